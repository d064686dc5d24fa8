"""Optimizers and learning-rate schedules for the trainer and for a user's own Session loop.

``optim.names`` (no torch import: the config and the planner read it), ``optim.build`` (the
optimizer and its parameter groups from ``[optimizer]``), ``optim.schedule`` (the learning rate
at a step from ``[schedule]``), ``optim.muon`` (Muon + AdamW under any sharding).
"""
