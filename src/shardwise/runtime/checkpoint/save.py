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
import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.errors import CheckpointError
from shardwise.fsutil import atomic_write_text, fsync_dir
from shardwise.runtime import faults
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
from shardwise.runtime.checkpoint.pieces import JsonPiece, Piece, split_pieces, standard_pieces
from shardwise.runtime.checkpoint.state import single_process_ok
from shardwise.runtime.collective import barrier, distributed, gather
from shardwise.runtime.collective import rank as global_rank
from shardwise.runtime.identity import launch_id, process_record
from shardwise.runtime.lifeline import ensure_alive


def partial_dir_name(step: int, job: str) -> str:
    """``.partial-step-N.<job hash>``: two jobs saving the same step never share a partial directory."""
    return f"{PARTIAL_PREFIX}{step_dir_name(step)}.{hashlib.sha256(job.encode()).hexdigest()[:12]}"


@dataclass
class PreparedSave:
    """A save whose state has been taken and whose partial directory exists; nothing written yet.

    ``payload`` goes to DCP (synchronously, or staged and written in the background by
    ``checkpoint.background``); ``finish_save`` then checksums, gathers and publishes.
    """

    root: Path
    partial: Path
    step: int
    job: str
    payload: dict[str, Any]
    job_state: dict[str, Any]
    rank_state: dict[str, Any]
    strategy: str
    world_size: int
    keep_last: int
    trainable_only: bool
    export: dict[str, Any] | None
    on_written: Callable[[Path], None] | None

    @property
    def final(self) -> Path:
        return self.root / step_dir_name(self.step)


def prepare_save(root: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 *, step: int, strategy: str, world_size: int, state: dict[str, Any] | None = None,
                 loader: Any = None, scaler: Any = None, scheduler_state: dict[str, Any] | None = None,
                 keep_last: int = 0, on_written: Callable[[Path], None] | None = None,
                 trainable_only: bool = False, export: dict[str, Any] | None = None,
                 job: str | None = None, pieces: dict[str, Piece] | None = None) -> PreparedSave:
    """Take every piece's state and create the partial directory (collective); see ``save_checkpoint``."""
    if pieces is None:
        pieces = standard_pieces(model, optimizer, loader=loader, state=state, scaler=scaler,
                                 trainable_only=trainable_only)
        if scheduler_state is not None:
            pieces["scheduler"] = JsonPiece(scheduler_state)
    tensor_pieces, manifest_pieces, rank_pieces = split_pieces(pieces)
    # Every piece's state is taken on every rank before anything is written: a piece that refuses
    # (state that is not JSON data) raises on every rank alike and leaves no partial directory.
    payload: dict[str, Any] = {name: piece.state_dict() for name, piece in tensor_pieces.items()}
    job_state = {name: piece.state_dict() for name, piece in manifest_pieces.items()}
    # The per-rank pieces (RNG streams, scaler) are taken now too: a background write must
    # record the state of the step it saves, not of a later one.
    rank_state = {name: piece.state_dict() for name, piece in rank_pieces.items()}
    root = Path(root)
    rank = global_rank()
    job = job or launch_id()
    partial = root / partial_dir_name(step, job)
    setup_error: str | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if partial.exists():  # this job's own, left by a save that was killed; never reused
                shutil.rmtree(partial)
            partial.mkdir()
            atomic_write_text(partial / PARTIAL_OWNER, json.dumps({**process_record(), "job": job}))
        except OSError as e:
            setup_error = describe_io_failure(e, rank)
            shutil.rmtree(partial, ignore_errors=True)
    # Rank 0's job names the directory (ranks on other hosts may derive other launch ids).
    where, setup_error = gather((str(partial), setup_error) if rank == 0 else None)[0]
    if setup_error:
        raise save_failed(root, step, [setup_error])
    return PreparedSave(root=root, partial=Path(where), step=step, job=job, payload=payload,
                        job_state=job_state, rank_state=rank_state, strategy=strategy,
                        world_size=world_size, keep_last=keep_last, trainable_only=trainable_only,
                        export=export, on_written=on_written)


def save_checkpoint(root: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    *, step: int, strategy: str, world_size: int, state: dict[str, Any] | None = None,
                    loader: Any = None, scaler: Any = None, scheduler_state: dict[str, Any] | None = None,
                    keep_last: int = 0, on_written: Callable[[Path], None] | None = None,
                    trainable_only: bool = False, export: dict[str, Any] | None = None,
                    job: str | None = None, pieces: dict[str, Piece] | None = None) -> Path:
    """Write a sharded checkpoint of ``step`` under ``root`` on every rank; return its final path.

    Collective: every rank must call it. What is saved is ``pieces`` (see ``checkpoint.pieces``);
    without it, the standard pieces of ``model``, ``optimizer``, ``loader`` (a ShardedLoader whose
    position is recorded), ``scheduler_state`` (the LR scheduler's state_dict as JSON data, kept in
    the manifest, never pickled), ``scaler``, every rank's RNG streams and ``state`` (JSON data of the
    caller; rank 0's is kept). ``keep_last`` > 0 removes this job's older checkpoints;
    ``on_written(partial_dir)`` runs on each rank after its files are on disk and before the
    checkpoint is published (fault-injection tests use it). ``trainable_only`` leaves frozen
    parameters out (LoRA: the base comes from model.pretrained); ``export`` is what
    ``ckpt export --format hf/peft`` needs to write the model back (JSON data, rank 0's is kept).
    ``job`` names the job (default: ``identity.launch_id()``); only checkpoints of the same job are
    ever rotated away. The background (asynchronous) form is ``checkpoint.background``.
    """
    prep = prepare_save(root, model, optimizer, step=step, strategy=strategy, world_size=world_size,
                        state=state, loader=loader, scaler=scaler, scheduler_state=scheduler_state,
                        keep_last=keep_last, on_written=on_written, trainable_only=trainable_only,
                        export=export, job=job, pieces=pieces)
    failure: str | None = None
    try:
        with single_process_ok():
            dcp.save(prep.payload, storage_writer=faults.storage_writer(prep.partial, step, global_rank()),
                     no_dist=not distributed())
    except (OSError, CheckpointException) as e:
        failure = describe_io_failure(e, global_rank(), prep.partial)
    return finish_save(prep, failure)


def finish_save(prep: PreparedSave, failure: str | None, group: Any = None) -> Path:
    """Checksum this rank's files, gather every rank's outcome and publish (rank 0); return the path.

    Collective over ``group`` (default: the world group; a background write uses its own group so
    that training's collectives are not interleaved with it). ``failure``: this rank's write
    error, if any. A full disk (or any I/O error) on any rank must not leave the others waiting, a
    partial directory filling the disk, or 'latest' moved: every rank reports its outcome in the
    gather below, and all raise the same CheckpointError once rank 0 has removed the partial save.
    """
    rank = global_rank()
    partial = prep.partial
    mine: dict[str, Any] = {}
    if failure is None:
        try:
            rank_file = partial / f"rng-rank{rank}.json"
            atomic_write_text(rank_file, json.dumps({"rank": rank, **prep.rank_state}), durable=True)
            # Each rank checksums what it wrote (in parallel); rank 0 assembles the manifest.
            mine = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
                    for p in [rank_file, *partial.glob(f"__{rank}_*.distcp")]}
            if prep.on_written is not None:
                prep.on_written(partial)
        except (OSError, CheckpointException) as e:
            failure = describe_io_failure(e, rank, partial)
    gathered = gather({"files": mine, "shapes": tensor_shapes(prep.payload["model"]), "error": failure},
                      group=group)
    errors = [item["error"] for item in gathered if item.get("error")]
    if errors:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        barrier(group)
        raise save_failed(prep.root, prep.step, errors)

    final = prep.final
    published: str | None = None
    if rank == 0:
        try:
            _write_manifest_and_publish(prep.root, partial, final, prep.job, gathered, step=prep.step,
                                        strategy=prep.strategy, world_size=prep.world_size,
                                        has_optimizer="optim" in prep.payload, job_state=prep.job_state,
                                        trainable_only=prep.trainable_only, export=prep.export)
            rotate(prep.root, prep.keep_last, prep.job)
        except OSError as e:
            published = describe_io_failure(e, rank)
            shutil.rmtree(partial, ignore_errors=True)
    # Instead of a barrier: every rank learns whether rank 0 could publish.
    published = gather(published, group=group)[0]
    if published:
        raise save_failed(prep.root, prep.step, [published])
    return final


# Below this much free space, a write that failed without an OS error (torch.save's zip writer
# reports a short write as "[enforce fail at inline_container.cc] unexpected pos") failed because
# the disk is full: no shard write is smaller than this.
FULL_DISK_FREE_BYTES = 1 << 20


def describe_io_failure(error: BaseException, rank: int, where: Path | None = None) -> str:
    """'rank R: <the OS error>' for a failed write; DCP's CheckpointException is unwrapped.

    ``where``: the directory written into; an error that is not an OSError (torch.save's short
    write) is reported as the full disk it is when that file system has (almost) no space left.
    """
    for_rank = rank
    if isinstance(error, CheckpointException):
        # {rank: (exception, traceback)}: the first rank's own exception says what happened.
        for failed_rank, (exc, _trace) in sorted(error.failures.items()):
            error, for_rank = exc, failed_rank
            if isinstance(exc, OSError):
                break
    if not isinstance(error, OSError) and where is not None and _free_bytes(where) < FULL_DISK_FREE_BYTES:
        error = faults.disk_full(where)
    if isinstance(error, OSError):
        name = f" ({error.filename})" if error.filename else ""
        text = f"[Errno {error.errno}] {error.strerror}{name}" if error.errno else str(error)
    else:
        text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return f"rank {for_rank}: {text}"


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return FULL_DISK_FREE_BYTES  # unknown: not called full

def latest_name(root: Path) -> str:
    """What ``root/latest`` names ('' when unreadable)."""
    try:
        return (root / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def save_failed(root: Path, step: int, errors: list[str]) -> CheckpointError:
    """The one-paragraph error of a save that could not be completed (nothing was published)."""
    previous = latest_name(root)
    full = any(f"[Errno {errno.ENOSPC}]" in e or f"[Errno {errno.EDQUOT}]" in e for e in errors)
    what = "no space left on the device" if full else "a write failed"
    kept = (f"the previous checkpoint {previous} is intact ({root / LATEST} still names it)" if previous
            else f"no earlier checkpoint exists in {root}")
    unique = list(dict.fromkeys(errors))
    return CheckpointError(
        f"{what} while saving checkpoint {step_dir_name(step)} into {root} ({'; '.join(unique[:4])}). "
        f"The partial save was removed and {kept}. "
        + ("Free space (or lower checkpoint.keep_last), then continue with --resume." if full else
           "Fix the file system problem, then continue with --resume.")
    )


def _write_manifest_and_publish(root: Path, partial: Path, final: Path, job: str, gathered: list[Any], *,
                                step: int, strategy: str, world_size: int, has_optimizer: bool,
                                job_state: dict[str, Any], trainable_only: bool, export: Any) -> None:
    """Rank 0: write the manifest, then rename the partial directory into place and move ``latest``."""
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
        "torch": torch.__version__, "has_optimizer": has_optimizer,
        "fingerprint": fingerprint(shapes), "model_tensors": shapes,
        **job_state, "files": files, "job": job,
        "frozen_excluded": trainable_only, "export": export,
    }
    manifest["checksum"] = body_checksum(manifest)
    if faults.disk_full_at(step, 0, "manifest"):
        raise faults.disk_full(partial / MANIFEST)
    atomic_write_text(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True), durable=True)
    (partial / PARTIAL_OWNER).unlink(missing_ok=True)
    # A rank whose launcher was killed meanwhile exits here rather than publish (lifeline).
    ensure_alive()
    try:
        publish(root, partial, final, job)
    except OSError:
        # Renamed into place but 'latest' could not be written: take it back out, so the run
        # directory says exactly what 'latest' says (the previous checkpoint).
        if final.is_dir() and not partial.exists() and checkpoint_job(final) == job \
                and latest_name(root) != final.name:
            shutil.rmtree(final, ignore_errors=True)
        raise


def publish(root: Path, partial: Path, final: Path, job: str) -> None:
    """Rename a written ``partial`` directory to ``final`` (atomic) and point ``latest`` at it (rank 0)."""
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
