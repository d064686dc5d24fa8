"""Model parallelism and its compositions with data parallelism on one device mesh.

Strategies: ``tp``, ``pp``, ``ddp+pp``, ``fsdp+pp``, ``fsdp+tp``, ``fsdp+tp+pp`` (alias ``3d``).
Degrees come from ``parallel.dp`` / ``parallel.tp`` / ``parallel.pp``; an unset one (0 for dp, 1 for
tp/pp) is inferred from the world size when it is the only one left open.

Mesh: always ``("pp", "dp", "tp")``, torchtitan's order. ``init_device_mesh`` lays ranks out
row-major, so the last dim is innermost: the ``tp`` ranks of one group are consecutive global ranks,
i.e. the same node and the fastest link (TP all-reduces/all-gathers run twice per layer, forward
and backward); ``dp`` is next (one gradient reduction per step); ``pp`` is outermost, the slowest
link, because it only moves one activation tensor per microbatch between neighbours. Dims of size 1
are kept, so the code never branches on the mesh's shape.

Order of application, as in torchtitan's ``parallelize``: pipeline split (each rank keeps only its
stages' parts) -> TP (the plan paths name the plain modules) -> activation checkpointing ->
data parallel (DDP or FSDP2 over the ``dp`` sub-mesh) -> pipeline stages and schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shardwise.config import ParallelConfig
from shardwise.errors import ConfigError
from shardwise.parallel.base import ParallelContext, Strategy
from shardwise.parallel.checkpointing import apply_activation_checkpointing
from shardwise.parallel.fsdp import apply_fsdp, reshard_all
from shardwise.parallel.pp import (
    Pipeline,
    autocast_forward,
    check_pp_model,
    check_schedule,
    local_stage_ids,
    microbatch_count,
    prune_to_stages,
    stage_layer_ranges,
    stage_view,
)
from shardwise.parallel.tp import (
    apply_tp,
    check_tp_model,
    clip_grads,
    local_value,
    split_mixed_param_groups,
    tp_loss_context,
)

MESH_DIMS = ("pp", "dp", "tp")


def resolve_degrees(world_size: int, options: ParallelConfig, active: tuple[str, ...]) -> dict[str, int]:
    """Return {"pp", "dp", "tp"} degrees for ``world_size`` ranks; ConfigError when impossible.

    Dims not in ``active`` are 1. Among active dims, the ones the user set are taken as given and
    at most one unset dim is inferred as world_size / (product of the others).
    """
    given = {"pp": options.pp if options.pp > 1 else 0, "tp": options.tp if options.tp > 1 else 0,
             "dp": options.dp}
    for dim in MESH_DIMS:
        if dim not in active and given[dim] > 1:
            raise ConfigError(
                f"parallel.{dim}={given[dim]} is set, but this strategy has no {dim} dimension "
                f"(its dimensions: {', '.join(active)}). Pick a strategy that includes it, e.g. "
                f"'fsdp+tp+pp', or leave parallel.{dim} unset."
            )
    degrees = {dim: (given[dim] or 0) if dim in active else 1 for dim in MESH_DIMS}
    open_dims = [d for d in MESH_DIMS if degrees[d] == 0]
    known = 1
    for d in MESH_DIMS:
        known *= degrees[d] or 1
    if len(open_dims) > 1:
        raise ConfigError(
            f"cannot infer {' and '.join(open_dims)} degrees from {world_size} ranks: set all but one "
            f"of {', '.join(f'parallel.{d}' for d in open_dims)} (e.g. --set parallel.{open_dims[-1]}=2)."
        )
    if open_dims:
        if world_size % known:
            raise ConfigError(
                f"{world_size} ranks do not divide by the fixed degrees "
                f"({' x '.join(f'{d}={degrees[d]}' for d in MESH_DIMS if degrees[d])} = {known})."
            )
        degrees[open_dims[0]] = world_size // known
    product = degrees["pp"] * degrees["dp"] * degrees["tp"]
    if product != world_size:
        raise ConfigError(
            f"dp x tp x pp must equal the world size: {degrees['dp']} x {degrees['tp']} x "
            f"{degrees['pp']} = {product}, but {world_size} ranks were launched. Change --nproc or "
            "the parallel.dp/tp/pp degrees."
        )
    for dim in active:
        if dim != "dp" and degrees[dim] < 2:
            raise ConfigError(
                f"strategy needs parallel.{dim} >= 2 (got {degrees[dim]} on {world_size} ranks); "
                f"launch more ranks or set parallel.{dim}."
            )
    return degrees


class ModelParallelStrategy(Strategy):
    """Base of every TP/PP composition; subclasses name their dims and data-parallel flavour."""

    name = "model-parallel"
    active: tuple[str, ...] = ()
    dp_kind = ""  # "", "ddp" or "fsdp"

    def __init__(self) -> None:
        self.degrees = {"pp": 1, "dp": 1, "tp": 1}
        self.pipeline: Pipeline | None = None

    # ------------------------------------------------------------ up-front checks and the mesh
    def check(self, world_size: int, options: ParallelConfig) -> None:
        self.degrees = resolve_degrees(world_size, options, self.active)
        if options.sequence_parallel and self.degrees["tp"] < 2:
            raise ConfigError("parallel.sequence_parallel needs tensor parallel (tp >= 2); "
                              "pick a strategy with tp or unset it.")
        if self.degrees["pp"] > 1:
            check_schedule(self.degrees["pp"], options)

    def check_model(self, model: nn.Module, world_size: int, options: ParallelConfig) -> None:
        """Raise ConfigError when ``model``'s shape does not fit the degrees (meta models work)."""
        self.check(world_size, options)
        check_tp_model(model, self.degrees["tp"])
        if self.degrees["pp"] > 1:
            check_pp_model(model, self.degrees["pp"] * options.pp_stages_per_rank,
                           options.pp_first_stage_fewer)

    def mesh_layout(self, world_size: int, options: ParallelConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
        self.degrees = resolve_degrees(world_size, options, self.active)
        return tuple(self.degrees[d] for d in MESH_DIMS), MESH_DIMS

    def dp_coords(self, ctx: ParallelContext) -> tuple[int, int]:
        # Every TP rank and every pipeline stage of one replica must read the same batch: the
        # first stage feeds its inputs, the last one its targets.
        mesh = ctx.mesh
        return mesh["dp"].get_local_rank(), mesh["dp"].size()  # type: ignore[index]

    @property
    def partitions_parameters(self) -> bool:  # type: ignore[override]
        return self.degrees["pp"] > 1

    def uses_autocast(self) -> bool:
        return self.dp_kind != "fsdp"  # FSDP2 casts through its MixedPrecisionPolicy

    def applies_activation_checkpointing(self) -> bool:
        return True  # after TP (its plan names the plain blocks' submodules), before FSDP

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        # fp16 (refused under PP): gradients are DTensor shards under TP/FSDP, so an inf found on one
        # rank must skip the step everywhere; the sharded scaler all-reduces its found-inf flag.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)

    # ------------------------------------------------------------ apply
    def apply(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        opts, mesh = ctx.options, ctx.mesh
        # Same model and options on every rank, so a bad shape raises the same error everywhere.
        self.check_model(model, ctx.world_size, opts)
        pp, tp = self.degrees["pp"], self.degrees["tp"]
        stage_ids, ranges = [0], [range(0)]
        if pp > 1:
            n_stages = pp * opts.pp_stages_per_rank
            ranges = stage_layer_ranges(len(model.blocks), n_stages, opts.pp_first_stage_fewer)
            stage_ids = local_stage_ids(mesh["pp"].get_local_rank(), pp, opts.pp_stages_per_rank)
            model = prune_to_stages(model, stage_ids, ranges).to(ctx.device)
        if tp > 1:
            apply_tp(model, mesh["tp"], opts.sequence_parallel)
        apply_activation_checkpointing(model, opts.activation_checkpointing, opts.ac_every)
        parts = [stage_view(model, s, ranges) for s in stage_ids] if pp > 1 else [model]
        wrapped = [self._wrap_dp(part, ctx) for part in parts]
        if pp == 1:
            return wrapped[0]
        if self.uses_autocast() and opts.precision == "bf16-mixed":  # fp16 is refused under PP
            for part in parts:
                autocast_forward(part, ctx.device.type, torch.bfloat16)
        self.pipeline = Pipeline(wrapped, stage_ids, len(ranges), mesh["pp"].get_group(), ctx.device,
                                 opts.pp_schedule, microbatch_count(opts))
        # The union: this rank's parts under their single-device names, for the optimizer,
        # state dicts and checkpoints. The stages run through the schedule, not through it.
        return model

    def _wrap_dp(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        dp_mesh = ctx.mesh["dp"]  # type: ignore[index]
        if self.dp_kind == "fsdp":
            # Applied even when dp == 1, so mixed precision comes from the same policy everywhere.
            # One FSDP unit per transformer block plus the root, as under plain fsdp.
            return apply_fsdp(module, dp_mesh, ctx.options)
        if self.dp_kind == "ddp" and self.degrees["dp"] > 1:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            return DistributedDataParallel(module, device_ids=device_ids,
                                           process_group=dp_mesh.get_group())
        return module

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                       ctx: ParallelContext) -> torch.optim.Optimizer:
        return split_mixed_param_groups(optimizer)

    # ------------------------------------------------------------ step time
    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # Under PP the schedule reduces gradients at the end of each step (correct, if not the
        # cheapest, for accumulation); without PP, FSDP skips the reduce-scatter until the last
        # micro-batch exactly as in plain FSDP.
        setter = getattr(model, "set_requires_gradient_sync", None)
        if self.pipeline is None and setter is not None:
            setter(False)
            try:
                yield
            finally:
                setter(True)
        else:
            yield

    def forward_backward(self, session: Any, model: nn.Module, inputs: torch.Tensor,
                         targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        tp = self.degrees["tp"]
        if self.pipeline is not None:
            with tp_loss_context(tp):
                return self.pipeline.run(inputs, targets, loss_fn, session.grad_accum_steps, train=True)
        with tp_loss_context(tp):
            with session.autocast():
                loss = loss_fn(model(inputs), targets)
            session.backward(loss)
        return local_value(loss.detach())

    def eval_loss(self, session: Any, model: nn.Module, inputs: torch.Tensor,
                  targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        tp = self.degrees["tp"]
        with tp_loss_context(tp):
            if self.pipeline is not None:
                loss = self.pipeline.run(inputs, targets, loss_fn, 1, train=False)
            else:
                with session.autocast():
                    loss = local_value(loss_fn(model(inputs), targets).detach())
        if self.dp_kind == "fsdp":
            reshard_all(model)  # as under plain fsdp: evaluation must not leave units unsharded
        return loss

    def clip_grad_norm(self, model: nn.Module, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
        pp_group = ctx.mesh["pp"].get_group() if self.degrees["pp"] > 1 else None  # type: ignore[index]
        return clip_grads(list(model.parameters()), max_norm, pp_group)

    def generation_unsupported(self) -> str | None:
        if self.degrees["pp"] > 1:
            return "the model is split into pipeline stages, so no rank holds all of it"
        if self.degrees["tp"] > 1:
            return "the tensor-parallel output head returns vocabulary-sharded logits"
        return None


class TPStrategy(ModelParallelStrategy):
    name = "tp"
    description = "tensor parallel: split every layer's matrices across ranks (parallelize_module)"
    active = ("tp",)


class PPStrategy(ModelParallelStrategy):
    name = "pp"
    description = "pipeline parallel: split the layers into stages (torch.distributed.pipelining)"
    active = ("pp",)


class DDPPPStrategy(ModelParallelStrategy):
    name = "ddp+pp"
    description = "pipeline stages, each replicated with DDP across the dp dimension"
    active = ("pp", "dp")
    dp_kind = "ddp"


class FSDPPPStrategy(ModelParallelStrategy):
    name = "fsdp+pp"
    description = "pipeline stages, each sharded with FSDP2 across the dp dimension"
    active = ("pp", "dp")
    dp_kind = "fsdp"


class FSDPTPStrategy(ModelParallelStrategy):
    name = "fsdp+tp"
    description = "2-D: tensor parallel inside a node, FSDP2 across the dp dimension"
    active = ("dp", "tp")
    dp_kind = "fsdp"


class FSDPTPPPStrategy(ModelParallelStrategy):
    name = "fsdp+tp+pp"
    description = "3-D: pipeline stages x FSDP2 replicas x tensor parallel (torchtitan layout)"
    active = ("pp", "dp", "tp")
    dp_kind = "fsdp"


STRATEGIES: list[type[Strategy]] = [TPStrategy, PPStrategy, DDPPPStrategy, FSDPPPStrategy,
                                    FSDPTPStrategy, FSDPTPPPStrategy]
