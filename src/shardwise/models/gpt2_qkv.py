"""GPT-2's fused q/k/v projection and its split form: the module and the one mapping of names.

GPT-2's attention fuses q, k and v into one ``c_attn`` (transformers' ``Conv1D``, weight ``(in,
out)``) whose output is ``[q | k | v]``. Tensor parallel replaces it, from outside the model, by a
``SplitQKV`` of three ``Conv1D`` (``c_attn.q``, ``.k``, ``.v``; ``parallel/tensor/gpt2.py`` makes the
split and shards it). Pretrained files, transformers, PEFT and shardwise's checkpoints all keep the
fused ``c_attn.weight``/``c_attn.bias`` (``c_attn.base_layer.weight`` and
``c_attn.lora_B.<adapter>.weight`` under LoRA), so every reader of a split model's state asks here
which slice of the fused tensor a part is (``fused_sources``, ``fused_dim``, ``split_names``): meta
init, pretrained loading, the optimizer, the checkpoints (``runtime/checkpoint/state.py`` fuses and
cuts the state dicts), verify and the Hugging Face export. No process group and no sharding here.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["PARTS", "FusedSlice", "SplitQKV", "fuse_shapes", "fuse_split_state", "fused_dim", "fused_sources",
           "has_split_qkv", "split_names"]

PARTS = ("q", "k", "v")

class SplitQKV(nn.Module):
    """GPT-2's fused ``c_attn`` as three ``Conv1D`` (q, k, v); the output is ``[q | k | v]`` as before.

    Also a LoRA ``B`` of ``c_attn`` as three ``nn.Linear`` (its q, k and v rows).
    """

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module) -> None:
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)], dim=-1)

class FusedSlice(NamedTuple):
    """Where a split part's tensor lives in the fused one: ``source[start:start + length]`` along ``dim``."""

    source: str
    start: int
    length: int
    dim: int

def fused_dim(name: str) -> int:
    """The dim along which the q/k/v parts of the fused tensor (or optimizer entry) ``name`` are cut:
    the output features, last in a Conv1D weight and first in a LoRA ``B`` (an ``nn.Linear``)."""
    return 0 if ".lora_B." in name else -1

def fused_sources(model: nn.Module) -> dict[str, FusedSlice]:
    """{name of a split part's tensor: its ``FusedSlice`` of the fused tensor}.

    E.g. ``...attn.c_attn.k.weight`` -> (``...attn.c_attn.weight``, C, C, -1) and, under LoRA,
    ``...attn.c_attn.lora_B.default.k.weight`` -> (``...attn.c_attn.lora_B.default.weight``, C, C, 0).
    Empty for a model ``split_qkv`` never touched.
    """
    out: dict[str, FusedSlice] = {}
    for name, module in model.named_modules():
        if not isinstance(module, SplitQKV):
            continue
        for i, part in enumerate(PARTS):
            layer = getattr(module, part)
            linear = isinstance(layer, nn.Linear)
            width = layer.out_features if linear else layer.nf
            for tensor in ("weight", "bias"):
                if getattr(layer, tensor, None) is None:
                    continue
                dim = 0 if linear or tensor == "bias" else -1
                out[f"{name}.{part}.{tensor}"] = FusedSlice(f"{name}.{tensor}", i * width, width, dim)
    return out

def fuse_split_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (full tensors by name) with every q/k/v triple of a ``SplitQKV`` (``split_names``)
    concatenated back into the fused tensor: the names and layout of the model before ``split_qkv``."""
    groups = split_names(state)
    first = {parts[0]: fused for fused, parts in groups.items()}
    rest = {p for parts in groups.values() for p in parts[1:]}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in first:
            fused = first[name]
            out[fused] = torch.cat([state[p] for p in groups[fused]], dim=fused_dim(fused))
        elif name not in rest:
            out[name] = tensor
    return out

# ------------------------------------------------------------------------------ checkpoint names
# A checkpoint holds the fused ``c_attn`` whatever the layout (as the pretrained files do), so one
# saved under TP resumes without it and back, and export/reshard see one format. The model and
# optimizer state dicts of a split model are mapped by ``runtime/checkpoint/state.py``: their q/k/v
# entries concatenated into the fused name on save, the fused entry cut back into the parts on load.
# ``c_attn.q.weight``; under LoRA ``c_attn.base_layer.q.weight`` and ``c_attn.lora_B.<adapter>.q.weight``.
_PART_NAME = re.compile(r"(?:^|\.)c_attn\.(?:base_layer\.|lora_B\.[^.]+\.)?([qkv])\.(?:weight|bias)(?=\.|$)")

def has_split_qkv(model: nn.Module) -> bool:
    """Whether ``split_qkv`` replaced a ``c_attn`` of ``model``."""
    return any(isinstance(m, SplitQKV) for m in model.modules())

def split_names(names: Any) -> dict[str, list[str]]:
    """{fused name: [its q, k, v names]} for the names among ``names`` that are q/k/v parts of a
    ``SplitQKV`` (all three present); model keys (``X.c_attn.q.weight``) and flattened optimizer
    keys (``state.X.c_attn.q.weight.exp_avg``, ``param_groups.X.c_attn.q.weight.lr``) alike."""
    present = set(names)
    groups: dict[str, list[str]] = {}
    for name in present:
        m = _PART_NAME.search(name)
        if m is None or m.group(1) != PARTS[0]:
            continue
        fused = name[:m.start(1)] + name[m.end(1) + 1:]
        parts = [name[:m.start(1)] + p + name[m.end(1):] for p in PARTS]
        if all(p in present for p in parts):
            groups[fused] = parts
    return groups

def fuse_shapes(shapes: dict[str, list]) -> dict[str, list]:
    """A checkpoint manifest's ``{name: [shape, dtype]}`` with q/k/v slices (``split_names``) as the
    fused tensor: what a checkpoint saved with the slices holds, under the unsplit model's names."""
    groups = split_names(shapes)
    rest = {p for parts in groups.values() for p in parts}
    out = {name: spec for name, spec in shapes.items() if name not in rest}
    for fused, parts in groups.items():
        shape, dtype = shapes[parts[0]]
        dim = fused_dim(fused) % len(shape)
        out[fused] = [[sum(shapes[p][0][dim] for p in parts) if d == dim else size for d, size in enumerate(shape)],
                      dtype]
    return out
