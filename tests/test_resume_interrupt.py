"""A clean interrupt (SIGTERM): the step finishes, a checkpoint is saved, exit 130, resume continues."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.ckpt import cli_args, fast_overrides, losses, run_cli, small_text

pytestmark = pytest.mark.slow


def test_sigterm_saves_and_the_run_resumes(tmp_path, cli_env):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    # Constant lr, so the resumed run (given its real length) trains the same steps.
    overrides = [*fast_overrides(data, steps=100000, every=0), "train.warmup_steps=0", "train.min_lr=1e-3"]
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "train", "--nproc", "2", "--strategy", "ddp",
                             "--out", str(out), *cli_args(overrides)], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    beat = out / "heartbeat" / "rank0.json"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # wait until training is under way
        try:
            if (json.loads(beat.read_text()).get("step") or 0) >= 3:
                break
        except (OSError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # like a scheduler: to the launcher, which forwards it
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted: checkpoint saved at step" in err and "--resume" in err
    summary = json.loads((out / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["interrupted"] and stopped >= 3
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:08d}"
    assert max(losses(out)) == stopped  # the step in flight was finished, and nothing after it

    resumed = run_cli(["train", "--out", str(out), "--resume", "--set", f"train.steps={stopped + 2}"],
                      cli_env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stopped}" in resumed.stderr
    assert sorted(losses(out)) == list(range(1, stopped + 3))
