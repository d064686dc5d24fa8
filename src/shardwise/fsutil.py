"""Crash-safe file writes shared by run directories, checkpoints and the watchdog.

Write-then-rename: a reader (or a resumed run) sees either the old file or the new one under the
final name, never a half-written one. ``durable=True`` also fsyncs the file and its directory,
for files whose loss after a power cut would lose work (checkpoint manifests, ``latest``);
frequent status files (heartbeats) skip the fsync.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename in it) to disk; a no-op where that is unsupported."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str, *, durable: bool = False) -> None:
    """Replace ``path`` with ``text`` atomically (a temporary file beside it, then a rename)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    if durable:
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, data: Any, *, durable: bool = False, **dumps: Any) -> None:
    """``atomic_write_text`` of ``json.dumps(data, **dumps)``."""
    atomic_write_text(path, json.dumps(data, **dumps), durable=durable)


def default_file_mode(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain ``open()`` would (0666 minus the umask).

    Writers that create files privately (safetensors' ``save_file`` makes them 0600) would leave
    an exported model unreadable to the group and others the rest of the export is readable by.
    """
    umask = os.umask(0)
    os.umask(umask)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~umask)


def real_path(path: str | os.PathLike) -> Path:
    """``path`` with its symbolic links resolved, never raising for a link loop.

    ``Path.resolve`` raises ``RuntimeError("Symlink loop")`` on Python 3.11 (``OSError`` later);
    ``os.path.realpath`` leaves a loop unresolved, and ``what_is`` then names it.
    """
    return Path(os.path.realpath(path))


def what_is(path: str | os.PathLike) -> str:
    """What is at ``path``, as the end of a sentence ("does not exist", "is a FIFO (named pipe)", ...)."""
    try:
        info = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link that leads back to itself (a loop of links)"
        if os.path.islink(path):
            return f"is a symbolic link to {os.readlink(path)!r}, which does not exist"
        if e.errno == errno.ENOENT:
            return "does not exist"
        return f"cannot be read ({e.strerror or e})"
    kinds = [(stat.S_ISDIR, "is a folder"), (stat.S_ISREG, "is a regular file"),
             (stat.S_ISFIFO, "is a FIFO (named pipe), not a file"),
             (stat.S_ISCHR, "is a character device, not a file"), (stat.S_ISBLK, "is a block device, not a file"),
             (stat.S_ISSOCK, "is a socket, not a file")]
    return next((text for test, text in kinds if test(info.st_mode)), "is not a regular file or folder")
