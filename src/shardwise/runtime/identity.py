"""Who is who: a process's identity (host, PID, start time) and the launch id of a job.

A PID alone names a process only while it lives: after it exits the number is reused. The run
directory lock, the watchdog and the partial-checkpoint cleanup therefore record the process's
start time too (Linux ``/proc/PID/stat`` field 22, in clock ticks since boot, plus the boot id) and
treat a PID whose start time differs as a different process.

The *launch id* names one job: ``shardwise train`` makes a fresh one per invocation and hands it
to its ranks in ``SHARDWISE_LAUNCH_ID`` (torchrun passes the environment through). Heartbeats and
checkpoint manifests carry it, so a watchdog only signals ranks of its own launch and a job only
deletes checkpoints it wrote. Ranks started by plain ``torchrun`` derive one that all local ranks
of that torchrun share, across its elastic restarts.
"""

from __future__ import annotations

import functools
import os
import socket
import uuid
from typing import Any

LAUNCH_ID_ENV = "SHARDWISE_LAUNCH_ID"
# The id of the job holding the run lock (the rendezvous id of a multi-node job, else the launch
# id); ranks register themselves in that lock (job.runlock.register_rank).
JOB_ID_ENV = "SHARDWISE_JOB_ID"


def hostname() -> str:
    return socket.gethostname()


@functools.cache
def boot_id() -> str:
    """This boot's id (Linux), '' elsewhere: start times only compare within one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3 on of ``/proc/PID/stat`` (state first), None when unknown or gone."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except (OSError, ValueError):
        return None
    # Field 2 (the command name) is in parentheses and may contain spaces or ')': split after
    # the last ')'. What follows starts at field 3.
    parts = stat.rsplit(")", 1)
    return parts[1].split() if len(parts) == 2 else None


def _start_time(fields: list[str] | None) -> int | None:
    try:
        return int(fields[19]) if fields else None  # field 22
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux), None when unknown or gone."""
    return _start_time(_stat_fields(pid))


def process_record(pid: int | None = None) -> dict[str, Any]:
    """Host, PID, start time and boot id of ``pid`` (default: this process), for lock/heartbeat files."""
    pid = os.getpid() if pid is None else pid
    return {"host": hostname(), "pid": pid, "start_time": process_start_time(pid), "boot_id": boot_id()}


def same_process_alive(record: dict[str, Any]) -> bool | None:
    """Whether the process described by ``record`` (see ``process_record``) still runs.

    True/False when that can be told from here; None when it cannot: the process ran on another
    host, or this platform has no ``/proc`` and the record has no start time to compare.
    """
    if record.get("host") != hostname():
        return None
    if record.get("boot_id") and boot_id() and record["boot_id"] != boot_id():
        return False  # the machine rebooted since: every process of that boot is gone
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    except OSError:
        return False
    fields = _stat_fields(pid)
    now = _start_time(fields)
    if now is None:
        # With /proc, a PID without a stat file has just exited. Without /proc (not Linux) a live
        # PID may be a reused one: cannot tell.
        return False if os.path.isdir("/proc") else None
    if fields[0] in ("Z", "X"):
        # Exited, waiting to be reaped (a zombie): its PID and /proc entry stay until its parent
        # waits for it, so it looks alive to kill(pid, 0); a launcher killed under a parent that
        # reaps late must still be gone to its ranks' lifelines (checked before publishing).
        return False
    recorded = record.get("start_time")
    if recorded is None:
        return None  # written where start times were unknown
    return recorded == now


@functools.cache
def _process_launch_id() -> str:
    return f"process-{uuid.uuid4().hex}"


def launch_id() -> str:
    """This job's launch id: ``SHARDWISE_LAUNCH_ID``, else derived from torchrun, else this process's.

    Under plain ``torchrun`` (no shardwise launcher) every local rank has the torchrun agent as
    parent: its PID and start time, with the rendezvous id, name the job on this host and stay
    the same across elastic restarts (attempts are told apart by the restart count).
    """
    given = os.environ.get(LAUNCH_ID_ENV, "").strip()
    if given:
        return given
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:
        agent = os.getppid()
        return f"torchrun-{run_id}-{hostname()}-{agent}-{process_start_time(agent)}"
    return _process_launch_id()


def new_launch_id() -> str:
    """A fresh launch id for one ``shardwise train`` invocation."""
    return uuid.uuid4().hex
