"""Rank functions for the sharding tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import count_allreduces, global_batches

from shardwise.config import ParallelConfig
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime import ledger
from shardwise.runtime.session import Session
from shardwise.verify import full_state_dict


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@contextlib.contextmanager
def count_reduce_scatters(calls: list[int]) -> Iterator[None]:
    """Count FSDP2's gradient reduce-scatters (it calls torch.distributed.reduce_scatter_single)."""
    original = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        yield
    finally:
        dist.reduce_scatter_single = original


def train(rank: int, world_size: int, strategy: str = "single", steps: int = 5, global_batch: int = 8,
          accum: int = 1, preset: str = "nano", precision: str = "fp32", ac: str = "none",
          ac_every: int = 2, wrap: str = "block", hsdp_shard_size: int = 0, lr: float = 1e-3,
          count_comms: bool = False, overrides: dict | None = None) -> dict:
    """Train a GPT preset with AdamW on fixed batches; this rank reads its slice of each global batch.

    Returns per-step global losses, the final full parameters (on every rank), this rank's ledger
    entry and, with ``count_comms``, the gradient collectives issued per optimizer step.
    """
    cfg = GPT_PRESETS[preset]
    if overrides:
        import dataclasses

        cfg = dataclasses.replace(cfg, **overrides)
    options = ParallelConfig(strategy=strategy, precision=precision, activation_checkpointing=ac,
                             ac_every=ac_every, wrap=wrap, hsdp_shard_size=hsdp_shard_size)
    session = Session(parallel=options, grad_accum_steps=accum, seed=0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    model, opt = session.prepare(model, opt)
    calls: list[int] = []
    if count_comms and hasattr(model, "register_comm_hook"):  # DDP (and zero1): one call per bucket
        count_allreduces(model, calls)
    data = global_batches(steps, global_batch, cfg.block_size, cfg.vocab_size)
    per_rank = global_batch // session.dp_size
    micro = per_rank // accum
    losses, comms_per_step = [], []
    counter = count_reduce_scatters(calls) if count_comms else contextlib.nullcontext()
    with counter:
        for step in range(steps):
            mine = data[step, session.dp_rank * per_rank:(session.dp_rank + 1) * per_rank]
            before = len(calls)
            total = 0.0
            for a in range(accum):
                chunk = mine[a * micro:(a + 1) * micro]
                loss = session.forward_backward(model, chunk[:, :-1], chunk[:, 1:], _lm_loss)
                total += float(loss) / accum
            session.step(opt)
            comms_per_step.append(len(calls) - before)
            losses.append(session.all_reduce(total, op="mean"))
    params = full_state_dict(model)
    entry = ledger.rank_ledger(session, model, opt)
    session.close()
    return {"losses": losses, "params": params, "ledger": entry, "comms_per_step": comms_per_step,
            "dp_size": session.dp_size}


def train_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Run several ``train`` configurations one after another in the same ranks (one spawn)."""
    return [train(rank, world_size, **case) for case in cases]


# ---------------------------------------------------------------- a user's own model and data
class MLPBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class ResidualMLP(torch.nn.Module):
    """A classifier that is not a GPT: input projection, repeated blocks, output head."""

    def __init__(self, n_in: int = 12, width: int = 32, depth: int = 3, n_classes: int = 5) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(n_in, width)
        self.layers = torch.nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build_mlp(**kwargs) -> torch.nn.Module:
    """model.factory for the custom-model verify test."""
    return ResidualMLP(**kwargs)


def build_blobs() -> tuple:
    """data.factory for the custom-model verify test: (train, val) random classification sets."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 12, generator=g)
    y = (x[:, :5].argmax(dim=1) + (x[:, 5] > 0).long()) % 5
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.Subset(ds, range(448)), torch.utils.data.Subset(ds, range(448, 512))


def build_mlp_not_on_meta(**kwargs) -> torch.nn.Module:
    """A model.factory that, like one filling weights from numpy, cannot run on the meta device."""
    if torch.empty(0).device.type == "meta":
        raise RuntimeError("this factory needs real tensors")
    return ResidualMLP(**kwargs)
