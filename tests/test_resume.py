"""`shardwise train --resume`: exact continuation after a kill, and clear refusals of bad checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardwise.cli import main
from shardwise.runtime.checkpoint.manifest import read_manifest
from tests.helpers.ckpt import cli_args, fast_overrides, final_weights, losses, run_cli, small_text


@pytest.mark.slow
def test_resume_after_kill_is_bitwise_identical_mid_epoch(tmp_path, cli_env):
    """Same world size and strategy: every per-step loss and the final weights equal bitwise."""
    data = small_text(tmp_path)
    common = ["train", "--nproc", "2", "--strategy", "ddp", *cli_args(fast_overrides(data))]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    # The reference and the run that gets killed after step 8 run side by side.
    ref = subprocess.Popen([sys.executable, "-m", "shardwise", *common, "--out", str(ref_dir)],
                           env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = run_cli([*common, "--out", str(run_dir), "--set", "debug.kill_rank=1",
                      "--set", "debug.kill_at_step=8"], cli_env)
    ref_out = ref.communicate(timeout=240)[0]
    assert ref.returncode == 0, ref_out
    assert killed.returncode != 0  # SIGKILL without restarts: the job fails, and says so
    # Checkpoints are written in the background (checkpoint.mode = auto): a kill at step 8 may come
    # before step 6's is published, and then the run resumes from step 3 -- never from a partial one.
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step-00000003", "step-00000006")
    start = int(latest.split("-")[1])

    resumed = run_cli(["train", "--out", str(run_dir), "--resume", "--set", "debug.kill_rank=-1"], cli_env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stderr and f"{latest} at step {start}" in resumed.stderr

    # Steps 3 and 6 are mid-epoch (11 batches per epoch) and the resumed run crosses into epoch 1.
    data_pos = read_manifest(run_dir / "checkpoints" / "step-00000012")["data"]
    assert data_pos["epoch"] == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith(latest) and summary["steps"] == 14

    ref_losses, run_losses = losses(ref_dir), losses(run_dir)
    assert sorted(run_losses) == list(range(1, 15))  # one line per step: no replay, no gap
    assert run_losses == ref_losses  # bitwise
    ref_w, run_w = final_weights(ref_dir), final_weights(run_dir)
    assert all(torch.equal(ref_w[k], run_w[k]) for k in ref_w)


# --------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished single-process run with checkpoints at steps 2 and 4 (in this process: fast)."""
    tmp = tmp_path_factory.mktemp("resume")
    data = small_text(tmp)
    out = tmp / "run"
    code = main(["train", "--nproc", "1", "--strategy", "single", "--out", str(out),
                 *cli_args(fast_overrides(data, steps=4, every=2, micro_batch=16))])
    assert code == 0
    return out, data


def _resume(capsys, out, *extra):
    code = main(["train", "--nproc", "1", "--strategy", "single", "--out", str(out), *extra])
    return code, capsys.readouterr().err


def _copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_resume_without_checkpoint_refuses(tmp_path, capsys, trained_run):
    _, data = trained_run
    fresh = tmp_path / "fresh"
    code, err = _resume(capsys, fresh, "--resume", *cli_args(fast_overrides(data)))
    assert code == 2 and "no checkpoint to resume" in err and "Traceback" not in err
    assert not (fresh / "metrics.jsonl").exists()  # no silent fresh start
    code, err = _resume(capsys, tmp_path / "other", "--resume", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err


def test_resume_refuses_truncated_shard(tmp_path, capsys, trained_run):
    out = _copy_run(trained_run[0], tmp_path / "run")
    shard = out / "checkpoints" / "step-00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    code, err = _resume(capsys, out, "--resume")
    assert code == 2 and "is damaged" in err and "truncated" in err


def test_resume_refuses_tampered_manifest(tmp_path, capsys, trained_run):
    out = _copy_run(trained_run[0], tmp_path / "run")
    manifest = out / "checkpoints" / "step-00000004" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 4', '"step": 40'))
    code, err = _resume(capsys, out, "--resume")
    assert code == 2 and "modified after it was written" in err


def test_resume_refuses_other_model_shape(tmp_path, capsys, trained_run):
    out = _copy_run(trained_run[0], tmp_path / "run")
    code, err = _resume(capsys, out, "--resume", "--set", "model.overrides={n_embd=64}")
    assert code == 2 and "different shape" in err and "Traceback" not in err
