"""Checks run in the launching process before any rank starts, and the metrics rewind on resume."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from shardwise.fsutil import atomic_write_text
from shardwise.runtime.checkpoint.locate import resolve_checkpoint
from shardwise.runtime.checkpoint.manifest import (
    DCP_METADATA,
    corruption_error,
    incompatible_error,
    read_manifest,
    shape_mismatch,
    verify_files,
)


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
        raise corruption_error(path, problems)
    if shapes is not None:
        diffs = shape_mismatch(manifest["model_tensors"], shapes)
        if diffs:
            raise incompatible_error(path, diffs)
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
    atomic_write_text(metrics_file, "".join(k + "\n" for k in kept), durable=True)
