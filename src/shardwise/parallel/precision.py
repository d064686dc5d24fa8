"""Precision modes, in one place: what each means under autocast and under FSDP2.

=============  ===============================  ===================================================
mode           replicated strategies             FSDP2 strategies (fsdp, zero2, hsdp, fsdp-offload)
=============  ===============================  ===================================================
fp32           float32 everywhere                float32 everywhere
bf16-mixed     torch.autocast(bfloat16)          MixedPrecisionPolicy(param=bf16, reduce=fp32)
fp16-mixed     torch.autocast(float16) + scaler  MixedPrecisionPolicy(param=fp16, reduce=fp32)
                                                 + ShardedGradScaler (found-inf all-reduced)
bf16-true      parameters stored in bfloat16     parameters stored (and sharded) in bfloat16
=============  ===============================  ===================================================

The master weights and optimizer state stay float32 in the mixed modes; gradients are reduced in
float32 under FSDP2 (torchtitan's default), so the all-reduce/reduce-scatter adds no bf16 rounding.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from shardwise.errors import ConfigError

COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """Return the low-precision compute dtype of a mixed mode, or None for fp32/bf16-true."""
    return COMPUTE_DTYPES.get(precision)


def storage_dtype(precision: str) -> torch.dtype | None:
    """Return the dtype parameters are stored in when it is not float32 (bf16-true), else None."""
    return torch.bfloat16 if precision == "bf16-true" else None


def fsdp_mp_policy(precision: str) -> object:
    """Return the FSDP2 MixedPrecisionPolicy for ``precision`` (a no-op policy for fp32/bf16-true)."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    # Compute in low precision, reduce gradients in fp32: the sharded fp32 gradients then equal
    # what DDP's fp32 all-reduce of autocast gradients produces, up to summation order.
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def check_precision(precision: str, device_type: str | None = None) -> None:
    """Raise ConfigError when ``precision`` cannot run on this machine's accelerator."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    needs_bf16 = precision in ("bf16-mixed", "bf16-true")
    if device_type == "cuda" and needs_bf16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision {precision!r} needs bfloat16, which this GPU "
            f"({torch.cuda.get_device_name()}) does not support (bf16 needs compute capability 8.0+, "
            "e.g. A100/H100). Use precision = 'fp16-mixed' (with loss scaling) or 'fp32'."
        )
