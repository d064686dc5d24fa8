"""Ten published training configurations through the planner, ``train --dry-run`` and the rehearsal.

    .venv/bin/python benchmarks/published_configs.py [--only NAME] [--ranks 0] [--no-rehearse] [--json OUT]

For each configuration the planner is run as a user would run it (``shardwise plan --model ... --gpu
... --nodes ... --seq ... --global-batch ...``; the degrees, strategy, checkpointing and micro-batch
are left to its search), its recommended ``shardwise train`` command is resolved as ``train
--dry-run`` resolves it (the real CLI parser, ``job.train.resolve_run``: config, layout, preflight on
the meta model; ``dry_run_prediction``: the per-rank ledger it prints), and then rehearsed
(``shardwise rehearse`` with the same arguments: the played ranks on fake cpu tensors in torch's
fake process group at the full world size). Printed per configuration: the command, the dry-run's
layout and predicted peak per played rank, the rehearsal's measured peak per played rank, the
verdict, and the time each half took.

The models and cluster shapes are published runs' (benchmarks/published_runs.json where one fits:
``source`` names it); the global batch is the run's where published, else stated as assumed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class Config:
    name: str
    model: str
    nodes: int  # of 8 H100 each
    seq: int
    global_batch: int
    source: str  # where the model / cluster / batch comes from
    pinned: tuple[str, ...] = ()  # degrees a published layout fixes (else the planner searches them)

    @property
    def plan(self) -> tuple[str, ...]:
        """The `shardwise plan` arguments a user gives."""
        return ("--model", self.model, "--gpu", "h100", "--nodes", str(self.nodes), "--seq", str(self.seq),
                "--global-batch", str(self.global_batch), *self.pinned)


CONFIGS = (
    # dense
    Config("llama-3-8b on 8 H100", "llama-3-8b", 1, 8192, 16,
           "torchtitan-bench-2412 tt-llama31-8b-h100-8gpu-sel-op (8 GPUs, local batch 2)"),
    Config("llama-3-70b on 4x8 H100", "llama-3-70b", 4, 8192, 32,
           "torchtitan-perf-2024 tt-llama3-70b-a100-64gpu-full (local batch 1; 32 GPUs here)"),
    Config("llama-3-70b on 8x8 H100", "llama-3-70b", 8, 8192, 64,
           "torchtitan-perf-2024 tt-llama3-70b-a100-64gpu-full (64 GPUs, local batch 1; on H100)"),
    Config("llama-3-405b 3-D on 32x8 H100", "llama-3-405b", 32, 8192, 64,
           "llama3-paper llama3-405b-h100-8192gpu-cp1-s8192's TP 8 x PP 16 (pinned: the published 3-D layout; "
           "left open, the planner picks fsdp(cp2)), on 256 GPUs, global batch 64 assumed",
           ("--tp", "8", "--pp", "16")),
    # mixture of experts
    Config("mixtral-8x7b on 8x8 H100", "mixtral-8x7b", 8, 4096, 256,
           "Mixtral of Experts (arXiv:2401.04088) model; 64 GPUs, seq 4096, global batch 256 assumed"),
    Config("qwen3-30b-a3b on 8 H100", "qwen3-30b-a3b", 1, 4096, 32,
           "Qwen3 technical report (arXiv:2505.09388) model; one node, global batch 32 assumed"),
    Config("qwen3-30b-a3b on 4x8 H100", "qwen3-30b-a3b", 4, 4096, 128,
           "Qwen3 model; 32 GPUs, global batch 128 assumed"),
    # long context
    Config("llama-3-8b at 32k on 8 H100", "llama-3-8b", 1, 32768, 8,
           "Llama 3 paper (arXiv:2407.21783) long-context stage; 8 GPUs, global batch 8 assumed"),
    Config("llama-3-8b at 128k on 2x8 H100", "llama-3-8b", 2, 131072, 4,
           "Llama 3 paper: 128K context with cp (llama3-405b-h100-16384gpu-cp16-s131072's seq); 8B on 16 GPUs"),
    Config("qwen3-30b-a3b at 32k on 8 H100", "qwen3-30b-a3b", 1, 32768, 8,
           "megatron-moe-modelzoo long-context table (MoE with cp and ep), scaled to Qwen3-30B-A3B on 8 GPUs"),
)


def plan_of(config: Config) -> Any:
    """The plan ``shardwise plan <config.plan>`` computes (the CLI's own parser and builder)."""
    from shardwise.plan.cli import add_arguments, build_plan

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_plan(parser.parse_args(list(config.plan)))


def train_words(command: str) -> list[str]:
    """The argv of a printed ``shardwise train ...`` command, as a shell passes it."""
    words = shlex.split(command.replace("$MASTER_ADDR", "10.0.0.1"), comments=True)
    if words[:2] != ["shardwise", "train"]:
        raise ValueError(f"not a shardwise train command: {command}")
    return words[2:]


def dry_run(command: str) -> Any:
    """(the run ``train --dry-run`` resolves for ``command``, its per-rank prediction)."""
    from shardwise.cli import build_parser
    from shardwise.job.train import dry_run_prediction, resolve_run

    args = build_parser().parse_args(["train", *train_words(command), "--dry-run"])
    run = resolve_run(args)
    return run, dry_run_prediction(run)


def rehearse(command: str, gpu_name: str, ranks: str, steps: int, rank_timeout: float) -> dict[str, Any]:
    """The rehearsal report of ``command`` (``shardwise rehearse`` with the same arguments)."""
    from shardwise.cli import build_parser
    from shardwise.rehearse.cli import rehearse as play

    words = train_words(command)
    # rehearse takes --nnodes N and no rendezvous flags; the rest is train's.
    nnodes, keep, i = 1, [], 0
    while i < len(words):
        if words[i] == "--nnodes":
            nnodes, i = int(words[i + 1]), i + 2
        elif words[i] in ("--rdzv-endpoint", "--node-rank"):
            i += 2
        else:
            keep.append(words[i])
            i += 1
    argv = ["rehearse", *keep, "--nnodes", str(nnodes), "--gpu", gpu_name, "--steps", str(steps),
            "--rank-timeout", str(rank_timeout)]
    if ranks:
        argv += ["--ranks", ranks]
    return play(build_parser().parse_args(argv))


def run_config(config: Config, *, ranks: str, steps: int, do_rehearse: bool,
               rank_timeout: float = 3600.0) -> dict[str, Any]:
    out: dict[str, Any] = {"name": config.name, "source": config.source,
                           "plan": "shardwise plan " + " ".join(config.plan)}
    t0 = time.perf_counter()
    plan = plan_of(config)
    out["plan_s"] = time.perf_counter() - t0
    if plan.recommended is None or not plan.commands:
        out.update(outcome="no recommendation", why=plan.warnings + plan.skipped[:3])
        return out
    best, command = plan.recommended, plan.commands[0]
    out.update(recommended=best.name, verdict=best.verdict, planned_peak_gib=best.memory.total / GIB,
               command=command)
    t0 = time.perf_counter()
    try:
        run, prediction = dry_run(command)
    except Exception as e:  # reported by name: the command a user would copy fails
        out.update(outcome="dry-run failed", why=f"{type(e).__name__}: {e}", dry_run_s=time.perf_counter() - t0)
        return out
    out["dry_run_s"] = time.perf_counter() - t0
    out["dry_run_layout"] = run.layout.describe()
    out["dry_run_peak_gib"] = _peaks(prediction)
    if not do_rehearse:
        out["outcome"] = "dry-run ok"
        return out
    t0 = time.perf_counter()
    try:
        report = rehearse(command, plan.cluster.gpu.name, ranks, steps, rank_timeout)
    except Exception as e:
        out.update(outcome="rehearsal refused", why=f"{type(e).__name__}: {e}", rehearse_s=time.perf_counter() - t0)
        return out
    out["rehearse_s"] = time.perf_counter() - t0
    out["outcome"] = report["outcome"]
    out["rehearsal_verdict"] = report["verdict"]
    # Per played rank and ledger column (param, grad, optim, activ, transient, peak): planned vs measured.
    out["played"] = [{"rank": r.get("rank"), "wall_s": r.get("wall_s"), "refused": r.get("refused"),
                      "failed": r.get("failed"),
                      "columns": {c["column"].removesuffix("_bytes"): {
                          "planned_gib": c["predicted"] / GIB, "measured_gib": c["measured"] / GIB,
                          "diff_pct": c["diff_pct"], "within": c["within"]} for c in r.get("comparison", [])}}
                     for r in report["ranks"]]
    out["report"] = report
    return out


def _peaks(prediction: Any) -> dict[str, float]:
    """The dry-run's predicted peak per rank, runs of equal ranks merged ("0-7": 43.70)."""
    out: dict[str, float] = {}
    start = 0
    peaks = [r.peak_bytes / GIB for r in prediction.ranks]
    for i, peak in enumerate(peaks):
        if i + 1 == len(peaks) or peaks[i + 1] != peak:
            out[f"{start}-{i}" if i > start else str(start)] = peak
            start = i + 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="run only the configurations whose name contains one of these "
                   "comma-separated texts")
    p.add_argument("--skip", default="", help="leave out the configurations whose name contains this text")
    p.add_argument("--rank-timeout", type=float, default=3600.0, help="seconds per played rank (default 3600: "
                   "a 70B rank on a loaded 2-core machine takes minutes)")
    p.add_argument("--ranks", default="0", help="ranks to play ('' = the rehearsal's default roles; default 0)")
    p.add_argument("--steps", type=int, default=3, help="rehearsed steps (default 3, the rehearsal's least)")
    p.add_argument("--no-rehearse", action="store_true", help="plan and dry-run only")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    args = p.parse_args()
    results = []
    for config in CONFIGS:
        if (args.only and not any(o in config.name for o in args.only.split(","))) or \
                (args.skip and args.skip in config.name):
            continue
        load = os.getloadavg()[0]
        res = run_config(config, ranks=args.ranks, steps=args.steps, do_rehearse=not args.no_rehearse,
                         rank_timeout=args.rank_timeout)
        res["load_average"] = load
        results.append(res)
        print(f"### {config.name}  ({config.source}; load average {load:.1f})")
        print(f"  {res['plan']}")
        if "recommended" in res:
            print(f"  recommended {res['recommended']} ({res['verdict']}), planned peak "
                  f"{res['planned_peak_gib']:.2f} GiB; plan {res['plan_s']:.1f} s")
            print(f"  {res['command']}")
        if "dry_run_layout" in res:
            peaks = ", ".join(f"{k}: {v:.2f}" for k, v in res["dry_run_peak_gib"].items())
            print(f"  dry-run ok in {res['dry_run_s']:.1f} s: {res['dry_run_layout']}; peak GiB per rank {peaks}")
        for r in res.get("played", []):
            cols = "; ".join(f"{k} {v['planned_gib']:.2f}/{v['measured_gib']:.2f}"
                             f"{'' if v['within'] else ' OUTSIDE'}" for k, v in r["columns"].items())
            print(f"  rank {r['rank']} ({r['wall_s'] or 0:.0f} s) planned/rehearsed GiB: {cols or r}")
        if "rehearse_s" in res:
            print(f"  rehearsal {res['outcome']} in {res['rehearse_s']:.0f} s: {res['rehearsal_verdict']}")
        if "why" in res:
            print(f"  {res['outcome']}: {res['why']}")
        sys.stdout.flush()
        if args.json:  # after each configuration: a long run killed midway keeps what it did
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(results, f, indent=2, default=str)
    failed = [r["name"] for r in results if r["outcome"] not in ("runs", "dry-run ok")]
    print(f"\n{len(results) - len(failed)} of {len(results)} passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
