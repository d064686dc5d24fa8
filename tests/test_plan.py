"""Unit tests of the planner's arithmetic, constructors, recommendation and CLI (no process group)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPT_PRESETS, gpt_flops_per_token, gpt_param_count
from shardwise.plan import cli as plan_cli
from shardwise.plan.advice import Cluster, Workload
from shardwise.plan.cost import all_gather_s, all_reduce_s, bubble_fraction, flops_per_token
from shardwise.plan.memory import (
    PRECISIONS,
    Layout,
    activation_bytes,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    state_bytes,
    zero1_partition,
)
from shardwise.plan.presets import gpu, model_preset
from shardwise.plan.search import make_plan
from shardwise.plan.spec import ROOT_UNIT, from_gpt_config, from_hf_config_dict, from_module, from_param_count

# Parameter counts published with each model (HF model cards / papers).
PUBLISHED_PARAMS = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "llama-3-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_counts_match_published(name):
    assert model_preset(name).n_params == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("size", sorted(GPT_PRESETS))
def test_gpt_presets_counted_exactly_with_units(size):
    spec = model_preset(f"gpt-{size}")
    cfg = GPT_PRESETS[size]
    assert spec.n_params == gpt_param_count(cfg)
    assert set(spec.unit_params()) == {ROOT_UNIT, *range(cfg.n_layer)}
    # Our FLOP convention is the one next to the model (nanoGPT / PaLM).
    assert flops_per_token(spec, cfg.block_size) == pytest.approx(gpt_flops_per_token(cfg))


def _tiny_hf(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=101, max_position_embeddings=128)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        return cfg, transformers.LlamaForCausalLM
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        return cfg, transformers.Qwen2ForCausalLM
    if kind == "mistral":
        return transformers.MistralConfig(**common), transformers.MistralForCausalLM
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=128)
    return cfg, transformers.GPT2LMHeadModel


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2"])
def test_hf_config_shapes_equal_the_real_module(kind):
    cfg, cls = _tiny_hf(kind)
    spec = from_hf_config_dict(cfg.to_dict())
    with torch.device("meta"):
        model = cls(cfg)
    real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert [(p.name, p.shape) for p in spec.params] == real
    assert spec.n_params == sum(p.numel() for p in model.parameters())


def test_module_on_meta_device_infers_blocks_and_structure():
    with torch.device("meta"):
        model = GPT(GPT_PRESETS["tiny"])
    spec = from_module(model, "x")
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.vocab) == (4, 128, 4, 65)
    assert spec.largest_unit_params() == max(spec.unit_params().values())


def test_model_factory(tmp_path, monkeypatch):
    (tmp_path / "my_factory.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(10, 20), nn.ModuleList([nn.Linear(20, 20) for _ in range(3)]))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from shardwise.plan.spec import from_factory

    spec = from_factory("my_factory:build")
    assert spec.n_params == 10 * 20 + 20 + 3 * (20 * 20 + 20)
    assert spec.n_layers == 3 and not spec.has_structure
    with pytest.raises(ConfigError, match="module:function|package.module:function"):
        from_factory("no_colon")


def test_bytes_per_param_conventions():
    spec = from_param_count(1_000_000_000)
    one = Layout("ddp", dp=1)
    per_param = {name: (state_bytes(spec, one, PRECISIONS[name], "adamw").total - 4) / spec.n_params
                 for name in ("bf16", "bf16-fp32grad", "fp32")}
    assert per_param == {"bf16": 16, "bf16-fp32grad": 18, "fp32": 16}  # (minus the 4-byte step tensor)
    fsdp = state_bytes(spec, Layout("fsdp", dp=8, shard=8), PRECISIONS["bf16"], "adamw")
    assert fsdp.total == pytest.approx(16 * spec.n_params / 8, rel=1e-6)
    zero1 = state_bytes(spec, Layout("zero1", dp=8), PRECISIONS["bf16"], "adamw")
    assert zero1.params + zero1.grads == 4 * spec.n_params  # only optimizer state and master are split


def test_zero1_partition_is_greedy_largest_first():
    assert zero1_partition([5, 3, 3, 1], 2) == [[0, 3], [1, 2]]
    assert zero1_partition([2, 2], 4) == [[0], [1], [], []]


def test_our_activation_model_reduces_to_korthikanti():
    """With dropout masks and a materialised softmax at 2 bytes, our count IS the published formula
    (apart from LayerNorm's fp32 statistics, which the paper leaves out) for a stack whose sequence
    parallel keeps each linear's input shard and gathers it again in backward (Megatron's, the
    paper's 34/t: ``Kernels.sp_regather``). torch's tensor parallel (shardwise's runtime) saves the
    all-gathered inputs of the attention and the MLP instead: the two LayerNorm outputs whole,
    2 x s*b*h*2 bytes x (1 - 1/tp) more (rehearsed on llama-3-8b tp 8: exact)."""
    spec = model_preset("gpt2")
    from dataclasses import replace

    from shardwise.plan.memory import Kernels

    # The paper's GELU is one kernel (transformers' GPT-2 "gelu_new" keeps three more tensors: act_extra).
    spec = replace(spec, dropout=0.1, act_extra=0)
    s, b, h, a = 1024, 4, spec.hidden, spec.n_heads
    stats = s * b * 16
    megatron = Kernels(sp_regather=True)
    for tp, sp in ((1, False), (2, False), (4, True)):
        ours = layer_activation_bytes(spec, s, b, 2, tp=tp, sp=sp, attention="math", kernels=megatron)
        assert ours - stats // (tp if sp else 1) == pytest.approx(
            korthikanti_layer_bytes(s, b, h, a, tp=tp, sp=sp), rel=1e-9)
        torch_tp = layer_activation_bytes(spec, s, b, 2, tp=tp, sp=sp, attention="math")
        assert torch_tp - ours == (2 * s * b * h * 2 * (tp - 1) // tp if sp else 0)
    full = activation_bytes(spec, s, b, 2, checkpoint="full", n_layers=1, first_stage=False, last_stage=False)
    assert full.saved == korthikanti_layer_bytes(s, b, h, a, recompute="full")


def test_ring_costs_and_bubble():
    assert all_reduce_s(4, 1e9, 1.0) == pytest.approx(1.5)
    assert all_gather_s(4, 1e9, 1.0) == pytest.approx(0.75)
    assert all_reduce_s(1, 1e9, 1.0) == 0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, virtual_stages=2) == pytest.approx(3 / 19)


def test_llama3_8b_on_8_h100_recommends_something_that_fits():
    plan = plan_cli.build_plan(_args("--model", "llama-3-8b", "--gpu", "h100-sxm", "--seq", "8192"))
    # fsdp without checkpointing is the fastest and tight (77 GiB of 80: the plan's rule recommends
    # the fastest usable layout, with a warning) since the transients count one moment of the
    # backward at a time (plan.memory._peak_moment; before, it was over the device).
    assert plan.recommended is not None and plan.recommended.verdict in ("fits", "tight")
    assert plan.recommended.fits or any("is recommended but tight" in w for w in plan.warnings)
    assert any(r.startswith("ddp: does not fit: needs") for r in plan.rejected)
    train, torchrun = plan.commands
    assert train.startswith("shardwise train hf-shakespeare ") and "--nproc 8" in train
    assert "--set model.hf_config=llama-3-8b --set model.overrides.block_size=8192" in train
    assert torchrun.startswith("torchrun --standalone --nproc-per-node=8 -m shardwise.job.worker hf-shakespeare")
    # make_plan without a model the runtime can build prints no command, and says why.
    bare = make_plan(model_preset("llama-3-8b"), Cluster(gpu("h100-sxm")), Workload(seq=8192))
    assert bare.commands == [] and any("no command is printed" in w for w in bare.warnings)


def test_multi_node_adds_hsdp_and_pipeline():
    plan = make_plan(model_preset("llama-3-70b"), Cluster(gpu("h100"), nodes=4),
                     Workload(seq=4096, global_batch=64, checkpoint="full"))
    names = {c.layout.strategy for c in plan.candidates}
    assert {"hsdp", "fsdp+tp"} <= names and plan.recommended is not None
    # The runtime's pipeline cuts Llama-family Hugging Face models too (parallel/pipeline/hf.py).
    assert any(c.layout.pp_enabled for c in plan.candidates)
    gpt = make_plan(model_preset("gpt-lab"), Cluster(gpu("h100"), gpus_per_node=2, nodes=2),
                    Workload(seq=256, global_batch=16))
    assert {"hsdp", "ddp+pp", "fsdp+pp", "fsdp+tp+pp"} <= {c.layout.strategy for c in gpt.candidates}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    plan_cli.register(sub)
    return parser.parse_args(["plan", *argv])


def test_cli_json_and_table(capsys):
    # How long it takes is benchmarks/plan_speed.py's figure (the same case), not an assertion here.
    assert _args("--model", "llama-3-8b", "--seq", "8192", "--json").func(
        _args("--model", "llama-3-8b", "--seq", "8192", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] and {c["strategy"] for c in out["candidates"]} >= {"ddp", "zero1", "zero2", "fsdp"}
    plan_cli.run(_args("--model", "gpt-tiny", "--gpu", "rtx-4090", "--gpus-per-node", "2", "--precision", "fp32"))
    text = capsys.readouterr().out
    command = next(line.strip() for line in text.splitlines() if line.strip().startswith("shardwise train"))
    assert "recommended: ddp" in text and command.startswith("shardwise train gpt-shakespeare --strategy ddp ")
    assert command.endswith("--nproc 2") and "--set model.preset=tiny" in command


@pytest.mark.parametrize("argv, message", [
    (("--model", "llama-3-8"), "Did you mean 'llama-3-8b'"),
    (("--model", "gpt2", "--gpu", "h10"), "Did you mean"),
    (("--model", "llama-3-8b", "--tp", "3"), "does not divide the 32 attention heads"),
    # gpt-nano's 2 layers: 4 stages with the ends holding only the embedding and the head, not 5.
    (("--model", "gpt-nano", "--gpus-per-node", "5", "--pp", "5"), "more pipeline stages than"),
    (("--model", "gpt2", "--gpus-per-node", "0"), "at least one GPU"),
    (("--model", "gpt2", "--params", "1e9"), "exactly one model source"),
    (("--model", "gpt2", "--precision", "fp8"), "unknown precision"),
])
def test_bad_input_is_a_config_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        plan_cli.run(_args(*argv))


def test_module_entry_point_exits_2_on_user_error():
    proc = subprocess.run([sys.executable, "-m", "shardwise.plan.cli", "--model", "gpt2", "--gpu", "h1000"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown GPU kind 'h1000'" in proc.stderr


def test_bare_count_warns_about_activations():
    plan = make_plan(from_param_count(7_000_000_000), Cluster(gpu("a100-80gb")), Workload(seq=4096))
    assert any("only a parameter count" in w for w in plan.warnings)


def test_gpt_preset_spec_matches_module():
    assert from_gpt_config(GPT_PRESETS["nano"]).n_params == gpt_param_count(GPT_PRESETS["nano"])


def test_zero_paper_figure_1_memory():
    """ZeRO (Rajbhandari et al. 2020) Fig. 1: 7.5B params, 64 GPUs, K=12: 120 / 31.4 / 16.6 / 1.9 GB."""
    spec = from_param_count(7_500_000_000)
    bf16 = PRECISIONS["bf16"]

    def gb(layout: Layout) -> float:
        return (state_bytes(spec, layout, bf16, "adamw").total - 4) / 1e9  # minus the step tensor

    assert gb(Layout("ddp", dp=64)) == pytest.approx(120, rel=0.01)
    assert gb(Layout("zero1", dp=64)) == pytest.approx(31.4, rel=0.01)
    # FSDP2's ZeRO-2 also keeps a sharded copy next to the unsharded params: +1.7 % vs the paper.
    assert gb(Layout("zero2", dp=64, shard=64)) + 2 * 7.5 == pytest.approx(16.6, rel=0.02)
    assert gb(Layout("fsdp", dp=64, shard=64)) == pytest.approx(1.9, rel=0.02)


def test_train_precision_spellings_plan_the_same_run(capsys):
    """A user copies ``parallel.precision`` from a run's config: ``bf16-mixed`` and ``auto`` plan what
    ``bf16`` plans (and ``auto`` on ``--gpu cpu`` what ``fp32`` does), instead of an unknown precision."""
    def planned(*argv: str) -> dict:
        plan_cli.run(_args("--model", "gpt-tiny", "--gpus-per-node", "2", "--json", *argv))
        out = json.loads(capsys.readouterr().out)
        return {"workload": out["workload"], "recommended": out["recommended"]}

    assert planned("--precision", "bf16-mixed") == planned("--precision", "bf16") == planned("--precision", "auto")
    assert planned("--precision", "fp16-mixed") == planned("--precision", "fp16")
    assert planned("--gpu", "cpu", "--precision", "auto") == planned("--gpu", "cpu")


def test_the_planner_checks_every_size_the_runtime_splits_under_tp():
    """One list (ModelSpec.tp_sizes): heads, kv heads, hidden and a dense MLP's width, as the runtime's
    TP plans split them; an MoE block's experts stay whole, so their width is not a TP size."""
    from shardwise.plan.spec import from_llama_like

    odd_mlp = from_llama_like("odd-mlp", n_layers=2, hidden=256, n_heads=8, ffn_hidden=1001, vocab=512)
    with pytest.raises(ConfigError, match="--tp 2 does not divide the 1001 MLP width of odd-mlp"):
        make_plan(odd_mlp, Cluster(gpu("h100-sxm")), Workload(seq=512), tp=2)
    assert model_preset("llama-3-8b").tp_sizes()["MLP width"] == 14336
    assert model_preset("mixtral-8x7b").tp_sizes()["MLP width"] is None
