"""Pipeline bubble per schedule: the planner's model of how long each pipeline rank idles.

Units: one rank's forward + backward of one micro-batch through all its layers is 1 (``work`` per
step = m micro-batches). The idle time of a step, relative to that work (``idle_ratio``), is:

* GPipe and 1F1B: (p - 1) / m -- the pipeline fills and drains once, one full micro-batch slot per
  stage boundary; as a share of the step, (p - 1) / (m + p - 1).
* Interleaved 1F1B and looped BFS with v stages per rank: a fill/drain slot is one stage's share,
  1 / v of a rank's layers, so (p - 1) / (v m) (Megatron-LM's interleaved schedule; breadth-first
  has the same fill and drain, with more activations held).
* Zero-bubble schedules (interleaved-zb, zbv, dualpipev): the weight-gradient pass W (about a third
  of forward + backward, with backward = 2 x forward) is deferred into the slots 1F1B leaves idle,
  so only the forward/input-gradient part of the fill and drain remains: (p - 1) / (3 v m)
  (ZB-H1's 1/3 of 1F1B's bubble, divided by v for interleaving).
* DualPipeV: twice that, 2 (p - 1) / (3 v m). Its order pairs one micro-batch's forward with
  another's backward (``OVERLAP_F_B``) for a runtime that overlaps the two; torch runs the pair one
  after the other unless a custom overlap function is registered (shardwise registers none), and
  that order then idles twice as long as ZBV's.

Each formula is the idle time of the action order torch's schedule runs, with the costs above
(F = 1, B = 2, I = W = 1) and free communication: ``benchmarks/pp_bubble.py --simulate`` replays
torch's orders and prints both (equal for every schedule, p in 2..8, several m and v;
``tests/test_pp.py`` checks a few). ``benchmarks/pp_bubble.py`` also measures real runs.
"""

from __future__ import annotations

from shardwise.core.pp_schedules import schedule_info

__all__ = ["bubble_fraction", "idle_ratio", "pipeline_degrees"]


def idle_ratio(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle time of a pipeline step over its compute time (0 without a pipeline)."""
    if pp <= 1:
        return 0.0
    info = schedule_info(schedule)
    v = max(1, stages_per_rank) if info.multi_stage else 1
    ratio = (pp - 1) / (v * max(1, microbatches))
    if not info.zero_bubble:
        return ratio
    # DualPipeV's overlapped F;B pairs run back to back in torch (see the module docstring).
    return ratio * 2 / 3 if schedule == "dualpipev" else ratio / 3


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Share of a pipeline step each rank idles: idle / (idle + compute)."""
    r = idle_ratio(schedule, pp, microbatches, stages_per_rank)
    return r / (1 + r)


def pipeline_degrees(n_layers: int | None, nodes: int) -> list[int]:
    """Pipeline degrees worth planning on ``nodes`` nodes: every divisor of the node count above 1 (a
    stage group spans whole nodes, so PP's point-to-point traffic crosses the slow links, never TP's)
    that leaves each stage at least one layer. 405B on 64 nodes: 2, 4, 8, 16, 32, 64 -- torchtitan's
    published 3-D layout (FSDP 8 x TP 8 x PP 8) among them.
    """
    limit = n_layers or 0
    return [d for d in range(2, nodes + 1) if nodes % d == 0 and d <= limit]
