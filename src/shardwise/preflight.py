"""Checks run once in the launching process, before any rank starts.

A bad strategy/world-size combination, a missing data file or a model whose shape does not fit
the tensor/pipeline degrees would otherwise surface as N copies of the same traceback, possibly
after minutes of start-up. ``train`` and ``verify`` both call :func:`check_run`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise.errors import ConfigError, ShardwiseError

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

    strategy = get_strategy(cfg.parallel.strategy, world_size)
    strategy.check(world_size, cfg.parallel)
    cfg.parallel.strategy = strategy.name
    # Building the datasets reports a missing or malformed data file here, once.
    workload = build_workload(cfg.model, cfg.data)
    model = meta_model(workload, builtin=cfg.model.kind != "custom")
    if model is not None:
        # Heads divisible by tp, no more stages than layers...; without a meta model the same
        # check still runs on every rank inside ``Strategy.apply``.
        strategy.check_model(model, world_size, cfg.parallel)
    return strategy, workload, model


def meta_model(workload: Workload, builtin: bool = False) -> nn.Module | None:
    """The workload's model on the meta device (allocates nothing), or None if it cannot be built there.

    A built-in model (gpt, cnn, hf) always builds on meta, so a failure there is a bad
    ``model.overrides`` value, reported as a ConfigError before any rank starts; so is a TypeError
    from a user factory (overrides it does not take). Otherwise a user factory may legitimately
    need real tensors (it fills weights from numpy), so it only returns None.
    """
    try:
        with torch.device("meta"):
            return workload.build_model()
    except ShardwiseError:
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        # A TypeError is a call that does not fit (an override the factory's **kwargs pass on to
        # a constructor that does not take it), not a factory that needs real tensors.
        if builtin or isinstance(e, TypeError):
            raise ConfigError(f"cannot build the model with these model.overrides: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:300] if str(e) else ''}. Check the values.") from None
        return None
