"""LoRA (peft) on a pretrained model: parity with plain PEFT under ddp, fsdp and tensor parallel,
a frozen base, adapter-only optimizer and checkpoints, and exports that PEFT and transformers load.
A PEFT adapter folder as the pretrained model loads merged under fsdp+tp and pipeline stages."""

import json
import shutil
import sys

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from shardwise.core.config import LoraConfig, load_config  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.models.hf import build_hf_model  # noqa: E402
from shardwise.models.pretrained import hf_name  # noqa: E402
from shardwise.runtime.checkpoint.locate import complete_checkpoints  # noqa: E402
from shardwise.runtime.checkpoint.manifest import read_manifest  # noqa: E402
from shardwise.testing import run_command, run_distributed  # noqa: E402
from tests.helpers.adapter import peft_model, save_lora_adapter  # noqa: E402
from tests.helpers.hf import hf_case, hf_cases, reference_losses, reference_model, save_tiny  # noqa: E402

# q/v are column-parallel under TP, o/down row-parallel: both adapter layouts are exercised.
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "o_proj", "down_proj"]}
RUN = {"steps": 5, "global_batch": 4, "seq": 16, "lr": 1e-2}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("lora") / "llama", "llama", shard_kb=60, seed=5)


@pytest.fixture(scope="module")
def adapter(folder, tmp_path_factory):
    """A PEFT LoRA adapter folder on ``folder`` (peft's save_pretrained), as model.pretrained."""
    return save_lora_adapter(folder, tmp_path_factory.mktemp("lora") / "adapter", LORA["targets"] + ["gate_proj"],
                             seed=3)


# Fresh adapters on a model loaded from an adapter folder: the merge under strided FSDP + TP shards
# and under pipeline stages (each loads its own layers).
FROM_ADAPTER = {"fsdp+tp": {"tp": 2}, "pp": {"pp": 2}}


@pytest.fixture(scope="module")
def runs(folder, adapter, tmp_path_factory):
    """One spawn of 2 ranks: LoRA under ddp, fsdp, tp and fsdp+tp (fsdp saves a checkpoint), then
    a fresh fsdp+tp LoRA model that resumes from fsdp's checkpoint, then one step of LoRA on the
    adapter folder under ``FROM_ADAPTER``."""
    ckpt = tmp_path_factory.mktemp("lora-ckpt") / "checkpoints"
    strategies = {"ddp": {}, "fsdp": {"ckpt_dir": str(ckpt)}, "tp": {"tp": 2}, "fsdp+tp": {"tp": 2}}
    cases = [{"folder": str(folder), "strategy": s, "lora": LORA, **RUN, **extra} for s, extra in strategies.items()]
    cases.append({"resume": True, "folder": str(folder), "strategy": "fsdp+tp", "tp": 2, "ckpt_dir": str(ckpt),
                  "lora": LORA})
    cases += [{"folder": str(adapter), "strategy": s, "lora": LORA, **RUN, "steps": 1, **extra}
              for s, extra in FROM_ADAPTER.items()]
    results = run_distributed(hf_cases, 2, timeout_s=600, cases=cases)
    n = len(strategies)
    return {"results": dict(zip(strategies, zip(*results))), "ckpt": ckpt, "resumed": results[0][n],
            "from_adapter": dict(zip(FROM_ADAPTER, zip(*(r[n + 1:] for r in results))))}


def _peft_name(name: str) -> str:
    return "base_model.model." + name[len("hf."):]


def test_lora_matches_single_process_peft_and_keeps_the_base_frozen(folder, runs):
    ref = reference_losses(folder, lora=LoraConfig(**LORA), seed=0, **{k: v for k, v in RUN.items()})
    base = reference_model(folder).state_dict()
    for strategy, (r0, r1) in runs["results"].items():
        assert r0["losses"] == pytest.approx(ref["losses"], abs=1e-5), strategy
        adapters = [n for n in r0["params"] if ".lora_" in n]
        assert len(adapters) == 2 * 2 * len(LORA["targets"])  # A and B, 2 layers
        # peft starts every B at zero: a B that moved is an adapter that trained.
        assert all(r0["params"][n].abs().max() > 0 for n in adapters if ".lora_B." in n), strategy
        # Adam divides by sqrt(v): an element with a near-zero gradient turns a reduction-order
        # rounding difference into a 1e-5-sized step, so the weights get 1e-4 (the losses 1e-5).
        for name in adapters:
            torch.testing.assert_close(r0["params"][name], ref["state"][_peft_name(name)], atol=1e-4, rtol=0)
        # Only the adapters are trained: in the optimizer, and the base after 5 steps is bit-identical
        # to the folder's weights.
        assert r0["in_optimizer"] == sorted(adapters), strategy
        assert r0["trainable_only"]
        for name, value in r0["params"].items():
            if ".lora_" not in name:
                assert torch.equal(value, base[hf_name(name[len("hf."):])]), (strategy, name)
        assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])


def test_an_adapter_folder_loads_merged_under_sharding_and_pipeline_stages(folder, adapter, runs):
    merged = peft_model(folder, adapter, merged=True).state_dict()
    for strategy, (r0, r1) in runs["from_adapter"].items():
        assert not isinstance(r0, str), r0
        params = {**r0["params"], **r1["params"]}  # the pipeline's stages together: the whole model
        frozen = {hf_name(n[len("hf."):]): v for n, v in params.items() if ".lora_" not in n}
        assert frozen.keys() == merged.keys(), strategy
        for name, value in frozen.items():
            torch.testing.assert_close(value, merged[name], atol=1e-6, rtol=0, msg=f"{strategy} {name}")


def test_planner_predicts_the_lora_runs_bytes(folder, runs):
    """The planner counts no gradient or optimizer state for the frozen base, under every layout
    (tensor parallel included): its prediction equals the ledger's measurement per rank."""
    from shardwise.core.config import ParallelConfig
    from shardwise.core.layout import resolve_layout
    from shardwise.plan.predict import predict_run
    from shardwise.plan.spec import from_module

    with torch.device("meta"):
        spec = from_module(build_hf_model(pretrained=str(folder), lora=LoraConfig(**LORA)), name="lora")
    for strategy, measured in runs["results"].items():
        tp = 2 if "tp" in strategy else 1
        layout = resolve_layout(ParallelConfig(strategy=strategy, tp=tp), 2, n_blocks=2)
        predicted = predict_run(spec, layout, precision="fp32", seq=RUN["seq"], micro_batch_size=2).ranks
        for rank, (want, got) in enumerate(zip(predicted, measured)):
            assert (want.grad_bytes, want.optim_bytes) == (got["grad_bytes"], got["optim_bytes"]), (strategy, rank)
            # The vocabulary (65) splits 33 + 32 under tp: the planner gives every rank the larger part.
            over = want.param_bytes - got["param_bytes"]
            assert over == 0 if rank == 0 or tp == 1 else 0 <= over <= 512, (strategy, rank, over)
        assert predicted[0].grad_bytes < predicted[0].param_bytes / 5  # adapters only


def test_gpt2_lora_conv1d_matches_peft(tmp_path):
    gpt2 = save_tiny(tmp_path / "gpt2", "gpt2", seed=6)
    lora = {"rank": 2, "alpha": 4.0}  # peft's default target for gpt2: c_attn (a Conv1D)
    ours = hf_case(0, 1, str(gpt2), "single", lora=lora, **{**RUN, "steps": 3})
    ref = reference_losses(gpt2, lora=LoraConfig(**lora), seed=0, **{**RUN, "steps": 3})
    assert ours["losses"] == pytest.approx(ref["losses"], abs=1e-5)


def test_checkpoints_hold_only_the_adapters_and_resume_elsewhere(folder, runs):
    step_dir = complete_checkpoints(runs["ckpt"])[-1]
    manifest = read_manifest(step_dir)
    assert manifest["frozen_excluded"] is True
    assert manifest["model_tensors"] and all(".lora_" in n for n in manifest["model_tensors"])
    assert manifest["export"]["lora"]["r"] == 4 and manifest["export"]["pretrained"] == str(folder.resolve())
    # Saved by fsdp on 2 ranks, resumed by fsdp+tp: the adapters come back, the base from the folder.
    resumed = runs["resumed"]
    trained = runs["results"]["fsdp"][0]["params"]
    assert resumed["step"] == RUN["steps"]
    for name, value in trained.items():
        assert torch.equal(resumed["params"][name], value), name
    # A model without adapters cannot take this checkpoint: one clear error.
    from shardwise.errors import CheckpointError

    plain = build_hf_model(pretrained=str(folder))
    from shardwise.runtime.session import Session

    session = Session(strategy="single", seed=0)
    model, opt = session.prepare(plain, torch.optim.AdamW(plain.parameters()))
    with pytest.raises(CheckpointError, match="holds only the LoRA adapters .* trains every weight"):
        session.load(runs["ckpt"], model, opt)
    session.close()


def _trained_model(folder, params):
    model = build_hf_model(pretrained=str(folder), lora=LoraConfig(**LORA))
    missing = model.load_state_dict(params, strict=False)
    assert not missing.unexpected_keys
    return model.eval()


def test_adapter_and_merged_exports_load_with_peft_and_transformers(folder, runs, tmp_path, cli_env, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ours = _trained_model(folder, runs["results"]["fsdp"][0]["params"])
    x = torch.randint(0, 65, (2, 12))
    with torch.no_grad():
        want = ours(x)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    # --base: the pretrained folder somewhere else than where the run read it (moved, copied).
    moved = shutil.copytree(folder, tmp_path / "moved-base")
    for args in (["--format", "peft", "--out", str(adapter)],
                 ["--format", "hf", "--merge", "--base", str(moved), "--out", str(merged)]):
        proc = run_command([sys.executable, "-m", "shardwise", "ckpt", "export", str(runs["ckpt"]), *args],
                           timeout=300, env=cli_env)
        assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(LORA["targets"])
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(reference_model(folder), str(adapter)).eval()
        assert torch.equal(peft_model(input_ids=x).logits, want)
        # Merging changes the arithmetic (W + BA in one matrix): equal up to float rounding.
        full = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
        torch.testing.assert_close(full(x).logits, want, atol=1e-5, rtol=0)
    # Without --merge a LoRA checkpoint has no full weights to write: one clear error (the CLI's
    # entry point in this process).
    from shardwise.cli import main

    capsys.readouterr()
    assert main(["ckpt", "export", str(runs["ckpt"]), "--format", "hf", "--out", str(tmp_path / "no")]) == 2
    assert "--format peft, or merged full weights with --format hf --merge" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_lora_config_errors(folder):
    with pytest.raises(ConfigError, match="lora.rank > 0 trains adapters on a frozen pretrained model"):
        load_config("hf-llama-tiny", ["lora.rank=4"])
    with pytest.raises(ConfigError, match="LoRA adapters do not run with parallel.sequence_parallel"):
        load_config("hf-finetune", [f'model.pretrained="{folder}"', "lora.rank=4", "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match=r"lora.dropout must be >= 0 and < 1, got 1.5"):
        load_config("hf-finetune", [f'model.pretrained="{folder}"', "lora.rank=4", "lora.dropout=1.5"])
    with pytest.raises(ConfigError, match=r"lora.targets \['qproj'\] name no module .* Linear layers it has: "
                                          r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        build_hf_model(pretrained=str(folder), lora=LoraConfig(rank=2, targets=["qproj"]))
