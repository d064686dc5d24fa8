"""Data parallel: every rank holds the whole model; gradients are all-reduced in buckets (DDP)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.parallel.base import ParallelContext, Strategy


class DDPStrategy(Strategy):
    impl = "ddp"

    @property
    def replicates_with_ddp(self) -> bool:
        return self.layout.dp > 1  # DDP on one rank only adds overhead; the math is identical

    def wrap(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        self.materialize(model, ctx)  # every rank holds the whole model: allocate it before DDP
        if not self.replicates_with_ddp:
            return model
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield
