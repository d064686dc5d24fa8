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

A LoRA-wrapped ``c_attn`` (peft: ``base(x) + B(A(x)) * scale``, ``A``: in -> r, ``B``: r -> 3 x
hidden) is split the same way inside its wrapper: the base layer becomes the ``SplitQKV`` and each
adapter's ``B`` a ``SplitQKV`` of three ``nn.Linear`` (r -> hidden) holding the q, k and v rows of
``B``. The TP plan then splits each part column-wise (``tp_plans.with_lora``), so each rank's ``B``
parts produce exactly its ``[q_r | k_r | v_r]`` columns of the update, and ``A`` stays whole on
every rank (its gradient is summed over the TP ranks by the parts' input all-reduce, as for any
column-parallel adapter).

The parts are slices of the tensor the pretrained files, transformers and PEFT name
``c_attn.weight``/``c_attn.bias`` (``c_attn.base_layer.weight`` and ``c_attn.lora_B.<adapter>.weight``
under LoRA): along the output features, the last dim of a Conv1D weight and the first of an
``nn.Linear`` one (``fused_dim``). ``fused_sources`` says which slice, and meta init, pretrained
loading, the optimizer, the checkpoints and the Hugging Face export ask it (one owner of the mapping).
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.errors import ConfigError

__all__ = ["PARTS", "Conv1DColwise", "Conv1DRowwise", "FusedSlice", "SplitQKV", "fuse_shapes", "fuse_split_state",
           "fuse_state", "fused_dim", "fused_sources", "has_split_qkv", "split_names", "split_qkv", "unfuse_state"]

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
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda _n, m, mesh: _distribute(m, mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class SplitQKV(nn.Module):
    """GPT-2's fused ``c_attn`` as three ``Conv1D`` (q, k, v); the output is ``[q | k | v]`` as before.

    Also a LoRA ``B`` of ``c_attn`` as three ``nn.Linear`` (its q, k and v rows).
    """

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module) -> None:
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)], dim=-1)


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "c_attn") and hasattr(m, "split_size") and hasattr(m, "embed_dim")]


def _split_conv1d(fused: nn.Module, width: int) -> SplitQKV:
    """Three ``Conv1D`` holding copies of ``fused``'s q, k and v columns (on meta, no data moves)."""
    parts = []
    for i in range(len(PARTS)):
        part = type(fused).__new__(type(fused))
        nn.Module.__init__(part)
        part.nf, part.nx = width, fused.nx
        cols = slice(i * width, (i + 1) * width)
        part.weight = nn.Parameter(fused.weight.detach()[:, cols].clone(), requires_grad=fused.weight.requires_grad)
        part.bias = nn.Parameter(fused.bias.detach()[cols].clone(), requires_grad=fused.bias.requires_grad)
        parts.append(part)
    return SplitQKV(*parts)


def _split_linear(fused: nn.Linear, width: int) -> SplitQKV:
    """Three ``nn.Linear`` holding copies of ``fused``'s q, k and v rows (its output features)."""
    parts = []
    for i in range(len(PARTS)):
        rows = slice(i * width, (i + 1) * width)
        part = nn.Linear(fused.in_features, width, bias=fused.bias is not None, device="meta")
        part.weight = nn.Parameter(fused.weight.detach()[rows].clone(), requires_grad=fused.weight.requires_grad)
        if fused.bias is not None:
            part.bias = nn.Parameter(fused.bias.detach()[rows].clone(), requires_grad=fused.bias.requires_grad)
        parts.append(part)
    return SplitQKV(*parts)


def _split_lora(name: str, layer: nn.Module, width: int) -> None:
    """Split a peft LoRA layer wrapping ``c_attn``: its base layer and every adapter's ``B``."""
    if getattr(layer, "lora_variant", None) or any(getattr(layer, "use_dora", {}).values()):
        raise ConfigError(f"{name}.c_attn carries a LoRA variant (e.g. DoRA) whose magnitude spans the fused q/k/v "
                          "columns: tensor parallel splits only plain LoRA adapters on GPT-2's c_attn.")
    for adapter, b in layer.lora_B.items():
        if not isinstance(b, nn.Linear) or b.out_features != 3 * width:
            raise ConfigError(f"{name}.c_attn.lora_B.{adapter} is a {type(b).__name__} with "
                              f"{getattr(b, 'out_features', '?')} outputs, not a linear layer of 3 x {width}: "
                              "tensor parallel cannot split this adapter of GPT-2's c_attn.")
        layer.lora_B[adapter] = _split_linear(b, width)
    layer.base_layer = _split_conv1d(layer.base_layer, width)


def split_qkv(model: nn.Module, tp: int) -> None:
    """Replace every GPT-2 attention's fused ``c_attn`` of ``model`` by a ``SplitQKV``, in place.

    Works on a meta model (the parts stay on meta; meta init fills them from the fused value) and
    on a real one (the parts get copies of their slices). ``split_size`` becomes the width one of
    ``tp`` ranks holds of each of q, k and v. A LoRA-wrapped ``c_attn`` keeps its wrapper; its base
    layer and adapters' ``B`` are split inside it (see the module's docstring).
    """
    for name, attn in _attention_modules(model):
        layer = attn.c_attn
        lora = hasattr(layer, "base_layer") and hasattr(layer, "lora_B")
        fused = layer.base_layer if lora else layer
        if isinstance(fused, SplitQKV):
            continue
        if getattr(attn, "is_cross_attention", False):
            raise ConfigError(f"tensor parallel does not split GPT-2 cross-attention ({name}); only decoder-only "
                              "GPT-2 language models are supported.")
        if not _is_conv1d(fused):
            raise ConfigError(f"{name}.c_attn is a {type(fused).__name__}, not GPT-2's Conv1D (or a LoRA layer "
                              "wrapping one): tensor parallel cannot split this fused q/k/v projection of GPT-2. "
                              "Train it with fsdp or ddp instead.")
        width = attn.embed_dim
        if fused.nf != 3 * width:
            raise ConfigError(f"{name}.c_attn has {fused.nf} output features, not 3 x {width}: not a GPT-2 attention.")
        if lora:
            _split_lora(name, layer, width)
        else:
            attn.c_attn = _split_conv1d(fused, width)
        attn.split_size = width // tp


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
# optimizer state dicts of a split model are mapped here: their q/k/v entries are concatenated
# into the fused name on save, and the fused entry is cut back into the parts on load.
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


def _fusable_placements(t: Any, dim: int) -> list[Any]:
    """``t``'s placements with every mesh dim that shards its dim ``dim`` replicated instead."""
    return [Replicate() if getattr(p, "dim", None) is not None and p.dim % t.ndim == dim else p
            for p in t.placements]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _fuse_values(values: list[Any], dim: int) -> Any:
    """The parts' entries as the fused tensor's: tensors concatenated along ``dim`` (the output
    features); scalars (Adam's ``step``) and hyper-parameters are shared, q's is kept."""
    first = values[0]
    if not isinstance(first, torch.Tensor) or first.ndim == 0:
        return first
    dim %= first.ndim
    with torch.no_grad():
        if not isinstance(first, DTensor):
            return torch.cat([v.detach() for v in values], dim=dim)
        # Each part is column-split across the TP ranks ([q_r | k_r | v_r] is not one block of the
        # fused tensor): gather ``dim`` over the mesh dims that split it, keep the others (FSDP's
        # row shards of a Conv1D part are the same rows in the three parts), and concatenate locally.
        placements = _fusable_placements(first, dim)
        local = torch.cat([v.detach().redistribute(v.device_mesh, placements).to_local() for v in values], dim=dim)
        shape = list(first.shape)
        shape[dim] = sum(v.shape[dim] for v in values)
        return DTensor.from_local(local, first.device_mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(tuple(shape)))


def _part_value(fused: Any, index: int, like: Any, dim: int) -> Any:
    """Part ``index`` of a fused entry (as ``_fuse_values`` made it, cut along ``dim``), laid out as ``like``."""
    if not isinstance(like, torch.Tensor):
        return fused
    if like.ndim == 0:
        return fused.detach().clone()  # one tensor per part: Adam increments ``step`` in place
    dim %= like.ndim
    width = like.shape[dim]
    if fused.shape[dim] != width * len(PARTS):
        raise ValueError(f"a fused q/k/v entry of {fused.shape[dim]} output features (dim {dim}) does not hold three "
                         f"parts of {width}")
    with torch.no_grad():
        if not isinstance(fused, DTensor):
            return fused.detach().narrow(dim, index * width, width).clone()
        # The fused entry's ``dim`` is whole on every rank (see _fuse_values): slice it locally,
        # then scatter it as the part is laid out (a local chunk for the TP split).
        local = fused.to_local().narrow(dim, index * width, width).contiguous()
        whole = DTensor.from_local(local, fused.device_mesh, fused.placements, run_check=False,
                                   shape=like.shape, stride=_contiguous_stride(tuple(like.shape)))
        if isinstance(like, DTensor):
            return whole.redistribute(like.device_mesh, like.placements)
        return whole.full_tensor()


def fuse_state(state: dict[str, Any]) -> dict[str, Any]:
    """A model or (flattened) optimizer state dict of a split model under the fused names.

    Collective when the parts are DTensors (their output features are gathered over the TP ranks).
    """
    groups = split_names(state)
    if not groups:
        return state
    first = {parts[0]: fused for fused, parts in groups.items()}
    rest = {p for parts in groups.values() for p in parts[1:]}
    out: dict[str, Any] = {}
    for name, value in state.items():
        if name in first:
            fused = first[name]
            out[fused] = _fuse_values([state[p] for p in groups[fused]], fused_dim(fused))
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
            out[name] = _part_value(loaded[fused], index, like[name], fused_dim(fused))
    return out


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
