"""One implementation per data-parallel kind; ``StrategyInfo.impl`` names the one a row runs.

The table itself (names, aliases, degrees, dp kinds, families) is ``shardwise.core.strategies`` (torch-free,
below config and layout); this module imports torch, so only a rank (or a check that builds one)
imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.parallel.base import Strategy
from shardwise.parallel.composed import ModelParallelStrategy
from shardwise.parallel.data.ddp import DDPStrategy
from shardwise.parallel.data.fsdp import FSDPStrategy
from shardwise.parallel.data.zero1 import ZeRO1Strategy
from shardwise.parallel.deepspeed.strategy import DeepSpeedStrategy, ZeRO3NVMeStrategy, ZeRO3OffloadStrategy

if TYPE_CHECKING:
    from shardwise.core.layout import Layout

IMPLEMENTATIONS: dict[str, type[Strategy]] = {
    "single": Strategy,
    "ddp": DDPStrategy,
    "zero1": ZeRO1Strategy,
    "fsdp": FSDPStrategy,  # fsdp, zero2, hsdp, fsdp-offload: the row's flags differ
    "model-parallel": ModelParallelStrategy,  # tp, pp and every composition with data parallel
    "deepspeed": DeepSpeedStrategy,  # the user's ds_config.json
    "zero3-offload": ZeRO3OffloadStrategy,
    "zero3-nvme": ZeRO3NVMeStrategy,
}


def get_strategy(layout: Layout) -> Strategy:
    """Return the implementation of the layout's strategy (``StrategyInfo.impl``), bound to it."""
    return IMPLEMENTATIONS[layout.info.impl](layout)
