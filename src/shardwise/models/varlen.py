"""Packed batches without the dense document mask: variable-length attention for Hugging Face models.

The mask path (``models.masking.attention_mask_4d``, the default) hands transformers a ``(B, 1, T, T)``
boolean mask: exact everywhere, but O(T^2) memory per row and, on CPU, SDPA's slow masked kernel.
This path cuts each packed row into its documents instead and attends within each one:

* ``cu_seqlens``: the documents as cumulative offsets into the flattened ``(B * T)`` tokens (a new
  sequence at every row start and wherever the doc id changes; a row's padding tail is one more
  sequence, whose outputs no label reads), and the longest one. Pure, testable anywhere.
* ``varlen_attention``: a transformers attention function (registered as ``"shardwise_varlen"`` in
  ``AttentionInterface``). With ``cu_seq_lens_q`` among its keyword inputs it runs

  - on CUDA, fp16/bf16, where torch has it: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention
    varlen kernel; causal, GQA and sliding windows in the kernel; no attention dropout);
  - anywhere else (CPU, fp32, an older torch, attention dropout in training): one causal SDPA call
    per document. Exact, and its memory is the sum of the documents' squares, not the row's.

  Without ``cu_seq_lens_q`` (a padded or plain batch) it is transformers' own ``sdpa`` attention,
  with the mask transformers builds for it (the same mask functions as ``sdpa``).

``enable(model)`` switches an ``HFCausalLM`` to it (``HFCausalLM.forward``, and each pipeline stage
for its microbatch, ``parallel.pipeline.hf.varlen_kwargs``, then pass the documents' ``cu_seqlens``
instead of the 4-D mask); ``kernel(...)`` says which kernel a batch gets. Context parallelism keeps
the mask path (its all-to-all attention takes the whole sequence's mask).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

from shardwise.errors import ConfigError

NAME = "shardwise_varlen"
_registered = False


def cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` of the documents of ``(B, T)`` doc ids (``-1`` = padding) in the
    flattened ``B * T`` tokens: int32 offsets ``[0, end_1, ..., B * T]`` and the longest document."""
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must be (batch, seq), got shape {tuple(doc_ids.shape)}")
    b, t = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return _from_starts(starts, b * t)


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The same from ``(B, T)`` positions that restart at 0 in every document (what flash-attention
    style packing reads): a sequence starts at every row start and every position 0."""
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (batch, seq), got shape {tuple(position_ids.shape)}")
    starts = position_ids == 0
    starts[:, 0] = True
    return _from_starts(starts, position_ids.numel())


def _from_starts(starts: torch.Tensor, total: int) -> tuple[torch.Tensor, int]:
    first = starts.reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([first, torch.tensor([total], device=first.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0


def varlen_kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's FlashAttention varlen kernel runs for tensors on ``device`` of ``dtype``."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.9)
    except ImportError:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8  # FlashAttention 2: Ampere or newer


def kernel(device: torch.device, dtype: torch.dtype, dropout: float = 0.0) -> str:
    """``"varlen_attn"`` (the CUDA kernel) or ``"per-document sdpa"`` for a batch's attention."""
    return "varlen_attn" if varlen_kernel_available(device, dtype) and dropout == 0.0 else "per-document sdpa"


@functools.cache
def _kernel_takes_gqa(kernel: Callable[..., Any]) -> bool:
    """Whether torch's ``varlen_attn`` has ``enable_gqa`` (2.13 does, 2.11 does not); asked once per kernel,
    not in every layer's forward."""
    return "enable_gqa" in inspect.signature(kernel).parameters


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: ``query`` ``(B, Hq, T, D)``, ``key``/``value`` ``(B, Hkv, T, D)``
    -> ``(B, T, Hq, D)``. Packed documents when ``kwargs`` holds ``cu_seq_lens_q`` (module docstring)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # defers transformers (optional)

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    max_len = int(kwargs.get("max_length_q") or 0)
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    # (B, H, T, D) -> (B * T, H, D): the documents are consecutive runs of the flattened tokens.
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    if kernel(query.device, query.dtype, dropout) == "varlen_attn":
        window = (sliding_window - 1, 0) if sliding_window else (-1, 0)
        gqa: dict[str, bool] = {}
        if hq != hkv and _kernel_takes_gqa(varlen_attn):
            gqa["enable_gqa"] = True
        elif hq != hkv:  # torch 2.11's kernel has no grouped-query heads: each kv head serves hq // hkv
            k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=window, **gqa)
        return out.reshape(b, t, hq, d), None
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        # (L, H, D) -> (1, H, L, D): one document, causal within itself.
        qd, kd, vd = (x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        n = hi - lo
        mask = None
        if sliding_window and n > sliding_window:
            i = torch.arange(n, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < sliding_window)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=dropout, scale=scaling, enable_gqa=hq != hkv)
        out[lo:hi] = o.squeeze(0).transpose(0, 1)
    return out.reshape(b, t, hq, d), None


def register() -> None:
    """Register ``varlen_attention`` (and ``sdpa``'s mask functions for its plain batches) with transformers."""
    global _registered
    if _registered:
        return
    # defers transformers (optional)
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _registered = True


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Switch an ``HFCausalLM`` (before or after it is wrapped) to variable-length attention for packed
    batches; return it. ConfigError for a model that is not a transformers one."""
    hf = getattr(model, "hf", None)
    config = getattr(hf, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ConfigError("variable-length attention (model.attention = 'varlen') is for Hugging Face models "
                          "(model.kind = 'hf'); the built-in GPT takes packed batches through its own mask.")
    register()
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation(NAME)
    else:  # transformers 4.x
        config._attn_implementation = NAME
    return model


def with_varlen(build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """A model factory whose models use variable-length attention (``model.attention = "varlen"``)."""
    def build_varlen() -> torch.nn.Module:
        return enable(build())

    return build_varlen


def enabled(hf: torch.nn.Module) -> bool:
    return getattr(getattr(hf, "config", None), "_attn_implementation", None) == NAME
