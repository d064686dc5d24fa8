import json
import re
import sys

import pytest
import torch

from shardwise.core.config import DataConfig, ModelConfig, load_config
from shardwise.errors import ConfigError
from shardwise.workloads import build_workload

pytest.importorskip("transformers")

from shardwise.models.hf import HFCausalLM, build_hf_model, bundled_configs, hf_family  # noqa: E402


def _llama_param_count(hidden, layers, heads, kv_heads, inter, vocab, tied=False):
    """Independent count: embeddings, per layer q/k/v/o + gated MLP + 2 RMSNorms, final norm, head."""
    head_dim = hidden // heads
    attn = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden + (0 if tied else vocab * hidden)


def test_llama_tiny_builds_with_hf_names_and_right_size():
    torch.manual_seed(0)
    model = build_hf_model("llama-tiny")
    assert isinstance(model, HFCausalLM)
    names = dict(model.named_modules())
    assert "hf.model.layers.0.self_attn.q_proj" in names and "hf.lm_head" in names
    assert model(torch.randint(0, 65, (2, 12))).shape == (2, 12, 65)
    n = sum(p.numel() for p in model.parameters())
    assert n == _llama_param_count(64, 2, 4, 2, 172, 65) == 99264
    assert next(model.parameters()).dtype == torch.float32


def test_init_is_deterministic_and_dropout_is_off(tmp_path):
    torch.manual_seed(1)
    a = build_hf_model("llama-tiny")
    torch.manual_seed(1)
    b = build_hf_model("llama-tiny")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    gpt2 = build_hf_model("gpt2-tiny").train()
    assert gpt2.hf.config.resid_pdrop == 0.0
    x = torch.randint(0, 65, (2, 8))
    assert torch.equal(gpt2(x), gpt2(x))  # train mode, yet no random masks


def test_overrides_apply_and_are_validated():
    model = build_hf_model("llama-tiny", num_hidden_layers=1, vocab_size=40, block_size=32)
    assert len(model.hf.model.layers) == 1 and model(torch.randint(0, 40, (1, 4))).shape == (1, 4, 40)
    with pytest.raises(ConfigError, match="'num_hiden_layers'.*Did you mean 'num_hidden_layers'"):
        build_hf_model("llama-tiny", num_hiden_layers=1)
    with pytest.raises(ConfigError, match="block_size=512 exceeds.*max_position_embeddings=256"):
        build_hf_model("llama-tiny", block_size=512)


def test_config_path_forms_and_family(tmp_path):
    assert {"llama-tiny", "gpt2-tiny"} <= set(bundled_configs())
    assert hf_family("llama-tiny") == "llama" and hf_family("gpt2-tiny.json") == "gpt2"
    for model_type in ("mistral", "qwen2", "qwen3"):  # qwen3: one family list (shardwise.core.families)
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({
            "model_type": model_type, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 30}))
        assert hf_family(str(folder)) == hf_family(str(folder / "config.json")) == model_type
        assert build_hf_model(str(folder))(torch.randint(0, 30, (1, 5))).shape == (1, 5, 30)
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match="'bert' is not supported; supported: llama, mistral, qwen2, qwen3, gpt2"):
        hf_family(str(tmp_path / "bert.json"))


def test_bad_config_paths(tmp_path):
    with pytest.raises(ConfigError, match="'llama-tny'.*Did you mean 'llama-tiny'.*Bundled:"):
        build_hf_model("llama-tny")
    with pytest.raises(ConfigError, match=f"{re.escape(str(tmp_path))}.*no config.json"):
        hf_family(str(tmp_path))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json.*as JSON"):
        hf_family(str(tmp_path / "broken.json"))


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ConfigError, match=r"pip install 'shardwise\[hf\]'"):
        build_hf_model("llama-tiny")


def test_hf_shakespeare_workload_trains():
    mc = ModelConfig(kind="hf", hf_config="llama-tiny", overrides={"block_size": 64})
    work = build_workload(mc, DataConfig(kind="shakespeare"))
    assert (work.family, work.tokens_per_sample) == ("llama", 64)
    torch.manual_seed(0)
    model = work.build_model()
    x, y = next(iter(torch.utils.data.DataLoader(work.train_set, batch_size=8)))
    assert x.shape == (8, 64) and model(x).shape == (8, 64, 65)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = work.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3


def test_recipe_loads_and_builds():
    cfg = load_config("hf-llama-tiny")
    assert (cfg.model.kind, cfg.model.hf_config, cfg.model.overrides) == ("hf", "llama-tiny", {"block_size": 128})
    assert build_workload(cfg.model, cfg.data).tokens_per_sample == 128


def test_pretrained_weights_fill_checkpoint_wrapped_layers(tmp_path):
    """A meta-built model is filled after the strategy wrapped its layers for activation checkpointing:
    the wrapper's name part is not in the files (fsdp/ddp+pp with a pretrained folder and AC)."""
    from shardwise.models.pretrained import check_model_tensors, inspect_pretrained
    from shardwise.parallel.checkpointing import apply_activation_checkpointing

    model = build_hf_model("llama-tiny", num_hidden_layers=2)
    model.hf.save_pretrained(str(tmp_path))
    apply_activation_checkpointing(model, "full")
    mapping = check_model_tensors(inspect_pretrained(tmp_path), model.hf)
    wrapped = "model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight"
    assert mapping[wrapped] == "model.layers.1.self_attn.q_proj.weight"
