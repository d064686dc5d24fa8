"""Pretrained Hugging Face folders: loading under every strategy, and every bad folder refused up front."""

import json
import struct

import pytest
import torch

pytest.importorskip("transformers")

from shardwise.core.config import ModelConfig, load_config  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.models.pretrained import inspect_pretrained  # noqa: E402
from shardwise.preflight import check_run  # noqa: E402
from shardwise.testing import fixed_batches, lm_loss, run_command, run_distributed  # noqa: E402
from tests.helpers.hf import VOCAB, hf_case, hf_cases, reference_model, save_tiny  # noqa: E402

STEPS_SEQ = {"global_batch": 4, "seq": 16}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny Llama and GPT-2 folders: one file each, and sharded into several files with an index."""
    root = tmp_path_factory.mktemp("pretrained")
    return {
        "llama": save_tiny(root / "llama", "llama", seed=1),
        "llama-sharded": save_tiny(root / "llama-sharded", "llama", shard_kb=40, seed=2),
        "gpt2": save_tiny(root / "gpt2", "gpt2", seed=3),
        "gpt2-sharded": save_tiny(root / "gpt2-sharded", "gpt2", shard_kb=40, seed=4),
    }


def _first_loss(folder) -> float:
    """The plain transformers model's loss on the first fixed batch (what step 1 of a run sees)."""
    x = fixed_batches(1, STEPS_SEQ["global_batch"], STEPS_SEQ["seq"], VOCAB)[0]
    with torch.no_grad():
        return float(lm_loss(reference_model(folder)(input_ids=x[:, :-1]).logits, x[:, 1:]))


def test_sharded_folders_have_an_index(folders):
    info = inspect_pretrained(folders["llama-sharded"])
    assert info.index and len(info.files) > 3
    assert not inspect_pretrained(folders["llama"]).index


def test_single_process_first_loss_equals_transformers(folders):
    for name in ("llama", "gpt2-sharded"):
        for init in ("meta", "eager"):
            result = hf_case(0, 1, str(folders[name]), "single", init=init, **STEPS_SEQ)
            assert result["losses"][0] == pytest.approx(_first_loss(folders[name]), abs=1e-5), (name, init)
            assert result["notes"] == []  # built on meta as asked, no eager fallback


@pytest.mark.slow
def test_every_strategy_loads_and_matches_transformers(folders):
    # One spawn of 2 ranks for all cases. GPT-2 under tp reads its fused c_attn from sharded files
    # into the split q/k/v (models/gpt2_qkv.py).
    cases, expect = [], []
    for name, strategies in (("llama-sharded", ("ddp", "fsdp", "tp", "fsdp+tp", "zero2", "hsdp")),
                             ("llama", ("fsdp",)), ("gpt2-sharded", ("ddp", "fsdp", "tp")), ("gpt2", ("zero1",))):
        for strategy in strategies:
            options = {"tp": 2} if "tp" in strategy else {}
            cases.append({"folder": str(folders[name]), "strategy": strategy, **STEPS_SEQ, **options})
            expect.append(name)
    cases.append({"folder": str(folders["llama-sharded"]), "strategy": "fsdp", "init": "eager", **STEPS_SEQ})
    expect.append("llama-sharded")
    results = run_distributed(hf_cases, 2, timeout_s=600, cases=cases)
    for case, name, r0, r1 in zip(cases, expect, *results):
        assert not isinstance(r0, str), r0
        want = _first_loss(folders[name])
        assert r0["losses"][0] == pytest.approx(want, abs=1e-5), case
        assert r1["losses"][0] == r0["losses"][0]
        # Whatever the sharding, the gathered weights after one step agree across ranks.
        assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])


def test_meta_loading_keeps_param_bytes_of_eager_loading(folders):
    eager = hf_case(0, 1, str(folders["llama"]), "single", init="eager", steps=0)
    meta = hf_case(0, 1, str(folders["llama"]), "single", init="meta", steps=0)
    assert eager["param_bytes"] == meta["param_bytes"] > 0
    assert all(torch.equal(eager["params"][k], meta["params"][k]) for k in eager["params"])


# ----------------------------------------------------------------------------------------- bad folders


def _cfg(folder, **extra):
    overrides = [f'model.pretrained="{folder}"', 'model.hf_config=""', "model.overrides.block_size=16",
                 "parallel.strategy=fsdp"] + [f"{k}={v}" for k, v in extra.items()]
    return load_config("hf-shakespeare", overrides)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_folders_are_refused_with_one_clear_paragraph(folders, tmp_path):
    sharded = folders["llama-sharded"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((sharded / "config.json").read_text())
    pickles = _copy(no_weights, tmp_path / "pickles")
    (pickles / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    missing = _copy(sharded, tmp_path / "missing")
    (missing / files[2]).unlink()
    truncated = _copy(sharded, tmp_path / "truncated")
    data = (truncated / files[1]).read_bytes()
    (truncated / files[1]).write_bytes(data[: len(data) - 100])
    absent_key = _copy(sharded, tmp_path / "absent-key")
    bad_index = dict(index, weight_map={**index["weight_map"], "model.norm.weight": files[0]})
    (absent_key / "model.safetensors.index.json").write_text(json.dumps(bad_index))
    dtype = _copy(folders["llama"], tmp_path / "dtype")
    cfg = json.loads((dtype / "config.json").read_text())
    (dtype / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    arch = _copy(folders["llama"], tmp_path / "arch")
    (arch / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    header_junk = _copy(folders["llama"], tmp_path / "junk")
    (header_junk / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\0" * 64)
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")

    cases = {
        no_weights: "has no weights: neither model.safetensors nor model.safetensors.index.json",
        pickles: "only PyTorch pickle weights (pytorch_model.bin)",
        missing: f"names 1 weight file(s) that are not in the folder: {files[2]}",
        truncated: f"{files[1]} is truncated",
        absent_key: "says 'model.norm.weight' is in",
        dtype: "config.json says the weights are bfloat16, but 21 tensor(s) are not",
        arch: "model_type 'bert' is not supported",
        header_junk: "damaged safetensors header",
        not_a_dir: "must be a folder",
    }
    for folder, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_run(_cfg(folder), 2)
    # Weights whose shapes do not match the config the run builds (an override changes the vocabulary).
    with pytest.raises(ConfigError, match=r"do not have the shape.*model.embed_tokens.weight is \[65, 64\]"):
        check_run(_cfg(folders["llama"], **{"model.overrides.vocab_size": 80}), 2)
    # Quantised weights: not floating point.
    from safetensors.torch import save_file

    quant = _copy(folders["llama"], tmp_path / "quant")
    save_file({"model.embed_tokens.weight": torch.zeros(65, 64, dtype=torch.int8)}, str(quant / "model.safetensors"))
    with pytest.raises(ConfigError, match="non-floating-point.*quantised weights are not supported"):
        inspect_pretrained(quant)


def test_pretrained_config_errors():
    with pytest.raises(ConfigError, match="model.pretrained .* needs model.kind = 'hf'"):
        load_config(None, ['model.pretrained="x"'])
    with pytest.raises(ConfigError, match="model.init mode 'lazy'"):
        load_config(None, ["model.init=lazy"])
    from shardwise.core.config import DataConfig
    from shardwise.workloads import build_workload

    with pytest.raises(ConfigError, match="needs model.hf_config .* or model.pretrained"):
        build_workload(ModelConfig(kind="hf"), DataConfig())


def test_cli_refuses_a_bad_folder_before_any_rank_and_writes_nothing(folders, tmp_path, cli_env):
    import sys

    missing = _copy(folders["llama-sharded"], tmp_path / "missing")
    index = json.loads((missing / "model.safetensors.index.json").read_text())
    (missing / sorted(set(index["weight_map"].values()))[0]).unlink()
    out = tmp_path / "run"
    proc = run_command([sys.executable, "-m", "shardwise", "train", "hf-shakespeare", "--nproc", "2", "--strategy",
                        "fsdp", "--out", str(out), "--set", f'model.pretrained="{missing}"',
                        "--set", 'model.hf_config=""', "--set", "model.overrides.block_size=16"],
                       timeout=300, env=cli_env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and "not in the folder" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not out.exists()  # refused before the run directory was made
