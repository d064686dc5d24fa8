"""The planner's search: every layout x every runtime setting the user left open, ranked, explained.

Two lists own what the planner explores (both in ``plan/choices.py``, which ``advice`` also asks),
so a new dimension plugs into one place:

* :func:`degree_sets` — the model-parallel degree combinations (``tp``, ``pp``, context parallel
  ``cp`` for long sequences, expert parallel ``ep`` for mixture-of-experts models; other
  dimensions append their axis here). Data parallelism takes
  whatever the degrees leave of the world; the strategy registry then names the strategies that
  run each set (``advice.candidate_layouts``).
* :data:`SEARCHABLE` — the runtime settings searched per layout when the user does not fix them
  (activation checkpointing, micro-batch, gradient-sync mode, stages per rank of an interleaved
  pipeline). What the user fixes stays fixed: ``Workload.search`` names only the open ones.
* :data:`FALLBACKS` — settings tried only when nothing fits: the optimizer (when the user named
  none, AdamW's two fp32 moments give way to Adafactor's factored state, ``FALLBACK_OPTIMIZER``,
  before the offload row; the plan says that this changes the optimizer).

Ranking (:func:`rank_key`, :func:`tier`): among the *usable* layouts -- those that fit the budget
and those ``tight`` (over the budget, within the device) that still leave the runtime reserve free
-- the highest tokens/s/GPU wins; an offload layout joins them only within OFFLOAD_FACTOR of the
fastest on-GPU layout or where it is the only way; then the tight ones without that headroom, the
slower offload ones, and last those that do ``no``t fit. Ties (equal as printed) go to less memory
(as printed), then to fewer moving parts (model-parallel degrees, non-default settings, the
registry's order). Every
"not X" reason is built from the same printed numbers the table shows (:func:`reason`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from shardwise.core.pp_schedules import checkpoint_refusal
from shardwise.core.strategies import REGISTRY
from shardwise.errors import ConfigError
from shardwise.optim.rules import DEVICE_STATE_OPTIMIZERS
from shardwise.plan.advice import (
    RUNTIME_RESERVE_GIB,
    Plan,
    candidate_layouts,
    evaluate,
    launch_commands,
    layout_key,
    layout_label,
    replicas,
)
from shardwise.plan.choices import (
    CHECKPOINT_SEARCH,
    FALLBACK_OPTIMIZER,
    SEARCHABLE,
    checkpoint_choices,
    exact_micro_batch,
    grad_sync_choices,
    micro_batch_choices,
)
from shardwise.plan.offload import offload_advice
from shardwise.plan.presets import ceiling

if TYPE_CHECKING:
    from shardwise.core.layout import Layout
    from shardwise.plan.advice import Candidate, Cluster, Plan, Workload
    from shardwise.plan.cost import Calibration
    from shardwise.plan.spec import ModelSpec

GIB = 1024**3

VERDICTS = ("fits", "tight", "no")


# -------------------------------------------------------------------------------------- ranking

def runtime_refusal(layout: Layout) -> str:
    """Why shardwise's runtime refuses a layout planned under another stack's rules ('' when it runs
    it): that stack's ZeRO-1 group (Kernels.zero1_group), its stage split (Kernels.pp_split), or its
    expert groups (the layout rebuilt with the runtime's rule, "dp-shard", so Layout._check_ep stays
    the one owner)."""
    if layout.zero1_group:
        return (f"it shards ZeRO-1's optimizer state within groups of {layout.zero1_group} data-parallel ranks (the "
                "stack's zero1_group), and train's ZeRO-1 shards it over all of them.")
    if layout.stage_layers:
        return (f"its pipeline stages hold {list(layout.stage_layers)} blocks (the stack's cost-balanced split, "
                "pp_split=cost), and train splits them by block count (parallel.pp_first_stage_fewer).")
    if layout.ep_groups == "dp-shard":
        return ""
    try:
        dataclasses.replace(layout, ep_groups="dp-shard")
    except ConfigError as e:
        return str(e)
    return ""

def gib(nbytes: float) -> str:
    """Bytes as the table prints them (GiB, 2 decimals)."""
    return f"{nbytes / GIB:.2f}"


def device_gib(memory_gib: float) -> str:
    """A device's memory as the reasons print it (58.7, 80)."""
    return f"{memory_gib:.1f}".removesuffix(".0")


def tps(value: float) -> str:
    """Tokens/s/GPU as the table prints them."""
    return f"{value:,.0f}"


def _printed(c: Candidate) -> tuple[float, float]:
    return float(tps(c.time.tokens_per_s_per_gpu).replace(",", "")), float(gib(c.memory.total))


def moving_parts(c: Candidate) -> int:
    """How many things a run has to get right beyond plain data parallelism."""
    lay = c.layout
    return (sum(d > 1 for d in (lay.tp, lay.pp, lay.cp, lay.ep)) + int(lay.info.hybrid) + int(bool(lay.offload))
            + int(c.checkpoint != "none") + int(c.grad_sync != "step") + int(lay.pp_stages_per_rank > 1)
            + int(lay.pp_first_stage_fewer > 0))


# The ranking rule (what a practitioner picks):
# * A layout is *usable* if it fits the budget, or is tight with at least TIGHT_HEADROOM_GIB of the
#   device left: the runtime reserve (CUDA context, NCCL and cuBLAS workspaces) still fits beside
#   the predicted peak; only the safety margin is waived. Usable layouts rank by speed alone.
# * An offload layout (state in host RAM) ranks with them only when it is within OFFLOAD_FACTOR of
#   the fastest layout that keeps its state on the GPUs and is within the device's memory, or when
#   no such layout exists (offload is the only way). Otherwise it comes after every such layout.
TIGHT_HEADROOM_GIB = RUNTIME_RESERVE_GIB  # the reserve the budget takes off the device (plan.advice)
OFFLOAD_FACTOR = 2.0  # an offload layout at most 2x slower than the fastest on-GPU one may be picked


def usable(c: Candidate) -> bool:
    """Fits, or is tight with the runtime reserve still free (TIGHT_HEADROOM_GIB)."""
    return c.verdict == "fits" or (c.verdict == "tight" and c.headroom_bytes >= TIGHT_HEADROOM_GIB * GIB)


def on_gpu_speed(cands: Iterable[Candidate]) -> float | None:
    """Tokens/s/GPU of the fastest layout that keeps its state on the GPUs and is within the
    device's memory (None: no such layout; offload is then the only way)."""
    speeds = [c.time.tokens_per_s_per_gpu for c in cands if not c.layout.offload and c.verdict != "no"]
    return max(speeds) if speeds else None


def tier(c: Candidate, gpu_speed: float | None = None) -> int:
    """0 usable (an offload one only within OFFLOAD_FACTOR of ``gpu_speed``, or with none),
    1 tight without the headroom, 2 offload slower than that, 3 does not fit."""
    if c.verdict == "no":
        return 3
    if c.layout.offload and gpu_speed is not None and c.time.tokens_per_s_per_gpu * OFFLOAD_FACTOR < gpu_speed:
        return 2
    return 0 if usable(c) else 1


def rank_key(c: Candidate, order: dict[str, int], gpu_speed: float | None = None) -> tuple:
    """Sort key, best first: tier (``tier``); then speed and memory as printed; then simplicity."""
    speed, mem = _printed(c)
    simple = (moving_parts(c), order.get(c.layout.strategy, 99), CHECKPOINT_SEARCH.index(c.checkpoint),
              -c.micro_batch)
    t = tier(c, gpu_speed)
    if t == 3:
        return (3, mem, 0.0, simple)  # closest to fitting first
    return (t, -speed, mem, simple)


def describe(c: Candidate) -> str:
    """The settings a candidate runs with, as the reasons name them."""
    parts = [f"checkpointing {c.checkpoint}", f"micro-batch {c.micro_batch}"]
    if c.grad_sync != "step":
        parts.append(f"grad sync {c.grad_sync}")
    return ", ".join(parts)


def reason(c: Candidate, best: Candidate | None, cluster: Cluster, work: Workload) -> str:
    """Why ``c`` is not the recommendation, in the numbers the table prints for both."""

    device = device_gib(cluster.gpu.memory_gib)
    if c.verdict == "no":
        if not c.host_fits:
            return (f"does not fit: needs {c.memory.host_bytes / GIB:.0f} GiB of host RAM per node for offloaded "
                    f"state, has {cluster.host_ram_gib or cluster.gpu.host_ram_gib:.0f}")
        searched = " even at its smallest setting" if work.search else ""
        return (f"does not fit: needs {gib(c.memory.total)} GiB{searched}, more than the device's "
                f"{device} GiB")
    if c.verdict == "tight":
        state = (f"tight: needs {gib(c.memory.total)} GiB, over the {gib(c.budget_bytes)} GiB budget (after the "
                 f"{RUNTIME_RESERVE_GIB:.0f} GiB reserve and {work.safety_margin:.0%} margin) with "
                 f"{gib(c.headroom_bytes)} GiB left of the device's {device} GiB")
        if not usable(c):
            return state + f", under the {TIGHT_HEADROOM_GIB:.0f} GiB a tight layout must leave free"
    else:
        state = f"fits ({gib(c.memory.total)} GiB)"
    if best is None:
        return state
    speed, mem = _printed(c)
    best_speed, best_mem = _printed(best)
    if c.layout.offload and tier(c, best.time.tokens_per_s_per_gpu if not best.layout.offload else None) == 2:
        return (f"{state} but offloads its state to the host at {tps(c.time.tokens_per_s_per_gpu)} tokens/s/GPU, "
                f"more than {OFFLOAD_FACTOR:.0f}x slower than {tps(best.time.tokens_per_s_per_gpu)} on the GPUs")
    if speed < best_speed:
        return f"{state} but slower: {tps(c.time.tokens_per_s_per_gpu)} tokens/s/GPU vs " \
               f"{tps(best.time.tokens_per_s_per_gpu)}"
    if speed > best_speed:  # only a tight one can be faster than a fitting recommendation
        return state
    if mem > best_mem:
        return (f"{state}, as fast ({tps(c.time.tokens_per_s_per_gpu)} tokens/s/GPU) but needs more memory: "
                f"{gib(c.memory.total)} GiB vs {gib(best.memory.total)}")
    return (f"{state}, as fast ({tps(c.time.tokens_per_s_per_gpu)} tokens/s/GPU) and as small but more moving "
            f"parts: {moving_parts(c)} vs {moving_parts(best)}")


# --------------------------------------------------------------------------------------- search
def search(spec: ModelSpec, cluster: Cluster, work: Workload, *, tp: int | None = None, pp: int | None = None,
           calib: Calibration | None = None, cp: int | None = None,
           ep: int | None = None) -> tuple[list[Candidate], list[str]]:
    """One candidate per layout (its best settings), best first; and the layouts left out, with why."""
    order = {name: i for i, name in enumerate(REGISTRY)}
    global_batch, micro_batches = micro_batch_choices(work, cluster)
    groups: dict[tuple, list[Candidate]] = {}
    skipped: dict[str, str] = {}
    for mb in micro_batches:
        at_mb = dataclasses.replace(work, micro_batch=mb, global_batch=global_batch)
        layouts, left_out = candidate_layouts(spec, cluster, at_mb, tp, pp, cp, ep)
        if mb == micro_batches[0]:
            for line in left_out:
                skipped.setdefault(line.split(":", 1)[0], line)
        for lay in layouts:
            if not exact_micro_batch(mb, replicas(lay), global_batch):
                continue
            for ckpt in checkpoint_choices(work, spec):
                if lay.pp > 1 and (why := checkpoint_refusal(lay.pp_schedule, ckpt)):  # the runtime's rule
                    if "checkpoint" not in work.search:  # asked for: say why its pipeline layouts are left out
                        label = layout_label(lay.strategy, lay.tp, lay.pp, cp=lay.cp, ep=lay.ep)
                        skipped.setdefault(label, f"{label}: {why}")
                    continue
                at = dataclasses.replace(at_mb, checkpoint=ckpt)
                first = evaluate(spec, cluster, at, lay, calib)
                tried = [first]
                for sync in grad_sync_choices(work, lay.sharding, lay.pp, first.grad_accum):
                    if sync != first.grad_sync:
                        tried.append(evaluate(spec, cluster, at, lay, calib, grad_sync=sync))
                groups.setdefault(layout_key(lay), []).extend(tried)
    chosen = [min(cands, key=lambda c: rank_key(c, order)) for cands in groups.values()]
    for c in chosen:
        if c.grad_sync == "microbatch" and "grad_sync" in work.search:
            step = [o for o in groups[layout_key(c.layout)] if o.grad_sync == "step"
                    and (o.checkpoint, o.micro_batch) == (c.checkpoint, c.micro_batch)]
            if step:
                c.note = "; ".join(filter(None, [c.note, (
                    f"reduce-scatters every micro-batch: syncing once per step would hold the whole unsharded "
                    f"gradient ({gib(step[0].memory.total)} GiB in total)")]))
    gpu_speed = on_gpu_speed(chosen)
    chosen.sort(key=lambda c: rank_key(c, order, gpu_speed))
    offered = {c.name.split(" ", 1)[0] for c in chosen}
    left = [line for label, line in skipped.items() if not any(o.startswith(label) for o in offered)]
    return chosen, left


def make_plan(spec: ModelSpec, cluster: Cluster, work: Workload, *, tp: int | None = None, pp: int | None = None,
              calib: Calibration | None = None, cp: int | None = None, ep: int | None = None) -> Plan:
    """Search every layout and open setting; recommend the best fitting one (see module docstring)."""
    calib = calib or cluster.calibration
    warnings: list[str] = []
    if not calib.fitted_runs:
        warnings.append(f"no published training run calibrates {cluster.gpu.name}: step times use the default "
                        "constants (docs/planner.md lists the GPUs that are calibrated); memory is unaffected.")
    unmeasured = [op for op in ("matmul", "attention") if not ceiling(cluster.gpu, op, work.precision)[1]]
    if unmeasured:
        warnings.append(f"no published kernel measurement for {' or '.join(unmeasured)} on {cluster.gpu.name}: "
                        "its ceiling is the mean of the A100's and the H100's fractions of peak "
                        "(presets.UNMEASURED_CEILINGS, docs/planner.md); step times are an estimate.")
    if not spec.has_structure:
        warnings.append(f"{spec.name}: only a parameter count is known, so activations and the attention "
                        "FLOPs are not modelled (counted as 0). Pass --hf-config, a preset or "
                        "--layers/--hidden/--heads/--vocab for a complete answer.")
    if spec.max_seq and work.seq > spec.max_seq and spec.arch == "gpt" and spec.learned_positions:
        warnings.append(f"--seq {work.seq} exceeds {spec.name}'s {spec.max_seq} learned positions.")
    cands, skipped = search(spec, cluster, work, tp=tp, pp=pp, calib=calib, cp=cp, ep=ep)
    best = cands[0] if cands and cands[0].verdict != "no" else None  # ranked: search.rank_key
    # AdamW fits nowhere on the devices (nothing fits, or only with its state in host memory) and the
    # user named no optimizer: Adafactor's factored state, where that fits on the devices.
    if (cands and "optimizer" in work.search and work.optimizer == "adamw"
            and (best is None or best.layout.offload)):
        lighter = dataclasses.replace(work, optimizer=FALLBACK_OPTIMIZER,
                                      search=tuple(k for k in work.search if k != "optimizer"))
        alt = make_plan(spec, cluster, lighter, tp=tp, pp=pp, calib=calib, cp=cp, ep=ep)
        if alt.recommended is not None and not alt.recommended.layout.offload:
            on_gpu = [c.memory.total for c in cands if not c.layout.offload]
            least = f" (the smallest needs {gib(min(on_gpu))} GiB of the device's " \
                    f"{device_gib(cluster.gpu.memory_gib)} GiB)" if on_gpu else ""
            alt.warnings.insert(0, (
                f"AdamW does not fit on {cluster.gpu.name} at any on-device layout searched{least}: this plan is "
                f"for Adafactor (optimizer.name = {FALLBACK_OPTIMIZER}: factored second moments, no first moment; "
                "another optimizer than AdamW, with other dynamics). --optimizer adamw plans AdamW, with its "
                "state offloaded to host memory as its way to fit."))
            return alt
    if best is not None and best.verdict == "tight":
        warnings.append(
            f"{best.name} is recommended but tight (the fastest usable layout): "
            f"{gib(best.memory.total)} GiB of the device's {device_gib(cluster.gpu.memory_gib)} GiB "
            f"({gib(best.headroom_bytes)} GiB left). Published runs do run this close; expect to tune "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or add GPUs.")
    rejected = [f"{c.name}: {reason(c, best, cluster, work)}" for c in cands if c is not best]
    commands = launch_commands(best, cluster, work, run_name=spec.name) if best else []
    if best is not None and (why := runtime_refusal(best.layout)):
        # Planned under another stack's rules (runtime_refusal): train would refuse it.
        warnings.append(f"{best.name} is planned under the --stack's rules, which shardwise's train does not "
                        f"run: {why} No command printed.")
        commands = []
    offload: list = []
    if not cands and skipped:
        # Every layout of the degrees asked for is refused (the runtime cannot run them): say so;
        # an offload row would run other degrees than those asked for.
        warnings.append("no layout runs with the degrees asked for; the 'not offered' lines say why.")
    elif best is None:
        open_knobs = "" if set(work.search) >= {"checkpoint", "micro_batch"} else (
            " Leave --checkpoint and --micro-batch out to let the planner search them;")
        warnings.append("nothing fits, not even tight (above the device's memory) at every setting searched."
                        f"{open_knobs} try a shorter --seq, more GPUs, or a GPU with more memory.")
        if work.objective == "dpo":  # plan.preference.dpo_layout_refusal: engines that own the step
            warnings.append("no offload row either: the offload layouts are DeepSpeed's engines, which own the "
                            "step, and train.objective = 'dpo' does not run under them yet.")
        elif work.optimizer in DEVICE_STATE_OPTIMIZERS:  # the runtime's rule (optim.rules.check_optimizer)
            warnings.append(f"no offload row either: optimizer {work.optimizer!r} does not run with its state in "
                            "host memory (the offload layouts); --optimizer adamw plans one.")
        else:
            # The decision table's last row: ZeRO-3 with CPU / NVMe offload (plan.offload owns the math).
            offload, commands, line = offload_advice(spec, cluster, work, cands)
            warnings.append(line)
    elif not work.recipe:
        warnings.append(f"{spec.name} is not a model shardwise can build, so no command is printed: plan a "
                        "preset (--model), a config.json (--hf-config) or a factory (--model-factory) for "
                        "commands that run as printed.")
    plan = Plan(spec, cluster, work, cands, best, rejected, commands, warnings, calib, skipped)
    if best is None:
        plan.offload = offload
    return plan


def searched(work: Workload) -> Iterable[str]:
    """The settings the plan searched (for headers and JSON); the end-stage lightening is not searched
    under a stack that balances its stages itself (Kernels.pp_split, choices.first_stage_fewer_choices)."""
    skip = ("pp_first_stage_fewer",) if work.kernels.pp_split != "layers" else ()
    return tuple(k for k in SEARCHABLE if k in work.search and k not in skip)
