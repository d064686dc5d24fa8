"""No parallelism: the reference every other strategy is checked against."""

from shardwise.parallel.base import Strategy


class SingleStrategy(Strategy):
    name = "single"
