"""Rehearse the planner's recommendations for big models at their real size on this machine.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rehearse_plans.py [--only NAME] [--ranks R] [--json OUT.json]

For each case the planner's top recommendation (under the case's plan flags) is rehearsed exactly
as the command ``plan`` prints would run it (``plan --rehearse``): played ranks on fake cpu tensors
in torch's fake process group at the full world size, three steps (memory read over the first two:
the optimizer's state exists from the first step's end), memory by kind next to the plan's per-rank
prediction, with each played rank's time and peak RSS. Where the recommendation is refused (a
layout the fake group cannot play, e.g. DeepSpeed's engine: docs/rehearse.md; DDP and ZeRO-1 play
since 2026-11-28, with a stand-in for DDP's C++ reducer), its refusal is printed and the case's
fallback layout is rehearsed instead (named as such). Run one case at a time on a small machine: a
played 70B rank is minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from shardwise.plan.cli import add_arguments, build_plan
from shardwise.rehearse.plan import rehearse_candidates
from shardwise.rehearse.report import format_text

MIB = 2**20

# name -> (plan arguments, the flags of the fallback layout when the recommendation is refused,
# ``--set`` overrides after the recommendation's own). The cases: the 405B's is its best 3-D
# layout (the plan's top, fsdp cp 2, is 2-D), Mixtral's its best with expert parallel (the plan's top
# has none); Qwen3's top already has ep. The 405B's plan runs a batch of 64 split into 64 pipeline
# micro-batches; 8 of 8 are played (one sample each, as planned): the rehearsal's text has 244
# samples of 8,192 tokens, fewer than 8 data-parallel ranks x 64 (refused as such), and the 1F1B
# schedule holds min(pp, micro-batches) = 8 in flight on the first stage either way; the prediction
# compared is the rehearsed run's, and it takes 1/8 of the time.
CASES: dict[str, tuple[list[str], list[str], tuple[str, ...]]] = {
    "llama-3-8b on 8": (["--model", "llama-3-8b", "--gpus-per-node", "8", "--nodes", "1"], ["--cp", "1"], ()),
    "llama-3-70b on 4x8": (["--model", "llama-3-70b", "--gpus-per-node", "8", "--nodes", "4"], ["--cp", "1"], ()),
    "llama-3-405b 3-D on 64x8": (["--model", "llama-3-405b", "--gpus-per-node", "8", "--nodes", "64",
                                  "--pp", "8", "--tp", "8"], ["--cp", "1"], ("train.micro_batch_size=8",
                                                                     "parallel.pp_microbatches=8")),
    "mixtral-8x7b ep on 8x8": (["--model", "mixtral-8x7b", "--gpus-per-node", "8", "--nodes", "8", "--ep", "8"],
                               ["--cp", "1"], ()),
    "qwen3-30b-a3b ep on 8": (["--model", "qwen3-30b-a3b", "--gpus-per-node", "8", "--nodes", "1"],
                              ["--cp", "1"], ()),
}


def _plan(argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_plan(parser.parse_args(argv))


def _rehearse(flags: list[str], extra: tuple[str, ...], args: argparse.Namespace) -> list[dict]:
    """The plan's top recommendation under ``flags``, rehearsed (three steps, ``extra`` overrides)."""
    return rehearse_candidates(_plan(flags), 1, steps=3, ranks=args.ranks, rank_timeout=args.rank_timeout,
                               extra=extra)


def _columns(report: dict) -> list[str]:
    """One line per played rank: its times and RSS, and each column's measured / planned MiB."""
    lines = []
    for rank in report["ranks"]:
        if "comparison" not in rank or "memory" not in rank:
            continue
        steps = ", ".join(f"{s:.0f}" for s in rank["step_s"])
        cells = "; ".join(f"{c['column'].removesuffix('_bytes')} {c['measured'] / MIB:,.0f} / "
                          f"{c['predicted'] / MIB:,.0f} ({c['diff_pct']:+.1f} %{'' if c['within'] else ' OUTSIDE'})"
                          for c in rank["comparison"] if c["diff_pct"] is not None)
        lines.append(f"  rank {rank['rank']}: prepare {rank['prepare_s']:.0f} s, steps {steps} s, "
                     f"wall {rank['wall_s']:.0f} s, peak RSS {rank['peak_rss_bytes'] / 2**30:.2f} GiB; "
                     f"MiB measured / planned: {cells}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="run only the cases whose name contains this text")
    p.add_argument("--ranks", default="", help="ranks to play, as rehearse --ranks (default: one of each role)")
    p.add_argument("--rank-timeout", type=float, default=3600.0, help="seconds a played rank may take")
    p.add_argument("--json", default="", help="also write every report to this JSON file")
    args = p.parse_args()
    out = {}
    for name, (plan_args, without, extra) in CASES.items():
        if args.only and args.only not in name:
            continue
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        rows = _rehearse(plan_args, extra, args)
        if rows and rows[0]["outcome"] == "refused":
            print(f"### {name}: the recommendation {rows[0]['candidate']} is refused: {rows[0]['verdict']}")
            name = f"{name} (best layout with {' '.join(without)})"
            rows = _rehearse(plan_args + without, extra, args)
        wall = time.perf_counter() - t0
        print(f"### {name}: {wall:.0f} s wall (load average {load:.1f} at the start)")
        for row in rows:
            if "report" in row:
                print(format_text(row["report"]))
                print("\n".join(_columns(row["report"])))
            else:
                print(f"{row['candidate']}: {row['outcome']}: {row['verdict']}")
        out[name] = {"wall_s": wall, "load_average": load, "rows": rows}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
