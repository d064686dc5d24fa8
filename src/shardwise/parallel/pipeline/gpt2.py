"""Pipeline stages for Hugging Face GPT-2-family models (``GPT2LMHeadModel`` as ``HFCausalLM``).

The same rules as the Llama family's (``parallel/pipeline/hf.py``), on GPT-2's layout
(``hf.transformer.{wte, wpe, drop, h, ln_f}`` and ``hf.lm_head``):

* the blocks move from the ``nn.ModuleList`` ``transformer.h`` into an ``nn.ModuleDict`` keyed by
  their original index, so every parameter keeps its single-device name
  (``hf.transformer.h.3.attn.c_attn.weight``); parts no local stage owns are set to ``None``;
* the first stage holds the token and the learned position embeddings (``wte``, ``wpe``) and adds
  them at the microbatch's ``position_ids`` (restarting per packed document), as
  ``GPT2Model.forward`` does; every stage builds the mask its blocks need from the microbatch's
  ``doc_ids`` / ``attention_mask`` (the schedule's keyword inputs, as for the Llama family; plain
  causal attention and positions without them); the last stage holds ``ln_f`` and ``lm_head`` and
  returns logits. Nothing but one activation tensor crosses a stage boundary;
* GPT-2 ties ``lm_head`` to ``wte``: the two stages keep one copy each, summed gradients keep them
  equal (``parallel/pipeline/ties.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.pretrained import load_pretrained
from shardwise.parallel.pipeline.hf import _build_mask, stage_attention_mask, stage_hf, stage_input, varlen_kwargs

__all__ = ["GPT2Stage", "check_gpt2_pp_model", "prune_gpt2_to_stages"]


def _n_layer(model: nn.Module) -> int:
    return int(model.hf.config.n_layer)  # type: ignore[union-attr]


def check_gpt2_pp_model(model: nn.Module) -> None:
    """Raise ConfigError when a GPT-2 model cannot be cut into stages (its blocks not where built)."""
    blocks = model.hf.transformer.h  # type: ignore[union-attr]
    if not isinstance(blocks, nn.ModuleList) or len(blocks) != _n_layer(model):
        raise ConfigError(
            f"pipeline parallel expects the model's {_n_layer(model)} GPT-2 blocks in hf.transformer.h; found "
            f"{type(blocks).__name__} of {len(blocks)}. Pass the model as build_hf_model returns it.")
    if getattr(model.hf.config, "add_cross_attention", False):  # type: ignore[union-attr]
        raise ConfigError("pipeline parallel cuts decoder-only GPT-2 models; this config adds cross-attention "
                          "(add_cross_attention = true), whose encoder states no stage would receive.")


def prune_gpt2_to_stages(model: nn.Module, stage_ids: list[int], ranges: list[range]) -> nn.Module:
    """Delete (in place) every part of ``model`` that no local stage owns; return it (the union)."""
    inner = model.hf.transformer  # type: ignore[union-attr]
    owned = sorted(i for s in stage_ids for i in ranges[s])
    blocks = inner.h
    inner.h = nn.ModuleDict({str(i): blocks[i] for i in owned})
    if 0 not in stage_ids:
        inner.wte = None
        inner.wpe = None
    if len(ranges) - 1 not in stage_ids:
        inner.ln_f = None
        model.hf.lm_head = None  # type: ignore[union-attr]
    return model


class GPT2Stage(nn.Module):
    """One pipeline stage of a GPT-2 ``HFCausalLM``: token ids or hidden states in, hidden states or
    logits out. Shares its modules with the union under the same names, like ``pipeline.hf.HFStage``."""

    def __init__(self, union: nn.Module, stage: int, ranges: list[range]) -> None:
        super().__init__()
        self.first = stage == 0
        self.last = stage == len(ranges) - 1
        src_hf, src = union.hf, union.hf.transformer  # type: ignore[union-attr]
        transformer = nn.Module()
        transformer.wte = src.wte if self.first else None
        transformer.wpe = src.wpe if self.first else None
        transformer.drop = src.drop
        transformer.h = nn.ModuleDict({str(i): src.h[str(i)] for i in ranges[stage]})
        transformer.ln_f = src.ln_f if self.last else None
        self.hf = stage_hf(src_hf, "transformer", transformer, self.last)
        self.pretrained = getattr(union, "pretrained", None)
        self._sp_mesh: Any = None

    def set_sequence_parallel(self, tp_mesh: Any) -> None:
        """As ``HFStage.set_sequence_parallel``: the sequence shard crosses the boundary as a plain tensor."""
        self._sp_mesh = tp_mesh

    def load_pretrained(self) -> None:
        """Read this stage's tensors (only those) from the pretrained folder; collective like DCP."""
        if self.pretrained is not None:
            load_pretrained(self.hf, self.pretrained)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: token ids (first stage) or hidden states; the keywords are the microbatch's side inputs
        of a packed or padded batch (``models.masking``), which the schedule hands every stage.

        As ``GPT2Model.forward`` for the same batch (what ``HFCausalLM.forward`` hands it): the first
        stage adds the learned position embeddings at ``position_ids`` (restarting at 0 in every packed
        document), and every stage builds the same mask from the doc ids / padding mask."""
        model, config = self.hf.transformer, self.hf.config
        hidden = x if self.first else stage_input(x, self._sp_mesh, position_ids, doc_ids, attention_mask)
        seq = hidden.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)  # the global length
        if self.first:
            hidden = model.drop(model.wte(x) + model.wpe(position_ids))
        packed = varlen_kwargs(self.hf, doc_ids)  # variable-length attention: cu_seqlens, no mask
        mask = None if packed else _build_mask("full_attention", config, hidden, position_ids,
                                               stage_attention_mask(doc_ids, attention_mask))
        for block in model.h.values():
            out = block(hidden, attention_mask=mask, use_cache=False, position_ids=position_ids, **packed)
            hidden = out[0] if isinstance(out, tuple) else out  # transformers 4.x returns a tuple
        if self.last:
            return self.hf.lm_head(model.ln_f(hidden))
        if self._sp_mesh is not None:
            hidden = hidden.to_local().clone()  # as HFStage: a copy of the shard, not a view of the DTensor
        return hidden
