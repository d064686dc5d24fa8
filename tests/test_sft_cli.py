"""The README's instruction-tuning commands as a user runs them (a local Qwen2 folder with a chat
template, their own chat.jsonl), and a bad record refused before any rank starts."""

import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from shardwise.data.records import SAMPLE_CHAT  # noqa: E402
from shardwise.testing import run_command  # noqa: E402
from tests.helpers.sft import chat_records, save_qwen2, write_jsonl  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
# Keeps the README's run short in CI: the commands as printed, then these overrides.
QUICK = ["--set", "train.steps=4", "--set", "train.eval_every=0", "--set", "checkpoint.every=0",
         "--set", "train.progress=false"]


def _readme_commands() -> list[list[str]]:
    section = README.read_text(encoding="utf-8").split("## Instruction tuning", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    return [shlex.split(line) for line in lines if line.strip().startswith("shardwise ")]


def test_the_readme_commands_train_and_export(tmp_path, cli_env):
    save_qwen2(tmp_path / "models" / "my-qwen")
    # A fresh clone's layout for the one file the command reads: the package's chat sample.
    sample = tmp_path / "src" / "shardwise" / "data" / "samples" / "chat.jsonl"
    sample.parent.mkdir(parents=True)
    shutil.copy(SAMPLE_CHAT, sample)
    train, export = _readme_commands()
    assert "data.path=src/shardwise/data/samples/chat.jsonl" in train
    assert train[:3] == ["shardwise", "train", "hf-sft"] and export[:3] == ["shardwise", "ckpt", "export"]
    env = {**cli_env, "HOME": str(tmp_path)}  # the data cache goes under ~/.cache/shardwise
    proc = run_command([sys.executable, "-m", "shardwise", *train[1:], *QUICK], timeout=420, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packed" in proc.stderr + proc.stdout
    proc = run_command([sys.executable, "-m", "shardwise", *export[1:]], timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "my-qwen-sft"))
    assert AutoTokenizer.from_pretrained(str(tmp_path / "my-qwen-sft")).chat_template

    # LoRA after instruction tuning (the same command, adapters on the frozen base, one process):
    # the PEFT export loads with peft, and its adapters trained.
    peft = pytest.importorskip("peft")
    proc = run_command([sys.executable, "-m", "shardwise", *train[1:], *QUICK, "--set", "lora.rank=4",
                        "--strategy", "single", "--nproc", "1", "--out", "runs/sft-lora"],
                       timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_command([sys.executable, "-m", "shardwise", "ckpt", "export", "runs/sft-lora", "--format", "peft",
                        "--out", "my-qwen-lora"], timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lora = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "models" / "my-qwen")),
                                          str(tmp_path / "my-qwen-lora"))
    b = [p for n, p in lora.named_parameters() if "lora_B" in n]
    assert b and any(p.abs().max() > 0 for p in b)  # peft starts B at zero: these were trained


def test_a_bad_record_is_refused_before_any_rank_starts(tmp_path, cli_env):
    save_qwen2(tmp_path / "my-qwen")
    data = tmp_path / "chat.jsonl"
    write_jsonl(data, chat_records(30))
    with open(data, "a", encoding="utf-8") as f:
        f.write('{"messages": [{"role": "user", "content": "hi"}, {"role": "model", "content": "ho"}]}\n')
    proc = run_command([sys.executable, "-m", "shardwise", "train", "hf-sft",
                        "--set", f'model.pretrained="{tmp_path / "my-qwen"}"', "--set", f'data.path="{data}"',
                        "--set", f'data.cache_dir="{tmp_path / "c"}"',
                        "--strategy", "ddp", "--nproc", "2", "--out", str(tmp_path / "run")],
                       timeout=120, env=cli_env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "chat.jsonl' line 31: turn 1 has role 'model'; allowed roles: system, user, assistant, tool" in proc.stderr
    assert "Traceback" not in proc.stderr and "rank 0" not in proc.stderr

