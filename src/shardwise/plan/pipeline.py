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

import dataclasses
from typing import TYPE_CHECKING

from shardwise.core.pp_schedules import schedule_info
from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.core.layout import Layout
    from shardwise.plan.spec import ModelSpec

__all__ = ["bubble_fraction", "cost_balanced_stage_layers", "idle_ratio", "pipeline_degrees", "with_stack_split"]


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


def cost_balanced_stage_layers(spec: ModelSpec, n_stages: int) -> tuple[int, ...]:
    """The blocks of each of ``n_stages`` stages under nanotron's split (``Kernels.pp_split = "cost"``).

    nanotron (``models/base.py`` build_model, ``get_block_compute_costs`` of its Llama and Qwen2)
    walks its pipeline blocks in order -- the embedding (cost 0), the decoder layers (4 h (heads x
    head_dim) + 3 h ffn each), the final norm (0), the head (V h), the loss (0) -- and gives each to
    the current stage, moving on once the running total passes that stage's share of the whole
    (k+1)/n: the stage that crosses its share keeps the block that crossed it. The head therefore
    lands on the last stage, which gets fewer decoder layers.
    """
    h, heads, ffn, vocab, n = spec.hidden, spec.n_heads, spec.ffn_hidden, spec.vocab, spec.n_layers
    if not (h and heads and ffn and vocab and n):
        raise ConfigError(f"the cost-balanced pipeline split (pp_split=cost) needs {spec.name}'s shape "
                          "(layers, hidden, heads, ffn, vocabulary); it is not known.")
    block = 4 * heads * (h // heads) * h + 3 * ffn * h
    costs = [0] + [block] * n + [0, vocab * h]  # embedding, layers, final norm, head (the loss costs 0)
    total = sum(costs)
    shares = [total * (k + 1) / n_stages for k in range(n_stages)]
    sizes, stage, running = [0] * n_stages, 0, 0
    for i, cost in enumerate(costs):
        if 1 <= i <= n:
            sizes[stage] += 1
        running += cost
        if i == len(costs) - 1:
            break  # the head's stage is the output stage
        if running > shares[stage]:
            stage += 1
    if stage != n_stages - 1 or any(k < 1 for k in sizes[1:-1]):
        raise ConfigError(f"the cost-balanced pipeline split (pp_split=cost) of {spec.name}'s {n} layers into "
                          f"{n_stages} stages leaves a stage without work ({list(sizes)} layers, the head on "
                          f"stage {stage}); use fewer stages or pp_split=layers.")
    return tuple(sizes)


def with_stack_split(spec: ModelSpec, layout: Layout, pp_split: str) -> Layout:
    """``layout`` with the stage split of the stack's ``pp_split`` (``Kernels.pp_split``): unchanged for
    "layers" (the runtime's rule) or without a pipeline; nanotron's cost-balanced split for "cost"."""
    if pp_split != "cost" or layout.pp == 1:
        return layout
    return dataclasses.replace(layout, stage_layers=cost_balanced_stage_layers(spec, layout.n_stages))
