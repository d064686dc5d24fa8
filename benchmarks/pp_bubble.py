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
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shardwise.core.pp_schedules import SCHEDULES as TABLE
from shardwise.plan.pipeline import bubble_fraction

# Every schedule: one stage per rank for GPipe/1F1B, two for the others (the V ones need exactly 2).
SCHEDULES = tuple((name, 2 if info.multi_stage else 1) for name, info in TABLE.items())


def _bench(out: Path, strategy: str, nproc: int, steps: int, overrides: list[str]) -> tuple[float, float]:
    """(bench's wall seconds per step, CPU seconds the whole job used: launcher and ranks)."""
    cmd = [sys.executable, "-m", "shardwise", "bench", "--strategies", strategy, "--nproc", str(nproc),
           "--steps", str(steps), "--out", str(out)]
    for item in overrides:
        cmd += ["--set", item]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    data = json.loads((out / "bench.json").read_text())
    rows = data["rows"] if isinstance(data, dict) else data  # {"rows": [...]} since bench's run-dir rework
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return rows[0]["step_time_s"], cpu


def _step_time(out: Path, strategy: str, nproc: int, steps: int, overrides: list[str]) -> tuple[float, float]:
    """(wall seconds per step, CPU seconds per step summed over the ranks). The CPU figure is the
    difference of a ``steps`` run and a 2-step one over the steps between (start-up cancels out):
    unlike wall time it counts only the job's own work, so it tells work that a pipeline adds
    (communication, extra passes) from time its ranks wait, and other load on the machine does not
    inflate it."""
    wall, cpu = _bench(out, strategy, nproc, steps, overrides)
    _, cpu_short = _bench(out.with_name(out.name + "-short"), strategy, nproc, 2, overrides)
    return wall, (cpu - cpu_short) / (steps - 2)


# torch's class for each schedule name (shardwise.core.pp_schedules owns the mapping).
def _torch_class(name: str) -> Any:
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, TABLE[name].torch_class)


def _timed(fn: Any, repeats: int) -> float:
    """The least CPU time of this process over ``repeats`` runs after one warm-up. CPU time, not wall
    time: with one thread (OMP_NUM_THREADS=1; CPU autograd runs in the calling thread) it is the
    action's own work, which other processes on a busy machine do not inflate the way they stretch
    wall time."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return min(times)


def _stage_runs(view: Any, first: bool, last: bool, ids: Any, hidden: Any) -> dict[str, Any]:
    """The runs timed per stage: forward (F), then F + full backward, F + input-gradient pass, F + I + W,
    with torch's own backward functions, as its runtime calls them."""
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
        # The loss (last stage) or the output as a tensor: torch's runtime passes them so (a list
        # holding the loss with no output gradient is silently skipped).
        stage_backward(out, grad, inputs)
        view.zero_grad(set_to_none=True)

    def split(weight: bool) -> None:
        inputs, out, grad = forward()
        _, groups = stage_backward_input([out], None if last else [grad], inputs, view.parameters())
        if weight:
            stage_backward_weight(view.parameters(), groups)
        view.zero_grad(set_to_none=True)

    runs = {"F": forward, "FB": full}
    if not first:  # torch skips the first stage's I and runs its whole backward as W
        runs.update(FI=lambda: split(False), FIW=lambda: split(True))
    return runs


def _gpt_layer_costs(overrides: list[str], rows: int, microbatches: int,
                     repeats: int) -> tuple[list[dict], float, int]:
    """F, B, I and W seconds of each layer on one micro-batch of ``rows`` rows, timed as a stage of
    its own (the first also runs the embeddings, the last the head and the loss); T1, one process's
    forward + backward of the whole batch (``rows`` x ``microbatches`` rows); the layer count.

    Timed per layer, not per stage of the split being simulated: one layer's actions take tens of
    milliseconds, short enough that the fastest of a few runs is the action's own cost even on a
    busy machine, where a whole stage's second-long actions never run undisturbed. A stage's cost
    is the sum of its layers' (``_stage_costs_of``)."""
    import dataclasses

    import torch

    from shardwise.core.layout import stage_layer_ranges
    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.parallel.pipeline.pp import stage_view
    from shardwise.testing import lm_loss

    sets = dict(item.split("=", 1) for item in overrides)
    cfg = GPT_PRESETS[sets.get("model.preset", "lab")]
    changes = {k.removeprefix("model.overrides."): int(v) for k, v in sets.items() if k.startswith("model.overrides.")}
    cfg = dataclasses.replace(cfg, **changes)
    torch.manual_seed(0)
    model = GPT(cfg)
    n = cfg.n_layer
    ranges = stage_layer_ranges(n, n)
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size))
    hidden = torch.randn(rows, cfg.block_size, cfg.n_embd)
    runs = [_stage_runs(stage_view(model, s, ranges), s == 0, s == n - 1, ids, hidden) for s in range(n)]
    # Round-robin over the layers, so a burst of load elsewhere slows one round, not one layer.
    best = [{k: float("inf") for k in r} for r in runs]
    for _ in range(repeats):
        for layer, r in zip(best, runs):
            for k, fn in r.items():
                layer[k] = min(layer[k], _timed(fn, 1))
    costs = []
    for t in best:
        f, b = t["F"], t["FB"] - t["F"]
        i, w = (t["FI"] - f, t["FIW"] - t["FI"]) if "FI" in t else (0.0, b)
        costs.append({"F": f, "B": b, "I": i, "W": w})
    batch = torch.randint(0, cfg.vocab_size, (rows * microbatches, cfg.block_size))

    def whole() -> None:
        lm_loss(model(batch), batch).backward()
        model.zero_grad(set_to_none=True)

    return costs, _timed(whole, max(1, repeats // 2)), n


def _stage_costs_of(layers: list[dict], n_stages: int) -> list[dict]:
    """Each stage's F, B, I, W as the sum of its layers' (``layout.stage_layer_ranges``); torch runs
    the first stage's whole backward as W (no input gradient to send)."""
    from shardwise.core.layout import stage_layer_ranges

    out = []
    for s, r in enumerate(stage_layer_ranges(len(layers), n_stages)):
        c = {k: sum(layers[i][k] for i in r) for k in "FBIW"}
        if s == 0:
            c["I"], c["W"] = 0.0, c["B"]
        out.append(c)
    return out


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


def simulate(orders: list[list[Any]], cost: Any, transfer: float = 0.0) -> tuple[float, list[float]]:
    """Replay each rank's action list in order with ``cost(stage, kind)`` seconds per action and
    free communication: an action starts when its rank is free and its inputs exist (F after the
    previous stage's F of that micro-batch, B/I after the next stage's B/I, W after its I).
    ``transfer``: seconds an input takes from a stage on another rank (0: free communication); sends
    never block and each transfer runs on its own, as when every receive is posted early (torch's
    multi-stage runtime), so the makespan grows only where a rank waits on one
    (``core.pp_schedules.waited_transfers``).
    Returns the makespan and each rank's busy time. Composite actions (DualPipeV's overlapped
    F;B) run their parts one after the other (a CPU does not overlap them)."""
    done: dict[tuple[int, str, int], float] = {}
    owner = {p.stage_index: r for r, rank in enumerate(orders) for a in rank for p in (a.sub_actions or [a])}
    n_stages = 1 + max(owner)
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

    def ready(d: tuple[int, str, int], rank: int) -> float:
        return done[d] + (transfer if owner[d[0]] != rank else 0.0)

    while any(p < len(r) for p, r in zip(pos, orders)):
        progressed = False
        for r, rank in enumerate(orders):
            while pos[r] < len(rank):
                a = rank[pos[r]]
                parts = list(a.sub_actions) if a.sub_actions else [a]
                own = [(q.stage_index, kind(q), q.microbatch_index) for q in parts]
                needed = [d for p in parts for d in deps(p) if d not in own]
                if any(d not in done for d in needed):
                    break
                t = max([free[r], *(ready(d, r) for d in needed)])
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
    import torch

    torch.set_num_threads(1)  # one core per rank, as the real runs have it (and CPU time = this thread's)
    rows = args.rows
    print(f"simulated: micro-batches of {rows} rows, {m} per step; each cost is the least CPU time of "
          f"{args.repeats} runs")
    layers, t1, n_layer = _gpt_layer_costs(args.overrides, rows, m, args.repeats)
    print("per layer (ms per micro-batch; layer 0 with the embeddings, the last with the head and loss): "
          + "; ".join(" ".join(f"{k}={x[k] * 1e3:.0f}" for k in "FBIW") for x in layers))
    fb = sum(x["F"] + x["B"] for x in layers)
    split = sum(x["I"] + x["W"] for x in layers[1:]) + layers[0]["B"]
    print(f"I + W = {split / (fb - sum(x['F'] for x in layers)):.2f} x B (the split backward's extra walk); "
          f"T1 (one process, the whole batch at once) = {t1:.3f} s = {t1 / (m * fb):.2f} x {m} micro-batches' F + B")
    print("| p | schedule | stages/rank | planner | torch order, ideal costs | torch order, measured costs: "
          "idle | extra work | 1 - T1/(p x step) |")
    print("|---|---|---|---|---|---|---|---|")
    for pp in args.stages:
        for schedule, v in SCHEDULES:
            n_stages = pp * v
            if n_stages > n_layer:
                print(f"| {pp} | {schedule} | {v} | {n_stages} stages > {n_layer} layers | | | | |")
                continue
            costs = _stage_costs_of(layers, n_stages)
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
    t1, cpu1 = _step_time(out / "single", "single", 1, args.steps, common)
    print(f"single process: {t1:.3f} s/step, {cpu1:.3f} CPU s/step")
    # measured: 1 - T1 / (p Tpp), everything beyond one process's step over p; of which extra CPU work
    # (sum of the ranks' CPU per step over one process's, minus 1) and waiting (1 - CPU / (p x wall)).
    print("| p | schedule | stages/rank | step s | measured bubble | predicted | extra CPU work | ranks waiting |")
    print("|---|---|---|---|---|---|---|---|")
    for pp in args.stages:
        for schedule, v in SCHEDULES:
            extra = [f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={v}",
                     f"parallel.pp_microbatches={m}"]
            try:
                tpp, cpu = _step_time(out / f"p{pp}-{schedule}", "pp", pp, args.steps, [*common, *extra])
            except subprocess.CalledProcessError:
                print(f"| {pp} | {schedule} | {v} | failed | | | | |")
                continue
            measured = 1 - t1 / (pp * tpp)
            predicted = bubble_fraction(schedule, pp, m, v)
            print(f"| {pp} | {schedule} | {v} | {tpp:.3f} | {measured:.1%} | {predicted:.1%} | "
                  f"{cpu / cpu1 - 1:+.1%} | {1 - cpu / (pp * tpp):.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
