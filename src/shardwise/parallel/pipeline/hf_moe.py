"""Hugging Face mixture-of-experts models under pipeline parallel: transformers' all-layers aux loss,
exact, with routers on every stage (``parallel/pipeline/hf.py`` cuts the model; ``models/hf_moe.py``
forms the same loss on one process).

transformers' load-balancing loss is one number over ALL layers' routing at once (L MoE layers,
N real tokens of the global micro-batch, E experts, R data-parallel ranks)::

    aux = coef * E * sum_e (C_e / (N L)) * (S_e / (N L))

C_e (top-k slots expert e got, no gradient) and S_e (its router-probability sum, differentiable)
are sums over every layer, so no stage can form it from its own layers: the built-in GPT's
per-layer aux losses (``parallel/pipeline/moe.py``, Megatron's auto-scaler) do not apply, the product
of two all-layer sums does not split into per-layer terms. Instead each stage's output carries,
beside the hidden states, one small fp32 side tensor ``[[S], [C]]`` of shape ``(2, E)``: the running
sums over the layers so far of this micro-batch. Stage s adds its layers' sums (S over this rank's
real tokens, C summed over the data-parallel group in the same all-reduce the one-process path
makes); the last stage holds the all-layer S and C and forms ``aux`` (with the R / N scale of
``models/hf_moe.py``). It joins the micro-batch's loss the way the built-in GPT's aux losses do
under a pipeline (``pipeline/moe.py``): Megatron's ``AuxLossAutoScaler`` puts it on the last stage's final hidden
states with the gradient scale the pipeline gives each micro-batch's loss, ``1 / (micro-batches x
accumulation)``, for a mean loss and a token-sum loss alike (the token-sum loss adds up over the
micro-batches; an aux loss inside it would be counted once per micro-batch instead of averaged), and
its value joins the reported loss (``StageAux.reported``). The pipeline's own backward then carries
``d aux / d S = coef * E * C * R / (N L)^2`` from the last stage back through
the normal point-to-point gradient path into every stage's routers: the same optimisation as one
process accumulating the same micro-batches. The C row rides in the same tensor (its gradient is
zero: the last stage reads it detached) because torch's ``PipelineStage`` gives every received
floating-point tensor ``requires_grad`` and expects a gradient back for it; one tensor keeps every
channel an ordinary differentiable one.

Stage metadata inference (torch runs each stage once on placeholder tensors at its first step) must
not count tokens, all-reduce or run the experts (under expert parallel their all-to-alls would meet
peers that are elsewhere, as ``pipeline/moe.py`` explains): the MoE blocks return ``0 * x`` then and the
side tensor is zero, still on the autograd path where the real one is, so torch sizes and wires its
gradient exactly as in the real steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.models.hf_moe import all_layers_aux
from shardwise.models.masking import real_token_mask
from shardwise.models.moe import expert_counts, queue_aux_loss
from shardwise.parallel.pipeline.moe import AuxLossAutoScaler

__all__ = ["StageRouting", "mute_hf_moe_inference", "stage_routing"]


class StageRouting:
    """The routers of one HF pipeline stage and the carried ``(2, E)`` sums (module docstring)."""

    def __init__(self, recorder: Any, blocks: list[nn.Module], last: bool) -> None:
        self.recorder = recorder
        self.blocks = blocks  # this stage's MoE blocks (``mlp`` modules carrying ``shardwise_moe``)
        self.last = last
        self.inferring = False  # torch's stage metadata inference is running (mute_hf_moe_inference)
        self._aux: torch.Tensor | None = None  # the last stage's aux loss of the current micro-batch

    def carry(self, side: torch.Tensor | None, hidden: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """This stage's side output: ``side`` (the previous stages' sums, None on the first) plus the
        sums of the routers this forward ran. On the last stage, also record the aux loss."""
        rec = self.recorder
        seen, rec.seen = rec.seen, []
        n_experts = rec.n_experts
        device = hidden.device
        # A copy, never the received tensor itself: the stage's output is a new node of the graph.
        out = torch.zeros(2, n_experts, dtype=torch.float32, device=device) if side is None else side.float().clone()
        if self.inferring:
            if self.blocks and torch.is_grad_enabled():
                local = hidden.to_local() if hasattr(hidden, "to_local") else hidden
                out = out + 0 * local.float().sum()  # on the autograd path, as the real sums are
            return out
        if not seen and not self.last:
            return out
        keep = real_token_mask(extra)
        keep = None if keep is None else keep.reshape(-1).to(device)
        rows = seen[0][1].shape[0] if seen else _rows(hidden)
        if keep is not None and keep.numel() != rows:
            raise ValueError(f"the MoE routers saw {rows} tokens but the batch's real-token mask has {keep.numel()}")
        # Per layer, top-k slots per expert of the real tokens, and the real-token count: one
        # all-reduce over the data-parallel group, as models/hf_moe.py makes on one forward.
        if keep is None:
            # The same counts as bincount, in a tensor of fixed shape (fake tensors can carry it).
            counts = [expert_counts(idx.reshape(-1), n_experts) for _, _, idx in seen]
            real = torch.tensor([rows], dtype=torch.long, device=device)
        else:
            counts = []
            for _, _, idx in seen:
                slots = keep.long().unsqueeze(-1).expand(-1, idx.shape[-1]).reshape(-1)
                counts.append(torch.zeros(n_experts, dtype=torch.long, device=device).index_add_(
                    0, idx.reshape(-1), slots))
            real = keep.long().sum().reshape(1)
        packed = torch.cat([*(c.reshape(-1) for c in counts), real])
        group = rec.stats_group
        ranks = 1
        if group is not None:
            dist.all_reduce(packed, group=group)
            ranks = dist.get_world_size(group)
        global_counts = packed[:-1].view(len(seen), n_experts)
        for i, (layer, _, _) in enumerate(seen):
            c = global_counts[i]
            layer.window_counts = c if layer.window_counts is None else layer.window_counts + c
        s, c = out[0], out[1].detach()
        for _, logits, _ in seen:  # layer by layer, the one-process summation order
            p = logits.float().softmax(dim=-1)
            s = s + (p if keep is None else p * keep.to(p.dtype).unsqueeze(-1)).sum(dim=0)
        c = c + global_counts.sum(0).to(c.dtype)
        out = torch.stack([s, c])
        if self.last:
            self._finish(out, packed[-1], ranks, [layer for layer, _, _ in seen])
        return out

    def attach(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's final hidden states with this micro-batch's aux loss riding on them
        (module docstring): the loss's gradient passes through them, and so reaches the aux loss."""
        aux, self._aux = self._aux, None
        stage_aux = getattr(self.recorder, "pp_aux", None)
        if aux is None or stage_aux is None:
            return hidden
        stage_aux._values.append(aux.detach())  # the reported loss includes it (StageAux.reported)
        return AuxLossAutoScaler.apply(hidden, aux, stage_aux.grad_scale)

    def _finish(self, side: torch.Tensor, real: torch.Tensor, ranks: int, layers: list[Any]) -> None:
        """The all-layer aux loss of this micro-batch (last stage), as ``_Recorder.finish`` forms it."""
        rec = self.recorder
        aux = all_layers_aux(rec.config, rec.n_experts, side[1].detach(), side[0], real.double().clamp(min=1),
                             rec.n_layers, ranks)
        if getattr(rec.config, "output_router_logits", False) and getattr(rec, "pp_aux", None) is not None:
            self._aux = aux  # joins the loss's gradient on the stage output (attach)
        elif getattr(rec.config, "output_router_logits", False):
            queue_aux_loss(aux)
        holder = layers[0] if layers else next((b.shardwise_moe for b in self.blocks), None)
        if holder is not None:  # metrics: one aux value per micro-batch (take_moe_stats sums the stages)
            holder.window_aux = holder.window_aux + aux.detach()
            holder.window_calls += 1


def _rows(hidden: torch.Tensor) -> int:
    """Tokens of a micro-batch from its hidden states (global shape under sequence parallel)."""
    return int(hidden.shape[0] * hidden.shape[1])


def stage_routing(src_hf: nn.Module, layers: list[nn.Module], last: bool) -> StageRouting | None:
    """The routing carry of a stage holding ``layers`` of an HF MoE model; None for a dense model."""
    recorder = getattr(src_hf, "shardwise_moe_recorder", None)
    if recorder is None:
        return None
    blocks = [m for layer in layers for m in layer.modules() if getattr(m, "shardwise_moe", None) is not None]
    return StageRouting(recorder, blocks, last)


def _shape_only(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """An MoE block's stand-in during stage metadata inference: its output's shape, no router or experts."""
    return hidden_states * 0


def mute_hf_moe_inference(stages: list[Any]) -> None:
    """Run torch's stage metadata inference of HF MoE stages with the MoE blocks skipped and no
    routing counted (module docstring). Stages of other models are left as they are."""
    for stage in stages:
        module = getattr(stage.submod, "module", stage.submod)  # DDP wraps; FSDP2 is in place
        routing = getattr(module, "moe_routing", None)
        infer = getattr(stage, "_forward_metadata_inference", None)
        if routing is None or infer is None:
            continue
        stage._forward_metadata_inference = _muted(infer, routing)


def _muted(infer: Any, routing: StageRouting) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        routing.inferring = True
        for block in routing.blocks:
            block.forward = _shape_only  # an instance attribute: the class is untouched
        try:
            return infer(*args, **kwargs)
        finally:
            routing.inferring = False
            routing.recorder.seen = []
            for block in routing.blocks:
                del block.forward

    return run
