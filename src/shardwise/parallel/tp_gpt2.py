"""GPT-2 under tensor parallel: Conv1D-aware styles and the fused q/k/v projection split in three.

GPT-2 keeps its projections in transformers' ``Conv1D``, whose weight is ``(in, out)``: transposed
from ``nn.Linear``. A column split (the output features) is therefore ``Shard(1)`` of the weight and
a row split (the input features) ``Shard(0)``; the bias follows the output features.

Its attention fuses q, k and v into one ``c_attn`` whose output is ``[q | k | v]``. A column split of
that matrix would hand rank 0 all of q and half of k: each rank needs ``[q_r | k_r | v_r]``, which
is not one contiguous block. So, from outside the model, ``split_qkv`` replaces every ``c_attn`` by
a ``SplitQKV`` holding three ``Conv1D`` (``c_attn.q``, ``.k``, ``.v``), each split column-wise, whose
output is their concatenation (``[q_r | k_r | v_r]`` on each rank, ``[q | k | v]`` unsplit), and
sets the attention's ``split_size`` to the local width. The model code is untouched.

The three parts are slices of the tensor the pretrained files and transformers name
``c_attn.weight``/``c_attn.bias``; ``fused_sources`` says which slice, and meta init, pretrained
loading and the Hugging Face export ask it (one owner of the mapping).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.errors import ConfigError

__all__ = ["PARTS", "Conv1DColwise", "Conv1DRowwise", "SplitQKV", "fuse_split_state", "fused_sources", "split_qkv"]

PARTS = ("q", "k", "v")


def _is_conv1d(module: nn.Module) -> bool:
    # transformers' Conv1D (pytorch_utils); checked by name so this module imports without it.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _distribute(module: nn.Module, mesh: Any, placements: dict[str, Any], src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """``ColwiseParallel`` for a ``Conv1D``: weight ``Shard(1)`` (its output features), bias ``Shard(0)``.

    Conv1D's forward runs on DTensors (the input is made a replicated DTensor first), so its
    ``view`` to the global output width is right; the output leaves as the local column shard.
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        from functools import partial

        return distribute_module(
            module, device_mesh,
            lambda _n, m, mesh: _distribute(m, mesh, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """``RowwiseParallel`` for a ``Conv1D``: weight ``Shard(0)`` (its input features), bias replicated."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        from functools import partial

        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda _n, m, mesh: _distribute(m, mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class SplitQKV(nn.Module):
    """GPT-2's fused ``c_attn`` as three ``Conv1D`` (q, k, v); the output is ``[q | k | v]`` as before."""

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module) -> None:
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)], dim=-1)


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "c_attn") and hasattr(m, "split_size") and hasattr(m, "embed_dim")]


def split_qkv(model: nn.Module, tp: int) -> None:
    """Replace every GPT-2 attention's fused ``c_attn`` of ``model`` by a ``SplitQKV``, in place.

    Works on a meta model (the parts stay on meta; meta init fills them from the fused value) and
    on a real one (the parts get copies of their slices). ``split_size`` becomes the width one of
    ``tp`` ranks holds of each of q, k and v.
    """
    for name, attn in _attention_modules(model):
        if isinstance(attn.c_attn, SplitQKV):
            continue
        if getattr(attn, "is_cross_attention", False):
            raise ConfigError(f"tensor parallel does not split GPT-2 cross-attention ({name}); only decoder-only "
                              "GPT-2 language models are supported.")
        fused = attn.c_attn
        if not _is_conv1d(fused):
            raise ConfigError(f"{name}.c_attn is a {type(fused).__name__}, not GPT-2's Conv1D: tensor parallel "
                              "cannot split a wrapped (e.g. LoRA) fused q/k/v projection of GPT-2. Train LoRA on "
                              "GPT-2 with fsdp or ddp instead.")
        width = attn.embed_dim
        if fused.nf != 3 * width:
            raise ConfigError(f"{name}.c_attn has {fused.nf} output features, not 3 x {width}: not a GPT-2 attention.")
        parts = []
        for i in range(len(PARTS)):
            part = type(fused).__new__(type(fused))
            nn.Module.__init__(part)
            part.nf, part.nx = width, fused.nx
            rows = slice(i * width, (i + 1) * width)
            # Slices of the fused tensors (copies, so each part owns its storage); on meta, no data moves.
            part.weight = nn.Parameter(fused.weight.detach()[:, rows].clone(), requires_grad=fused.weight.requires_grad)
            part.bias = nn.Parameter(fused.bias.detach()[rows].clone(), requires_grad=fused.bias.requires_grad)
            parts.append(part)
        attn.c_attn = SplitQKV(*parts)
        attn.split_size = width // tp


def fused_sources(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """{name of a split part's tensor: (name of the fused tensor, start, length) along its last dim}.

    E.g. ``...attn.c_attn.k.weight`` -> (``...attn.c_attn.weight``, C, C). Empty for a model
    ``split_qkv`` never touched.
    """
    out: dict[str, tuple[str, int, int]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, SplitQKV):
            continue
        for i, part in enumerate(PARTS):
            for tensor in ("weight", "bias"):
                width = getattr(module, part).nf
                out[f"{name}.{part}.{tensor}"] = (f"{name}.{tensor}", i * width, width)
    return out


def fuse_split_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (full tensors by name) with every ``X.q/k/v.T`` triple of a ``SplitQKV`` named
    ``X`` concatenated back into ``X.T``: the names and layout of the model before ``split_qkv``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        stem, _, leaf = name.rpartition(".")
        owner, _, part = stem.rpartition(".")
        names = [f"{owner}.{p}.{leaf}" for p in PARTS]
        if part in PARTS and owner.endswith("c_attn") and all(n in state for n in names):
            if part == PARTS[0]:
                out[f"{owner}.{leaf}"] = torch.cat([state[n] for n in names], dim=-1)
            continue
        out[name] = tensor
    return out
