"""Reading a checkpoint without ever running code from it.

Tensors are read by DCP with ``torch.load(weights_only=True)``; DCP's non-tensor entries (optimizer
hyper-parameters) are normally read with ``weights_only=False``, so ``SafeLoadPlanner`` reads them
with ``weights_only=True``; DCP's ``.metadata`` is a plain pickle, so ``SafeFileSystemReader``
checks its SHA-256 against the manifest and then unpickles it with an allow-list of DCP's own
metadata classes (any other global is refused).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from shardwise.errors import CheckpointError
from shardwise.runtime.checkpoint.manifest import DCP_METADATA

# Globals DCP's .metadata pickle legitimately refers to (checked against torch 2.13's writer).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


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


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is checksum-verified, then unpickled with an allow-list."""

    def __init__(self, path: str | os.PathLike, expected_sha256: str | None) -> None:
        super().__init__(path)
        self.expected_sha256 = expected_sha256

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        meta_path = Path(self.path) / DCP_METADATA
        data = meta_path.read_bytes()
        if self.expected_sha256 is not None and hashlib.sha256(data).hexdigest() != self.expected_sha256:
            raise CheckpointError(f"{meta_path} does not match the checksum in the manifest; the "
                                  "checkpoint is corrupted or was altered.")
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{meta_path} is not DCP metadata.")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries are read with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"refusing to load the entry {read_item.dest_index.fqn!r}: it holds an object that a "
                f"weights-only load does not allow ({str(e).splitlines()[-1][:200]}). The checkpoint "
                "was altered or was not written by shardwise; do not load it."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_dcp_metadata(path: Path, manifest: dict[str, Any]) -> Metadata:
    """Return the verified, safely unpickled DCP metadata of the checkpoint at ``path``."""
    expected = manifest["files"].get(DCP_METADATA, {}).get("sha256")
    if expected is None:
        raise CheckpointError(f"the manifest of {path} lists no {DCP_METADATA}; the checkpoint is incomplete.")
    return SafeFileSystemReader(path, expected).read_metadata()

