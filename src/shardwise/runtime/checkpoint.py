"""Sharded checkpoints on PyTorch DCP: atomic publish, checksummed manifest, resharding, export.

Layout of a checkpoints root (``<run>/checkpoints``)::

    step-00000200/            one complete checkpoint
        __0_0.distcp ...      DCP shards, each written by the rank that owns the data
        .metadata             DCP's index (a pickle: see "Security" below)
        rng-rank0.json ...    each rank's RNG streams and loss-scaler state (plain JSON)
        manifest.json         written last: step, strategy, world size, model fingerprint, data
                              position, user state, and the size + SHA-256 of every other file
    latest                    the name of the newest complete checkpoint, written after publish
    .partial-step-00000400/   a checkpoint being written; never read, removed on the next save

Every rank writes into ``.partial-step-N``; once every shard is on disk, rank 0 writes the
manifest and renames the directory to ``step-N`` (a rename is atomic on POSIX file systems), then
replaces ``latest``. A kill at any point therefore leaves ``latest`` naming the previous complete
checkpoint, and a partial directory is never mistaken for one.

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict``, whose keys are the plain model's parameter names whatever the wrapping (DDP,
FSDP2, DTensor TP), and DCP reshards on load: a checkpoint saved by any strategy on any number of
ranks loads into any other.

Security: nothing read from a checkpoint can run code. Tensors are read by DCP with
``torch.load(weights_only=True)``; DCP's non-tensor entries (optimizer hyper-parameters) are
normally read with ``weights_only=False``, so ``SafeLoadPlanner`` reads them with
``weights_only=True``; DCP's ``.metadata`` is a plain pickle, so ``SafeFileSystemReader`` checks its
SHA-256 against the manifest and then unpickles it with an allow-list of DCP's own metadata classes
(any other global is refused). RNG states, scaler state and the manifest are JSON.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardwise.errors import CheckpointError
from shardwise.runtime.rng import capture_rng_state, restore_rng_state

FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
PARTIAL_PREFIX = ".partial-"
DCP_METADATA = ".metadata"


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


# ----------------------------------------------------------------------------- safe reading
# Globals DCP's .metadata pickle legitimately refers to (checked against torch 2.13's writer).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global that is not one of DCP's data classes."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _METADATA_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return super().find_class(module, name)
            if module in _METADATA_MODULES:
                obj = super().find_class(module, name)
                # Only classes defined by DCP itself (dataclasses, enums); never a function or an
                # imported helper reachable as a module attribute (e.g. ``filesystem.os``).
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
        raise CheckpointError(
            f"refusing to load DCP metadata that refers to {module}.{name}: a checkpoint's "
            ".metadata may only hold DCP's own metadata classes. The file was altered or is not a "
            "shardwise/DCP checkpoint; do not load it."
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is checksum-verified, then unpickled with an allow-list."""

    def __init__(self, path: str | os.PathLike, expected_sha256: str | None) -> None:
        super().__init__(path)
        self.expected_sha256 = expected_sha256

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta_path = Path(self.path) / DCP_METADATA
        data = meta_path.read_bytes()
        if self.expected_sha256 is not None and hashlib.sha256(data).hexdigest() != self.expected_sha256:
            raise CheckpointError(f"{meta_path} does not match the checksum in the manifest; the "
                                  "checkpoint is corrupted or was altered.")
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{meta_path} is not DCP metadata.")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries are read with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"refusing to load the entry {read_item.dest_index.fqn!r}: it holds an object that a "
                f"weights-only load does not allow ({str(e).splitlines()[-1][:200]}). The checkpoint "
                "was altered or was not written by shardwise; do not load it."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_dcp_metadata(path: Path, manifest: dict[str, Any]) -> Metadata:
    """Return the verified, safely unpickled DCP metadata of the checkpoint at ``path``."""
    expected = manifest["files"].get(DCP_METADATA, {}).get("sha256")
    if expected is None:
        raise CheckpointError(f"the manifest of {path} lists no {DCP_METADATA}; the checkpoint is incomplete.")
    return SafeFileSystemReader(path, expected).read_metadata()


# ----------------------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _body_checksum(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path: Path) -> dict[str, Any]:
    """Return the manifest of checkpoint ``path`` after checking its format and self-checksum."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a complete shardwise checkpoint "
                              "(an interrupted save leaves no manifest).")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); the checkpoint is corrupted.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a shardwise checkpoint manifest.")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file} has format version {manifest.get('version')}; this shardwise "
                              f"reads version {FORMAT_VERSION}.")
    if manifest.get("checksum") != _body_checksum(manifest):
        raise CheckpointError(f"{file} was modified after it was written (its checksum does not "
                              "match its content); the checkpoint cannot be trusted.")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], names: list[str] | None = None) -> list[str]:
    """Check size and SHA-256 of the manifest's files (or ``names`` of them); return the problems."""
    problems = []
    for name in names if names is not None else sorted(manifest["files"]):
        info = manifest["files"][name]
        file = Path(path) / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != info["bytes"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, the manifest says {info['bytes']} "
                            "(truncated or overwritten)")
        elif _sha256(file) != info["sha256"]:
            problems.append(f"{name} does not match its SHA-256 checksum (corrupted)")
    return problems


def _corruption_error(path: Path, problems: list[str]) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} is damaged: {'; '.join(problems)}. Resume from an earlier checkpoint "
        f"(pass --resume {Path(path).parent}/step-...) or start a fresh run."
    )


# ----------------------------------------------------------------------------- locating
def _complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")
             and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when nothing was published under ``root``."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    target = Path(root) / name
    if not name.startswith("step-") or "/" in name or not (target / MANIFEST).is_file():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint in "
                              f"{root}. Pass --resume with one of: "
                              f"{', '.join(p.name for p in _complete_checkpoints(Path(root))) or 'none'}.")
    return target


def resolve_checkpoint(source: str | os.PathLike) -> Path:
    """Return the checkpoint directory meant by ``source``: a checkpoint, a checkpoints root or a run dir."""
    p = Path(source)
    if not p.exists():
        raise CheckpointError(f"no checkpoint to resume: {str(p)!r} does not exist.")
    if (p / MANIFEST).is_file():
        return p
    if p.name.startswith(PARTIAL_PREFIX):
        raise CheckpointError(f"{p} is an incomplete checkpoint (its save was interrupted) and "
                              "cannot be loaded; use the checkpoint named in 'latest' next to it.")
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    found = latest_checkpoint(root)
    if found is not None:
        return found
    complete = _complete_checkpoints(root)
    if complete:
        raise CheckpointError(f"{root} has no '{LATEST}' pointer; pass one of its checkpoints "
                              f"explicitly: {', '.join(str(c) for c in complete)}.")
    partial = [c.name for c in root.iterdir() if c.name.startswith(PARTIAL_PREFIX)] if root.is_dir() else []
    extra = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
    raise CheckpointError(f"no checkpoint to resume in {p}{extra}. A resume needs a run directory, "
                          "its checkpoints/ folder, or a step-N checkpoint folder.")


# ----------------------------------------------------------------------------- fingerprint
def tensor_shapes(model_state: dict[str, Any]) -> dict[str, list]:
    """Map each model tensor name to [global shape, dtype] (DTensors report their global shape)."""
    out = {}
    for name, value in model_state.items():
        if isinstance(value, torch.Tensor):
            out[name] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return out


def fingerprint(shapes: dict[str, list]) -> str:
    """Short SHA-256 of the model's tensor names and shapes: what must match to load the weights.

    Strategy, world size and precision are left out on purpose: a checkpoint loads under any of
    them (DCP reshards, and converts dtypes on copy).
    """
    names_shapes = {name: spec[0] for name, spec in shapes.items()}
    return hashlib.sha256(json.dumps(names_shapes, sort_keys=True).encode()).hexdigest()[:16]


def shape_mismatch(saved: dict[str, list], mine: dict[str, list], limit: int = 4) -> list[str]:
    """Describe how two tensor-shape maps differ (empty when they match)."""
    diffs = []
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            diffs.append(f"{name} is in the checkpoint but not in this model")
        elif name not in saved:
            diffs.append(f"{name} is in this model but not in the checkpoint")
        elif saved[name][0] != mine[name][0]:
            diffs.append(f"{name} is {saved[name][0]} {saved[name][1]} in the checkpoint and "
                         f"{mine[name][0]} {mine[name][1]} here")
    return diffs[:limit] + ([f"... {len(diffs) - limit} more"] if len(diffs) > limit else [])


def _incompatible(path: Path, diffs: list[str]) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path} was saved from a model of a different shape: {'; '.join(diffs)}. "
        "Resume with the same [model] settings it was trained with (see `shardwise ckpt inspect "
        f"{path}`)."
    )


# ----------------------------------------------------------------------------- collectives
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank (a one-item list without a process group)."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _raise_if_any(errors: list[str | None]) -> None:
    # Every rank raises the same error, so no rank is left waiting in the next collective.
    for err in errors:
        if err:
            raise CheckpointError(err)


@contextlib.contextmanager
def _single_process_ok() -> Any:
    # DCP warns on every save/load without a process group that it "assumes" one process; here
    # that is intended (one rank, or `ckpt export`), so the warning would only be noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _dcp_failures(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if not failures:
        return f"{type(e).__name__}: {e}"
    return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in failures.items())


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- save
@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` restored: where from, the step, the caller's state and RNG."""

    path: Path
    step: int
    state: dict[str, Any]
    manifest: dict[str, Any]
    # This rank's saved RNG streams; None when the world size changed (streams cannot be mapped).
    rng: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def save_checkpoint(root: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    *, step: int, strategy: str, world_size: int, state: dict[str, Any] | None = None,
                    loader: Any = None, scaler: Any = None, keep_last: int = 0,
                    on_written: Callable[[Path], None] | None = None) -> Path:
    """Write a sharded checkpoint of ``step`` under ``root`` on every rank; return its final path.

    Collective: every rank must call it. ``state`` is JSON data of the caller (rank 0's is kept);
    ``loader`` is a ShardedLoader whose position is recorded; ``keep_last`` > 0 removes older
    checkpoints; ``on_written(partial_dir)`` runs on each rank after its files are on disk and
    before the checkpoint is published (fault-injection tests use it).
    """
    root = Path(root)
    rank = _rank()
    name = step_dir_name(step)
    partial = root / f"{PARTIAL_PREFIX}{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():  # left by a save that was killed; never reused
            shutil.rmtree(partial)
        partial.mkdir()
    _barrier()

    model_state, optim_state = _state_dicts(model, optimizer)
    payload: dict[str, Any] = {"model": model_state}
    if optim_state is not None:
        payload["optim"] = optim_state
    with _single_process_ok():
        dcp.save(payload, storage_writer=FileSystemWriter(partial, sync_files=True),
                 no_dist=not _distributed())

    extra = {"rank": rank, "rng": capture_rng_state(),
             "scaler": scaler.state_dict() if scaler is not None else None}
    rank_file = partial / f"rng-rank{rank}.json"
    _write_atomic(rank_file, json.dumps(extra))
    # Each rank checksums what it wrote (in parallel); rank 0 assembles the manifest.
    mine = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in [rank_file, *partial.glob(f"__{rank}_*.distcp")]}
    if on_written is not None:
        on_written(partial)
    gathered = _gather({"files": mine, "shapes": tensor_shapes(model_state)})

    final = root / name
    if rank == 0:
        files: dict[str, Any] = {}
        shapes: dict[str, list] = {}
        for item in gathered:
            files.update(item["files"])
            shapes.update(item["shapes"])
        meta = partial / DCP_METADATA
        files[DCP_METADATA] = {"bytes": meta.stat().st_size, "sha256": _sha256(meta)}
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "step": step,
            "strategy": strategy, "world_size": world_size,
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "has_optimizer": optim_state is not None,
            "fingerprint": fingerprint(shapes), "model_tensors": shapes,
            "data": loader.state_dict() if loader is not None else None,
            "state": state or {}, "files": files,
        }
        manifest["checksum"] = _body_checksum(manifest)
        _write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_dir(partial)
        _publish(root, partial, final)
        if keep_last > 0:
            rotate(root, keep_last)
    _barrier()
    return final


def _publish(root: Path, partial: Path, final: Path) -> None:
    if final.exists():
        # Re-saving a step (after resuming from an older checkpoint): move the old one aside
        # first, since rename() cannot replace a non-empty directory.
        old = root / f"{PARTIAL_PREFIX}old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    _fsync_dir(root)
    # The pointer is written last: until here, 'latest' still names the previous checkpoint.
    _write_atomic(root / LATEST, final.name + "\n")
    _fsync_dir(root)


def rotate(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints and any stale partial ones."""
    keep = _complete_checkpoints(root)[-keep_last:]
    latest = latest_checkpoint(root)
    removed = []
    for p in root.iterdir():
        stale_partial = p.name.startswith(PARTIAL_PREFIX)
        old_complete = p.name.startswith("step-") and p not in keep and p != latest
        if p.is_dir() and (stale_partial or old_complete):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds, keyed by parameter name.

    ZeroRedundancyOptimizer (zero1) keeps each rank's share of the state in an inner optimizer
    over the parameters the rank owns; its own state_dict() needs a consolidation onto one rank
    first. Saving the inner optimizer instead gives each rank's share under the parameters'
    names, which DCP merges across ranks and reads back under any other partition or strategy.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


# Optimizer state keyed by parameter name, hyper-parameters included ("param_groups.<fqn>.lr"),
# instead of by param-group index: groups differ between strategies (a pipeline stage or a ZeRO-1
# shard holds only some parameters), names do not. torchtitan saves the same way.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    if optimizer is None:
        return get_model_state_dict(model, options=_OPTIONS), None
    return get_state_dict(model, _local_optimizer(optimizer), options=_OPTIONS)


def _set_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     payload: dict[str, Any]) -> None:
    if optimizer is None:
        set_model_state_dict(model, payload["model"], options=_OPTIONS)
        return
    local = _local_optimizer(optimizer)
    # A ZeRO-1 shard can own no parameter of a group. torch 2.13's name-keyed loader fails on
    # such an empty group (it reads the group's first parameter name), and the group has no state
    # to load anyway: load into the non-empty groups only, then put the empty ones back in place.
    groups = local.param_groups
    local.param_groups = [g for g in groups if g["params"]]
    try:
        set_state_dict(model, local, model_state_dict=payload["model"],
                       optim_state_dict=payload["optim"], options=_OPTIONS)
    finally:
        loaded = iter(local.param_groups)
        local.param_groups = [next(loaded) if g["params"] else g for g in groups]


# ----------------------------------------------------------------------------- load
def load_checkpoint(source: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    *, world_size: int, loader: Any = None, scaler: Any = None,
                    restore_rng: bool = True) -> LoadedCheckpoint:
    """Restore model, optimizer, data position, scaler (and RNG) from ``source`` on every rank.

    Collective. Verifies the manifest and every file's checksum (split across ranks) and the model
    shapes before DCP reads anything; raises CheckpointError, on every rank alike, when a check fails.
    """
    rank = _rank()
    # Rank 0 resolves 'latest' once, so all ranks read the same checkpoint even if a save lands now.
    path_or_err: tuple[str | None, str | None]
    try:
        path_or_err = (str(resolve_checkpoint(source)), None) if rank == 0 else (None, None)
    except CheckpointError as e:
        path_or_err = (None, str(e))
    path_or_err = _gather(path_or_err)[0]
    _raise_if_any([path_or_err[1]])
    path = Path(path_or_err[0])

    try:
        manifest: dict[str, Any] | None = read_manifest(path)
        error = None
    except CheckpointError as e:
        manifest, error = None, str(e)
    _raise_if_any(_gather(error))
    assert manifest is not None

    # Checksums: each rank verifies a disjoint share of the files; then every rank checks and
    # safely unpickles the .metadata itself (as SafeFileSystemReader does again inside DCP).
    world = dist.get_world_size() if _distributed() else 1
    names = sorted(manifest["files"])[rank::world]
    problems = verify_files(path, manifest, names)
    all_problems = [p for ps in _gather(problems) for p in ps]
    if all_problems:
        raise _corruption_error(path, all_problems)
    try:
        read_dcp_metadata(path, manifest)
        error = None
    except CheckpointError as e:
        error = str(e)
    _raise_if_any(_gather(error))

    model_state, optim_state = _state_dicts(model, optimizer)
    mine = tensor_shapes(model_state)
    saved = manifest["model_tensors"]
    local_diffs = shape_mismatch({k: v for k, v in saved.items() if k in mine}, mine)
    union: dict[str, list] = {}
    for shapes in _gather(mine):
        union.update(shapes)
    diffs = local_diffs or shape_mismatch(saved, union)
    _raise_if_any(_gather(str(_incompatible(path, diffs)) if diffs else None))
    if optimizer is not None and not manifest.get("has_optimizer", True):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state; load it without an "
                              "optimizer, or resume from a training checkpoint.")

    payload: dict[str, Any] = {"model": model_state}
    if optim_state is not None:
        payload["optim"] = optim_state
    reader = SafeFileSystemReader(path, manifest["files"][DCP_METADATA]["sha256"])
    try:
        with _single_process_ok():
            dcp.load(payload, storage_reader=reader, planner=SafeLoadPlanner(),
                     no_dist=not _distributed())
    except CheckpointError:
        raise
    except (Exception, dcp.api.CheckpointException) as e:
        # DCP gathers every rank's failure into one CheckpointException (a BaseException).
        raise CheckpointError(f"could not read checkpoint {path}: {_dcp_failures(e)}") from None
    _set_state_dicts(model, optimizer if optim_state is not None else None, payload)

    loaded = LoadedCheckpoint(path=path, step=int(manifest["step"]), state=manifest.get("state", {}),
                              manifest=manifest)
    if loader is not None and manifest.get("data") is not None:
        try:
            loader.load_state_dict(manifest["data"])
        except ValueError as e:
            raise CheckpointError(f"cannot continue the data order of {path}: {e}.") from None
    rank_file = path / f"rng-rank{rank}.json"
    if manifest["world_size"] == world_size and rank_file.is_file():
        extra = json.loads(rank_file.read_text(encoding="utf-8"))
        loaded.rng = extra["rng"]
        if scaler is not None and extra.get("scaler"):
            scaler.load_state_dict(extra["scaler"])
        if restore_rng:
            restore_rng_state(loaded.rng)
    else:
        loaded.notes.append(f"saved on {manifest['world_size']} ranks, loaded on {world_size}: "
                            "model, optimizer and data position are continued; per-rank RNG streams "
                            "(dropout) start afresh")
        if scaler is not None:
            rank0 = path / "rng-rank0.json"
            extra0 = json.loads(rank0.read_text(encoding="utf-8")) if rank0.is_file() else {}
            if extra0.get("scaler"):
                scaler.load_state_dict(extra0["scaler"])
    _barrier()
    return loaded


# ----------------------------------------------------------------------------- inspect / export
def inspect_checkpoint(source: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """Summary of a checkpoint (no process group): step, strategy, world size, tensors, sizes."""
    path = resolve_checkpoint(source)
    manifest = read_manifest(path)
    if verify:
        problems = verify_files(path, manifest)
        if problems:
            raise _corruption_error(path, problems)
    meta = read_dcp_metadata(path, manifest)
    groups: dict[str, dict[str, int]] = {}
    for key, item in meta.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            g = groups.setdefault(key.split(".", 1)[0], {"tensors": 0, "elements": 0, "bytes": 0})
            numel = item.size.numel()
            g["tensors"] += 1
            g["elements"] += numel
            g["bytes"] += numel * torch.empty((), dtype=item.properties.dtype).element_size()
    return {
        "path": str(path), "step": manifest["step"], "strategy": manifest["strategy"],
        "world_size": manifest["world_size"], "fingerprint": manifest["fingerprint"],
        "created": manifest["created"], "torch": manifest["torch"], "data": manifest["data"],
        "state": manifest["state"], "groups": groups,
        "files": len(manifest["files"]),
        "total_bytes": sum(f["bytes"] for f in manifest["files"].values()),
        "model_tensors": manifest["model_tensors"], "verified": verify,
    }


def read_full_model_state(source: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Consolidated full model weights of a checkpoint, read in this process without a process group."""
    path = resolve_checkpoint(source)
    manifest = read_manifest(path)
    problems = verify_files(path, manifest)
    if problems:
        raise _corruption_error(path, problems)
    meta = read_dcp_metadata(path, manifest)
    model: dict[str, torch.Tensor] = {}
    for key, item in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(item.size, dtype=item.properties.dtype)
    reader = SafeFileSystemReader(path, manifest["files"][DCP_METADATA]["sha256"])
    payload = {"model": model}
    with _single_process_ok():
        dcp.load(payload, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return payload["model"], manifest


def export_weights(source: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """Write a checkpoint's full model weights to a safetensors file; return what was written."""
    from safetensors.torch import save_file

    weights, manifest = read_full_model_state(source)
    out = Path(out)
    if out.suffix != ".safetensors":
        raise CheckpointError(f"--out {out} must end in .safetensors (the only export format).")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tensors = {k: v.contiguous() for k, v in weights.items()}
    save_file(tensors, str(tmp), metadata={"step": str(manifest["step"]),
                                           "fingerprint": manifest["fingerprint"],
                                           "source": "shardwise"})
    os.replace(tmp, out)
    return {"out": str(out), "tensors": len(tensors), "bytes": out.stat().st_size,
            "step": manifest["step"]}


# ----------------------------------------------------------------------------- pre-launch checks
def preflight(source: str | os.PathLike, shapes: dict[str, list] | None = None) -> Path:
    """Resolve and check a resume source before any rank starts; return the checkpoint path.

    Cheap checks only: the manifest (and its self-checksum), the .metadata checksum, that every
    file exists with its recorded size, and, when ``shapes`` of the model to train are given, that
    they match. The ranks verify every file's SHA-256 again at load.
    """
    path = resolve_checkpoint(source)
    manifest = read_manifest(path)
    problems = verify_files(path, manifest, [DCP_METADATA])
    problems += [f"{n} is missing" for n in manifest["files"] if not (path / n).is_file()]
    problems += [f"{n} has {(path / n).stat().st_size} bytes, the manifest says {i['bytes']} "
                 "(truncated or overwritten)"
                 for n, i in manifest["files"].items()
                 if (path / n).is_file() and (path / n).stat().st_size != i["bytes"]]
    if problems:
        raise _corruption_error(path, problems)
    if shapes is not None:
        diffs = shape_mismatch(manifest["model_tensors"], shapes)
        if diffs:
            raise _incompatible(path, diffs)
    return path


def truncate_metrics(metrics_file: Path, step: int) -> None:
    """Drop metric lines logged after ``step`` (they are re-logged by the resumed run)."""
    if not metrics_file.is_file():
        return
    kept = []
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
    _write_atomic(metrics_file, "".join(k + "\n" for k in kept))
