"""The names inside a run directory (torch-free; the launcher, the trainer, checkpoint lookup and a
pretrained-folder check all ask here, so the names have one owner below every layer)."""

from __future__ import annotations

# The one name of a run's checkpoint directory.
CHECKPOINTS_DIR = "checkpoints"
# What makes a directory "hold a run": any of these written by an earlier job.
RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", CHECKPOINTS_DIR)
