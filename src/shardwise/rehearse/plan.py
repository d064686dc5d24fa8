"""``plan --rehearse [K]``: rehearse the planner's top K recommendations, each exactly as the
command the plan prints would run it (``plan.advice.train_settings``), and set each one's measured
peak beside the plan's."""

from __future__ import annotations

import argparse
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.plan.advice import train_settings
from shardwise.rehearse.cli import rehearse

GIB = 2**30


def rehearse_candidates(plan: Any, k: int, *, device: str = "cpu", steps: int = 3,
                        ranks: str = "", rank_timeout: float = 1800.0,
                        extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One row per rehearsed candidate (best first): its name, the plan's peak, the outcome, the
    measured peak of its highest played rank, and the rehearsal's verdict. ``ranks``: as
    ``rehearse --ranks`` (default: one of each role); ``extra``: ``--set`` overrides after the
    candidate's own (the prediction compared is the rehearsed run's, overrides included)."""
    if not plan.workload.recipe:
        raise ShardwiseError("plan --rehearse needs a model the runtime can build (--model, --hf-config or "
                             "--pretrained), not a bare parameter count.")
    rows = []
    for cand in [c for c in plan.candidates if c.verdict != "no"][:k]:
        args = argparse.Namespace(
            recipe=plan.workload.recipe, overrides=[*train_settings(cand, plan.workload), *extra],
            strategy=cand.layout.strategy,
            nproc=plan.cluster.gpus_per_node, nnodes=plan.cluster.nodes, gpu=plan.cluster.gpu.name, ranks=ranks,
            device=device, steps=steps, jobs=1, rank_timeout=rank_timeout, json=False)
        row: dict[str, Any] = {"candidate": cand.name, "planned_peak_bytes": int(cand.memory.total)}
        try:
            report = rehearse(args)
        except ShardwiseError as e:  # a layout the rehearsal refuses (what fake tensors cannot carry)
            rows.append({**row, "outcome": "refused", "measured_peak_bytes": None, "verdict": str(e)})
            continue
        peaks = [r["memory"]["peak"]["peak_bytes"] for r in report["ranks"] if "memory" in r]
        rows.append({**row, "outcome": report["outcome"], "measured_peak_bytes": max(peaks) if peaks else None,
                     "verdict": report["verdict"], "report": report})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = ["rehearsed (fake tensors at the full world size; measured = the highest played rank's peak):",
             f"  {'candidate':<34} {'planned_GiB':>11} {'measured_GiB':>12}  outcome"]
    for r in rows:
        measured = "-" if r["measured_peak_bytes"] is None else f"{r['measured_peak_bytes'] / GIB:.2f}"
        lines.append(f"  {r['candidate']:<34} {r['planned_peak_bytes'] / GIB:>11.2f} {measured:>12}  {r['outcome']}")
        lines.append(f"    {r['verdict']}")
    return "\n".join(lines)
