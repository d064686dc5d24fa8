"""Saving: every rank writes its shards into ``.partial-step-N``; rank 0 publishes atomically.

Once every shard is on disk, rank 0 writes the manifest and renames the directory to ``step-N`` (a
rename is atomic on POSIX file systems), then replaces ``latest``. A kill at any point therefore
leaves ``latest`` naming the previous complete checkpoint, and a partial directory is never
mistaken for one.

Every save records its job (the launch id) in the manifest and names its partial directory after
the job, with an owner file (job, host, PID, start time) inside while it is written: rotation and
cleanup then delete only what this job wrote, and never a partial directory another live job is
writing (see ``locate.rotate``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from shardwise.fsutil import atomic_write_text, fsync_dir
from shardwise.runtime.checkpoint.locate import checkpoint_job, rotate
from shardwise.runtime.checkpoint.manifest import (
    DCP_METADATA,
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    PARTIAL_OWNER,
    PARTIAL_PREFIX,
    body_checksum,
    fingerprint,
    sha256_file,
    step_dir_name,
    tensor_shapes,
)
from shardwise.runtime.checkpoint.state import single_process_ok, state_dicts
from shardwise.runtime.collective import barrier, distributed, gather
from shardwise.runtime.collective import rank as global_rank
from shardwise.runtime.identity import launch_id, process_record
from shardwise.runtime.rng import capture_rng_state


def partial_dir_name(step: int, job: str) -> str:
    """``.partial-step-N.<job hash>``: two jobs saving the same step never share a partial directory."""
    return f"{PARTIAL_PREFIX}{step_dir_name(step)}.{hashlib.sha256(job.encode()).hexdigest()[:12]}"


def save_checkpoint(root: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    *, step: int, strategy: str, world_size: int, state: dict[str, Any] | None = None,
                    loader: Any = None, scaler: Any = None, scheduler_state: dict[str, Any] | None = None,
                    keep_last: int = 0, on_written: Callable[[Path], None] | None = None,
                    trainable_only: bool = False, export: dict[str, Any] | None = None,
                    job: str | None = None) -> Path:
    """Write a sharded checkpoint of ``step`` under ``root`` on every rank; return its final path.

    Collective: every rank must call it. ``state`` is JSON data of the caller (rank 0's is kept);
    ``loader`` is a ShardedLoader whose position is recorded; ``scheduler_state`` is the LR
    scheduler's state_dict as JSON data (kept in the manifest, never pickled); ``keep_last`` > 0
    removes this job's older checkpoints; ``on_written(partial_dir)`` runs on each rank after its
    files are on disk and before the checkpoint is published (fault-injection tests use it).
    ``trainable_only`` leaves frozen parameters out (LoRA: the base comes from model.pretrained);
    ``export`` is what ``ckpt export --format hf/peft`` needs to write the model back (JSON data,
    rank 0's is kept). ``job`` names the job (default: ``identity.launch_id()``); only checkpoints
    of the same job are ever rotated away.
    """
    root = Path(root)
    rank = global_rank()
    job = job or launch_id()
    name = step_dir_name(step)
    partial = root / partial_dir_name(step, job)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():  # this job's own, left by a save that was killed; never reused
            shutil.rmtree(partial)
        partial.mkdir()
        atomic_write_text(partial / PARTIAL_OWNER, json.dumps({**process_record(), "job": job}))
    # Rank 0's job names the directory (ranks on other hosts may derive other launch ids).
    partial = Path(gather(str(partial) if rank == 0 else None)[0])

    model_state, optim_state = state_dicts(model, optimizer, trainable_only)
    payload: dict[str, Any] = {"model": model_state}
    if optim_state is not None:
        payload["optim"] = optim_state
    with single_process_ok():
        dcp.save(payload, storage_writer=FileSystemWriter(partial, sync_files=True),
                 no_dist=not distributed())

    extra = {"rank": rank, "rng": capture_rng_state(),
             "scaler": scaler.state_dict() if scaler is not None else None}
    rank_file = partial / f"rng-rank{rank}.json"
    atomic_write_text(rank_file, json.dumps(extra), durable=True)
    # Each rank checksums what it wrote (in parallel); rank 0 assembles the manifest.
    mine = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in [rank_file, *partial.glob(f"__{rank}_*.distcp")]}
    if on_written is not None:
        on_written(partial)
    gathered = gather({"files": mine, "shapes": tensor_shapes(model_state)})

    final = root / name
    if rank == 0:
        files: dict[str, Any] = {}
        shapes: dict[str, list] = {}
        for item in gathered:
            files.update(item["files"])
            shapes.update(item["shapes"])
        meta = partial / DCP_METADATA
        files[DCP_METADATA] = {"bytes": meta.stat().st_size, "sha256": sha256_file(meta)}
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "step": step,
            "strategy": strategy, "world_size": world_size,
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "has_optimizer": optim_state is not None,
            "fingerprint": fingerprint(shapes), "model_tensors": shapes,
            "data": loader.state_dict() if loader is not None else None,
            "scheduler": scheduler_state,
            "state": state or {}, "files": files, "job": job,
            "frozen_excluded": trainable_only, "export": export,
        }
        manifest["checksum"] = body_checksum(manifest)
        atomic_write_text(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True), durable=True)
        (partial / PARTIAL_OWNER).unlink(missing_ok=True)
        _publish(root, partial, final, job)
        rotate(root, keep_last, job)
    barrier()
    return final


def _publish(root: Path, partial: Path, final: Path, job: str) -> None:
    if os.path.lexists(final):
        # Re-saving a step (after resuming from an older checkpoint): move the old one aside
        # first, since rename() cannot replace a non-empty directory. This job's own is then
        # deleted; another job's is kept beside it under a name that is not a checkpoint's.
        ours = checkpoint_job(final) == job and not final.is_symlink()
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        old = root / (f"{PARTIAL_PREFIX}old-{final.name}.{stamp}" if ours else f"{final.name}.replaced-{stamp}")
        os.rename(final, old)
        os.rename(partial, final)
        if ours:
            shutil.rmtree(old, ignore_errors=True)
        else:
            print(f"shardwise: kept the earlier checkpoint {final.name} of another job as {old} "
                  f"(this job saved step {final.name} again).", file=sys.stderr, flush=True)
    else:
        os.rename(partial, final)
    fsync_dir(root)
    # The pointer is written last: until here, 'latest' still names the previous checkpoint.
    atomic_write_text(root / LATEST, final.name + "\n", durable=True)
    fsync_dir(root)
