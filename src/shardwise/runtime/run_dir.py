"""The files one run writes, rank 0 only: config.toml, metrics.jsonl (and its sinks), summary.json.

The run directory's names are ``run_files``; claiming and locking a directory for a job is the
launcher's (``job/rundir.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.core.config import RunConfig, to_toml
from shardwise.core.run_files import CHECKPOINTS_DIR, default_run_dir
from shardwise.fsutil import atomic_write_text


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write null so every line stays valid JSON for other tools.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDir:
    """Files of one run. Only the rank with ``enabled=True`` (rank 0) writes."""

    def __init__(self, path: str | Path, enabled: bool = True) -> None:
        self.path = Path(path) if path else default_run_dir("run", "local")
        self.enabled = enabled
        if enabled:
            self.path.mkdir(parents=True, exist_ok=True)
        self._metrics = None
        # Also called with every record written to metrics.jsonl (experiment trackers).
        self.sinks: list[Callable[[dict[str, Any]], None]] = []

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    def write_config(self, cfg: RunConfig) -> None:
        if self.enabled:
            atomic_write_text(self.path / "config.toml", to_toml(cfg), durable=True)

    def log_metrics(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._metrics is None:
            self._metrics = open(self.path / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        clean = {k: _clean(v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()
        for sink in self.sinks:
            sink(clean)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            body = json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2)
            atomic_write_text(self.path / "summary.json", body + "\n", durable=True)
