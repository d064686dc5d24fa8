"""``torch.compile`` applied from outside, per transformer block (torchtitan's ``apply_compile``).

Each block is compiled on its own: the blocks share one structure, so the graph is traced,
lowered and (through inductor's on-disk cache) code-generated once and reused by the others, and
a change of batch shape recompiles one small graph instead of the whole model. The order is
torchtitan's, "turn on per-block compile after AC wrapping and before FSDP":

    (pipeline split) -> TP -> activation checkpointing -> compile -> DDP / FSDP2 -> (stages)

* after TP: the compiled graph traces the DTensor parameters and the plan's input/output
  redistributions that ``parallelize_module`` installed on the block's submodules;
* after AC: the checkpoint wrapper's ``torch.utils.checkpoint`` call is traced into the graph (a
  higher-order op), so recomputation happens inside compiled code;
* before FSDP2: ``fully_shard`` then registers its all-gather/reduce-scatter hooks on the compiled
  wrapper, so the collectives run eagerly around each compiled block, as in torchtitan. DDP wraps
  the whole model; its gradient hooks fire from the compiled backward's gradient accumulation.

``torch.compile(block)`` returns an ``OptimizedModule`` holding the block as ``_orig_mod``:
parameter names gain a ``_orig_mod.`` segment. DCP's state-dict API drops it (checkpoints of
compiled and eager runs are interchangeable), and ``clean_name`` drops it wherever shardwise
matches parameters by name.

A model without a block container is compiled whole (in place, ``nn.Module.compile``: its
parameter names stay as they are). On the CPU inductor generates C++ (a C compiler must be on
PATH); on CUDA, Triton kernels.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.blocks import transformer_blocks

if TYPE_CHECKING:
    from shardwise.core.config import ParallelConfig
    from shardwise.parallel.base import Strategy


def is_compiled(module: nn.Module) -> bool:
    """True when ``module`` is a ``torch.compile`` wrapper (or was compiled in place)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None


def toolchain_refusal(device_type: str) -> str | None:
    """Why inductor cannot generate code for ``device_type`` on this machine (None when it can)."""
    if device_type == "cpu" and not any(shutil.which(cc) for cc in ("cc", "gcc", "clang", "c++", "g++")):
        return ("on the CPU inductor needs a C/C++ compiler (it generates C++ kernels), but none of cc, gcc, "
                "clang, c++, g++ is on PATH (install one, e.g. apt-get install g++)")
    return None


def compile_refusal(strategy: Strategy, options: ParallelConfig, device_type: str) -> str | None:
    """Why ``train.compile`` cannot run under ``strategy`` with ``options`` on this machine (None: it can).

    ``check_compile`` raises it for an explicit ``true``; ``train.compile = "auto"`` turns compile off
    for it (shardwise.runtime.auto).
    """
    reason = strategy.compile_unsupported(options)
    if reason:
        return f"strategy {strategy.name!r} cannot compile: {reason}"
    if options.cp > 1:
        return ("context parallel (parallel.cp > 1) does not compile yet: the all-to-all attention is routed "
                "by a TorchFunctionMode")
    return toolchain_refusal(device_type)


def check_compile_toolchain(device_type: str) -> None:
    """Raise ConfigError when inductor cannot generate code for ``device_type`` on this machine."""
    reason = toolchain_refusal(device_type)
    if reason:
        raise ConfigError(f"train.compile = true cannot run: {reason}; or set train.compile = false.")


def check_compile(strategy: Strategy, options: ParallelConfig, device_type: str) -> None:
    """Raise ConfigError when ``train.compile`` cannot run under ``strategy`` with ``options``, or on
    this machine (``device_type``)."""
    if strategy.layout.cp > 1:
        raise ConfigError("train.compile does not run with context parallel (parallel.cp > 1) yet: the all-to-all "
                          "attention is routed by a TorchFunctionMode. Unset one of them.")
    reason = strategy.compile_unsupported(options)
    if reason:
        raise ConfigError(f"train.compile = true cannot run under strategy {strategy.name!r}: {reason}. "
                          "Set train.compile = false, or choose another strategy.")
    check_compile_toolchain(device_type)


def apply_compile(model: nn.Module) -> nn.Module:
    """Return ``model`` with each transformer block replaced by ``torch.compile(block)``, in place.

    Blocks already compiled are left alone (a composition may call this once per stage view). A
    model with no block container is compiled whole, in place.
    """
    container = transformer_blocks(model)
    if container is None:
        if not is_compiled(model):
            model.compile()
        return model
    for name, block in list(container.named_children()):
        if is_compiled(block):
            continue
        container.register_module(name, torch.compile(block))
    return model


def compile_loss(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``loss_fn`` compiled (torchtitan compiles the loss beside the blocks)."""
    return torch.compile(loss_fn)
