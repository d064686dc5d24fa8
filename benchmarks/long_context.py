"""Long sequences under context parallel: peak RSS per rank, predicted vs measured activation
bytes, and tokens/s, for a small GPT at several sequence lengths and cp degrees.

Each (seq, cp) case runs ``cp`` real processes (gloo on CPU, the harness of the tests) training
one sequence per step with ``strategy = fsdp`` and ``parallel.cp = cp``, fp32. "measured
activations" is the RSS a forward adds on top of the built, sharded model (what backward will
free); "predicted" is the planner's ``activation_bytes`` for ``seq / cp`` tokens (plan/cp.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py --seqs 4096 16384 --cps 1 2 4

``--impl ring``: ``parallel.cp_impl = ring`` (torch's load-balanced ring attention, parallel/context/ring.py)
instead of the all-to-all.

``--packed N``: every sequence is packed documents of N tokens (``doc_ids`` / ``position_ids``,
models.masking), so attention runs with the whole sequence's document mask (a dense ``seq^2``
bool per row on every rank, built by parallel.context.cp.chunk_batch under cp) instead of plain causal.
"""

from __future__ import annotations

import argparse
import resource
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, world: int, seq: int, steps: int, layers: int, hidden: int, heads: int,
          vocab: int, packed: int = 0, impl: str = "alltoall") -> dict:
    import torch

    from shardwise.core.config import ParallelConfig
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.runtime.session import Session
    from shardwise.workloads import cross_entropy_loss

    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden,
                    dropout=0.0, bias=False)
    strategy = "fsdp" if world > 1 else "single"
    session = Session(parallel=ParallelConfig(strategy=strategy, cp=world, cp_impl=impl), seed=0, loss_chunks="auto")
    model = session.build(lambda: GPT(cfg))
    model, opt = session.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (steps + 1, 1, seq + 1), generator=g)
    # Activations: RSS after this process's first forward minus before it (no backward yet; a
    # later forward would reuse memory the allocator kept from the previous step).
    from shardwise.loss import token_loss_context
    from shardwise.parallel.context.cp import split_sequence

    def inputs(x: torch.Tensor) -> object:
        if not packed:
            return x
        at = torch.arange(seq)
        return {"input_ids": x, "doc_ids": (at // packed)[None], "position_ids": (at % packed)[None]}

    x, y = data[0, :, :-1], data[0, :, 1:]
    before = _rss_mib()
    if packed and world > 1:
        from shardwise.parallel.context.cp import chunk_batch

        xs, ys = chunk_batch(inputs(x), y, session.cp_rank, world, session.cp_state)  # the mask counts too
    elif world > 1:
        xs, ys = (split_sequence(t, session.cp_rank, world, session.cp_impl) for t in (x, y))
    else:
        xs, ys = inputs(x), y
    with token_loss_context(model, cross_entropy_loss, ys) as loss_fn:
        loss = loss_fn(model(xs), ys)
    act_mib = _rss_mib() - before
    loss.backward()
    del loss
    session.step(opt)
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        session.forward_backward(model, inputs(data[s, :, :-1]), data[s, :, 1:], cross_entropy_loss)
        session.step(opt)
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_rss_mib": peak, "act_mib": act_mib, "tokens_per_s": steps * seq / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--packed", type=int, default=0, metavar="N",
                   help="pack documents of N tokens per sequence (document mask + positions); 0: plain causal")
    p.add_argument("--impl", choices=("alltoall", "ring"), default="alltoall", help="parallel.cp_impl at cp > 1")
    args = p.parse_args()

    from shardwise.models.gpt import GPTConfig
    from shardwise.plan.memory import activation_bytes
    from shardwise.plan.spec import from_gpt_config
    from shardwise.testing import run_distributed

    print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab {args.vocab}; fp32, "
          f"one sequence per step, fsdp over the cp ranks, cp_impl {args.impl}"
          f"{f'; packed documents of {args.packed} tokens (dense document mask)' if args.packed else ''}")
    print(f"{'seq':>6} {'cp':>3} {'peak RSS/rank MiB':>18} {'act measured MiB':>17} {'act predicted MiB':>18} "
          f"{'tokens/s':>9}")
    for seq in args.seqs:
        spec = from_gpt_config(GPTConfig(vocab_size=args.vocab, block_size=seq, n_layer=args.layers,
                                         n_head=args.heads, n_embd=args.hidden, bias=False))
        for cp in args.cps:
            predicted = activation_bytes(spec, seq // cp, 1, 4).saved / 2**20
            try:
                rows = run_distributed(_rank, cp, timeout_s=args.timeout, seq=seq, steps=args.steps,
                                       layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                                       packed=args.packed, impl=args.impl)
            except Exception as e:  # one case failing (memory, time) must not hide the others
                print(f"{seq:>6} {cp:>3} failed: {str(e).splitlines()[0][:100]}")
                continue
            print(f"{seq:>6} {cp:>3} {max(r['peak_rss_mib'] for r in rows):>18.0f} "
                  f"{max(r['act_mib'] for r in rows):>17.0f} {predicted:>18.0f} {rows[0]['tokens_per_s']:>9.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
