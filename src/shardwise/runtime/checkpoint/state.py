"""Model and optimizer state dicts keyed by parameter name, whatever the wrapping or sharding.

Both go through ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
``set_state_dict``), whose keys are the plain model's parameter names under DDP, FSDP2 and DTensor
TP alike, so DCP can reshard a checkpoint onto any other strategy and rank count. A tensor a
strategy trains in slices (GPT-2's fused ``c_attn`` as q/k/v under TP, ``parallel/tp_gpt2.py``) is
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

from shardwise.parallel.pp_ties import rename_copy_keys
from shardwise.parallel.tp_gpt2 import fuse_state, has_split_qkv, unfuse_state


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
    state = get_optimizer_state_dict(model, _local_optimizer(optimizer), options=_options(trainable_only))
    # A pipeline's last-stage copy of a tied weight saves its state under the original's name.
    return _fused(model, rename_copy_keys(model, state, to_original=True), fused)


def _unfused(model: nn.Module, state: dict[str, Any], own: Any) -> dict[str, Any]:
    """``state`` (fused or sliced names) under the model's own names and layout (``own()`` gives them)."""
    return unfuse_state(state, own()) if has_split_qkv(model) else state


def set_model_state(model: nn.Module, state: dict[str, Any], trainable_only: bool = False) -> None:
    state = _unfused(model, state, lambda: get_model_state_dict(model, options=_options(trainable_only)))
    set_model_state_dict(model, state, options=_options(trainable_only))


def set_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                        trainable_only: bool = False) -> None:
    local = _local_optimizer(optimizer)
    state = _unfused(model, state, lambda: get_optimizer_state_dict(model, local, options=_options(trainable_only)))
    state = rename_copy_keys(model, state, to_original=False)
    # A ZeRO-1 shard can own no parameter of a group. torch 2.13's name-keyed loader fails on
    # such an empty group (it reads the group's first parameter name), and the group has no state
    # to load anyway: load into the non-empty groups only, then put the empty ones back in place.
    groups = local.param_groups
    local.param_groups = [g for g in groups if g["params"]]
    try:
        set_optimizer_state_dict(model, local, state, options=_options(trainable_only))
    finally:
        loaded = iter(local.param_groups)
        local.param_groups = [next(loaded) if g["params"] else g for g in groups]


@contextlib.contextmanager
def single_process_ok() -> Any:
    """Silence DCP's warning that it "assumes" one process when there is no process group.

    Here that is intended (one rank, or ``ckpt export``), so the warning would only be noise.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield
