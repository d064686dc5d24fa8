"""Rehearse the planner's recommendations for big models at their real size on this machine.

    .venv/bin/python benchmarks/rehearse_plans.py [--only NAME] [--json OUT.json]

For each case the planner's top recommendation is rehearsed exactly as the command ``plan``
prints would run it (``plan --rehearse``): played ranks on fake cpu tensors in torch's fake
process group at the full world size, memory by kind next to the plan's per-rank prediction, with
each played rank's time and peak RSS. Where the recommendation is refused (a layout the fake group
cannot play, e.g. DDP, whose reducer's all-reduce yields no tensor there: docs/rehearse.md), its
refusal is printed and the case's fallback layout is rehearsed instead (named as such).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from shardwise.plan.cli import add_arguments, build_plan
from shardwise.rehearse.plan import rehearse_candidates
from shardwise.rehearse.report import format_text

# name -> plan arguments; "without" -> the plan flags that leave out what fake tensors cannot carry.
CASES = {
    "llama-3-8b on 8": (["--model", "llama-3-8b", "--gpus-per-node", "8", "--nodes", "1"], ["--cp", "1"]),
    "llama-3-70b on 4x8": (["--model", "llama-3-70b", "--gpus-per-node", "8", "--nodes", "4"], ["--cp", "1"]),
    "llama-3-405b on 64x8": (["--model", "llama-3-405b", "--gpus-per-node", "8", "--nodes", "64"],
                             ["--cp", "1", "--pp", "1"]),
    "mixtral-8x7b ep on 8x8": (["--model", "mixtral-8x7b", "--gpus-per-node", "8", "--nodes", "8"],
                               ["--cp", "1", "--pp", "1"]),
    "qwen3-30b-a3b ep on 8": (["--model", "qwen3-30b-a3b", "--gpus-per-node", "8", "--nodes", "1"],
                              ["--cp", "1", "--pp", "1"]),
}


def _plan(argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_plan(parser.parse_args(argv))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="run only the cases whose name contains this text")
    p.add_argument("--json", default="", help="also write every report to this JSON file")
    args = p.parse_args()
    out = {}
    for name, (plan_args, without) in CASES.items():
        if args.only and args.only not in name:
            continue
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        rows = rehearse_candidates(_plan(plan_args), 1)
        if rows and rows[0]["outcome"] == "refused":
            print(f"### {name}: the recommendation {rows[0]['candidate']} is refused: {rows[0]['verdict']}")
            name = f"{name} (best layout with {' '.join(without)})"
            rows = rehearse_candidates(_plan(plan_args + without), 1)
        wall = time.perf_counter() - t0
        print(f"### {name}: {wall:.0f} s wall (load average {load:.1f} at the start)")
        for row in rows:
            if "report" in row:
                print(format_text(row["report"]))
            else:
                print(f"{row['candidate']}: {row['outcome']}: {row['verdict']}")
        out[name] = {"wall_s": wall, "load_average": load, "rows": rows}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
