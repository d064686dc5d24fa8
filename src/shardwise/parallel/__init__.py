"""Parallelism applied from outside the model: one small module per strategy, plus a registry."""

from shardwise.parallel.base import ParallelContext, Strategy
from shardwise.parallel.registry import canonical_strategy, get_strategy, strategy_names

__all__ = ["ParallelContext", "Strategy", "canonical_strategy", "get_strategy", "strategy_names"]
