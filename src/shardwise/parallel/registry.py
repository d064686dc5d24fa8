"""Which implementation runs a strategy: one per data-parallel kind, chosen by the table's row.

The table itself (names, aliases, degrees, dp kinds, families) lives in ``shardwise.strategies``
(torch-free, below config and layout); the names are re-exported here for callers that reach it
through ``shardwise.parallel``. ``get_strategy`` imports the torch implementations on first use so
that importing this package stays light (``shardwise plan`` answers without torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.families import LLAMA_LIKE, PP_FAMILIES, TP_FAMILIES
from shardwise.strategies import (
    ALIASES,
    COMPOSED_MESH,
    REGISTRY,
    StrategyInfo,
    canonical_strategy,
    composition_for,
    strategy_info,
    strategy_names,
)

if TYPE_CHECKING:
    from shardwise.layout import Layout
    from shardwise.parallel.base import Strategy

__all__ = ["ALIASES", "COMPOSED_MESH", "LLAMA_LIKE", "PP_FAMILIES", "REGISTRY", "TP_FAMILIES", "StrategyInfo",
           "canonical_strategy", "composition_for", "get_strategy", "strategy_info", "strategy_names"]


def get_strategy(layout: Layout) -> Strategy:
    """Return the implementation of the layout's strategy (``StrategyInfo.impl``), bound to it."""
    from shardwise.parallel import implementations  # torch: imported when a rank needs it

    return implementations.IMPLEMENTATIONS[layout.info.impl](layout)
