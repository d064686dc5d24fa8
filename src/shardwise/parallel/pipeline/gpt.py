"""Pipeline stages of shardwise's own GPT (``models/gpt.py``), which is built for this.

Its blocks live in an ``nn.ModuleDict`` keyed "0".."n-1" and ``tok_emb``/``pos_emb``/``ln_f``/
``lm_head`` may be ``None``: a rank keeps one GPT with every part it does not own deleted (its
union), and each local stage is a light view of that union holding only the stage's own parts.
The pipeline asks through ``parallel/adapters.py``; the Hugging Face families have theirs in
``hf.py`` and ``gpt2.py``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def n_gpt_blocks(model: nn.Module) -> int:
    """The number of blocks the pipeline splits into stages."""
    return len(model.blocks)


def check_gpt_pp_model(model: nn.Module) -> None:
    """Nothing to refuse: every built-in GPT can be cut into stages (the layout checks the count)."""


def prune_gpt_to_stages(model: nn.Module, stage_ids: list[int], ranges: list[range]) -> nn.Module:
    """Delete from ``model`` (in place) every part no local stage owns; return it (the union)."""
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


def gpt_stage(union: nn.Module, stage: int, ranges: list[range]) -> nn.Module:
    """Return a GPT holding only stage ``stage``'s parts, sharing its modules with ``union``.

    A fresh module (not a copy) so that wrappers (DDP, FSDP) and hooks put on a stage never
    leak onto the union; attribute order matches GPT so the stage's FQNs are the union's.
    """
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
    _keyword_inputs(view)
    return view


def _keyword_inputs(view: nn.Module) -> None:
    """Let a GPT stage take its side inputs by keyword, as the schedule passes them (module docstring).

    The GPT reads them from its input mapping; a stage after the first gets hidden states as the
    mapping's ``input_ids`` (its forward uses them as such when it has no embedding)."""
    forward = view.forward

    @functools.wraps(forward)
    def keyword_forward(x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        return forward({"input_ids": x, **extra} if extra else x)

    view.forward = keyword_forward
