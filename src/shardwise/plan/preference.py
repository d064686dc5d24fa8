"""Planner arithmetic of a DPO step (``train.objective = "dpo"``): what preference tuning adds.

* **Doubled sequences.** Chosen and rejected answers run in one forward: a micro-batch of ``B``
  pairs is ``2B`` sequences (or ``B`` packed rows twice as long), so activations are those of
  ``2B`` sequences. The reference's forward runs without gradients and keeps no activations.
* **The reference model.** ``copy`` (a full fine-tune): a frozen copy sharded like the policy, so
  each rank holds its parameter shards once more (no gradients, no optimizer state); ``adapters``
  (LoRA): nothing, the base is the reference with the adapters off; ``precomputed``: two float64
  log-probs per pair on the host, nothing on the device.

``dpo_breakdown`` is the language-model breakdown at ``2B`` sequences plus the reference's bytes;
``plan --objective dpo`` can call it where it calls ``memory_breakdown``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardwise.errors import ConfigError
from shardwise.plan.memory import MemoryBreakdown, memory_breakdown

REFERENCES = ("copy", "adapters", "precomputed")
PRECOMPUTED_BYTES_PER_PAIR = 16  # chosen and rejected log-probs, float64


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
