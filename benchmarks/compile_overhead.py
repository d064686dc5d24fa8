"""Compiled vs eager step time, and shardwise's per-step overhead against a plain PyTorch loop.

    OMP_NUM_THREADS=1 python benchmarks/compile_overhead.py --preset lab --nproc 2 --steps 30

Runs ``shardwise bench --strategies ddp,torch-ddp`` twice, eager and with ``train.compile = true``
(the reference loop compiles each block the same way), on the same recipe, and prints:

* step time and tokens/s of ``ddp`` eager vs compiled (the compile speed-up);
* ``ddp`` / ``torch-ddp`` step-time ratio in each mode (the Session loop's overhead: the target is
  within 3%, i.e. a ratio <= 1.03);
* MFU and achieved TFLOP/s per device of the shardwise runs (from their summary.json: the planner's
  FLOP count against the catalog peak on CUDA, a measured matmul peak on the CPU).

Step times are medians over logging windows (``train.log_every``), so the first window, which
holds the compilation, does not count. Figures, not assertions: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def run_bench(out: Path, args: argparse.Namespace, compile: bool) -> dict:
    cmd = [sys.executable, "-m", "shardwise", "bench", "--strategies", "ddp,torch-ddp",
           "--nproc", str(args.nproc), "--steps", str(args.steps), "--repeat", str(args.repeat),
           "--out", str(out), "--overwrite",
           "--set", f"model.preset={args.preset}", "--set", f"train.micro_batch_size={args.micro_batch}",
           "--set", f"train.log_every={args.log_every}", "--set", "train.eval_batches=1",
           "--set", "train.sample_tokens=0", "--set", f"train.compile={'true' if compile else 'false'}"]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    result = json.loads((out / "bench.json").read_text())
    rows = {r["strategy"]: r for r in result["rows"]}
    summaries = [json.loads(p.read_text()) for p in sorted((out / "ddp").rglob("summary.json"))]
    return {"rows": rows, "overhead": result["overhead"], "summaries": summaries}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="lab")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", default="runs/compile-overhead")
    args = p.parse_args()
    out = Path(args.out)
    results = {mode: run_bench(out / mode, args, mode == "compiled") for mode in ("eager", "compiled")}
    print(f"\n{args.preset} preset, {args.nproc} ranks, micro-batch {args.micro_batch}, {args.steps} steps, "
          f"{args.repeat} round(s)")
    print(f"{'mode':<9} {'impl':<10} {'step_s':>8} {'tokens/s':>10} {'TFLOP/s/dev':>12} {'MFU':>8}")
    for mode, r in results.items():
        for name in ("ddp", "torch-ddp"):
            row = r["rows"][name]
            extra = ""
            if name == "ddp" and r["summaries"]:
                s = r["summaries"][-1]
                mfu = f"{s['mfu']:.2%}" if s.get("mfu") is not None else "-"
                extra = f" {s['tflops_per_device']:>12.4g} {mfu:>8}"
            print(f"{mode:<9} {name:<10} {row['step_time_s']:>8.3f} {row['tokens_per_s']:>10.0f}{extra}")
    eager, compiled = (results[m]["rows"]["ddp"]["step_time_s"] for m in ("eager", "compiled"))
    print(f"\ncompile speed-up (ddp eager / ddp compiled step time): {eager / compiled:.3f}x")
    for mode, r in results.items():
        for pair in r["overhead"]:
            print(f"overhead {mode}: {pair['strategy']} / {pair['reference']} = {pair['ratio']:.3f}x "
                  f"(target <= 1.03)")
    (out / "compile_overhead.json").write_text(json.dumps(
        {"args": vars(args), "eager_step_s": eager, "compiled_step_s": compiled,
         "overhead": {m: r["overhead"] for m, r in results.items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
