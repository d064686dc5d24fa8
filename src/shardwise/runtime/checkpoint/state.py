"""Model and optimizer state dicts keyed by parameter name, whatever the wrapping or sharding.

Both go through ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
``set_state_dict``), whose keys are the plain model's parameter names under DDP, FSDP2 and DTensor
TP alike, so DCP can reshard a checkpoint onto any other strategy and rank count. A tensor a
strategy trains in slices (GPT-2's fused ``c_attn`` as q/k/v under TP, ``parallel/tensor/gpt2.py``) is
named and shaped as the unsplit model has it, so that too resumes under any layout.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate

from shardwise.models.gpt2_qkv import PARTS, fused_dim, has_split_qkv, split_names
from shardwise.parallel.pipeline.ties import rename_copy_keys


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds, keyed by parameter name.

    ZeroRedundancyOptimizer (zero1) keeps each rank's share of the state in an inner optimizer
    over the parameters the rank owns; its own state_dict() needs a consolidation onto one rank
    first. Saving the inner optimizer instead gives each rank's share under the parameters'
    names, which DCP merges across ranks and reads back under any other partition or strategy.
    """
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


# Optimizer state keyed by parameter name, hyper-parameters included ("param_groups.<fqn>.lr"),
# instead of by param-group index: groups differ between strategies (a pipeline stage or a ZeRO-1
# shard holds only some parameters), names do not. torchtitan saves the same way.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# LoRA on a pretrained model: the frozen base is read from model.pretrained at every start, so
# checkpoints hold only the trainable tensors (and loading leaves the frozen ones as they are).
_TRAINABLE = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def _options(trainable_only: bool) -> StateDictOptions:
    return _TRAINABLE if trainable_only else _OPTIONS


def _fused(model: nn.Module, state: dict[str, Any], fused: bool) -> dict[str, Any]:
    return fuse_state(state) if fused and has_split_qkv(model) else state


def model_state(model: nn.Module, trainable_only: bool = False, fused: bool = True) -> dict[str, Any]:
    """The model's state as this rank holds it, name-keyed; ``trainable_only`` leaves frozen parameters out.

    ``fused``: a tensor trained in slices appears whole, under its own name (a fresh tensor, not the
    parameters'); False gives the slices as the model holds them (what checkpoints of shardwise
    before the fused format saved).
    """
    return _fused(model, get_model_state_dict(model, options=_options(trainable_only)), fused)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainable_only: bool = False, fused: bool = True) -> dict[str, Any]:
    """The optimizer's state as this rank holds it, keyed by parameter name (flattened); ``fused`` as
    in ``model_state``."""
    local = _local_optimizer(optimizer)
    if not any(g["params"] for g in local.param_groups):
        # A ZeRO-1 rank that owns no parameter (fewer parameters than ranks: ZeroRedundancyOptimizer
        # hands out whole tensors) holds no state; torch 2.13 refuses to make an empty optimizer
        # state dict, which failed every save of such a run. Its share of the checkpoint is empty.
        return {}
    with _without_empty_groups(local):
        state = get_optimizer_state_dict(model, local, options=_options(trainable_only))
    # A pipeline's last-stage copy of a tied weight saves its state under the original's name.
    return _fused(model, rename_copy_keys(model, state, to_original=True), fused)


@contextlib.contextmanager
def _without_empty_groups(local: torch.optim.Optimizer) -> Any:
    """``local`` with its parameter groups that hold no parameter (a ZeRO-1 shard's) set aside:
    torch 2.13's name-keyed state dict reads each group's first parameter name. They hold no state
    to save or load; they are put back in place afterwards."""
    groups = local.param_groups
    local.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        kept = iter(local.param_groups)
        local.param_groups = [next(kept) if g["params"] else g for g in groups]


def _unfused(model: nn.Module, state: dict[str, Any], own: Any) -> dict[str, Any]:
    """``state`` (fused or sliced names) under the model's own names and layout (``own()`` gives them)."""
    return unfuse_state(state, own()) if has_split_qkv(model) else state


def set_model_state(model: nn.Module, state: dict[str, Any], trainable_only: bool = False) -> None:
    state = _unfused(model, state, lambda: get_model_state_dict(model, options=_options(trainable_only)))
    set_model_state_dict(model, state, options=_options(trainable_only))


def set_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                        trainable_only: bool = False) -> None:
    local = _local_optimizer(optimizer)
    if not any(g["params"] for g in local.param_groups):
        return  # a ZeRO-1 rank that owns no parameter: no state to load (see optimizer_state)
    with _without_empty_groups(local):
        state = _unfused(model, state, lambda: get_optimizer_state_dict(model, local, options=_options(trainable_only)))
        state = rename_copy_keys(model, state, to_original=False)
        # A ZeRO-1 shard can own no parameter of a group: torch 2.13's name-keyed loader fails on
        # such an empty group, which has no state to load anyway (_without_empty_groups).
        set_optimizer_state_dict(model, local, state, options=_options(trainable_only))


@contextlib.contextmanager
def single_process_ok() -> Any:
    """Silence DCP's warning that it "assumes" one process when there is no process group.

    Here that is intended (one rank, or ``ckpt export``), so the warning would only be noise.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


# ------------------------------------------------------------- GPT-2's split q/k/v (models/gpt2_qkv.py)
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
