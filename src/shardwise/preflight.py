"""Checks run once in the launching process, before any rank starts.

A bad strategy/world-size combination, a missing data file or a model whose shape does not fit
the tensor/pipeline degrees would otherwise surface as N copies of the same traceback, possibly
after minutes of start-up. ``train`` and ``verify`` both call :func:`check_run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardwise.errors import ShardwiseError

if TYPE_CHECKING:
    from shardwise.config import RunConfig
    from shardwise.parallel.base import Strategy
    from shardwise.workloads import Workload


def check_run(cfg: RunConfig, world_size: int) -> tuple[Strategy, Workload]:
    """Validate ``cfg`` for ``world_size`` ranks; return the strategy and the built workload.

    Sets ``cfg.parallel.strategy`` to the canonical strategy name. Raises ConfigError (or
    another ShardwiseError) with a message naming what is wrong.
    """
    from shardwise.parallel.registry import get_strategy
    from shardwise.workloads import build_workload

    strategy = get_strategy(cfg.parallel.strategy, world_size)
    strategy.check(world_size, cfg.parallel)
    cfg.parallel.strategy = strategy.name
    # Building the datasets reports a missing or malformed data file here, once.
    workload = build_workload(cfg.model, cfg.data)
    check_model_shape(strategy, workload, world_size, cfg)
    return strategy, workload


def check_model_shape(strategy: Strategy, workload: Workload, world_size: int, cfg: RunConfig) -> None:
    """Run the strategy's shape check (heads divisible by tp, layers by stages...) on a meta model."""
    try:
        # The meta device allocates nothing, so even a 70B model is checked in milliseconds.
        with torch.device("meta"):
            model = workload.build_model()
    except ShardwiseError:
        raise
    except Exception:  # noqa: BLE001 - a user factory that cannot build on meta
        # Some factories cannot run on the meta device (they fill weights from numpy, say); the
        # same check still runs on every rank inside ``Strategy.apply``.
        return
    strategy.check_model(model, world_size, cfg.parallel)
