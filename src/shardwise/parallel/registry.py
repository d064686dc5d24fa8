"""Strategy names (and aliases) mapped to their implementations, Lightning-registry style."""

from __future__ import annotations

from shardwise.errors import unknown_choice
from shardwise.parallel.base import Strategy


def _registry() -> dict[str, type[Strategy]]:
    # Imported lazily so `shardwise plan` and config validation never import the heavy modules.
    from shardwise.parallel.ddp import DDPStrategy
    from shardwise.parallel.fsdp import FSDPOffloadStrategy, FSDPStrategy, HSDPStrategy, ZeRO2Strategy
    from shardwise.parallel.single import SingleStrategy
    from shardwise.parallel.zero1 import ZeRO1Strategy

    strategies: list[type[Strategy]] = [SingleStrategy, DDPStrategy, ZeRO1Strategy, ZeRO2Strategy,
                                        FSDPStrategy, HSDPStrategy, FSDPOffloadStrategy]
    from shardwise.parallel.composed import STRATEGIES as MODEL_PARALLEL

    strategies += MODEL_PARALLEL
    return {s.name: s for s in strategies}


ALIASES: dict[str, str] = {"zero3": "fsdp", "none": "single", "3d": "fsdp+tp+pp", "tp+pp": "fsdp+tp+pp"}


def strategy_names() -> list[str]:
    """Every accepted strategy name, aliases and 'auto' included."""
    return sorted([*_registry(), *(a for a, t in ALIASES.items() if t in _registry()), "auto"])


def canonical_strategy(name: str) -> str:
    """Return the canonical name for ``name`` ('auto' stays 'auto'); ConfigError lists valid ones."""
    name = ALIASES.get(name, name)
    if name == "auto" or name in _registry():
        return name
    raise unknown_choice("strategy", name, strategy_names())


def resolve_auto(name: str, world_size: int) -> str:
    """'auto' means ddp on several ranks and single on one."""
    if name != "auto":
        return name
    return "ddp" if world_size > 1 else "single"


def get_strategy(name: str, world_size: int) -> Strategy:
    """Return an instance of the strategy ``name`` (after alias and 'auto' resolution)."""
    return _registry()[resolve_auto(canonical_strategy(name), world_size)]()
