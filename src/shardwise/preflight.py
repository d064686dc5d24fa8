"""Checks run once in the launching process, before any rank starts.

A bad strategy/world-size combination, a missing data file or a model whose shape does not fit
the tensor/pipeline degrees would otherwise surface as N copies of the same traceback, possibly
after minutes of start-up. ``train`` and ``verify`` both call :func:`check_run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise.errors import ShardwiseError

if TYPE_CHECKING:
    from shardwise.config import RunConfig
    from shardwise.parallel.base import Strategy
    from shardwise.workloads import Workload


def check_run(cfg: RunConfig, world_size: int) -> tuple[Strategy, Workload, nn.Module | None]:
    """Validate ``cfg`` for ``world_size`` ranks; return the strategy, the built workload and a
    meta-device copy of the model (None when the model's factory cannot build on meta).

    Sets ``cfg.parallel.strategy`` to the canonical strategy name. Raises ConfigError (or
    another ShardwiseError) with a message naming what is wrong.
    """
    from shardwise.parallel.registry import get_strategy
    from shardwise.workloads import build_workload

    check_observability(cfg, world_size)
    strategy = get_strategy(cfg.parallel.strategy, world_size)
    strategy.check(world_size, cfg.parallel)
    cfg.parallel.strategy = strategy.name
    # Building the datasets reports a missing or malformed data file here, once.
    workload = build_workload(cfg.model, cfg.data)
    model = meta_model(workload)
    if model is not None:
        # Heads divisible by tp, no more stages than layers...; without a meta model the same
        # check still runs on every rank inside ``Strategy.apply``.
        strategy.check_model(model, world_size, cfg.parallel)
    return strategy, workload, model


def check_observability(cfg: RunConfig, world_size: int) -> None:
    """Tracker extras installed, profiled ranks inside the world; raises ConfigError otherwise."""
    from shardwise.errors import ConfigError
    from shardwise.observe.trackers import check_trackers

    check_trackers(cfg.log.trackers)
    outside = [r for r in cfg.profile.ranks if r >= world_size]
    if cfg.profile.enabled and outside:
        raise ConfigError(f"profile.ranks names rank(s) {outside}, but the job has {world_size} rank(s) "
                          f"(0..{world_size - 1}); list ranks inside it, or [] for all.")


def meta_model(workload: Workload) -> nn.Module | None:
    """The workload's model on the meta device (allocates nothing), or None if it cannot be built there."""
    try:
        with torch.device("meta"):
            return workload.build_model()
    except ShardwiseError:
        raise
    except Exception:  # noqa: BLE001 - a user factory that cannot build on meta
        return None  # e.g. it fills weights from numpy
