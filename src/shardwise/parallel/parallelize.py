"""The one parallelize order, for every strategy (torchtitan's ``parallelize``).

    checks on the whole model -> pipeline split -> TP/SP -> CP -> EP -> activation checkpointing
    -> torch.compile per block -> data parallel (DDP / ZeRO-1 / FSDP2, with meta-device
    materialisation) -> pipeline schedule

Every dimension is one named step below; each asks the mesh owner (``ctx.meshes``,
``parallel/mesh.py``) for its view and the layout (``ctx.layout``) for its degree and coordinates.

Why this order: the model-shape checks see the whole model (a pipeline stage may hold no MoE
layer), the same on every rank. The pipeline split keeps this rank's stages only, so nothing later
touches the layers it does not run. The TP plan names the plain modules, so it runs before anything
wraps them. CP replaces each attention's forward by the sequence-chunked one and puts its position
hooks ahead of TP's input hooks. EP turns the experts into ``Shard(0)`` DTensors on the ``ep`` view and
installs the token dispatch; the data-parallel step later shards them over the expert-FSDP view.
Activation checkpointing wraps whole (already TP-sharded, CP- and EP-patched) blocks; compile traces
the checkpointed blocks and must see them before DDP/FSDP hooks are installed; FSDP2 then shards
each block as one unit; the pipeline schedule drives the wrapped stages.

How to add a dimension: give the layout its degree (``shardwise/core/layout.py``), the mesh owner its
view (``parallel/mesh.py``), and this file one step in its place; a strategy only fills in the steps
it overrides (``Strategy.split``, ``apply_tp``, ``wrap``), never reorders them. ``Session.prepare``
calls ``parallelize``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from shardwise.parallel.checkpointing import apply_activation_checkpointing
from shardwise.parallel.compile import apply_compile
from shardwise.parallel.context.cp import apply_cp, check_cp_model
from shardwise.parallel.experts.ep import check_moe_model, route_moe

if TYPE_CHECKING:
    from shardwise.parallel.base import ParallelContext, Strategy

__all__ = ["apply_context_parallel", "apply_expert_parallel", "check_dimensions", "parallelize"]


def parallelize(model: nn.Module, strategy: Strategy, ctx: ParallelContext) -> nn.Module:
    """Return ``model`` parallelised by ``strategy`` in the one order above."""
    check_dimensions(model, ctx)  # shape rules of cp and ep, on the whole model
    model = strategy.split(model, ctx)  # pipeline: this rank keeps its stages only
    strategy.apply_tp(model, ctx)  # tensor (and sequence) parallel
    apply_context_parallel(model, ctx)
    apply_expert_parallel(model, ctx)
    model = apply_activation_checkpointing(model, ctx.options.activation_checkpointing, ctx.options.ac_every)
    if ctx.compile:
        model = apply_compile(model)
    return strategy.wrap(model, ctx)  # data parallel, materialisation, pipeline schedule


def check_dimensions(model: nn.Module, ctx: ParallelContext) -> None:
    """Raise ConfigError where ``model``'s shape does not fit the layout's cp or ep (a meta model works)."""
    check_moe_model(model, ctx.layout, ctx.options.activation_checkpointing)
    if ctx.layout.cp > 1:
        check_cp_model(model, ctx.layout.cp, ctx.layout.tp, ctx.cp_state.impl)


def apply_context_parallel(model: nn.Module, ctx: ParallelContext) -> None:
    """CP: every attention runs on this rank's sequence chunk with its cp group (``parallel/context/cp.py``)."""
    if ctx.layout.cp == 1:
        return
    group, _ = ctx.meshes.cp_group()
    apply_cp(model, group, ctx.layout.cp_rank(ctx.rank), ctx.layout.cp, ctx.cp_state)


def apply_expert_parallel(model: nn.Module, ctx: ParallelContext) -> None:
    """EP: MoE routing statistics over the dp group; experts split over the ``ep`` view (``parallel/experts/ep.py``)."""
    route_moe(model, ctx.layout, ctx.meshes)
