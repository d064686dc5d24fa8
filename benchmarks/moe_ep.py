"""fsdp vs fsdp + expert parallelism on the MoE preset: step time, peak RSS, dispatch overhead.

    OMP_NUM_THREADS=1 python benchmarks/moe_ep.py --nproc 2 --steps 6 --preset moe-lab

One spawn per case (peak RSS is per process lifetime). Per rank: median step time over the steps
after the first (warm-up), peak resident memory, parameter bytes, and under EP the time spent in
the token dispatch/combine hooks (counts exchange, all-to-alls, permutations) per step.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch


def rank_fn(rank: int, world_size: int, preset: str, steps: int, batch: int, ep: int) -> dict:
    from shardwise.core.config import ParallelConfig
    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.models.moe import with_aux_loss
    from shardwise.runtime import ledger
    from shardwise.runtime.session import Session
    from shardwise.testing import fixed_batches, lm_loss

    cfg = GPT_PRESETS[preset]
    session = Session(parallel=ParallelConfig(strategy="fsdp", ep=ep), seed=0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = session.prepare(model, opt)
    dispatch_s = [0.0]
    for m in model.modules():
        d = getattr(m, "ep_dispatcher", None)
        if d is None:
            continue
        for name in ("dispatch", "combine"):
            fn = getattr(d, name)

            def timed(*a: object, _fn=fn) -> object:
                t0 = time.perf_counter()
                out = _fn(*a)
                dispatch_s[0] += time.perf_counter() - t0
                return out
            # The hooks were registered with the bound methods: swap the hook dicts' entries.
            for hooks in (m._forward_pre_hooks, m._forward_hooks):
                for k, h in list(hooks.items()):
                    if getattr(h, "__func__", None) is getattr(fn, "__func__", None) and h.__self__ is d:
                        hooks[k] = timed
    data = fixed_batches(steps, batch * world_size, cfg.block_size, cfg.vocab_size)
    loss_fn = with_aux_loss(lm_loss)
    times, disp = [], []
    for step in range(steps):
        rows = data[step, rank * batch:(rank + 1) * batch]
        dispatch_s[0] = 0.0
        t0 = time.perf_counter()
        session.forward_backward(model, rows[:, :-1], rows[:, 1:], loss_fn)
        session.step(opt, max_norm=1.0)
        times.append(time.perf_counter() - t0)
        disp.append(dispatch_s[0])
    out = {"step_s": statistics.median(times[1:]), "dispatch_s": statistics.median(disp[1:]),
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "param_mib": ledger.param_bytes(model) / 2**20}
    session.close()
    return out


def main() -> None:
    from shardwise.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--preset", default="moe-lab")
    args = p.parse_args()
    print(f"{args.preset}, {args.nproc} ranks, {args.batch} sequences/rank, median of {args.steps - 1} steps")
    print(f"{'case':<14} {'step s':>8} {'dispatch s':>10} {'peak RSS MiB (per rank)':>26} {'params MiB':>10}")
    for ep in (1, args.nproc):
        ranks = run_distributed(rank_fn, args.nproc, timeout_s=1200, preset=args.preset, steps=args.steps,
                                batch=args.batch, ep=ep)
        name = "fsdp" if ep == 1 else f"fsdp+ep{ep}"
        rss = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in ranks)
        print(f"{name:<14} {max(r['step_s'] for r in ranks):>8.3f} {max(r['dispatch_s'] for r in ranks):>10.3f} "
              f"{rss:>26} {ranks[0]['param_mib']:>10.1f}")


if __name__ == "__main__":
    main()
