"""Checkpoint save/load time, and the time a save blocks training, per strategy and mode (figures, not a test).

    .venv/bin/python benchmarks/checkpoint_io.py --strategies ddp,fsdp --nproc 2 --preset lab
    .venv/bin/python benchmarks/checkpoint_io.py --strategies fsdp --modes sync,async --n-layer 20 \\
        --n-embd 2048 --optimizer sgd --train-steps 0 --repeat 2      # ~1.0B parameters

Builds the GPT preset (or ``--n-layer``/``--n-embd`` on top of it) on N gloo ranks (real
processes, the test harness), takes one optimizer step so the optimizer state exists (AdamW; SGD
without momentum has none, for a model whose AdamW state would not fit), then per mode
(``sync``, ``async``, ``async-pinned``) times ``--repeat`` saves:

* blocked: how long ``Session.save`` kept the caller (the whole write when sync; waiting and
  taking the state when async) plus, when async, how long the next optimizer step waited for the
  copy to host memory to finish (it runs beside the steps' forward and backward) — the slowest rank;
* write: the background write until published (async), from ``Session.background_saves``;
* steps/s while a write is in flight: training steps run after an async save returns, until it is
  published, against steps/s with no write (``--train-steps`` > 0).

``async-pinned`` differs from ``async`` only on CUDA (pinned host buffers, non-blocking copies);
on the CPU it is the same code path and its rows are the same measurement again.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path


def _rank_fn(rank: int, world_size: int, strategy: str, preset: str, root: str, repeat: int, modes: list[str],
             n_layer: int, n_embd: int, optimizer: str, train_steps: int) -> dict:
    import torch

    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.runtime.session import Session

    torch.manual_seed(0)
    cfg = GPT_PRESETS[preset]
    if n_layer or n_embd:
        cfg = dataclasses.replace(cfg, n_layer=n_layer or cfg.n_layer, n_embd=n_embd or cfg.n_embd,
                                  n_head=max(1, (n_embd or cfg.n_embd) // 64), block_size=min(cfg.block_size, 64))
    session = Session(strategy)
    model = session.build(lambda: GPT(cfg))
    params = sum(p.numel() for p in model.parameters())
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
            # one state tensor per parameter: half of AdamW's, for a model whose AdamW state would not fit
            "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3)}[optimizer]
    model, opt = session.prepare(model, make)
    x = torch.randint(0, cfg.vocab_size, (1, cfg.block_size), device=session.device)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        session.backward(loss)
        session.step(opt)

    if optimizer != "sgd" or train_steps:
        step()
    idle_sps = 0.0
    if train_steps:
        session.barrier()
        t0 = time.perf_counter()
        for _ in range(train_steps):
            step()
        idle_sps = train_steps / (time.perf_counter() - t0)
    out: dict = {"params": params, "idle_steps_per_s": idle_sps}
    n = 0
    for mode in modes:
        session.set_checkpoint_mode(mode)
        blocked, writes, during = [], [], []
        for _ in range(repeat):
            n += 1
            session.barrier()
            waited0 = session.checkpoint_stats["staging_wait_s_total"]
            result = session.save(root, model, opt, step=n, keep_last=1)
            blocked.append(session.last_save_blocked_s)
            if mode != "sync":
                steps, t0 = 0, time.perf_counter()
                while train_steps and not result.done() and steps < 10 * train_steps:
                    step()
                    steps += 1
                if steps:
                    during.append(steps / (time.perf_counter() - t0))
                session.wait_checkpoint()
                writes.append(session.background_saves[-1]["write_s"])
                # The copy to host memory runs beside the next steps; the first optimizer step (or,
                # with no steps, the wait above) waits for what is left of it: blocked time too.
                blocked[-1] += session.checkpoint_stats["staging_wait_s_total"] - waited0
        out[mode] = {"blocked_s": blocked, "write_s": writes, "steps_per_s_during_write": during}
    path = Path(root) / f"step-{n:08d}"
    out["bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    out["staging_bytes"] = session.checkpoint_stats["staging_bytes"]
    t0 = time.perf_counter()
    session.load(path, model, opt)
    out["load_s"] = time.perf_counter() - t0
    session.close()
    return out


def main() -> int:
    from shardwise.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="ddp,fsdp")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--preset", default="lab")
    p.add_argument("--n-layer", type=int, default=0)
    p.add_argument("--n-embd", type=int, default=0)
    # sgd keeps no state, and DCP then builds one at every save (get_optimizer_state_dict runs a
    # zero-gradient step when the optimizer's state is empty): that cost is inside "blocked".
    p.add_argument("--optimizer", choices=("adamw", "sgd", "sgd-momentum"), default="adamw")
    p.add_argument("--modes", default="sync,async,async-pinned")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=3, help="steps timed without a write (0: none)")
    args = p.parse_args()
    modes = args.modes.split(",")
    print("| strategy | ranks | params | size MiB | staging MiB/rank | mode | blocked s (min / max) | "
          "write s (min / max) | steps/s idle / during write | load s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for strategy in args.strategies.split(","):
        root = tempfile.mkdtemp(prefix="shardwise-ckpt-bench-")
        try:
            res = run_distributed(_rank_fn, args.nproc, timeout_s=3000, collective_timeout_s=1800,
                                  strategy=strategy, preset=args.preset, root=root, repeat=args.repeat,
                                  modes=modes, n_layer=args.n_layer, n_embd=args.n_embd,
                                  optimizer=args.optimizer, train_steps=args.train_steps)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        r0 = res[0]
        for mode in modes:
            blocked = [max(r[mode]["blocked_s"][i] for r in res) for i in range(args.repeat)]  # slowest rank
            writes = [max(r[mode]["write_s"][i] for r in res) for i in range(len(r0[mode]["write_s"]))]
            during = r0[mode]["steps_per_s_during_write"]
            w = f"{min(writes):.2f} / {max(writes):.2f}" if writes else "-"
            sps = (f"{r0['idle_steps_per_s']:.2f} / {sum(during) / len(during):.2f}" if during else
                   (f"{r0['idle_steps_per_s']:.2f} / 0 (blocked)" if args.train_steps else "-"))
            print(f"| {strategy} | {args.nproc} | {r0['params'] / 1e6:.0f}M | {r0['bytes'] / 2**20:.0f} | "
                  f"{r0['staging_bytes'] / 2**20:.0f} | {mode} | {min(blocked):.2f} / {max(blocked):.2f} | {w} | "
                  f"{sps} | {max(r['load_s'] for r in res):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
