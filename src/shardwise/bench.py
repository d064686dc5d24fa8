"""``shardwise bench``: the same workload under several strategies and plain reference loops, side by side.

Each shardwise strategy is a normal ``shardwise train`` run (its own run directory under the bench
folder), so the figures are exactly what users get. Reference implementations (``torch-ddp``,
``torch-fsdp2``, ``accelerate``, ``fabric``; see ``shardwise.reference``) train the same workload, data order
and seed with no shardwise code in their step, so each shardwise strategy's overhead against the
loop a user would write is a measured ratio. ``--repeat K`` runs K rounds, each round every
implementation once in turn (interleaved, so a slow minute on the machine hits all of them
alike), and reports medians with their min..max spread.

Written: ``bench.md`` (table + overhead ratios), ``bench.csv`` (table), ``bench.json`` (table,
ratios and every single run) and ``bench.png`` (throughput, peak memory per rank, final loss,
overhead).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from shardwise.core.config import load_config, to_toml
from shardwise.core.strategies import canonical_strategy
from shardwise.errors import ConfigError
from shardwise.fsutil import atomic_write_text
from shardwise.job.rundir import holds_run, lock_run_dir, move_run_aside
from shardwise.launch import LaunchSpec, torchrun_command
from shardwise.reference import PAIRS, REFERENCES, check_reference, installed, is_reference
from shardwise.runtime.identity import new_launch_id

COLUMNS = ("strategy", "impl", "world_size", "status", "runs", "tokens_per_s", "tokens_per_s_min",
           "tokens_per_s_max", "step_time_s", "peak_mib_per_rank", "model_state_mib_per_rank",
           "param_mib_per_rank", "grad_mib_per_rank", "optim_mib_per_rank", "final_train_loss",
           "final_val_loss", "overhead_ratio", "overhead_vs", "wall_s")
# Shown in bench.md (the CSV/JSON keep every column).
MD_COLUMNS = ("strategy", "impl", "world_size", "status", "runs", "tokens_per_s", "tokens_per_s_min",
              "tokens_per_s_max", "step_time_s", "peak_mib_per_rank", "model_state_mib_per_rank",
              "final_train_loss", "final_val_loss", "overhead_ratio", "overhead_vs")
# `--strategies classic`: the lab's table, single vs DDP vs FSDP2 vs the plain loops.
CLASSIC = ("single", "ddp", "fsdp", "torch-ddp", "torch-fsdp2", "accelerate", "fabric")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="compare strategies and plain PyTorch/Accelerate loops (table + plot)",
                       description="Train the same recipe under several shardwise strategies and "
                       "reference loops (torch-ddp, torch-fsdp2, accelerate, fabric) and compare throughput, "
                       "peak memory per rank, final loss and shardwise's overhead per step.")
    p.add_argument("recipe", nargs="?", default=None, metavar="RECIPE_OR_TOML")
    p.add_argument("--strategies", default="single,ddp",
                   help="comma-separated shardwise strategies and reference loops (torch-ddp, "
                   "torch-fsdp2, accelerate, fabric); 'classic' = " + ",".join(CLASSIC) + " (default: single,ddp)")
    p.add_argument("--nproc", type=int, default=2, help="ranks for every multi-rank run")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--repeat", type=int, default=1, metavar="K",
                   help="interleaved rounds; the table shows medians and min..max (default 1)")
    p.add_argument("--out", default=None,
                   help="folder for runs and the comparison files (default: runs/bench-<time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="reuse an --out holding an earlier bench: it is moved aside to OUT.old-<time> first")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=run)


def _holds_results(out: Path) -> bool:
    return holds_run(out) or (out / "bench.json").exists() or any(
        holds_run(child) for child in out.iterdir() if child.is_dir() and not child.is_symlink())


def _mib(value: float | None) -> float | None:
    return None if value is None else value / 2**20


def row_from_summary(strategy: str, summary: dict[str, Any] | None, status: str) -> dict[str, Any]:
    """One table row from a run's summary.json (memory figures from its ledger when present)."""
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(strategy=strategy, status=status, runs="1" if status == "ok" else "0/1",
               impl="reference" if is_reference(strategy) else "shardwise")
    if not summary:
        return row
    for key in ("world_size", "tokens_per_s", "step_time_s", "final_train_loss", "final_val_loss", "wall_s"):
        row[key] = summary.get(key)
    row["tokens_per_s_min"] = row["tokens_per_s_max"] = row["tokens_per_s"]
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


def _median(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(name: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the rows of one implementation's rounds: medians, tokens/s min..max."""
    ok = [r for r in rounds if r["status"] == "ok"]
    if not ok:
        row = dict(rounds[-1])
        row["runs"] = f"0/{len(rounds)}"
        return row
    row = {c: None for c in COLUMNS}
    row.update(strategy=name, impl=ok[0]["impl"], world_size=ok[0]["world_size"])
    failed = [r["status"] for r in rounds if r["status"] != "ok"]
    row["status"] = "ok" if not failed else failed[0]
    row["runs"] = str(len(rounds)) if not failed else f"{len(ok)}/{len(rounds)}"
    for key in COLUMNS:
        if key.endswith(("_s", "_mib_per_rank", "_loss")) or key == "tokens_per_s":
            row[key] = _median([r[key] for r in ok])
    speeds = [r["tokens_per_s"] for r in ok if r["tokens_per_s"] is not None]
    row["tokens_per_s_min"], row["tokens_per_s_max"] = (min(speeds), max(speeds)) if speeds else (None, None)
    return row


def overheads(rows: list[dict[str, Any]], runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """shardwise step time / plain loop step time for every (strategy, reference) pair in the table.

    ``ratio`` uses the median step times; ``round_min``/``round_max`` span the per-round ratios,
    i.e. how much the machine's noise moves it. Above 1: shardwise is slower.
    """
    by_name = {r["strategy"]: r for r in rows}
    out = []
    for strategy, refs in PAIRS.items():
        for ref in refs:
            a, b = by_name.get(strategy), by_name.get(ref)
            if not a or not b or not a["step_time_s"] or not b["step_time_s"]:
                continue
            per_round = [x["step_time_s"] / y["step_time_s"] for x, y in
                         ((rnd.get(strategy), rnd.get(ref)) for rnd in map(_index, runs))
                         if x and y and x["status"] == y["status"] == "ok" and y["step_time_s"]]
            out.append({"strategy": strategy, "reference": ref, "ratio": a["step_time_s"] / b["step_time_s"],
                        "round_min": min(per_round) if per_round else None,
                        "round_max": max(per_round) if per_round else None,
                        "loss_diff": (None if a["final_train_loss"] is None or b["final_train_loss"] is None
                                      else abs(a["final_train_loss"] - b["final_train_loss"]))})
    return out


def _index(round_rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["strategy"]: r for r in round_rows}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]], columns: tuple[str, ...] = MD_COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def overhead_lines(pairs: list[dict[str, Any]]) -> str:
    if not pairs:
        return ""
    lines = ["", "shardwise step time / plain loop step time (median; >1 = shardwise slower):", ""]
    for p in pairs:
        spread = (f" (rounds {p['round_min']:.3f}..{p['round_max']:.3f})"
                  if p["round_min"] is not None and p["round_min"] != p["round_max"] else "")
        diff = f"; final train loss differs by {p['loss_diff']:.2g}" if p["loss_diff"] is not None else ""
        lines.append(f"- {p['strategy']} / {p['reference']}: {p['ratio']:.3f}x{spread}{diff}")
    return "\n".join(lines) + "\n"


def write_outputs(rows: list[dict[str, Any]], out: Path, pairs: list[dict[str, Any]] | None = None,
                  runs: list[list[dict[str, Any]]] | None = None, note: str = "") -> list[Path]:
    """Write bench.md/.csv/.json (and bench.png when matplotlib is installed); return the paths."""
    pairs = pairs or []
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "bench.md", markdown_table(rows) + overhead_lines(pairs) + (f"\n{note}\n" if note else ""))
    atomic_write_text(out / "bench.json", json.dumps({"rows": rows, "overhead": pairs, "runs": runs or [],
                                                      "note": note}, indent=2) + "\n")
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    paths = [out / "bench.md", out / "bench.csv", out / "bench.json"]
    if _plot(rows, pairs, out / "bench.png"):
        paths.append(out / "bench.png")
    return paths


def _plot(rows: list[dict[str, Any]], pairs: list[dict[str, Any]], path: Path) -> bool:
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
    colors = ["#4c72b0" if r["impl"] == "shardwise" else "#dd8452" for r in ok]
    panels = [("tokens_per_s", "tokens/s (median, min..max)"), ("peak_mib_per_rank", "peak MiB per rank"),
              ("final_train_loss", "final train loss")]
    fig, axes = plt.subplots(1, 4 if pairs else 3, figsize=(17 if pairs else 13, 4.2))
    for ax, (key, title) in zip(axes, panels):
        values = [r[key] or 0 for r in ok]
        err = None
        if key == "tokens_per_s":
            err = [[v - (r["tokens_per_s_min"] or v) for v, r in zip(values, ok)],
                   [(r["tokens_per_s_max"] or v) - v for v, r in zip(values, ok)]]
        ax.bar(names, values, color=colors, yerr=err, capsize=3)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    if pairs:
        ax = axes[3]
        labels = [f"{p['strategy']}/{p['reference']}" for p in pairs]
        ax.bar(labels, [p["ratio"] for p in pairs], color="#55a868")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title("shardwise / plain step time")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("blue: shardwise strategies, orange: plain reference loops", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def build_args_for_test(argv: list[str]) -> argparse.Namespace:
    """Parse ``shardwise bench`` arguments (tests drive ``run`` with them)."""
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


# ------------------------------------------------------------------------------ running
def _parse_names(spec: str) -> tuple[list[str], list[str]]:
    """(names to run, notes); 'classic' expands, accelerate is skipped there when missing."""
    names, notes = [], []
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        if raw == "classic":
            for name in CLASSIC:
                if installed(name):
                    names.append(name)
                else:
                    notes.append(f"{name} skipped: not installed (pip install 'shardwise[{name}]')")
            continue
        if not is_reference(raw):
            canonical_strategy(raw)  # unknown names fail here, before anything runs
        names.append(raw)
    if not names:
        raise ConfigError("--strategies needs at least one name, e.g. --strategies single,ddp,fsdp,torch-ddp "
                          "(or 'classic').")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"--strategies lists {', '.join(duplicates)} more than once; use --repeat K instead.")
    return names, notes


def _train_sets(args: argparse.Namespace) -> list[str]:
    return [f"train.steps={args.steps}", "train.sample_tokens=0", "train.progress=false",
            # The final checkpoint is not part of what is compared; the user may turn it back on.
            "checkpoint.at_end=false", *args.overrides]


def _command(name: str, args: argparse.Namespace, run_dir: Path) -> tuple[list[str], int]:
    """The command that runs ``name`` into ``run_dir``, and its rank count."""
    if is_reference(name):
        cmd = torchrun_command(LaunchSpec(nproc=args.nproc),
                               ["-m", REFERENCES[name], str(run_dir / "config.toml"), "--out", str(run_dir)])
        return cmd, args.nproc
    nproc = 1 if canonical_strategy(name) == "single" else args.nproc
    cmd = [sys.executable, "-m", "shardwise", "train", *([args.recipe] if args.recipe else []),
           "--strategy", name, "--nproc", str(nproc), "--out", str(run_dir)]
    for item in _train_sets(args):
        cmd += ["--set", item]
    return cmd, nproc


def run(args: argparse.Namespace) -> int:
    from shardwise.runtime.auto import peer_defaults  # defers torch

    names, notes = _parse_names(args.strategies)
    limits = (("nproc", args.nproc, 4096), ("steps", args.steps, 10**9), ("repeat", args.repeat, 1000))
    bad = [f"--{k} must be between 1 and {hi}, got {v}" for k, v, hi in limits if not 1 <= v <= hi]
    if bad:
        raise ConfigError("; ".join(bad) + ".")
    # The workload every run shares, resolved once: a bad recipe or --set fails here, and the
    # reference loops read exactly this config.
    cfg = load_config(args.recipe, _train_sets(args))
    for name in names:
        if is_reference(name):
            check_reference(name, peer_defaults(cfg))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    lock = lock_run_dir(args.out or f"runs/bench-{stamp}", new_launch_id(), "shardwise bench")
    try:
        out = lock.run_dir
        if _holds_results(out):
            if not args.overwrite:
                raise ConfigError(f"{out} already holds runs or results of an earlier bench; choose another "
                                  "--out, or pass --overwrite to move them aside first (nothing is deleted).")
            print(f"bench: moved the earlier results in {out} to {move_run_aside(out)}.", file=sys.stderr)
        return _run_rounds(args, names, notes, cfg, out)
    finally:
        lock.release()


def _run_rounds(args: argparse.Namespace, names: list[str], notes: list[str], cfg: Any, out: Path) -> int:
    """Run every implementation once per round into ``out``; write and print the comparison."""
    from shardwise.runtime.auto import peer_defaults  # defers torch

    runs: list[list[dict[str, Any]]] = []
    for k in range(args.repeat):
        round_rows = []
        for name in names:  # interleaved: every implementation once per round
            run_dir = out / name.replace("+", "_") / (f"round{k + 1}" if args.repeat > 1 else "")
            cmd, nproc = _command(name, args, run_dir)
            if is_reference(name):
                run_dir.mkdir(parents=True, exist_ok=True)
                # The reference loops run "auto" settings at their own defaults (fp32, eager).
                (run_dir / "config.toml").write_text(to_toml(peer_defaults(cfg)))
            print(f"bench: {name} on {nproc} rank(s), round {k + 1}/{args.repeat} ...", file=sys.stderr, flush=True)
            summary_path = run_dir / "summary.json"
            summary_path.unlink(missing_ok=True)  # a failed run must not report an earlier run's figures
            env = dict(os.environ)
            if is_reference(name):
                env.setdefault("OMP_NUM_THREADS", "1")  # what `shardwise train` gives its torchrun ranks
            proc = subprocess.run(cmd, env=env)
            summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
            status = "ok" if proc.returncode == 0 and summary else f"failed ({proc.returncode})"
            round_rows.append(row_from_summary(name, summary, status))
        runs.append(round_rows)
    rows = [aggregate(name, [rnd[i] for rnd in runs]) for i, name in enumerate(names)]
    pairs = overheads(rows, runs)
    for p in pairs:
        row = next(r for r in rows if r["strategy"] == p["strategy"])
        if row["overhead_vs"] is None:  # the first reference listed for it (torch-ddp before accelerate)
            row["overhead_ratio"], row["overhead_vs"] = p["ratio"], p["reference"]
    note = "; ".join([f"{args.repeat} interleaved round(s), {args.steps} steps, {args.nproc} rank(s), "
                      f"{os.cpu_count()} CPU core(s) visible", *notes])
    paths = write_outputs(rows, out, pairs, runs, note)
    print(markdown_table(rows) + overhead_lines(pairs))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r["status"] == "ok" for r in rows) else 1
