"""Mixture-of-experts aux losses under pipeline parallel (Megatron-Core's ``MoEAuxLossAutoScaler``).

Without a pipeline every MoE layer's aux loss (load balancing + z-loss, ``models/moe.py``) joins
the training loss through ``with_aux_loss``. Under pipeline parallel the loss exists on the last
stage only, and the routers of earlier stages live on other ranks: their aux losses cannot reach
it without sending autograd graphs across ranks. Megatron's answer, used here: each MoE layer's
aux loss is attached to the layer's *output* by an autograd function that is the identity in
forward and, in backward, passes the output gradient through unchanged and gives the aux loss
the gradient ``scale`` (the one the pipeline puts on each micro-batch's loss). Each stage then
backpropagates its own routers' aux losses when the output gradient arrives, with nothing sent:

    d/dθ [ scale * (CE_mb + sum_layers aux_mb) ] = scale * dCE_mb/dθ + scale * sum_layers d aux_mb/dθ

which is what one process does with ``with_aux_loss`` on the same micro-batch. The aux loss of a
pipeline micro-batch is formed, as under gradient accumulation, over that micro-batch's tokens of
every data-parallel rank (counts all-reduced over the stage's dp group): the exact one-process
equivalent is one process accumulating the same micro-batches.

The values are kept (detached) so the reported loss still includes them: per step, their sum
over this rank's layers and micro-batches is summed over the pipeline ranks and averaged over the
micro-batches (``reported``), as each micro-batch's loss would have held it.

Model code stays single-device: the MoE layer records its aux loss as always; a forward hook put
on it from outside moves that record onto the layer's output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.models.moe import MoE, _pending

__all__ = ["AuxLossAutoScaler", "StageAux", "attach_pp_aux"]


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; backward gives ``aux`` the gradient ``scale`` (Megatron-Core's)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        # Only the aux loss's dtype/device are kept (no saved tensor): an activation-checkpointed
        # block recomputes its forward without the aux loss, and must not find a saved one missing.
        ctx.aux_dtype, ctx.aux_device, ctx.scale = aux.dtype, aux.device, scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad_output, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


class StageAux:
    """The MoE layers of this rank's pipeline stages: their aux losses ride on their outputs."""

    def __init__(self, layers: list[nn.Module], pp_group: Any) -> None:
        self.layers, self.pp_group = layers, pp_group
        self.grad_scale = 1.0  # set per step: the pipeline's per-micro-batch loss scale
        self._values: list[torch.Tensor] = []
        self._mark: list[int] = []

    def _before(self, module: nn.Module, args: Any) -> None:
        self._mark.append(len(_pending))

    def _after(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        mark = self._mark.pop()
        if len(_pending) == mark:  # evaluation, or a checkpointed block's recomputation
            return output
        aux = _pending.pop()
        self._values.append(aux.detach())
        return AuxLossAutoScaler.apply(output, aux, self.grad_scale)

    def mute_metadata_inference(self, stages: list[Any]) -> None:
        """Keep the routers out of the stages' shape inference.

        On its first step each ``PipelineStage`` runs its forward once on placeholder tensors
        (``_forward_metadata_inference``, with grad) to learn the shapes it sends: the MoE layers
        must not count those tokens, all-reduce their counts, or record an aux loss from them.
        They run it as in evaluation (``training`` off: no record; dropout is 0 in shape terms),
        and skip their experts: an MoE layer's output has its input's shape, so it returns
        ``0 * x`` (still on the autograd path, for the backward inference). Under expert
        parallel the experts would run token all-to-alls inside torch's metadata inference,
        which the two ranks of a stage did not reach together (a 4-rank fsdp+pp ep=2 run hung
        there in the first step: one rank's backward inference waited in the all-to-all while
        its ep peer had moved on to the schedule); with the experts skipped the inference runs no
        collective of the MoE layers at all.
        """
        for stage in stages:
            infer = getattr(stage, "_forward_metadata_inference", None)
            if infer is not None:
                stage._forward_metadata_inference = self._muted(infer)

    def _muted(self, infer: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            modes = [layer.training for layer in self.layers]
            for layer in self.layers:
                layer.training = False
                layer.forward = _shape_only  # an instance attribute: the class is untouched
            try:
                return infer(*args, **kwargs)
            finally:
                for layer, mode in zip(self.layers, modes):
                    layer.training = mode
                    del layer.forward

        return run

    def reported(self, n_microbatches: int, device: torch.device) -> torch.Tensor:
        """This step's aux losses per micro-batch, summed over every stage's layers (a collective
        over the pipeline ranks); forget them."""
        total = torch.stack(self._values).sum() if self._values else torch.zeros((), device=device)
        self._values.clear()
        # float64 on the wire: stages must agree on the dtype, and a stage's aux dtype is its model's.
        total = total.double().to(device)
        dist.all_reduce(total, group=self.pp_group)
        return total / n_microbatches


def _shape_only(x: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """An MoE layer's stand-in during the stages' metadata inference: its output's shape, no experts."""
    return x * 0


def attach_pp_aux(model: nn.Module, pp_group: Any) -> StageAux | None:
    """Hook every built-in MoE layer of ``model`` (a pipeline rank's union); None for a dense model.

    Also points ``take_moe_stats`` at the pipeline group (``model.moe_pp_group``), so routing
    statistics cover every stage's layers.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    model.moe_pp_group = pp_group
    # A Hugging Face MoE model: its last stage puts the all-layers aux loss on its output with this
    # object's scale and reporting (parallel/pipeline/hf_moe.py); no per-layer hooks.
    recorder = getattr(getattr(model, "hf", None), "shardwise_moe_recorder", None)
    if not layers and recorder is None:
        return None
    aux = StageAux(layers, pp_group)
    if recorder is not None:
        recorder.pp_aux = aux
    for layer in layers:
        layer.register_forward_pre_hook(aux._before)
        layer.register_forward_hook(aux._after)
    return aux
