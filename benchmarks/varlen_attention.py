"""Packed batches on a Hugging Face model: the dense document mask vs variable-length attention.

Builds a small Qwen2-style model (random weights, no files), packs documents of 50-800 tokens into
rows of ``--seq`` tokens, and times forward + backward of each path in its own process (peak memory
is per process): ``mask`` (the (B, 1, T, T) document mask handed to SDPA, the default) and
``varlen`` (``shardwise.models.varlen``: torch's FlashAttention varlen kernel on CUDA in bf16, one
SDPA call per document elsewhere). Prints tokens/s and peak memory (CUDA: max allocated; CPU: the
growth of the process's peak RSS over the step) and checks that the two paths' losses agree.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/varlen_attention.py --seq 4096 --steps 3
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _batch(seq: int, rows: int, vocab: int):
    import torch

    from shardwise.data.collate import RecordCollator

    g = torch.Generator().manual_seed(0)
    recs, total = [], 0
    while total < seq * rows:
        n = int(torch.randint(50, 800, (1,), generator=g))
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        recs.append({"input_ids": ids, "labels": ids})
        total += n
    x, y = RecordCollator(0, pack=True, block_size=seq)(recs)
    return {k: v[:rows] for k, v in x.items()}, y[:rows]


def _one(mode: str, seq: int, rows: int, steps: int, device: str) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from shardwise.models import varlen
    from shardwise.models.hf import HFCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = HFCausalLM(Qwen2ForCausalLM(cfg)).to(device=device, dtype=dtype)
    if mode == "varlen":
        varlen.enable(model)
    x, y = _batch(seq, rows, cfg.vocab_size)
    x, y = {k: v.to(device) for k, v in x.items()}, y.to(device)
    kernel = varlen.kernel(torch.device(device), dtype) if mode == "varlen" else "sdpa + 4-D mask"
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(steps):
        t = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), ignore_index=-100)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        model.zero_grad(set_to_none=True)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
    real = int((x["doc_ids"] >= 0).sum())
    best = min(times[1:] or times)
    return {"mode": mode, "kernel": kernel, "tokens_per_s": real / best, "peak_mib": peak, "loss": losses[0],
            "docs": int(x["doc_ids"].max()) + 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.one:
        print(json.dumps(_one(a.one, a.seq, a.rows, a.steps, device)))
        return
    results = []
    for mode in ("mask", "varlen"):
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--seq", str(a.seq), "--rows", str(a.rows),
                              "--steps", str(a.steps), "--device", device], capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"device {device}, seq {a.seq}, rows {a.rows}, {results[0]['docs']} documents in the first row")
    print(f"{'path':8} {'kernel':20} {'tokens/s':>10} {'peak MiB':>10} {'loss':>10}")
    for r in results:
        print(f"{r['mode']:8} {r['kernel']:20} {r['tokens_per_s']:10.0f} {r['peak_mib']:10.1f} {r['loss']:10.5f}")
    tol = 2e-2 if device == "cuda" else 1e-4
    if abs(results[0]["loss"] - results[1]["loss"]) > tol:
        sys.exit(f"the two paths' losses differ: {results[0]['loss']} vs {results[1]['loss']}")


if __name__ == "__main__":
    main()
