"""The learning rate at each optimizer step: linear warm-up, then cosine, linear, constant or WSD.

A pure function of the step (no state to checkpoint): resuming at step s gives the same rate as
the uninterrupted run. With warm-up W, steps T, peak ``lr`` and floor ``min_lr`` (``[train]``),
for s < W the rate is lr * (s + 1) / W; after it, with p = (s - W) / max(1, T - W) clipped to 1:

* cosine:   min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
* linear:   min_lr + (lr - min_lr) * (1 - p)
* constant: lr
* wsd (warm-up, stable, decay): lr until the last ``decay_fraction`` of the T steps, then linear
  to min_lr over those D = round(decay_fraction * T) steps: min_lr + (lr - min_lr) * (1 - q),
  q = (s - (T - D)) / D clipped to 1. A stable phase can be extended and decayed later (MiniCPM).

Each param group may carry ``lr_ratio`` (Muon's own rate relative to train.lr): its rate is the
schedule's times that ratio.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.core.config import ScheduleConfig, TrainConfig


def lr_at(step: int, t: TrainConfig, s: ScheduleConfig | None = None) -> float:
    """Learning rate after ``step`` optimizer steps under schedule ``s`` (default: warm-up + cosine)."""
    name = s.name if s is not None else "cosine"
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if name == "constant":
        return t.lr
    if name == "wsd":
        assert s is not None
        decay = wsd_decay_steps(t.steps, s.decay_fraction)
        start = t.steps - decay
        if step < start:
            return t.lr
        q = min(1.0, (step - start) / decay)
        return t.min_lr + (1.0 - q) * (t.lr - t.min_lr)
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    if name == "linear":
        return t.min_lr + (1.0 - progress) * (t.lr - t.min_lr)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def wsd_decay_steps(steps: int, decay_fraction: float) -> int:
    """The number of decay steps at the end of a WSD schedule (at least one)."""
    return max(1, round(decay_fraction * steps))


def set_lr(param_groups: list[dict[str, Any]], step: int, t: TrainConfig, s: ScheduleConfig | None = None) -> None:
    """Write the rate for ``step`` into every param group (times the group's ``lr_ratio``, if any)."""
    lr = lr_at(step, t, s)
    for group in param_groups:
        ratio = group.get("lr_ratio", 1.0)
        group["lr"] = lr if ratio == 1.0 else lr * ratio


def check_schedule(t: TrainConfig, s: ScheduleConfig) -> None:
    """Raise ConfigError where the schedule's phases do not fit in train.steps."""
    if s.name == "wsd":
        decay = wsd_decay_steps(t.steps, s.decay_fraction)
        if t.steps - decay < t.warmup_steps:
            raise ConfigError(
                f"schedule 'wsd': the decay phase (schedule.decay_fraction = {s.decay_fraction:g} of "
                f"train.steps = {t.steps}, {decay} steps) overlaps the warm-up (train.warmup_steps = "
                f"{t.warmup_steps}); lower decay_fraction or warmup_steps, or raise steps.")
