"""A resumed run is the same run: ``--resume`` keeps the run's own config.toml, lists what changes,
and refuses an unstated change of the optimisation."""

import argparse
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.core.config import load_config, to_toml
from shardwise.errors import ConfigError
from shardwise.job.resume_config import find_run_config, plan_resume


def _args(**kw) -> argparse.Namespace:
    base = {"recipe": None, "resume": None, "out": None, "nproc": None, "overrides": [], "strategy": None,
            "nnodes": None}
    return argparse.Namespace(**{**base, **kw})


def _sft_run(tmp_path: Path) -> tuple[Path, list[str]]:
    """The issue's run: hf-sft with its lr and warm-up changed, experts split over 2 ranks (fsdp, ep=2)."""
    run = tmp_path / "sft"
    run.mkdir()
    user = [f'model.pretrained="{tmp_path / "my-moe"}"', f'data.path="{tmp_path / "chat.jsonl"}"']
    cfg = load_config("hf-sft", [*user, "train.lr=1e-3", "train.warmup_steps=5", "parallel.strategy=\"fsdp\"",
                                 "parallel.ep=2", "parallel.nproc=2", f'out_dir="{run}"'])
    (run / "config.toml").write_text(to_toml(cfg))
    return run, user


def test_a_recipe_resume_on_one_rank_keeps_lr_and_warmup_and_says_what_changed(tmp_path):
    run, user = _sft_run(tmp_path)
    args = _args(recipe="hf-sft", resume=str(run / "checkpoints" / "step-00000004"), out=str(tmp_path / "new"),
                 nproc=1, overrides=list(user))
    plan = plan_resume(args, list(user))
    cfg = load_config(args.recipe, args.overrides)
    assert (cfg.train.lr, cfg.train.warmup_steps) == (1e-3, 5)  # the run's, not hf-sft's 2e-5 and 20
    # 2 replicas x 4 sequences = 8 per step: one rank keeps it with 2 accumulation steps
    assert cfg.train.grad_accum_steps == 2 and cfg.parallel.ep == 1 and cfg.out_dir == ""
    line = plan.describe()
    assert "\n" not in line
    assert "train.grad_accum_steps 1 -> 2 (keeps the global batch 8" in line
    assert 'parallel.strategy "fsdp" -> "single"' in line and "parallel.ep 2 -> 1" in line
    assert "train.lr 0.001 (not 2e-05)" in line and "train.warmup_steps 5 (not 20)" in line


def test_a_stated_change_is_applied_and_an_unstated_global_batch_change_refused(tmp_path):
    run, user = _sft_run(tmp_path)
    stated = [*user, "train.lr=5e-4"]
    args = _args(resume=str(run), out=str(tmp_path / "new"), nproc=2, overrides=list(stated))
    plan = plan_resume(args, stated)
    assert load_config(args.recipe, args.overrides).train.lr == 5e-4
    assert "train.lr 0.001 -> 0.0005" in plan.describe() and "grad_accum" not in plan.describe()
    # 3 ranks x 4 sequences cannot make 8 per step: refused, naming the keys that would say so
    args = _args(resume=str(run), out=str(tmp_path / "new"), nproc=3)
    with pytest.raises(ConfigError, match=r"global batch of 8 .*train\.micro_batch_size=N"):
        plan_resume(args, [])
    # ... unless the user states the new batch
    args = _args(resume=str(run), out=str(tmp_path / "new"), nproc=3)
    plan = plan_resume(args, ["train.micro_batch_size=2", "parallel.ep=1"])
    assert "train.micro_batch_size 4 -> 2" in plan.describe()


def test_a_bare_checkpoint_path_finds_its_run_config(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000004").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(load_config()))
    for given in (run, run / "checkpoints", run / "checkpoints" / "step-00000004"):
        assert find_run_config(str(given), None) == run / "config.toml"
    assert find_run_config("latest", str(run)) == run / "config.toml"
    assert find_run_config(str(tmp_path / "elsewhere"), None) is None


def test_resume_from_a_checkpoint_path_trains_with_the_runs_settings(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quick = ["--set", "train.steps=2", "--set", "train.progress=false", "--set", "train.eval_every=0",
             "--set", "train.sample_tokens=0", "--set", "model.overrides={n_layer=1, n_embd=32, n_head=2}",
             "--set", "train.micro_batch_size=2", "--set", "train.eval_batches=1"]
    assert main(["train", "--nproc", "1", *quick, "--set", "train.lr=1e-3", "--set", "train.progress=true",
                 "--out", "run1"]) == 0
    err = capsys.readouterr().err
    assert "loss=" in err and "val=nan" not in err  # the bar shows no val before the first evaluation
    # No recipe: the default GPT would not match the checkpoint (1 layer here); the run's config does.
    assert main(["train", "--resume", "run1/checkpoints/step-00000002", "--out", "run2", "--nproc", "1",
                 "--set", "train.steps=3"]) == 0
    err = capsys.readouterr().err
    assert "resume: the run's settings from run1/config.toml; changed: train.steps 2 -> 3" in err
    saved = load_config("run2/config.toml")
    assert saved.train.lr == 1e-3 and saved.model.overrides["n_layer"] == 1
