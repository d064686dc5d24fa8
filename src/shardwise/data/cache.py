"""The on-disk cache of tokenised data: where it lives, how entries are named, and who builds one.

An entry is named by a SHA-256 of everything that decides its content (source files' paths,
sizes and modification times, the tokenizer's files, the library versions), so a changed input
is a new entry and a stale one is never read. Entries are published by rename (a reader sees a
whole file or none), and an exclusive ``flock`` on the entry's lock file makes the first process
build it while the others (ranks of one job, or two jobs) wait and then read it.

Under ``read_only()`` (``--dry-run``, which promises to write nothing) the cache folder is only
read: an existing entry is used, no folder or lock file is created, and a missing entry is built
in a temporary folder that is removed when the dry run ends (``build_root``).
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

DEFAULT_CACHE_DIR = "~/.cache/shardwise"

# The scratch folder of the current read-only (dry) run; None: entries are built in the cache.
_SCRATCH: contextvars.ContextVar[Path | None] = contextvars.ContextVar("shardwise_cache_scratch", default=None)


@contextlib.contextmanager
def read_only() -> Iterator[None]:
    """Leave every cache folder as it is for the block (a dry run): see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="shardwise-dry-run-") as tmp:
        token = _SCRATCH.set(Path(tmp))
        try:
            yield
        finally:
            _SCRATCH.reset(token)


def build_root(root: Path) -> Path:
    """Where a missing entry of ``root`` is built: ``root`` itself, or the dry run's scratch folder."""
    return _SCRATCH.get() or root


def where_built(root: Path) -> str:
    """How the "tokenising ..." line ends: where the entry goes and whether later runs find it."""
    if _SCRATCH.get() is not None:
        return f"for this dry run only (in a temporary folder; a real run caches it in {root})"
    return f"into {root}; later runs reuse it"


def cache_root(cache_dir: str) -> Path:
    """The cache folder ``data.cache_dir`` names (default ``~/.cache/shardwise``), created if needed
    (under ``read_only()``: checked as a real run would, but neither created nor written)."""
    root = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
    if _SCRATCH.get() is not None:
        _check_creatable(root)
        return root
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the data cache folder {str(root)!r} ({e.strerror}); set "
                          "data.cache_dir to a writable folder.") from None
    if not os.access(root, os.W_OK):
        raise ConfigError(f"the data cache folder {str(root)!r} is not writable; set data.cache_dir "
                          "to a writable folder.")
    return root


def _check_creatable(root: Path) -> None:
    # What a real run's mkdir + write check would say, found without creating anything.
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(f"cannot create the data cache folder {str(root)!r} ({str(existing)!r} is a file); "
                          "set data.cache_dir to a writable folder.")
    if not os.access(existing, os.W_OK):
        what = "is not writable" if existing == root else f"cannot be created ({str(existing)!r} is not writable)"
        raise ConfigError(f"the data cache folder {str(root)!r} {what}; set data.cache_dir to a writable folder.")


def cache_key(parts: dict[str, Any]) -> str:
    """A short stable name for the cache entry described by ``parts`` (JSON data)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def file_identity(path: Path) -> list[Any]:
    """[absolute path, size, mtime in ns]: what says a file is unchanged without reading it."""
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if absent) for the block.

    Under ``read_only()`` an absent lock file is not created (nobody is building that entry, and
    what this process builds goes to its own scratch folder); an existing one is still waited on.
    """
    if _SCRATCH.get() is not None:
        if not lock_file.is_file():
            yield
            return
        mode = "rb"
    else:
        mode = "a+b"
    with open(lock_file, mode) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # blocks while another process builds the entry
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
