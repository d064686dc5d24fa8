"""How a multi-rank run ended, as one paragraph and one exit code (what ``shardwise train`` prints).

The ranks and the torchrun agent leave reports in the run directory and the agent's report file;
this module turns them into the console's last word:

* a hang (``hang-rank*.json``, written by a rank's watchdog): exit 3, naming the stuck and the
  silent ranks;
* a rank that failed with a user-facing error (``failure-rank*.json`` with ``internal`` false):
  its message and exit code (2, or 4 for a non-finite loss); preferred over the follow-on failures
  of the other ranks (a peer's "connection closed" is a consequence, not a cause);
* a rank that failed otherwise (an environment fault or a bug): its one-line error, with the rank
  log that holds the traceback, exit 1;
* a rank killed by a signal with no report of its own (OOM killer, segfault): which rank, which
  signal and its log file, exit 1;
* the launcher stopped by SIGINT/SIGTERM before any checkpoint: exit 130.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from shardwise.runtime.watchdog import HANG_EXIT_CODE, describe_hang

INTERRUPTED_EXIT_CODE = 130


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def rank_failures(out: Path) -> list[dict[str, Any]]:
    """The ranks' failure reports, causes first (user-facing errors by rank, then internal ones by time)."""
    reports = []
    for path in out.glob("failure-rank*.json"):
        data = _read_json(path)
        if isinstance(data, dict) and isinstance(data.get("rank"), int) and isinstance(data.get("error"), str):
            reports.append(data)
    # A user-facing error is usually the same on every rank: the lowest rank's, deterministically.
    # Among internal errors the first one is the cause, the later ones its consequences.
    return sorted(reports, key=lambda r: (bool(r.get("internal")),
                                          (r.get("time") or 0.0) if r.get("internal") else 0.0, r["rank"]))


def report_ranks(rc: int, out: Path, agent_report: str | os.PathLike | None = None) -> int:
    """Print the paragraph for a torchrun that ended with ``rc``; return the exit code of ``train``."""
    if rc == 0:
        return 0
    hang = describe_hang(out)
    if hang:
        print(f"error: {hang}", file=sys.stderr)
        return HANG_EXIT_CODE
    failures = rank_failures(out)
    agent = _read_json(Path(agent_report)) if agent_report else None
    agent = agent if isinstance(agent, dict) else {}
    reported = {f["rank"] for f in failures}
    # Ranks that died without a word (a signal, a segfault): the cause, unless a rank failed with
    # a user-facing error; the other ranks' errors ("connection closed by peer") follow from it.
    crashed = [f for f in agent.get("failures", []) if isinstance(f, dict) and f.get("rank") not in reported]
    if failures and not failures[0].get("internal"):
        return _print_failure(failures[0], out)
    if crashed:
        parts = []
        for f in crashed:
            how = f"was killed by {f['signal']}" if f.get("signal") else f"exited with code {f.get('exitcode')}"
            log = out / "logs" / f"rank-{f.get('rank')}.log"
            parts.append(f"rank {f.get('rank')} {how} (its output: {log})")
        why = (" A rank killed by SIGKILL was often stopped by the out-of-memory killer (see `dmesg`)."
               if any(f.get("signal") == "SIGKILL" for f in crashed) else "")
        print(f"error: training failed: {'; '.join(parts)}.{why} The run directory is {out}; continue "
              f"from its latest checkpoint with: shardwise train --out {out} --resume", file=sys.stderr)
        return 1
    if failures:
        return _print_failure(failures[0], out)
    if agent.get("signal") or rc in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        name = agent.get("signal") or signal.Signals(rc - 128).name
        print(f"interrupted ({name}) before a checkpoint was saved; {out / 'checkpoints'} holds nothing "
              "newer than before this launch.", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    extra = f" ({agent['error']})" if agent.get("error") else ""
    print(f"error: training failed (torchrun exit code {rc}){extra}; see the rank logs in {out / 'logs'}. "
          f"The run directory is {out}.", file=sys.stderr)
    return 1


def _print_failure(first: dict[str, Any], out: Path) -> int:
    log = first.get("log") or str(out / "logs" / f"rank-{first['rank']}.log")
    error = first["error"].rstrip(".")
    tail = (f" The full output of rank {first['rank']} (with the traceback) is in {log}."
            if first.get("internal") else "")
    print(f"error: rank {first['rank']} failed: {error}.{tail}", file=sys.stderr)
    code = first.get("exit_code")
    return code if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 256 else 1


def report_script_ranks(rc: int, agent_report: str | os.PathLike, script: str) -> int:
    """``shardwise launch``: one line for a user script whose ranks failed; returns the exit code.

    The ranks' own output (their tracebacks included: the script is the user's) is already on the
    console; this only says which rank ended how.
    """
    if rc == 0:
        return 0
    agent = _read_json(Path(agent_report))
    agent = agent if isinstance(agent, dict) else {}
    if agent.get("signal") or rc in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        print(f"interrupted ({agent.get('signal') or 'signal'}): {script} was stopped on every rank.",
              file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    failures = [f for f in agent.get("failures", []) if isinstance(f, dict)]
    parts = [f"rank {f.get('rank')} " + (f"was killed by {f['signal']}" if f.get("signal")
                                          else f"exited with code {f.get('exitcode')}") for f in failures]
    detail = "; ".join(parts) or (agent.get("error") or f"torchrun exit code {rc}")
    print(f"error: {script} failed: {detail} (each rank's output is above).", file=sys.stderr)
    codes = [f.get("exitcode") for f in failures if isinstance(f.get("exitcode"), int) and f["exitcode"] > 0]
    return codes[0] if codes and codes[0] < 256 else 1
