"""Reading a checkpoint in one process, without the ranks that wrote it: inspect and export."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardwise.errors import CheckpointError
from shardwise.fsutil import default_file_mode
from shardwise.runtime.checkpoint.engines import engine_for
from shardwise.runtime.checkpoint.load import dcp_error
from shardwise.runtime.checkpoint.locate import resolve_checkpoint
from shardwise.runtime.checkpoint.manifest import DCP_METADATA, corruption_error, engine_of, read_manifest, verify_files
from shardwise.runtime.checkpoint.safe_read import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from shardwise.runtime.checkpoint.state import single_process_ok


def _model_entries(path: Path, manifest: dict[str, Any], meta: Any) -> dict[str, TensorStorageMetadata]:
    """The metadata's model tensors, checked against the manifest's recorded shapes before any allocation.

    A forged .metadata could ask for tensors of any size; each one must have exactly the shape the
    manifest records for it, and fit in the bytes the checkpoint's data files hold.
    """
    recorded = manifest["model_tensors"]
    data_bytes = sum(i["bytes"] for n, i in manifest["files"].items() if n != DCP_METADATA)
    entries: dict[str, TensorStorageMetadata] = {}
    for key, item in meta.state_dict_metadata.items():
        if not (key.startswith("model.") and isinstance(item, TensorStorageMetadata)):
            continue
        name = key[len("model."):]
        nbytes = item.size.numel() * torch.empty((), dtype=item.properties.dtype).element_size()
        if name not in recorded or list(item.size) != recorded[name][0] or nbytes > data_bytes:
            raise CheckpointError(
                f"the DCP metadata of {path} describes the model tensor {name!r} as {list(item.size)}, "
                f"which the manifest does not record{'' if name not in recorded else f' (it says {recorded[name][0]})'}"
                "; the checkpoint was altered. Refusing to read it."
            )
        entries[name] = item
    missing = sorted(set(recorded) - set(entries))
    if missing:
        raise CheckpointError(f"the DCP metadata of {path} lacks model tensors the manifest lists "
                              f"({', '.join(missing[:4])}); the checkpoint is damaged or altered.")
    return entries


def inspect_checkpoint(source: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """Summary of a checkpoint (no process group): step, strategy, world size, tensors, sizes."""
    path = resolve_checkpoint(source)
    manifest = read_manifest(path)
    if verify:
        problems = verify_files(path, manifest)
        if problems:
            raise corruption_error(path, problems)
    meta = read_dcp_metadata(path, manifest)
    _model_entries(path, manifest, meta)
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
        "created": manifest["created"], "torch": manifest["torch"], "data": manifest.get("data"),
        "state": manifest["state"], "groups": groups,
        "files": len(manifest["files"]),
        "total_bytes": sum(f["bytes"] for f in manifest["files"].values()),
        "model_tensors": manifest["model_tensors"], "verified": verify,
    }


def read_full_model_state(source: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Consolidated full model weights of a checkpoint, read in this process without a process group."""
    path = resolve_checkpoint(source)
    manifest = read_manifest(path)
    engine = engine_for(engine_of(manifest))
    if engine is not None:  # e.g. DeepSpeed's ZeRO shards, consolidated by its zero_to_fp32
        return engine.read_full_state(path, manifest), manifest
    identities: dict[str, list[int]] = {}
    problems = verify_files(path, manifest, identities=identities)
    if problems:
        raise corruption_error(path, problems)
    meta = read_dcp_metadata(path, manifest)
    model = {name: torch.empty(item.size, dtype=item.properties.dtype)
             for name, item in _model_entries(path, manifest, meta).items()}
    reader = SafeFileSystemReader(path, manifest["files"][DCP_METADATA]["sha256"], files=manifest["files"],
                                  identities=identities)
    payload = {"model": model}
    try:
        with single_process_ok():
            dcp.load(payload, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, dcp.api.CheckpointException) as e:
        raise dcp_error(path, e) from None
    return payload["model"], manifest


def export_weights(source: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """Write a checkpoint's full model weights to a safetensors file; return what was written."""
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
    default_file_mode(tmp)  # safetensors writes 0600; an export is as readable as any other file
    os.replace(tmp, out)
    return {"out": str(out), "tensors": len(tensors), "bytes": out.stat().st_size,
            "step": manifest["step"]}
