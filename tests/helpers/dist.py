"""Functions that run inside spawned ranks (module-level so spawn can import them)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.core.config import ParallelConfig
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime.session import Session
from shardwise.testing import fixed_batches, train_fixed_batches


def boom(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one exploded")
    dist.barrier()  # rank 0 waits here; the harness must kill it rather than hang


def sleepy(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)
    dist.barrier()


def echo(rank: int, world_size: int, value: int) -> tuple[int, int]:
    t = torch.tensor([rank + value])
    dist.all_reduce(t)
    return rank, int(t)


def count_allreduces(model: torch.nn.Module, calls: list[int]) -> None:
    """Append to ``calls`` once per gradient bucket all-reduced by DDP (or zero1's DDP)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def counting_hook(state, bucket):
        calls.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)


def per_step_counts(calls: list[int]) -> tuple[list[int], Callable[[int], None]]:
    """(counts, after_step): ``after_step`` appends how many entries ``calls`` gained this step."""
    counts: list[int] = []
    seen = [0]

    def after_step(step: int) -> None:
        counts.append(len(calls) - seen[0])
        seen[0] = len(calls)

    return counts, after_step


def train_losses(rank: int, world_size: int, strategy: str = "ddp", steps: int = 5,
                 global_batch: int = 8, accum: int = 1, preset: str = "nano",
                 count_allreduce: bool = False, precision: str = "fp32") -> dict:
    """Train the GPT preset on fixed batches with a user-style loop (accumulate/autocast/backward)."""
    cfg = GPT_PRESETS[preset]
    session = Session(parallel=ParallelConfig(strategy=strategy, precision=precision),
                      grad_accum_steps=accum, seed=0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = session.prepare(model, opt)
    calls: list[int] = []
    if count_allreduce:
        count_allreduces(model, calls)
    allreduce_per_step, count = per_step_counts(calls)
    data = fixed_batches(steps, global_batch, cfg.block_size, cfg.vocab_size)
    run = train_fixed_batches(session, model, opt, data, explicit_loop=True, after_step=count)
    params = {n: p.detach().clone() for n, p in session.unwrap(model).state_dict().items()}
    session.close()
    return {"losses": run["losses"], "params": params, "allreduce_per_step": allreduce_per_step}


def reduce_metrics(rank: int, world_size: int) -> dict:
    session = Session(seed=0)
    value = float(rank + 1)
    out = {op: session.all_reduce(value, op=op) for op in ("mean", "sum", "max", "min")}
    out["tensor"] = session.all_reduce(torch.tensor([value, 2 * value]), op="sum").tolist()
    out["broadcast"] = session.broadcast_object({"from": rank}, src=1)
    out["is_main"] = session.is_main
    out["strategy"] = session.strategy_name
    # Every rank initialised the same weights from the shared seed.
    out["init"] = GPT(GPT_PRESETS["nano"]).lm_head.weight.sum().item()
    session.close()
    return out


def env_of(rank: int, world_size: int, names: tuple[str, ...]) -> dict[str, str | None]:
    """The values of ``names`` in this rank's environment."""
    import os

    return {name: os.environ.get(name) for name in names}


def segfault_once(rank: int, world_size: int, marker: str) -> int:
    """Rank 1 dies of SIGSEGV the first time (``marker`` does not exist yet), as gloo's transport
    thread once did under load; its peer then sees the connection close. Every later run succeeds."""
    import os
    import signal
    from pathlib import Path

    if rank == 1 and not Path(marker).exists():
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return rank


def segfault_always(rank: int, world_size: int) -> None:
    import os
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
