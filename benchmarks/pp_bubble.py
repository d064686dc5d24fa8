"""Pipeline bubble: measured idle fraction of every schedule next to the planner's formula.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_bubble.py --microbatches 8 --stages 2 4 \
        --set model.preset=lab --set model.overrides.n_layer=8

Runs the same recipe on one process and under ``pp`` on p=2 ranks with each schedule (normal
``shardwise bench`` runs). With perfect balance and free communication a step on p stages takes
T1/p, so the measured bubble is 1 - T1 / (p * Tpp): the share of each rank's step spent idle (or
communicating). Predicted: ``plan.pipeline.bubble_fraction`` per schedule ((p-1)/(m+p-1) for GPipe
and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B and looped BFS, a third of the idle time for the
zero-bubble ones). Needs one core per rank to mean anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--stages", type=int, nargs="+", default=[2], help="pipeline degrees (ranks) to measure")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="runs/bench-pp-bubble")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    m, out = args.microbatches, Path(args.out)
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
