"""Parallelism applied from outside the model: one small module per strategy, plus a registry.

The registry (``shardwise.parallel.registry``) is torch-free, so importing this package stays
light: the strategy classes are imported on first use.
"""

from shardwise.parallel.registry import REGISTRY, StrategyInfo, canonical_strategy, get_strategy, strategy_names

__all__ = ["REGISTRY", "ParallelContext", "Strategy", "StrategyInfo", "canonical_strategy", "get_strategy",
           "strategy_names"]


def __getattr__(name: str) -> object:  # Lazy: the base module imports torch.
    if name in ("ParallelContext", "Strategy"):
        from shardwise.parallel import base

        return getattr(base, name)
    raise AttributeError(name)
