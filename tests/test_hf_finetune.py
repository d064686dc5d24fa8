"""The ``hf-finetune`` recipe as a user runs it: a local pretrained folder (weights + its own
tokenizer) and a local text file, fsdp on 2 ranks for 20 steps through ``shardwise train``, then
``shardwise ckpt export --format hf``; transformers' ``from_pretrained`` of the export gives
shardwise's final logits."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from shardwise.testing import run_command  # noqa: E402
from tests.helpers.hf import save_tiny  # noqa: E402
from tests.helpers.text import corpus_text, make_tokenizer  # noqa: E402

VOCAB = 300
SEQ = 32
STEPS = 20


def _shardwise(args: list[str], env: dict) -> "object":
    return run_command([sys.executable, "-m", "shardwise", *args], timeout=420, env=env)


@pytest.fixture(scope="module")
def env() -> dict:
    """conftest's ``cli_env`` for a module-scoped fixture: this checkout's src and tests importable."""
    root = Path(__file__).resolve().parents[1]
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    out["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), out.get("PYTHONPATH", "")])
    return out


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, env):
    root = tmp_path_factory.mktemp("finetune")
    model = save_tiny(root / "my-llama", "llama", vocab=VOCAB, seed=7)
    make_tokenizer(model, VOCAB)  # the model folder carries its tokenizer, as save_pretrained of both writes it
    text = root / "notes.txt"
    text.write_text(corpus_text(8000), encoding="utf-8")
    run = root / "run"
    proc = _shardwise(["train", "hf-finetune", "--strategy", "fsdp", "--nproc", "2", "--out", str(run),
                       "--set", f'model.pretrained="{model}"', "--set", f'data.path="{text}"',
                       "--set", f'data.cache_dir="{root / "cache"}"', "--set", f"train.steps={STEPS}",
                       "--set", f"model.overrides.block_size={SEQ}", "--set", "train.eval_every=0",
                       "--set", "train.eval_batches=1", "--set", "train.progress=false", "--set", "train.lr=1e-3",
                       "--set", "train.warmup_steps=2", "--set", "train.log_every=1"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = root / "export"
    proc = _shardwise(["ckpt", "export", str(run), "--format", "hf", "--max-shard-size", "100KB",
                       "--out", str(export)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"model": model, "run": run, "export": export, "root": root, "stdout": proc.stdout}


def test_fsdp_finetune_exports_a_folder_that_from_pretrained_loads_with_the_same_logits(finetuned):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.models.hf import build_hf_model
    from shardwise.runtime.session import Session

    run, export = finetuned["run"], finetuned["export"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and '"step"' in line]
    assert losses[-1] < losses[0] - 0.3, losses  # it trained

    # Hugging Face's layout: config.json, several weight files named in the index with the original
    # names (no shardwise prefix), and the folder's tokenizer copied along.
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((export / f).is_file() for f in files)
    assert "model.embed_tokens.weight" in index["weight_map"]
    assert not any(n.startswith("hf.") for n in index["weight_map"])
    assert AutoTokenizer.from_pretrained(str(export)).vocab_size == VOCAB
    assert "copied" in finetuned["stdout"] and "tokenizer.json" in finetuned["stdout"]

    # shardwise's final model: the run's checkpoint restored into the pretrained model.
    model = build_hf_model(pretrained=str(finetuned["model"]), block_size=SEQ)
    session = Session(strategy="single", seed=0)
    ours, opt = session.prepare(model, torch.optim.AdamW(model.parameters()))
    assert session.load(run, ours, opt).step == STEPS
    session.close()
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.eval()(x)
        got = AutoModelForCausalLM.from_pretrained(str(export)).eval()(x).logits
        before = AutoModelForCausalLM.from_pretrained(str(finetuned["model"])).eval()(x).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (before - want).abs().max() > 0.1  # the export holds the fine-tuned weights, not the base's


def _cli(args: list[str], capsys) -> tuple[int, str]:
    """``shardwise ARGS`` in this process (the same entry point, without a second interpreter's start-up)."""
    from shardwise.cli import main

    capsys.readouterr()
    code = main(args)
    return code, capsys.readouterr().err


def test_export_never_overwrites_and_bf16_export_loads(finetuned, capsys):
    from transformers import AutoModelForCausalLM

    taken = finetuned["root"] / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    code, err = _cli(["ckpt", "export", str(finetuned["run"]), "--format", "hf", "--out", str(taken)], capsys)
    assert code == 2 and "already exists and is not an empty folder" in err, err
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    assert not any(p.name.startswith(".taken.partial") for p in taken.parent.iterdir())

    half = finetuned["root"] / "bf16"
    code, err = _cli(["ckpt", "export", str(finetuned["run"]), "--format", "hf", "--dtype", "bfloat16",
                      "--out", str(half)], capsys)
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(str(half))
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.bfloat16
    # A full fine-tune has no adapters to export as PEFT: one clear error, nothing written.
    code, err = _cli(["ckpt", "export", str(finetuned["run"]), "--format", "peft", "--out",
                      str(finetuned["root"] / "adapter")], capsys)
    assert code == 2 and "has no LoRA adapters" in err, err
    assert not (finetuned["root"] / "adapter").exists()
    # --base must be a model folder.
    code, err = _cli(["ckpt", "export", str(finetuned["run"]), "--format", "hf", "--base", str(taken), "--out",
                      str(finetuned["root"] / "no-base")], capsys)
    assert code == 2 and "config.json" in err, err
    assert not (finetuned["root"] / "no-base").exists()
