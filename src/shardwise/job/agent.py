"""The torchrun agent as ``shardwise train`` runs it: ``python -m shardwise.job.agent <torchrun args>``.

It is torchrun itself (``torch.distributed.run``: rendezvous, restarts, multi-node), with three
differences that keep the console to one clean paragraph and the job to one owner:

* it dies with the launcher (``runtime.lifeline``), so its ranks do too;
* torchrun's failure reports (``ChildFailedError`` with its traceback, a ``SignalException``
  traceback on SIGTERM/SIGINT) are not printed: the failing ranks are written as JSON to
  ``SHARDWISE_AGENT_REPORT`` for the launcher, which prints one paragraph naming the rank and its
  log file. Each rank's own traceback stays in ``<run>/logs/rank-N.log``;
* a second termination signal while torchrun is already stopping the ranks (Ctrl-C reaches the
  agent from the terminal *and* from the launcher, which forwards it) is ignored instead of
  raising inside torchrun's shutdown.

Exit codes: 0 success; 1 a rank failed (see the report); 128 + N when stopped by signal N.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Any

from shardwise.fsutil import atomic_write_json
from shardwise.runtime import lifeline

REPORT_ENV = "SHARDWISE_AGENT_REPORT"


def _signal_once() -> None:
    """Make torchrun's termination handler raise on the first signal only (later ones are ignored)."""
    try:
        from torch.distributed.elastic.multiprocessing import api
    except ImportError:  # pragma: no cover - torch without elastic
        return
    original = getattr(api, "_terminate_process_handler", None)
    if original is None:
        return
    seen: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if seen:
            return  # already stopping the ranks
        seen.append(signum)
        original(signum, frame)

    api._terminate_process_handler = handler  # noqa: SLF001 - looked up by name when torchrun starts


def _failures(error: BaseException) -> list[dict[str, Any]]:
    out = []
    for local_rank, failure in sorted(getattr(error, "failures", {}).items()):
        out.append({"local_rank": local_rank, "rank": getattr(failure, "rank", local_rank),
                    "exitcode": getattr(failure, "exitcode", None), "pid": getattr(failure, "pid", None),
                    "signal": _signal_name(getattr(failure, "exitcode", None))})
    return out


def _signal_name(code: Any) -> str | None:
    if isinstance(code, int) and code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return None


def _report(data: dict[str, Any]) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with contextlib.suppress(OSError):
            atomic_write_json(path, data)


def main(argv: list[str] | None = None) -> int:
    lifeline.start("torchrun agent")
    _signal_once()
    from torch.distributed.elastic.multiprocessing.api import SignalException  # defers torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # defers torch
    from torch.distributed.run import parse_args, run  # defers torch

    args = parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun's warnings (each SIGTERM it sends while stopping ranks) are noise next to the
    # launcher's paragraph; its one ERROR line per failed rank stays (under --max-restarts it is
    # the only sign that a rank died and the job was restarted).
    if not os.environ.get("LOGLEVEL"):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        run(args)
    except ChildFailedError as e:
        _report({"failures": _failures(e)})
        return 1
    except SignalException as e:
        _report({"signal": e.sigval.name})
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        _report({"signal": "SIGINT"})
        return 128 + signal.SIGINT
    except Exception as e:  # noqa: BLE001 - rendezvous timeouts and the like: one line, no traceback
        _report({"error": f"{type(e).__name__}: {e}"})
        sys.stderr.write(f"shardwise: torchrun failed: {type(e).__name__}: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    # torchrun has stopped every rank and closed its rendezvous: skip the interpreter's teardown
    # (seconds with torch loaded on a busy machine), so the launcher reports without delay.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
