"""Where each optimizer runs: torch-free, so the planner asks the runtime's own rule (optim/build.py
re-exports it for the trainer)."""

from __future__ import annotations

from typing import Any

from shardwise.core.config import OptimizerConfig
from shardwise.errors import ConfigError

# Optimizers that reduce over whole matrices, so their state and step must be on the device.
DEVICE_STATE_OPTIMIZERS = ("muon", "adafactor")


def check_optimizer(o: OptimizerConfig, layout: Any) -> None:
    """Raise ConfigError where the optimizer cannot run on the layout's parameters.

    Muon and Adafactor reduce over whole matrices (Muon gathers each to an owner rank, Adafactor
    all-reduces its row/column statistics: optim/adafactor.py), which needs the parameters on the
    device: not under offload or a DeepSpeed engine.
    """
    engine = layout.info.impl in ("deepspeed", "zero3-offload", "zero3-nvme")
    if o.name not in DEVICE_STATE_OPTIMIZERS or not (layout.info.offload or engine):
        return
    if o.name == "adafactor":
        raise ConfigError(
            f"optimizer 'adafactor' does not run under strategy {layout.strategy!r}: its step all-reduces each "
            "sharded matrix's row/column statistics, which host-memory (or NVMe) state cannot do with the "
            "device's collectives, and a DeepSpeed engine hands its optimizer flat partitions rather than "
            "matrices. Use adafactor under single, ddp, zero1, zero2, fsdp, hsdp or the tp/pp/ep compositions.")
    raise ConfigError(
        f"optimizer 'muon' does not run under strategy {layout.strategy!r}: its state and step live in host "
        "memory (or on NVMe), where Muon's gather of each matrix to its owner rank cannot use the device's "
        "collectives, and a DeepSpeed engine hands its optimizer flat partitions rather than matrices. "
        "Use muon under single, ddp, zero1, zero2, fsdp, hsdp or the tp/pp/ep compositions.")
