"""The trainer's observation hooks: profiler and experiment trackers, at four points of a run.

    hooks = RunHooks(cfg, session)          # every rank: checks the tracker extras are installed
    hooks.start(run_dir, first_step)        # before the first step: trackers (rank 0), profiler
    hooks.step(step)                        # after each optimizer step: the profiler's schedule
    hooks.log(record)                       # each record written to metrics.jsonl -> trackers
    hooks.end(summary)                      # after the loop, or end(None, failed=True) on error

A user's own Session loop can drive the same object.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from shardwise.core.config import RunConfig, to_toml
from shardwise.observe.profiler import StepProfiler
from shardwise.observe.trackers import Tracker, check_trackers, open_trackers


class RunHooks:
    """Profiler + trackers for one rank of one run (trackers on rank 0 only)."""

    def __init__(self, cfg: RunConfig, session: Any) -> None:
        self.cfg = cfg
        self.session = session
        # On every rank, so a missing extra fails all ranks alike instead of rank 0 alone.
        check_trackers(cfg.log.trackers)
        self.trackers: list[Tracker] = []
        self.profiler: StepProfiler | None = None
        self._ended = False

    def _log(self, message: str) -> None:
        if self.session.is_main:
            self.session.log(message)
        else:  # a profiled rank other than 0 still says what it wrote
            print(f"[rank {self.session.rank}] {message}", file=sys.stderr, flush=True)

    def start(self, run_dir: str | Path, first_step: int) -> None:
        """Open the trackers (rank 0) and arm the profiler; ``first_step`` is the next step to run."""
        s = self.session
        if s.is_main and self.cfg.log.trackers:
            self.trackers = open_trackers(self.cfg.log, self.cfg, run_dir, to_toml(self.cfg),
                                          start_step=first_step - 1)
            s.log(f"trackers: {', '.join(t.name for t in self.trackers)} (rank 0)")
        self.profiler = StepProfiler(self.cfg.profile, run_dir, rank=s.rank, world_size=s.world_size,
                                     device=s.device, strategy=s.strategy_name, log=self._log)
        self.profiler.start(first_step)

    def step(self, step: int) -> None:
        """After optimizer step ``step``."""
        if self.profiler is not None:
            self.profiler.step(step)

    def log(self, record: dict[str, Any]) -> None:
        """One metrics record (the dict written to metrics.jsonl) for every tracker."""
        for tracker in self.trackers:
            tracker.log(record)

    def end(self, summary: dict[str, Any] | None, failed: bool = False) -> None:
        """Stop the profiler and close the trackers (idempotent; ``failed`` marks the runs failed)."""
        if self._ended:
            return
        self._ended = True
        trackers, self.trackers = self.trackers, []
        try:
            if self.profiler is not None:
                self.profiler.stop()
        finally:
            for tracker in trackers:
                tracker.close(summary, failed=failed)
