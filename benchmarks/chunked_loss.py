"""Peak memory and step time of one forward+backward with the dense head + loss vs chunked
(``train.loss_chunks``), on a GPT whose vocabulary dominates (the Llama-3 shape in small).

Each variant runs in a fresh process, so its peak RSS (``ru_maxrss``) is its own; on CUDA the
peak allocated bytes are printed as well. Prints one line per variant and the saving.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/chunked_loss.py --vocab 32768 --seq 2048 --batch 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def run_one(args: argparse.Namespace) -> dict:
    import torch

    from shardwise.loss import install_chunked_head, token_loss_context
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.workloads import cross_entropy_loss

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4,
                    n_embd=args.hidden, dropout=0.0, bias=False)
    model = GPT(cfg).to(device)
    if args.chunks != "0":
        assert install_chunked_head(model, args.chunks).enabled
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        with token_loss_context(model, cross_entropy_loss, y) as loss_fn:
            loss = loss_fn(model(x), y)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"chunks": args.chunks, "loss": float(loss), "step_s": min(times),
           "peak_rss_mib": peak / 1024, "step_rss_mib": (peak - base) / 1024}
    if device.type == "cuda":
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--variants", default="0,auto,16")
    p.add_argument("--chunks", default=None, help=argparse.SUPPRESS)  # one variant, in a child
    args = p.parse_args()
    if args.chunks is not None:
        print(json.dumps(run_one(args)))
        return
    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    print(f"GPT {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch {args.batch} x seq "
          f"{args.seq}: dense fp32 logits = {logits_mib:.0f} MiB")
    rows = []
    for chunks in args.variants.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--chunks", chunks]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
        r = rows[-1]
        cuda = f", peak CUDA {r['peak_cuda_mib']:.0f} MiB" if "peak_cuda_mib" in r else ""
        print(f"loss_chunks={chunks:>5}: loss {r['loss']:.6f}, fwd+bwd {r['step_s']:.2f} s, peak RSS "
              f"{r['peak_rss_mib']:.0f} MiB (+{r['step_rss_mib']:.0f} MiB over the built model){cuda}")
    for r in rows[1:]:
        print(f"loss_chunks={r['chunks']}: peak RSS {rows[0]['peak_rss_mib'] - r['peak_rss_mib']:+.0f} MiB saved, "
              f"loss difference {abs(r['loss'] - rows[0]['loss']):.2e}")


if __name__ == "__main__":
    main()
