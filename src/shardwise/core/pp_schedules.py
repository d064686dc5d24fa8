"""The pipeline schedules shardwise runs, as data: one owner for their names, constraints and placement.

Torch-free (config validation, the layout and the planner read it); ``parallel/pipeline/pp.py`` maps a name
to its ``torch.distributed.pipelining`` class. Every rule a schedule imposes on the layout lives
here, and ``check_schedule`` raises one ConfigError naming it, before any rank starts:

* stages per rank (``parallel.pp_stages_per_rank``): GPipe and 1F1B run one; the interleaved and
  looped ones run two or more; the V-shaped ones (ZBV, DualPipeV) exactly two;
* stage placement: "loop" (rank r holds stages r, r + p, r + 2p, ...) or "v" (rank r holds stages
  r and 2p - 1 - r, so rank 0 holds the first and the last stage: the V-shaped schedules need it);
* micro-batch count (``parallel.pp_microbatches``): at least the pipeline degree everywhere; the
  interleaved ones take whole rounds (a multiple of p); DualPipeV at least as many as stages;
* ``train.compile``: torch cannot compile the split input/weight backward of the zero-bubble ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.errors import ConfigError, unknown_choice

__all__ = ["PP_SCHEDULES", "SCHEDULES", "ScheduleInfo", "check_schedule", "cross_rank_receives",
           "p2p_messages_per_step", "peak_in_flight", "peak_weight_passes_due", "schedule_info", "stage_ids_of",
           "stages_in_backward",
           "stage_rank", "tied_weights_refusal", "waited_transfers"]


@dataclass(frozen=True)
class ScheduleInfo:
    """What one schedule is and needs. ``stages_per_rank``: "one", "many" (>= 2) or "two"."""

    name: str
    torch_class: str  # in torch.distributed.pipelining
    stages_per_rank: str
    placement: str  # "loop" or "v"
    zero_bubble: bool  # splits the backward into input- and weight-gradient passes
    description: str

    @property
    def multi_stage(self) -> bool:
        return self.stages_per_rank != "one"


_TABLE = (
    ScheduleInfo("gpipe", "ScheduleGPipe", "one", "loop", False,
                 "all forwards, then all backwards (activations of every micro-batch held)"),
    ScheduleInfo("1f1b", "Schedule1F1B", "one", "loop", False,
                 "one forward, one backward in steady state (at most p micro-batches of activations)"),
    ScheduleInfo("interleaved-1f1b", "ScheduleInterleaved1F1B", "many", "loop", False,
                 "1F1B over v stages per rank (Megatron interleaving): bubble shrinks v times"),
    ScheduleInfo("looped-bfs", "ScheduleLoopedBFS", "many", "loop", False,
                 "breadth-first over v stages per rank: all micro-batches through a stage before the next"),
    ScheduleInfo("interleaved-zb", "ScheduleInterleavedZeroBubble", "many", "loop", True,
                 "interleaved 1F1B with the weight-gradient pass deferred into the bubble (ZB-H1 style)"),
    ScheduleInfo("zbv", "ScheduleZBVZeroBubble", "two", "v", True,
                 "zero-bubble V schedule: two stages per rank in a V, weight gradients fill the bubble"),
    ScheduleInfo("dualpipev", "ScheduleDualPipeV", "two", "v", True,
                 "DeepSeek's DualPipe on a V placement: overlaps one micro-batch's forward with another's backward"),
)
SCHEDULES: dict[str, ScheduleInfo] = {s.name: s for s in _TABLE}
PP_SCHEDULES: tuple[str, ...] = tuple(SCHEDULES)


def schedule_info(name: str) -> ScheduleInfo:
    """The entry of ``name``; ConfigError listing the valid names otherwise."""
    if name not in SCHEDULES:
        raise unknown_choice("pipeline schedule", name, PP_SCHEDULES)
    return SCHEDULES[name]


def stage_ids_of(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stage indices ``pp_rank`` runs under ``schedule`` (loop or V placement)."""
    if SCHEDULES.get(schedule, SCHEDULES["1f1b"]).placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def stage_rank(schedule: str, stage: int, pp: int, stages_per_rank: int) -> int:
    """The pipeline rank that runs ``stage``."""
    return next(r for r in range(pp) if stage in stage_ids_of(schedule, r, pp, stages_per_rank))


def peak_in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int) -> int:
    """The most stage-microbatches whose activations pipeline rank ``pp_rank`` holds at once in one
    schedule step: forwarded through one of its stages, that stage's backward (input and weight
    gradients) not finished. One stage-microbatch is one stage's activations of one microbatch (1 / v
    of the rank's layers, v = stages per rank).

    Counted on the action order torch runs (``tests/test_pp.py`` replays torch's orders for p 2..4
    and several m and v): GPipe forwards all m microbatches first; 1F1B's stage r does min(m, p - r)
    warm-up forwards; interleaved 1F1B's rank r (v - 1) p + 2 (p - 1 - r) warm-up forwards and one
    more in steady state; looped BFS runs every microbatch through a stage before the next, v m; the
    interleaved zero-bubble order holds one round (v p) until the deferred weight gradients; ZBV's
    rank r m + 1 + r, at most both stages' p each; DualPipeV 2p + 1.
    """
    m, v, r = microbatches, stages_per_rank, pp_rank
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - r)
    if schedule == "looped-bfs":
        return v * m
    if schedule == "interleaved-1f1b":
        return min(v * m, (v - 1) * pp + 2 * (pp - 1 - r) + 1)
    if schedule == "interleaved-zb":
        return min(v * m, v * pp)
    if schedule == "zbv":
        return min(2 * pp, m + 1 + r)
    if schedule == "dualpipev":
        return min(2 * m, 2 * pp + 1)
    raise unknown_choice("pipeline schedule", schedule, PP_SCHEDULES)


def peak_weight_passes_due(schedule: str, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int) -> int:
    """The most stage-microbatches of pipeline rank ``pp_rank`` whose input-gradient pass has begun
    and whose deferred weight-gradient pass has not run (0 for a schedule that does not split its
    backward): each keeps the gradients of its weight ops' outputs until then (torch's
    ``stage_backward_input`` hands them to ``stage_backward_weight``).

    Counted on torch's action orders (``tests/test_pp.py``): the interleaved zero-bubble order and
    DualPipeV r + 1; ZBV 2r + 1 once m >= 2p, 1 at m = p; between the two ZBV's order is irregular
    (p 4, m 5: 1, 2, 2, 3) and 2r + 1 is its upper bound.
    """
    if not schedule_info(schedule).zero_bubble:
        return 0
    if schedule == "zbv":
        return 1 if microbatches <= pp else 2 * pp_rank + 1
    return pp_rank + 1


def stages_in_backward(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> int:
    """The most of a rank's stages whose backwards have begun and not all ended at once: each holds its
    unsharded parameters and accumulated gradients from its first backward until torch's multi-stage
    runtime reshards it and reduces its gradients right after its last one (``RESHARD``,
    ``REDUCE_GRAD``). Looped BFS runs every backward of one stage before the next stage's; so does
    interleaved 1F1B in a single round (m = p). Every other order is taken to hold all of the
    rank's stages (interleaved 1F1B at m > p alternates them; the zero-bubble and V-shaped orders
    are not counted here). Checked against torch's orders in ``tests/test_pp.py``."""
    if schedule == "looped-bfs" or schedule == "interleaved-1f1b" and microbatches == pp:
        return 1
    return stages_per_rank


def cross_rank_receives(schedule: str, pp: int, stages_per_rank: int, pp_rank: int) -> int:
    """How many (stage, direction) pairs of ``pp_rank`` receive from another rank: a stage's input
    activations from the previous stage and its output gradients from the next, when that stage
    runs elsewhere. torch (2.13) allocates one receive buffer per microbatch of a step for each
    (``PipelineStage._setup_forward_recv_info``, ``_create_grad_recv_info``), kept for the run; a
    neighbour on the same rank (the V placement's turn) hands its tensors over directly."""
    n_stages = pp * stages_per_rank
    count = 0
    for stage in stage_ids_of(schedule, pp_rank, pp, stages_per_rank):
        for neighbour in (stage - 1, stage + 1):
            if 0 <= neighbour < n_stages and stage_rank(schedule, neighbour, pp, stages_per_rank) != pp_rank:
                count += 1
    return count


def p2p_messages_per_step(schedule: str, pp: int, stages_per_rank: int, microbatches: int, pp_rank: int) -> int:
    """Point-to-point messages pipeline rank ``pp_rank`` sends in one schedule step of ``microbatches``
    micro-batches, and as many it receives. Each stage boundary the rank holds that joins another rank
    carries one micro-batch's activations forward and their gradient back, so every (stage, direction)
    pair that receives (``cross_rank_receives``) also sends once per micro-batch: 1F1B's end ranks one
    boundary, its middle ranks two; a loop-placed rank with v stages 2v (2v - 1 on the first and the
    last rank); a V-placed rank 4, its ends 2 (rank 0 holds the chain's two ends, rank p - 1 hands the
    turn of the V over on the rank). Equal to the SEND and RECV actions of torch's orders
    (``tests/test_pp.py``) and to the rehearsal's p2p counter (``tests/test_rehearse.py``)."""
    return cross_rank_receives(schedule, pp, stages_per_rank, pp_rank) * microbatches


def waited_transfers(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> int:
    """How many of a step's point-to-point transfers the pipeline waits on one after another, when each
    takes less than the compute between the actions it joins: the step time's exposed part (the rest
    runs while a rank computes). From how torch runs each schedule:

    * GPipe and 1F1B: all of the busiest rank's messages (``p2p_messages_per_step``). Their loop
      (``PipelineScheduleSingle``) posts a receive right before the compute that needs it and waits at
      once, and 1F1B's order has no slack to hide one anyway.
    * The other multi-stage schedules (``_PipelineScheduleRuntime``) post each receive as soon as the
      sender's compute is scheduled (``_add_send_recv``) and wait only before the compute that consumes
      it, sends never block: only the fill and the drain wait, the first micro-batch's forward crossing
      each stage boundary that joins two ranks in turn and the last one's backward crossing them back.
      Looped BFS runs every micro-batch through a stage before the next, so only its first loop's
      p - 1 boundaries; the V placement's turn (stages p - 1 and p on one rank) is no transfer.
    * DualPipeV: its steady state pairs one micro-batch's forward with another's backward, and that
      backward takes the gradient its neighbour's pair has just produced: every gradient message is
      waited on (half of the busiest rank's), the activations hide.

    ``benchmarks/pp_bubble.py``'s replay with a transfer time on every cross-rank input measures these:
    exactly for interleaved 1F1B and looped BFS, within a quarter for the others
    (``tests/test_pp.py``)."""
    busiest = max(p2p_messages_per_step(schedule, pp, stages_per_rank, microbatches, r) for r in range(pp))
    if not schedule_info(schedule).multi_stage:
        return busiest
    if schedule == "dualpipev":
        return busiest // 2
    if schedule == "looped-bfs":
        return 2 * (pp - 1)
    return 2 * sum(stage_rank(schedule, s, pp, stages_per_rank) != stage_rank(schedule, s + 1, pp, stages_per_rank)
                   for s in range(pp * stages_per_rank - 1))


def check_schedule(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """Raise ConfigError naming the broken rule when ``schedule`` cannot run this layout."""
    info = schedule_info(schedule)
    v, m = stages_per_rank, microbatches
    key = f"parallel.pp_schedule='{schedule}'"
    if info.stages_per_rank == "one" and v != 1:
        multi = ", ".join(s.name for s in _TABLE if s.multi_stage)
        raise ConfigError(f"parallel.pp_stages_per_rank={v} needs a schedule that runs several stages per "
                          f"rank ({multi}); {key} runs one stage per rank.")
    if info.stages_per_rank == "many" and v < 2:
        raise ConfigError(
            f"{key} needs parallel.pp_stages_per_rank >= 2 (it interleaves several stages per rank to "
            "shrink the bubble); set it to 2, or use '1f1b'.")
    if info.stages_per_rank == "two" and v != 2:
        raise ConfigError(
            f"{key} needs parallel.pp_stages_per_rank = 2 exactly: it places two stages per rank in a V "
            f"(rank r runs stages r and 2p-1-r); got {v}.")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"parallel.pp_microbatches must be a positive integer, got {m!r}.")
    if m < pp:
        raise ConfigError(
            f"parallel.pp_microbatches={m} must be >= the pipeline degree {pp}: with fewer "
            "microbatches than stages some stage always idles, the bubble (p-1)/(m+p-1) exceeds "
            "half the step, and the 1F1B schedules cannot even fill the pipeline. Use at least "
            f"{pp} (2 x {pp} or more keeps the bubble small).")
    if schedule in ("interleaved-1f1b", "interleaved-zb") and m % pp:
        raise ConfigError(
            f"parallel.pp_microbatches={m} must be a multiple of the pipeline degree {pp} for "
            f"'{schedule}' (microbatches go round the ranks in full rounds).")
    if schedule == "dualpipev" and m < 2 * pp:
        raise ConfigError(
            f"parallel.pp_microbatches={m} is too few for 'dualpipev': it needs at least as many "
            f"micro-batches as stages (2 x pp = {2 * pp}).")


def _splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` is a known zero-bubble one (input- and weight-gradient passes apart)."""
    info = SCHEDULES.get(schedule)
    return info is not None and info.zero_bubble


def recompute_passes(schedule: str) -> int:
    """How many times a checkpointed block's forward runs again per micro-batch: once per backward
    pass that reads its tensors. Twice under the zero-bubble schedules, whose input-gradient pass and
    deferred weight-gradient pass are separate autograd calls (torch's non-reentrant checkpoint
    recomputes once per call; the weight pass's own calls, one per parameter group, share one:
    ``parallel/pipeline/pp._recompute_once``); once otherwise."""
    return 2 if _splits_backward(schedule) else 1


def ep_refusal(schedule: str) -> str | None:
    """Why expert parallel (``parallel.ep > 1``) cannot run under ``schedule`` (None when it can)."""
    if _splits_backward(schedule):
        return (f"expert parallel (parallel.ep > 1) does not train correctly under the zero-bubble pipeline "
                f"schedule {schedule!r} yet: its split backward (input-gradient pass, then a deferred "
                "weight-gradient pass) gives the experts, whose tokens travel by all-to-all, other "
                "gradients than one process (2.7e-2 on the weights after 5 steps, aux losses off too). "
                "Use '1f1b', 'gpipe', 'interleaved-1f1b' or 'looped-bfs' with ep, or set parallel.ep = 1")
    return None


def ddp_refusal(schedule: str) -> str | None:
    """Why DDP-replicated stages (``ddp+pp`` with several data-parallel ranks) cannot run under
    ``schedule`` (None when they can)."""
    if _splits_backward(schedule):
        return (f"the zero-bubble pipeline schedule {schedule!r} does not train correctly under ddp+pp with "
                "several data-parallel ranks: torch arms DDP's reducer for the last input-gradient pass and "
                "the deferred weight-gradient passes make the weights' gradients after it, so the replicas "
                "drift apart (shardwise verify: 1.8e-2 on the weights after 3 steps, torch 2.13). Use fsdp+pp "
                "(or fsdp+tp+pp), or '1f1b', 'gpipe', 'interleaved-1f1b' or 'looped-bfs' with ddp+pp")
    return None


def checkpoint_refusal(schedule: str, mode: str) -> str | None:
    """Why activation checkpointing ``mode`` cannot run under ``schedule`` (None when it can)."""
    if mode == "selective-op" and _splits_backward(schedule):
        return (f"activation_checkpointing = 'selective-op' cannot run under the zero-bubble pipeline schedule "
                f"{schedule!r}: torch's per-op selective checkpointing allows one backward per checkpointed "
                "region, and this schedule runs two (an input-gradient pass, then a deferred weight-gradient "
                "pass; torch raises 'Trying to backward an extra time' at the first weight pass). Use 'full' or "
                "'selective' (whole blocks) with it, or 'selective-op' under '1f1b', 'gpipe', 'interleaved-1f1b' "
                "or 'looped-bfs'")
    return None


def compile_refusal(schedule: str) -> str | None:
    """Why ``train.compile`` cannot run under ``schedule`` (None when it can)."""
    if _splits_backward(schedule):
        return (f"the zero-bubble pipeline schedule {schedule!r} splits each backward into input- and "
                "weight-gradient passes, which torch.compile does not support in this PyTorch; use "
                "'1f1b' or 'interleaved-1f1b' to compile, or set train.compile = false")
    return None


def tied_weights_refusal(layout: Any) -> str:
    """Why a model whose output head is tied to its input embedding cannot run on ``layout`` ('' when it
    can): the one rule, asked by the runtime (``parallel/pipeline/ties.py``) and the planner.

    The pipeline keeps one copy of the tied tensor on the first and one on the last stage, their
    gradients summed. When one rank runs both stages (the V placement) the tie stays one tensor
    there, which is exact unless a data-parallel wrapper takes each stage as its own unit: FSDP2
    (applied even at dp = 1) and DDP at dp > 1 would each reduce or shard that tensor once more.
    """
    if layout.pp <= 1:
        return ""
    first = stage_rank(layout.pp_schedule, 0, layout.pp, layout.pp_stages_per_rank)
    last = stage_rank(layout.pp_schedule, layout.n_stages - 1, layout.pp, layout.pp_stages_per_rank)
    if first != last or not (layout.info.dp_kind == "fsdp" or layout.dp > 1):
        return ""
    return (f"parallel.pp_schedule='{layout.pp_schedule}' puts the first and the last pipeline stage on one rank, "
            f"and the model ties its output head to its input embedding: {layout.strategy} wraps each stage in "
            "its own data-parallel unit, which would reduce (or shard) the one tied tensor twice. Use a "
            "loop-placed schedule (1f1b, gpipe, interleaved-1f1b, interleaved-zb), plain pp, or untie the "
            "weights (tie_word_embeddings = false)")
