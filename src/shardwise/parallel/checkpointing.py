"""Activation checkpointing applied from outside: wrap transformer blocks, never edit the model.

``full`` wraps every block, ``selective`` every k-th block (torchtitan's "selective layer" mode):
a wrapped block keeps only its input during forward and recomputes its activations in backward,
trading roughly one extra block forward for the activation memory of that block.

We use ``checkpoint_wrapper`` with the non-reentrant implementation (``torch.utils.checkpoint``
with ``use_reentrant=False``): it works with FSDP2's hooks, with inputs that do not require grad,
and its state-dict hooks strip the ``_checkpoint_wrapped_module.`` prefix, so checkpoint keys (DCP)
and exported weights are the same with and without AC. It must be applied before FSDP
(torchtitan order: TP -> AC -> compile -> FSDP), so each FSDP unit wraps a checkpointed block.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from shardwise.errors import ConfigError

CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def checkpointed_indices(n_blocks: int, mode: str, every: int) -> list[int]:
    """Return the indices of the blocks that ``mode`` checkpoints (``every``: selective period)."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(n_blocks))
    if mode == "selective":
        # Blocks every-1, 2*every-1, ...: with every=2 on 6 blocks that is blocks 1, 3 and 5.
        return [i for i in range(n_blocks) if (i + 1) % every == 0]
    raise ConfigError(f"unknown activation_checkpointing mode {mode!r}; valid: none, full, selective.")


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> nn.Module:
    """Return ``model`` with the chosen transformer blocks wrapped in non-reentrant checkpointing."""
    if mode == "none":
        return model
    from shardwise.parallel.blocks import transformer_blocks

    container = transformer_blocks(model)
    if container is None:
        raise ConfigError(
            f"activation_checkpointing = {mode!r} needs transformer blocks to wrap, but none were found "
            f"in {type(model).__name__}: shardwise looks for a ModuleList/ModuleDict of repeated blocks "
            "(model.blocks, model.layers, model.model.layers, transformer.h, ...). Keep the blocks in "
            "such a container, or set parallel.activation_checkpointing = 'none'."
        )
    children = list(container.named_children())
    for i in checkpointed_indices(len(children), mode, every):
        name, block = children[i]
        if hasattr(block, "_checkpoint_wrapped_module"):
            continue  # already checkpointed (a composition applied it): never nest two wrappers
        # preserve_rng_state keeps dropout masks identical between forward and recomputation,
        # so a checkpointed run computes the same numbers as one without checkpointing.
        container.register_module(
            name, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                     preserve_rng_state=True)
        )
    return model


def clean_name(name: str) -> str:
    """Return a parameter name without wrapper prefixes (DDP ``module.``, checkpoint wrappers)."""
    name = name.replace(CHECKPOINT_PREFIX, "")
    return name[len("module."):] if name.startswith("module.") else name

