"""``shardwise bench``: the same workload under several strategies, side by side.

Each strategy is a normal ``shardwise train`` run (its own run directory under the bench folder),
so the figures are exactly what users get. The comparison is written as ``bench.md`` (table),
``bench.csv``, ``bench.json`` and ``bench.png`` (throughput, peak memory per rank, final loss).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

COLUMNS = ("strategy", "world_size", "status", "tokens_per_s", "step_time_s", "peak_mib_per_rank",
           "model_state_mib_per_rank", "param_mib_per_rank", "grad_mib_per_rank", "optim_mib_per_rank",
           "final_train_loss", "final_val_loss", "wall_s")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="compare strategies on the same workload (table + plot)",
                       description="Train the same recipe under several strategies and compare "
                       "throughput, peak memory per rank and final loss.")
    p.add_argument("recipe", nargs="?", default=None, metavar="RECIPE_OR_TOML")
    p.add_argument("--strategies", default="single,ddp",
                   help="comma-separated strategy names (default: single,ddp)")
    p.add_argument("--nproc", type=int, default=2, help="ranks for every multi-rank strategy")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per strategy")
    p.add_argument("--out", default=None,
                   help="folder for runs and the comparison files (default: runs/bench-<time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="reuse an --out holding an earlier bench: it is moved aside to OUT.old-<time> first")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=run)


def _holds_results(out: Path) -> bool:
    from shardwise.runtime.rundir import holds_run

    return holds_run(out) or (out / "bench.json").exists() or any(
        holds_run(child) for child in out.iterdir() if child.is_dir() and not child.is_symlink())


def _mib(value: float | None) -> float | None:
    return None if value is None else value / 2**20


def row_from_summary(strategy: str, summary: dict[str, Any] | None, status: str) -> dict[str, Any]:
    """One table row from a run's summary.json (memory figures from its ledger when present)."""
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(strategy=strategy, status=status)
    if not summary:
        return row
    for key in ("world_size", "tokens_per_s", "step_time_s", "final_train_loss", "final_val_loss", "wall_s"):
        row[key] = summary.get(key)
    ranks = (summary.get("memory") or {}).get("ranks") or []
    if ranks:
        peaks = [r.get("peak_bytes") for r in ranks if r.get("peak_bytes") is not None]
        states = [sum(r.get(k, 0) for k in ("param_bytes", "grad_bytes", "optim_bytes")) for r in ranks]
        row["peak_mib_per_rank"] = _mib(max(peaks)) if peaks else None
        row["model_state_mib_per_rank"] = _mib(max(states))
        # The largest rank for each kind (pipeline stages differ; sharded ranks differ by padding).
        for kind in ("param", "grad", "optim"):
            row[f"{kind}_mib_per_rank"] = _mib(max(r.get(f"{kind}_bytes", 0) for r in ranks))
    return row


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_outputs(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write bench.md/.csv/.json (and bench.png when matplotlib is installed); return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(markdown_table(rows))
    (out / "bench.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    paths = [out / "bench.md", out / "bench.csv", out / "bench.json"]
    if _plot(rows, out / "bench.png"):
        paths.append(out / "bench.png")
    return paths


def _plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return False
    names = [r["strategy"] for r in ok]
    panels = [("tokens_per_s", "tokens/s (median)"), ("peak_mib_per_rank", "peak MiB per rank"),
              ("final_train_loss", "final train loss")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, title) in zip(axes, panels):
        ax.bar(names, [r[key] or 0 for r in ok], color="#4c72b0")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    from shardwise.parallel.registry import canonical_strategy

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies:
        raise ConfigError("--strategies needs at least one name, e.g. --strategies single,ddp,fsdp.")
    for name in strategies:
        canonical_strategy(name)  # unknown names fail here, before anything runs
    if not 1 <= args.nproc <= 4096 or not 1 <= args.steps <= 10**9:
        raise ConfigError("--nproc (at most 4096) and --steps must be at least 1.")
    import datetime

    from shardwise.runtime.identity import new_launch_id
    from shardwise.runtime.rundir import lock_run_dir, move_run_aside

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    lock = lock_run_dir(args.out or f"runs/bench-{stamp}", new_launch_id(), "shardwise bench")
    try:
        out = lock.run_dir
        if _holds_results(out):
            if not args.overwrite:
                raise ConfigError(f"{out} already holds runs or results of an earlier bench; choose another "
                                  "--out, or pass --overwrite to move them aside first (nothing is deleted).")
            print(f"bench: moved the earlier results in {out} to {move_run_aside(out)}.", file=sys.stderr)
        return _run_all(args, strategies, out)
    finally:
        lock.release()


def _run_all(args: argparse.Namespace, strategies: list[str], out: Path) -> int:
    from shardwise.parallel.registry import canonical_strategy

    rows = []
    for name in strategies:
        nproc = 1 if canonical_strategy(name) == "single" else args.nproc
        run_dir = out / name.replace("+", "_")
        cmd = [sys.executable, "-m", "shardwise", "train", *([args.recipe] if args.recipe else []),
               "--strategy", name, "--nproc", str(nproc), "--out", str(run_dir),
               "--set", f"train.steps={args.steps}", "--set", "train.sample_tokens=0",
               "--set", "train.progress=false",
               # The final checkpoint is not part of what is compared; the user may turn it back on.
               "--set", "checkpoint.at_end=false"]
        for item in args.overrides:
            cmd += ["--set", item]
        print(f"bench: {name} on {nproc} rank(s) ...", file=sys.stderr, flush=True)
        summary_path = run_dir / "summary.json"
        summary_path.unlink(missing_ok=True)  # a failed run must not report an earlier run's figures
        proc = subprocess.run(cmd)
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        status = "ok" if proc.returncode == 0 and summary else f"failed ({proc.returncode})"
        rows.append(row_from_summary(name, summary, status))
    paths = write_outputs(rows, out)
    print(markdown_table(rows))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r["status"] == "ok" for r in rows) else 1
