"""Ledger bytes and step time per strategy at several rank counts (issue figures, not a test).

    .venv/bin/python benchmarks/strategy_memory.py --nproc 2 4 --steps 6 \
        --strategies ddp,zero1,zero2,fsdp,hsdp --set model.preset=lab

Each (strategy, ranks) pair is one ``shardwise bench`` run, i.e. a normal ``shardwise train``.
Prints one table: bytes per rank held in parameters, gradients and optimizer state (the largest
rank), peak (max RSS on CPU, max allocated on CUDA) and median step time. Strategies that do not
fit a rank count (hsdp on 2 ranks) are reported as failed and skipped in the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--strategies", default="ddp,zero1,zero2,fsdp,hsdp")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="runs/bench-strategy-memory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    rows = []
    for n in args.nproc:
        out = Path(args.out) / f"n{n}"
        cmd = [sys.executable, "-m", "shardwise", "bench", "--strategies", args.strategies,
               "--nproc", str(n), "--steps", str(args.steps), "--out", str(out)]
        for item in args.overrides:
            cmd += ["--set", item]
        subprocess.run(cmd, stdout=subprocess.DEVNULL)  # failed strategies show in bench.json
        for row in json.loads((out / "bench.json").read_text()):
            rows.append((n, row))
    print("| ranks | strategy | status | param B/rank | grad B/rank | optim B/rank | peak MiB | step s |")
    print("|---|---|---|---|---|---|---|---|")
    for n, r in rows:
        def b(key: str, r: dict = r) -> str:
            return "-" if r[key] is None else f"{round(r[key] * 2**20):,}"
        peak = "-" if r["peak_mib_per_rank"] is None else f"{r['peak_mib_per_rank']:.0f}"
        step = "-" if r["step_time_s"] is None else f"{r['step_time_s']:.3f}"
        print(f"| {n} | {r['strategy']} | {r['status']} | {b('param_mib_per_rank')} | "
              f"{b('grad_mib_per_rank')} | {b('optim_mib_per_rank')} | {peak} | {step} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
