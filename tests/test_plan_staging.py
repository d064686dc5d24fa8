"""The plan says what asynchronous checkpoints hold in host memory, and recommends sync where that does
not fit beside the run (checkpoint.mode's default is async; runtime/checkpoint/background.py)."""

from __future__ import annotations

from shardwise.cli import main


def test_plan_reports_checkpoint_staging_and_recommends_sync_where_it_does_not_fit(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("checkpoints:"))
    assert "within the node's" in line and "checkpoint.mode=sync" not in line
    # The same plan on nodes with little host memory: each rank's stored state is staged once more.
    assert main(["plan", "--model", "llama-3-8b", "--gpus-per-node", "8", "--host-ram-gib", "64"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("checkpoints:"))
    assert "does not fit beside the run" in line and "--set checkpoint.mode=sync" in line
