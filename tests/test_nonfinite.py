"""A NaN/inf loss or gradient norm stops the run cleanly (exit 4), or is skipped and counted.

The NaN is injected with ``debug.nan_loss_at_step`` (the loss is multiplied by NaN at that step),
so the cases are exact: the first bad step, which checkpoints exist, what the summary counts.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from shardwise.cli import main
from shardwise.errors import NONFINITE_EXIT_CODE, NonFiniteError
from shardwise.runtime.checkpoint.export import read_full_model_state
from shardwise.runtime.checkpoint.locate import complete_checkpoints, latest_checkpoint
from tests.helpers.ckpt import cli_args, fast_overrides, run_cli, small_text

ONE = ["--nproc", "1", "--strategy", "single"]


def _train(capsys, out, data, *overrides: str, steps: int = 6, every: int = 2):
    args = cli_args([*fast_overrides(data, steps=steps, every=every, micro_batch=16), "checkpoint.keep_last=10",
                     *overrides])
    code = main(["train", *ONE, "--out", str(out), *args])
    return code, capsys.readouterr().err


def _finite(path) -> bool:
    weights, _ = read_full_model_state(path)
    return all(torch.isfinite(w).all() for w in weights.values())


@pytest.fixture
def data(tmp_path):
    return small_text(tmp_path)


def test_a_nan_loss_stops_the_run_before_the_next_checkpoint(tmp_path, data, capsys):
    out = tmp_path / "run"
    # NaN at step 3; metrics only every 100 steps, so the check that catches it is the one before
    # the step-4 checkpoint: that checkpoint must never be written.
    code, err = _train(capsys, out, data, "debug.nan_loss_at_step=3", "train.log_every=100")
    assert code == NONFINITE_EXIT_CODE, err
    last = err.strip().splitlines()[-1]  # after the run's own log lines: one paragraph
    assert last.startswith("error: training stopped") and "Traceback" not in err, err
    assert "non-finite (NaN/inf) at step 3" in last
    assert "step-00000002" in err and "--resume" in err  # the last good checkpoint, and how to continue
    root = out / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000002"]
    assert latest_checkpoint(root).name == "step-00000002" and _finite(root)
    assert not (out / "summary.json").exists()  # not reported as a finished run


def test_the_check_also_runs_at_logging_steps_and_at_the_end(tmp_path, data, capsys):
    out = tmp_path / "run"
    code, err = _train(capsys, out, data, "debug.nan_loss_at_step=5", "checkpoint.at_end=false", every=0)
    assert code == NONFINITE_EXIT_CODE and "at step 5" in err and "No checkpoint was saved" in err
    losses = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r] == [1, 2, 3, 4]  # nothing logged after it


def test_skip_mode_skips_and_counts_the_bad_steps(tmp_path, data, capsys):
    out = tmp_path / "run"
    code, err = _train(capsys, out, data, "train.nonfinite=skip", "debug.nan_loss_at_step=3",
                       "debug.nan_loss_steps=2")
    assert code == 0, err
    assert "step 3: non-finite loss or gradient norm; optimizer step skipped" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and summary["steps"] == 6
    assert math.isfinite(summary["final_train_loss"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records if "loss" in r}
    assert by_step[3]["loss"] is None and by_step[2]["skipped_steps"] == 0 and by_step[6]["skipped_steps"] == 2
    for path in complete_checkpoints(out / "checkpoints"):
        assert _finite(path), path  # the skipped steps never reached the weights


def test_skip_mode_gives_up_after_too_many_in_a_row(tmp_path, data, capsys):
    out = tmp_path / "run"
    code, err = _train(capsys, out, data, "train.nonfinite=skip", "train.max_nonfinite_skips=3",
                       "debug.nan_loss_at_step=2", "debug.nan_loss_steps=10")
    assert code == NONFINITE_EXIT_CODE, err
    assert "3 optimizer steps in a row" in err and "steps 2-4" in err and "train.max_nonfinite_skips = 3" in err


def test_weights_holding_nan_are_never_saved(tmp_path, data):
    from shardwise.core.config import load_config
    from shardwise.runtime.trainer import Trainer

    cfg = load_config(None, fast_overrides(data, steps=2, micro_batch=16))
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        with torch.no_grad():
            next(trainer.model.parameters())[0].fill_(float("nan"))
        with pytest.raises(NonFiniteError, match="weights hold NaN/inf"):
            trainer.save_checkpoint()
    finally:
        trainer.session.close()
    assert not complete_checkpoints(tmp_path / "run" / "checkpoints")


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_with_exit_4(tmp_path, data, cli_env):
    """Two ranks, NaN on rank 1 only: the decision is collective, and the launcher exits 4."""
    out = tmp_path / "run"
    overrides = [*fast_overrides(data, steps=6, every=2), "debug.nan_loss_at_step=3", "debug.nan_loss_rank=1"]
    proc = run_cli(["train", "--nproc", "2", "--strategy", "ddp", "--out", str(out), *cli_args(overrides)],
                   cli_env)
    assert proc.returncode == NONFINITE_EXIT_CODE, proc.stderr[-3000:]
    # Every rank stops on the same collective decision; whichever rank's report the launcher reads
    # first is named (torchrun stops the others once one has exited).
    assert re.search(r"error: rank [01] failed: training stopped", proc.stderr) and "at step 3" in proc.stderr
    assert latest_checkpoint(out / "checkpoints").name == "step-00000002"
