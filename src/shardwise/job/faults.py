"""Test-only fault injection for I/O failures that a test cannot cause for real without root.

``SHARDWISE_DEBUG_DISK_FULL="step=N[,rank=R][,stage=shards|manifest]"`` makes the checkpoint save
of step N fail with ``ENOSPC`` exactly as a full disk does: at stage ``shards`` (the default) the
rank's DCP storage writer writes part of a shard file and then fails inside DCP (which turns it
into a ``CheckpointException`` on every rank, as for a real full disk); at stage ``manifest`` rank
0's manifest write fails (``fsutil.atomic_write_text``). Without ``rank`` every rank fails. The
variable is read per save, so a test can set it for one run only; unset, nothing changes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

DISK_FULL_ENV = "SHARDWISE_DEBUG_DISK_FULL"


def disk_full_at(step: int, rank: int, stage: str) -> bool:
    """Whether the test asked for a full disk at this save ``step``, ``rank`` and ``stage``."""
    text = os.environ.get(DISK_FULL_ENV, "")
    if not text:
        return False
    spec = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    try:
        if int(spec.get("step", "-1")) != step:
            return False
        if "rank" in spec and int(spec["rank"]) != rank:
            return False
    except ValueError:
        return False
    return spec.get("stage", "shards") == stage


def disk_full(path: str | os.PathLike) -> OSError:
    """The error a write into ``path`` raises on a full disk."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def storage_writer(path: Path, step: int, rank: int) -> Any:
    """DCP's FileSystemWriter for ``path``; one that runs out of space when the test asked for it."""
    from torch.distributed.checkpoint import FileSystemWriter

    if not disk_full_at(step, rank, "shards"):
        return FileSystemWriter(path, sync_files=True)

    class FullDiskWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            # Part of a shard lands on disk before the device fills up, as in real life.
            target = Path(path) / f"__{rank}_0.distcp"
            with open(target, "wb") as f:
                f.write(b"\0" * 4096)
            raise disk_full(target)

    return FullDiskWriter(path, sync_files=True)
