"""Habits from Accelerate, torchrun, TRL and transformers: launch flags accepted as aliases or
answered with the shardwise spelling, other tools' config names pointed to their home here, the
recipes listed in ``train --help``, ``train RECIPE --show``; the verify report names its degrees."""

import tomllib
from pathlib import Path

import pytest

from shardwise.cli import build_parser, main
from shardwise.core.config import builtin_recipes
from shardwise.core.families import FAMILIES
from shardwise.verify import VerifyReport

ROOT = Path(__file__).resolve().parents[1]


def test_accelerate_and_torchrun_launch_flags_are_aliases(capsys):
    args = build_parser().parse_args(["train", "--num_processes", "1", "--nproc_per_node", "1",
                                      "--gradient_accumulation_steps", "4", "--mixed_precision", "bf16"])
    assert args.nproc == 1 and args.max_restarts == 0 and args.nnodes is None
    assert main(["train", "--num_processes", "2", "--mixed_precision", "bf16", "--gradient_accumulation_steps",
                 "4", "--show"]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert shown["parallel"]["precision"] == "bf16-mixed" and shown["train"]["grad_accum_steps"] == 4
    assert shown["parallel"]["nproc"] == 2


@pytest.mark.parametrize(("flag", "answer"), [
    (["--use_fsdp"], "--strategy fsdp"),
    (["--main_process_ip", "10.0.0.1"], "--rdzv-endpoint HOST:PORT"),
    (["--master_port", "29500"], "--rdzv-endpoint HOST:PORT"),
    (["--use_deepspeed"], "--strategy zero3"),
])
def test_flags_without_a_meaning_here_are_answered_with_the_shardwise_spelling(capsys, flag, answer):
    assert main(["train", *flag]) == 2
    err = capsys.readouterr().err
    assert answer in err and "unrecognized arguments" not in err


@pytest.mark.parametrize(("key", "home"), [
    ("train.learning_rate=1e-4", "learning_rate is train.lr"),
    ("data.max_seq_length=512", "max_seq_length is model.overrides.block_size"),
    ("train.per_device_train_batch_size=2", "per_device_train_batch_size is train.micro_batch_size"),
    ("train.gradient_accumulation_steps=2", "gradient_accumulation_steps is train.grad_accum_steps"),
    ("lora.lora_alpha=32", "lora_alpha is lora.alpha"),
    ("train.lrr=1", "Did you mean 'lr'?"),
])
def test_set_keys_of_other_tools_point_to_their_home(capsys, key, home):
    assert main(["train", "--set", key, "--show"]) == 2
    assert home in capsys.readouterr().err


def test_train_help_lists_every_recipe_with_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in builtin_recipes():
        assert f"\n  {name} " in out, name
    sft = out.split("\n  hf-sft ", 1)[1].split("\n  hf-", 1)[0]
    assert "steps 200" in sft and "lr 2e-05" in sft and "block" in sft and "512" in sft


def test_show_prints_the_resolved_recipe(capsys):
    assert main(["train", "hf-sft", "--show", "--set", "train.lr=1e-4"]) == 0
    captured = capsys.readouterr()
    shown = tomllib.loads(captured.out)
    assert shown["name"] == "hf-sft" and shown["train"]["lr"] == 1e-4 and shown["train"]["warmup_steps"] == 20
    assert "model.pretrained is not set" in captured.err  # what it still needs, said once


def test_the_verify_report_names_the_degrees_in_force():
    report = VerifyReport("fsdp", 2, "fp32", [1.0], [1.0], 0.0, "w", 1e-5, 0.0, 1e-5,
                          degrees={"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 2})
    assert report.table().startswith("verify: fsdp (dp_shard=2, ep=2) on 2 rank(s)")
    assert report.to_dict()["degrees"]["ep"] == 2


def test_every_family_and_recipe_is_in_the_docs():
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    missing = [f for f in FAMILIES if f"`{f}`" not in text] + [r for r in builtin_recipes() if f"`{r}`" not in text]
    assert not missing, f"not named (in backticks) in README.md or docs/: {missing}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert all(f"`{r}`" in readme for r in builtin_recipes()), "the README's recipe list"


def test_trl_max_seq_length_under_model_overrides_points_to_block_size(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", "model.overrides.max_seq_length=64", "--nproc", "1", "--dry-run"]) == 2
    assert "max_seq_length is model.overrides.block_size" in capsys.readouterr().err
