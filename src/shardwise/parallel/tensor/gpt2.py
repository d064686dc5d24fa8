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
``B``. The TP plan then splits each part column-wise (``tensor.plans.with_lora``), so each rank's ``B``
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

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.errors import ConfigError
from shardwise.models.gpt2_qkv import PARTS, SplitQKV

__all__ = ["Conv1DColwise", "Conv1DRowwise", "split_qkv"]



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




























