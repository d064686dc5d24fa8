"""Model inputs beyond token ids, and the attention masks they imply (one owner for both models).

A batch's inputs are either a ``(B, T)`` tensor of token ids or a mapping with these keys
(what ``shardwise.data.instruct`` and packed text data produce; a user's own loop may build them):

* ``input_ids`` ``(B, T)`` int64: the token ids (always present).
* ``position_ids`` ``(B, T)`` int64: each token's position inside its own document, restarting at
  0 where a document starts (packed rows). Absent: ``0..T-1``.
* ``doc_ids`` ``(B, T)`` int64: which document of its row each token belongs to (0, 1, 2, ...);
  ``-1`` marks padding at the end of a row. A token attends only to earlier tokens of the same
  document. Absent: one document per row.
* ``attention_mask`` ``(B, T)`` 0/1: Hugging Face's padding mask (1 = a real token) for rows that
  hold one record each, right-padded. Absent: every token is real.
* ``real_tokens`` ``(B, T)`` bool: which tokens are real, for the mixture-of-experts routers' load
  balancing (``real_token_mask``) where neither key above is given; it implies no attention mask.
  Under context parallel the Session adds it to an MoE model's chunks only.

Under context parallel, ``shardwise.parallel.context.cp.chunk_batch`` builds the whole sequence's mask with
``attention_mask_4d`` from these keys before the sequence is cut; the model gets its chunk of
``input_ids`` and ``position_ids``, and of ``real_tokens`` where the batch has padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

INPUT_KEYS = ("input_ids", "position_ids", "doc_ids", "attention_mask", "real_tokens")


def split_inputs(inputs: torch.Tensor | Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(token ids, the other input tensors) of a batch's inputs; ValueError for unknown keys."""
    if isinstance(inputs, torch.Tensor):
        return inputs, {}
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise ValueError(f"model inputs must be a (B, T) tensor of token ids or a mapping with 'input_ids' "
                         f"(and optionally {', '.join(INPUT_KEYS[1:])}); got {type(inputs).__name__}")
    unknown = sorted(set(inputs) - set(INPUT_KEYS))
    if unknown:
        raise ValueError(f"unknown model input key(s) {', '.join(map(repr, unknown))}; allowed: "
                         f"{', '.join(INPUT_KEYS)}")
    return inputs["input_ids"], {k: v for k, v in inputs.items() if k != "input_ids" and v is not None}


def attention_mask_4d(extra: Mapping[str, torch.Tensor], window: int | None = None) -> torch.Tensor | None:
    """The ``(B, 1, T, T)`` boolean mask (True = may attend) of causal attention within documents and
    over real tokens, or None when plain causal attention is exact (no doc ids, no padding mask).
    ``window``: a sliding-window layer's window (a query sees its last ``window`` keys, itself
    included), as transformers' sliding-window masks; an explicit 4-D mask replaces theirs.

    ``T`` is the side inputs' own length, the whole sequence: the hidden states a module holds may
    be a part of it (a pipeline stage's input under sequence parallel is a sequence shard)."""
    doc_ids, pad = extra.get("doc_ids"), extra.get("attention_mask")
    if doc_ids is None and pad is None:
        return None
    ref = doc_ids if doc_ids is not None else pad
    seq, device = ref.shape[-1], ref.device
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if window:
        causal = causal & ~torch.ones(seq, seq, dtype=torch.bool, device=device).tril(-window)
    mask = causal[None, None]
    if doc_ids is not None:
        mask = mask & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    if pad is not None:
        # Keys that are padding are hidden; a padding query still sees itself (no empty row -> no NaN).
        keys = pad.bool()[:, None, None, :]
        mask = mask & (keys | torch.eye(seq, dtype=torch.bool, device=device)[None, None])
    return mask


def layer_kind(config: Any, index: int) -> str:
    """'full_attention' or 'sliding_attention' for layer ``index`` of a transformers config, as the
    HF model decides it (``layer_types`` where the config lists them: qwen2/qwen3; Mistral and
    Mixtral slide every layer when they have a ``sliding_window``)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return str(layer_types[index])
    if getattr(config, "model_type", "") in ("mistral", "mixtral") and getattr(config, "sliding_window", None):
        return "sliding_attention"
    return "full_attention"


def hf_document_masks(config: Any, extra: Mapping[str, torch.Tensor]) -> Any:
    """What a transformers model takes as ``attention_mask`` for a packed batch: the 4-D document mask,
    or, where layers slide, a ``{kind: mask}`` mapping (transformers 5 takes one; Mistral, whose
    layers all slide, takes the windowed mask itself). An explicit 4-D mask replaces the model's
    own masks, so the window must be in it."""
    mask = attention_mask_4d(extra)
    n_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    kinds = {layer_kind(config, i) for i in range(n_layers)}
    if "sliding_attention" not in kinds:
        return mask
    windowed = attention_mask_4d(extra, int(config.sliding_window))
    if kinds == {"sliding_attention"}:
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}


def real_token_mask(extra: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The ``(B, T)`` boolean mask of real (non-padding) tokens from a batch's side inputs, or None
    when every token is real: ``doc_ids >= 0``, else the 2-D ``attention_mask``, else ``real_tokens``
    (a cp rank's chunk). (A mixture-of-experts router balances over the real tokens only,
    ``models/moe.py``.)"""
    if "doc_ids" in extra:
        return extra["doc_ids"] >= 0
    if "attention_mask" in extra:
        return extra["attention_mask"].bool()
    if "real_tokens" in extra:
        return extra["real_tokens"].bool()
    return None


def real_token_count(inputs: torch.Tensor | Mapping[str, Any]) -> int:
    """How many tokens of a batch are real (not padding): what tokens/s and MFU count."""
    ids, extra = split_inputs(inputs)
    real = real_token_mask(extra)
    return ids.numel() if real is None else int(real.sum())
