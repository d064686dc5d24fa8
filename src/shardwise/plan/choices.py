"""What the planner's search may vary: THE list of degree sets and the settings tried per layout.

Torch-free and below ``advice`` (which builds a candidate from one choice) and ``search`` (which
ranks them): both ask here, so neither imports the other back.

* :func:`degree_sets` — the model-parallel degree combinations (``tp``, ``pp``, context parallel
  ``cp`` for long sequences, expert parallel ``ep`` for mixture-of-experts models; other
  dimensions append their axis here).
* :data:`SEARCHABLE` — the runtime settings searched per layout when the user does not fix them.
* :data:`FALLBACKS` — settings tried only when nothing fits (the optimizer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.core.families import CP_FAMILIES
from shardwise.core.layout import ep_candidates
from shardwise.core.pp_schedules import schedule_info
from shardwise.plan.cp import cp_candidates, cp_impl_for, cp_multiple
from shardwise.plan.memory import CHECKPOINT_MODES, GRAD_SYNC_MODES
from shardwise.plan.pipeline import pipeline_degrees

if TYPE_CHECKING:
    from shardwise.plan.advice import Cluster, Workload
    from shardwise.plan.spec import ModelSpec

# Settings the planner searches per layout unless the user fixes them (Workload.search).
SEARCHABLE = ("checkpoint", "micro_batch", "grad_sync", "pp_stages_per_rank", "pp_first_stage_fewer")
FALLBACKS = ("optimizer",)
FALLBACK_OPTIMIZER = "adafactor"  # no first moment, factored second: ~0 B/param of state against AdamW's 8
# Order = fewer moving parts first (ties between equally fast, equally small settings).
CHECKPOINT_SEARCH = ("none", "selective", "selective-op", "moe", "full")
MAX_SEARCHED_MICRO_BATCH = 16
STAGES_PER_RANK_SEARCH = (2, 3, 4, 6, 8)
# parallel.pp_first_stage_fewer tried per pipeline layout: the even split, and the embedding and the
# head a block's place each (Megatron's --account-for-embedding/loss-in-pipeline-split).
FIRST_STAGE_FEWER_SEARCH = (0, 1)

assert set(CHECKPOINT_SEARCH) == set(CHECKPOINT_MODES)


def degree_sets(spec: ModelSpec, cluster: Cluster, *, tp: int | None = None, pp: int | None = None, tp_ok=None,
                cp: int | None = None, ep: int | None = None, seq: int = 0,
                cp_impl: str = "auto") -> list[dict[str, int]]:
    """Every model-parallel degree combination the planner considers: THE list of candidate sets.

    TP stays inside a node (a divisor of gpus_per_node that ``tp_ok`` accepts: it divides the
    heads and widths); PP spans nodes (one stage group per node). ``tp x pp`` must divide the world;
    data parallelism takes the rest, and context / expert parallel are carved out of it (the
    runtime's layout: cp ranks are a factor of dp, ep ranks are borrowed from the FSDP shard ranks):

    * ``cp``: for a long ``seq`` (plan/cp.py ``cp_candidates``: from ``LONG_SEQ`` tokens, degrees
      dividing dp and the sequence that ``cp_impl`` can run: the all-to-all needs the heads per TP
      rank divisible by cp, ``auto`` takes the ring where it does not). The runtime runs cp beside a pipeline,
      and a pinned ``--cp`` is tried with every pp degree; the open search tries cp only at pp = 1
      (crossing both axes multiplies the layouts about ninefold for a long-sequence 70B plan).
    * ``ep``: for a mixture-of-experts model (core/layout.py ``ep_candidates``: divisors of
      dp_shard x cp -- the whole data dimension world / (tp x pp) for fsdp -- that divide the expert
      count, so an expert group may span cp ranks, torchtitan's ep over dp_shard x cp); which
      strategies run it (and hsdp's smaller shard groups) the layout decides as each is resolved.

    A pinned degree (``--tp``, ``--pp``, ``--cp``, ``--ep``) is the only value of its axis.
    """
    g, world = cluster.gpus_per_node, cluster.world
    tps = [tp] if tp else [1, *(t for t in range(2, g + 1) if g % t == 0 and (tp_ok is None or tp_ok(t)))]
    # PP degrees: every node-count divisor (plan/pipeline.py), so a 3-D layout can keep dp > 1.
    pps = [pp] if pp else [1, *pipeline_degrees(spec.n_layers, cluster.nodes)]
    moe = getattr(spec, "moe", None)
    sets = []
    for p in pps:
        for t in tps:
            if world % (t * p):
                continue
            dp = world // (t * p)
            # Only the families whose attention context parallel knows (families.CP_FAMILIES; a model
            # of unknown family, e.g. a bare parameter count, is planned as if it were one).
            cp_ok = not spec.family or spec.family in CP_FAMILIES
            if cp:
                impl = cp_impl_for(cp_impl, spec.n_heads, t, cp)
                runs = bool(impl) and (not seq or seq % cp_multiple(cp, impl) == 0)
                cps = [cp] if cp_ok and dp % cp == 0 and runs else []
            else:
                cps = cp_candidates(dp * t, seq, spec.n_heads, tp=t, impl=cp_impl) if p == 1 and cp_ok else [1]
            eps = [ep] if ep else (ep_candidates(dp, moe.n_experts) if moe is not None and p == 1 else [1])
            sets += [{"tp": t, "pp": p, "cp": c, "ep": e} for c in cps for e in eps]
    return sets


# ------------------------------------------------------------------------------------- settings
def micro_batch_choices(work: Workload, cluster: Cluster) -> tuple[int | None, list[int]]:
    """(the global batch the search holds fixed, the micro-batches to try).

    The global batch (sequences per optimizer step) is what the user's optimisation depends on,
    so the search never changes it: it trades micro-batch size against gradient-accumulation
    steps. Unset, it is one sequence per GPU (``--micro-batch`` fixed: that many per GPU).
    With ``--grad-accum`` fixed the micro-batch is not searched (it would change the batch).
    """
    if "micro_batch" not in work.search or work.grad_accum is not None:
        return work.global_batch, [work.micro_batch]
    global_batch = work.global_batch or cluster.world
    choices, m = [], 1
    while m <= min(global_batch, MAX_SEARCHED_MICRO_BATCH):
        choices.append(m)
        m *= 2
    return global_batch, choices


def exact_micro_batch(micro_batch: int, dp: int, global_batch: int | None) -> bool:
    """Whether ``micro_batch`` splits the global batch over ``dp`` replicas exactly (1 always may)."""
    return micro_batch == 1 or global_batch is None or global_batch % (micro_batch * dp) == 0


def checkpoint_choices(work: Workload, spec: ModelSpec | None = None) -> tuple[str, ...]:
    """The checkpointing modes to try: the given one, or every mode that applies to ``spec``
    ("moe" only to a mixture of experts: it recomputes nothing in a dense model)."""
    if "checkpoint" not in work.search:
        return (work.checkpoint,)
    return tuple(m for m in CHECKPOINT_SEARCH if m != "moe" or spec is None or spec.moe is not None)


def grad_sync_choices(work: Workload, sharding: str, pp: int, grad_accum: int) -> tuple[str, ...]:
    """Gradient-sync modes worth trying: they differ only for sharded layouts under accumulation."""
    if "grad_sync" in work.search and sharding in ("zero2", "fsdp") and pp == 1 and grad_accum > 1:
        return GRAD_SYNC_MODES
    return (work.grad_sync,)


def stages_per_rank_choices(work: Workload) -> tuple[int, ...]:
    if schedule_info(work.pp_schedule).stages_per_rank == "many" and "pp_stages_per_rank" in work.search:
        return STAGES_PER_RANK_SEARCH
    return (work.pp_stages_per_rank,)


def first_stage_fewer_choices(work: Workload) -> tuple[int, ...]:
    """The end-stage lightening to try on a pipeline layout: the given one, or none and one block's
    worth (the planner's compute follows the busiest rank, whose head it can then even out)."""
    if work.kernels.pp_split != "layers":  # the stack balances its stages itself (Kernels.pp_split)
        return (0,)
    return FIRST_STAGE_FEWER_SEARCH if "pp_first_stage_fewer" in work.search else (work.pp_first_stage_fewer,)
