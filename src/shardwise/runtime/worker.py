"""Per-rank entry point started by torchrun: ``python -m shardwise.runtime.worker RECIPE [...]``.

It takes the same arguments as ``shardwise train`` (recipe or TOML, --strategy, --set, --out), so
plain ``torchrun --nproc-per-node=N -m shardwise.runtime.worker gpt-shakespeare`` works too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from shardwise.errors import ShardwiseError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise.runtime.worker",
                                description="Train one rank (started by torchrun).")
    p.add_argument("recipe", nargs="?", default=None)
    p.add_argument("--strategy", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        from shardwise.config import load_config
        from shardwise.runtime.trainer import train

        overrides = list(args.overrides)
        if args.strategy:
            overrides.append(f"parallel.strategy={args.strategy}")
        cfg = load_config(args.recipe, overrides)
        # Every rank must agree on the run directory: without --out, name it after torchrun's
        # rendezvous id, which all ranks of one job share.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        out = args.out or cfg.out_dir or f"runs/{cfg.name}-{cfg.parallel.strategy.replace('+', '_')}-{run_id}"
        args.out = out
        # torchrun's restart count: a restarted attempt resumes from the run's latest checkpoint.
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        train(cfg, out, attempt=attempt)
        return 0
    except ShardwiseError as e:
        _report_failure(args.out, rank, str(e))
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return e.exit_code


def _report_failure(out: str | None, rank: int, message: str) -> None:
    # The launcher reads this to print one clear paragraph instead of torchrun's tracebacks.
    if not out:
        return
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"failure-rank{rank}.json").write_text(json.dumps({"rank": rank, "error": message}))
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
