"""How long `shardwise plan` takes, and whether it imports torch, for preset models.

    python benchmarks/plan_speed.py

Each case runs in a fresh interpreter (`python -m shardwise plan ...`), so the figure is what a
user waits for, interpreter start and imports included; the second column is the in-process
planning time alone. The target is under a second, without importing torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ["--model", "gpt-nano", "--gpus-per-node", "2"],
    ["--model", "gpt2-xl", "--gpu", "a100-80gb"],
    ["--model", "llama-3-8b", "--seq", "8192"],
    ["--model", "llama-3-70b", "--nodes", "8", "--checkpoint", "selective-op"],
    ["--model", "llama-3-405b", "--nodes", "64", "--checkpoint", "full"],
    ["--model", "mistral-7b", "--gpu", "h200", "--nodes", "16"],
    # The searched context- and expert-parallel degrees (was a timed assertion in test_plan_cp_ep.py).
    ["--model", "llama-3-70b", "--nodes", "4", "--seq", "32768"],
    ["--model", "gpt-moe-lab", "--nodes", "4"],
]
PROBE = ("import io, sys, time, contextlib\nfrom shardwise.cli import main\nt = time.perf_counter()\n"
         "with contextlib.redirect_stdout(io.StringIO()):\n    rc = main(['plan', *sys.argv[1:]])\n"
         "print(rc, time.perf_counter() - t, 'torch' in sys.modules)")


def main() -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    print(f"{'case':70s} {'wall s':>7s} {'plan s':>7s} torch imported")
    for case in CASES:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "shardwise", "plan", *case], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        out = subprocess.run([sys.executable, "-c", PROBE, *case], env=env, check=True, capture_output=True,
                             text=True).stdout.split()
        print(f"{' '.join(case):70s} {wall:7.2f} {float(out[1]):7.2f} {out[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
