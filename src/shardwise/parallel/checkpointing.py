"""Activation checkpointing applied from outside: wrap transformer blocks, never edit the model.

``full`` wraps every block, ``selective`` every k-th block (torchtitan's "selective layer" mode):
a wrapped block keeps only its input during forward and recomputes its activations in backward,
trading roughly one extra block forward for the activation memory of that block.

``selective-op`` is torchtitan's per-op selective checkpointing (``_apply_op_sac`` in
torchtitan v0.2.2): every block is wrapped, but the outputs of the expensive ops -- attention
(every SDPA kernel) and every other matmul -- are kept from the forward; only the cheap ops
(norms, activations, rotary, residual adds) and the other half of the matmuls are recomputed.
Built on ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: the recomputation
replays the same ops on the same inputs, so results are exactly those without checkpointing.

``moe`` wraps every mixture-of-experts layer (router, dispatch, experts, combine) and nothing else
(Megatron-Core's ``--recompute-modules moe``): a MoE layer keeps the most per token of a block
(every routed slot's expert activations, ``top_k`` of them) for the least compute (only the
active experts' matmuls), so recomputing it alone frees most of a MoE block's activations while
attention, whose recomputation is the expensive part at long sequences, keeps its tensors. The
layer's input is its norm's output, which the block keeps anyway. Under expert parallel the
recomputation repeats the dispatch and combine all-to-alls.

We use ``checkpoint_wrapper`` with the non-reentrant implementation (``torch.utils.checkpoint``
with ``use_reentrant=False``): it works with FSDP2's hooks, with inputs that do not require grad,
and its state-dict hooks strip the ``_checkpoint_wrapped_module.`` prefix, so checkpoint keys (DCP)
and exported weights are the same with and without AC. It must be applied before FSDP
(torchtitan order: TP -> AC -> compile -> FSDP), so each FSDP unit wraps a checkpointed block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardwise.core.config import AC_MODES
from shardwise.errors import ConfigError
from shardwise.models.moe import is_moe_layer
from shardwise.parallel.blocks import transformer_blocks


def _ops(namespace: Any, names: tuple[str, ...]) -> set[Any]:
    # Resolved by name and skipped when absent, so a torch build without one kernel still works.
    return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}


# Matmul outputs: torchtitan saves aten.mm; a Linear with a bias (our GPT) runs aten.addmm instead.
SAC_MATMUL_OPS = _ops(torch.ops.aten, ("mm", "addmm"))
# torchtitan v0.2.2 ``_op_sac_save_list``: every attention kernel (plus the CPU flash kernel, which
# is what F.scaled_dot_product_attention runs on CPU), the sequence-parallel reduce-scatter (so
# it is not re-communicated) and max (float8 scales).
SAC_SAVE_OPS = SAC_MATMUL_OPS | _ops(torch.ops.aten, (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable", "max",
)) | _ops(torch.ops._c10d_functional, ("reduce_scatter_tensor",))


def op_sac_policy() -> Callable[..., Any]:
    """Return a fresh per-op SAC policy for one checkpointed call (torchtitan's ``_custom_policy``).

    Saves the outputs of SAC_SAVE_OPS except every second matmul, which is recomputed: the
    forward and the recomputation count matmuls separately, so the n-th matmul gets the same
    decision both times. The planner's ``selective-op`` bytes follow the same rule
    (``plan.memory.op_sac_saved``).
    """
    matmuls = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in SAC_MATMUL_OPS:
            key = "recompute" if ctx.is_recompute else "forward"
            matmuls[key] += 1
            if matmuls[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAC_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_context() -> Any:
    return create_selective_checkpoint_contexts(op_sac_policy())


def checkpointed_indices(n_blocks: int, mode: str, every: int) -> list[int]:
    """Return the indices of the blocks that ``mode`` checkpoints (``every``: selective period)."""
    if mode in ("none", "moe"):  # "moe" wraps the blocks' MoE layers, no block whole
        return []
    if mode in ("full", "selective-op"):
        return list(range(n_blocks))
    if mode == "selective":
        # Blocks every-1, 2*every-1, ...: with every=2 on 6 blocks that is blocks 1, 3 and 5.
        return [i for i in range(n_blocks) if (i + 1) % every == 0]
    raise ConfigError(f"unknown activation_checkpointing mode {mode!r}; valid: {', '.join(AC_MODES)}.")


def _wrap(module: nn.Module, **extra: Any) -> nn.Module:
    # preserve_rng_state keeps dropout masks identical between forward and recomputation,
    # so a checkpointed run computes the same numbers as one without checkpointing.
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True, **extra)


def _checkpoint_moe_layers(model: nn.Module, container: nn.Module) -> nn.Module:
    """``moe``: wrap each block's mixture-of-experts layers (``models.moe.is_moe_layer``) in place."""
    for block in container.children():
        if hasattr(block, "_checkpoint_wrapped_module"):
            continue  # the whole block is checkpointed already (a composition applied it)
        # A pipeline stage's dense blocks (DeepSeek's first layers) have none: nothing to wrap there.
        # (A model with no MoE layer at all is refused before launch: experts.ep.check_moe_model.)
        targets = [(parent, name) for parent in block.modules() for name, child in parent.named_children()
                   if is_moe_layer(child) and not hasattr(parent, "_checkpoint_wrapped_module")]
        for parent, name in targets:
            parent.register_module(name, _wrap(getattr(parent, name)))
    return model


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> nn.Module:
    """Return ``model`` with the chosen transformer blocks wrapped in non-reentrant checkpointing."""
    if mode == "none":
        return model
    container = transformer_blocks(model)
    if container is None:
        raise ConfigError(
            f"activation_checkpointing = {mode!r} needs transformer blocks to wrap, but none were found "
            f"in {type(model).__name__}: shardwise looks for a ModuleList/ModuleDict of repeated blocks "
            "(model.blocks, model.layers, model.model.layers, transformer.h, ...). Keep the blocks in "
            "such a container, or set parallel.activation_checkpointing = 'none'."
        )
    if mode == "moe":
        return _checkpoint_moe_layers(model, container)
    children = list(container.named_children())
    for i in checkpointed_indices(len(children), mode, every):
        name, block = children[i]
        if hasattr(block, "_checkpoint_wrapped_module"):
            continue  # already checkpointed (a composition applied it): never nest two wrappers
        extra = {"context_fn": _op_sac_context} if mode == "selective-op" else {}
        container.register_module(name, _wrap(block, **extra))
    return model
