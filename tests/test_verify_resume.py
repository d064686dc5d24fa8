"""``shardwise verify --resume``: interrupted twice and resumed equals uninterrupted, or the first
differing step is named (a planted defect: a data set that does not resume where it stopped).

Each case runs ``shardwise train`` four times (one rank, a small custom model: a few seconds per
run unloaded).
"""

from __future__ import annotations

import json

from shardwise.cli import main

CUSTOM = ["--set", "model.kind=custom", "--set", 'model.factory="tests.helpers.models:build_mlp"',
          "--set", "data.kind=custom", "--set", "train.micro_batch_size=8", "--set", "train.lr=1e-3",
          "--set", "train.warmup_steps=0", "--set", "train.progress=false", "--set", "train.sample_tokens=0",
          "--set", "train.eval_every=0"]


def _verify(tmp_path, name: str, data_factory: str, capsys) -> tuple[int, dict, str]:
    out = tmp_path / name
    code = main(["verify", "--resume", "--nproc", "1", "--steps", "7", "--out", str(out), *CUSTOM,
                 "--set", f'data.factory="tests.helpers.models:{data_factory}"'])
    text = capsys.readouterr().out
    return code, json.loads((out / "verify-resume.json").read_text()), text


def test_verify_resume_passes_on_a_custom_model_and_names_the_first_step_of_a_planted_defect(
        tmp_path, capsys, cli_env, monkeypatch):
    for key in ("PYTHONPATH",):  # the runs are `shardwise train` subprocesses: they import tests.helpers
        monkeypatch.setenv(key, cli_env[key])
    code, report, text = _verify(tmp_path, "good", "build_blobs", capsys)
    assert code == 0, text
    assert report["passed"] and report["exact"] and report["first_difference"] is None
    assert report["interrupts"] == [2, 4] and len(report["reference_losses"]) == 7
    assert "PASS" in text and "bit for bit" in text
    # Steps 1-3 ran before the first resume and agree; the resumed process reads other items from
    # step 4 (resumed from the checkpoint of step 3) on.
    code, report, text = _verify(tmp_path, "defect", "build_forgetful_blobs", capsys)
    assert code == 1, text
    assert report["first_difference"] == 4, text
    assert "FAIL" in text and "first differing step: 4" in text
