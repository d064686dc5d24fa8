"""Ranks die with their launcher: no orphan keeps training, and no orphan ever saves again.

``shardwise train`` (the launcher) starts the torchrun agent, which starts the ranks. When the
launcher is killed (``kill -9``, an OOM killer, a lost login shell), nothing in torchrun stops the
agent or the ranks: they are re-parented to PID 1 and would keep training and checkpointing into a
run directory whose lock says its owner is gone. Two mechanisms, each enough on its own:

* **parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the kernel kills the agent
  the moment the launcher dies, and each rank the moment the agent dies. Immediate, but Linux only;
* **a lifeline thread** (everywhere): every ``POLL_S`` it checks that this process's parent is still
  the one it started under and that the launcher (its PID *and* start time, from
  ``SHARDWISE_LAUNCHER``) still runs; when either is gone the process exits at once with
  ``ORPHAN_EXIT_CODE``, from the thread, without unwinding (so no ``finally`` saves anything).

``ensure_alive()`` makes the same check synchronously; the checkpoint writer calls it right before
publishing, so even a save in flight when the launcher died is never published.

Both are started by the agent wrapper (``job.agent``) and by every rank (``job.worker``);
they work the same on CUDA/NCCL clusters (nothing here touches devices), and on each node of a
multi-node job each rank watches its own node's launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
from typing import Any

from shardwise.runtime.identity import process_record, same_process_alive

LAUNCHER_ENV = "SHARDWISE_LAUNCHER"  # JSON process record (host, pid, start time, boot id)
ORPHAN_EXIT_CODE = 137  # what a SIGKILL would report: the process was stopped from outside
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_lost = threading.Event()
_state: dict[str, Any] = {}


def launcher_env() -> dict[str, str]:
    """Environment entry naming this process as the launcher of the processes it starts."""
    return {LAUNCHER_ENV: json.dumps(process_record())}


def launcher_record(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The launcher's process record from the environment, None when there is none (plain torchrun)."""
    text = (os.environ if environ is None else environ).get(LAUNCHER_ENV, "")
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where unsupported.

    Linux only (``prctl``). The setting survives ``exec`` and is per process, so each generation
    (agent, rank) sets its own.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def lost_reason() -> str | None:
    """Why this process is an orphan now (its parent or launcher is gone), None while it is not."""
    parent = _state.get("parent")
    if parent is not None and os.getppid() != parent:
        return f"its parent process {parent} is gone"
    launcher = _state.get("launcher")
    if launcher is not None and same_process_alive(launcher) is False:
        return f"the launcher (pid {launcher.get('pid')}) is gone"
    return None


def _stop(reason: str) -> None:
    _lost.set()
    with contextlib.suppress(Exception):
        os.write(2, f"shardwise ({_state.get('who', 'process')} {os.getpid()}): {reason}; stopping at once "
                    "without saving (the job was killed from outside).\n".encode())
    os._exit(ORPHAN_EXIT_CODE)


def ensure_alive() -> None:
    """Exit at once (without unwinding) when this process's launcher or parent is gone."""
    reason = lost_reason()
    if reason is not None:
        _stop(reason)


def _watch() -> None:
    while not _lost.wait(POLL_S):
        reason = lost_reason()
        if reason is not None:
            _stop(reason)


def start(who: str = "process") -> None:
    """Tie this process's life to its parent and launcher (idempotent); call it first thing.

    ``who`` names the process in the one line printed when it stops ("rank 1", "torchrun agent").
    """
    if _state.get("started"):
        return
    parent = os.getppid()
    _state.update(started=True, who=who, parent=parent, launcher=launcher_record())
    set_parent_death_signal(signal.SIGKILL)
    # The parent may have died before prctl: then this process already belongs to init (or a
    # subreaper), and the kernel will never send the signal.
    ensure_alive()
    threading.Thread(target=_watch, name="shardwise-lifeline", daemon=True).start()
