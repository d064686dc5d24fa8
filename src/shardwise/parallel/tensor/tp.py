"""Tensor parallel (+ optional sequence parallel): split each layer's matrices across the ``tp`` ranks.

Applied from outside with ``parallelize_module`` and the per-family plans in ``tensor/plans.py``; the
model code stays single-device. This module also holds what every model-parallel strategy needs
at step time: the shape checks, the vocabulary-parallel loss context and a gradient norm that is
correct when parameters are DTensors and/or split across pipeline stages.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from shardwise.core.families import LLAMA_LIKE, no_tp_plan
from shardwise.core.layout import tp_indivisible
from shardwise.errors import ConfigError
from shardwise.models.moe import is_moe_layer
from shardwise.parallel.adapters import adapter_for
from shardwise.parallel.blocks import model_family, submodule
from shardwise.parallel.tensor.plans import TPPlan, with_lora
from shardwise.parallel.ties import retie, tied_groups

__all__ = ["LLAMA_LIKE", "apply_tp", "check_tp_model", "clip_grads", "local_value",
           "split_mixed_param_groups", "tp_loss_context", "tp_shape_sizes", "total_grad_norm"]


def tp_shape_sizes(model: nn.Module) -> dict[str, int]:
    """Return the sizes tensor parallel must divide (heads, KV heads, hidden, MLP width): its family's."""
    adapter = adapter_for(model)
    return adapter.tp_sizes(model) if adapter is not None else {}


def check_tp_model(model: nn.Module, tp: int) -> None:
    """Raise ConfigError unless ``model`` has a TP plan and ``tp`` divides every sharded size."""
    if tp == 1:
        return
    if adapter_for(model) is None:
        family = model_family(model)
        what = f"the {family} model" if family else type(model).__name__
        raise ConfigError(
            f"{no_tp_plan(what)}. Use a data-parallel or sharded strategy (ddp, fsdp, hsdp) or pipeline parallel "
            "for this model.")
    bad = tp_indivisible(tp, tp_shape_sizes(model))
    if bad:
        sizes = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ConfigError(
            f"parallel.tp={tp} must divide the sizes it splits, but {sizes} is not divisible by {tp}: "
            "each rank must hold whole attention heads and an equal slice of each matrix. "
            "Choose a tp degree that divides them."
        )


def apply_tp(model: nn.Module, tp_mesh: Any, sequence_parallel: bool = False) -> nn.Module:
    """Return ``model`` with its family's TP plan applied in place on the 1-D ``tp_mesh``.

    Parts set to ``None`` (a pipeline stage that does not own the embeddings or the head) are
    skipped, so the same call works on every pipeline stage.
    """
    adapter = adapter_for(model)
    assert adapter is not None, "check_tp_model refuses a model without a TP plan first"
    plan: TPPlan = adapter.tp_plan(sequence_parallel)
    if adapter.before_tp is not None:  # e.g. GPT-2's fused q/k/v made three column-splittable ones
        adapter.before_tp(model, tp_mesh.size())
    ties = tied_groups(model)
    top = {name: style for name, style in plan.top.items() if submodule(model, name) is not None}
    if top:
        parallelize_module(model, tp_mesh, with_lora(top, model))
    blocks = submodule(model, plan.blocks_path)
    for block in (blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks or []):
        # LoRA-wrapped layers: the plan's style goes to the base layer, the adapters follow it.
        # An MoE block has no dense MLP: its router and experts stay whole on every TP
        # rank (experts may be split by expert parallelism instead), so those entries are skipped.
        styles = dict(plan.block)
        if is_moe_layer(submodule(block, "mlp")):
            styles.update(plan.moe_block)
        # After with_lora, which may move a path into a LoRA layer (GPT-2's split c_attn under LoRA).
        parallelize_module(block, tp_mesh,
                           {path: style for path, style in with_lora(styles, block).items()
                            if submodule(block, path) is not None})
    # parallelize_module gave the tied embedding and head a DTensor each: one tensor again, before
    # anything else wraps the model (parallel/ties.py says what breaks otherwise).
    retie(model, ties)
    # Parameters no plan touched (norms without SP, GPT's pos_emb...) stay plain replicated
    # tensors. Their gradients are identical on every TP rank (their inputs' gradients come out of
    # the column-parallel backward's all-reduce), so they need no communication of their own.
    for p in model.parameters():
        # Frozen weights (a LoRA base) get no gradient, so nothing to re-shard.
        if isinstance(p, DTensor) and p.requires_grad and any(pl.is_shard() for pl in p.placements):
            p.register_post_accumulate_grad_hook(_shard_grad_like_param)
    return model


def _shard_grad_like_param(param: torch.Tensor) -> None:
    """Give ``param.grad`` the parameter's own sharding, keeping only the local shard in memory.

    DTensor's embedding backward returns the gradient of a row-sharded (vocab-parallel) table as
    ``Replicate``: every rank would hold the whole table's gradient until the optimizer step (one
    full embedding per rank for a 128k vocabulary). The plans' embeddings avoid it at the source
    (``tensor/embedding.VocabParallelEmbedding``); this catches what still takes DTensor's path
    (its fallbacks: ``max_norm``, sparse gradients, a rank past the table's end, and any other
    style). Taking this rank's rows is a local slice, no communication; it is copied so the
    whole-table buffer is freed. Later micro-batches' gradients
    add into the sharded one (DTensor slices the replicated addend). Under FSDP2 this hook is
    inert: ``fully_shard`` replaces the parameters, and FSDP reduce-scatters gradients itself.
    """
    grad = param.grad
    if not isinstance(grad, DTensor) or grad.placements == param.placements:
        return
    shard = grad.redistribute(param.device_mesh, param.placements).to_local()
    param.grad = DTensor.from_local(shard.clone(), param.device_mesh, param.placements,
                                    shape=param.shape, stride=param.stride())


def tp_loss_context(tp_degree: int) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` under TP (logits stay vocab-sharded), else a no-op.

    Both the loss and its backward must run inside it; cross-entropy is the only loss it supports.
    """
    return loss_parallel() if tp_degree > 1 else contextlib.nullcontext()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """Return a plain tensor (the full value of a DTensor, e.g. a loss computed under TP)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad_groups(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    # One foreach kernel cannot mix plain tensors with DTensors, nor DTensors of different meshes
    # or layouts: group the parameters that have gradients by (mesh, placements).
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def total_grad_norm(params: list[torch.Tensor], pp_group: Any = None) -> torch.Tensor:
    """Return the global L2 norm of the gradients of ``params`` across TP, FSDP and PP ranks.

    Each DTensor group's norm is reduced over its mesh by ``full_tensor``; plain gradients are
    complete (replicated) on this rank. Pipeline stages hold disjoint parameters, so the squared
    norms are summed over ``pp_group`` last.
    """
    device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
    # float32 at least; a float64 run's norm stays float64 (its clip factor must not be rounded).
    dtype = torch.promote_types(next((p.grad.dtype for p in params if p.grad is not None), torch.float32),
                                torch.float32)
    squares = torch.zeros((), dtype=dtype, device=device)
    # On a 2-D (dp, tp) mesh DTensor reduces the partial norm with one all-reduce per mesh dim and
    # logs a warning about it each step; the result is exact, and it is one scalar, so stay quiet.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        for group in _grad_groups(params):
            norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
            squares = squares + local_value(norm).to(device, dtype) ** 2
    finally:
        redistribute_log.setLevel(level)
    if pp_group is not None:
        # In float64 on the wire: every stage must send the same dtype, and a stage without
        # gradients does not know the model's (for two float32 stages the result is the float32 sum).
        total = squares.double()
        dist.all_reduce(total, group=pp_group)
        squares = total.to(squares.dtype)
    return squares.sqrt()


def clip_grads(params: list[torch.Tensor], max_norm: float, pp_group: Any = None,
               counted: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Clip gradients to ``max_norm`` (0: only measure) and return the pre-clip global norm.

    ``counted``: the parameters the norm adds up (default ``params``); a pipeline's second copy of a
    tied weight is clipped but not counted (``parallel/pipeline/ties.py``).
    """
    norm = total_grad_norm(params if counted is None else counted, pp_group)
    if max_norm > 0:
        for group in _grad_groups(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


def split_mixed_param_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Return ``optimizer`` with each param group split into DTensor and plain-tensor groups.

    Under TP the planned layers hold DTensors while untouched ones (norms without SP) hold plain
    tensors; the optimizers' foreach/fused kernels (the CUDA default) refuse a list mixing both.
    The split groups keep every hyperparameter, so the update is unchanged.
    """
    new_groups = []
    for group in optimizer.param_groups:
        kinds: dict[Any, list[torch.Tensor]] = {}
        for p in group["params"]:
            # DTensors of one mesh may mix placements in one kernel (torchtitan's FSDP+TP groups do).
            kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        for params in kinds.values():
            new_groups.append({**group, "params": params})
        if not kinds:
            new_groups.append(group)
    optimizer.param_groups = new_groups
    return optimizer
