"""Sharded data parallel with FSDP2 ``fully_shard``: ZeRO-3 (``fsdp``), ZeRO-2, HSDP and CPU offload.

Order of application, as in torchtitan's ``parallelize``: (TP) -> activation checkpointing ->
FSDP, and inside FSDP each wrap unit first (a transformer block, or N consecutive blocks), then
the root, which picks up what is left (embeddings, final norm, output head). Each unit's
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
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shardwise.config import ParallelConfig
from shardwise.errors import ConfigError
from shardwise.parallel.base import ParallelContext, Strategy
from shardwise.parallel.precision import fsdp_mp_policy
from shardwise.runtime.device import backend_for

# Where known model families keep their repeated blocks (checked in this order); anything else is
# found by ``transformer_blocks``' generic search for a container of same-class children.
BLOCK_PATHS = ("blocks", "layers", "model.layers", "hf.model.layers", "transformer.h", "hf.transformer.h")


def _unwrapped_type(module: nn.Module) -> type:
    # A checkpoint-wrapped block counts as the block it wraps.
    return type(getattr(module, "_checkpoint_wrapped_module", module))


def _is_block_container(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    kinds = {_unwrapped_type(m) for m in module.children()}
    return len(module) >= 1 and len(kinds) == 1


def transformer_blocks(model: nn.Module) -> nn.Module | None:
    """Return the ModuleList/ModuleDict holding ``model``'s repeated blocks, or None if there is none.

    Known paths first (GPT ``blocks``, HF Llama ``model.layers`` / ``hf.model.layers``, GPT-2
    ``transformer.h``), then the first container in ``named_modules()`` order whose two or more
    children all share one class. Wrappers that keep the block container's names (checkpoint
    wrappers, FSDP's in-place class swap) do not change the answer.
    """
    for path in BLOCK_PATHS:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            continue
        if _is_block_container(found):
            return found
    for _, module in model.named_modules():
        if _is_block_container(module) and len(module) >= 2:
            return module
    return None


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
               reshard_after_forward: bool = True, offload: bool = False) -> nn.Module:
    """Return ``model`` sharded in place with FSDP2 over ``mesh`` (1-D: FSDP; 2-D: HSDP).

    Reusable by compositions (``fsdp+tp`` passes the data-parallel sub-mesh of its mesh). From
    ``options`` it reads ``wrap`` (the unit size) and ``precision`` (the MixedPrecisionPolicy);
    ``reshard_after_forward=False`` gives ZeRO-2, ``offload=True`` keeps shards on the CPU.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    options = options or ParallelConfig()
    common: dict[str, Any] = {"mesh": mesh, "mp_policy": fsdp_mp_policy(options.precision)}
    if offload:
        # Pinned host memory makes the per-use host->device copies asynchronous; it needs an
        # accelerator, so a CPU mesh (tests, CPU-only runs) uses pageable memory.
        common["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    else:
        common["offload_policy"] = OffloadPolicy()
    units = wrap_units(model, options.wrap)
    for i, unit in enumerate(units):
        # The last unit runs first in backward: resharding it after forward would only force an
        # immediate re-gather, so it keeps its parameters (torchtitan does the same).
        keep = reshard_after_forward and i < len(units) - 1
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=keep, **common)
    # The root holds embeddings and the output head; None lets FSDP keep them unsharded between
    # forward and backward (they are needed first in backward), False does so explicitly.
    fully_shard(model, reshard_after_forward=None if reshard_after_forward else False, **common)
    return model


def reshard_all(model: nn.Module) -> None:
    """Free the unsharded parameters every FSDP unit of ``model`` still holds.

    A forward without backward (evaluation) leaves every unit that does not reshard after forward
    (all of them under zero2; the root and last block under fsdp) holding whole parameters until
    the next training step; resharding right away keeps evaluation from raising memory between
    steps.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class FSDPStrategy(Strategy):
    name = "fsdp"
    description = "ZeRO-3: shard parameters, gradients and optimizer state (FSDP2 fully_shard)"
    reshard_after_forward = True
    offload = False

    def check(self, world_size: int, options: ParallelConfig) -> None:
        if world_size < 1:
            raise ConfigError(f"strategy {self.name!r} needs at least one rank.")
        if options.tp > 1 or options.pp > 1:
            raise ConfigError(
                f"strategy {self.name!r} is pure data parallel, but parallel.tp={options.tp} and "
                f"parallel.pp={options.pp}; use a composed strategy (e.g. 'fsdp+tp') or set them to 1."
            )

    def needs_process_group(self) -> bool:
        # DTensor shards need a mesh even on one rank (e.g. fsdp-offload on a single GPU).
        return True

    def apply(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        return apply_fsdp(model, ctx.mesh, ctx.options,
                          reshard_after_forward=self.reshard_after_forward, offload=self.offload)

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

    def uses_autocast(self) -> bool:
        return False  # MixedPrecisionPolicy casts parameters and inputs per unit instead

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        # Each rank sees only its gradient shard: an inf on one rank must skip the step on all,
        # so the found-inf flag is all-reduced (FSDP's ShardedGradScaler; works on DTensor grads).
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)


class ZeRO2Strategy(FSDPStrategy):
    name = "zero2"
    description = "ZeRO-2: shard gradients and optimizer state; whole parameters through fwd+bwd"
    reshard_after_forward = False


class FSDPOffloadStrategy(FSDPStrategy):
    name = "fsdp-offload"
    description = "ZeRO-3 with parameters, gradients and optimizer state kept on the CPU"
    offload = True

    def process_group_backend(self, device: torch.device) -> str:
        # Offloaded gradients are DTensors on the CPU: clip_grad_norm_'s norm all-reduce runs on
        # CPU tensors, which NCCL cannot carry, so CPU tensors get a gloo backend beside NCCL.
        if device.type == "cuda":
            return "cpu:gloo,cuda:nccl"
        return backend_for(device)


def local_world_size(options: ParallelConfig, world_size: int) -> int:
    """Ranks per node: torchrun's LOCAL_WORLD_SIZE, else ``parallel.nproc``, else the world size."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return options.nproc or world_size


class HSDPStrategy(FSDPStrategy):
    name = "hsdp"
    description = "hybrid: shard within groups of hsdp_shard_size ranks, replicate across groups"

    def shard_size(self, world_size: int, options: ParallelConfig) -> int:
        """Ranks per shard group: ``parallel.hsdp_shard_size``, or ranks per node when it is 0."""
        return options.hsdp_shard_size or local_world_size(options, world_size)

    def check(self, world_size: int, options: ParallelConfig) -> None:
        super().check(world_size, options)
        shard = self.shard_size(world_size, options)
        if shard < 1 or shard > world_size or world_size % shard:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ConfigError(
                f"strategy 'hsdp' shards within groups of parallel.hsdp_shard_size={shard} ranks, which "
                f"must divide the world size {world_size}. Valid shard sizes: "
                f"{', '.join(map(str, divisors))} (0 = ranks per node)."
            )

    def mesh_layout(self, world_size: int, options: ParallelConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
        # FSDP2 reads a 2-D mesh as (replicate, shard): parameters Replicate() on dim 0, Shard(0)
        # on dim 1. Shard groups are consecutive ranks, i.e. one node when shard = ranks per node,
        # so the heavy reduce-scatter/all-gather stays on the fast intra-node links.
        shard = self.shard_size(world_size, options)
        return (world_size // shard, shard), ("replicate", "shard")
