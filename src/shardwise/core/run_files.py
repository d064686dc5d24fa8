"""The names inside a run directory (torch-free; the launcher, the trainer, checkpoint lookup and a
pretrained-folder check all ask here, so the names have one owner below every layer)."""

from __future__ import annotations

import datetime
from pathlib import Path

# The one name of a run's checkpoint directory.
CHECKPOINTS_DIR = "checkpoints"
# What makes a directory "hold a run": any of these written by an earlier job.
RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", CHECKPOINTS_DIR)


def default_run_dir(name: str, strategy: str) -> Path:
    """``runs/<name>-<strategy>-<timestamp>``: where a run without ``--out`` writes."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{strategy.replace('+', '_')}-{stamp}"
