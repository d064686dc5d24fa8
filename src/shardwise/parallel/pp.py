"""Pipeline parallel: split the model's layers into stages and run them with a PyTorch schedule.

Stages come from the built-in GPT, which is built for this: its blocks live in an ``nn.ModuleDict``
keyed "0".."n-1" and ``tok_emb``/``pos_emb``/``ln_f``/``lm_head`` may be ``None``. Each rank keeps
one GPT with everything it does not own deleted (its *union* model: parameter names are the
single-device ones, so checkpoints line up across layouts), and each local stage is a light view
of that union holding only the stage's own parts. Schedules, microbatching and the point-to-point
activation traffic are ``torch.distributed.pipelining``: every schedule in ``pp_schedules.py``
(GPipe, 1F1B, interleaved 1F1B, looped BFS, interleaved zero-bubble, ZBV, DualPipeV).

Loss scaling (why the result equals one big batch): the schedule calls backward itself, once per
microbatch, and ``scale_grads=False`` keeps it from rescaling afterwards (it would also rescale the
gradients kept from earlier accumulation steps). We hand it ``loss_mb / (m * A)`` for ``m``
microbatches and ``A = grad_accum_steps``; the sum of the ``m * A`` backward passes is then
``(1 / (m A)) * sum_a sum_mb grad(mean loss of the microbatch)``, the gradient of the mean loss
over the rank's whole batch; DDP/FSDP average it over data-parallel replicas as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage

from shardwise.errors import ConfigError
from shardwise.layout import Layout, stage_layer_ranges
from shardwise.pp_schedules import schedule_info, stage_rank

__all__ = ["Pipeline", "autocast_forward", "check_pp_model", "n_pipeline_blocks",
           "prune_to_stages", "stage_layer_ranges", "stage_view"]


def _is_gpt(model: nn.Module) -> bool:
    from shardwise.models.gpt import GPT

    return isinstance(model, GPT)


def n_pipeline_blocks(model: nn.Module) -> int:
    """The number of blocks the pipeline splits into stages (GPT blocks or HF decoder layers)."""
    if _is_gpt(model):
        return len(model.blocks)
    from shardwise.parallel.pp_hf import n_layers

    return n_layers(model)


def check_pp_model(model: nn.Module, layout: Layout) -> None:
    """Raise ConfigError unless ``model`` can be cut into the layout's pipeline stages."""
    from shardwise.parallel.pp_hf import check_hf_pp_model, hf_pp_family
    from shardwise.parallel.registry import PP_FAMILIES

    if not _is_gpt(model):
        if not hf_pp_family(model):
            from shardwise.parallel.blocks import model_family

            family = model_family(model)
            what = f"the Hugging Face {family} model" if family else type(model).__name__
            raise ConfigError(
                f"pipeline parallel has a stage split for the built-in GPT and the Hugging Face families "
                f"{', '.join(f for f in PP_FAMILIES if f != 'gpt')}; {what} has no stage split. Use tensor parallel "
                "or a data-parallel/sharded strategy (ddp, fsdp) for this model.")
        check_hf_pp_model(model)
    from shardwise.parallel.pp_ties import check_stage_ties

    check_stage_ties(model, layout)
    layout.with_blocks(n_pipeline_blocks(model), "blocks")  # raises when the stages cannot be cut


def prune_to_stages(model: nn.Module, stage_ids: list[int], ranges: list[range]) -> nn.Module:
    """Delete from ``model`` (in place) every part no local stage owns; return it (the union)."""
    if not _is_gpt(model):
        from shardwise.parallel.pp_hf import prune_hf_to_stages

        return prune_hf_to_stages(model, stage_ids, ranges)
    n_stages = len(ranges)
    owned = {str(i) for s in stage_ids for i in ranges[s]}
    for key in list(model.blocks.keys()):
        if key not in owned:
            del model.blocks[key]
    if 0 not in stage_ids:
        model.tok_emb = None
        model.pos_emb = None
    if n_stages - 1 not in stage_ids:
        model.ln_f = None
        model.lm_head = None
    return model


def stage_view(union: nn.Module, stage: int, ranges: list[range]) -> nn.Module:
    """Return a GPT holding only stage ``stage``'s parts, sharing its modules with ``union``.

    A fresh module (not a copy) so that wrappers (DDP, FSDP) and hooks put on a stage never
    leak onto the union; attribute order matches GPT so the stage's FQNs are the union's.
    Hugging Face models get an ``HFStage`` (``parallel/pp_hf.py``), built on the same rule.
    """
    if not _is_gpt(union):
        from shardwise.parallel.pp_hf import hf_stage

        return hf_stage(union, stage, ranges)
    last = stage == len(ranges) - 1
    view = type(union).__new__(type(union))
    nn.Module.__init__(view)
    view.config = union.config
    view.tok_emb = union.tok_emb if stage == 0 else None
    view.pos_emb = union.pos_emb if stage == 0 else None
    view.drop = union.drop
    view.blocks = nn.ModuleDict({str(i): union.blocks[str(i)] for i in ranges[stage]})
    view.ln_f = union.ln_f if last else None
    view.lm_head = union.lm_head if last else None
    return view


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
    from torch.distributed.pipelining import schedules as torch_schedules

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
        self._loss_fn: Callable | None = None
        self._scale = 1.0
        kwargs = {"n_microbatches": n_microbatches, "loss_fn": self._scaled_loss, "scale_grads": False}
        # The schedule table (pp_schedules.py) names the torch class and its stage placement;
        # the layout already checked its rules (stages per rank, micro-batch count).
        info = schedule_info(schedule)
        cls = getattr(pipelining, info.torch_class)
        self.schedule = cls(self.stages if info.multi_stage else self.stages[0], **kwargs)
        # V placement puts the last stage (the loss) on rank 0; loop placement on rank pp - 1.
        self.last_rank = stage_rank(schedule, n_stages - 1, self.pp_size, layout.pp_stages_per_rank)
        self._eval_schedule = self.schedule
        if info.placement == "v":
            self._eval_schedule = _forward_only_v_schedule(self.stages, kwargs)

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target) * self._scale

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable,
            grad_accum_steps: int, train: bool) -> torch.Tensor:
        """Run the schedule on one batch (forward+backward, or forward only); return the mean loss.

        Every rank of the pipeline returns the same value, broadcast from the last stage.
        """
        self.layout.check_batch(inputs.shape[0])
        self._loss_fn = loss_fn
        # See the module docstring: the m * A backward passes sum to one big batch's gradient.
        self._scale = 1.0 / (self.n_microbatches * grad_accum_steps)
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        losses: list | None = [] if self.has_last else None
        if train:
            self.schedule.step(*args, target=target, losses=losses)
        else:
            self._eval_schedule.eval(*args, target=target, losses=losses)
            if self._eval_schedule is not self.schedule:
                # The two schedules share the stages, but each keeps its own "stages initialised
                # for train/eval" flags: make the next training step re-initialise them (its
                # receive buffers must require grad again, or the stage boundaries pass no
                # gradient), and the next evaluation likewise.
                for sched in (self.schedule, self._eval_schedule):
                    sched._stages_forward_initialized = False  # noqa: SLF001
                    sched._stages_backward_initialized = False  # noqa: SLF001
        from shardwise.parallel.tp import local_value

        if self.has_last:
            # The schedule's per-microbatch losses (not ones seen by our loss_fn, which it also
            # calls on placeholder tensors while it infers shapes on the first step), unscaled.
            loss = torch.stack([local_value(t.detach()).float() for t in losses]).mean() / self._scale
        else:
            loss = torch.zeros((), dtype=torch.float32, device=inputs.device)
        dist.broadcast(loss, group=self.pp_group, group_src=self.last_rank)
        return loss

