"""Sharded data parallel with FSDP2 ``fully_shard``: ZeRO-3 (``fsdp``), ZeRO-2, HSDP and CPU offload.

Order of application, as in torchtitan's ``parallelize``: (TP) -> activation checkpointing ->
FSDP, and inside FSDP the input embeddings, each wrap unit (a transformer block, or N consecutive
blocks), the final norm + output head, then the root, which picks up what is left (a tied
embedding/head pair; everything when no blocks are found). Each unit's
parameters are all-gathered in one collective before its forward and its gradients are
reduce-scattered in one collective after its backward, so per-block units bound the unsharded
memory to about one block at a time and overlap communication with the next block's compute.

What each strategy stores per rank between steps (N = shard group size):

==============  ============  ============  ==========  ===========================================
strategy        parameters    gradients     optimizer   during forward/backward
==============  ============  ============  ==========  ===========================================
fsdp (ZeRO-3)   1/N           1/N           1/N         one unit unsharded at a time
zero2           1/N           1/N           1/N         every unit stays unsharded from its forward
                                                        to its backward (no re-gather in backward)
hsdp            1/S           1/S           1/S         as fsdp inside a group of S ranks; gradients
                                                        also all-reduced across the N/S groups
fsdp-offload    CPU           CPU           CPU         as fsdp; shards copied to the GPU per use
==============  ============  ============  ==========  ===========================================

``zero2`` is ``fully_shard(reshard_after_forward=False)`` (FSDP1's SHARD_GRAD_OP): ZeRO-2's
communication (one all-gather per step, one reduce-scatter) and ZeRO-2's peak (whole parameters
held through forward and backward). Unlike DeepSpeed's ZeRO-2 it also frees the unsharded
parameters after backward, so between steps it stores only 1/N of them: never more memory.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from shardwise.core.config import ParallelConfig
from shardwise.device import backend_for
from shardwise.parallel.base import ParallelContext, Strategy
from shardwise.parallel.blocks import BLOCK_PATHS, OuterModules, find_blocks, outer_modules, transformer_blocks
from shardwise.parallel.experts.ep import shard_experts
from shardwise.parallel.precision import fsdp_mp_policy
from shardwise.parallel.tensor.tp import clip_grads, split_mixed_param_groups

__all__ = ["BLOCK_PATHS", "apply_fsdp", "find_blocks", "reshard_all", "transformer_blocks", "wrap_units"]

def wrap_units(model: nn.Module, wrap: str | int) -> list[list[nn.Module]]:
    """Return the FSDP units below the root: one list of blocks per unit (empty for ``"model"``).

    ``wrap`` is "block" (one unit per block), "model" (no units below the root) or N (one unit per
    N consecutive blocks, the last unit possibly shorter).
    """
    if str(wrap) == "model":
        return []
    container = transformer_blocks(model)
    if container is None:
        warnings.warn(
            f"no transformer blocks found in {type(model).__name__}; sharding it as one FSDP unit "
            "(correct, but the whole model is unsharded during forward and backward)",
            stacklevel=2,
        )
        return []
    per_unit = 1 if str(wrap) == "block" else int(wrap)
    blocks = list(container.children())
    return [blocks[i:i + per_unit] for i in range(0, len(blocks), per_unit)]


def apply_fsdp(model: nn.Module, mesh: Any, options: ParallelConfig | None = None, *,
               reshard_after_forward: bool = True, offload: bool = False, expert_mesh: Any = None) -> nn.Module:
    """Return ``model`` sharded in place with FSDP2 over ``mesh`` (1-D: FSDP; 2-D: HSDP).

    Reusable by compositions (``fsdp+tp`` passes the data-parallel sub-mesh of its mesh). From
    ``options`` it reads ``wrap`` (the unit size) and ``precision`` (the MixedPrecisionPolicy);
    ``reshard_after_forward=False`` gives ZeRO-2, ``offload=True`` keeps shards on the CPU.
    ``expert_mesh``: the mesh owner's expert-FSDP view, when the expert-parallel step split experts.
    """
    options = options or ParallelConfig()
    common: dict[str, Any] = {"mesh": mesh, "mp_policy": fsdp_mp_policy(options.precision)}
    if offload:
        # Pinned host memory makes the per-use host->device copies asynchronous; it needs an
        # accelerator, so a CPU mesh (tests, CPU-only runs) uses pageable memory.
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    else:
        common["offload_policy"] = OffloadPolicy()
    if expert_mesh is not None:
        # Experts first (split over the ep ranks, sharded over the rest): the units below skip them.
        # Their gradients are the mean over every data-parallel rank of this (dense) mesh.
        shard_experts(model, expert_mesh, mesh.size(), common)
    units = wrap_units(model, options.wrap)
    # torchtitan's order: the embeddings, each block (or group), the final norm + output head, then
    # the root. With the embeddings and the head as units of their own, FSDP gathers (and
    # prefetches) one of them at a time instead of both together in the root (for a 70B Llama:
    # 1 B parameters instead of 2 B), and reduce-scatters each as soon as its backward is done.
    outer = outer_modules(model) if units else OuterModules()
    if outer.before:
        # Used first in forward and last in backward: resharded after forward like any block.
        fully_shard(_unit(outer.before), reshard_after_forward=reshard_after_forward, **common)
    for i, unit in enumerate(units):
        # The last unit runs first in backward: resharding it after forward would only force an
        # immediate re-gather, so it keeps its parameters (torchtitan does the same).
        keep = reshard_after_forward and i < len(units) - 1
        fully_shard(_unit(unit), reshard_after_forward=keep, **common)
    if outer.after:
        # Run last in forward and first in backward: kept unsharded in between (torchtitan too).
        fully_shard(_unit(outer.after), reshard_after_forward=False, **common)
    # The root holds what is left (no parameters for the usual models; a tied embedding and head,
    # or everything when no blocks were found); None lets FSDP keep them unsharded between
    # forward and backward (they are needed first in backward), False does so explicitly.
    fully_shard(model, reshard_after_forward=None if reshard_after_forward else False, **common)
    return model


def _unit(modules: list[nn.Module] | tuple[nn.Module, ...]) -> nn.Module | list[nn.Module]:
    """``fully_shard``'s argument for one unit: the module, or the list of modules it groups."""
    return modules[0] if len(modules) == 1 else list(modules)


def reshard_all(model: nn.Module) -> None:
    """Free the unsharded parameters every FSDP unit of ``model`` still holds.

    A forward without backward (evaluation) leaves every unit that does not reshard after forward
    (all of them under zero2; the root and last block under fsdp) holding whole parameters until
    the next training step; resharding right away keeps evaluation from raising memory between
    steps.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class FSDPStrategy(Strategy):
    """FSDP2 for every sharded row of the table: fsdp (ZeRO-3), zero2 (``reshard_after_forward``
    False), fsdp-offload (``offload``) and hsdp (the layout's 2-D ("replicate", "shard") mesh, which
    FSDP2 reads as HSDP: ``Replicate()`` on dim 0, ``Shard(0)`` on dim 1; the shard group size is
    ``layout.dp_shard``, i.e. ``parallel.hsdp_shard_size``, 0 = ranks per node)."""

    impl = "fsdp"

    @property
    def reshard_after_forward(self) -> bool:
        return self.info.reshard_after_forward

    @property
    def offload(self) -> bool:
        return self.info.offload

    def needs_process_group(self) -> bool:
        # DTensor shards need a mesh even on one rank (e.g. fsdp-offload on a single GPU).
        return True

    def wrap(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        model = apply_fsdp(model, ctx.mesh, ctx.options,
                           reshard_after_forward=self.reshard_after_forward, offload=self.offload,
                           expert_mesh=ctx.expert_mesh)
        # A meta-device model is sharded first, then each rank allocates and fills its 1/N shards.
        self.materialize(model, ctx)
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # Micro-batches before the last keep unsharded fp32 gradients locally and skip the
        # reduce-scatter (and HSDP's all-reduce); the last one reduces the accumulated sum once.
        # Loss math: Session.backward divides each micro-batch's mean loss by A (micro-batches)
        # and FSDP divides the reduced sum by the data-parallel size R, so each rank's gradient
        # shard is (1/(R*A)) * sum_{r,a} grad(mean_loss[r, a]) = grad of the global batch's mean
        # loss when every micro-batch holds the same number of tokens -- one big batch.
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def eval_loss(self, session: Any, model: nn.Module, inputs: torch.Tensor,
                  targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        loss = super().eval_loss(session, model, inputs, targets, loss_fn)
        reshard_all(model)
        return loss

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                       ctx: ParallelContext) -> torch.optim.Optimizer:
        if self.layout.ep > 1:  # experts live on the EP mesh, dense parameters on the dp mesh
            return split_mixed_param_groups(optimizer)
        return optimizer

    def clip_grad_norm(self, model: nn.Module, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
        if self.layout.ep > 1:  # one norm per mesh, reduced over it, then combined
            return clip_grads(list(model.parameters()), max_norm)
        return super().clip_grad_norm(model, max_norm, ctx)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        # Each rank sees only its gradient shard: an inf on one rank must skip the step on all,
        # so the found-inf flag is all-reduced (FSDP's ShardedGradScaler; works on DTensor grads).
        return ShardedGradScaler(device=device.type)

    def process_group_backend(self, device: torch.device) -> str:
        if not self.offload:
            return backend_for(device)
        # Offloaded gradients are DTensors on the CPU: clip_grad_norm_'s norm all-reduce runs on
        # CPU tensors, which NCCL cannot carry, so CPU tensors get a gloo backend beside NCCL.
        if device.type == "cuda":
            return "cpu:gloo,cuda:nccl"
        return backend_for(device)
