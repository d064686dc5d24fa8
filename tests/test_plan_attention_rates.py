"""How the planner prices attention (issue 32, round i32-r8): FlashAttention-1's class at half
FlashAttention-2's published rate, unfused ("math") attention as batched matmuls at the matmul rate
plus its s x s score traffic, the fit's attention prior in the planner's own FLOP convention, and an
interleaved pipeline's last rank holding the loss stage's tensors for one micro-batch at a time
whatever the stack. Hand computations; pure arithmetic, one process.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.core.layout import Layout
from shardwise.errors import ConfigError
from shardwise.plan.cost import (
    TYPICAL_OF_PEAK,
    Calibration,
    Fabric,
    attention_flops_per_token,
    hardware_flops_per_token,
    micro_batch_compute_s,
)
from shardwise.plan.memory import Kernels, layer_activation_bytes, memory_breakdown, precision
from shardwise.plan.presets import (
    FLASH1_OF_FLASH2,
    attention_ceiling,
    ceiling,
    gpu,
    model_preset,
    training_attention_fraction,
)
from shardwise.plan.spec import from_hf_config_dict


def test_flash1_runs_at_half_flash2_on_every_gpu():
    for name in ("a100-80gb", "h100-sxm", "l40s"):
        g = gpu(name)
        flash2 = ceiling(g, "attention-flash2", "bf16")[0]
        assert attention_ceiling(g, "flash1", "bf16")[0] == pytest.approx(flash2 * FLASH1_OF_FLASH2)
        assert attention_ceiling(g, "flash2", "bf16")[0] == flash2
    fab = Fabric(gpus_per_node=8, intra_gbs=100, nic_gbs=10, peak_tflops=312, attention_flash2_ceiling=1.124)
    cal = Calibration(attention_factor=0.9)
    assert fab.attention_flops_per_s(cal, "flash1") == pytest.approx(312e12 * 1.124 * 0.5 * 0.9)
    assert Kernels(attention_kernel="flash1").attention_kernel == "flash1"
    with pytest.raises(ConfigError, match="attention kernel"):
        Kernels(attention_kernel="flash4")


def test_math_attention_is_batched_matmuls_plus_the_score_traffic():
    spec = model_preset("llama-2-7b")
    prec = precision("bf16")
    fab = Fabric(gpus_per_node=8, intra_gbs=100, nic_gbs=10, peak_tflops=312, mem_bw_tbs=2.0,
                 matmul_ceiling=0.8, attention_ceiling=1.124, attention_flash2_ceiling=1.124)
    no_traffic = Calibration(matmul_factor=0.9, attention_factor=0.5, elementwise_passes=0.0)
    kw = dict(seq=4096, micro_batch=1, checkpoint="none", every=2, calib=no_traffic)
    total = hardware_flops_per_token(spec, 4096, "none")
    attn = attention_flops_per_token(spec, 4096)
    mm_rate = 312e12 * 0.8 * 0.9
    # Unfused: every FLOP (the whole s x s included) at the matmul rate.
    assert micro_batch_compute_s(spec, prec, fab, attention="math", **kw) == pytest.approx(4096 * total / mm_rate)
    # Fused: the attention at its kernel's rate.
    fused = 4096 * ((total - attn) / mm_rate + attn / (312e12 * 1.124 * 0.5))
    assert micro_batch_compute_s(spec, prec, fab, attention="sdpa", **kw) == pytest.approx(fused)
    # The scores' bytes join the memory-bound traffic.
    passes = dataclasses.replace(no_traffic, elementwise_passes=1.0)
    kw["calib"] = passes
    extra = (micro_batch_compute_s(spec, prec, fab, attention="math", **kw) - 4096 * total / mm_rate
             - (micro_batch_compute_s(spec, prec, fab, attention="sdpa", **kw) - fused))
    diff = (layer_activation_bytes(spec, 4096, 1, 2, attention="math")
            - layer_activation_bytes(spec, 4096, 1, 2, attention="sdpa")) * spec.n_layers
    assert extra == pytest.approx(diff / 2e12)


def test_the_attention_prior_is_flashattention_2_s_typical_rate_in_the_planner_s_convention():
    # Dao 2023: 50-73 % of the A100's peak on the FLOPs a causal kernel runs; the midpoint in the
    # planner's convention (unhalved causal FLOPs, backward = 2 forwards).
    assert TYPICAL_OF_PEAK["attention"] == pytest.approx(training_attention_fraction(0.615, 0.615))
    assert TYPICAL_OF_PEAK["attention"] == pytest.approx(2 * 3 * 0.615 / 3.5)


def test_an_interleaved_last_rank_holds_the_loss_stage_for_one_micro_batch_on_any_stack():
    def in_flight(vocab: int) -> int:
        spec = from_hf_config_dict({"model_type": "llama", "num_hidden_layers": 16, "hidden_size": 1024,
                                    "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 4096,
                                    "vocab_size": vocab, "max_position_embeddings": 4096}, "tiny")
        layout = Layout.external_stack("zero1+tp+pp", "zero1", dp=1, tp=2, pp=4, pp_schedule="interleaved-1f1b",
                                       pp_stages_per_rank=2, pp_microbatches=16, sequence_parallel=True)
        mem = memory_breakdown(spec, layout, precision("bf16"), "adamw", seq=4096, micro_batch=1,
                               checkpoint="full", grad_accum=16, kernels=Kernels(loss="fused"), stage=3)
        return next(v for k, v in mem.transient_parts.items() if k.startswith("pipeline in-flight"))

    # The last rank's in-flight micro-batches are its other stage's (the logits never among them).
    assert in_flight(32000) == in_flight(256000)
