"""Test-only fault injection for I/O failures that a test cannot cause for real without root.

``SHARDWISE_DEBUG_DISK_FULL="step=N[,rank=R][,stage=shards|manifest][,bytes=B]"`` makes the checkpoint
save of step N fail with ``ENOSPC`` exactly as a full disk does: at stage ``shards`` (the default) the
rank's DCP storage writer writes part of a shard file (``B`` bytes, default 4096: where the disk
filled up) and then fails inside DCP (which turns it
into a ``CheckpointException`` on every rank, as for a real full disk); at stage ``manifest`` rank
0's manifest write fails (``fsutil.atomic_write_text``). Without ``rank`` every rank fails. The
variable is read per save, so a test can set it for one run only; unset, nothing changes.

``SHARDWISE_DEBUG_SIGNAL="step=N[,rank=R][,signal=TERM|INT]"`` makes the rank (every rank, or
rank R) send itself SIGTERM (default) or SIGINT right after step N (its checkpoint, if any, is
saved first), as a scheduler or Ctrl-C would: the run must then save at its next logging step and
exit 130. Read after every step; the run-time fault fuzzer (tests/test_fuzz_faults.py) uses both.

``SHARDWISE_DEBUG_SLOW="rank=R,phase=data|forward,seconds=S"`` makes rank R slow on every step: it
sleeps S seconds before each batch it takes from the data loader (``data``) or at the start of its
model's forward (``forward``), as a slow disk or a slower GPU would. The step-phase report
(observe/step_phases.py) must then name that rank and phase.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DISK_FULL_ENV = "SHARDWISE_DEBUG_DISK_FULL"
SIGNAL_ENV = "SHARDWISE_DEBUG_SIGNAL"
SLOW_ENV = "SHARDWISE_DEBUG_SLOW"


def _spec_at(env: str, step: int, rank: int) -> dict[str, str] | None:
    """The fault spec in ``env`` when it names this ``step`` (and ``rank``, if it names one)."""
    text = os.environ.get(env, "")
    if not text:
        return None
    spec = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    try:
        if int(spec.get("step", "-1")) != step:
            return None
        if "rank" in spec and int(spec["rank"]) != rank:
            return None
    except ValueError:
        return None
    return spec


def disk_full_at(step: int, rank: int, stage: str) -> bool:
    """Whether the test asked for a full disk at this save ``step``, ``rank`` and ``stage``."""
    spec = _spec_at(DISK_FULL_ENV, step, rank)
    return spec is not None and spec.get("stage", "shards") == stage


def signal_after_step(step: int, rank: int) -> None:
    """Send this process the signal the test asked for after ``step`` on ``rank`` (if any)."""
    spec = _spec_at(SIGNAL_ENV, step, rank)
    if spec is not None:
        os.kill(os.getpid(), signal.SIGINT if spec.get("signal", "TERM").upper() == "INT" else signal.SIGTERM)


def disk_full(path: str | os.PathLike) -> OSError:
    """The error a write into ``path`` raises on a full disk."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def storage_writer(path: Path, step: int, rank: int) -> Any:
    """DCP's FileSystemWriter for ``path``; one that runs out of space when the test asked for it."""
    from torch.distributed.checkpoint import FileSystemWriter  # defers torch

    if not disk_full_at(step, rank, "shards"):
        return FileSystemWriter(path, sync_files=True)
    spec = _spec_at(DISK_FULL_ENV, step, rank) or {}
    written = int(spec["bytes"]) if spec.get("bytes", "").isdigit() else 4096

    class FullDiskWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            # Part of a shard lands on disk before the device fills up, as in real life.
            target = Path(path) / f"__{rank}_0.distcp"
            with open(target, "wb") as f:
                f.write(b"\0" * written)
            raise disk_full(target)

    return FullDiskWriter(path, sync_files=True)


def slow_rank(batches: Iterator[Any], model: Any, rank: int) -> Iterator[Any]:
    """``batches``, delayed on the rank ``SHARDWISE_DEBUG_SLOW`` names (its model's forward delayed instead
    with ``phase=forward``); unchanged everywhere else."""
    text = os.environ.get(SLOW_ENV, "")
    spec = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    try:
        if not spec or int(spec.get("rank", "-1")) != rank:
            return batches
        seconds = float(spec.get("seconds", "0.2"))
    except ValueError:
        return batches
    if spec.get("phase", "data") == "forward":
        model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))
        return batches

    def slow() -> Iterator[Any]:
        for batch in batches:
            time.sleep(seconds)
            yield batch

    return slow()
