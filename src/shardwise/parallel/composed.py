"""Model parallelism and its compositions with data parallelism on one device mesh.

Strategies: ``tp``, ``pp``, ``ddp+pp``, ``fsdp+pp``, ``fsdp+tp``, ``fsdp+tp+pp`` (alias ``3d``).
Every degree comes from the run's layout (``shardwise.core.layout``): ``parallel.dp`` / ``parallel.tp`` /
``parallel.pp`` as given, an unset one (0 for dp, 1 for tp/pp) inferred from the world size when it
is the only one left open, the pipeline's micro-batches and stage ranges resolved there too.

Mesh: always ``("pp", "dp", "tp")``, torchtitan's order. ``init_device_mesh`` lays ranks out
row-major, so the last dim is innermost: the ``tp`` ranks of one group are consecutive global ranks,
i.e. the same node and the fastest link (TP all-reduces/all-gathers run twice per layer, forward
and backward); ``dp`` is next (one gradient reduction per step); ``pp`` is outermost, the slowest
link, because it only moves one activation tensor per microbatch between neighbours. Dims of size 1
are kept, so the code never branches on the mesh's shape.

Order of application: ``parallel/parallelize.py`` (the one order for every strategy); this class
fills in its steps: ``split`` (each rank keeps only its stages' parts), ``apply_tp`` (the plan
paths name the plain modules) and ``wrap`` (DDP or FSDP2 over the ``dp`` sub-mesh, then the
pipeline stages and schedule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from shardwise.core.config import ParallelConfig
from shardwise.core.layout import Layout
from shardwise.core.pp_schedules import compile_refusal, schedule_info
from shardwise.core.strategies import COMPOSED_MESH as MESH_DIMS
from shardwise.parallel.base import ParallelContext, Strategy
from shardwise.parallel.data.fsdp import apply_fsdp, reshard_all
from shardwise.parallel.pipeline.hf_moe import mute_hf_moe_inference
from shardwise.parallel.pipeline.moe import StageAux, attach_pp_aux
from shardwise.parallel.pipeline.pp import (
    Pipeline,
    autocast_forward,
    check_pp_model,
    n_pipeline_blocks,
    prune_to_stages,
    stage_view,
)
from shardwise.parallel.pipeline.ties import StageTies
from shardwise.parallel.tensor.tp import (
    apply_tp,
    check_tp_model,
    clip_grads,
    local_value,
    split_mixed_param_groups,
    tp_loss_context,
)
from shardwise.parallel.ties import tied_groups

__all__ = ["MESH_DIMS", "ModelParallelStrategy"]


class ModelParallelStrategy(Strategy):
    """Every TP/PP composition; the table row's dp kind picks the data-parallel flavour."""

    impl = "model-parallel"

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout)
        # FSDP2 over the dp dim for the sharding rows; DDP for the replicating ones (a no-op
        # while dp == 1, as under "tp" and "pp").
        self.dp_kind = "fsdp" if layout.info.dp_kind == "fsdp" else "ddp"
        self.pipeline: Pipeline | None = None
        self.ties: StageTies | None = None  # tied weights the stage split cut apart (pipeline/ties.py)
        self.moe_aux: StageAux | None = None  # MoE aux losses under PP (parallel/pipeline/moe.py)

    # ------------------------------------------------------------ up-front checks
    def check_model(self, model: nn.Module) -> None:
        """Raise ConfigError when ``model``'s shape does not fit the degrees (meta models work)."""
        check_tp_model(model, self.layout.tp)
        if self.layout.pp > 1:
            check_pp_model(model, self.layout)

    @property
    def partitions_parameters(self) -> bool:  # type: ignore[override]
        return self.layout.pp > 1

    def compile_unsupported(self, options: ParallelConfig) -> str | None:
        if self.layout.pp > 1:
            refusal = compile_refusal(self.layout.pp_schedule)
            if refusal:
                return refusal
        if self.layout.tp > 1 and options.activation_checkpointing != "none":
            # torch 2.13's AOT autograd cannot save a checkpointed region's DTensor metadata (it
            # stores the DeviceMesh among the saved tensors and asserts); TP + compile and
            # AC + compile each work.
            return (f"tensor parallel (tp={self.layout.tp}) with activation checkpointing "
                    f"({options.activation_checkpointing!r}) does not compile in this PyTorch "
                    "(AOT autograd cannot save a checkpointed DTensor region); set "
                    "parallel.activation_checkpointing = \"none\" to compile under TP")
        return None

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        # fp16 (refused under PP): gradients are DTensor shards under TP/FSDP, so an inf found on one
        # rank must skip the step everywhere; the sharded scaler all-reduces its found-inf flag.
        return ShardedGradScaler(device=device.type)

    # ------------------------------------------------------------ parallelize's steps
    def split(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        # Same model and layout on every rank, so a bad shape raises the same error everywhere.
        self.check_model(model)
        layout = ctx.layout
        if layout.pp > 1 and layout.n_blocks != n_pipeline_blocks(model):
            layout = layout.with_blocks(n_pipeline_blocks(model), "blocks")
        self._stage_ids, self._ranges = [0], [range(0)]
        self._stage_layout = layout
        if layout.pp == 1:
            return model
        self._ranges = list(layout.stage_ranges)
        self._stage_ids = layout.stage_ids(ctx.mesh["pp"].get_local_rank())  # type: ignore[index]
        ties = tied_groups(model)  # before the split cuts an embedding from its tied head
        # MoE aux losses ride on their layers' outputs (parallel/pipeline/moe.py); hooked before the
        # pruning so that every rank of an MoE model has one, whichever layers its stages hold.
        self.moe_aux = attach_pp_aux(model, ctx.mesh["pp"].get_group())  # type: ignore[index]
        model = prune_to_stages(model, self._stage_ids, self._ranges)
        self.ties = StageTies.plan(model, ties, layout, self._stage_ids, ctx.meshes)
        if ctx.materialize is None:  # a meta-device model is allocated in wrap(), stages only
            model = model.to(ctx.device)
        return model

    def apply_tp(self, model: nn.Module, ctx: ParallelContext) -> None:
        if self.layout.tp > 1:
            apply_tp(model, ctx.mesh["tp"], self.layout.sequence_parallel)  # type: ignore[index]

    def wrap(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        opts, layout = ctx.options, self._stage_layout
        pp, tp, stage_ids, ranges = layout.pp, layout.tp, self._stage_ids, self._ranges
        mesh = ctx.mesh
        parts = [stage_view(model, s, ranges) for s in stage_ids] if pp > 1 else [model]
        if pp > 1 and tp > 1 and layout.sequence_parallel:
            for part in parts:  # HF stages re-wrap the sequence shard they receive (pipeline/hf.py)
                if hasattr(part, "set_sequence_parallel"):
                    part.set_sequence_parallel(mesh["tp"])  # type: ignore[index]
        if self.dp_kind == "fsdp":
            # Meta-device models: shard, then allocate and fill each rank's shards. Per FSDP root
            # (each stage), so that FSDP re-points its sharded parameters at the new storage.
            wrapped = [self._wrap_dp(part, ctx) for part in parts]
            for part in wrapped:
                self.materialize(part, ctx)
        else:
            # DDP (or nothing) on top: the stage's or TP slice's tensors must be real first.
            self.materialize(model, ctx)
            wrapped = [self._wrap_dp(part, ctx) for part in parts]
        if pp == 1:
            return wrapped[0]
        if self.ties is not None:
            self.ties.sync_weights()  # both copies of a tied embedding/head start equal (pipeline/ties.py)
        if self.uses_autocast() and opts.precision == "bf16-mixed":  # fp16 is refused under PP
            for part in parts:
                autocast_forward(part, ctx.device.type, torch.bfloat16)
        self.pipeline = Pipeline(wrapped, stage_ids, layout, ctx.mesh["pp"].get_group(), ctx.device)  # type: ignore[index]
        if self.moe_aux is not None:
            self.moe_aux.mute_metadata_inference(self.pipeline.stages)
        mute_hf_moe_inference(self.pipeline.stages)  # HF MoE stages (pipeline/hf_moe.py); others untouched
        # The union: this rank's parts under their single-device names, for the optimizer,
        # state dicts and checkpoints. The stages run through the schedule, not through it.
        return model

    @property
    def replicates_with_ddp(self) -> bool:
        return self.dp_kind == "ddp" and self.layout.dp > 1

    def _wrap_dp(self, module: nn.Module, ctx: ParallelContext) -> nn.Module:
        dp_mesh = ctx.mesh["dp"]  # type: ignore[index]
        if self.dp_kind == "fsdp":
            # Applied even when dp == 1, so mixed precision comes from the same policy everywhere.
            # One FSDP unit per transformer block plus the root, as under plain fsdp.
            # The zero-bubble schedules run a stage's weight gradients in a later pass (torch's
            # stage_backward_weight, after other micro-batches' forwards): a block unit that reshards
            # after forward lost them (torch 2.13; every unit but each stage's last one, which is never
            # resharded after forward, kept its weights: tests/test_pp.py). Under a pipeline every unit
            # of a stage stays unsharded from its first backward to the step's end anyway (torch turns
            # reshard-after-backward off until REDUCE_GRAD), so keeping them from the first forward
            # costs only the first forwards' gathers of the step.
            split_backward = self.layout.pp > 1 and schedule_info(self.layout.pp_schedule).zero_bubble
            return apply_fsdp(module, dp_mesh, ctx.options, expert_mesh=ctx.expert_mesh,
                              reshard_after_forward=not split_backward)
        if self.replicates_with_ddp:
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            # find_unused_parameters=True turns off DDP's bucket rebuild after the first iteration.
            # That rebuild records the parameters in gradient-ready order until the next forward;
            # under GPipe (or 1F1B with m == stages) a stage runs every micro-batch's backward
            # before its next forward, so it records each parameter m times and the reducer
            # asserts on step 2. The cost is one autograd-graph walk per stage forward; the
            # buckets keep DDP's initial (reverse registration) order. static_graph=True also
            # avoids the assert but its delayed reduction is wrong with the schedule's no_sync.
            return DistributedDataParallel(module, device_ids=device_ids,
                                           process_group=dp_mesh.get_group(), find_unused_parameters=True)
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
        tp = self.layout.tp
        if self.pipeline is not None:
            if self.ties is not None:
                self.ties.mark_backward()
            aux, m = self.moe_aux, self.pipeline.n_microbatches
            if aux is not None:  # the pipeline's per-micro-batch loss scale (parallel/pipeline/pp.py)
                aux.grad_scale = 1.0 / (m * session.grad_accum_steps)
            with tp_loss_context(tp):
                loss = self.pipeline.run(inputs, targets, loss_fn, session.grad_accum_steps, train=True,
                                         cp_state=session.cp_state)
            # The reported loss holds every stage's aux losses, as one process's loss does.
            return loss if aux is None else loss + aux.reported(m, loss.device)
        with tp_loss_context(tp):
            with session.autocast():
                loss = loss_fn(model(inputs), targets)
            session.backward(loss)
        return local_value(loss.detach())

    def eval_loss(self, session: Any, model: nn.Module, inputs: torch.Tensor,
                  targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        tp = self.layout.tp
        with tp_loss_context(tp):
            if self.pipeline is not None:
                loss = self.pipeline.run(inputs, targets, loss_fn, 1, train=False, cp_state=session.cp_state)
            else:
                with session.autocast():
                    loss = local_value(loss_fn(model(inputs), targets).detach())
        if self.dp_kind == "fsdp":
            reshard_all(model)  # as under plain fsdp: evaluation must not leave units unsharded
        return loss

    def clip_grad_norm(self, model: nn.Module, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
        pp_group = ctx.mesh["pp"].get_group() if self.layout.pp > 1 else None  # type: ignore[index]
        params = list(model.parameters())
        if self.ties is None:
            return clip_grads(params, max_norm, pp_group)
        # Every step passes here before the optimizer: the tied copies' gradients are summed first,
        # and the norm counts the tied tensor once, as one process does (pipeline/ties.py).
        self.ties.sync_grads()
        return clip_grads(params, max_norm, pp_group, counted=self.ties.counted(params))

    def generation_unsupported(self) -> str | None:
        if self.layout.pp > 1:
            return "the model is split into pipeline stages, so no rank holds all of it"
        if self.layout.tp > 1:
            return "the tensor-parallel output head returns vocabulary-sharded logits"
        return None
