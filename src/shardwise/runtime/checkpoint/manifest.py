"""Checkpoint names and the manifest: format, self-checksum, per-file checksums, model fingerprint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from shardwise.errors import CheckpointError

FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
PARTIAL_PREFIX = ".partial-"
DCP_METADATA = ".metadata"


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def body_checksum(manifest: dict[str, Any]) -> str:
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
    if manifest.get("checksum") != body_checksum(manifest):
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
        elif sha256_file(file) != info["sha256"]:
            problems.append(f"{name} does not match its SHA-256 checksum (corrupted)")
    return problems


def corruption_error(path: Path, problems: list[str]) -> CheckpointError:
    """The error for a checkpoint whose files do not match its manifest."""
    return CheckpointError(
        f"checkpoint {path} is damaged: {'; '.join(problems)}. Resume from an earlier checkpoint "
        f"(pass --resume {Path(path).parent}/step-...) or start a fresh run."
    )




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


def incompatible_error(path: Path, diffs: list[str]) -> CheckpointError:
    """The error for a checkpoint saved from a model of another shape."""
    return CheckpointError(
        f"checkpoint {path} was saved from a model of a different shape: {'; '.join(diffs)}. "
        "Resume with the same [model] settings it was trained with (see `shardwise ckpt inspect "
        f"{path}`)."
    )

