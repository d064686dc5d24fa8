"""shardwise's log lines go through the standard ``logging`` module, logger ``"shardwise"``.

Rank 0 speaks by default (N ranks would print every line N times); ``[log] all_ranks = true`` (or
``configure(rank, all_ranks=True)``) lets every rank speak, each line tagged ``[rank R]``. Results
(the final losses, a text sample) are not logs: ``Session.print`` writes them to stdout.

Route or silence the lines like any library's:

    import logging
    logging.getLogger("shardwise").setLevel(logging.WARNING)       # silence progress lines
    logging.getLogger("shardwise").addHandler(logging.FileHandler("train.log"))

or ``[log] level = "warning"`` in a recipe. shardwise adds its own stderr handler (``[HH:MM:SS]
message``) only when the ``shardwise`` logger has no handler; while that handler is attached the
records do not propagate to the root logger (no double lines under ``logging.basicConfig``). To
route them yourself, add your handler to ``logging.getLogger("shardwise")`` before the Session is
created (then shardwise adds none and leaves propagation alone).
"""

from __future__ import annotations

import logging
import sys

from shardwise.core.config import LOG_LEVELS as LEVELS  # noqa: F401 - the valid ``level`` names

LOGGER_NAME = "shardwise"


class RankFilter(logging.Filter):
    """Passes records on rank 0 (or on every rank with ``all_ranks``) and tags them with the rank."""

    def __init__(self, rank: int, all_ranks: bool = False) -> None:
        super().__init__()
        self.rank = rank
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        record.rank_prefix = f"[rank {self.rank}] " if self.all_ranks else ""
        return self.all_ranks or self.rank == 0


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when a record is written (pytest, notebooks and
    tools that swap the stream keep getting the lines)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - mirrors logging.StreamHandler.stream
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # always the current sys.stderr


def _shardwise_handler() -> logging.Handler:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(rank_prefix)s%(message)s", "%H:%M:%S"))
    handler.set_name("shardwise-stderr")
    return handler


def is_configured() -> bool:
    """True when a rank filter is installed on the ``shardwise`` logger (``configure`` ran)."""
    return any(isinstance(f, RankFilter) for f in logging.getLogger(LOGGER_NAME).filters)


def configure(rank: int, *, level: str | None = None, all_ranks: bool = False) -> logging.Logger:
    """Set up the ``shardwise`` logger for this rank and return it.

    Replaces an earlier rank filter (one per process); ``level`` (one of ``LEVELS``) sets the
    logger's level, None keeps a level the application set (INFO when none is). Adds the stderr
    handler only when the logger has no handler (see the module docstring).
    """
    logger = logging.getLogger(LOGGER_NAME)
    for old in [f for f in logger.filters if isinstance(f, RankFilter)]:
        logger.removeFilter(old)
    rank_filter = RankFilter(rank, all_ranks)
    logger.addFilter(rank_filter)
    if level is not None:
        logger.setLevel(level.upper())
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    ours = [h for h in logger.handlers if h.get_name() == "shardwise-stderr"]
    if not logger.handlers:
        ours = [_shardwise_handler()]
        logger.addHandler(ours[0])
        logger.propagate = False  # the root's handlers (basicConfig) would print each line again
    for handler in ours:
        # Records of child loggers ("shardwise.x") skip the parent's filters; the handler's own
        # copy tags and filters them too.
        for old in [f for f in handler.filters if isinstance(f, RankFilter)]:
            handler.removeFilter(old)
        handler.addFilter(rank_filter)
    return logger
