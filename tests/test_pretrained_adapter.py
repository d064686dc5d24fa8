"""A PEFT LoRA adapter folder as model.pretrained: shardwise builds its base with the adapter merged
in (the logits PEFT gives, GPT-2's transposed Conv1D weights and rsLoRA's scale included), finds a
base named relative to the adapter, and refuses what it cannot merge with one message that says
what to do. The user's flow end to end: a LoRA SFT run, its adapter exported by shardwise, then an
hf-dpo run from that folder with fresh adapters on the merged weights, whose export is refused as
a PEFT folder and written whole with --format hf --merge."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from shardwise.core.config import load_config  # noqa: E402
from shardwise.errors import CheckpointError, ConfigError  # noqa: E402
from shardwise.models.hf import build_hf_model  # noqa: E402
from shardwise.models.pretrained import inspect_pretrained  # noqa: E402
from tests.helpers.adapter import edit_adapter_config, peft_model, save_lora_adapter  # noqa: E402
from tests.helpers.preference import dpo_overrides, preference_records  # noqa: E402
from tests.helpers.sft import VOCAB, chat_records, save_qwen2, write_jsonl  # noqa: E402

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_qwen2(tmp_path_factory.mktemp("adapter") / "qwen")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("adapter") / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)).save_pretrained(
        str(folder))
    return folder


@pytest.fixture(scope="module")
def adapter(qwen, tmp_path_factory):
    return save_lora_adapter(qwen, tmp_path_factory.mktemp("adapter") / "lora", TARGETS)


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("case", ["qwen2", "qwen2-rslora", "gpt2-conv1d"])
def test_the_built_model_is_the_base_with_the_adapter_merged(case, qwen, gpt2, adapter, tmp_path):
    base = gpt2 if case.startswith("gpt2") else qwen
    if case == "qwen2":
        folder = adapter
    elif case == "qwen2-rslora":  # scale alpha / sqrt(r) instead of alpha / r
        folder = save_lora_adapter(qwen, tmp_path / "lora", ["o_proj", "up_proj"], seed=1, use_rslora=True)
    else:  # GPT-2's Conv1D keeps (in, out) weights: the update is transposed (peft's fan_in_fan_out)
        folder = save_lora_adapter(gpt2, tmp_path / "lora", ["c_attn", "c_proj"], seed=2, fan_in_fan_out=True)
    ours = build_hf_model(pretrained=str(folder)).eval()
    assert ours.pretrained.path == base.resolve() and ours.pretrained.source == folder
    x = torch.randint(0, VOCAB, (2, 16))
    want = _logits(peft_model(base, folder), x)
    torch.testing.assert_close(_logits(ours, x), want, atol=1e-5, rtol=1e-5)
    # The adapter matters: the base alone is far from it.
    assert (_logits(build_hf_model(pretrained=str(base)).eval(), x) - want).abs().max() > 1e-2


def test_a_relative_base_is_taken_from_the_adapter_folder(qwen, adapter, tmp_path):
    moved = shutil.copytree(adapter, tmp_path / "models" / "sft-lora")
    shutil.copytree(qwen, tmp_path / "models" / "base")
    edit_adapter_config(moved, base_model_name_or_path="../base")
    folder = inspect_pretrained(moved)
    assert folder.path == (tmp_path / "models" / "base").resolve()
    assert sorted(folder.adapter.targets)[:2] == ["model.layers.0.mlp.down_proj.weight",
                                                  "model.layers.0.self_attn.q_proj.weight"]
    assert len(folder.adapter.targets) == 2 * len(TARGETS) and folder.adapter.scale == 2.0


@pytest.mark.parametrize("change, problem", [
    ({"base_model_name_or_path": "/no/such/base"}, r"'/no/such/base' does not exist: the base model must be a local"),
    ({"base_model_name_or_path": "Qwen/Qwen2-0.5B"}, "Hub id it would need a download, and shardwise never downloads"),
    ({"base_model_name_or_path": None}, "names no base model"),
    ({"use_dora": True}, "sets use_dora = true, which shardwise's merge does not support"),
    ({"modules_to_save": ["lm_head"]}, "sets modules_to_save"),
    ({"alpha_pattern": {"q_proj": 4}}, "sets alpha_pattern"),
    ({"init_lora_weights": "pissa"}, r"sets init_lora_weights = \"pissa\""),
    ({"peft_type": "IA3"}, "a PEFT adapter of type 'IA3'; shardwise merges LoRA adapters only"),
    ("gpt2", r"adapts 'model.layers.0.mlp.down_proj', but its base .* holds no model.layers.0.mlp.down_proj.weight"),
    ("magnitude", r"q_proj.lora_magnitude_vector', which is not a LoRA A/B weight .* \(no DoRA"),
    ("config.json", "holds both config.json .* ambiguous"),
])
def test_what_cannot_be_merged_is_refused_with_what_to_do(change, problem, qwen, gpt2, adapter, tmp_path):
    folder = shutil.copytree(adapter, tmp_path / "lora")
    if change == "gpt2":  # an adapter trained on another model
        edit_adapter_config(folder, base_model_name_or_path=str(gpt2))
    elif change == "magnitude":
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "adapter_model.safetensors")
        tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(64)
        save_file(tensors, folder / "adapter_model.safetensors")
    elif change == "config.json":
        shutil.copy(qwen / "config.json", folder / "config.json")
    else:
        edit_adapter_config(folder, **change)
    with pytest.raises(ConfigError, match=problem):
        inspect_pretrained(folder)


def test_an_sft_adapter_exported_by_shardwise_starts_a_dpo_run_with_fresh_adapters(qwen, tmp_path):
    from shardwise.runtime.checkpoint.hf_export import export_hf, export_peft
    from shardwise.runtime.trainer import Trainer

    quick = ["train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=0", "train.eval_every=0",
             "train.progress=false", "checkpoint.every=0", "train.steps=2", "parallel.nproc=1", "lora.rank=4"]
    chat = write_jsonl(tmp_path / "chat.jsonl", chat_records(12))
    sft = load_config("hf-sft", [f'model.pretrained="{qwen}"', f'data.path="{chat}"', "model.overrides.block_size=96",
                                 f'data.cache_dir="{tmp_path / "cache"}"', "lora.targets=['q_proj', 'down_proj']",
                                 'parallel.strategy="single"', *quick])
    Trainer(sft, tmp_path / "sft").run()
    adapter = tmp_path / "sft-adapter"
    export_peft(tmp_path / "sft" / "checkpoints", adapter)  # base_model_name_or_path: the qwen folder

    prefs = write_jsonl(tmp_path / "prefs.jsonl", preference_records(12))
    # Fresh adapters on q/v: the reference (adapters off) is the SFT model; down_proj stays frozen.
    dpo = load_config("hf-dpo", [*dpo_overrides(adapter, prefs, "single"), *quick])
    trainer = Trainer(dpo, tmp_path / "dpo")
    summary = trainer.run()
    assert summary["steps"] == 2
    # The run's weights are the SFT model: the base with the exported adapter merged, as peft merges it.
    want = dict(peft_model(qwen, adapter, merged=True).named_parameters())
    ours = {n.removeprefix("hf."): p.detach() for n, p in trainer.model.named_parameters()}
    original = build_hf_model(pretrained=str(qwen)).state_dict()
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.base_layer.weight"):
        plain = name.replace(".base_layer", "")
        torch.testing.assert_close(ours[name], want[plain], atol=1e-6, rtol=0)
        assert (want[plain] - original[f"hf.{plain}"]).abs().max() > 1e-4  # the SFT adapter trained
    with pytest.raises(CheckpointError, match="a PEFT folder of them would name a base that does not hold"):
        export_peft(tmp_path / "dpo" / "checkpoints", tmp_path / "dpo-adapter")
    merged = tmp_path / "dpo-merged"
    result = export_hf(tmp_path / "dpo" / "checkpoints", merged, merge=True)
    assert "tokenizer.json" in result["companions"]  # the base's: the adapter folder has none
    from transformers import AutoModelForCausalLM

    full = dict(AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).named_parameters())
    name = "model.layers.0.mlp.down_proj.weight"  # SFT-merged, untouched by DPO
    torch.testing.assert_close(full[name], want[name], atol=1e-6, rtol=0)
    name = "model.layers.0.self_attn.q_proj.weight"  # SFT-merged plus the DPO adapters
    assert (full[name] - want[name]).abs().max() > 1e-6


def test_a_missing_base_is_reported_before_the_data_is_read(adapter, tmp_path):
    from shardwise.workloads import build_workload

    folder = shutil.copytree(adapter, tmp_path / "lora")
    edit_adapter_config(folder, base_model_name_or_path="Qwen/Qwen2-0.5B")
    prefs = write_jsonl(tmp_path / "prefs.jsonl", preference_records(4))
    cfg = load_config("hf-dpo", [*dpo_overrides(folder, prefs, "single"), "parallel.nproc=1"])
    # The tokenizer default looks through the adapter to its base: the base's problem comes first.
    with pytest.raises(ConfigError, match="shardwise never downloads"):
        build_workload(cfg.model, cfg.data, cfg.lora, cfg.preference)


def test_an_adapter_on_per_expert_weights_is_refused_where_the_model_fuses_them(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    # Saved in the per-expert layout of released MoE checkpoints; transformers builds the experts fused.
    cfg = AutoConfig.for_model("qwen2_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=2,
                               num_experts_per_tok=1, moe_intermediate_size=24, shared_expert_intermediate_size=32)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path / "moe"))
    key = "model.layers.0.mlp.experts.0.gate_proj"
    with safe_open(str(tmp_path / "moe" / "model.safetensors"), "pt") as f:
        out, inner = f.get_slice(f"{key}.weight").get_shape()
    adapter = tmp_path / "lora"
    adapter.mkdir()
    save_file({f"base_model.model.{key}.lora_A.weight": torch.ones(4, inner),
               f"base_model.model.{key}.lora_B.weight": torch.ones(out, 4)}, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "base_model_name_or_path": "../moe"}')
    assert list(inspect_pretrained(adapter).adapter.targets) == [f"{key}.weight"]
    with pytest.raises(ConfigError, match=rf"adapts 1 weight\(s\) that the model shardwise builds does not hold as "
                                          rf"such, e.g. {key}.weight \(MoE experts are fused\)"):
        build_hf_model(pretrained=str(adapter))


def test_a_shardwise_run_directory_as_model_pretrained_names_the_export_command(tmp_path):
    """An SFT run's directory (or one of its checkpoints) given as model.pretrained: the message says
    it is a run, not a model folder, and gives the export command that makes one."""
    from shardwise.models.pretrained import inspect_pretrained

    run = tmp_path / "runs" / "sft"
    (run / "checkpoints" / "step-4").mkdir(parents=True)
    (run / "checkpoints" / "step-4" / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a shardwise run directory, not a model folder") as e:
        inspect_pretrained(run)
    assert f"shardwise ckpt export {run} --format hf --out {run / 'hf'}" in str(e.value)
    with pytest.raises(ConfigError, match=r"is a shardwise checkpoint, not a model folder"):
        inspect_pretrained(run / "checkpoints" / "step-4")
