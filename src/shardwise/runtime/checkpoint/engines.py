"""Checkpoint engines: who writes a checkpoint's tensors, inside shardwise's one protocol.

Every checkpoint is a ``step-N`` directory written as ``.partial-step-N.<job>``, checksummed into
``manifest.json`` and published by an atomic rename that ``latest`` then names (``save``), read
back only after its checksums and shapes are checked on every rank (``load``). Who writes the
tensors inside it is the engine, recorded in the manifest (``"engine"``; ``manifest.engine_of``):

* ``dcp`` (no entry here): PyTorch DCP, for every strategy whose parameters torch's state-dict API
  reads (``save.save_checkpoint``, ``load.load_checkpoint``, ``export``);
* an engine that owns its files, e.g. DeepSpeed's ZeRO partitions (``deepspeed_engine``): it
  implements :class:`CheckpointEngine` with the protocol's public parts (``save.partial_dir_name``
  and ``publish``, ``locate.rotate``, ``load.resolve_everywhere``, ``read_rank_file`` and
  ``foreign_engine_error``, ``manifest.verify_files`` ...), and is listed in ``ENGINES``.

A strategy names its engine (``Strategy.checkpoint_engine``); the Session's save and load and the
exports (``ckpt export``, ``verify --resume``) ask :func:`engine_for`. Adding an engine: one module
implementing the protocol, one entry below.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shardwise.errors import CheckpointError
from shardwise.runtime.checkpoint import deepspeed_engine
from shardwise.runtime.checkpoint.load import LoadedCheckpoint
from shardwise.runtime.checkpoint.manifest import DCP


class CheckpointEngine(Protocol):
    """What an engine that writes its own files provides (collective where a process group is)."""

    def save(self, session: Any, root: str | os.PathLike, model: nn.Module, optimizer: Any, *, step: int,
             state: dict[str, Any] | None = None, loader: Any = None, scheduler_state: dict[str, Any] | None = None,
             keep_last: int = 0, on_written: Any = None) -> Path:
        """Write and publish the checkpoint of ``step`` under ``root``; return its directory."""
        ...

    def load(self, session: Any, source: str | os.PathLike, model: nn.Module, optimizer: Any, *,
             loader: Any = None, scheduler: Any = None, restore_rng: bool = True) -> LoadedCheckpoint:
        """Verify, then restore the model, optimizer, data position, scheduler and this rank's RNG."""
        ...

    def read_full_state(self, path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The consolidated weights of a verified checkpoint, in one process (no process group)."""
        ...

    def engine_entries(self, path: Path, manifest: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(consolidated weights, DCP-like metadata per name) for the Hugging Face / PEFT exports."""
        ...


ENGINES: dict[str, CheckpointEngine] = {deepspeed_engine.ENGINE: deepspeed_engine}


def engine_for(name: str) -> CheckpointEngine | None:
    """The engine that reads and writes checkpoints named ``name`` (None: PyTorch DCP, the default)."""
    if name == DCP:
        return None
    if name not in ENGINES:
        raise CheckpointError(f"checkpoint engine {name!r} is not one this shardwise knows "
                              f"({', '.join([DCP, *ENGINES])}): the checkpoint was written by another version, "
                              "or its manifest was altered.")
    return ENGINES[name]
