"""A ZeRO-1 run on more ranks than the model has parameters (tests/test_checkpoint.py)."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.core.config import ParallelConfig
from shardwise.runtime.session import Session
from shardwise.testing import default_dtype


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def zero1_small(rank: int, world_size: int, strategy: str, steps: range, save: str = "", load: str = "") -> dict:
    """Train an ``nn.Linear(4, 4)`` (two tensors: with 4 ranks, two ZeRO-1 ranks own none) on fixed
    global batches; optionally resume from ``load`` first and save to ``save`` after the last step."""
    with default_dtype(torch.float64):
        session = Session(parallel=ParallelConfig(strategy=strategy), seed=0)
        model = session.build(lambda: nn.Linear(4, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = session.prepare(model, opt)
        if load:
            session.load(load, model, opt)
        losses = []
        for step in steps:
            x, y = _batches(step)
            rows = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
            loss = session.forward_backward(model, x[rows], y[rows], lambda o, t: ((o - t) ** 2).mean())
            session.step(opt)
            losses.append(float(loss))
        if save:
            session.save(save, model, opt)
        params = {n: p.detach().clone() for n, p in session.unwrap(model).named_parameters()}
        session.close()
        return {"losses": losses, "params": params}
