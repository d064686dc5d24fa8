"""``shardwise profile RUN_DIR``: the top ops and the compute / communication / data split per rank.

For a run directory it first prints the run's per-rank step-phase table (summary.json's
``step_phases``, observe/step_phases.py: every run has it, profiled or not), then reads the traces
a run with ``[profile] enabled = true`` wrote (``RUN_DIR/profile/rank*.pt.trace.json``)
or any torch.profiler Chrome trace file(s) given directly.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from shardwise.errors import ConfigError
from shardwise.observe.phase_table import format_table
from shardwise.observe.trace import format_summary, load_trace, summarize

_RANK_RE = re.compile(r"rank(\d+)\.pt\.trace\.json(\.gz)?$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="summarise a run's profiler traces (top ops, comm/compute/data)",
                       description="Print, per rank, each profiled step split into compute, data "
                       "loading, exposed communication and other time, the collectives, and the "
                       "top operators by self time. Record traces with --set profile.enabled=true.")
    p.add_argument("paths", nargs="+", metavar="RUN_DIR_OR_TRACE",
                   help="a run directory (reads RUN_DIR/profile/rank*.pt.trace.json) or trace files")
    p.add_argument("--top", type=int, default=15, help="operators to list per rank (default 15)")
    p.add_argument("--rank", type=int, action="append", default=None,
                   help="only this rank (repeatable; default: every rank with a trace)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def step_phase_tables(paths: list[str]) -> dict[str, dict]:
    """Run directory -> its summary.json's per-rank step-phase table, for the run directories in ``paths``."""
    tables = {}
    for raw in paths:
        summary = Path(raw) / "summary.json"
        if summary.is_file():
            try:
                table = json.loads(summary.read_text()).get("step_phases")
            except (OSError, ValueError):
                continue
            if table:
                tables[raw] = table
    return tables


def _has_traces(raw: str) -> bool:
    path = Path(raw)
    if path.is_file():
        return True
    folder = path / "profile" if (path / "profile").is_dir() else path
    return folder.is_dir() and any(_RANK_RE.search(p.name) for p in folder.iterdir())


def find_traces(paths: list[str]) -> list[Path]:
    """The trace files named by ``paths`` (run directories or files), rank order for run dirs."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            found.append(path)
            continue
        if not path.is_dir():
            raise ConfigError(f"{raw!r} is neither a run directory nor a trace file.")
        folder = path / "profile" if (path / "profile").is_dir() else path
        traces = [p for p in folder.iterdir() if _RANK_RE.search(p.name)]
        if not traces:
            raise ConfigError(f"no profiler traces (rank<R>.pt.trace.json) in {str(folder)!r}. Record "
                              "them with: shardwise train ... --set profile.enabled=true "
                              "[--set profile.start_step=3 --set profile.end_step=5].")
        found += sorted(traces, key=lambda p: int(_RANK_RE.search(p.name).group(1)))
    return found


def run(args: argparse.Namespace) -> int:
    if args.top < 0:
        raise ConfigError(f"--top must be >= 0, got {args.top}.")
    tables = step_phase_tables(args.paths)
    if tables and not args.json:
        for run_dir, table in tables.items():
            print(f"{run_dir}: step phases per rank (ms per step)\n{format_table(table)}\n")
    if tables and not any(_has_traces(p) for p in args.paths):
        if args.json:
            print(json.dumps({"step_phases": tables}, indent=2))
        return 0  # a run without profiler traces: its step-phase table is the profile there is
    summaries = []
    for path in find_traces(args.paths):
        summary = summarize(load_trace(path), top=args.top)
        if args.rank is None or summary["rank"] in args.rank:
            summaries.append({"trace": str(path), **summary})
    if not summaries:
        raise ConfigError(f"no trace of rank(s) {args.rank} among {', '.join(args.paths)}.")
    if args.json:
        print(json.dumps(summaries, indent=2))
        return 0
    for s in summaries:
        print(f"{s['trace']}\n{format_summary(s)}\n")
    print("compute: an operator runs; data: waiting for the data loader; comm(exposed): a collective "
          "is in flight or waited on and nothing computes; comm in flight: all collective time, "
          "overlapped or not. Open a trace in ui.perfetto.dev for the timeline.")
    return 0
