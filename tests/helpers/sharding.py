"""Rank functions for the sharding tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardwise.core.config import ParallelConfig
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime import ledger
from shardwise.runtime.session import Session
from shardwise.testing import default_dtype, fixed_batches, train_fixed_batches
from shardwise.verify import full_state_dict
from tests.helpers.dist import count_allreduces, per_step_counts


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
          count_comms: bool = False, overrides: dict | None = None, grad_sync: str = "step",
          dtype: str = "float32") -> dict:
    """Train a GPT preset with AdamW on fixed batches; this rank reads its slice of each global batch.

    Returns per-step global losses, the final full parameters (on every rank), this rank's ledger
    entry and, with ``count_comms``, the gradient collectives issued per optimizer step. ``dtype``
    is the model's (float64 for parity: see ``shardwise.testing.default_dtype``).
    """
    with default_dtype(getattr(torch, dtype)):
        return _train(rank, world_size, strategy, steps, global_batch, accum, preset, precision, ac, ac_every,
                      wrap, hsdp_shard_size, lr, count_comms, overrides, grad_sync)


def _train(rank: int, world_size: int, strategy: str, steps: int, global_batch: int, accum: int, preset: str,
           precision: str, ac: str, ac_every: int, wrap: str, hsdp_shard_size: int, lr: float,
           count_comms: bool, overrides: dict | None, grad_sync: str) -> dict:
    cfg = GPT_PRESETS[preset]
    if overrides:
        import dataclasses

        cfg = dataclasses.replace(cfg, **overrides)
    options = ParallelConfig(strategy=strategy, precision=precision, activation_checkpointing=ac,
                             ac_every=ac_every, wrap=wrap, hsdp_shard_size=hsdp_shard_size, grad_sync=grad_sync)
    session = Session(parallel=options, grad_accum_steps=accum, seed=0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    model, opt = session.prepare(model, opt)
    calls: list[int] = []
    if count_comms and hasattr(model, "register_comm_hook"):  # DDP (and zero1): one call per bucket
        count_allreduces(model, calls)
    comms_per_step, count = per_step_counts(calls)
    data = fixed_batches(steps, global_batch, cfg.block_size, cfg.vocab_size)
    with count_reduce_scatters(calls) if count_comms else contextlib.nullcontext():
        losses = train_fixed_batches(session, model, opt, data, after_step=count)["losses"]
    params = full_state_dict(model)
    entry = ledger.rank_ledger(session, model, opt)
    session.close()
    return {"losses": losses, "params": params, "ledger": entry, "comms_per_step": comms_per_step,
            "dp_size": session.dp_size}


def train_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Run several ``train`` configurations one after another in the same ranks (one spawn)."""
    return [train(rank, world_size, **case) for case in cases]
