"""Loop short 2-rank runs and count crashes at shutdown (figures, not a test).

    .venv/bin/python benchmarks/shutdown_loop.py --runs 40 --mode async

Each run trains the nano GPT for 3 steps under ddp on 2 ranks, saving a checkpoint after every
step (``checkpoint.mode`` as given), then shuts down. A run counts as a crash when it exits
non-zero or any rank's output contains ``terminate called`` (a C++ abort, e.g. a thread left
joinable at exit) or a SIGABRT; its output is kept. Prints the count and the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ABORT_MARKS = ("terminate called", "SIGABRT", "Signal 6")


def main() -> int:
    from shardwise.data.shakespeare import bundled_text_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--mode", default="async", help="checkpoint.mode of every run")
    p.add_argument("--keep", default="shutdown-loop-failures", help="folder for the output of failed runs")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shardwise-shutdown-"))
    data = work / "small.txt"
    data.write_text(bundled_text_path().read_text(encoding="utf-8")[:6000], encoding="utf-8")
    sets = ["model.preset=nano", "train.steps=3", "train.eval_every=0", "train.eval_batches=1",
            "train.sample_tokens=0", "train.progress=false", f'data.path="{data}"', "data.val_fraction=0.5",
            "checkpoint.every=1", "train.micro_batch_size=4", f"checkpoint.mode={args.mode}"]
    cmd = [sys.executable, "-m", "shardwise", "train", "--nproc", "2", "--strategy", "ddp", "--out", str(work / "run")]
    for s in sets:
        cmd += ["--set", s]
    crashes = 0
    try:
        for i in range(1, args.runs + 1):
            shutil.rmtree(work / "run", ignore_errors=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            text = proc.stdout + proc.stderr
            logs = work / "run" / "logs"
            for log in logs.glob("rank-*.log") if logs.is_dir() else []:
                text += log.read_text(encoding="utf-8", errors="replace")
            bad = proc.returncode != 0 or any(mark in text for mark in ABORT_MARKS)
            if bad:
                crashes += 1
                keep = Path(args.keep)
                keep.mkdir(parents=True, exist_ok=True)
                (keep / f"run-{i}.txt").write_text(text, encoding="utf-8")
            print(f"run {i}: exit {proc.returncode}{' CRASH' if bad else ''} (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{crashes} crash(es) in {args.runs} runs, checkpoint.mode={args.mode}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
