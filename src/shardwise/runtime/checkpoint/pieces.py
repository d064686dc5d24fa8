"""What a checkpoint holds: a dict of named Stateful pieces, each stored in one of three places.

``save_checkpoint`` and ``load_checkpoint`` loop over the dict; adding something to every
checkpoint is one entry (``Session.checkpoint_pieces["name"] = MyPiece(...)``, or one line in
``standard_pieces``), never an edit to save.py, load.py or ``Session.save/load``.

Every piece follows ``torch.distributed.checkpoint.stateful.Stateful`` (``state_dict()`` /
``load_state_dict(state)``) and says where its state goes by the base class it derives from:

- ``TensorPiece``: tensors, written and resharded by DCP under ``<name>.<key>`` (model, optimizer).
  ``state_dict()`` is called on save and, on load, gives the template DCP reads into (so it must
  describe this rank's current layout); ``load_state_dict`` then receives the filled template.
- ``ManifestPiece``: JSON data of the whole job, kept in ``manifest.json`` under ``<name>`` (data
  position, LR scheduler, the caller's state). Rank 0's is written; every rank loads it.
- ``RankPiece``: JSON data of one rank, kept in ``rng-rank<r>.json`` under ``<name>`` (RNG
  streams, loss scaler). Loaded only by the same rank of a job of the same world size, or, when
  ``from_rank0_when_resharded`` is true, from rank 0's file when the world size changed.

State is computed on every rank before any file is written, so a piece that refuses (state that
is not JSON data, say) raises on every rank alike and leaves nothing half written. A piece whose
``state_dict()`` returns None is recorded as absent; on load an absent piece's ``absent(path)`` is
asked for a note instead. A ``load_state_dict`` that raises ``ValueError``/``KeyError``/
``TypeError``/``AttributeError`` becomes a CheckpointError worded by ``load_error``.

The names below are today's on-disk keys (``model``/``optim`` in DCP, ``data``/``scheduler``/
``state`` in the manifest, ``rng``/``scaler`` in the rank files): checkpoints written before this
module existed load unchanged. An engine that checkpoints model and optimizer itself (DeepSpeed)
replaces the ``model``/``optim`` entries with its own pieces; see docs/checkpoints.md.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from shardwise.errors import ShardwiseError
from shardwise.models.gpt2_qkv import split_names
from shardwise.runtime.checkpoint.state import (
    model_state,
    optimizer_state,
    set_model_state,
    set_optimizer_state,
)
from shardwise.runtime.rng import capture_rng_state, restore_rng_state
from shardwise.runtime.scheduler import (
    apply_scheduler_state,
    restore_scheduler,
    scheduler_load_error,
    scheduler_state,
)

# Manifest keys that belong to the checkpoint itself, never to a piece.
RESERVED_MANIFEST_KEYS = frozenset({
    "format", "version", "step", "strategy", "world_size", "created", "torch", "has_optimizer",
    "fingerprint", "model_tensors", "files", "job", "frozen_excluded", "export", "checksum",
})


class Piece(Stateful):
    """One named part of a checkpoint (see the module docstring for where each kind is stored)."""

    def state_dict(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_state_dict(self, state: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def absent(self, path: Any) -> str | None:
        """A note for the load report when the checkpoint holds no state for this piece."""
        return None

    def load_error(self, name: str, path: Any, error: BaseException) -> str:
        """The CheckpointError message when ``load_state_dict`` refused the saved state."""
        return f"cannot restore '{name}' from {path}: {type(error).__name__}: {error}."


class TensorPiece(Piece):
    """Tensors saved and resharded by DCP."""

    def load_template(self, saved_keys: set[str]) -> Any:
        """What DCP reads into; ``saved_keys`` are this piece's keys in the checkpoint (prefix removed)."""
        return self.state_dict()


class ManifestPiece(Piece):
    """JSON data of the whole job, kept in manifest.json."""


class RankPiece(Piece):
    """JSON data of one rank, kept in rng-rank<r>.json."""

    from_rank0_when_resharded = False


# ---------------------------------------------------------------------------------- DCP pieces
def _saved_split(saved_keys: set[str]) -> bool:
    """Whether a checkpoint holds GPT-2's c_attn as q/k/v slices (``parallel/tensor/gpt2.py``): written
    under TP by shardwise before checkpoints held the fused tensor whatever the layout."""
    return bool(split_names(saved_keys))


class ModelPiece(TensorPiece):
    """The model's parameters and buffers, keyed by the plain model's names whatever the wrapping."""

    def __init__(self, model: nn.Module, trainable_only: bool = False) -> None:
        self.model, self.trainable_only = model, trainable_only

    def state_dict(self) -> dict[str, Any]:
        return model_state(self.model, self.trainable_only)

    def load_template(self, saved_keys: set[str]) -> dict[str, Any]:
        # Saved as q/k/v slices (GPT-2 under TP, by shardwise before the fused format): read them as such.
        return model_state(self.model, self.trainable_only, fused=not _saved_split(saved_keys))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state(self.model, state, self.trainable_only)


class OptimizerPiece(TensorPiece):
    """The optimizer's state and hyper-parameters, keyed by parameter name (see state.py)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False) -> None:
        self.model, self.optimizer, self.trainable_only = model, optimizer, trainable_only
        self._kept: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return optimizer_state(self.model, self.optimizer, self.trainable_only)

    def load_template(self, saved_keys: set[str]) -> dict[str, Any]:
        state = optimizer_state(self.model, self.optimizer, self.trainable_only, fused=not _saved_split(saved_keys))
        # An LR scheduler adds ``initial_lr`` to the param groups, so a checkpoint saved without one
        # lacks it. It is the scheduler's own value (its base_lrs, restored from its JSON state):
        # keep the current one rather than refuse the checkpoint.
        self._kept = {k: v for k, v in state.items() if k.endswith(".initial_lr") and k not in saved_keys}
        return {k: v for k, v in state.items() if k not in self._kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state(self.model, self.optimizer, {**state, **self._kept}, self.trainable_only)


# ----------------------------------------------------------------------------- manifest pieces
class LoaderPiece(ManifestPiece):
    """A ShardedLoader's position (the next batch), mapped onto another rank count on load."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any] | None:
        return self.loader.state_dict() if self.loader is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.loader is not None:
            self.loader.load_state_dict(state)

    def load_error(self, name: str, path: Any, error: BaseException) -> str:
        return f"cannot continue the data order of {path}: {error}."


class SchedulerPiece(ManifestPiece):
    """The LR scheduler's state_dict, as JSON data (never pickled)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any] | None:
        return scheduler_state(self.scheduler) if self.scheduler is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None:
            apply_scheduler_state(self.scheduler, state)

    def absent(self, path: Any) -> str | None:
        return restore_scheduler(self.scheduler, None, str(path)) if self.scheduler is not None else None

    def load_error(self, name: str, path: Any, error: BaseException) -> str:
        return scheduler_load_error(self.scheduler, str(path), error)


class JsonPiece(ManifestPiece):
    """Plain JSON data of the caller (the trainer's loss, seed, model description...)."""

    def __init__(self, value: dict[str, Any] | None = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        state = self.value or {}
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise ShardwiseError(f"the checkpoint's state is not JSON data ({e}); pass numbers, strings, "
                                 "lists and dicts only.") from None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state


# --------------------------------------------------------------------------------- rank pieces
class RngPiece(RankPiece):
    """This rank's RNG streams (Python, NumPy, torch CPU and accelerator); restored only on the same rank."""

    def __init__(self, restore: bool = True) -> None:
        self.restore = restore
        self.value: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state
        if self.restore:
            restore_rng_state(state)


class ScalerPiece(RankPiece):
    """The loss scaler (fp16); identical on every rank, so rank 0's serves a new world size."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    @property
    def from_rank0_when_resharded(self) -> bool:  # type: ignore[override]
        return self.scaler is not None

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def standard_pieces(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, scheduler: Any = None, state: dict[str, Any] | None = None,
                    scaler: Any = None, trainable_only: bool = False,
                    restore_rng: bool = True) -> dict[str, Piece]:
    """The pieces every shardwise checkpoint holds, under their on-disk names, in load order.

    Order matters on load: tensors first, then the scheduler (which writes its learning rates into
    the freshly loaded optimizer), then the per-rank pieces.
    """
    pieces: dict[str, Piece] = {"model": ModelPiece(model, trainable_only)}
    if optimizer is not None:
        pieces["optim"] = OptimizerPiece(model, optimizer, trainable_only)
    pieces.update(data=LoaderPiece(loader), scheduler=SchedulerPiece(scheduler), state=JsonPiece(state),
                  rng=RngPiece(restore_rng), scaler=ScalerPiece(scaler))
    return pieces


def split_pieces(pieces: dict[str, Piece]) -> tuple[dict[str, TensorPiece], dict[str, ManifestPiece],
                                                    dict[str, RankPiece]]:
    """(DCP pieces, manifest pieces, rank pieces); a name the manifest reserves, or no kind, is refused."""
    tensors, manifest, ranks = {}, {}, {}
    for name, piece in pieces.items():
        if isinstance(piece, TensorPiece):
            tensors[name] = piece
        elif isinstance(piece, ManifestPiece):
            if name in RESERVED_MANIFEST_KEYS:
                raise ShardwiseError(f"checkpoint piece '{name}' would overwrite the manifest's own "
                                     f"'{name}' entry; name it otherwise (reserved: "
                                     f"{', '.join(sorted(RESERVED_MANIFEST_KEYS))}).")
            manifest[name] = piece
        elif isinstance(piece, RankPiece):
            ranks[name] = piece
        else:
            raise ShardwiseError(f"checkpoint piece '{name}' is a {type(piece).__name__}; a piece derives "
                                 "from TensorPiece, ManifestPiece or RankPiece "
                                 "(shardwise.runtime.checkpoint.pieces) so that it is known where to store it.")
    if "model" not in tensors:
        raise ShardwiseError("a checkpoint needs a 'model' TensorPiece (its shapes are checked on load).")
    return tensors, manifest, ranks
