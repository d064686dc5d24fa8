"""Your own training loop on the shardwise Session API.

Run it on 2 ranks with either of:
    shardwise launch --nproc 2 examples/user_loop.py --steps 20
    torchrun --nproc-per-node=2 examples/user_loop.py --steps 20
or as one plain process: python examples/user_loop.py
"""

import argparse
import json

import torch

from shardwise import Session
from shardwise.data.shakespeare import load_shakespeare
from shardwise.models.gpt import GPT, GPT_PRESETS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--result", default="", help="write final metrics here as JSON (rank 0)")
    args = parser.parse_args()

    with Session(strategy=args.strategy, grad_accum_steps=args.accum, seed=0) as session:
        cfg = GPT_PRESETS["nano"]
        train_set, _, _ = load_shakespeare("", cfg.block_size, 0.1)
        model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, optimizer = session.prepare(model, optimizer)
        loader = session.dataloader(train_set, batch_size=16)
        loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731

        bar = session.progress(args.steps, desc="user-loop")
        step, batches = 0, loader.forever()
        while step < args.steps:
            for _ in range(session.grad_accum_steps):
                x, y = next(batches)
                loss = session.forward_backward(model, x.to(session.device), y.to(session.device), loss_fn)
            session.step(optimizer, max_norm=1.0)
            step += 1
            mean_loss = session.all_reduce(loss, op="mean")
            bar.update(1, loss=float(mean_loss))
        bar.close()
        session.print(f"final loss {float(mean_loss):.4f} on {session.world_size} rank(s)")
        if args.result and session.is_main:
            with open(args.result, "w") as f:
                json.dump({"loss": float(mean_loss), "world_size": session.world_size,
                           "strategy": session.strategy_name, "epoch": loader.epoch}, f)


if __name__ == "__main__":
    main()
