"""Finding checkpoints under a checkpoints root: complete ones, ``latest``, and rotation.

Rotation only ever deletes what this job wrote: complete checkpoints whose manifest names this
job, and partial directories of this job or of a writer that is provably gone. Checkpoints of
earlier jobs (a run continued with ``--resume``) and partial directories a live job is writing
are left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from shardwise.core.run_files import CHECKPOINTS_DIR
from shardwise.errors import CheckpointError
from shardwise.fsutil import what_is
from shardwise.runtime.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    PARTIAL_OWNER,
    PARTIAL_PREFIX,
    is_step_dir_name,
    resume_instead,
)
from shardwise.runtime.identity import same_process_alive


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete (manifest-bearing) step-N checkpoints under ``root``, oldest first.

    Symbolic links are not checkpoints of this root: a link to a checkpoint elsewhere is skipped.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_step_dir_name(p.name) and not p.is_symlink() and p.is_dir()
             and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name)


def missing_latest_error(root: Path, complete: list[Path], who: str) -> CheckpointError:
    """The error for complete checkpoints without a ``latest`` pointer: never start fresh over them."""
    return CheckpointError(
        f"{who} found complete checkpoints in {root} but no '{LATEST}' pointer to the newest one, so "
        f"it will not start fresh over them. Resume one explicitly, e.g. --resume {complete[-1]} "
        f"(all: {', '.join(p.name for p in complete)}), or move them away to start over."
    )


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names, or None when nothing was published under ``root``."""
    pointer = Path(root) / LATEST
    if pointer.is_symlink() or (pointer.exists() and not pointer.is_file()):
        # Written by shardwise as a small regular file; a link (perhaps to a file outside the run)
        # is never followed, and nothing of its target is read or quoted.
        raise CheckpointError(f"{pointer} is not a regular file (a symbolic link or a special file); "
                              "shardwise writes 'latest' as a small file naming a checkpoint in "
                              f"{root}. Remove it and pass --resume with one of: "
                              f"{', '.join(p.name for p in complete_checkpoints(Path(root))) or 'none'}.")
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text(encoding="utf-8")[:300].strip()
    except (OSError, UnicodeDecodeError):
        name = "?"
    target = Path(root) / name
    if is_step_dir_name(name) and target.is_dir() and not target.is_symlink() and not (target / MANIFEST).is_file():
        # The save publishes 'latest' only after the manifest: it was deleted or damaged since.
        what = "is not a regular file" if os.path.lexists(target / MANIFEST) else "is missing"
        raise CheckpointError(f"{pointer} names {name}, but its {MANIFEST} {what}: that checkpoint was "
                              f"damaged after it was saved (shardwise writes the manifest before "
                              f"'{LATEST}') and cannot be loaded. {resume_instead(target)}")
    if not is_step_dir_name(name) or target.is_symlink() or not (target / MANIFEST).is_file():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint in "
                              f"{root}. Pass --resume with one of: "
                              f"{', '.join(p.name for p in complete_checkpoints(Path(root))) or 'none'}.")
    return target


def resolve_checkpoint(source: str | os.PathLike) -> Path:
    """Return the checkpoint directory meant by ``source``: a checkpoint, a checkpoints root or a run dir."""
    p = Path(source)
    if not p.exists():
        raise CheckpointError(f"no checkpoint to resume: {str(p)!r} {what_is(p)}.")
    if (p / MANIFEST).is_file():
        if p.is_symlink():
            raise CheckpointError(f"{p} is a symbolic link; shardwise reads a checkpoint only from a real "
                                  "directory (pass the link's target itself if you trust it).")
        return p
    if p.name.startswith(PARTIAL_PREFIX):
        raise CheckpointError(f"{p} is an incomplete checkpoint (its save was interrupted) and "
                              "cannot be loaded; use the checkpoint named in 'latest' next to it.")
    root = p / CHECKPOINTS_DIR if (p / CHECKPOINTS_DIR).is_dir() else p
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


def checkpoint_job(path: Path) -> str | None:
    """The job id recorded in the manifest of ``path`` (None when unreadable or not recorded)."""
    try:
        job = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8")).get("job")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return job if isinstance(job, str) and job else None


def partial_owner(partial: Path) -> dict | None:
    """The owner record of a partial directory (None when it has none or it is unreadable)."""
    with contextlib.suppress(OSError, UnicodeDecodeError, ValueError):
        owner = json.loads((partial / PARTIAL_OWNER).read_text(encoding="utf-8"))
        if isinstance(owner, dict):
            return owner
    return None


def removable_partial(partial: Path, job: str) -> bool:
    """True when ``partial`` was left by this job, or by a writer that is provably no longer running."""
    owner = partial_owner(partial)
    if owner is None:
        return False  # being created right now, or from an older shardwise: not ours to judge
    if owner.get("job") == job:
        return True
    return same_process_alive(owner) is False


def rotate(root: Path, keep_last: int, job: str) -> list[Path]:
    """Delete this job's complete checkpoints but its newest ``keep_last``, and stale partial ones.

    Returns what was removed. Checkpoints of other jobs and the one ``latest`` names are never
    deleted; a partial directory only when ``removable_partial`` says so.
    """
    own = [p for p in complete_checkpoints(root) if checkpoint_job(p) == job]
    keep = set(own[-keep_last:]) if keep_last > 0 else set(own)
    try:
        latest = latest_checkpoint(root)
    except CheckpointError:
        latest = None
    removed = []
    for p in own:
        if p not in keep and p != latest:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    for p in root.iterdir():
        if p.name.startswith(PARTIAL_PREFIX) and not p.is_symlink() and p.is_dir() and removable_partial(p, job):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def resume_source(resume: str, checkpoints: Path, *, restart: str = "") -> str | None:
    """Where a run resumes from: the one reading of ``checkpoint.resume`` (the launcher's preflight
    and every rank of the trainer ask it). None: a fresh start.

    ``checkpoints``: this run's own checkpoint directory. ``restart``: set (e.g. "elastic restart
    2") when this attempt restarts after a failure: it continues from the run's newest checkpoint,
    like ``resume = "auto"``; before the first one was written, from the user's resume source, or
    else from scratch -- never from scratch over complete checkpoints whose 'latest' is missing.
    """
    if restart or resume == "auto":
        if latest_checkpoint(checkpoints) is not None:
            return str(checkpoints)
        complete = complete_checkpoints(checkpoints)
        if complete:
            raise missing_latest_error(checkpoints, complete, restart or 'checkpoint.resume = "auto"')
        return resume if resume not in ("", "auto", "latest") else None
    if resume == "latest":
        return str(checkpoints)  # loading raises a clear error when there is none
    return resume or None
