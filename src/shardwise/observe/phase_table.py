"""The per-rank step-phase table as text (``shardwise profile RUN``): torch-free, so the CLI that
prints a finished run's table starts without torch (``observe.step_phases`` measures the phases)."""

from __future__ import annotations

from typing import Any

PHASES = ("data", "forward", "backward", "collective", "optimizer", "checkpoint")


def format_table(table: dict[str, Any]) -> str:
    """The per-rank phase table as text (``shardwise profile RUN``), milliseconds per step."""
    phases = list(table.get("phases", PHASES))
    head = ["rank", "host", "steps", "step ms", *(f"{p} ms" for p in phases), "other ms"]
    lines = ["  ".join(f"{h:>10}" for h in head)]
    for row in table.get("ranks", []):
        cells = [str(row["rank"]), str(row["host"])[:10], str(row["steps"]), f"{row['step_s'] * 1e3:.1f}",
                 *(f"{row[f'{p}_s'] * 1e3:.1f}" for p in phases), f"{row['other_s'] * 1e3:.1f}"]
        lines.append("  ".join(f"{c:>10}" for c in cells))
    for named in table.get("slow_ranks", []):
        lines.append(f"slow: {named['message']}")
    if not table.get("slow_ranks"):
        lines.append("no rank was consistently slower than the others")
    return "\n".join(lines)
