"""Training stacks as the planner's cost and memory model sees them: named sets of properties.

``plan --stack NAME`` picks one set; ``plan --stack-set KEY=VALUE`` (repeatable) sets one property
alone, on top of the stack. Every property is a field of ``plan.memory.Kernels`` (how the stack
implements the pieces whose bytes and time differ) or ``grad_sync`` (when gradients are reduced
under accumulation). ``benchmarks/calibrate_planner.py`` describes each published run with these
same settings (``settings_from``), so a calibration row is something the CLI can say.

What each stack implies (the properties not named keep shardwise's defaults):

* ``shardwise``: this runtime -- torch cross-entropy and eager RMSNorm, SDPA's FlashAttention-2
  (``attention_kernel = "flash2"``), no TP or EP overlap, DDP's bucket copy, fp32 parameters
  (FSDP2 / autocast), gradients reduced once per step (no_sync).
* ``torchtitan``: FSDP2 as shardwise, but gradients reduce-scattered every micro-batch, and its
  experts tensor-parallel under TP (expert-tensor-parallel = tp: ``experts_whole_on_tp = false``,
  ``experts_tp = true``).
* ``megatron``: Megatron-Core -- fused cross-entropy and RMSNorm, its fused SwiGLU / GeGLU
  (``glu = "fused"``: the activation's input kept, the activation recomputed in backward),
  Transformer Engine's attention
  (cuDNN's fused kernel on Hopper, which TE prefers there: ``attention_kernel = "flash3"``), TP
  communication pipelined with the GEMMs (``--tp-comm-overlap``: ``tp_overlap = "full"``; a run without
  it: ``--stack-set tp_overlap=backward``), the distributed optimizer overlapping its reduce-scatter / all-gather, a
  contiguous fp32 gradient buffer, 16-bit parameters with an fp32 master copy, pipeline receives
  into the in-flight micro-batches' own tensors; expert groups folded over tp x dp x cp of a
  pipeline stage (MoE parallel folding, expert-tensor-parallel 1: ``ep_groups = "tp-dp"``, each TP
  rank routing its own tokens: ``experts_whole_on_tp = false``); its token dispatcher keeps no
  routed copy beyond the experts' tensors (``ep_dispatch_copy = false``); its sequence parallel
  keeps each linear's input shard and all-gathers it again in backward (``sp_regather = true``).
  Megatron-Core before its folding (NeMo 24.x) carved ep from the data-parallel ranks and split
  every expert over tp: ``--stack-set ep_groups=dp --stack-set experts_tp=true``.
* ``deepspeed``: DeepSpeed's BF16 optimizer -- bf16 gradients kept beside the fp32 buffer, 16-bit
  parameters with an fp32 master copy, pipeline receives into its in-flight buffers; expert groups
  carved from the data-parallel ranks of any ZeRO stage (``ep_groups = "dp"``), no routed copy
  kept by the dispatch (``ep_dispatch_copy = false``), experts not whole on TP ranks.

``ep_groups`` lets the planner plan an ep that stack allows and shardwise's runtime does not (the
rule itself: core/layout.py ``EP_GROUPS``); ``train`` still refuses it (``Layout._check_ep``).
torchtitan keeps shardwise's rule here (its default expert-tensor-parallel = tp); its etp 1 folds
ep over tp as well: ``--stack-set ep_groups=tp-dp`` says so.

``pp_split = cost`` (no stack above implies it) is nanotron's pipeline split, balanced by a cost per
block with the head counted (plan/pipeline.py ``cost_balanced_stage_layers``); planned, never run by
``train``, which splits by block count. ``zero1_group = G`` (none implies it either) shards a ZeRO-1
stack's optimizer state within groups of G data-parallel ranks (InternEvo's ``zero1`` size,
Megatron-Core's distributed-optimizer instances); ``train`` shards over every dp rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardwise.errors import ConfigError
from shardwise.plan.memory import GRAD_SYNC_MODES, Kernels

__all__ = ["STACKS", "STACK_KEYS", "settings_from", "stack_settings"]

STACKS: dict[str, dict[str, Any]] = {
    "shardwise": {},
    "torchtitan": {"grad_sync": "microbatch", "experts_whole_on_tp": False, "experts_tp": True},
    "megatron": {"loss": "fused", "norm": "fused", "glu": "fused", "attention_kernel": "flash3", "tp_overlap": "full",
                 "dp_overlap": True, "grad_buffer": "contiguous", "state": "master-copy", "pp_receive_buffers": False,
                 "ep_groups": "tp-dp", "ep_dispatch_copy": False, "experts_whole_on_tp": False,
                 "sp_regather": True},
    "deepspeed": {"grad_buffer": "deepspeed-bf16", "state": "master-copy", "pp_receive_buffers": False,
                  "ep_groups": "dp", "ep_dispatch_copy": False, "experts_whole_on_tp": False},
}
STACK_KEYS = (*(f.name for f in dataclasses.fields(Kernels)), "grad_sync")


def _value(key: str, text: str) -> Any:
    """``text`` as the type of property ``key`` (booleans: true/false)."""
    if key == "grad_sync":
        if text not in GRAD_SYNC_MODES:
            raise ConfigError(f"--stack-set grad_sync={text}: allowed: {', '.join(GRAD_SYNC_MODES)}.")
        return text
    if key == "tp_overlap" and text.lower() in ("true", "false"):
        return "full" if text.lower() == "true" else "none"  # the boolean this property was until 2026-11-29
    default = getattr(Kernels(), key)
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ConfigError(f"--stack-set {key}={text}: {key} is true or false.")
        return text.lower() == "true"
    if isinstance(default, int):
        if not text.isdigit():
            raise ConfigError(f"--stack-set {key}={text}: {key} is a whole number >= 0.")
        return int(text)
    return text


def settings_from(stack: str = "shardwise", sets: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """The properties of ``stack`` with each ``KEY=VALUE`` of ``sets`` applied on top."""
    if stack not in STACKS:
        raise ConfigError(f"--stack {stack!r} is not a stack the planner models; allowed: {', '.join(STACKS)}.")
    out = dict(STACKS[stack])
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or key not in STACK_KEYS:
            raise ConfigError(f"--stack-set {item!r}: give KEY=VALUE with KEY one of {', '.join(STACK_KEYS)}.")
        out[key] = _value(key, text)
    return out


def stack_settings(stack: str = "shardwise", sets: tuple[str, ...] | list[str] = ()) -> tuple[Kernels, str | None]:
    """(the Kernels, the grad_sync or None when the stack leaves it to the search) of a stack."""
    props = settings_from(stack, sets)
    grad_sync = props.pop("grad_sync", None)
    return Kernels(**props), grad_sync
