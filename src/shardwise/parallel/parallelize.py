"""The one parallelize order, for every strategy (torchtitan's ``parallelize``).

    pipeline split -> TP/SP -> activation checkpointing -> torch.compile per block
    -> data parallel (DDP / ZeRO-1 / FSDP2, with meta-device materialisation) -> pipeline schedule

Before it, ``Session.prepare`` installs the patches that add or move no parameter and name the
plain modules: the MoE routing group and expert-parallel dispatch hooks (``parallel/ep.py``), the
chunked loss head (``shardwise.loss``) and context-parallel attention (``parallel/cp.py``).

Why this order: the TP plan names the plain modules, so it runs before anything wraps them;
activation checkpointing wraps whole (already TP-sharded) blocks; compile traces the checkpointed
blocks, and must see them before DDP/FSDP hooks are installed; FSDP2 then shards each block as one
unit; the pipeline schedule drives the wrapped stages. ``Session.prepare`` calls this; a strategy
only fills in its steps (``Strategy.split``, ``apply_tp``, ``wrap``), never reorders them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from shardwise.parallel.checkpointing import apply_activation_checkpointing
from shardwise.parallel.compile import apply_compile

if TYPE_CHECKING:
    from shardwise.parallel.base import ParallelContext, Strategy

__all__ = ["parallelize"]


def parallelize(model: nn.Module, strategy: Strategy, ctx: ParallelContext) -> nn.Module:
    """Return ``model`` parallelised by ``strategy`` in the one order above."""
    model = strategy.split(model, ctx)  # pipeline: this rank keeps its stages only
    strategy.apply_tp(model, ctx)  # tensor (and sequence) parallel
    model = apply_activation_checkpointing(model, ctx.options.activation_checkpointing, ctx.options.ac_every)
    if ctx.compile:
        model = apply_compile(model)
    return strategy.wrap(model, ctx)  # data parallel, materialisation, pipeline schedule
