"""Per-rank runtime: the Session, data loading, the built-in trainer, checkpoints, metrics."""
