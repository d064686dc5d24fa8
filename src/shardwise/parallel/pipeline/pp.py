"""Pipeline parallel: split the model's layers into stages and run them with a PyTorch schedule.

Stages come from the model family's split (``parallel/adapters.py``: the built-in GPT in
``gpt.py``, the Llama-like Hugging Face families in ``hf.py``, GPT-2 in ``gpt2.py``). Each rank
keeps one model with everything it does not own deleted (its *union* model: parameter names are
the single-device ones, so checkpoints line up across layouts), and each local stage is a light
view of that union holding only the stage's own parts. Schedules, microbatching and the point-to-point
activation traffic are ``torch.distributed.pipelining``: every schedule in ``core/pp_schedules.py``
(GPipe, 1F1B, interleaved 1F1B, looped BFS, interleaved zero-bubble, ZBV, DualPipeV).

Loss scaling (why the result equals one big batch): the schedule calls backward itself, once per
microbatch, and ``scale_grads=False`` keeps it from rescaling afterwards (it would also rescale the
gradients kept from earlier accumulation steps). We hand it ``loss_mb / (m * A)`` for ``m``
microbatches and ``A = grad_accum_steps``; the sum of the ``m * A`` backward passes is then
``(1 / (m A)) * sum_a sum_mb grad(mean loss of the microbatch)``, the gradient of the mean loss
over the rank's whole batch; DDP/FSDP average it over data-parallel replicas as usual. A loss
marked as a token SUM (``runtime.token_loss``: records and packed text, already scaled by the
global count of trained tokens) adds up over the microbatches instead: it gets ``1 / A``, so the
step's gradient is the one-process token mean whatever the split.

Record and packed batches (a mapping with ``position_ids`` / ``doc_ids`` / ``attention_mask``,
``models.masking``): every stage needs its microbatch's positions and document mask, not only
the first. They go to ``schedule.step`` as keyword arguments on every rank: torch's schedules cut
step kwargs into the same microbatches as the inputs and hand microbatch ``i``'s share to every
stage's forward of microbatch ``i`` (torchtitan feeds its positions and attention masks to later
stages the same way, as ``kwarg_mbs``). The pipeline ranks of a group read the same batch, so each
rank has them; nothing but the activation crosses a stage boundary, and each stage builds the
mask it needs from the doc ids (``models.masking.attention_mask_4d``, the one owner of that rule).
Under context parallel the whole sequence's mask lives in the cp group's ``CPState``; it is cut
into the same microbatches and the state is pointed at microbatch ``i``'s mask whenever a stage
runs microbatch ``i``, forward or backward (activation checkpointing recomputes the attention in
the backward, in whatever order the schedule interleaves the microbatches).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import GraphExecGroup

from shardwise.core.families import PP_FAMILIES, no_stage_split
from shardwise.core.layout import Layout, stage_layer_ranges
from shardwise.core.pp_schedules import schedule_info, stage_rank
from shardwise.errors import ConfigError
from shardwise.models.masking import split_inputs
from shardwise.parallel.adapters import StageSplit, adapter_for
from shardwise.parallel.blocks import model_family
from shardwise.parallel.pipeline.ties import check_stage_ties
from shardwise.parallel.tensor.tp import local_value
from shardwise.runtime.token_loss import is_token_sum

__all__ = ["Pipeline", "autocast_forward", "check_pp_model", "fixed_shape_collate", "n_pipeline_blocks",
           "prune_to_stages", "stage_layer_ranges", "stage_view"]


def _split_of(model: nn.Module) -> StageSplit:
    adapter = adapter_for(model)
    if adapter is None or model_family(model) not in PP_FAMILIES:
        family = model_family(model)
        what = f"the Hugging Face {family} model" if family else type(model).__name__
        raise ConfigError(
            f"{no_stage_split(what)}. Use tensor parallel or a data-parallel/sharded strategy (ddp, fsdp) for "
            "this model.")
    return adapter.stages


def n_pipeline_blocks(model: nn.Module) -> int:
    """The number of blocks the pipeline splits into stages (GPT blocks or HF decoder layers)."""
    return _split_of(model).n_blocks(model)


def check_pp_model(model: nn.Module, layout: Layout) -> None:
    """Raise ConfigError unless ``model`` can be cut into the layout's pipeline stages."""
    _split_of(model).check(model)
    check_stage_ties(model, layout)
    layout.with_blocks(n_pipeline_blocks(model), "blocks")  # raises when the stages cannot be cut


def prune_to_stages(model: nn.Module, stage_ids: list[int], ranges: list[range]) -> nn.Module:
    """Delete from ``model`` (in place) every part no local stage owns; return it (the union)."""
    return _split_of(model).prune(model, stage_ids, ranges)


def stage_view(union: nn.Module, stage: int, ranges: list[range]) -> nn.Module:
    """Stage ``stage``'s module, sharing its parts with ``union`` (its family's, ``parallel/adapters.py``)."""
    return _split_of(union).stage(union, stage, ranges)


def autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``module``'s forward under autocast (the schedule, not our code, calls it)."""
    forward = module.forward

    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = wrapped


def _forward_only_v_schedule(stages: list[PipelineStage], kwargs: dict[str, Any]) -> Any:
    """A ZBV schedule over ``stages`` keeping only its forward actions, for evaluation.

    torch 2.13's ``eval()`` of the V-shaped schedules (ZBV, DualPipeV) still walks their backward
    actions and fails handing a backward between the two stages of one rank ("can't steal_bwd_input
    if this stage doesn't have backward"). Both schedules use the same V placement, so ZBV's action
    list with only the forwards (communication re-derived by torch's own lowering) evaluates either.
    """
    schedule = pipelining.ScheduleZBVZeroBubble(stages, **kwargs)
    forward = torch_schedules._ComputationType.FORWARD
    order = {rank: torch_schedules._add_unshard_reshard(
                [a for a in actions if a is not None and a.computation_type == forward])
             for rank, actions in schedule.pipeline_order.items()}
    # torch's lowering (as _prepare_schedule_with_comms does it, minus the validation, which
    # insists on one backward per micro-batch): the sends/receives between the forwards.
    schedule.pipeline_order_with_comms = torch_schedules._add_send_recv(
        order, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=schedule._num_stages)
    return schedule


def _recompute_once(weight_pass: Callable) -> Callable:
    """A split-backward schedule's weight pass (ZBV, DualPipeV, interleaved zero-bubble) with each
    checkpointed block recomputed once, not once per parameter group.

    torch's ``stage_backward_weight`` calls ``torch.autograd.grad`` once per parameter group (about
    nine per Llama block: each weight and the intermediate node that leads to it), and non-reentrant
    activation checkpointing recomputes a block's forward once per autograd call: a two-layer stage's
    weight pass recomputed its blocks 18 times (measured on real tensors: 108 recomputed matmuls
    per micro-batch, 12 with this). Under one ``GraphExecGroup`` (torch's public way for several
    backward calls to share one recomputation; the groups' calls read disjoint saved tensors) they
    share it; the gradients are bitwise the same. A no-op without checkpointing."""
    @functools.wraps(weight_pass)
    def run(*args: Any, **kwargs: Any) -> Any:
        with GraphExecGroup():
            return weight_pass(*args, **kwargs)

    return run


def fixed_shape_collate(collate_fn: Callable) -> Callable:
    """The collate function to feed a pipeline with instead of ``collate_fn``: batches of one shape.

    torch sizes the stages' receive buffers from the first batch. Re-inferring them when a batch
    has another shape (``Pipeline._fit_shapes``) runs a forward outside the schedule, whose FSDP
    all-gathers only the ranks that re-infer take part in: ranks of another data-parallel replica
    (other data) or an accumulation step later in the same optimizer step would not match. So the
    built-in trainer's record batches keep their full row length under a pipeline instead of being
    cut to the batch's longest row (``data.collate``): the padding is masked and its labels -100,
    so no number changes; the cost is the padding's compute.
    """
    from shardwise.data.collate import collate_rows  # defers numpy

    if collate_fn is collate_rows:
        return functools.partial(collate_rows, trim=False)
    return collate_fn


# Single-stage schedules keep the flags as ``_stage_*``, multi-stage ones as ``_stages_*``.
_INIT_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized",
               "_stages_forward_initialized", "_stages_backward_initialized")


def _uninitialise(schedule: Any) -> None:
    """Make torch's ``schedule`` set up its stages (shapes, buffers) again at its next step."""
    for name in _INIT_FLAGS:
        if hasattr(schedule, name):
            setattr(schedule, name, False)


class Pipeline:
    """One rank's share of a pipeline: its stages, the schedule, and loss bookkeeping."""

    def __init__(self, stage_modules: list[nn.Module], stage_ids: list[int], layout: Layout,
                 pp_group: Any, device: torch.device) -> None:
        self.layout = layout
        self.pp_group = pp_group
        self.pp_size = dist.get_world_size(pp_group)
        # The micro-batch count the layout resolved (and preflight checked): one number, one owner.
        self.n_microbatches = n_microbatches = layout.pp_microbatches
        n_stages, schedule = layout.n_stages, layout.pp_schedule
        self.has_first = 0 in stage_ids
        self.has_last = n_stages - 1 in stage_ids
        self.stages = [PipelineStage(m, s, n_stages, device, group=pp_group)
                       for m, s in zip(stage_modules, stage_ids)]
        # Context parallel: the step's whole-sequence masks, one per microbatch (module docstring).
        self._cp_state: Any = None
        self._cp_masks: list[torch.Tensor | None] | None = None
        for stage in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, name, self._with_cp_mask(getattr(stage, name)))
            stage.backward_weight_one_chunk = _recompute_once(stage.backward_weight_one_chunk)
        self._loss_fn: Callable | None = None
        self._shapes: dict[int, tuple[int, ...]] = {}  # the batch shape each schedule last ran
        self._scale = 1.0
        kwargs = {"n_microbatches": n_microbatches, "loss_fn": self._scaled_loss, "scale_grads": False}
        # The schedule table (core/pp_schedules.py) names the torch class and its stage placement;
        # the layout already checked its rules (stages per rank, micro-batch count).
        info = schedule_info(schedule)
        cls = getattr(pipelining, info.torch_class)
        self.schedule = cls(self.stages if info.multi_stage else self.stages[0], **kwargs)
        # V placement puts the last stage (the loss) on rank 0; loop placement on rank pp - 1.
        self.last_rank = stage_rank(schedule, n_stages - 1, self.pp_size, layout.pp_stages_per_rank)
        self._eval_schedule = self.schedule
        if info.placement == "v":
            self._eval_schedule = _forward_only_v_schedule(self.stages, kwargs)

    def _fit_shapes(self, schedule: Any, shape: tuple[int, ...]) -> None:
        """Make ``schedule`` infer its stages' shapes again when the batch's shape changed.

        torch sizes every stage's receive buffers once, from the first batch. A loop of its own may
        pad records to each batch's longest row (dynamic padding, ``data.collate``), so a later
        batch may be shorter or longer: the stages then re-run torch's shape inference (a forward
        and a small metadata exchange between neighbours). The pipeline ranks read the same batch,
        so they all do it at the same step. Refused under FSDP with several data-parallel ranks
        (see ``fixed_shape_collate``; the built-in trainer's batches have one shape).
        """
        if self._shapes.get(id(schedule)) not in (None, shape):
            if self.layout.dp > 1 and self.layout.info.dp_kind == "fsdp":
                # The re-inference's FSDP all-gathers would run on this replica only (fixed_shape_collate).
                raise ConfigError(
                    f"pipeline parallel under FSDP with {self.layout.dp} data-parallel ranks needs every batch "
                    f"of a run in one shape; this one is {list(shape)} after {list(self._shapes[id(schedule)])}. "
                    "Pad batches to a fixed length (shardwise.data.collate.collate_rows(..., trim=False); the "
                    "built-in trainer does), or use ddp+pp.")
            _uninitialise(schedule)
        self._shapes[id(schedule)] = shape

    @contextlib.contextmanager
    def _keep_grads(self, schedule: Any, train: bool) -> Any:
        """Keep the gradients earlier micro-batches left when ``schedule`` sets its stages up again.

        torch's shape inference runs a real forward (and backward) and then sets every FSDP
        parameter's ``grad`` to None (``_post_metadata_inference_cleanup``). It runs at a schedule's
        first run, after ``_uninitialise`` (a new batch shape), and at every switch between a
        training step and an evaluation (torch sets a schedule up again when it did not last run
        with the same has-backward): an evaluation between two micro-batches of one accumulation
        window wiped the first one's gradients under FSDP (the loss off by 3e-2 a step later, fsdp+pp).
        Set aside here and added back after the run: for every evaluation, which makes no
        gradients, and for a training run whose schedule will set up again."""
        flags = [getattr(schedule, name, None) for name in _INIT_FLAGS]
        if train and all(flag for flag in flags if flag is not None):
            yield  # set up for training: no shape inference in this run
            return
        # Only FSDP's parameters lose theirs (other gradients stay, summed in the order they came).
        kept = [(p, p.grad) for stage in self.stages for m in stage.submod.modules() if isinstance(m, FSDPModule)
                for p in m.parameters() if p.grad is not None]
        kept = list({id(p): (p, g) for p, g in kept}.values())  # nested FSDP units share parameters
        for p, _ in kept:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in kept:
                p.grad = grad if p.grad is None else p.grad + grad

    @contextlib.contextmanager
    def _no_ddp_sync(self) -> Any:
        """DDP-wrapped stages in ``no_sync`` for the whole step.

        torch runs every microbatch's forward under ``no_sync`` and arms DDP's reducer itself before
        the last backward; the one forward it runs outside is the shape inference's, whose output
        gets no backward. On the first step that is harmless, but a re-inference (a new batch
        shape, ``_fit_shapes``) after DDP built its buckets leaves the reducer expecting a backward
        and the next step fails inside DDP. Under ``no_sync`` that forward arms nothing.
        """
        with contextlib.ExitStack() as stack:
            for stage in self.stages:
                if isinstance(stage.submod, DistributedDataParallel):
                    stack.enter_context(stage.submod.no_sync())
            yield

    def _with_cp_mask(self, method: Callable) -> Callable:
        """``method`` (a stage's forward or backward of one microbatch) with the cp state pointed at
        that microbatch's whole-sequence mask while it runs."""
        @functools.wraps(method)
        def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if self._cp_masks is not None:
                self._cp_state.mask = self._cp_masks[chunk_id]
            return method(chunk_id, *args, **kwargs)

        return run

    def _take_cp_masks(self, cp_state: Any) -> None:
        """Cut the batch's whole-sequence mask (``parallel.context.cp.chunk_batch`` left it in ``cp_state``)
        into the schedule's microbatches, with torch's own splitting, so microbatch i gets rows i."""
        self._cp_state, self._cp_masks = cp_state, None
        if cp_state is None or cp_state.mask is None:
            return
        _, pieces = split_args_kwargs_into_chunks((), {"mask": cp_state.mask}, self.n_microbatches)
        self._cp_masks = [piece["mask"] for piece in pieces]
        # torch's shape inference (first step, or a new batch shape) runs a forward of microbatch
        # 0's inputs outside forward_one_chunk: it must see that microbatch's mask too.
        cp_state.mask = self._cp_masks[0]

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target) * self._scale

    def run(self, inputs: torch.Tensor | dict[str, torch.Tensor], targets: torch.Tensor, loss_fn: Callable,
            grad_accum_steps: int, train: bool, cp_state: Any = None) -> torch.Tensor:
        """Run the schedule on one batch (forward+backward, or forward only); return its loss: the mean
        over the microbatches, or for a token-sum loss (``runtime.token_loss``) their sum. Forward
        only, a ``loss_fn`` returning one value per row (or several: a 1-D tensor per microbatch)
        gets the microbatches' values concatenated in row order (per-sequence scores).

        ``inputs``: token ids, or a mapping of them and their side inputs (``models.masking``).
        ``cp_state``: the cp group's state holding the batch's whole-sequence mask (context parallel).
        Every rank of the pipeline returns the same value, broadcast from the last stage.
        """
        ids, extra = split_inputs(inputs)
        self.layout.check_batch(ids.shape[0])
        self._loss_fn = loss_fn
        # See the module docstring: the m * A backward passes sum to one big batch's gradient
        # (a token sum adds up over the m microbatches itself).
        summed = is_token_sum(loss_fn)
        self._scale = 1.0 / (grad_accum_steps if summed else self.n_microbatches * grad_accum_steps)
        self._take_cp_masks(cp_state)
        self._fit_shapes(self.schedule if train else self._eval_schedule, tuple(ids.shape))
        args = (ids,) if self.has_first else ()
        target = targets if self.has_last else None
        losses: list | None = [] if self.has_last else None
        schedule = self.schedule if train else self._eval_schedule
        try:
            with self._no_ddp_sync(), self._keep_grads(schedule, train):
                if train:
                    # return_outputs=False: the last stage would keep every microbatch's output (the
                    # logits) in ``output_chunks`` until the next step, through the optimizer step,
                    # and concatenate them into one more copy, to return what training never reads.
                    schedule.step(*args, target=target, losses=losses, return_outputs=False, **extra)
                else:
                    schedule.eval(*args, target=target, losses=losses, **extra)
        finally:
            self._cp_masks = None
            if cp_state is not None:
                cp_state.mask = None
        if not train and self._eval_schedule is not self.schedule:
            # The two schedules share the stages, but each keeps its own "stages initialised
            # for train/eval" flags: make the next training step re-initialise them (its
            # receive buffers must require grad again, or the stage boundaries pass no
            # gradient), and the next evaluation likewise.
            for sched in (self.schedule, self._eval_schedule):
                _uninitialise(sched)
        if not train and (rows := self._rows(losses, ids.device)) is not None:
            return rows
        if self.has_last:
            # The schedule's per-microbatch losses (not ones seen by our loss_fn, which it also
            # calls on placeholder tensors while it infers shapes on the first step), unscaled.
            # Summed in float64 (exact for float32 values; a float64 run's loss is not rounded).
            loss = torch.stack([local_value(t.detach()).double() for t in losses])
            loss = (loss.sum() if summed else loss.mean()) / self._scale
        else:
            loss = torch.zeros((), dtype=torch.float64, device=ids.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_rank)
        return loss

    def _rows(self, losses: list | None, device: torch.device) -> torch.Tensor | None:
        """An evaluation's per-row values (its loss_fn returned a 1-D tensor per microbatch),
        concatenated, on every stage; None for one loss. The last stage alone saw them: it sends
        their number first (-1: one loss), then the values."""
        rows = None
        if self.has_last and losses and losses[0].dim() > 0:
            # The schedule holds what _scaled_loss returned: undo the scale, as for one loss.
            rows = torch.cat([local_value(t.detach()).double() for t in losses]) / self._scale
        n = torch.tensor(rows.numel() if rows is not None else -1, device=device)
        dist.broadcast(n, group=self.pp_group, group_src=self.last_rank)
        if int(n.item()) < 0:
            return None
        out = rows if rows is not None else torch.zeros(int(n.item()), dtype=torch.float64, device=device)
        dist.broadcast(out, group=self.pp_group, group_src=self.last_rank)
        return out
