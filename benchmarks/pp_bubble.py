"""Pipeline bubble: measured idle fraction next to the (p-1)/(m+p-1) prediction (issue figures).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_bubble.py --microbatches 4 --set model.preset=lab

Runs the same recipe on one process and under ``pp`` on p=2 ranks with each schedule (normal
``shardwise bench`` runs). With perfect balance and free communication a step on p stages takes
T1/p, so the measured bubble is 1 - T1 / (p * Tpp): the share of each rank's step spent idle (or
communicating). Predicted: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved
1F1B with v stages per rank. Needs one core per rank to mean anything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))


def _step_time(out: Path, strategy: str, nproc: int, steps: int, overrides: list[str]) -> float:
    cmd = [sys.executable, "-m", "shardwise", "bench", "--strategies", strategy, "--nproc", str(nproc),
           "--steps", str(steps), "--out", str(out)]
    for item in overrides:
        cmd += ["--set", item]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    return json.loads((out / "bench.json").read_text())[0]["step_time_s"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="runs/bench-pp-bubble")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    pp, m, out = 2, args.microbatches, Path(args.out)
    common = [*args.overrides, "train.eval_every=0", "train.eval_batches=1"]
    t1 = _step_time(out / "single", "single", 1, args.steps, common)
    print(f"single process: {t1:.3f} s/step")
    print("| schedule | stages/rank | step s | measured bubble | predicted |")
    print("|---|---|---|---|---|")
    for schedule, v in SCHEDULES:
        extra = [f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={v}",
                 f"parallel.pp_microbatches={m}"]
        tpp = _step_time(out / schedule, "pp", pp, args.steps, [*common, *extra])
        measured = 1 - t1 / (pp * tpp)
        predicted = (pp - 1) / (v * m + pp - 1)
        print(f"| {schedule} | {v} | {tpp:.3f} | {measured:.1%} | {predicted:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
