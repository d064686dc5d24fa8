"""Sharded checkpoint save/load time and size per strategy (issue figures, not a test).

    .venv/bin/python benchmarks/checkpoint_io.py --strategies ddp,fsdp --nproc 2 --preset lab

Builds the GPT preset on N gloo ranks (real processes, the test harness), takes one optimizer
step so AdamW state exists, then times ``Session.save`` and ``Session.load`` ``--repeat`` times.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def _rank_fn(rank: int, world_size: int, strategy: str, preset: str, root: str, repeat: int) -> dict:
    import torch

    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.runtime.session import Session

    torch.manual_seed(0)
    cfg = GPT_PRESETS[preset]
    session = Session(strategy)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = session.prepare(model, opt)
    x = torch.randint(0, 65, (2, cfg.block_size), device=session.device)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    session.backward(loss)
    session.step(opt)
    saves, loads = [], []
    for i in range(repeat):
        session.barrier()
        t0 = time.perf_counter()
        path = session.save(root, model, opt, step=i + 1, keep_last=1)
        saves.append(time.perf_counter() - t0)
        session.barrier()
        t0 = time.perf_counter()
        session.load(path, model, opt)
        loads.append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return {"save_s": saves, "load_s": loads, "bytes": size}


def main() -> int:
    from shardwise.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="lab")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print("| strategy | ranks | size MiB | save s (min / max) | load s (min / max) |")
    print("|---|---|---|---|---|")
    for strategy in args.strategies.split(","):
        root = tempfile.mkdtemp(prefix="shardwise-ckpt-bench-")
        try:
            res = run_distributed(_rank_fn, args.nproc, timeout_s=900, collective_timeout_s=600,
                                  strategy=strategy, preset=args.preset, root=root, repeat=args.repeat)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        save = [max(r["save_s"][i] for r in res) for i in range(args.repeat)]  # slowest rank
        load = [max(r["load_s"][i] for r in res) for i in range(args.repeat)]
        print(f"| {strategy} | {args.nproc} | {res[0]['bytes'] / 2**20:.1f} | {min(save):.2f} / {max(save):.2f} "
              f"| {min(load):.2f} / {max(load):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
