"""The on-disk cache of tokenised data: where it lives, how entries are named, and who builds one.

An entry is named by a SHA-256 of everything that decides its content (source files' paths,
sizes and modification times, the tokenizer's files, the library versions), so a changed input
is a new entry and a stale one is never read. Entries are published by rename (a reader sees a
whole file or none), and an exclusive ``flock`` on the entry's lock file makes the first process
build it while the others (ranks of one job, or two jobs) wait and then read it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

DEFAULT_CACHE_DIR = "~/.cache/shardwise"


def cache_root(cache_dir: str) -> Path:
    """The cache folder ``data.cache_dir`` names (default ``~/.cache/shardwise``), created if needed."""
    root = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the data cache folder {str(root)!r} ({e.strerror}); set "
                          "data.cache_dir to a writable folder.") from None
    if not os.access(root, os.W_OK):
        raise ConfigError(f"the data cache folder {str(root)!r} is not writable; set data.cache_dir "
                          "to a writable folder.")
    return root


def cache_key(parts: dict[str, Any]) -> str:
    """A short stable name for the cache entry described by ``parts`` (JSON data)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def file_identity(path: Path) -> list[Any]:
    """[absolute path, size, mtime in ns]: what says a file is unchanged without reading it."""
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if absent) for the block."""
    with open(lock_file, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # blocks while another process builds the entry
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
