"""Fine-tune plans: ``plan --pretrained DIR [--lora RANK]`` as a user runs it.

A tiny Llama saved with save_pretrained (its tokenizer next to it) and a text file: the plan's
command is a fine-tune of that folder that passes ``train --dry-run`` once ``$DATA`` is set, and
run for one step on 2 gloo ranks its memory ledger equals the plan's bytes per rank.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("tokenizers")

from shardwise.core.config import load_config  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.plan import cli as plan_cli  # noqa: E402
from shardwise.testing import run_command  # noqa: E402
from tests.helpers.hf import save_tiny  # noqa: E402
from tests.helpers.text import corpus_text, make_tokenizer  # noqa: E402
from tests.test_plan_grid import plan_args  # noqa: E402

VOCAB = 300


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("plan-finetune")
    model = save_tiny(root / "my llama", "llama", vocab=VOCAB, seed=3)  # a space in the path, as users have
    make_tokenizer(model, VOCAB)
    text = root / "notes.txt"
    text.write_text(corpus_text(20000), encoding="utf-8")
    bare = save_tiny(root / "no-tokenizer", "llama", vocab=VOCAB, seed=3)
    return {"root": root, "model": model, "text": text, "bare": bare}


def _filled(command: str, data: Path) -> list[str]:
    """The argv a shell runs for ``command`` with $DATA set (expanded inside its double quotes)."""
    assert command.count("$DATA") == 1 and '"data.path=$DATA"' in command
    return shlex.split(command.replace("$DATA", str(data)))


def test_lora_plan_prints_a_finetune_of_the_folder_that_dry_runs(folder, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(folder["root"]))  # the tokenised-data cache goes under ~/.cache
    plan = plan_cli.build_plan(plan_args("--pretrained", str(folder["model"]), "--lora", "8", "--gpu", "h100-sxm",
                                         "--gpus-per-node", "8", "--json"))
    out = plan_cli.plan_to_dict(plan)
    assert out["recommended"] and out["model"]["name"] == "my llama+lora8"
    train, torchrun = plan.commands
    assert train.startswith("shardwise train hf-finetune ")
    assert f"model.pretrained=\"{folder['model'].resolve()}\"" in shlex.split(train)
    assert "lora.rank=8" in shlex.split(train) and "$DATA" in torchrun
    assert any("$DATA" in w for w in plan.warnings)
    # The frozen base: gradients and optimizer state only for the adapters.
    best = plan.recommended
    assert 0 < best.memory.grads < best.memory.params / 5
    from shardwise.cli import main

    capsys.readouterr()
    assert main([*_filled(train, folder["text"])[1:], "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "every check passed" in printed and "hf-finetune, 8 rank(s)" in printed
    # The plan's per-rank bytes are the ones the dry run predicts.
    per_rank = out["recommended_per_rank"][0]
    assert f"{per_rank['param_bytes'] / 2**20:.2f}" in printed


def test_the_plans_bytes_per_rank_are_the_runs_ledger(folder, cli_env):
    plan = plan_cli.build_plan(plan_args("--pretrained", str(folder["model"]), "--lora", "4", "--lora-targets",
                                         "q_proj", "v_proj", "o_proj", "--gpus-per-node", "2", "--seq", "32"))
    train = plan.commands[0]
    assert 'lora.targets=["q_proj", "v_proj", "o_proj"]' in shlex.split(train)
    run_dir = folder["root"] / "run"
    words = _filled(train, folder["text"])
    env = {**cli_env, "HOME": str(folder["root"])}
    # The printed command as is, plus what makes it short: one step, no evaluation or checkpoint.
    proc = run_command([sys.executable, "-m", "shardwise", *words[1:], "--out", str(run_dir),
                        "--set", "train.steps=1", "--set", "train.eval_every=0", "--set", "train.eval_batches=1",
                        "--set", "train.progress=false", "--set", "checkpoint.every=0"], timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    measured = {r["rank"]: r for r in summary["memory"]["ranks"]}
    predicted = plan_cli.run_prediction(plan)
    assert len(measured) == len(predicted.ranks) == 2
    for r in predicted.ranks:
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            want, got = getattr(r, key), measured[r.rank][key]
            assert abs(want - got) <= 0.01 * got, (plan.recommended.name, r.rank, key, want, got)
    assert 0 < predicted.ranks[0].grad_bytes < predicted.ranks[0].param_bytes / 5


def test_a_folder_without_a_tokenizer_gets_a_placeholder_for_it(folder):
    plan = plan_cli.build_plan(plan_args("--pretrained", str(folder["bare"]), "--gpus-per-node", "2"))
    assert '"data.tokenizer=$TOKENIZER"' in plan.commands[0] and "lora.rank" not in plan.commands[0]
    assert any("holds no tokenizer" in w for w in plan.warnings)


@pytest.mark.parametrize("argv, message", [
    (("--model", "llama-3-8b", "--lora", "8"), "give the model folder with --pretrained DIR"),
    (("--pretrained", "/nonexistent/model"), "/nonexistent/model"),
])
def test_bad_finetune_input_is_a_config_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        plan_cli.build_plan(plan_args(*argv))


def test_hf_finetune_without_pretrained_refuses_instead_of_training_from_scratch():
    with pytest.raises(ConfigError, match="model.pretrained is not set") as e:
        load_config("hf-finetune", ["data.path=notes.txt", "data.tokenizer=tok", "model.hf_config=llama-3-8b"])
    assert "from scratch, use hf-shakespeare" in str(e.value)
