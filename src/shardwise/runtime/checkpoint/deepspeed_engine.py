"""DeepSpeed checkpoints inside shardwise's checkpoint protocol: the engine ``engines.ENGINES`` lists.

The engine writes its own files (``mp_rank_00_model_states.pt``, one
``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank) straight into this job's
``.partial-step-N.<job>`` directory (DeepSpeed's ``tag`` is that directory's name, and its own
``latest`` file is not written). Then, exactly as for DCP checkpoints (``runtime.checkpoint.save``):
every file is checksummed into ``manifest.json`` (with ``"engine": "deepspeed"``), rank 0 renames
the directory to ``step-N`` atomically, replaces ``latest`` and rotates this job's old
checkpoints (``keep_last``). The data position, the LR scheduler, user state and each rank's RNG
streams are shardwise's own JSON, so a resume continues mid-epoch exactly.

Loading checks the manifest and every file's SHA-256 before DeepSpeed opens anything (DeepSpeed
reads its files with ``torch.load(weights_only=False)``: only files whose checksums match the
manifest written with them are read). A DCP checkpoint (from fsdp, ddp, ...) is refused with the
way across (``ckpt export``, then ``model.pretrained``). On a different number of ranks, the
checkpoint is converted with DeepSpeed's universal checkpoint (``ds_to_universal``) and loaded
from the converted copy (``_load_universal``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

from shardwise.errors import CheckpointError
from shardwise.fsutil import atomic_write_text
from shardwise.parallel.deepspeed.config import offload_devices
from shardwise.parallel.deepspeed.setup import import_deepspeed
from shardwise.runtime.checkpoint.load import LoadedCheckpoint, foreign_engine_error, read_rank_file, resolve_everywhere
from shardwise.runtime.checkpoint.locate import rotate
from shardwise.runtime.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PARTIAL_OWNER,
    body_checksum,
    corruption_error,
    engine_of,
    fingerprint,
    read_manifest,
    removed_error,
    sha256_file,
    shape_mismatch,
    step_dir_name,
    verify_files,
)
from shardwise.runtime.checkpoint.save import partial_dir_name, publish
from shardwise.runtime.collective import barrier, gather, raise_on_every_rank
from shardwise.runtime.collective import rank as global_rank
from shardwise.runtime.collective import world_size as global_world
from shardwise.runtime.identity import process_record
from shardwise.runtime.rng import capture_rng_state, restore_rng_state
from shardwise.runtime.scheduler import restore_scheduler

ENGINE = "deepspeed"


def model_shapes(engine: Any) -> dict[str, list]:
    """Full shapes and dtypes of the model's parameters (ZeRO-3 keeps the full shape in ds_shape)."""
    module = engine.module if hasattr(engine, "module") else engine
    out: dict[str, list] = {}
    for name, p in module.named_parameters():
        shape = list(getattr(p, "ds_shape", p.shape))
        out[name] = [shape, str(p.dtype).removeprefix("torch.")]
    return out


def save(session: Any, root: str | os.PathLike, model: nn.Module, optimizer: Any, *, step: int,
         state: dict[str, Any] | None = None, loader: Any = None, scheduler_state: dict[str, Any] | None = None,
         keep_last: int = 0, on_written: Any = None) -> Path:
    """Write the engine's checkpoint of ``step`` under ``root`` with shardwise's guarantees (collective)."""
    engine = session.strategy.engine
    root = Path(root)
    rank, world = global_rank(), global_world()
    job = session.launch_id
    partial = root / partial_dir_name(step, job)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
        atomic_write_text(partial / PARTIAL_OWNER, json.dumps({**process_record(), "job": job}))
    partial = Path(gather(str(partial) if rank == 0 else None)[0])
    # The engine's state goes into the partial directory itself; DeepSpeed's own "latest" file
    # would clash with ours, so it is not written.
    engine.save_checkpoint(str(partial.parent), tag=partial.name, save_latest=False)
    rank_file = partial / f"rng-rank{rank}.json"
    atomic_write_text(rank_file, json.dumps({"rank": rank, "rng": capture_rng_state(), "scaler": None}),
                      durable=True)
    barrier()  # every rank's files are on disk
    if on_written is not None:
        on_written(partial)
    names = sorted(str(p.relative_to(partial)) for p in partial.rglob("*")
                   if p.is_file() and p.name != PARTIAL_OWNER)
    # Each rank checksums a share of the files (they may be large: optimizer partitions).
    mine = {n: {"bytes": (partial / n).stat().st_size, "sha256": sha256_file(partial / n)}
            for n in names[rank::world]}
    gathered = gather(mine)
    final = root / step_dir_name(step)
    if rank == 0:
        every: dict[str, Any] = {}
        for item in gathered:
            every.update(item)
        # Top-level files in the manifest's "files" (checked by every reader); files DeepSpeed
        # puts in subfolders (NVMe swap state: offloaded_tensors/) in "engine_files", checked here.
        files = {n: v for n, v in every.items() if "/" not in n}
        nested = {n: v for n, v in every.items() if "/" in n}
        shapes = model_shapes(engine)
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "engine": ENGINE, "step": step,
            "strategy": session.strategy_name, "world_size": world,
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "has_optimizer": optimizer is not None,
            "fingerprint": fingerprint(shapes), "model_tensors": shapes,
            "data": loader.state_dict() if loader is not None else None,
            "scheduler": scheduler_state, "state": state or {}, "files": files, "job": job,
            "frozen_excluded": False, "export": session._export_info(model),
            "deepspeed": {"version": _ds_version(), "config": session.strategy.ds_config},
            "engine_files": nested,
        }
        manifest["checksum"] = body_checksum(manifest)
        atomic_write_text(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True), durable=True)
        (partial / PARTIAL_OWNER).unlink(missing_ok=True)
        publish(root, partial, final, job)
        rotate(root, keep_last, job)
        # DeepSpeed copies its recovery scripts beside the checkpoint; `shardwise ckpt export` does
        # their job, and a checkpoints root holds only checkpoints.
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (root / script).unlink(missing_ok=True)
    barrier()
    return final


def swaps_to_nvme(ds_config: dict[str, Any]) -> bool:
    """Whether the engine swaps state to NVMe (where DeepSpeed's checkpoint load does not restore it)."""
    return "nvme" in offload_devices(ds_config)


def _ds_version() -> str:
    import deepspeed  # defers deepspeed (optional)

    return str(deepspeed.__version__)


def load(session: Any, source: str | os.PathLike, model: nn.Module, optimizer: Any, *, loader: Any = None,
         scheduler: Any = None, restore_rng: bool = True) -> LoadedCheckpoint:
    """Verify, then restore the engine's state, the data position and this rank's RNG (collective)."""
    engine = session.strategy.engine
    rank, world = global_rank(), global_world()
    path = resolve_everywhere(source)
    manifest: dict[str, Any] | None = None
    error = None
    try:
        manifest = read_manifest(path)
        if engine_of(manifest) != ENGINE:
            error = str(foreign_engine_error(path, manifest, ENGINE))
        elif swaps_to_nvme(session.strategy.ds_config or {}):
            error = (f"cannot resume from {path} under NVMe offload: DeepSpeed {_ds_version()} restores ZeRO-3 "
                     "state into the swapped-out buffers of offload_optimizer/offload_param = nvme without "
                     "reading it back, so training would silently continue from the initial weights (measured "
                     f"here). Export its weights (`shardwise ckpt export {path} --format safetensors` or `--format "
                     "hf`) and start a new run from them (model.pretrained), or train with CPU offload "
                     "(zero3-offload), whose checkpoints resume exactly.")
        else:
            diffs = shape_mismatch(manifest["model_tensors"], model_shapes(engine))
            if diffs:
                error = f"checkpoint {path} does not fit this model: {'; '.join(diffs)}."
    except CheckpointError as e:
        error = str(e)
    raise_on_every_rank(error, CheckpointError)
    assert manifest is not None
    mine = verify_files(path, manifest, sorted(manifest["files"])[rank::world])
    if rank == 0:
        mine += verify_nested(path, manifest)
    problems = [p for ps in gather(mine) for p in ps]
    if problems:
        raise removed_error(path) if not path.is_dir() else corruption_error(path, problems)
    if manifest["world_size"] == world:
        load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name,
                                              load_optimizer_states=optimizer is not None,
                                              load_lr_scheduler_states=False)
    else:
        load_path = _load_universal(engine, path, int(manifest["world_size"]), world, optimizer is not None,
                                    session.launch_id)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed could not read checkpoint {path}.")
    loaded = LoadedCheckpoint(path=path, step=int(manifest["step"]), state=manifest.get("state", {}),
                              manifest=manifest)
    if loader is not None and manifest.get("data") is not None:
        try:
            loader.load_state_dict(manifest["data"])
        except ValueError as e:
            raise CheckpointError(f"cannot continue the data order of {path}: {e}.") from None
    if scheduler is not None:
        note = restore_scheduler(scheduler, manifest.get("scheduler"), str(path))
        if note:
            loaded.notes.append(note)
    extra = read_rank_file(path, f"rng-rank{rank}.json")
    loaded.rng = extra["rng"]
    if restore_rng:
        restore_rng_state(loaded.rng)
    barrier()
    return loaded


def _load_universal(engine: Any, path: Path, saved_world: int, world: int, with_optimizer: bool,
                    job: str) -> str | None:
    """Resume a checkpoint of ``saved_world`` ranks on ``world`` ranks (collective).

    ZeRO's partitions are per rank, so rank 0 converts the verified checkpoint with DeepSpeed's
    ``ds_to_universal`` (one file per parameter and state: fp32 weight, exp_avg, exp_avg_sq) into
    ``.universal-<step>.<job>`` beside it, every rank loads its new partition from there
    (``load_universal_checkpoint``), and the converted copy is removed: it is derived from files
    whose checksums were just checked, and the checkpoint itself stays untouched.
    """
    rank = global_rank()
    work = path.parent / f".universal-{path.name}.{job}"
    target = work / path.name
    error = None
    if rank == 0:
        try:
            _convert_universal(path, target)
        except Exception as e:  # DeepSpeed's converter: name what failed, on every rank
            error = (f"cannot resume {path} (saved by {saved_world} DeepSpeed ranks) on {world} ranks: DeepSpeed's "
                     f"universal-checkpoint conversion failed ({type(e).__name__}: {e}). Resume on {saved_world} "
                     f"ranks, or export the weights (`shardwise ckpt export {path} --format safetensors`) and start "
                     "a new run from them.")
            shutil.rmtree(work, ignore_errors=True)
    raise_on_every_rank(gather(error)[0], CheckpointError)
    # DeepSpeed reads this flag from its config at load time; it is this load's, not the run's.
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        load_path, _ = engine.load_checkpoint(str(work), tag=path.name, load_optimizer_states=with_optimizer,
                                              load_lr_scheduler_states=False)
    finally:
        config.load_universal_checkpoint = before
        barrier()
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
    return load_path


def _convert_universal(source: Path, target: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of one checkpoint directory, in this process (quietly)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # defers deepspeed (optional)

    shutil.rmtree(target.parent, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(source), output_folder=str(target), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal(args)


def verify_nested(path: Path, manifest: dict[str, Any]) -> list[str]:
    """Check the files DeepSpeed wrote in subfolders (``engine_files``): plain relative names, sizes, SHA-256."""
    nested = manifest.get("engine_files") or {}
    if not isinstance(nested, dict):
        return ["the manifest's engine_files is not an object"]
    problems = []
    for name, info in nested.items():
        parts = str(name).split("/")
        if not all(p and p not in (".", "..") and "\\" not in p for p in parts) or name.startswith("/"):
            problems.append(f"engine file name {name!r} is not a plain relative path")
            continue
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
            problems.append(f"engine_files[{name!r}] is not {{bytes, sha256}}")
            continue
        problems += verify_files(path, {"files": {name: info}}, [name])
    return problems


def read_full_state(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The consolidated fp32 weights of a verified DeepSpeed checkpoint (ZeRO shards merged)."""
    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # defers deepspeed (optional)

    problems = verify_files(path, manifest) + verify_nested(path, manifest)
    if problems:
        raise corruption_error(path, problems)
    state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def engine_entries(path: Path, manifest: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(consolidated weights, DCP-like metadata per name) for ``ckpt export`` (hf_export's reader).

    Names are the model's own (the Session's model, e.g. ``hf.model.layers.0...`` for a Hugging
    Face model), as in a DCP checkpoint, so the same exporters apply.
    """
    state = read_full_state(path, manifest)
    entries = {n: TensorStorageMetadata(TensorProperties(dtype=v.dtype), v.size(), [])
               for n, v in state.items()}
    return state, entries
