"""The few collectives shardwise's own bookkeeping needs, and one rule: errors raise on every rank.

A check that fails on one rank only (a missing file, a bad shape) must not leave the other ranks
waiting in the next collective until the timeout. Each rank computes its own error (or None), the
errors are gathered, and every rank raises the first one: ``raise_on_every_rank``.

Without a process group (one process, ``ckpt export``) every helper degrades to the local answer.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from shardwise.errors import ShardwiseError


def distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if distributed() else 1


def barrier(group: Any = None) -> None:
    if distributed():
        dist.barrier(group=group)


def gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, on every rank (a one-item list without a process group).

    ``group``: a process group over all ranks other than the default one (a background
    checkpoint write gathers on its own group while training uses the default).
    """
    if not distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def raise_on_every_rank(error: str | None, error_type: type[ShardwiseError] = ShardwiseError) -> None:
    """Gather every rank's ``error`` (None: fine); if any rank has one, raise the first everywhere.

    A collective: every rank must call it, with or without an error of its own.
    """
    for err in gather(error):
        if err:
            raise error_type(err)


def first_error(errors: list[str | None], error_type: type[ShardwiseError] = ShardwiseError) -> None:
    """Raise the first non-empty entry of already-gathered ``errors`` (same on every rank)."""
    for err in errors:
        if err:
            raise error_type(err)
