"""Hang detection: a rank that makes no progress for ``timeout_s`` ends the job, leaving its stack.

Each rank runs a ``Watchdog``. The training loop calls ``beat(step, phase)`` whenever it makes
progress (every optimizer step, every eval batch, around checkpoints); that only stores two
values. A daemon thread checks the time since the last beat and, every poll, writes
``<run>/heartbeat/rank{r}.json`` (pid, its start time, host, launch id, attempt, step, phase,
seconds since progress) for people and tools watching the run. When the time since progress
exceeds ``timeout_s`` the thread:

1. writes this rank's Python stack (every thread) to ``<run>/stacks/rank{r}.txt``;
2. writes ``<run>/hang-rank{r}.json``: the step, the phase and the innermost frame of the main
   thread, i.e. where this rank is stuck (``shardwise train`` prints these);
3. sends SIGUSR1 to the other ranks of this launch on this host, whose faulthandler then dumps
   their stacks into their own ``stacks/rank{r}.txt`` even when they are blocked inside a
   collective. A heartbeat file is only a claim: a PID is signalled only when its heartbeat has
   this rank's launch id and attempt AND the process with that PID has the start time the
   heartbeat recorded (so a stale heartbeat, a reused PID or a planted file never gets an
   unrelated process signalled; where start times cannot be read, nobody is signalled);
4. exits the process with ``HANG_EXIT_CODE``. torchrun then stops the other ranks, so the job
   ends non-zero instead of hanging (with ``--max-restarts`` it is restarted from the latest
   checkpoint, and ends non-zero once the restarts are used up).

A thread cannot run while another holds the GIL forever (a stuck C extension), so
``faulthandler.dump_traceback_later`` is kept armed ``grace_s`` past the deadline as a backstop: it
dumps every thread's stack and exits without needing the GIL.

Hangs inside collectives are usually one rank not reaching a collective the others are in (a
skipped call, a data-dependent branch, an exception swallowed on one rank). Opt in to PyTorch's own
collective checks with ``watchdog.debug_collectives = true`` (TORCH_DISTRIBUTED_DEBUG=DETAIL): a
mismatched collective then raises with both ranks' call descriptions.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from shardwise.fsutil import atomic_write_json
from shardwise.runtime.identity import launch_id as launch_id_from_env
from shardwise.runtime.identity import process_record, same_process_alive

HANG_EXIT_CODE = 3

# A rank whose heartbeat has not been rewritten for this long is gone: its watchdog thread writes
# one every poll (at most 1 s) for as long as the process lives, even while the rank is blocked
# in a collective. Generous on purpose: it also absorbs clock skew between hosts and the attribute
# caching of a shared file system (the run lock asks this for ranks on other hosts).
STALE_HEARTBEAT_S = 120.0


def heartbeat_times(run_dir: str | os.PathLike) -> dict[tuple[Any, Any, Any], float]:
    """When each rank process (host, pid, start time) last wrote its heartbeat in ``run_dir``
    (read once: a lock check asks about every rank of a large job). The newer of the heartbeat's
    own time and the file's modification time counts, so a clock running behind never makes a
    live rank look stale."""
    out: dict[tuple[Any, Any, Any], float] = {}
    for beat in Path(run_dir, "heartbeat").glob("rank*.json"):
        try:
            info = json.loads(beat.read_text(encoding="utf-8"))
            mtime = beat.stat().st_mtime
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict):
            continue
        written = info.get("time")
        ok = isinstance(written, (int, float)) and not isinstance(written, bool) and written == written
        key = (info.get("host"), info.get("pid"), info.get("start_time"))
        out[key] = max(out.get(key, 0.0), max(mtime, written) if ok else mtime)
    return out


def rank_alive_by_heartbeat(beats: dict[tuple[Any, Any, Any], float], record: dict[str, Any],
                            now: float | None = None) -> bool | None:
    """Whether rank process ``record`` (on any host) still runs, judged by its heartbeat alone
    (``beats``: ``heartbeat_times``): False when older than ``STALE_HEARTBEAT_S``, True when newer,
    None when that very process left none (watchdog off, or it never started)."""
    written = beats.get((record.get("host"), record.get("pid"), record.get("start_time")))
    if written is None:
        return None
    return (time.time() if now is None else now) - written <= STALE_HEARTBEAT_S


class Watchdog:
    """One rank's hang detector; ``start()`` arms it, ``beat()`` records progress, ``stop()`` disarms."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, timeout_s: float,
                 attempt: int = 0, poll_s: float | None = None, grace_s: float | None = None,
                 launch_id: str | None = None, first_step_timeout_s: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.timeout_s = float(timeout_s)
        # Until the first optimizer step is done (the first beat in phase "train"), a rank may be
        # silent this long: that step compiles (train.compile), builds the communicators and warms
        # the allocator, which on a large model takes minutes longer than any later step.
        self.first_step_timeout_s = max(self.timeout_s, float(first_step_timeout_s or 0.0))
        self._first_step_done = False
        self.attempt = attempt
        self.launch_id = launch_id or launch_id_from_env()
        self._me = process_record()  # host, pid, start time, boot id: computed once
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, self.timeout_s / 20))
        self.grace_s = grace_s if grace_s is not None else max(5.0, 0.25 * self.timeout_s)
        self.step: int | None = None
        self.phase = "starting"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stack_file: Any = None
        self._main_ident = threading.main_thread().ident
        self.heartbeat_path = self.run_dir / "heartbeat" / f"rank{rank}.json"
        self.stack_path = self.run_dir / "stacks" / f"rank{rank}.txt"

    # ------------------------------------------------------------------ public
    def start(self) -> Watchdog:
        """Arm the watchdog (idempotent) and return it."""
        if self._thread is not None:
            return self
        self.heartbeat_path.parent.mkdir(parents=True, exist_ok=True)
        self.stack_path.parent.mkdir(parents=True, exist_ok=True)
        # Appended to, so the stacks of an earlier elastic attempt are kept.
        self._stack_file = open(self.stack_path, "a", encoding="utf-8")  # noqa: SIM115 - lives until stop()
        if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
            faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        self._last = time.monotonic()
        self._arm_backstop()
        self._thread = threading.Thread(target=self._run, name=f"shardwise-watchdog-rank{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def beat(self, step: int | None = None, phase: str | None = None) -> None:
        """Record progress (cheap: two assignments; the thread does all I/O)."""
        self._last = time.monotonic()
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase
            if phase == "train":
                self._first_step_done = True

    @property
    def deadline_s(self) -> float:
        """How long this rank may now go without progress: ``timeout_s``, or
        ``first_step_timeout_s`` before its first optimizer step."""
        return self.timeout_s if self._first_step_done else self.first_step_timeout_s

    @property
    def deadline_setting(self) -> str:
        """The setting that holds ``deadline_s`` (named in the hang report)."""
        if self._first_step_done or self.first_step_timeout_s == self.timeout_s:
            return "watchdog.timeout_s"
        return "watchdog.first_step_timeout_s"

    def stop(self) -> None:
        """Disarm: no more checks, no backstop, SIGUSR1 back to its default."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._thread = None
        faulthandler.cancel_dump_traceback_later()
        if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
            faulthandler.unregister(signal.SIGUSR1)
        if self._stack_file is not None:
            self._stack_file.close()
            self._stack_file = None

    # ------------------------------------------------------------------ thread
    def _arm_backstop(self) -> None:
        remaining = self.deadline_s + self.grace_s - (time.monotonic() - self._last)
        faulthandler.dump_traceback_later(max(remaining, 0.1), repeat=False, file=self._stack_file,
                                          exit=True)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            stale_s = time.monotonic() - self._last
            self._write_heartbeat(stale_s)
            if stale_s > self.deadline_s:
                self._fire(stale_s)
                return
            self._arm_backstop()

    def _write_heartbeat(self, stale_s: float) -> None:
        # A full or vanished disk must not kill training; the deadline still applies.
        with contextlib.suppress(OSError):
            atomic_write_json(self.heartbeat_path, {
                "rank": self.rank, **self._me, "launch_id": self.launch_id,
                "attempt": self.attempt, "step": self.step, "phase": self.phase,
                "seconds_since_progress": round(stale_s, 3), "time": time.time(),
            })

    def _fire(self, stale_s: float) -> None:
        where = self._main_thread_frame()
        f = self._stack_file
        f.write(f"\n=== rank {self.rank} (pid {os.getpid()}, attempt {self.attempt}): no progress for "
                f"{stale_s:.1f}s ({self.deadline_setting} {self.deadline_s:g}s) at step {self.step}, phase "
                f"{self.phase!r}; {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.flush()
        silent = self.silent_peers()
        atomic_write_json(self.run_dir / f"hang-rank{self.rank}.json", {
            "rank": self.rank, "pid": os.getpid(), "attempt": self.attempt, "step": self.step,
            "phase": self.phase, "seconds_since_progress": round(stale_s, 1),
            "timeout_s": self.deadline_s, "setting": self.deadline_setting, "where": where,
            "stack_file": str(self.stack_path),
            "silent_ranks": [{k: v for k, v in peer.items() if k != "record"} for peer in silent],
        })
        self._signal_peers()
        time.sleep(1.0)  # let the peers' faulthandlers finish writing before the job is torn down
        # A silent peer (stopped, or frozen with the GIL held) neither dumps its stack nor obeys
        # torchrun's SIGTERM, which would then wait 30 s before killing it: end it now, so the
        # job ends within timeout_s + a few seconds.
        for peer in silent:
            if same_process_alive(peer["record"]) is True:
                with contextlib.suppress(OSError):
                    os.kill(peer["pid"], signal.SIGKILL)
        quiet = "".join(f"; rank {p['rank']} (pid {p['pid']}) is silent" for p in silent)
        print(f"shardwise watchdog: rank {self.rank} made no progress for {stale_s:.0f}s "
              f"(step {self.step}, {self.phase}, at {where}){quiet}; stacks in {self.stack_path.parent}",
              file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)

    def silent_peers(self) -> list[dict[str, Any]]:
        """The other ranks of this launch on this host whose watchdog itself stopped writing heartbeats.

        A rank blocked in a collective still writes heartbeats (its watchdog thread runs); one
        whose heartbeat is older than a few polls is stopped (SIGSTOP, a debugger) or frozen
        (a C call holding the GIL): it is the rank the others wait for.
        """
        limit = max(5 * self.poll_s, 3.0)
        now = time.time()
        out = []
        for info in self._peer_heartbeats():
            age = now - info["time"] if isinstance(info.get("time"), (int, float)) else None
            if age is None or age <= limit or same_process_alive(info) is not True:
                continue
            out.append({"rank": info.get("rank"), "pid": info["pid"], "seconds_silent": round(age, 1),
                        "state": process_state(info["pid"]), "step": info.get("step"),
                        "phase": info.get("phase"), "record": info})
        return out

    def _main_thread_frame(self) -> str:
        frame = sys._current_frames().get(self._main_ident)  # noqa: SLF001 - the documented way
        if frame is None:
            return "unknown"
        last = traceback.extract_stack(frame)[-1]
        return f"{last.filename}:{last.lineno} in {last.name}"

    def _signal_peers(self) -> None:
        if not hasattr(signal, "SIGUSR1"):
            return
        for pid in self.peer_pids():
            with contextlib.suppress(OSError):  # gone meanwhile
                os.kill(pid, signal.SIGUSR1)

    def peer_pids(self) -> list[int]:
        """PIDs of the other ranks of this launch and attempt on this host, each proven alive and the same process.

        A heartbeat counts only with this launch id and attempt, on this host, and when the process
        with its PID has the start time it recorded (``identity.same_process_alive`` is True).
        """
        return [info["pid"] for info in self._peer_heartbeats() if same_process_alive(info) is True]

    def _peer_heartbeats(self) -> list[dict[str, Any]]:
        """The heartbeats of the other ranks of this launch and attempt (claims, not yet checked)."""
        out = []
        for beat in sorted(self.heartbeat_path.parent.glob("rank*.json")):
            try:
                info = json.loads(beat.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not isinstance(info, dict) or info.get("rank") == self.rank:
                continue
            if info.get("launch_id") != self.launch_id or info.get("attempt") != self.attempt:
                continue
            pid = info.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid == os.getpid():
                continue
            out.append(info)
        return out


def process_state(pid: int) -> str:
    """'stopped', 'running', ... for ``pid`` from /proc (Linux); '' where unknown."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="utf-8", errors="replace") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return ""
    return {"T": "stopped", "t": "stopped by a debugger", "R": "running", "S": "sleeping",
            "D": "in uninterruptible I/O", "Z": "exited"}.get(code, code)


def hang_reports(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The hang reports ranks wrote in ``run_dir`` (empty when no watchdog fired)."""
    out = []
    for p in sorted(Path(run_dir).glob("hang-rank*.json")):
        try:
            out.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def _age(report: dict[str, Any]) -> str:
    """', last progress Ns before' for a hang report that records its age ('' when it does not)."""
    age = report.get("seconds_since_progress")
    return f", last progress {age:.0f}s before" if isinstance(age, (int, float)) else ""


def describe_hang(run_dir: str | os.PathLike) -> str | None:
    """One paragraph naming the stuck ranks, their step/phase and where; None when no hang."""
    reports = [r for r in hang_reports(run_dir) if isinstance(r, dict) and isinstance(r.get("attempt", 0), int)]
    if not reports:
        return None
    latest = max(r.get("attempt", 0) for r in reports)
    reports = [r for r in reports if r.get("attempt", 0) == latest]
    parts = [f"rank {r.get('rank')} at step {r.get('step')} ({r.get('phase')}{_age(r)}) in {r.get('where')}"
             for r in reports]
    timeout = reports[0].get("timeout_s")
    timeout = f"{timeout:g}" if isinstance(timeout, (int, float)) else "?"
    silent: dict[Any, dict[str, Any]] = {}
    for r in reports:
        for peer in r.get("silent_ranks") or []:
            if isinstance(peer, dict):
                silent.setdefault(peer.get("rank"), peer)
    reported = {r.get("rank") for r in reports}
    silent = {k: v for k, v in silent.items() if k not in reported}
    if silent:
        names = "; ".join(f"rank {p.get('rank')} (pid {p.get('pid')}, last at step {p.get('step')}, "
                          f"{p.get('state') or 'frozen'}, no heartbeat for {p.get('seconds_silent')}s)"
                          for _, p in sorted(silent.items(), key=lambda kv: str(kv[0])))
        who = (f" The silent rank(s), which the others were waiting for: {names}; a stopped or frozen "
               "process leaves no stack, so it was ended.")
        stacks = f"The stacks of the ranks that answered are in {Path(run_dir) / 'stacks'}."
    else:
        who = ""
        stacks = (f"Every rank's Python stack is in {Path(run_dir) / 'stacks'}. A rank waiting inside a "
                  "collective is usually waiting for another rank that never reached it.")
    setting = reports[0].get("setting")
    setting = setting if setting in ("watchdog.timeout_s", "watchdog.first_step_timeout_s") else "watchdog.timeout_s"
    return (f"training hung: no progress for more than {timeout}s ({setting}) on "
            f"{'; '.join(parts)}.{who} {stacks}")
