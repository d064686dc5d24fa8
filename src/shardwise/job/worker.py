"""Per-rank entry point started by torchrun: ``python -m shardwise.job.worker RECIPE [...]``.

It takes the same arguments as ``shardwise train`` (recipe or TOML, --strategy, --set, --out), so
plain ``torchrun --nproc-per-node=N -m shardwise.job.worker gpt-shakespeare`` works too.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from shardwise.core.config import load_config
from shardwise.errors import ShardwiseError
from shardwise.fsutil import atomic_write_json
from shardwise.job.rundir import claim_run_dir
from shardwise.job.runlock import register_rank
from shardwise.runtime import lifeline
from shardwise.runtime.identity import JOB_ID_ENV, LAUNCH_ID_ENV, launch_id


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise.job.worker",
                                description="Train one rank (started by torchrun).")
    p.add_argument("recipe", nargs="?", default=None)
    p.add_argument("--strategy", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    # First thing: this rank dies with its torchrun agent and its launcher (no orphans).
    lifeline.start(f"rank {rank}")
    try:
        from shardwise.runtime.trainer import train  # defers numpy and torch

        overrides = list(args.overrides)
        if args.strategy:
            overrides.append(f"parallel.strategy={args.strategy}")
        cfg = load_config(args.recipe, overrides)
        # Every rank must agree on the run directory: without --out, name it after torchrun's
        # rendezvous id, which all ranks of one job share.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        out = args.out or cfg.out_dir or f"runs/{cfg.name}-{cfg.parallel.strategy.replace('+', '_')}-{run_id}"
        args.out = out
        _tee_to_rank_log(Path(out), rank)
        # torchrun's restart count: a restarted attempt resumes from the run's latest checkpoint.
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        lock = _claim_without_launcher(cfg, out, rank)
        # Every rank is recorded in the run lock: the directory stays locked while any rank of
        # this job lives, even if its launcher is gone.
        # Under plain torchrun (no job id from a launcher) ranks on other hosts derive other
        # launch ids than rank 0: they register only where the ids agree.
        job = os.environ.get(JOB_ID_ENV)
        try:
            register_rank(out, job or launch_id(), rank, strict=bool(job))
            train(cfg, out, attempt=attempt)
        finally:
            if lock is not None:
                lock.release()
        return 0
    except ShardwiseError as e:
        _report_failure(args.out, rank, str(e), e.exit_code)
        _say(f"error (rank {rank}): {e}")
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before the trainer's handler was installed
        return 130
    except BaseException as e:  # noqa: BLE001 - the console gets one line; the rank log the traceback
        if isinstance(e, (SystemExit, GeneratorExit)):
            raise
        # (DCP's CheckpointException is a BaseException, hence not `except Exception`.)
        message = describe_unexpected(e)
        where = _log_traceback()
        _report_failure(args.out, rank, message, INTERNAL_EXIT_CODE, internal=True, log=where)
        _say(f"error (rank {rank}): {message}" + (f" (traceback in {where})" if where else ""))
        return INTERNAL_EXIT_CODE


# A failure that is not a ShardwiseError: an environment fault (network, a peer rank gone) or a
# bug. The rank log keeps the traceback.
INTERNAL_EXIT_CODE = 1
_RANK_LOG: dict[str, Any] = {}


def _say(line: str) -> None:
    """A rank's last word: into its log; on the console too unless a shardwise launcher will say it.

    Under ``shardwise train`` the launcher prints one paragraph for the whole job (from the
    failure reports); under plain torchrun each rank says it itself. One write per line, so two
    ranks printing at once never run their lines together.
    """
    log = _RANK_LOG.get("file")
    targets = [log] if log is not None else []
    if log is None or lifeline.launcher_record() is None:
        targets.append(sys.__stderr__)
    for stream in targets:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.write(line + "\n")
            stream.flush()


def describe_unexpected(error: BaseException) -> str:
    """One line for an exception that is not a ShardwiseError."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left on the device holding {error.filename or 'the run directory'} "
                f"({error.strerror}); free space, then continue with --resume")
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first[:500]}"


def _log_traceback() -> str | None:
    """Write the current exception's traceback to this rank's log only; return the log's path."""
    log = _RANK_LOG.get("file")
    if log is None:
        traceback.print_exc(file=sys.__stderr__)  # no log to keep it: the console is all there is
        return None
    with contextlib.suppress(OSError, ValueError):
        traceback.print_exc(file=log)
        log.flush()
    return _RANK_LOG.get("path")


class _Tee:
    """A text stream writing to this rank's log file and, optionally, to the console stream."""

    def __init__(self, log: TextIO, console: TextIO | None) -> None:
        self._log, self._console = log, console

    def write(self, text: str) -> int:
        self._log.write(text)
        if self._console is not None:
            self._console.write(text)
        return len(text)

    def flush(self) -> None:
        self._log.flush()
        if self._console is not None:
            self._console.flush()

    def isatty(self) -> bool:
        return self._console is not None and self._console.isatty()

    def fileno(self) -> int:
        # faulthandler and subprocesses need a real descriptor: the console's, else the log's.
        return (self._console or self._log).fileno()

    def __getattr__(self, name: str) -> object:
        return getattr(self._console or self._log, name)


def _tee_to_rank_log(out: Path, rank: int) -> None:
    """Copy this rank's Python output to ``<out>/logs/rank-N.log``; only rank 0 prints to the console.

    Every rank's stderr (warnings, errors) still reaches the console too, so a failing rank is
    never silent; its stdout (progress, results) goes to its log alone. Appended to, so the log
    keeps every elastic attempt.
    """
    logs = out / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / f"rank-{rank}.log", "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives with the process
    except OSError as e:
        print(f"shardwise: cannot write the rank log in {logs}: {e.strerror or e}; output goes to the "
              "console only", file=sys.stderr, flush=True)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _RANK_LOG.update(file=log, path=str(logs / f"rank-{rank}.log"))
    log.write(f"--- rank {rank}, pid {os.getpid()}, attempt {attempt} ---\n")
    sys.stdout = _Tee(log, sys.stdout if rank == 0 else None)  # type: ignore[assignment]
    sys.stderr = _Tee(log, sys.stderr)  # type: ignore[assignment]


def _claim_without_launcher(cfg: object, out: str, rank: int) -> object | None:
    """Under plain torchrun (no `shardwise train` holding the run directory), rank 0 claims it.

    The job id is the derived launch id, the same for every attempt of this torchrun, so a
    restarted rank 0 takes over its own job's lock (its holder, the previous attempt's rank 0,
    is gone); a fresh run into another run's directory is refused as from the CLI. Returns the
    lock to release, or None.
    """
    if rank != 0 or os.environ.get(LAUNCH_ID_ENV):
        return None  # the launcher holds it (or rank 0 does)
    return claim_run_dir(out, cfg, job_id=launch_id())  # type: ignore[arg-type]


def _report_failure(out: str | None, rank: int, message: str, exit_code: int = 2, internal: bool = False,
                    log: str | None = None) -> None:
    # The launcher reads this to print one clear paragraph (and exit with this code) instead of
    # torchrun's tracebacks.
    if not out:
        return
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(out) / f"failure-rank{rank}.json",
                          {"rank": rank, "error": message, "exit_code": exit_code, "internal": internal,
                           "log": log, "time": time.time()})
    except OSError:
        pass  # a failure report that cannot be written must not hide the failure itself


if __name__ == "__main__":
    from shardwise.job.exit import exit_rank

    exit_rank(main())  # no interpreter teardown after the work is done (job/exit.py)
