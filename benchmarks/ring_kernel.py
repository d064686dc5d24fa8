"""Ring attention's per-block kernels (parallel/context/ring.py) on one device, against plain SDPA.

A ring step runs one attention kernel on a block of queries against a block of keys and merges
the results; here one block is the whole sequence, so each kernel's output and gradients must
equal ``F.scaled_dot_product_attention``'s. CUDA: the flash kernel (bf16, causal, no mask) and
the memory-efficient one (with a mask); CPU: the flash-for-CPU kernel. Prints one line per kernel
(time per forward + backward, largest difference) and exits 1 when a kernel disagrees.

    .venv/bin/python benchmarks/ring_kernel.py [--seq 4096] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch
    import torch.nn.functional as F

    from shardwise.parallel.context import ring as cp_ring

    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    cases = [("flash", torch.bfloat16, None), ("efficient", torch.bfloat16, True)] if cuda else [
        ("flash-cpu", torch.float32, None)]
    failed = False
    for name, dtype, masked in cases:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, a.heads, a.seq, a.head_dim, device=dev, dtype=dtype, generator=g) for _ in range(3))
        mask = None
        if masked:  # a causal mask given as a float bias: what a packed batch hands the kernel
            keep = torch.ones(a.seq, a.seq, device=dev, dtype=torch.bool).tril()
            mask = torch.zeros(1, 1, a.seq, a.seq, device=dev, dtype=dtype).masked_fill(~keep, float("-inf"))
        dout = torch.randn_like(q)
        forward = cp_ring._cuda_forward if cuda else cp_ring._cpu_forward
        backward = cp_ring._cuda_backward if cuda else cp_ring._cpu_backward
        causal = mask is None
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, lse, rest = forward(q, k, v, causal, None, mask)
        grads = backward(dout, q, k, v, out, lse, causal, None, mask, rest)
        if cuda:
            torch.cuda.synchronize()
        took = time.perf_counter() - t0
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
        ref.backward(dout.float())
        diff = max(float((out.float() - ref.detach()).abs().max()),
                   *(float((gk.float() - gr.grad).abs().max()) for gk, gr in zip(grads[:3], (qr, kr, vr), strict=True)))
        tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
        ok = diff <= tol
        failed |= not ok
        print(f"ring kernel {name}: seq {a.seq}, {dtype}, forward+backward {took * 1e3:.1f} ms, "
              f"max |diff| vs SDPA {diff:.2e} ({'ok' if ok else 'DIFFERS'}, tolerance {tol:g})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
