"""Loading: verify everything (split across ranks), then let DCP reshard into this layout."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from shardwise.errors import CheckpointError, count_of
from shardwise.runtime.checkpoint.locate import resolve_checkpoint
from shardwise.runtime.checkpoint.manifest import (
    DCP,
    DCP_METADATA,
    corruption_error,
    engine_of,
    incompatible_error,
    open_regular,
    read_manifest,
    removed_error,
    shape_mismatch,
    tensor_shapes,
    verify_files,
)
from shardwise.runtime.checkpoint.pieces import Piece, split_pieces, standard_pieces
from shardwise.runtime.checkpoint.safe_read import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from shardwise.runtime.checkpoint.state import single_process_ok
from shardwise.runtime.collective import barrier, distributed, first_error, gather, raise_on_every_rank
from shardwise.runtime.collective import rank as global_rank
from shardwise.runtime.rng import check_rng_state


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



def resolve_everywhere(source: str | os.PathLike) -> Path:
    """The checkpoint ``source`` names, resolved once on rank 0 and handed to every rank (collective).

    One resolution, so all ranks read the same checkpoint even if a save publishes a newer ``latest``
    meanwhile; its error is raised on every rank alike. Every engine's load starts here.
    """
    path_or_err: tuple[str | None, str | None]
    try:
        path_or_err = (str(resolve_checkpoint(source)), None) if global_rank() == 0 else (None, None)
    except CheckpointError as e:
        path_or_err = (None, str(e))
    path_or_err = gather(path_or_err)[0]
    first_error([path_or_err[1]], CheckpointError)
    return Path(path_or_err[0])


def foreign_engine_error(path: Path, manifest: dict[str, Any], engine: str) -> CheckpointError:
    """A checkpoint written by another engine than the one this strategy loads with: the way across."""
    wrote, strategy = engine_of(manifest), manifest.get("strategy")
    who = {"deepspeed": "DeepSpeed", DCP: "PyTorch DCP"}
    return CheckpointError(
        f"checkpoint {path} was written by {who.get(wrote, wrote)} (strategy {strategy!r}), and this strategy "
        f"loads only checkpoints written by {who.get(engine, engine)}. To continue from its weights, export them "
        f"(`shardwise ckpt export {path} --format hf` or `--format safetensors`) and start from that folder "
        "(model.pretrained), or resume with the strategy that wrote it.")

def load_checkpoint(source: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    *, world_size: int, loader: Any = None, scaler: Any = None,
                    restore_rng: bool = True, trainable_only: bool = False,
                    pieces: dict[str, Piece] | None = None) -> LoadedCheckpoint:
    """Restore model, optimizer, data position, scaler (and RNG) from ``source`` on every rank.

    Collective. Verifies the manifest and every file's checksum (split across ranks) and the model
    shapes before DCP reads anything; raises CheckpointError, on every rank alike, when a check fails.
    ``trainable_only``: the model's frozen parameters are not in the checkpoint (LoRA on a pretrained
    model) and are left as they are. ``pieces`` (see ``checkpoint.pieces``) says what to restore;
    without it, the standard pieces of the other arguments.
    """
    if pieces is None:
        pieces = standard_pieces(model, optimizer, loader=loader, scaler=scaler, trainable_only=trainable_only,
                                 restore_rng=restore_rng)
    tensor_pieces, manifest_pieces, rank_pieces = split_pieces(pieces)
    rank = global_rank()
    path = resolve_everywhere(source)
    try:
        manifest: dict[str, Any] | None = read_manifest(path)
        error = None
    except CheckpointError as e:
        manifest, error = None, str(e)
    if error is None and engine_of(manifest) != DCP:
        error = str(foreign_engine_error(path, manifest, DCP))
    raise_on_every_rank(error, CheckpointError)
    assert manifest is not None

    # Checksums: each rank verifies a disjoint share of the files and records each file's
    # identity; DCP then reads only files whose identity is unchanged (the very files verified).
    # Every rank checks and safely unpickles the .metadata itself (as SafeFileSystemReader does
    # again inside DCP, from the bytes it hashes).
    world = dist.get_world_size() if distributed() else 1
    names = sorted(manifest["files"])[rank::world]
    mine_ids: dict[str, list[int]] = {}
    problems = verify_files(path, manifest, names, identities=mine_ids)
    gathered = gather((problems, mine_ids))
    all_problems = [p for ps, _ in gathered for p in ps]
    identities = {k: v for _, ids in gathered for k, v in ids.items()}
    if all_problems:
        raise removed_error(path) if not path.is_dir() else corruption_error(path, all_problems)
    saved_keys: set[str] = set()
    try:
        saved_keys = set(read_dcp_metadata(path, manifest).state_dict_metadata)
        error = None
    except CheckpointError as e:
        error = str(e)
    raise_on_every_rank(error, CheckpointError)

    saved_trainable_only = bool(manifest.get("frozen_excluded", False))
    if saved_trainable_only != trainable_only:  # read from the manifest: every rank raises alike
        what = ("holds only the LoRA adapters (its frozen base comes from model.pretrained), but the model "
                "to load it into trains every weight" if saved_trainable_only else
                "holds every weight, but the model to load it into trains LoRA adapters on a frozen base")
        raise CheckpointError(f"checkpoint {path} {what}. Load it with the [lora] and model.pretrained "
                              "settings it was trained with.")
    def saved_of(name: str) -> set[str]:
        return {k[len(name) + 1:] for k in saved_keys if k.startswith(f"{name}.")}

    model_state = tensor_pieces["model"].load_template(saved_of("model"))
    mine = tensor_shapes(model_state)
    saved = manifest["model_tensors"]
    local_diffs = shape_mismatch({k: v for k, v in saved.items() if k in mine}, mine)
    union: dict[str, list] = {}
    for shapes in gather(mine):
        union.update(shapes)
    diffs = local_diffs or shape_mismatch(saved, union)
    raise_on_every_rank(str(incompatible_error(path, diffs, saved)) if diffs else None, CheckpointError)
    if "optim" in tensor_pieces and not manifest.get("has_optimizer", True):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state; load it without an "
                              "optimizer, or resume from a training checkpoint.")

    payload: dict[str, Any] = {"model": model_state}
    absent: list[str] = []
    for name, piece in tensor_pieces.items():
        if name == "model":
            continue
        keys = saved_of(name)
        if not keys:  # saved before this piece existed: it keeps its state
            absent.append(name)
            continue
        payload[name] = piece.load_template(keys)
    reader = SafeFileSystemReader(path, manifest["files"][DCP_METADATA]["sha256"], files=manifest["files"],
                                  identities=identities)
    try:
        with single_process_ok():
            dcp.load(payload, storage_reader=reader, planner=SafeLoadPlanner(),
                     no_dist=not distributed())
    except CheckpointError:
        raise
    except (Exception, dcp.api.CheckpointException) as e:
        # DCP gathers every rank's failure into one CheckpointException (a BaseException).
        raise dcp_error(path, e) from None
    # Optimizer before model, as torch's set_state_dict does.
    for name in sorted(payload, key=lambda n: n == "model"):
        tensor_pieces[name].load_state_dict(payload[name])

    loaded = LoadedCheckpoint(path=path, step=int(manifest["step"]), state=manifest.get("state", {}),
                              manifest=manifest)
    for name in absent:
        _restore(tensor_pieces[name], name, None, path, loaded)
    for name, piece in manifest_pieces.items():
        _restore(piece, name, manifest.get(name), path, loaded)
    extra, extra0, error = None, None, None
    try:
        if manifest["world_size"] == world_size and f"rng-rank{rank}.json" in manifest["files"]:
            extra = read_rank_file(path, f"rng-rank{rank}.json")
        elif (any(p.from_rank0_when_resharded for p in rank_pieces.values())
              and "rng-rank0.json" in manifest["files"]):
            extra0 = read_rank_file(path, "rng-rank0.json")
    except CheckpointError as e:
        error = str(e)
    raise_on_every_rank(error, CheckpointError)
    if extra is not None:
        for name, piece in rank_pieces.items():
            _restore(piece, name, extra.get(name), path, loaded)
    else:
        loaded.notes.append(f"saved on {count_of(manifest['world_size'], 'rank')}, loaded on {world_size}: "
                            "model, optimizer and data position are continued; per-rank RNG streams "
                            "(dropout) start afresh")
        for name, piece in rank_pieces.items():
            if piece.from_rank0_when_resharded and extra0 is not None and extra0.get(name) is not None:
                _restore(piece, name, extra0[name], path, loaded)
    rng = rank_pieces.get("rng")
    loaded.rng = getattr(rng, "value", None) if extra is not None else None
    barrier()
    return loaded


def _restore(piece: Piece, name: str, state: Any, path: Path, loaded: LoadedCheckpoint) -> None:
    """Load one JSON piece's saved ``state`` (None: the checkpoint has none; the piece may add a note)."""
    if state is None:
        note = piece.absent(path)
        if note:
            loaded.notes.append(note)
        return
    try:
        piece.load_state_dict(state)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(piece.load_error(name, path, e)) from None


def read_rank_file(path: Path, name: str) -> dict[str, Any]:
    """A verified rng-rank<r>.json, checked to hold RNG streams (and scaler state) as shardwise writes them."""
    fd = open_regular(path / name)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(1 << 24)
    try:
        extra = json.loads(raw.decode("utf-8"))
        if not isinstance(extra, dict) or not isinstance(extra.get("scaler"), (dict, type(None))):
            raise ValueError("not an object with 'rng' and 'scaler'")
        check_rng_state(extra.get("rng"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path / name} does not hold saved RNG streams ({e}); the checkpoint "
                              "was altered or is damaged.") from None
    return extra


def dcp_error(path: Path, e: BaseException) -> CheckpointError:
    """One CheckpointError for a failed ``dcp.load``: a rank's own CheckpointError as it is, else the failures."""
    failures = getattr(e, "failures", None)
    if not failures:
        return CheckpointError(f"could not read checkpoint {path}: {type(e).__name__}: {e}")
    for exc, _ in failures.values():
        if isinstance(exc, CheckpointError):
            return CheckpointError(str(exc))
    detail = "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _) in failures.items())
    return CheckpointError(f"could not read checkpoint {path}: {detail}")
