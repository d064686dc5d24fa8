"""Hang detection: a rank that stops participating ends the job non-zero, with every rank's stack."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from shardwise.runtime.watchdog import HANG_EXIT_CODE, Watchdog, describe_hang
from tests.helpers.ckpt import cli_args, fast_overrides, run_cli, small_text

TIMEOUT_S = 3
# Stated margin between the watchdog timeout and the job's end: process start-up (torch import,
# rendezvous: ~10-20 s on a loaded 2-core machine), the poll interval and the 1 s stack wait.
MARGIN_S = 90


def test_watchdog_unit_fires_on_a_stuck_process(tmp_path):
    script = (
        "import time; from shardwise.runtime.watchdog import Watchdog\n"
        f"w = Watchdog({str(tmp_path)!r}, rank=0, timeout_s=1.0).start()\n"
        "w.beat(5, 'train')\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == HANG_EXIT_CODE
    assert time.monotonic() - t0 < 30
    report = json.loads((tmp_path / "hang-rank0.json").read_text())
    assert report["step"] == 5 and report["phase"] == "train" and "<string>" in report["where"]
    assert "time.sleep" in (tmp_path / "stacks" / "rank0.txt").read_text() or \
        'File "<string>"' in (tmp_path / "stacks" / "rank0.txt").read_text()


@pytest.mark.slow
def test_stuck_rank_is_detected_stacks_written_exit_nonzero(tmp_path, cli_env):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--nproc", "2", "--strategy", "ddp", "--out", str(out),
            *cli_args(fast_overrides(data, steps=40)), "--set", f"watchdog.timeout_s={TIMEOUT_S}",
            "--set", "debug.hang_rank=1", "--set", "debug.hang_at_step=4"]
    t0 = time.monotonic()
    proc = run_cli(argv, cli_env, timeout=TIMEOUT_S + MARGIN_S + 60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    assert elapsed < TIMEOUT_S + MARGIN_S
    err = proc.stderr
    assert "training hung" in err and "rank 1 at step 4" in err and "_inject_faults" in err
    assert "stacks" in err
    for rank in (0, 1):
        stack = (out / "stacks" / f"rank{rank}.txt").read_text()
        assert "most recent call first" in stack
    # Rank 0 is blocked in DDP's gradient all-reduce, waiting for rank 1.
    assert "backward" in (out / "stacks" / "rank0.txt").read_text()
    assert "time.sleep" in describe_hang(out) or "_inject_faults" in describe_hang(out)
    # Steps 3 was checkpointed: the hang lost nothing before it.
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000003"


@pytest.mark.slow
def test_persistent_hang_under_restarts_still_ends_nonzero(tmp_path, cli_env):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--nproc", "2", "--strategy", "ddp", "--out", str(out), "--max-restarts", "1",
            *cli_args(fast_overrides(data, steps=40)), "--set", f"watchdog.timeout_s={TIMEOUT_S}",
            "--set", "debug.hang_rank=0", "--set", "debug.hang_at_step=2",
            "--set", "debug.every_attempt=true"]
    proc = run_cli(argv, cli_env, timeout=2 * (TIMEOUT_S + MARGIN_S))
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in out.glob("hang-rank*.json")]
    assert max(r["attempt"] for r in reports) == 1, proc.stderr[-4000:]  # the restart hung again


# ------------------------------------------------------------------ only this launch's ranks
_HANG_SCRIPT = (
    "import time; from shardwise.runtime.watchdog import Watchdog\n"
    "w = Watchdog({run!r}, rank=0, timeout_s=1.0, launch_id='this-launch').start()\n"
    "w.beat(5, 'train')\n"
    "time.sleep(60)\n"
)


def _bystander() -> subprocess.Popen:
    """An unrelated process that SIGUSR1 would kill (default action: terminate)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _heartbeat(run, rank: int, **info) -> None:
    (run / "heartbeat").mkdir(parents=True, exist_ok=True)
    (run / "heartbeat" / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "attempt": 0, **info}))


def test_watchdog_never_signals_a_process_outside_its_launch(tmp_path):
    import socket

    from shardwise.runtime.identity import boot_id, process_start_time

    host = socket.gethostname()
    victims = [_bystander() for _ in range(4)]
    peer = _bystander()
    try:
        start = {p.pid: process_start_time(p.pid) for p in [*victims, peer]}
        # A stale heartbeat of an older shardwise (no launch id, no start time) ...
        _heartbeat(tmp_path, 1, pid=victims[0].pid, host=host)
        # ... one of another launch ...
        _heartbeat(tmp_path, 2, pid=victims[1].pid, host=host, launch_id="other-launch",
                   start_time=start[victims[1].pid], boot_id=boot_id())
        # ... one of this launch whose PID now belongs to another process (start time differs) ...
        _heartbeat(tmp_path, 3, pid=victims[2].pid, host=host, launch_id="this-launch",
                   start_time=start[victims[2].pid] - 1, boot_id=boot_id())
        # ... one of this launch but an earlier attempt ...
        _heartbeat(tmp_path, 4, pid=victims[3].pid, host=host, launch_id="this-launch", attempt=-1,
                   start_time=start[victims[3].pid], boot_id=boot_id())
        # ... and a genuine peer rank of this launch: the only one to be signalled.
        _heartbeat(tmp_path, 5, pid=peer.pid, host=host, launch_id="this-launch",
                   start_time=start[peer.pid], boot_id=boot_id())
        proc = subprocess.run([sys.executable, "-c", _HANG_SCRIPT.format(run=str(tmp_path))],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == HANG_EXIT_CODE, proc.stderr
        assert peer.wait(timeout=10) == -signal.SIGUSR1
        assert all(v.poll() is None for v in victims), [v.poll() for v in victims]
    finally:
        for p in [*victims, peer]:
            p.kill()
            p.wait()


def test_heartbeats_record_launch_id_and_process_start_time(tmp_path):
    from shardwise.runtime.identity import process_start_time
    from shardwise.runtime.watchdog import Watchdog

    w = Watchdog(tmp_path, rank=0, timeout_s=30, poll_s=0.05, launch_id="L1").start()
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "heartbeat" / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        w.stop()
    beat = json.loads((tmp_path / "heartbeat" / "rank0.json").read_text())
    assert beat["launch_id"] == "L1" and beat["start_time"] == process_start_time(os.getpid())


def test_launch_id_from_the_launcher_or_derived_under_plain_torchrun(monkeypatch):
    from shardwise.runtime.identity import LAUNCH_ID_ENV, launch_id

    monkeypatch.setenv(LAUNCH_ID_ENV, "from-launcher")
    assert launch_id() == "from-launcher"
    monkeypatch.delenv(LAUNCH_ID_ENV)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-7")
    derived = launch_id()
    assert derived.startswith("torchrun-rdzv-7-") and str(os.getppid()) in derived
    assert launch_id() == derived  # every rank of this torchrun (same agent) derives the same one


def test_the_launcher_clears_old_heartbeats_and_reports(tmp_path, capsys):
    from shardwise.cli import main
    from tests.helpers.ckpt import cli_args, fast_overrides

    out = tmp_path / "run"
    _heartbeat(out, 7, pid=1, host="somewhere")
    (out / "hang-rank3.json").write_text("{}")
    code = main(["train", "--nproc", "1", "--out", str(out),
                 *cli_args(fast_overrides(small_text(tmp_path), steps=2, every=0))])
    assert code == 0, capsys.readouterr().err
    assert not (out / "heartbeat" / "rank7.json").exists() and not (out / "hang-rank3.json").exists()


def test_a_long_text_sample_after_the_final_save_is_not_a_hang(tmp_path, cli_env):
    # The sample (1000 tokens, several seconds here) runs after training and the final save: the
    # watchdog (3 s) has stopped by then.
    data = small_text(tmp_path)
    out = tmp_path / "run"
    overrides = [*fast_overrides(data, steps=2, every=0), "watchdog.timeout_s=3", "train.sample_tokens=1000",
                 "checkpoint.at_end=false"]
    proc = run_cli(["train", "--nproc", "1", "--out", str(out), *cli_args(overrides)], cli_env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--- sample ---" in proc.stdout and not (out / "hang-rank0.json").exists()


def test_the_first_step_has_its_own_allowance(tmp_path):
    """A first step that compiles for longer than timeout_s is not a hang; a later silence is, and the
    report names the setting that was exceeded."""
    w = Watchdog(tmp_path, rank=0, timeout_s=2.0, poll_s=0.05, first_step_timeout_s=60.0, launch_id="L")
    assert (w.deadline_s, w.deadline_setting) == (60.0, "watchdog.first_step_timeout_s")
    w.beat(0, "resume")
    assert w.deadline_s == 60.0  # loading a checkpoint is before the first step too
    w.beat(1, "train")
    assert (w.deadline_s, w.deadline_setting) == (2.0, "watchdog.timeout_s")
    w.beat(phase="eval")
    assert w.deadline_s == 2.0  # once past the first step, for good
    same = Watchdog(tmp_path, rank=0, timeout_s=900.0, first_step_timeout_s=60.0)
    assert (same.deadline_s, same.deadline_setting) == (900.0, "watchdog.timeout_s")  # never shorter
