"""Chunked cross-entropy: the output projection and the loss over slices of the tokens.

A language model's last step turns ``[tokens, hidden]`` into ``[tokens, vocab]`` logits and the
loss reads them once. At a 128k vocabulary and 8k tokens those logits are 4 GiB in fp32 per
sequence, plus as much again for their gradient: often the largest tensor of the whole step.
Here the head's matrix product and the cross-entropy run together over ``chunk`` tokens at a
time, forward and backward (the backward recomputes each chunk's logits instead of keeping
them), so at most one chunk of logits exists at any moment. The loss and gradients are the same
numbers as ``F.cross_entropy(head(h).float(), targets)`` (the same softmax per token; only the
order of the head gradient's sums over tokens differs).

How it reaches a model without the model knowing: ``install_chunked_head`` gives the output head
(the built-in GPT's ``lm_head``, a Hugging Face causal LM's output embedding) a forward that,
inside ``token_loss_context``, returns each token's loss instead of its logits; outside it (text
generation, a user's own loss) the head is the plain ``nn.Linear`` it was. The head's weight is
used inside the head's own forward, so FSDP2's all-gather and reduce-scatter around it work as
for the dense head, whether the head is its own FSDP unit or part of the root's.

``train.loss_chunks``: ``0`` off, ``auto`` on when the logits would be larger than the hidden
states (vocabulary > 4 x hidden) and a micro-batch's whole fp32 logits would exceed
``AUTO_DENSE_LOGITS_BYTES`` (2 GiB; decided per call, by the tokens the head sees: a smaller
micro-batch gets the plain head and loss, which is faster), in chunks of at most
``AUTO_CHUNK_BYTES`` of fp32 logits; ``N`` splits every micro-batch's tokens into N chunks. It
applies to the token-mean cross-entropy (``workloads.cross_entropy_loss``); any other loss function
sees the ordinary logits.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.core.config import (  # the rules live with the setting
    AUTO_CHUNK_BYTES,
    AUTO_DENSE_LOGITS_BYTES,
    auto_chunks_logits,
    parse_loss_chunks,
)
from shardwise.core.families import CHUNKED_HEAD_FAMILIES
from shardwise.errors import ConfigError
from shardwise.parallel.blocks import model_family
from shardwise.workloads import cross_entropy_loss

__all__ = ["AUTO_CHUNK_BYTES", "AUTO_DENSE_LOGITS_BYTES", "ChunkPlan", "chunked_cross_entropy", "install_chunked_head",
           "is_token_ce", "plan_chunked_head",
           "parse_loss_chunks", "token_loss_context"]

# auto: each chunk's fp32 logits at most this many bytes (64 MiB: 4k tokens at a 4k vocabulary,
# 128 tokens at 128k). Small enough to be noise beside the activations, large enough that the
# head's matmuls stay efficient.
IGNORE_INDEX = -100  # F.cross_entropy's default, which workloads.cross_entropy_loss uses

# The targets of the micro-batch being run, set by token_loss_context around the model's forward.
_TARGETS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("shardwise_loss_targets",
                                                                               default=None)


# --------------------------------------------------------------------------- the autograd function


class _ChunkedCE(torch.autograd.Function):
    """Per-token cross-entropy of ``hidden @ weight.T`` computed ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        device_type = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        # fp32 at least, as workloads.cross_entropy_loss (logits.float()); fp64 stays fp64.
        acc = torch.promote_types(hidden.dtype, torch.float32)
        losses = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        lse = torch.empty_like(losses)
        for start in range(0, hidden.shape[0], chunk):
            logits = (hidden[start:start + chunk] @ weight.t()).to(acc)
            t = targets[start:start + chunk]
            chunk_lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            lse[start:start + chunk] = chunk_lse
            losses[start:start + chunk] = torch.where(t == IGNORE_INDEX, 0.0, chunk_lse - picked)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if want_w else None
        # The forward's matmuls ran under the caller's autocast; the recomputation must match.
        with torch.autocast(hidden.device.type, dtype=dtype, enabled=enabled):
            for start in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[start:start + ctx.chunk]
                t = targets[start:start + ctx.chunk]
                logits = (h @ weight.t()).to(lse.dtype)
                # d loss_i / d logits_i = softmax_i - onehot(target_i), scaled by the incoming grad.
                d_logits = torch.exp(logits - lse[start:start + ctx.chunk].unsqueeze(1))
                keep = (t != IGNORE_INDEX).to(d_logits.dtype)  # no boolean indexing: no host sync
                d_logits.scatter_add_(1, t.clamp(min=0).unsqueeze(1), -keep.unsqueeze(1))
                d_logits *= (grad_losses[start:start + ctx.chunk] * keep).unsqueeze(1)
                d_logits = d_logits.to(h.dtype)
                if want_h:
                    grad_h[start:start + ctx.chunk] = d_logits @ weight  # type: ignore[index]
                if want_w:
                    grad_w += (d_logits.t() @ h).to(lse.dtype)  # type: ignore[operator]
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int) -> torch.Tensor:
    """Per-token losses ``F.cross_entropy(hidden @ weight.T, targets, reduction='none')`` in chunks.

    ``hidden``: ``[..., D]``; ``weight``: ``[V, D]``; ``targets``: ``hidden.shape[:-1]`` ids
    (-100 ignored: loss 0, no gradient). Returns fp32 (fp64 for fp64 inputs) losses of shape ``targets.shape``; at most
    ``chunk`` tokens' logits exist at once, forward and backward.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = _ChunkedCE.apply(flat, weight, targets.reshape(-1), chunk)
    return out.view(targets.shape)


# --------------------------------------------------------------------------- the model's head


@dataclass
class ChunkPlan:
    """What ``install_chunked_head`` decided: ``chunks`` (0: N by size), ``reason`` when off."""

    enabled: bool
    chunks: int | None  # None: auto size (AUTO_CHUNK_BYTES per chunk)
    reason: str = ""

    def chunk_tokens(self, tokens: int, vocab: int) -> int:
        if self.chunks:
            return max(1, math.ceil(tokens / self.chunks))
        return max(1, AUTO_CHUNK_BYTES // (4 * vocab))


def output_head(model: nn.Module) -> nn.Linear | None:
    """The output projection of the built-in GPT or a Hugging Face causal LM (None if neither)."""
    head = getattr(model, "lm_head", None)
    if head is None and hasattr(model, "hf") and hasattr(model.hf, "get_output_embeddings"):
        head = model.hf.get_output_embeddings()
    return head if isinstance(head, nn.Linear) else None


# The families whose head the chunks may replace: families.CHUNKED_HEAD_FAMILIES (the planner asks too).
_PLAIN_HEAD_FAMILIES = CHUNKED_HEAD_FAMILIES


def plan_chunked_head(model: nn.Module, setting: Any, *, tp: int = 1, pp: int = 1,
                      plain_ce: bool = True) -> ChunkPlan:
    """Whether ``model``'s head would be chunked under ``train.loss_chunks = setting``; changes nothing.

    ConfigError when chunks are asked for explicitly where they cannot run; 'auto' quietly stays
    off there (the plan's ``reason`` says why). Preflight calls it on the meta model before launch.
    ``plain_ce``: the run's loss is the token-mean CE (``Workload.plain_token_ce``).
    """
    chunks = parse_loss_chunks(setting)
    if chunks == 0:
        return ChunkPlan(False, 0, "train.loss_chunks = 0")
    head = output_head(model)
    family = model_family(model) if head is not None else ""
    why = ""
    if not plain_ce:
        why = ("the run's loss is not the plain token-mean cross-entropy (records' response-only token sum, "
               "packed documents, or an MoE aux loss)")
    elif head is None or family not in _PLAIN_HEAD_FAMILIES:
        why = (f"the model ({family or type(model).__name__}) has no plain output head the chunked loss knows "
               f"(the built-in GPT and Hugging Face {', '.join(_PLAIN_HEAD_FAMILIES[1:])})")
    elif head.bias is not None:
        why = "the output head has a bias"
    elif tp > 1:
        # The tensor-parallel head is vocabulary-parallel already: each rank's logits are
        # vocab / tp wide and loss_parallel never gathers them, so chunking would save 1/tp as much.
        why = "tensor parallel already splits the logits over the vocabulary (loss_parallel)"
    elif pp > 1:
        why = "pipeline parallel computes the loss inside its schedule, per microbatch"
    if why:
        if chunks is None:
            return ChunkPlan(False, None, why)
        raise ConfigError(f"train.loss_chunks = {chunks} cannot run here: {why}. Set train.loss_chunks = 0 "
                          "or 'auto' (which turns it on only where it runs).")
    if chunks is None and head.out_features <= 4 * head.in_features:
        return ChunkPlan(False, None, f"the vocabulary ({head.out_features}) is small beside the hidden size "
                                      f"({head.in_features}): the logits are not the largest tensor")
    return ChunkPlan(True, chunks)


def install_chunked_head(model: nn.Module, setting: Any, *, tp: int = 1, pp: int = 1) -> ChunkPlan:
    """Make ``model``'s output head able to return per-token losses (see module docstring)."""
    plan = plan_chunked_head(model, setting, tp=tp, pp=pp)
    if not plan.enabled:
        return plan
    head = output_head(model)
    assert head is not None
    dense = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        targets = _TARGETS.get()
        if targets is None:
            return dense(hidden)
        tokens = targets.numel()
        if plan.chunks is None and not auto_chunks_logits(tokens, head.out_features):
            return dense(hidden)  # logits, not per-token losses: token_loss_context's function sees which
        return chunked_cross_entropy(hidden, head.weight, targets,
                                     plan.chunk_tokens(tokens, head.out_features))

    head.forward = forward  # type: ignore[method-assign]  # instance attribute: the class is untouched
    head._shardwise_chunked = plan  # type: ignore[attr-defined]
    return plan


def _has_chunked_head(model: nn.Module) -> bool:
    return any(getattr(m, "_shardwise_chunked", None) is not None for m in model.modules())


def is_token_ce(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` is the token-mean cross-entropy (possibly compiled) the chunks replace."""
    return loss_fn is cross_entropy_loss or getattr(loss_fn, "_torchdynamo_orig_callable", None) is cross_entropy_loss


def _token_mean(token_losses: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # F.cross_entropy's mean: over the tokens that are not ignored.
    return token_losses.sum() / (targets != IGNORE_INDEX).sum()


@contextlib.contextmanager
def token_loss_context(model: nn.Module, loss_fn: Callable[..., Any],
                       targets: torch.Tensor) -> Iterator[Callable[..., Any]]:
    """Yield the loss function to call on ``model(inputs)``: the chunked head's when it applies.

    Inside, a chunked head returns per-token losses for ``targets`` and the yielded function takes
    their token mean -- or, where ``auto`` left a small micro-batch whole, the logits, which it hands
    to ``loss_fn``; otherwise ``loss_fn`` comes back unchanged and nothing is set.
    """
    if not (is_token_ce(loss_fn) and _has_chunked_head(model)):
        yield loss_fn
        return

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Per-token losses have the targets' shape; logits have one more (vocabulary) dimension.
        if output.dim() > targets.dim():
            return loss_fn(output, targets)
        return _token_mean(output, targets)

    token = _TARGETS.set(targets)
    try:
        yield loss
    finally:
        _TARGETS.reset(token)
