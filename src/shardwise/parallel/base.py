"""What every strategy provides: a mesh layout, up-front checks, ``apply`` and step-time hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.config import ParallelConfig


@dataclass
class ParallelContext:
    """What a strategy needs to apply itself on one rank."""

    world_size: int
    rank: int
    device: torch.device
    options: ParallelConfig
    mesh: object | None = None  # torch DeviceMesh, built by the Session from ``mesh_layout``


class Strategy:
    """Base strategy: plain single-process training. Subclasses override what differs."""

    name = "single"
    description = "one process, no parallelism"

    def check(self, world_size: int, options: ParallelConfig) -> None:
        """Raise ConfigError when this strategy cannot run on ``world_size`` ranks with ``options``."""
        from shardwise.errors import ConfigError

        if world_size != 1:
            raise ConfigError(
                f"strategy 'single' runs one process, but {world_size} were launched. "
                "Use --nproc 1, or a parallel strategy such as 'ddp'."
            )

    def mesh_layout(self, world_size: int, options: ParallelConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Return (shape, dim names) of the device mesh; the Session builds it with init_device_mesh."""
        return (world_size,), ("dp",)

    def apply(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        """Return the model to train (wrapped or sharded in place)."""
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                       ctx: ParallelContext) -> torch.optim.Optimizer:
        """Return the optimizer to step (ZeRO-1 swaps in a sharded one)."""
        return optimizer

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Context in which backward accumulates local gradients without communicating."""
        yield

    def forward_backward(self, session: Any, model: nn.Module, inputs: torch.Tensor,
                         targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """One micro-batch's forward, loss and backward (inside ``session.accumulate``)."""
        with session.autocast():
            loss = loss_fn(model(inputs), targets)
        session.backward(loss)
        return loss.detach()

    def eval_loss(self, session: Any, model: nn.Module, inputs: torch.Tensor,
                  targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Mean loss of one batch without gradients."""
        with session.autocast():
            return loss_fn(model(inputs), targets).detach()

    def dp_coords(self, ctx: ParallelContext) -> tuple[int, int]:
        """Return (data-parallel rank, data-parallel size): which slice of each batch this rank reads."""
        return ctx.rank, ctx.world_size

    def uses_autocast(self) -> bool:
        """Whether mixed precision comes from torch.autocast (True) or from the wrapper itself."""
        return True

    def needs_process_group(self) -> bool:
        """Whether this strategy needs a process group and mesh even on a single rank."""
        return False

    def process_group_backend(self, device: torch.device) -> str:
        """Return the torch.distributed backend string for ranks on ``device``."""
        from shardwise.runtime.device import backend_for

        return backend_for(device)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """Return the fp16 loss scaler (sharded strategies all-reduce its found-inf flag)."""
        return torch.amp.GradScaler(device.type)

    def applies_activation_checkpointing(self) -> bool:
        """True when ``apply`` places activation checkpointing itself (e.g. between TP and FSDP);
        otherwise the Session wraps the blocks before calling ``apply``."""
        return False

    def check_model(self, model: nn.Module, world_size: int, options: ParallelConfig) -> None:
        """Raise ConfigError when ``model``'s shape does not fit the strategy (a meta model works).

        Called from ``apply`` (the same error on every rank) and usable before launch.
        """

    # True where each rank keeps only part of the parameters (pipeline stages): the optimizer
    # passed to Session.prepare drops the parameters this rank does not hold.
    partitions_parameters = False

    def clip_grad_norm(self, model: nn.Module, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
        """Clip gradients to ``max_norm`` (0: only measure) and return the global pre-clip norm."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # a DTensor norm under sharding: materialise it
            norm = norm.full_tensor()
        return norm

    def generation_unsupported(self) -> str | None:
        """Why ``model.generate`` cannot run under this strategy, or None when it can."""
        return None
