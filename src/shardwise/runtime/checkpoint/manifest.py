"""Checkpoint names and the manifest: format, self-checksum, per-file checksums, model fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch

from shardwise.errors import CheckpointError
from shardwise.models.gpt2_qkv import split_names

FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
PARTIAL_PREFIX = ".partial-"
# Inside a partial directory while it is written: who writes it (job, host, PID, start time), so
# a cleanup never removes a partial checkpoint that a live job is still writing. Removed before
# the checkpoint is published.
PARTIAL_OWNER = ".owner.json"
DCP_METADATA = ".metadata"
# Who wrote a checkpoint's tensors (the manifest's "engine"; absent: PyTorch DCP). The engines that
# own their files are listed in ``checkpoint.engines``.
DCP = "dcp"
STEP_DIR_RE = re.compile(r"step-\d{8,}")
# A manifest describes a few thousand tensors at most; anything far larger is not one.
MAX_MANIFEST_BYTES = 64 * 2**20



def engine_of(manifest: dict[str, Any]) -> str:
    """The engine that wrote a checkpoint's tensors ("dcp" unless the manifest names another)."""
    return str(manifest.get("engine") or DCP)

def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def is_step_dir_name(name: str) -> bool:
    """True for ``step-NNNNNNNN`` (what ``step_dir_name`` makes), False for anything else."""
    return STEP_DIR_RE.fullmatch(name) is not None


def safe_name(name: Any) -> bool:
    """True when ``name`` is a plain file name: one path component, no '..', no separators, no NUL.

    Every file a checkpoint lists must be such a name, so that it can only resolve inside the
    checkpoint directory itself.
    """
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..")
            and not any(c in name for c in "/\\\x00") and name.isprintable())


def open_regular(path: Path) -> int:
    """Open ``path`` read-only without following a symlink or blocking on a FIFO; return the fd.

    Raises CheckpointError unless it is a regular file (a symlink, FIFO, device or directory is
    refused before a byte is read).
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if os.path.islink(path):
            raise CheckpointError(f"{path} is a symbolic link; a checkpoint's files must be regular "
                                  "files inside its directory.") from None
        raise CheckpointError(f"cannot open {path}: {e.strerror or e}.") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file (a FIFO, device or directory); a "
                              "checkpoint's files must be regular files inside its directory.")
    return fd


def file_identity(st: os.stat_result) -> list[int]:
    """What changes whenever a file is replaced or written: inode, size, mtime and ctime.

    The ctime cannot be set from user space, so a file rewritten in place and given back its old
    mtime still shows as changed.
    """
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def sha256_file(path: Path) -> str:
    fd = open_regular(Path(path))
    with os.fdopen(fd, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def body_checksum(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def newest_intact(root: Path, before: str | None = None) -> Path | None:
    """The newest step-N checkpoint in ``root`` (older than the step directory named ``before``)
    whose manifest reads whole (format, self-checksum, schema); None when there is none.

    The one rule for "which checkpoint to resume from instead" in every refusal. Its shard files
    are not hashed here: they are verified when it loads.
    """
    try:
        steps = sorted((p for p in Path(root).iterdir() if is_step_dir_name(p.name) and not p.is_symlink()
                        and p.is_dir() and (before is None or p.name < before)), key=lambda p: p.name)
    except OSError:
        return None
    for candidate in reversed(steps):
        try:
            _read_manifest(candidate)
        except (CheckpointError, OSError):
            continue
        return candidate
    return None


def resume_instead(path: Path) -> str:
    """The sentence that ends a refusal of checkpoint ``path``: the newest intact earlier one to resume from."""
    path = Path(path)
    earlier = newest_intact(path.parent, before=path.name) if is_step_dir_name(path.name) else None
    if earlier is not None:
        return (f"Resume from the newest earlier intact checkpoint with --resume {earlier} (its files are "
                "verified again when it loads).")
    return (f"No earlier intact checkpoint is in {path.parent}: start a fresh run "
            "(--overwrite keeps the old one).")


def read_manifest(path: Path) -> dict[str, Any]:
    """Return the manifest of checkpoint ``path`` after checking its format, self-checksum and schema.

    A refusal names the newest earlier intact checkpoint (``resume_instead``).
    """
    path = Path(path)
    try:
        return _read_manifest(path)
    except CheckpointError as e:
        if path.is_symlink() or not is_step_dir_name(path.name):
            raise
        raise CheckpointError(f"{e} {resume_instead(path)}") from None


def _read_manifest(path: Path) -> dict[str, Any]:
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symbolic link; shardwise reads a checkpoint only from a real "
                              "directory (pass the link's target itself if you trust it).")
    file = path / MANIFEST
    if not os.path.lexists(file):
        raise CheckpointError(f"{path} has no {MANIFEST}: it is not a complete shardwise checkpoint "
                              "(its save did not finish, or the file was deleted).")
    fd = open_regular(file)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{file} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a shardwise manifest.")
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); the checkpoint is corrupted.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a shardwise checkpoint manifest.")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file} has format version {manifest.get('version')!r}; this shardwise "
                              f"reads version {FORMAT_VERSION}.")
    if manifest.get("checksum") != body_checksum(manifest):
        raise CheckpointError(f"{file} was modified after it was written (its checksum does not "
                              "match its content); the checkpoint cannot be trusted.")
    problem = schema_problem(manifest)
    if problem:
        raise CheckpointError(f"{file} is not a valid shardwise manifest: {problem}. The checkpoint was "
                              "altered or written by something else; do not load it.")
    return manifest


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _tensor_spec_problem(name: Any, spec: Any) -> str | None:
    if not isinstance(name, str):
        return f"model tensor name {name!r} is not a string"
    if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list)
            and all(_is_int(d) for d in spec[0]) and isinstance(spec[1], str)):
        return f"model_tensors[{name!r}] is not [shape, dtype]"
    return None


def schema_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields (None when every field has its type and range)."""
    scalars = {"step": lambda v: _is_int(v), "world_size": lambda v: _is_int(v, 1),
               "strategy": lambda v: isinstance(v, str), "fingerprint": lambda v: isinstance(v, str),
               "created": lambda v: isinstance(v, str), "torch": lambda v: isinstance(v, str),
               "state": lambda v: isinstance(v, dict), "files": lambda v: isinstance(v, dict),
               "model_tensors": lambda v: isinstance(v, dict)}
    for key, ok in scalars.items():
        if key not in manifest:
            return f"the field {key!r} is missing"
        if not ok(manifest[key]):
            return f"the field {key!r} has the wrong type or range ({str(manifest[key])[:80]!r})"
    if not isinstance(manifest.get("has_optimizer", True), bool):
        return "the field 'has_optimizer' is not true/false"
    if not isinstance(manifest.get("job", ""), str):
        return "the field 'job' is not a string"
    if not isinstance(manifest.get("frozen_excluded", False), bool):
        return "the field 'frozen_excluded' is not true/false"
    if not isinstance(manifest.get("export"), (dict, type(None))):
        return "the field 'export' is not an object"
    data = manifest.get("data")
    if data is not None:
        if not isinstance(data, dict):
            return "the field 'data' is not an object"
        for key, low in (("epoch", 0), ("batch_in_epoch", 0), ("batch_size", 1), ("num_replicas", 1),
                         ("seed", -(2**63))):
            if not _is_int(data.get(key), low):
                return f"data.{key} is missing or not an integer >= {low}"
    for name, info in manifest["files"].items():
        if not safe_name(name):
            return (f"the file name {name!r} is not a plain name inside the checkpoint directory "
                    "(absolute paths, '..', separators and control characters are refused)")
        if not (isinstance(info, dict) and _is_int(info.get("bytes")) and isinstance(info.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", info["sha256"])):
            return f"files[{name!r}] is not {{bytes, sha256}}"
    if DCP_METADATA not in manifest["files"] and engine_of(manifest) == DCP:
        return f"it lists no {DCP_METADATA}"
    for name, spec in manifest["model_tensors"].items():
        problem = _tensor_spec_problem(name, spec)
        if problem:
            return problem
    return None


def verify_files(path: Path, manifest: dict[str, Any], names: list[str] | None = None,
                 identities: dict[str, list[int]] | None = None) -> list[str]:
    """Check size and SHA-256 of the manifest's files (or ``names`` of them); return the problems.

    Each file is opened once, without following symlinks, and must be a regular file; its size and
    hash come from that open file. ``identities`` (optional) receives each verified file's
    ``file_identity``, so a later read can prove it reads the very file that was verified.
    """
    problems = []
    for name in names if names is not None else sorted(manifest["files"]):
        info = manifest["files"][name]
        file = Path(path) / name
        if not os.path.lexists(file):
            problems.append(f"{name} is missing")
            continue
        try:
            fd = open_regular(file)
        except CheckpointError as e:
            problems.append(str(e).removesuffix("."))
            continue
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != info["bytes"]:
                problems.append(f"{name} has {size} bytes, the manifest says {info['bytes']} "
                                "(truncated or overwritten)")
                continue
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            if digest != info["sha256"]:
                problems.append(f"{name} does not match its SHA-256 checksum (corrupted)")
            elif identities is not None:
                identities[name] = file_identity(os.fstat(f.fileno()))
    return problems


def removed_error(path: Path) -> CheckpointError:
    """The error for a checkpoint that disappeared while it was being read."""
    return CheckpointError(
        f"checkpoint {path} was removed while it was being read: a run still writing to "
        f"{Path(path).parent} rotated it away (checkpoint.keep_last). Resume from a checkpoint that "
        "is not being rotated (copy it first), or wait for that run to finish."
    )


def corruption_error(path: Path, problems: list[str]) -> CheckpointError:
    """The error for a checkpoint whose files do not match its manifest."""
    path = Path(path)
    return CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}. {resume_instead(path)}")




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


def incompatible_error(path: Path, diffs: list[str], saved_names: Any = ()) -> CheckpointError:
    """The error for a checkpoint saved from a model of another shape (``saved_names``: its tensors)."""
    # GPT-2 under tensor parallel trains its fused c_attn as c_attn.q/k/v (parallel/tensor/gpt2.py); checkpoints
    # hold the fused c_attn whatever the layout, but those of shardwise before that held the slices.
    split = bool(split_names(saved_names))
    hint = (" It is a GPT-2 checkpoint saved under tensor parallel by an earlier shardwise, which stored c_attn "
            "as c_attn.q/k/v: resume it under tp > 1 (every checkpoint written from then on holds the fused "
            "c_attn, which resumes under any layout), or export it with `shardwise ckpt export --format hf` "
            "and start the other run from that folder (model.pretrained)."
            if split else "")
    return CheckpointError(
        f"checkpoint {path} was saved from a model of a different shape: {'; '.join(diffs)}. "
        "Resume with the same [model] settings it was trained with (see `shardwise ckpt inspect "
        f"{path}`).{hint}"
    )

