"""The run-directory lock: one job owns a run directory at a time.

``<run>/.shardwise.lock`` is a small JSON file naming the holder: host, PID, process start time,
boot id, job id, the time and the command. The launching process (``shardwise train``, ``verify``,
``bench``) takes it before writing anything and removes it when the job ends. Another launcher
that finds it:

* with the same job id **joins** (the nodes of one multi-node job share a directory; the lock's
  job id is the rendezvous id there): it is added to the lock's ``members``, and the last member
  to leave removes the lock; members that are provably gone (an earlier attempt, a lost node) are
  dropped;
* held by a live process on this host is **refused**, naming the holder;
* held by a process that is gone (no such PID, or the PID was reused: its start time differs, or
  the machine rebooted since) **takes it over**, with a log line: a killed job leaves its lock;
  but only when every *rank* of that job is gone too. Each rank adds itself to the lock's
  ``ranks`` (``register_rank``: host, PID, start time), so a rank that outlived its launcher
  (which ``runtime.lifeline`` prevents, but a hung kernel call can delay) keeps the directory
  locked: a ``--resume`` never shares the directory with a survivor of the old job;
* held on another host, whose processes cannot be checked from here, is judged by the heartbeats
  its ranks write into the run directory (``watchdog.heartbeat_times``): taken over when every rank
  the lock names on that host has a heartbeat older than ``watchdog.STALE_HEARTBEAT_S``, and
  otherwise **refused**, naming the host and how to clear the lock by hand if that job is gone.

Deciding and writing happen under an ``flock`` on ``<run>/.shardwise.lock.guard`` (taken for
milliseconds), so two launchers racing for one directory cannot both win; the lock file itself is
replaced atomically (write beside it, then rename), so readers never see half a lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.fsutil import atomic_write_json
from shardwise.runtime.identity import process_record, same_process_alive
from shardwise.runtime.watchdog import STALE_HEARTBEAT_S, heartbeat_times, rank_alive_by_heartbeat

LOCK_FILE = ".shardwise.lock"
GUARD_FILE = ".shardwise.lock.guard"


def read_lock(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The lock record of ``run_dir``, None when unlocked; an unreadable lock reads as {}."""
    path = Path(run_dir) / LOCK_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return {}
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return record if isinstance(record, dict) else {}


@contextlib.contextmanager
def _guard(run_dir: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic replace alone still keeps the file whole
        yield
        return
    fd = os.open(run_dir / GUARD_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _stale_s() -> float:
    return STALE_HEARTBEAT_S


def describe_holder(record: dict[str, Any]) -> str:
    """'pid P on host H (job J, since T)' for messages."""
    since = record.get("time")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return (f"pid {record.get('pid')} on host {record.get('host')} (job {record.get('job_id')}, "
            f"{record.get('command') or 'shardwise'}, since {when})")


def lock_members(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The launchers holding a lock record: its ``members`` (one per node of a multi-node job), else its writer."""
    members = record.get("members")
    if isinstance(members, list) and members:
        return [m for m in members if isinstance(m, dict)]
    return [record]


def lock_ranks(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The ranks registered in a lock record (``register_rank``)."""
    ranks = record.get("ranks")
    return [r for r in ranks if isinstance(r, dict)] if isinstance(ranks, list) else []


def register_rank(run_dir: str | os.PathLike, job_id: str, rank: int, strict: bool = True) -> bool:
    """Add this rank's process to the lock of ``run_dir`` held by job ``job_id``; False when unlocked.

    Raises ConfigError when another job holds the lock (``strict``): this rank's job no longer
    owns the directory (it was taken over), so it must not write into it; without ``strict`` such
    a lock is left alone (False). Ranks that are provably gone (earlier attempts) are dropped as
    the list is rewritten.
    """
    run_dir = Path(run_dir)
    with _guard(run_dir):
        held = read_lock(run_dir)
        if held is None or not held:
            return False
        if held.get("job_id") != job_id:
            if not strict:
                return False
            raise ConfigError(f"run directory {run_dir} is locked by another job ({describe_holder(held)}), "
                              f"not by this rank's job {job_id}; rank {rank} stops without writing into it.")
        me = {**process_record(), "rank": rank}
        ranks = [r for r in lock_ranks(held) if same_process_alive(r) is not False
                 and (r.get("pid"), r.get("host")) != (me["pid"], me["host"])]
        atomic_write_json(run_dir / LOCK_FILE, {**held, "ranks": [*ranks, me]}, durable=True, indent=1)
    return True


class RunLock:
    """Ownership of one run directory for one job; ``acquire()`` takes it, ``release()`` gives it back.

    The launchers of one job (the nodes of a multi-node job, which share the run directory and
    the job id) are the lock's *members*: each adds itself on ``acquire()`` and removes itself on
    ``release()``; the last one to leave removes the lock, so a node that finishes (or is lost)
    first never unlocks the directory under the nodes still running.
    """

    def __init__(self, run_dir: str | os.PathLike, job_id: str, command: str = "shardwise train") -> None:
        self.run_dir = Path(run_dir)
        self.job_id = job_id
        self.command = command
        self.joined = False  # True: another launcher of the same job holds it (this one joined)
        self.took_over: dict[str, Any] | None = None  # the stale lock replaced, if any
        self.remote: dict[Any, bool | None] = {}  # other hosts of the last lock checked: alive by heartbeat
        self._held = False
        self._member_id = uuid.uuid4().hex  # names this launcher among the lock's members

    @property
    def path(self) -> Path:
        return self.run_dir / LOCK_FILE

    def acquire(self) -> RunLock:
        """Take (or join) the lock; raise ConfigError when a live job of another id holds it."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the run directory {self.run_dir}: {e.strerror or e}.") from None
        with _guard(self.run_dir):
            held = read_lock(self.run_dir)
            live: list[dict[str, Any]] = []
            if held is not None:
                live = self._check_holder(held)
            me = {**process_record(), "member_id": self._member_id}
            if self.joined:
                record = {**held, "members": [*live, me]}  # type: ignore[dict-item]
            else:
                record = {**me, "job_id": self.job_id, "time": time.time(), "command": self.command,
                          "members": [me]}
            atomic_write_json(self.path, record, durable=True, indent=1)
            self._held = True
        if self.took_over is not None:
            gone = [h for h, alive in self.remote.items() if alive is False]
            how = (f" (its ranks on {', '.join(map(str, gone))} have written no heartbeat for over "
                   f"{_stale_s():g}s)" if gone else "")
            print(f"shardwise: took over the stale lock of {self.run_dir}: it was held by "
                  f"{describe_holder(self.took_over)}, which is no longer running{how}.", file=sys.stderr)
        return self

    def check(self) -> None:
        """Raise as ``acquire()`` would, without taking the lock (a stale lock passes)."""
        held = read_lock(self.run_dir)
        if held is not None:
            self._check_holder(held)
            self.joined, self.took_over = False, None

    def _check_holder(self, held: dict[str, Any]) -> list[dict[str, Any]]:
        """Decide join / take over / refuse for the lock ``held``; return its members still running."""
        if not held:
            # Unreadable: never written whole (writes are atomic), so damaged by hand or a disk
            # fault. Nobody can be shown to hold it; say so rather than guess.
            raise ConfigError(f"the lock file {self.path} is unreadable. If no job is running in "
                              f"{self.run_dir}, delete {self.path} and retry.")
        members = lock_members(held)
        states = [(m, same_process_alive(m)) for m in members]
        live = [m for m, alive in states if alive is not False]
        if self.job_id and held.get("job_id") == self.job_id:
            # Another launcher of this job (a node) joins; when every earlier member is gone (an
            # earlier attempt of this job) the lock is simply taken again.
            self.joined = bool(live)
            return live
        ranks = lock_ranks(held)
        rank_states = [(r, same_process_alive(r)) for r in ranks]
        # Processes on other hosts: judged by their host's rank heartbeats (None: cannot tell).
        here = process_record()["host"]
        hosts = {r.get("host") for r, alive in rank_states if alive is None} | \
                {m.get("host") for m, alive in states if alive is None}
        verdicts = {h: self._remote_host_alive(h, ranks) for h in hosts if h != here}
        self.remote = verdicts
        states = [(m, verdicts.get(m.get("host")) if alive is None else alive) for m, alive in states]
        rank_states = [(r, verdicts.get(r.get("host")) if alive is None else alive) for r, alive in rank_states]
        live = [m for m, alive in states if alive is not False]
        live_ranks = [r for r, alive in rank_states if alive is not False]
        if not live and live_ranks:
            survivor = {**held, **live_ranks[0]}
            if not any(alive is True for _, alive in rank_states):
                raise ConfigError(
                    f"run directory {self.run_dir} is locked by a job whose launcher ({describe_holder(held)}) "
                    f"is gone, but whose rank {survivor.get('rank')} ran on host {survivor.get('host')}, where "
                    f"shardwise cannot check from here whether it still runs{self._no_heartbeat}. If it does "
                    f"not, delete {self.path} and retry; otherwise stop it first, or choose another --out.")
            raise ConfigError(
                f"run directory {self.run_dir} is still in use by the job that locked it: its launcher "
                f"({describe_holder(held)}) is gone, but rank {survivor.get('rank')} of that job still runs "
                f"as pid {survivor.get('pid')} on host {survivor.get('host')}{self._fresh_heartbeat(survivor)}. "
                "Two jobs writing one run "
                "directory would mix their checkpoints; stop that process (it is an orphan of the killed "
                "job) and retry, or choose another --out."
            )
        if not live:
            self.took_over = held
            return []
        holder = {**held, **live[0]}
        if any(alive is True for _, alive in states):
            raise ConfigError(
                f"run directory {self.run_dir} is in use by a running job: {describe_holder(holder)}"
                f"{self._fresh_heartbeat(holder)}. Wait for it to finish (or stop it), or choose another --out. "
                "Two jobs writing one run directory would mix their metrics and delete each other's checkpoints."
            )
        if live[0].get("host") != process_record()["host"]:
            raise ConfigError(
                f"run directory {self.run_dir} is locked by {describe_holder(holder)}; shardwise "
                f"cannot check from this host whether that job is still running on host "
                f"{holder.get('host')}{self._no_heartbeat}. If it is not, delete {self.path} and retry "
                f"(or run this command on {holder.get('host')}, which can check); otherwise choose another --out."
            )
        raise ConfigError(
            f"run directory {self.run_dir} is locked by {describe_holder(holder)}, and this "
            f"platform cannot tell whether that process is still the same job. If it is not, "
            f"delete {self.path} and retry; otherwise choose another --out."
        )

    def _remote_host_alive(self, host: Any, ranks: list[dict[str, Any]]) -> bool | None:
        """Whether the job still runs on ``host`` (another host), from the heartbeats of the ranks the
        lock names there: False when every one is stale, True when one is fresh, None when a rank
        has no heartbeat or the lock names no rank there (its launcher alone proves nothing)."""
        there = [r for r in ranks if r.get("host") == host]
        if not there:
            return None
        beats = heartbeat_times(self.run_dir)
        verdicts = [rank_alive_by_heartbeat(beats, r) for r in there]
        if any(v is True for v in verdicts):
            return True
        return False if all(v is False for v in verdicts) else None

    def _fresh_heartbeat(self, holder: dict[str, Any]) -> str:
        # Said only for another host, where "running" rests on the heartbeats, not on the process.
        if self.remote.get(holder.get("host")) is not True:
            return ""
        return (f" (its ranks there still write heartbeats into {self.run_dir / 'heartbeat'}; the lock is "
                f"taken over once they have been silent for {_stale_s():g}s. If that job is gone, e.g. its "
                f"host was switched off, delete {self.path} and retry)")

    @property
    def _no_heartbeat(self) -> str:
        return (f" (its ranks left no heartbeat in {self.run_dir / 'heartbeat'} to tell: the lock is taken "
                f"over once every rank there has been silent for {STALE_HEARTBEAT_S:g}s, which needs the "
                "watchdog on)")

    def release(self) -> None:
        """Leave the lock; the last member of the job removes it."""
        if not self._held:
            return
        self._held = False
        with _guard(self.run_dir):
            held = read_lock(self.run_dir)
            if not held or held.get("job_id") != self.job_id:
                return  # not ours (any more): leave it alone
            rest = [m for m in lock_members(held)
                    if m.get("member_id") != self._member_id and same_process_alive(m) is not False]
            if rest:
                first = {k: rest[0].get(k) for k in ("host", "pid", "start_time", "boot_id")}
                atomic_write_json(self.path, {**held, **first, "members": rest}, durable=True, indent=1)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
