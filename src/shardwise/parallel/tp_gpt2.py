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

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.errors import ConfigError

__all__ = ["PARTS", "Conv1DColwise", "Conv1DRowwise", "SplitQKV", "fuse_shapes", "fuse_split_state", "fuse_state",
           "fused_sources", "has_split_qkv", "split_names", "split_qkv", "unfuse_state"]

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


# ------------------------------------------------------------------------------ checkpoint names
# A checkpoint holds the fused ``c_attn`` whatever the layout (as the pretrained files do), so one
# saved under TP resumes without it and back, and export/reshard see one format. The model and
# optimizer state dicts of a split model are mapped here: their q/k/v entries are concatenated
# into the fused name on save, and the fused entry is cut back into the parts on load.
_PART_NAME = re.compile(r"(?:^|\.)c_attn\.([qkv])\.(?:weight|bias)(?=\.|$)")


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


def _fusable_placements(t: Any) -> list[Any]:
    """``t``'s placements with every mesh dim that shards its last dim replicated instead."""
    last = t.ndim - 1
    return [Replicate() if getattr(p, "dim", None) is not None and p.dim % t.ndim == last else p
            for p in t.placements]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _fuse_values(values: list[Any]) -> Any:
    """The parts' entries as the fused tensor's: tensors concatenated along the last dim (the
    output features); scalars (Adam's ``step``) and hyper-parameters are shared, q's is kept."""
    first = values[0]
    if not isinstance(first, torch.Tensor) or first.ndim == 0:
        return first
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if not isinstance(first, DTensor):
            return torch.cat([v.detach() for v in values], dim=-1)
        # Each part is column-split across the TP ranks ([q_r | k_r | v_r] is not one block of the
        # fused tensor): gather the last dim over the mesh dims that split it, keep the others
        # (FSDP's row shards are the same rows in the three parts), and concatenate locally.
        placements = _fusable_placements(first)
        local = torch.cat([v.detach().redistribute(v.device_mesh, placements).to_local() for v in values], dim=-1)
        shape = (*first.shape[:-1], sum(v.shape[-1] for v in values))
        return DTensor.from_local(local, first.device_mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _part_value(fused: Any, index: int, like: Any) -> Any:
    """Part ``index`` of a fused entry (as ``_fuse_values`` made it), laid out as ``like``."""
    if not isinstance(like, torch.Tensor):
        return fused
    if like.ndim == 0:
        return fused.detach().clone()  # one tensor per part: Adam increments ``step`` in place
    from torch.distributed.tensor import DTensor

    width = like.shape[-1]
    if fused.shape[-1] != width * len(PARTS):
        raise ValueError(f"a fused q/k/v entry of last dim {fused.shape[-1]} does not hold three parts of {width}")
    columns = slice(index * width, (index + 1) * width)
    with torch.no_grad():
        if not isinstance(fused, DTensor):
            return fused.detach()[..., columns].clone()
        # The fused entry's last dim is whole on every rank (see _fuse_values): slice it locally,
        # then scatter it as the part is laid out (a local chunk for the TP split).
        local = fused.to_local()[..., columns].contiguous()
        whole = DTensor.from_local(local, fused.device_mesh, fused.placements, run_check=False,
                                   shape=like.shape, stride=_contiguous_stride(tuple(like.shape)))
        if isinstance(like, DTensor):
            return whole.redistribute(like.device_mesh, like.placements)
        return whole.full_tensor()


def fuse_state(state: dict[str, Any]) -> dict[str, Any]:
    """A model or (flattened) optimizer state dict of a split model under the fused names.

    Collective when the parts are DTensors (their last dim is gathered over the TP ranks).
    """
    groups = split_names(state)
    if not groups:
        return state
    first = {parts[0]: fused for fused, parts in groups.items()}
    rest = {p for parts in groups.values() for p in parts[1:]}
    out: dict[str, Any] = {}
    for name, value in state.items():
        if name in first:
            out[first[name]] = _fuse_values([state[p] for p in groups[first[name]]])
        elif name not in rest:
            out[name] = value
    return out


def unfuse_state(loaded: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """``loaded`` (fused names, as ``fuse_state`` gives) under the names and layout of ``like``
    (the split model's own state dict): each fused entry cut into its q/k/v parts. Entries
    ``loaded`` holds under a part's own name (a checkpoint that saved the parts) are kept."""
    groups = split_names(like)
    if not groups:
        return loaded
    part_of = {p: (fused, i) for fused, parts in groups.items() for i, p in enumerate(parts)}
    out = {name: value for name, value in loaded.items() if name not in groups}
    for name, (fused, index) in part_of.items():
        if name not in out and fused in loaded:
            out[name] = _part_value(loaded[fused], index, like[name])
    return out


def fuse_shapes(shapes: dict[str, list]) -> dict[str, list]:
    """A checkpoint manifest's ``{name: [shape, dtype]}`` with q/k/v slices (``split_names``) as the
    fused tensor: what a checkpoint saved with the slices holds, under the unsplit model's names."""
    groups = split_names(shapes)
    rest = {p for parts in groups.values() for p in parts}
    out = {name: spec for name, spec in shapes.items() if name not in rest}
    for fused, parts in groups.items():
        shape, dtype = shapes[parts[0]]
        out[fused] = [[*shape[:-1], sum(shapes[p][0][-1] for p in parts)], dtype]
    return out
