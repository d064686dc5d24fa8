"""Planner arithmetic of a DPO step (``train.objective = "dpo"``): what preference tuning adds.

* **Doubled sequences.** Chosen and rejected answers run in one forward: a micro-batch of ``B``
  pairs is ``2B`` sequences (or ``B`` packed rows twice as long), so activations are those of
  ``2B`` sequences. The reference's forward runs without gradients and keeps no activations.
* **The reference model.** ``copy`` (a full fine-tune): a frozen copy sharded like the policy, so
  each rank holds its parameter shards once more (no gradients, no optimizer state); ``adapters``
  (LoRA): nothing, the base is the reference with the adapters off; ``precomputed``: two float64
  log-probs per pair on the host, nothing on the device.

* **Time.** The policy's forward and backward run on ``2B`` sequences; a live reference (``copy`` or
  ``adapters``) adds one forward of them without gradients, a third of a forward + backward's FLOPs
  (forward 1, backward 2), so the compute term grows by 1/3; ``precomputed`` adds nothing per step.

``dpo_breakdown`` is the language-model breakdown at ``2B`` sequences plus the reference's bytes and
``dpo_step_time`` the step time of ``2B`` sequences with the reference's forward; ``plan --objective
dpo`` (``plan/advice.evaluate``) uses both for every layout it searches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardwise.core.config import OBJECTIVES
from shardwise.errors import ConfigError
from shardwise.plan.cost import StepTime
from shardwise.plan.memory import MemoryBreakdown, memory_breakdown

REFERENCE_FORWARD_SHARE = 1 / 3  # a forward without gradients against a forward + backward

REFERENCES = ("copy", "adapters", "precomputed")
PRECOMPUTED_BYTES_PER_PAIR = 16  # chosen and rejected log-probs, float64


__all__ = ["OBJECTIVES", "REFERENCES", "dpo_breakdown", "dpo_layout_refusal", "dpo_step_time", "reference_for"]


def dpo_layout_refusal(layout: Any, owns_step: bool, reference: str = "copy") -> str | None:
    """Why the DPO step cannot run under ``layout`` (None where it can): the one rule, asked by the
    runtime before launch and on every rank (``preference.step.check_layout``) and by the planner's
    search (a layout it would refuse is never recommended). ``reference``: ``reference_for``'s answer.
    A pipeline's microbatches hold whole pairs by the layout's own rule (``Layout.check_batch``: the
    micro-batch, which counts pairs, splits into equal microbatches)."""
    if owns_step:
        return (f"train.objective = 'dpo' does not run under the {layout.strategy} engine (it owns the step) yet. "
                "It runs under single, ddp, zero1, zero2, fsdp, hsdp, tensor and pipeline parallel (tp, fsdp+tp, "
                "pp, fsdp+pp, fsdp+tp+pp), with context or expert parallel beside them; set one of them.")
    if layout.pp == 1:
        return None
    if layout.cp > 1:
        return ("train.objective = 'dpo' does not run under context parallel beside pipeline parallel "
                "(parallel.cp > 1 with parallel.pp > 1) yet: set one of them to 1.")
    if reference == "copy":
        # The strategy runs one pipeline schedule: a frozen copy's stages would need their own.
        return ("train.objective = 'dpo' under pipeline parallel takes its reference from LoRA adapters switched "
                "off (lora.rank > 0) or from log-probs scored once before training (preference.precompute_reference"
                " = true), not from a frozen copy of the model, whose stages would need a pipeline schedule of "
                "their own. Set one of the two, or a strategy without pipeline parallel.")
    return None


def reference_for(lora_rank: int, precompute: bool) -> str:
    """The reference a run uses: precomputed if asked, else adapters off with LoRA, else a frozen copy."""
    return "precomputed" if precompute else "adapters" if lora_rank else "copy"


def dpo_breakdown(spec: Any, layout: Any, prec: Any, optimizer: str, *, seq: int, micro_batch_pairs: int,
                  reference: str, pairs: int = 0, **options: Any) -> MemoryBreakdown:
    """Per-GPU bytes of a DPO step of ``micro_batch_pairs`` pairs per micro-batch (``memory_breakdown``'s
    other options pass through); ``pairs``: the data set's size, for the precomputed log-probs."""
    if reference not in REFERENCES:
        raise ConfigError(f"unknown DPO reference {reference!r}; allowed: {', '.join(REFERENCES)}.")
    base = memory_breakdown(spec, layout, prec, optimizer, seq=seq, micro_batch=2 * micro_batch_pairs, **options)
    extra_params = base.params if reference == "copy" else 0
    host = PRECOMPUTED_BYTES_PER_PAIR * pairs if reference == "precomputed" else 0
    return dataclasses.replace(base, params=base.params + extra_params, host_bytes=base.host_bytes + host)


def dpo_step_time(base: StepTime, reference: str) -> StepTime:
    """``base``: the step time of the doubled sequences (2 per pair); with a live reference its forward
    is added to the compute term (``REFERENCE_FORWARD_SHARE`` of it), with precomputed log-probs nothing."""
    if reference not in REFERENCES:
        raise ConfigError(f"unknown DPO reference {reference!r}; allowed: {', '.join(REFERENCES)}.")
    share = 0.0 if reference == "precomputed" else REFERENCE_FORWARD_SHARE
    return dataclasses.replace(base, compute_s=base.compute_s * (1 + share))
