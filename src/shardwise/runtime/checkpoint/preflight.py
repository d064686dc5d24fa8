"""Checks run in the launching process before any rank starts, and the metrics rewind on resume."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

from shardwise.errors import CheckpointError
from shardwise.fsutil import atomic_write_text
from shardwise.models.gpt2_qkv import fuse_shapes
from shardwise.runtime.checkpoint.locate import resolve_checkpoint
from shardwise.runtime.checkpoint.manifest import (
    DCP_METADATA,
    corruption_error,
    incompatible_error,
    read_manifest,
    removed_error,
    shape_mismatch,
    verify_files,
)

# How often to follow 'latest' again when the checkpoint it named was rotated away meanwhile.
_FOLLOW_ATTEMPTS = 3


def preflight(source: str | os.PathLike, shapes: dict[str, list] | None = None) -> Path:
    """Resolve and check a resume source before any rank starts; return the checkpoint path.

    Cheap checks only: the manifest (its self-checksum and schema), the .metadata checksum, that
    every file is a regular file with its recorded size, and, when ``shapes`` of the model to train
    are given, that they match. The ranks verify every file's SHA-256 again at load.

    A checkpoint that disappears during the checks was rotated away by a run still writing next to
    it: when ``source`` named it through ``latest``, the new ``latest`` is checked instead; when it
    was named directly, the error says so (it is not "damaged").
    """
    for attempt in range(_FOLLOW_ATTEMPTS):
        path = resolve_checkpoint(source)
        try:
            return _check(path, shapes)
        except CheckpointError:
            if path.is_dir():
                raise
            followed = Path(source).absolute() != path.absolute()
            if not followed or attempt == _FOLLOW_ATTEMPTS - 1:
                raise removed_error(path) from None
    raise AssertionError("unreachable")  # pragma: no cover


def _check(path: Path, shapes: dict[str, list] | None) -> Path:
    manifest = read_manifest(path)
    # A DeepSpeed checkpoint has no DCP index (its engine files are checked at load).
    problems = verify_files(path, manifest, [n for n in [DCP_METADATA] if n in manifest["files"]])
    for name, info in manifest["files"].items():
        if name == DCP_METADATA:
            continue  # verified above, with its checksum
        file = path / name
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{name} is not a regular file (a symlink, FIFO or device)")
        elif st.st_size != info["bytes"]:
            problems.append(f"{name} has {st.st_size} bytes, the manifest says {info['bytes']} "
                            "(truncated or overwritten)")
    if problems:
        raise corruption_error(path, problems)
    if shapes is not None:
        # GPT-2 saved under TP by an earlier shardwise holds c_attn as q/k/v slices: it loads under TP
        # (the ranks refuse it, with the way out, under a layout without TP).
        saved = manifest["model_tensors"]
        diffs = shape_mismatch(fuse_shapes(saved), shapes)
        if diffs:
            raise incompatible_error(path, diffs, saved)
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
