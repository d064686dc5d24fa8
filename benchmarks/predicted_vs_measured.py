"""The planner's per-rank prediction against the memory ledger, from each run's summary.json.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/predicted_vs_measured.py --set model.preset=lab

Each case is a normal ``shardwise train`` (2 steps, a small batch, no checkpoint); its summary.json
holds, per rank, the ledger's measured parameter / gradient / optimizer bytes next to the planner's
prediction for that rank (``memory.predicted_vs_measured``). Prints one markdown table. On CUDA the
peak (``max_memory_allocated``) is compared too; on the CPU the peak is the process RSS and is not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CASES = [  # (label, ranks, strategy, extra --set overrides)
    ("ddp", 2, "ddp", []),
    ("fsdp", 2, "fsdp", []),
    ("tp", 2, "tp", []),
    ("pp", 2, "pp", []),
    ("fsdp+tp", 4, "fsdp+tp", ["parallel.tp=2"]),
]
FIELDS = ("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma-separated case labels")
    p.add_argument("--out", default="runs/bench-predicted-vs-measured")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    wanted = set(args.cases.split(","))
    common = ["train.steps=2", "train.micro_batch_size=4", "train.eval_every=0", "train.eval_batches=1",
              "train.sample_tokens=0", "train.progress=false", "checkpoint.at_end=false", *args.overrides]
    print("| strategy | ranks | rank | params pred / meas (B) | grads pred / meas (B) | optim pred / meas (B) | "
          "max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for label, n, strategy, extra in CASES:
        if label not in wanted:
            continue
        out = Path(args.out) / label.replace("+", "_")
        cmd = [sys.executable, "-m", "shardwise", "train", "--strategy", strategy, "--nproc", str(n),
               "--out", str(out)]
        for item in [*common, *extra]:
            cmd += ["--set", item]
        summary = out / "summary.json"
        summary.unlink(missing_ok=True)  # a failed run must not report an earlier run's figures
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not summary.is_file():
            print(f"| {label} | {n} | failed ({proc.returncode}) | {proc.stderr.strip()[-200:]} | | | |")
            continue
        for row in json.loads(summary.read_text())["memory"]["predicted_vs_measured"]:
            cells = [f"{row[k]['predicted']:,} / {row[k]['measured']:,}" for k in FIELDS[:3]]
            worst = max(abs(row[k]["diff_pct"] or 0.0) for k in FIELDS if k in row)
            print(f"| {label} | {n} | {row['rank']} | " + " | ".join(cells) + f" | {worst:.2f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
