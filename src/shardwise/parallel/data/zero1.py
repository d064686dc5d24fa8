"""ZeRO-1: DDP for gradients, ``ZeroRedundancyOptimizer`` for a 1/N share of the optimizer state.

Parameters and gradients stay whole on every rank (DDP all-reduces gradients exactly as in
``ddp``); each rank keeps the AdamW moments only for the parameters it owns, steps those, and
broadcasts them to the other ranks. That is ZeRO stage 1 exactly. FSDP2 has no mode that keeps
gradients whole while sharding only optimizer state, so ZeroRedundancyOptimizer is the building
block that matches ZeRO-1's memory (measured by the ledger: see docs/strategies.md).

ZeroRedundancyOptimizer assigns whole parameters to ranks (greedily, largest first, per param
group), so a rank's share of the state is 1/N only up to the size of the largest parameter.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from shardwise.errors import ConfigError
from shardwise.parallel.base import ParallelContext
from shardwise.parallel.data.ddp import DDPStrategy


class ZeRO1Strategy(DDPStrategy):
    impl = "zero1"

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                       ctx: ParallelContext) -> torch.optim.Optimizer:
        if ctx.world_size == 1:
            return optimizer  # nothing to shard across
        if optimizer.state:
            raise ConfigError("zero1 needs a fresh optimizer (no step taken) to shard its state.")
        groups = [dict(g) for g in optimizer.param_groups]
        # ``defaults`` can hold keys the constructor does not take (AdamW records
        # decoupled_weight_decay): pass only what it accepts; the groups carry the rest.
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        # The same optimizer class and hyper-parameters, rebuilt over the same param groups; the
        # lr the trainer writes into ``param_groups`` each step is copied to the local shard's
        # optimizer by ZeroRedundancyOptimizer.step.
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)
