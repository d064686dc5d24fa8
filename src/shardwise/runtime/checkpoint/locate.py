"""Finding checkpoints under a checkpoints root: complete ones, ``latest``, and rotation."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shardwise.errors import CheckpointError
from shardwise.runtime.checkpoint.manifest import LATEST, MANIFEST, PARTIAL_PREFIX


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete (manifest-bearing) step-N checkpoints under ``root``, oldest first."""
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
                              f"{', '.join(p.name for p in complete_checkpoints(Path(root))) or 'none'}.")
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
    complete = complete_checkpoints(root)
    if complete:
        raise CheckpointError(f"{root} has no '{LATEST}' pointer; pass one of its checkpoints "
                              f"explicitly: {', '.join(str(c) for c in complete)}.")
    partial = [c.name for c in root.iterdir() if c.name.startswith(PARTIAL_PREFIX)] if root.is_dir() else []
    extra = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
    raise CheckpointError(f"no checkpoint to resume in {p}{extra}. A resume needs a run directory, "
                          "its checkpoints/ folder, or a step-N checkpoint folder.")



def rotate(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints and any stale partial ones."""
    keep = complete_checkpoints(root)[-keep_last:]
    latest = latest_checkpoint(root)
    removed = []
    for p in root.iterdir():
        stale_partial = p.name.startswith(PARTIAL_PREFIX)
        old_complete = p.name.startswith("step-") and p not in keep and p != latest
        if p.is_dir() and (stale_partial or old_complete):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
