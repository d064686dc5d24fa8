"""The two compute rates the planner prices a step with, measured on this device.

The planner's compute term (``plan.cost.micro_batch_compute_s``) runs a step's matrix products at
``peak x matmul ceiling x matmul_factor`` and the attention core (unhalved FLOPs) at
``peak x attention ceiling x attention_factor``, the ceiling that of the stack's attention kernel
(``Kernels.attention_kernel``: "flash2" for SDPA's default FlashAttention-2, "flash3" for cuDNN's
or FlashAttention-3 on Hopper), the factors fitted to published runs. A played llama-3-8b rank on
an H200 (full recomputation, 8,192 tokens) ran 20 % faster than that term priced as "flash2" (and
as fast as "flash3"), a llama-3-70b rank (selective-op) 4 % slower ("flash2"); attention is 22.6 %
of the first's planned FLOPs and 12.1 % of the second's. This measures both rates at the 8B's
shapes, forward and backward, SDPA's default and (on CUDA) its cuDNN kernel, and prints them
beside the planner's for ``--gpu``:

    .venv/bin/python benchmarks/kernel_rates.py [--gpu h200] [--seq 8192] [--device cuda]

Shapes: a (seq x hidden) @ (hidden x ffn) product and its two backward products (bf16), and causal
SDPA over (1, heads, seq, head_dim) forward and backward (bf16; flash on CUDA). On the CPU (a check
of the script, the figures mean nothing) the shapes shrink.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed(fn, device: str, repeats: int) -> float:
    """Seconds per call of ``fn``: the fastest of ``repeats`` after two warm-ups."""
    import torch

    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    import torch
    import torch.nn.functional as F

    from shardwise.plan.advice import Cluster
    from shardwise.plan.presets import gpu

    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="h200", help="the planner's GPU kind whose priced rates are printed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.device == "cpu":  # the script's own check: small shapes, seconds
        args.seq, args.hidden, args.ffn, args.heads, args.head_dim = 256, 128, 384, 4, 32
        args.repeats = 2
    dev, dt = args.device, torch.bfloat16
    s, h, f = args.seq, args.hidden, args.ffn

    x = torch.randn(s, h, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(h, f, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(s, f, device=dev, dtype=dt)

    def gemm() -> None:
        torch.autograd.grad(x @ w, (x, w), g)

    gemm_s = _timed(gemm, dev, args.repeats)
    gemm_flops = 3 * 2 * s * h * f

    q, k, v = (torch.randn(1, args.heads, s, args.head_dim, device=dev, dtype=dt, requires_grad=True)
               for _ in range(3))
    go = torch.randn(1, args.heads, s, args.head_dim, device=dev, dtype=dt)

    def attention() -> None:
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), go)

    attn_s = _timed(attention, dev, args.repeats)
    cudnn_s = None
    if dev == "cuda":  # cuDNN's fused attention, SDPA's opt-in Hopper kernel (the planner's "flash3" class)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn_s = _timed(attention, dev, args.repeats)
        except RuntimeError as e:  # no cuDNN attention for this GPU or shape: say so, keep the rest
            print(f"cuDNN attention not run: {str(e).splitlines()[0]}")
    attn_flops = 12 * args.heads * args.head_dim * s * s  # unhalved, as the planner counts it

    cluster = Cluster(gpu=gpu(args.gpu), gpus_per_node=1)
    calib = cluster.calibration
    fabric = cluster.fabric("bf16", calib)
    # SDPA's default (FlashAttention-2 first on every GPU) is priced as "flash2"; cuDNN's as "flash3".
    priced = {"matmul": fabric.matmul_flops_per_s(calib) / 1e12,
              "attention": fabric.attention_flops_per_s(calib, "flash2") / 1e12,
              "attn-cudnn": fabric.attention_flops_per_s(calib, "flash3") / 1e12}
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (a check of the script: figures mean nothing)"
    print(f"device: {name}; planner's rates for {args.gpu} (peak {fabric.peak_tflops:.0f} TFLOP/s 16-bit)")
    rows = [("matmul", gemm_s, gemm_flops), ("attention", attn_s, attn_flops)]
    if cudnn_s is not None:
        rows.append(("attn-cudnn", cudnn_s, attn_flops))
    for what, secs, flops in rows:
        rate = flops / secs / 1e12
        print(f"{what:<10} {secs * 1e3:9.3f} ms  {rate:8.1f} TFLOP/s measured  {priced[what]:8.1f} priced  "
              f"measured / priced {rate / priced[what]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
