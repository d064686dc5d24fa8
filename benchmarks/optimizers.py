"""Muon and Adafactor vs AdamW on the lab model under FSDP: loss, step time, Muon's cost, state memory.

    OMP_NUM_THREADS=1 python benchmarks/optimizers.py --nproc 2 4 --steps 30

Per optimizer and rank count, the same character-level Tiny Shakespeare batches (global batch
``--batch``, the same at every rank count), warm-up + cosine at train.lr,
Muon with Moonlight's ``match_rms_adamw`` so it reuses AdamW's rate and weight decay. Reported:
the validation loss after the same number of tokens, the median step time after the first step,
the time in Muon's orthogonalisation (gather to owners + Newton-Schulz + scatter) per step, and the
optimizer-state bytes per rank from the memory ledger (Adafactor's factored state sharded like the
parameters: optim/adafactor.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _tokens() -> torch.Tensor:
    from shardwise.data.shakespeare import bundled_text_path

    text = bundled_text_path().read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def _batches(tokens: torch.Tensor, steps: int, rows: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens.numel() - seq - 1, (steps, rows), generator=g)
    return torch.stack([torch.stack([tokens[s:s + seq + 1] for s in row]) for row in starts])


def rank_fn(rank: int, world_size: int, optimizer: str, strategy: str, preset: str, steps: int,
            global_batch: int) -> dict:
    from shardwise.core.config import OptimizerConfig, ParallelConfig, TrainConfig
    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.optim.build import build_optimizer
    from shardwise.optim.schedule import set_lr
    from shardwise.runtime import ledger
    from shardwise.runtime.session import Session
    from shardwise.testing import lm_loss

    cfg = GPT_PRESETS[preset]
    session = Session(parallel=ParallelConfig(strategy=strategy), seed=0)
    torch.manual_seed(0)
    model = GPT(cfg)
    t = TrainConfig(steps=steps, lr=3e-3, min_lr=3e-4, warmup_steps=max(1, steps // 10))
    opt = build_optimizer(model, t, OptimizerConfig(name=optimizer), session.device)
    model, opt = session.prepare(model, opt)
    tokens = _tokens()
    split = int(0.9 * tokens.numel())
    train = _batches(tokens[:split], steps, global_batch, cfg.block_size, seed=1)
    val = _batches(tokens[split:], 4, global_batch, cfg.block_size, seed=2)
    per = global_batch // world_size
    times, muon = [], []
    for step in range(steps):
        set_lr(opt.param_groups, step, t)
        rows = train[step, rank * per:(rank + 1) * per]
        t0 = time.perf_counter()
        session.forward_backward(model, rows[:, :-1], rows[:, 1:], lm_loss)
        session.step(opt, max_norm=1.0)
        times.append(time.perf_counter() - t0)
        muon.append(getattr(opt, "muon_seconds", 0.0))
    losses = []
    with torch.no_grad():
        for b in val:
            rows = b[rank * per:(rank + 1) * per]
            losses.append(float(session.eval_loss(model, rows[:, :-1], rows[:, 1:], lm_loss)))
    out = {"val_loss": session.all_reduce(sum(losses) / len(losses), op="mean"),
           "step_s": statistics.median(times[1:]), "muon_s": statistics.median(muon[1:]),
           "optim_mib": ledger.optimizer_bytes(opt) / 2**20,
           "tokens": steps * global_batch * cfg.block_size}
    session.close()
    return out


def main() -> None:
    from shardwise.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--preset", default="lab")
    args = p.parse_args()
    print(f"{args.preset}, global batch {args.batch}, {args.steps} steps")
    print(f"{'ranks':>5} {'strategy':<6} {'optimizer':<9} {'val loss':>8} {'step s':>7} {'muon s':>7} "
          f"{'optim MiB/rank':>14} {'tokens':>8}")
    cases = [(n, "fsdp", o) for n in args.nproc for o in ("adamw", "muon", "adafactor")]
    for n, strategy, opt in cases:
        r = run_distributed(rank_fn, n, timeout_s=3000, optimizer=opt, strategy=strategy, preset=args.preset,
                            steps=args.steps, global_batch=args.batch)[0]
        print(f"{n:>5} {strategy:<6} {opt:<9} {r['val_loss']:>8.4f} {r['step_s']:>7.3f} {r['muon_s']:>7.3f} "
              f"{r['optim_mib']:>14.2f} {r['tokens']:>8}", flush=True)


if __name__ == "__main__":
    main()
