"""No orphans, no second writer: ranks die with their launcher, and the lock outlives no rank.

A real ``shardwise train --nproc 2`` (gloo) whose launcher is SIGKILLed: every rank and the torchrun
agent must be gone within seconds, no checkpoint may be published after the kill, and the run
resumes cleanly afterwards. A lock whose launcher is gone but one of whose ranks still runs is
never taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.runtime.identity import process_record, same_process_alive
from tests.helpers.ckpt import cli_args, fast_overrides, small_text

LOCK_FILE = ".shardwise.lock"


def _alive(record: dict) -> bool:
    return same_process_alive(record) is not False


def _latest_step(run: Path) -> int:
    try:
        return int((run / "checkpoints" / "latest").read_text().strip().rsplit("-", 1)[1])
    except (OSError, ValueError, IndexError):
        return -1


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(entry.name))
                todo.append(int(entry.name))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_killed_launcher_leaves_no_rank_and_no_later_checkpoint(tmp_path, cli_env, capsys):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    overrides = [*fast_overrides(data, steps=100000, every=1, micro_batch=8), "checkpoint.keep_last=2"]
    launcher = subprocess.Popen([sys.executable, "-m", "shardwise", "train", "--nproc", "2", "--strategy", "ddp",
                                 "--out", str(out), *cli_args(overrides)], env=cli_env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and _latest_step(out) < 2:
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            time.sleep(0.2)
        assert _latest_step(out) >= 2, "the run never saved"
        # Every process of the job: the agent and both ranks (which registered in the lock).
        lock = json.loads((out / LOCK_FILE).read_text())
        ranks = {r["rank"]: r for r in lock["ranks"]}
        assert sorted(ranks) == [0, 1], lock
        job = [process_record(pid) for pid in _children(launcher.pid)]
        assert len(job) >= 3, job  # agent + 2 ranks
        os.kill(launcher.pid, signal.SIGKILL)
        killed_at, step_at_kill = time.monotonic(), _latest_step(out)
        launcher.wait(timeout=30)
        while time.monotonic() < killed_at + 10 and any(_alive(p) for p in job):
            time.sleep(0.1)
        survivors = [p["pid"] for p in job if _alive(p)]
        assert not survivors, f"processes outlived their launcher: {survivors}"
        gone_after = time.monotonic() - killed_at
        # At most the save that was being written at the kill could have been published (it
        # was not: the writer checks its launcher before publishing, but the kill may land
        # after that check).
        assert _latest_step(out) <= step_at_kill + 1
        before = sorted(p.name for p in (out / "checkpoints").iterdir())
        time.sleep(2)
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    finally:
        for p in [launcher.pid, *_children(launcher.pid)]:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
    print(f"all processes gone {gone_after:.1f}s after the kill")
    # The killed job's lock is stale (launcher and every rank gone): --resume takes it over and
    # continues from the last published checkpoint.
    last = _latest_step(out)
    code = main(["train", "--nproc", "1", "--strategy", "single", "--out", str(out), "--resume",
                 "--set", f"train.steps={last + 1}"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "took over the stale lock" in err and "Traceback" not in err


def test_a_lock_whose_launcher_is_gone_but_a_rank_lives_is_refused(tmp_path, capsys):
    from shardwise.job.runlock import RunLock, register_rank

    data = small_text(tmp_path)
    out = tmp_path / "run"
    code = main(["train", "--nproc", "1", "--strategy", "single", "--out", str(out),
                 *cli_args(fast_overrides(data, steps=2, every=1))])
    assert code == 0, capsys.readouterr().err
    # A job whose launcher is gone (a finished process) but whose rank 1 (a live process) is not.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead = {**process_record(), "pid": int(gone.stdout), "start_time": 1}
        rank = {**process_record(orphan.pid), "rank": 1}
        (out / LOCK_FILE).write_text(json.dumps({**dead, "job_id": "old-job", "time": time.time(),
                                                 "command": "shardwise train", "members": [dead],
                                                 "ranks": [rank]}))
        capsys.readouterr()
        code = main(["train", "--out", str(out), "--resume", "--set", "train.steps=3"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert f"rank 1 of that job still runs as pid {orphan.pid}" in err and "Traceback" not in err
        # A rank of another job never registers into this lock (it would write into a directory
        # its job no longer owns).
        with pytest.raises(Exception, match="locked by another job"):
            register_rank(out, "new-job", 0)
    finally:
        orphan.kill()
        orphan.wait()
    # Once the orphan is gone, the lock is stale and is taken over.
    lock = RunLock(out, job_id="new-job").acquire()
    assert lock.took_over is not None
    lock.release()


_CHILD = (
    "import sys, time\n"
    "from shardwise.runtime import lifeline\n"
    "lifeline.set_parent_death_signal = lambda *a: False  # the portable path alone\n"
    "lifeline.start('rank 0')\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize("who", ["parent", "launcher"])
def test_lifeline_thread_alone_stops_an_orphan(tmp_path, cli_env, who):
    """Without the parent-death signal (non-Linux), the lifeline thread still ends the orphan."""
    from shardwise.runtime.lifeline import ORPHAN_EXIT_CODE, launcher_env

    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    env = dict(cli_env, **(launcher_env() if who == "parent" else {}))
    if who == "launcher":  # the launcher is another process than the parent
        env["SHARDWISE_LAUNCHER"] = json.dumps(process_record(stand_in.pid))
    # parent: a shell that runs the child and reports its exit code
    parent = subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$CHILD"; echo "exit $?"'],
                              env=dict(env, CHILD=_CHILD), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        child = _children(parent.pid)
        assert len(child) == 1
        record = process_record(child[0])
        t0 = time.monotonic()
        if who == "parent":
            os.kill(parent.pid, signal.SIGKILL)
        else:
            os.kill(stand_in.pid, signal.SIGKILL)
            stand_in.wait()
        while time.monotonic() < t0 + 5 and _alive(record):
            time.sleep(0.05)
        assert not _alive(record), "the orphan kept running"
        if who == "launcher":
            out, err = parent.communicate(timeout=10)
            assert out.strip() == f"exit {ORPHAN_EXIT_CODE}" and "the launcher (pid" in err, (out, err)
    finally:
        for proc in (parent, stand_in):
            proc.kill()
            proc.wait()


def test_a_lock_held_on_another_host_is_taken_over_only_when_its_rank_heartbeats_are_stale(tmp_path, capsys):
    """A lock whose job ran on another host is taken over once every rank the lock names
    there has a stale heartbeat (the watchdog's files in the shared run directory); a fresh or
    missing heartbeat refuses, naming the host and how to clear the lock. Fabricated records:
    no second host is needed."""
    from shardwise.errors import ConfigError
    from shardwise.job.runlock import LOCK_FILE, RunLock
    from shardwise.runtime.watchdog import STALE_HEARTBEAT_S

    host = "gpu-node-17.example"
    ranks = [{"host": host, "pid": 4000 + r, "start_time": 777 + r, "boot_id": "b", "rank": r} for r in (0, 1)]
    launcher = {"host": host, "pid": 3999, "start_time": 5, "boot_id": "b", "member_id": "m"}

    def plant(name: str, ages: dict[int, float | None]) -> Path:
        run = tmp_path / name
        (run / "heartbeat").mkdir(parents=True)
        (run / LOCK_FILE).write_text(json.dumps({**launcher, "job_id": "old-job", "time": time.time() - 9999,
                                                 "command": "shardwise train", "members": [launcher],
                                                 "ranks": ranks}))
        for rank, age in ages.items():
            if age is None:
                continue
            beat = run / "heartbeat" / f"rank{rank}.json"
            beat.write_text(json.dumps({**ranks[rank], "launch_id": "l", "attempt": 0, "step": 7,
                                        "time": time.time() - age}))
            os.utime(beat, (time.time() - age, time.time() - age))
        return run

    stale = STALE_HEARTBEAT_S + 60
    run = plant("stale", {0: stale, 1: stale})
    lock = RunLock(run, job_id="new-job").acquire()
    assert json.loads((run / LOCK_FILE).read_text())["job_id"] == "new-job"
    err = capsys.readouterr().err
    assert "took over the stale lock" in err and host in err and "no heartbeat for over" in err, err
    lock.release()

    for name, ages, words in (("fresh", {0: stale, 1: 2.0}, "still write heartbeats"),
                              ("missing", {0: stale}, "left no heartbeat"),
                              ("none", {}, "left no heartbeat")):
        run = plant(name, ages)
        before = (run / LOCK_FILE).read_text()
        with pytest.raises(ConfigError) as e:
            RunLock(run, job_id="new-job").acquire()
        text = str(e.value)
        assert words in text and host in text and f"delete {run / LOCK_FILE}" in text, text
        assert (run / LOCK_FILE).read_text() == before

    # A heartbeat file's own clock running behind (skew) does not make a live rank look stale:
    # its modification time is newer.
    run = plant("skew", {0: stale, 1: stale})
    os.utime(run / "heartbeat" / "rank1.json")
    with pytest.raises(ConfigError, match="still write heartbeats"):
        RunLock(run, job_id="new-job").acquire()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process state from /proc")
def test_an_exited_process_not_yet_reaped_is_not_alive():
    """A launcher killed under a parent that has not waited for it yet is a zombie: its PID and /proc
    entry remain, but the ranks' lifeline (checked right before publishing a checkpoint) must see it gone."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        record = process_record(child.pid)
        assert same_process_alive(record) is True
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and ") Z " not in Path(f"/proc/{child.pid}/stat").read_text():
            time.sleep(0.01)
        assert same_process_alive(record) is False  # exited, not yet reaped
    finally:
        child.kill()
        child.wait()
