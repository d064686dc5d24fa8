"""Hang detection: a rank that stops participating ends the job non-zero, with every rank's stack."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from shardwise.runtime.watchdog import HANG_EXIT_CODE, describe_hang
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
