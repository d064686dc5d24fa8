"""A played rank's measured bytes next to the planner's prediction for the same rank.

The prediction is ``train --dry-run``'s (``job.train.dry_run_prediction``), one ``RankPrediction``
per rank. Each column is read where it is largest (``measure``): model state after the optimizer
step, activations after the forward, the total at the peak, and transients as the peak less
those (``transient_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Column -> (the moment it is read, the bound on |measured - predicted| / predicted). Model state
# is exact arithmetic over tensor shapes (padding, stage split included), so it must agree closely;
# activations and transients depend on which ops save what, which the planner models coarsely.
BOUNDS: dict[str, tuple[str, float]] = {
    "param_bytes": ("after_step", 0.02),
    "grad_bytes": ("after_step", 0.02),
    "optim_bytes": ("after_step", 0.02),
    "activation_bytes": ("after_forward", 0.15),
    "transient_bytes": ("derived", 0.15),
    "peak_bytes": ("peak", 0.15),
}


@dataclass(frozen=True)
class Row:
    column: str
    predicted: int
    measured: int
    bound: float

    @property
    def diff_pct(self) -> float | None:
        """(measured - predicted) / |predicted| in percent; None when nothing was predicted.

        The plan's transients are negative where its peak holds less than the state it counts (a
        step of one micro-batch: no gradient shard exists before the first reduce-scatter), and so
        are the measured ones there: the difference is taken against the plan's magnitude."""
        return None if self.predicted == 0 else 100.0 * (self.measured - self.predicted) / abs(self.predicted)

    @property
    def within(self) -> bool:
        if self.predicted == 0:
            return self.measured == 0
        return abs(self.measured - self.predicted) <= self.bound * abs(self.predicted)

    def to_dict(self) -> dict[str, Any]:
        return {"column": self.column, "predicted": self.predicted, "measured": self.measured,
                "diff_pct": None if self.diff_pct is None else round(self.diff_pct, 2),
                "bound_pct": round(100 * self.bound, 1), "within": self.within}


def compare_rank(prediction: Any, result: dict[str, Any]) -> list[Row]:
    """The rows for one played rank (empty when the planner made no prediction for it)."""
    by_rank = {r.rank: r for r in prediction.ranks} if prediction is not None else {}
    predicted = by_rank.get(result["rank"])
    if predicted is None or "memory" not in result:
        return []
    rows = []
    for column, (moment, bound) in BOUNDS.items():
        measured = transient_bytes(result["memory"]) if moment == "derived" else \
            int(result["memory"].get(moment, {}).get(column, 0))
        rows.append(Row(column, int(getattr(predicted, column)), measured, bound))
    return rows


def transient_bytes(memory: dict[str, Any]) -> int:
    """What the peak holds beyond the model state and the activations column: the peak less the
    persistent state (read after the optimizer step) less the activations saved by the forward
    (read after it; one micro-batch's on a pipeline rank, ``measure.MemoryProbe``).

    The planner's columns add up to its peak the same way: its transients include gathered
    (unsharded) parameters and no_sync's unsharded gradients, which the tracker files as
    parameters and gradients, a pipeline rank's other micro-batches in flight, which the tracker
    files as activations, and a checkpointed block's recomputation, which it files as activations
    too; and the saved activations a backward has freed by the peak count against them
    (``plan.memory._peak_moment``). Until 2026-11-27 the peak's own activations were subtracted
    on a rank without a pipeline: the three measured columns then added up to more than the peak.
    """
    peak, state = memory.get("peak", {}), memory.get("after_step", {})
    persistent = sum(int(state.get(c, 0)) for c in ("param_bytes", "grad_bytes", "optim_bytes"))
    saved = memory.get("after_forward", {})
    return int(peak.get("peak_bytes", 0)) - persistent - int(saved.get("activation_bytes", 0))
