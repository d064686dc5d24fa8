"""Elastic restarts: `--max-restarts` survives a SIGKILLed rank and a rank killed mid-checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers.ckpt import cli_args, fast_overrides, final_weights, losses, run_cli, small_text

pytestmark = pytest.mark.slow


def _launch(argv, env):
    return subprocess.Popen([sys.executable, "-m", "shardwise", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_killed_rank_is_restarted_and_matches_uninterrupted_run(tmp_path, cli_env):
    data = small_text(tmp_path)
    common = ["train", "--nproc", "2", "--strategy", "ddp", *cli_args(fast_overrides(data))]
    ref_dir, run_dir, mid_dir = tmp_path / "ref", tmp_path / "run", tmp_path / "mid"
    ref = _launch([*common, "--out", str(ref_dir)], cli_env)
    # Rank 1 SIGKILLs itself after step 8 (checkpoints every 3 steps: steps 7-8 are lost work).
    run = run_cli([*common, "--out", str(run_dir), "--max-restarts", "1",
                   "--set", "debug.kill_rank=1", "--set", "debug.kill_at_step=8"], cli_env)
    ref_out = ref.communicate(timeout=240)[0]
    assert ref.returncode == 0, ref_out
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Signal 9 (SIGKILL)" in run.stderr or "exitcode: -9" in run.stderr
    # Step 6's checkpoint is written in the background (checkpoint.mode auto): when it was still
    # in flight at the kill, it was never published and the restart resumes from step 3.
    assert "resumed from" in run.stderr
    assert "step-00000006 at step 6" in run.stderr or "step-00000003 at step 3" in run.stderr
    assert losses(run_dir) == losses(ref_dir)
    ref_w, run_w = final_weights(ref_dir), final_weights(run_dir)
    assert all(torch.equal(ref_w[k], run_w[k]) for k in ref_w)

    # Killed while writing the step-6 checkpoint (its shards on disk, not yet published): the
    # restart resumes from step 3, never from the partial step 6, and still ends identical.
    mid = run_cli([*common, "--out", str(mid_dir), "--max-restarts", "1", "--set", "debug.kill_rank=0",
                   "--set", "debug.kill_at_step=6", "--set", "debug.kill_in_checkpoint=true"], cli_env)
    assert mid.returncode == 0, mid.stdout + mid.stderr
    assert "step-00000003 at step 3" in mid.stderr
    assert not list((mid_dir / "checkpoints").glob(".partial-*"))  # cleaned by the next save
    mid_w = final_weights(mid_dir)
    assert all(torch.equal(ref_w[k], mid_w[k]) for k in ref_w)


def test_a_launcher_killed_during_a_background_write_resumes_bit_exactly(tmp_path, cli_env):
    """The launcher is SIGKILLed while step 6's checkpoint is being written in the background (rank
    0's shards on disk, not yet published): every rank goes; ``latest`` names a whole checkpoint —
    step 3, or step 6 when every rank's write had finished and was gathered before the ranks saw
    their launcher gone — and ``--resume`` ends with the uninterrupted run's losses and weights, bit
    for bit."""
    import json
    import time

    from shardwise.runtime.identity import same_process_alive

    data = small_text(tmp_path)
    common = ["train", "--nproc", "2", "--strategy", "ddp", *cli_args(fast_overrides(data))]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = _launch([*common, "--out", str(ref_dir)], cli_env)
    killed = run_cli([*common, "--out", str(run_dir), "--set", "debug.kill_rank=0", "--set", "debug.kill_at_step=6",
                      "--set", "debug.kill_in_checkpoint=true", "--set", "debug.kill_launcher=true"], cli_env)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    from shardwise.runtime.checkpoint.export import inspect_checkpoint

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step-00000003", "step-00000006")
    assert inspect_checkpoint(run_dir / "checkpoints")["step"] == int(latest[-8:])  # whole, checksums hold
    ranks = json.loads((run_dir / ".shardwise.lock").read_text())["ranks"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(same_process_alive(r) is not False for r in ranks):
        time.sleep(0.2)
    # The fault is off for the resume (a new launch is a first attempt again): resumed from step 3,
    # the saved config's kill at step 6 would fire once more.
    resumed = run_cli([*common, "--out", str(run_dir), "--resume", "--set", "debug.kill_rank=-1"], cli_env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"{latest} at step {int(latest[-8:])}" in resumed.stderr and "Traceback" not in resumed.stderr
    assert ref.communicate(timeout=240)[0] is not None and ref.returncode == 0
    assert losses(run_dir) == losses(ref_dir)
    ref_w, run_w = final_weights(ref_dir), final_weights(run_dir)
    assert all(torch.equal(ref_w[k], run_w[k]) for k in ref_w)
