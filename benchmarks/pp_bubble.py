"""Pipeline bubble: measured idle fraction of every schedule next to the planner's formula.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_bubble.py --microbatches 8 --stages 2 4 \
        --set model.preset=lab --set model.overrides.n_layer=8

Runs the same recipe on one process and under ``pp`` on p=2 ranks with each schedule (normal
``shardwise bench`` runs). With perfect balance and free communication a step on p stages takes
T1/p, so the measured bubble is 1 - T1 / (p * Tpp): the share of each rank's step spent idle (or
communicating). Predicted: ``plan.pipeline.bubble_fraction`` per schedule ((p-1)/(m+p-1) for GPipe
and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B and looped BFS, a third of the idle time for the
zero-bubble ones). Needs one core per rank to mean anything.

``--simulate`` needs no spare cores (one process): it times each action torch's schedules run on
each stage of the same model cut into p x v stages (forward F, full backward B, and the zero-bubble
schedules' input-gradient I and weight-gradient W passes, with torch's own ``stage_backward*``
functions on micro-batches of the run's size), takes each schedule's action order from torch
(``get_schedule_ops``: the order the runtime executes) and replays it with those costs and free
communication. It prints, per schedule: the planner's formula; the idle share of torch's order
with the formula's ideal costs (F = I = W = 1, B = 2); with the measured costs, the idle share and
the work each pipeline step does beyond one process's (split backward, micro-batch size); and
``1 - T1 / (p x makespan)``, the figure the real runs measure (comparable to them when they had a
core per rank, and the estimate for p ranks where the machine has fewer cores).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_bubble.py --simulate --microbatches 8 --stages 2 4 \
        --set model.preset=lab --set model.overrides.n_layer=8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardwise.plan.pipeline import bubble_fraction
from shardwise.pp_schedules import SCHEDULES as TABLE

# Every schedule: one stage per rank for GPipe/1F1B, two for the others (the V ones need exactly 2).
SCHEDULES = tuple((name, 2 if info.multi_stage else 1) for name, info in TABLE.items())


def _step_time(out: Path, strategy: str, nproc: int, steps: int, overrides: list[str]) -> float:
    cmd = [sys.executable, "-m", "shardwise", "bench", "--strategies", strategy, "--nproc", str(nproc),
           "--steps", str(steps), "--out", str(out)]
    for item in overrides:
        cmd += ["--set", item]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"] if isinstance(data, dict) else data  # {"rows": [...]} since bench's run-dir rework
    return rows[0]["step_time_s"]


# torch's class for each schedule name (shardwise.pp_schedules owns the mapping).
def _torch_class(name: str) -> Any:
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, TABLE[name].torch_class)


def _timed(fn: Any, repeats: int) -> float:
    """The fastest of ``repeats`` runs after one warm-up: on a shared machine other processes only
    ever add time, so the minimum is the action's own cost."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _stage_costs(view: Any, first: bool, last: bool, ids: Any, hidden: Any, repeats: int) -> dict[str, float]:
    """Seconds of F, B, I and W of one stage on one micro-batch, with torch's own backward functions."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    from shardwise.testing import lm_loss

    def forward() -> tuple[list[Any], Any, Any]:
        x = ids if first else hidden.clone().requires_grad_(True)
        out = view(x)
        if last:
            return ([] if first else [x]), lm_loss(out, ids), None
        return ([] if first else [x]), out, torch.randn_like(out)

    def full() -> None:
        inputs, out, grad = forward()
        stage_backward([out] if last else out, None if last else grad, inputs)
        view.zero_grad(set_to_none=True)

    def input_only(weight: bool = False) -> None:
        inputs, out, grad = forward()
        _, groups = stage_backward_input([out], None if last else [grad], inputs, view.parameters())
        if weight:
            stage_backward_weight(view.parameters(), groups)
        view.zero_grad(set_to_none=True)

    f = _timed(forward, repeats)
    b = _timed(full, repeats) - f
    if first:  # torch skips the first stage's I and runs its whole backward as W
        return {"F": f, "B": b, "I": 0.0, "W": b}
    i = _timed(input_only, repeats) - f
    w = _timed(lambda: input_only(weight=True), repeats) - f - i
    return {"F": f, "B": b, "I": i, "W": w}


def _gpt_stage_costs(overrides: list[str], n_stages: int, rows: int, microbatches: int,
                     repeats: int) -> tuple[list[dict], float]:
    """Per stage: the seconds of F, B, I and W on one micro-batch of ``rows`` rows; and T1, one
    process's forward + backward of the whole batch (``rows`` x ``microbatches`` rows)."""
    import dataclasses

    import torch

    from shardwise.layout import stage_layer_ranges
    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.parallel.pp import stage_view
    from shardwise.testing import lm_loss

    sets = dict(item.split("=", 1) for item in overrides)
    cfg = GPT_PRESETS[sets.get("model.preset", "lab")]
    changes = {k.removeprefix("model.overrides."): int(v) for k, v in sets.items() if k.startswith("model.overrides.")}
    cfg = dataclasses.replace(cfg, **changes)
    torch.manual_seed(0)
    model = GPT(cfg)
    ranges = stage_layer_ranges(cfg.n_layer, n_stages)
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size))
    hidden = torch.randn(rows, cfg.block_size, cfg.n_embd)
    costs = [_stage_costs(stage_view(model, s, ranges), s == 0, s == n_stages - 1, ids, hidden, repeats)
             for s in range(n_stages)]
    batch = torch.randint(0, cfg.vocab_size, (rows * microbatches, cfg.block_size))

    def whole() -> None:
        lm_loss(model(batch), batch).backward()
        model.zero_grad(set_to_none=True)

    return costs, _timed(whole, repeats)


_COMPUTE = ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT", "OVERLAP_F_B")


def _actions(name: str, pp: int, m: int, v: int) -> list[list[Any]]:
    """Each rank's compute actions in the order torch runs them under schedule ``name``.

    The multi-stage schedules run their ``pipeline_order`` (``get_schedule_ops`` gives it). GPipe
    and 1F1B run their own loop instead (``Schedule1F1B._step_microbatches``: stage r does
    min(m, p - r) warm-up forwards, then alternates backward / forward, then drains), written out
    here; the order ``get_schedule_ops`` shows for them is not what runs.
    """
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    if not TABLE[name].multi_stage:
        orders = []
        for r in range(pp):
            fwd = [_Action(r, _ComputationType.FORWARD, i) for i in range(m)]
            bwd = [_Action(r, _ComputationType.FULL_BACKWARD, i) for i in range(m)]
            if name == "gpipe":
                orders.append(fwd + bwd)
                continue
            warmup = min(m, pp - r)
            order, f, b = fwd[:warmup], warmup, 0
            while b < m:
                order.append(bwd[b])
                b += 1
                if f < m:
                    order.append(fwd[f])
                    f += 1
            orders.append(order)
        return orders
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return [[a for a in rank if a is not None and a.computation_type.name in _COMPUTE]
            for rank in get_schedule_ops(_torch_class(name), pp, m, v)]


def simulate(orders: list[list[Any]], cost: Any) -> tuple[float, list[float]]:
    """Replay each rank's action list in order with ``cost(stage, kind)`` seconds per action and
    free communication: an action starts when its rank is free and its inputs exist (F after the
    previous stage's F of that micro-batch, B/I after the next stage's B/I, W after its I).
    Returns the makespan and each rank's busy time. Composite actions (DualPipeV's overlapped
    F;B) run their parts one after the other (a CPU does not overlap them)."""
    done: dict[tuple[int, str, int], float] = {}
    n_stages = 1 + max(a.stage_index for rank in orders for a in rank
                       for a in ([a] if not a.sub_actions else a.sub_actions))
    free = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    pos = [0] * len(orders)

    def kind(a: Any) -> str:
        return {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}[
            a.computation_type.name]

    def deps(a: Any) -> list[tuple[int, str, int]]:
        s, k, mb = a.stage_index, kind(a), a.microbatch_index
        if k == "F":
            return [(s - 1, "F", mb)] if s > 0 else []
        if k in ("B", "I"):
            return [(s, "F", mb)] + ([(s + 1, "G", mb)] if s < n_stages - 1 else [])
        return [(s, "G", mb)]  # W after this stage's input gradient

    while any(p < len(r) for p, r in zip(pos, orders)):
        progressed = False
        for r, rank in enumerate(orders):
            while pos[r] < len(rank):
                a = rank[pos[r]]
                parts = list(a.sub_actions) if a.sub_actions else [a]
                needed = [d for p in parts for d in deps(p) if d not in [(q.stage_index, kind(q), q.microbatch_index)
                                                                       for q in parts]]
                if any(d not in done for d in needed):
                    break
                t = max([free[r], *(done[d] for d in needed)])
                for p in parts:
                    c = cost(p.stage_index, kind(p))
                    t += c
                    busy[r] += c
                    key = (p.stage_index, kind(p), p.microbatch_index)
                    done[key] = t
                    if kind(p) in ("B", "I"):
                        done[(p.stage_index, "G", p.microbatch_index)] = t  # gradient sent upstream
                    if kind(p) == "W" and p.stage_index == 0:
                        done[(0, "G", p.microbatch_index)] = t
                free[r] = t
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's action order deadlocks in the replay")
    return max(free), busy


def _simulated(args: argparse.Namespace, m: int) -> None:
    rows = args.rows
    print(f"simulated: micro-batches of {rows} rows, {m} per step; each cost is the fastest of {args.repeats} runs")
    print("| p | schedule | stages/rank | planner | torch order, ideal costs | torch order, measured costs: "
          "idle | extra work | 1 - T1/(p x step) |")
    print("|---|---|---|---|---|---|---|---|")
    cache: dict[int, tuple[list[dict], float]] = {}
    for pp in args.stages:
        for schedule, v in SCHEDULES:
            n_stages = pp * v
            if n_stages not in cache:
                cache[n_stages] = _gpt_stage_costs(args.overrides, n_stages, rows, m, args.repeats)
                c, t1 = cache[n_stages]
                print(f"costs at {n_stages} stages (s per micro-batch, stage 0 .. {n_stages - 1}): "
                      + "; ".join(" ".join(f"{k}={x[k] * 1e3:.1f}ms" for k in "FBIW") for x in c)
                      + f"; T1 (one process, whole batch) = {t1:.3f} s")
            costs, t1 = cache[n_stages]
            orders = _actions(schedule, pp, m, v)

            def ideal(stage: int, kind: str) -> float:
                return {"F": 1.0, "B": 2.0, "I": 1.0 if stage else 0.0, "W": 1.0 if stage else 2.0}[kind]

            span, busy = simulate(orders, ideal)
            ideal_idle = 1 - sum(busy) / (pp * span)
            span, busy = simulate(orders, lambda stage, kind, costs=costs: costs[stage][kind])
            idle = 1 - sum(busy) / (pp * span)
            fb = m * sum(x["F"] + x["B"] for x in costs)
            extra = sum(busy) / fb - 1
            predicted = bubble_fraction(schedule, pp, m, v)
            print(f"| {pp} | {schedule} | {v} | {predicted:.1%} | {ideal_idle:.1%} | {idle:.1%} | {extra:+.1%} | "
                  f"{1 - t1 / (pp * span):.1%} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stages", type=int, nargs="+", default=[2], help="pipeline degrees (ranks) to measure")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="runs/bench-pp-bubble")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--simulate", action="store_true", help="time each stage's actions in one process and "
                   "replay torch's schedule orders (no ranks started)")
    p.add_argument("--rows", type=int, default=4, help="--simulate: rows per micro-batch (the run's "
                   "micro_batch_size / microbatches; 32 / 8 for the recipe)")
    p.add_argument("--repeats", type=int, default=5, help="--simulate: timings per action (the fastest counts)")
    args = p.parse_args()
    m, out = args.microbatches, Path(args.out)
    if args.simulate:
        _simulated(args, m)
        return 0
    common = [*args.overrides, "train.eval_every=0", "train.eval_batches=1"]
    t1 = _step_time(out / "single", "single", 1, args.steps, common)
    print(f"single process: {t1:.3f} s/step")
    print("| p | schedule | stages/rank | step s | measured bubble | predicted |")
    print("|---|---|---|---|---|---|")
    for pp in args.stages:
        for schedule, v in SCHEDULES:
            extra = [f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={v}",
                     f"parallel.pp_microbatches={m}"]
            try:
                tpp = _step_time(out / f"p{pp}-{schedule}", "pp", pp, args.steps, [*common, *extra])
            except subprocess.CalledProcessError:
                print(f"| {pp} | {schedule} | {v} | failed | | |")
                continue
            measured = 1 - t1 / (pp * tpp)
            predicted = bubble_fraction(schedule, pp, m, v)
            print(f"| {pp} | {schedule} | {v} | {tpp:.3f} | {measured:.1%} | {predicted:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
