"""Reading a checkpoint without ever running code from it, or reading outside it.

Tensors are read by DCP with ``torch.load(weights_only=True)``; DCP's non-tensor entries (optimizer
hyper-parameters) are normally read with ``weights_only=False``, so ``SafeLoadPlanner`` reads them
with ``weights_only=True``; DCP's ``.metadata`` is a plain pickle, so ``SafeFileSystemReader``
checks its SHA-256 against the manifest and then unpickles it with an allow-list of DCP's own
metadata classes (any other global is refused).

Confinement: DCP opens whatever file its metadata names. ``SafeFileSystemReader`` checks, before
any read, that every storage entry of the metadata names a file the manifest lists (a plain name
inside the checkpoint directory) at an offset and length inside that file's recorded size, and
opens files only through ``_ConfinedFileSystem``: no symlink is followed, only regular files are
read (a FIFO would block forever), and a file whose identity changed since it was verified
(replaced or written: inode, size, mtime, ctime) is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from shardwise.errors import CheckpointError
from shardwise.runtime.checkpoint.manifest import DCP_METADATA, file_identity, open_regular, safe_name

# Globals DCP's .metadata pickle legitimately refers to (checked against torch 2.13's writer).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}
# Without a manifest (a raw DCP folder) the metadata's size is unknown; no real one is this big.
_MAX_RAW_METADATA_BYTES = 1 << 30


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every global that is not one of DCP's data classes."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _METADATA_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return super().find_class(module, name)
            if module in _METADATA_MODULES:
                obj = super().find_class(module, name)
                # Only classes defined by DCP itself (dataclasses, enums); never a function or an
                # imported helper reachable as a module attribute (e.g. ``filesystem.os``).
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
        raise CheckpointError(
            f"refusing to load DCP metadata that refers to {module}.{name}: a checkpoint's "
            ".metadata may only hold DCP's own metadata classes. The file was altered or is not a "
            "shardwise/DCP checkpoint; do not load it."
        )


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(d, int) and d >= 0 for d in value)


def metadata_problem(metadata: Any, files: dict[str, dict[str, Any]] | None) -> str | None:
    """What makes unpickled DCP metadata unsafe or malformed (None when it is neither).

    Every storage entry must name a data file of ``files`` (the manifest's list: plain names inside
    the checkpoint directory) at an offset and length inside that file; tensor entries must have
    sizes, dtypes and chunks that fit together.
    """
    if not isinstance(metadata, Metadata):
        return "it is not DCP metadata"
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        return "its entry tables are not dictionaries"
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"entry {key!r} is not named by a string"
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata) or not _is_size(item.size) \
                or not isinstance(getattr(item.properties, "dtype", None), torch.dtype):
            return f"entry {key!r} is not a tensor or bytes entry with a valid size and dtype"
        if not isinstance(item.chunks, list):
            return f"entry {key!r} has no chunk list"
        for chunk in item.chunks:
            if not (isinstance(chunk, ChunkStorageMetadata) and _is_size(chunk.offsets) and _is_size(chunk.sizes)
                    and len(chunk.offsets) == len(chunk.sizes) == len(item.size)
                    and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, item.size))):
                return f"entry {key!r} has a chunk outside the tensor's size"
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "a storage entry is not DCP's (index, storage info)"
        rel = info.relative_path
        if not safe_name(rel) or rel == DCP_METADATA or (files is not None and rel not in files):
            return (f"the storage entry of {index.fqn!r} points at {rel!r}, which is not a data file "
                    "listed in the manifest (paths outside the checkpoint directory are refused)")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
            return f"the storage entry of {index.fqn!r} has an invalid offset or length"
        if files is not None and info.offset + info.length > files[rel]["bytes"]:
            return f"the storage entry of {index.fqn!r} reaches past the end of {rel}"
        if info.transform_descriptors:
            return f"the storage entry of {index.fqn!r} asks for stream transforms shardwise never writes"
    return None


class _ConfinedFileSystem(FileSystem):
    """DCP's file system, but reading only listed regular files inside one directory."""

    def __init__(self, root: Path, files: dict[str, dict[str, Any]] | None,
                 identities: dict[str, list[int]] | None) -> None:
        super().__init__()
        self.root = Path(root)
        self.files = files
        self.identities = identities or {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise CheckpointError(f"a checkpoint is opened read-only here (asked for {mode!r} on {path}).")
        p = Path(path)
        if p.parent != self.root or not safe_name(p.name) or (self.files is not None and p.name not in self.files):
            raise CheckpointError(f"refusing to read {path}: not a file listed in the manifest of {self.root}.")
        fd = open_regular(p)
        with os.fdopen(fd, "rb") as stream:
            st = os.fstat(fd)
            expected = self.files[p.name]["bytes"] if self.files is not None else st.st_size
            known = self.identities.get(p.name)
            if st.st_size != expected or (known is not None and file_identity(st) != known):
                raise CheckpointError(f"{path} changed after it was verified (replaced or written "
                                      "since); refusing to load it. Another process is writing this "
                                      "checkpoint directory.")
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader confined to the manifest's files, with a verified, allow-listed ``.metadata``.

    ``files`` is the manifest's file list (name -> bytes, sha256); ``identities`` (optional) the
    ``file_identity`` of each file as it was verified. Without ``files`` (a raw DCP folder) the
    regular files of the directory are the list.
    """

    def __init__(self, path: str | os.PathLike, expected_sha256: str | None = None, *,
                 files: dict[str, dict[str, Any]] | None = None,
                 identities: dict[str, list[int]] | None = None) -> None:
        super().__init__(path)
        self.expected_sha256 = expected_sha256
        self.files = files
        self.fs = _ConfinedFileSystem(Path(self.path), files, identities)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta_path = Path(self.path) / DCP_METADATA
        limit = self.files[DCP_METADATA]["bytes"] if self.files and DCP_METADATA in self.files \
            else _MAX_RAW_METADATA_BYTES
        # Hashed and unpickled from the same bytes of the same open file.
        with self.fs.create_stream(meta_path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise CheckpointError(f"{meta_path} is larger than the manifest says; the checkpoint was altered.")
        if self.expected_sha256 is not None and hashlib.sha256(data).hexdigest() != self.expected_sha256:
            raise CheckpointError(f"{meta_path} does not match the checksum in the manifest; the "
                                  "checkpoint is corrupted or was altered.")
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to parse untrusted bytes means "not metadata"
            raise CheckpointError(f"{meta_path} cannot be read as DCP metadata ({type(e).__name__}: "
                                  f"{str(e)[:200]}); the checkpoint is corrupted or was altered.") from None
        problem = metadata_problem(metadata, self.files)
        if problem:
            raise CheckpointError(f"{meta_path} is not safe to load: {problem}. The checkpoint was "
                                  "altered or was not written by shardwise; do not load it.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries are read with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"refusing to load the entry {read_item.dest_index.fqn!r}: it holds an object that a "
                f"weights-only load does not allow ({str(e).splitlines()[-1][:200]}). The checkpoint "
                "was altered or was not written by shardwise; do not load it."
            ) from None
        except (RuntimeError, EOFError, ValueError) as e:
            raise CheckpointError(f"the entry {read_item.dest_index.fqn!r} cannot be read ({type(e).__name__}: "
                                  f"{str(e)[:200]}); the checkpoint is corrupted.") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_dcp_metadata(path: Path, manifest: dict[str, Any]) -> Metadata:
    """Return the verified, safely unpickled and checked DCP metadata of the checkpoint at ``path``."""
    expected = manifest["files"].get(DCP_METADATA, {}).get("sha256")
    if expected is None:
        raise CheckpointError(f"the manifest of {path} lists no {DCP_METADATA}; the checkpoint is incomplete.")
    return SafeFileSystemReader(path, expected, files=manifest["files"]).read_metadata()
