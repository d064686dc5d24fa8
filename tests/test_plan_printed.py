"""Printed commands run as printed: 21 plans over the bundled configs and pretrained folders (dense
and MoE, text and chat data, the cpu target, pinned degrees), and every ``shardwise train`` command
they print passes ``train --dry-run`` in this process. What ``train`` would refuse (a sequence
above the model's positions, a pinned degree the family cannot use) ``plan`` refuses by name.

Cost: the folders are 2-layer models; each dry run builds its model on the meta device and
tokenises a 40-record file (about 1-2 s each)."""

import shlex
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from shardwise.cli import main  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.plan import cli as plan_cli  # noqa: E402
from tests.helpers.sft import (  # noqa: E402
    VOCAB,
    chat_records,
    instruct_records,
    save_gpt2,
    save_qwen2,
    save_tokenizer,
    write_jsonl,
)
from tests.helpers.text import corpus_text  # noqa: E402
from tests.test_plan_grid import plan_args  # noqa: E402


def _save_moe(folder: Path, family: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=24, max_position_embeddings=256, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("plans")
    qwen = save_qwen2(root / "my-qwen")
    moe = _save_moe(root / "my-moe", "qwen3_moe")
    gpt2 = save_gpt2(root / "my-gpt2")
    chat = write_jsonl(root / "chat.jsonl", chat_records(40))
    instruct = write_jsonl(root / "pairs.jsonl", instruct_records(40))
    text = root / "notes.txt"
    text.write_text(corpus_text(20000), encoding="utf-8")
    return {"qwen": str(qwen), "moe": str(moe), "gpt2": str(gpt2), "chat": str(chat), "instruct": str(instruct),
            "text": str(text)}


PLANS = [
    # bundled configs, the cpu target and GPUs
    ("--hf-config", "llama-tiny", "--gpu", "cpu"),
    ("--hf-config", "llama-tiny", "--gpu", "cpu", "--tp", "2"),
    ("--hf-config", "llama-tiny", "--gpu", "cpu", "--cp", "2", "--seq", "512"),  # positions raised: from scratch
    ("--hf-config", "llama-tiny", "--gpu", "cpu", "--pp", "2"),
    ("--hf-config", "gpt2-tiny", "--gpu", "cpu"),
    ("--hf-config", "mixtral-tiny", "--gpu", "cpu"),
    ("--hf-config", "mixtral-tiny", "--gpu", "cpu", "--ep", "2"),
    ("--hf-config", "qwen3-moe-tiny", "--gpu", "cpu", "--ep", "2"),
    ("--hf-config", "qwen3-moe-tiny", "--gpu", "h100", "--gpus-per-node", "4"),
    ("--hf-config", "llama-tiny", "--gpu", "a100", "--gpus-per-node", "2", "--nodes", "2"),
    ("--model", "gpt-tiny", "--gpu", "cpu"),
    ("--model", "gpt-moe-nano", "--gpu", "cpu", "--ep", "2"),
    # pretrained folders: the data decides the recipe
    ("--pretrained", "{qwen}", "--gpu", "cpu", "--data", "{chat}"),
    ("--pretrained", "{qwen}", "--gpu", "cpu", "--data", "{instruct}"),
    ("--pretrained", "{qwen}", "--gpu", "cpu", "--data", "{text}", "--seq", "128"),
    ("--pretrained", "{qwen}", "--gpu", "cpu"),  # $DATA: the run's text
    ("--pretrained", "{qwen}", "--gpu", "cpu", "--data", "{chat}", "--tp", "2"),
    ("--pretrained", "{moe}", "--gpu", "cpu", "--data", "{chat}", "--ep", "2"),
    ("--pretrained", "{moe}", "--gpu", "cpu", "--data", "{chat}", "--pp", "2"),
    ("--pretrained", "{moe}", "--gpu", "h100", "--gpus-per-node", "2", "--data", "{chat}"),
    ("--pretrained", "{moe}", "--gpu", "cpu", "--data", "{text}", "--cp", "2"),  # long context, MoE, text
    ("--pretrained", "{moe}", "--gpu", "cpu", "--data", "{chat}", "--cp", "2", "--ep", "2"),  # ... and chat
]


def test_twenty_plans_print_commands_that_pass_train_dry_run(world, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # the data cache (a dry run only reads it)
    assert len(PLANS) >= 20
    for plan_argv in PLANS:
        argv = [a.format(**world) for a in plan_argv]
        plan = plan_cli.build_plan(plan_args(*argv))
        assert plan.commands, (argv, plan.warnings)
        train = plan.commands[0].replace("$DATA", shlex.quote(world["text"])).replace("$MASTER_ADDR", "127.0.0.1")
        words = shlex.split(train)
        assert words[:2] == ["shardwise", "train"], train
        if "--data" in argv:
            kind = Path(argv[argv.index("--data") + 1]).stem
            assert words[2] == ("hf-finetune" if kind == "notes" else "hf-sft"), train
            assert ("data.kind=instruct" in words) == (kind == "pairs"), train
        code = main([*words[1:], "--dry-run"])
        out, err = capsys.readouterr()
        assert code == 0, f"{argv}\n{train}\n{err[-2000:]}"
        assert "every check passed" in out
        if "--gpu" in argv and argv[argv.index("--gpu") + 1] == "cpu":
            assert "--nproc 2" in train or "--nproc" not in train


@pytest.mark.parametrize(("argv", "refusal"), [
    (("--pretrained", "{qwen}", "--seq", "8192"), r"--seq 8192 exceeds the model's max_position_embeddings=256"),
    (("--hf-config", "gpt2-tiny", "--cp", "2"), r"--cp 2: context parallel does not run on the gpt2 family"),
    (("--hf-config", "llama-tiny", "--ep", "2"), r"no mixture-of-experts layers"),
    (("--hf-config", "llama-tiny", "--data", "x.jsonl"), r"--data .* --pretrained DIR"),
    (("--pretrained", "{moe}", "--data", "{chat}", "--cp", "2", "--pp", "2"),
     r"--cp 2 with --pp 2: .* mixture-of-experts model on chat"),
])
def test_what_train_refuses_plan_refuses_by_name(world, argv, refusal):
    with pytest.raises(ConfigError, match=refusal):
        plan_cli.build_plan(plan_args(*[a.format(**world) for a in argv]))


def test_chat_records_given_to_hf_finetune_point_to_hf_sft(world, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    code = main(["train", "hf-finetune", "--set", f"model.pretrained={world['qwen']!r}".replace("'", '"'),
                 "--set", f"data.path=\"{world['chat']}\"", "--nproc", "1", "--dry-run",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "no 'text' field" in err and "hf-sft recipe" in err, err


def test_small_models_print_their_size_in_a_unit_that_shows_it():
    assert plan_cli._param_count(190_312) == "190.3K"
    assert plan_cli._param_count(124_439_808) == "124.4M"
    assert plan_cli._param_count(7_000_000_000) == "7.000B"


def test_cp_on_a_family_without_it_is_refused_by_name_before_the_data_is_read(world, tmp_path, capsys):
    code = main(["train", "hf-sft", "--set", f'model.pretrained="{world["gpt2"]}"', "--set",
                 f'data.path="{tmp_path / "not-written-yet.jsonl"}"', "--set", "parallel.cp=2", "--nproc", "2",
                 "--dry-run", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "gpt2 is not one of them. Set parallel.cp = 1" in err, err
    assert "unpacked text" not in err and "not-written-yet" not in err  # no dead end; the data was not read
