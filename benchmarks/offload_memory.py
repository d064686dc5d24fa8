"""Peak host RSS per rank and step time of the offload strategies (issue 23), with NVMe bytes written.

    python benchmarks/offload_memory.py --preset lab --steps 6 --nproc 2

Runs ``shardwise train`` once per strategy (fsdp, fsdp-offload, zero3-offload, zero3-nvme) on the
same recipe and prints, per strategy: each rank's peak RSS (the run's memory ledger, getrusage),
the mean step time after the first step, and for zero3-nvme the bytes under parallel.nvme_path
while it runs (the swap files' largest total size). On a CPU machine every "device" copy is a
host copy, so the offload strategies show their bookkeeping and I/O cost, not a GPU saving.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = ("fsdp", "fsdp-offload", "zero3-offload", "zero3-nvme")


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="lab")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--micro-batch", type=int, default=4)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="offload-bench-") as tmp:
        for strategy in args.strategies.split(","):
            out, nvme = Path(tmp) / strategy, Path(tmp) / f"nvme-{strategy}"
            cmd = [sys.executable, "-m", "shardwise", "train", "--nproc", str(args.nproc), "--strategy", strategy,
                   "--out", str(out), "--set", f"model.preset={args.preset}", "--set", f"train.steps={args.steps}",
                   "--set", f"train.micro_batch_size={args.micro_batch}", "--set", "train.eval_every=0",
                   "--set", "train.sample_tokens=0", "--set", "train.progress=false", "--set", "train.log_every=1",
                   "--set", "checkpoint.at_end=false", "--set", f"parallel.nvme_path={nvme}"]
            log = Path(tmp) / f"{strategy}.log"
            with open(log, "w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
                # DeepSpeed removes its swap files at exit: the largest size seen while it runs.
                most = 0
                while proc.poll() is None:
                    most = max(most, du(nvme))
                    time.sleep(0.5)
            if proc.returncode != 0:
                print(f"{strategy}: failed\n{log.read_text()[-3000:]}", file=sys.stderr)
                continue
            summary = json.loads((out / "summary.json").read_text())
            peaks = [r["peak_bytes"] / 2**20 for r in summary["memory"]["ranks"]]
            rows.append((strategy, peaks, summary["step_time_s"], most))
    print(f"{'strategy':<14} {'peak RSS per rank (MiB)':<28} {'step_s':>8} {'nvme_bytes':>12}")
    for strategy, peaks, step_s, nvme_bytes in rows:
        print(f"{strategy:<14} {', '.join(f'{x:.0f}' for x in peaks):<28} {step_s:>8.3f} {nvme_bytes:>12,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
