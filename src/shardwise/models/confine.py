"""A pretrained folder is confined to itself: the files it names are plain files inside it.

``model.safetensors.index.json`` is data from wherever the folder came from. An entry such as
``../../outside/model.safetensors``, ``/etc/passwd`` or ``/proc/self/mem`` must never be opened:
``confined_file`` checks a name *before* anything is opened and returns the path only when it is

* a plain file name (a string without ``/``, ``\\``, NUL, and not ``.`` or ``..``), so it lies in
  the folder itself;
* a regular file (never a device, FIFO or ``/proc`` entry), or a symbolic link to a regular file
  inside the folder or, for a folder in the Hugging Face cache (``<repo>/snapshots/<revision>``),
  inside that repository's ``blobs/`` (where the cache keeps the bytes its snapshots link to).

Error messages name the entry and the folder, never bytes of a refused file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shardwise.errors import ConfigError
from shardwise.fsutil import real_path, what_is


def hf_cache_blobs(folder: Path) -> Path | None:
    """``<repo>/blobs`` when ``folder`` is a Hugging Face cache snapshot ``<repo>/snapshots/<rev>``."""
    real = real_path(folder)
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent / "blobs"
    return None


def confined_file(folder: Path, name: object, what: str) -> Path:
    """The path of file ``name`` in ``folder``; ConfigError when it would lead outside or is not a regular file.

    ``what`` says where the name came from (e.g. "the index model.safetensors.index.json").
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{what} of the pretrained folder {str(folder)!r} names a weight file as "
                          f"{type(name).__name__} {name!r}; file names must be non-empty strings.")
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or os.path.isabs(name):
        raise ConfigError(f"{what} of the pretrained folder {str(folder)!r} names the weight file {name!r}, "
                          "which is not a plain file name inside the folder (absolute paths, '..' and "
                          "sub-paths are refused: a model folder may only read its own files).")
    path = folder / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path  # absent: the caller reports missing files together
    except OSError as e:
        raise ConfigError(f"cannot read {name!r} in the pretrained folder {str(folder)!r}: "
                          f"{e.strerror or e}.") from None
    if stat.S_ISLNK(info.st_mode):
        if "loop" in what_is(path):
            raise ConfigError(f"{name!r} in the pretrained folder {str(folder)!r} {what_is(path)}; weight "
                              "files must be regular files.")
        target = real_path(path)
        inside = [real_path(folder), *filter(None, [hf_cache_blobs(folder)])]
        if not any(target.is_relative_to(root) for root in inside):
            raise ConfigError(f"{name!r} in the pretrained folder {str(folder)!r} is a symbolic link to "
                              f"{str(target)!r}, outside the folder; a model folder may only read its own "
                              "files. Copy the file into the folder instead of linking it.")
        try:
            info = os.stat(path)
        except OSError:
            return path  # a dangling link reads as a missing file
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{name!r} in the pretrained folder {str(folder)!r} is not a regular file "
                          "(a device, FIFO, folder or special file); weight files must be regular files.")
    return path
