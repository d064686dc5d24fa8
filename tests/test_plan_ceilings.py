"""Efficiency ceilings from published kernel measurements (presets.KERNEL_CEILINGS): the planner's
rates are ceiling x a fitted factor confined to cost.FACTOR_BANDS (docs/planner.md, calibration)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.errors import ConfigError
from shardwise.plan.advice import Cluster, Workload, predict_step_time
from shardwise.plan.cost import CALIBRATIONS, FACTOR_BANDS
from shardwise.plan.memory import Layout
from shardwise.plan.presets import (
    KERNEL_CEILINGS,
    UNMEASURED_CEILINGS,
    ceiling,
    gpu,
    gpu_from_dict,
    model_preset,
    training_attention_fraction,
)
from shardwise.plan.spec import from_param_count


def test_every_fitted_factor_lies_in_its_band():
    for gen, cal in CALIBRATIONS.items():
        for name, (lo, hi) in FACTOR_BANDS[gen].items():
            assert lo <= getattr(cal, name) <= hi, (gen, name)


def test_catalog_gpus_take_their_generation_s_published_ceilings():
    # MAMF table: A100 SXM 271.2 of 312, H100 SXM 794.5 of 989 ("H200 is the same"); the H100
    # PCIe has no measurement and takes the H100 SXM's fraction of its own peak.
    for name in ("a100-40gb", "a100-80gb"):
        assert ceiling(gpu(name), "matmul", "bf16")[0] == pytest.approx(271.2 / 312)
    for name in ("h100-sxm", "h100-pcie", "h200"):
        assert ceiling(gpu(name), "matmul", "bf16")[0] == pytest.approx(794.5 / 989)
        assert ceiling(gpu(name), "attention", "bf16")[0] == pytest.approx(
            training_attention_fraction(740 / 989, 561 / 989))
    # fp32 (TF32) has no row: the 16-bit fraction, of the TF32 peak the Fabric uses.
    assert ceiling(gpu("h100-sxm"), "matmul", "fp32") == ceiling(gpu("h100-sxm"), "matmul", "bf16")
    # Unmeasured: the documented fallback, with no source (what makes `plan` warn).
    assert ceiling(gpu("l40s"), "matmul", "bf16") == (UNMEASURED_CEILINGS["matmul"], "")
    assert ceiling(gpu("mi300x"), "matmul", "bf16")[0] == pytest.approx(668.4 / 1300)
    assert ceiling(gpu("mi300x"), "attention", "bf16") == (UNMEASURED_CEILINGS["attention"], "")
    assert all(c.source for row in KERNEL_CEILINGS.values() for c in row.values())


def test_attention_ceiling_converts_the_papers_convention():
    # Forward and backward at one rate f: the planner's 3 units take 3.5 / f of the kernel's time,
    # and a causal kernel runs half the unhalved FLOPs: 2 * 3 / 3.5 * f.
    assert training_attention_fraction(0.6, 0.6) == pytest.approx(2 * 3 / 3.5 * 0.6)


def test_a_matmul_bound_layout_reaches_the_ceiling_and_never_passes_it():
    """A model known by its parameter count only (no attention, no memory-bound ops) on one H100:
    its MFU is the matmul rate, ceiling x factor; at the band's top it is the published MAMF
    fraction (794.5 / 989), which no factor inside the band exceeds."""
    spec = from_param_count(7_000_000_000)
    cluster = Cluster(gpu("h100-sxm"), gpus_per_node=1, nodes=1)
    work = Workload(seq=4096)
    layout = Layout("ddp", dp=1)
    cal = CALIBRATIONS["h100"]
    lo, hi = FACTOR_BANDS["h100"]["matmul_factor"]
    mfus = [predict_step_time(spec, cluster, work, layout, replace(cal, matmul_factor=f)).mfu
            for f in (lo, cal.matmul_factor, hi)]
    assert mfus[1] == pytest.approx(794.5 / 989 * cal.matmul_factor)
    assert mfus[2] == pytest.approx(794.5 / 989)
    assert mfus[0] < mfus[1] <= mfus[2] <= 794.5 / 989 + 1e-9


def test_gpu_spec_names_its_ceilings_row_or_inherits_its_base_s():
    assert gpu_from_dict({"base": "h100-sxm", "memory_gib": 94}, "test").ceilings == "h100-sxm"
    bare = gpu_from_dict({"memory_gib": 48, "bf16_tflops": 300, "mem_bw_tbs": 1.0}, "test")
    assert ceiling(bare, "matmul", "bf16")[1] == ""
    assert gpu_from_dict({"memory_gib": 48, "bf16_tflops": 300, "mem_bw_tbs": 1.0, "ceilings": "a100-sxm"},
                         "test").ceilings == "a100-sxm"
    with pytest.raises(ConfigError, match="ceilings must be one of"):
        gpu_from_dict({"base": "h100-sxm", "ceilings": "b200"}, "test")


def test_the_attention_kernel_is_a_stack_property_with_its_own_ceiling():
    """Kernels.attention_kernel (docs/planner.md, "The attention kernel is a stack property"): on an
    H100 FlashAttention-2 rates at 0.35 / 0.748 of FlashAttention-3's ceiling (its abstract), cuDNN /
    FA3 ("flash3") at FA3's; on an A100, where no newer kernel runs, both at FlashAttention-2's.
    Megatron's stack (Transformer Engine: cuDNN on Hopper) says flash3, shardwise's runtime flash2."""
    from shardwise.plan.memory import Kernels
    from shardwise.plan.presets import attention_op
    from shardwise.plan.stacks import stack_settings

    fa3 = training_attention_fraction(740 / 989, 561 / 989)
    for name in ("h100-sxm", "h200"):
        assert ceiling(gpu(name), attention_op("flash3"), "bf16")[0] == pytest.approx(fa3)
        assert ceiling(gpu(name), attention_op("flash2"), "bf16")[0] == pytest.approx(fa3 * 0.35 / (740 / 989))
    a100 = ceiling(gpu("a100-80gb"), "attention", "bf16")
    assert ceiling(gpu("a100-80gb"), attention_op("flash2"), "bf16") == a100
    assert ceiling(gpu("l40s"), attention_op("flash2"), "bf16") == (UNMEASURED_CEILINGS["attention"], "")
    assert stack_settings("megatron")[0].attention_kernel == "flash3"
    assert stack_settings("shardwise")[0].attention_kernel == "flash2"
    assert stack_settings("shardwise", ["attention_kernel=flash3"])[0].attention_kernel == "flash3"
    with pytest.raises(ConfigError, match="flash2"):
        Kernels(attention_kernel="flash4")

    # The step: only the attention term moves, by the ratio of the ceilings (H100), not at all (A100).
    spec = model_preset("llama-3-8b")
    for name, faster in (("h100-sxm", True), ("a100-80gb", False)):
        cluster = Cluster(gpu(name), gpus_per_node=8, nodes=1)
        times = {}
        for k in ("flash2", "flash3"):
            work = Workload(seq=8192, micro_batch=1, grad_accum=1, precision="bf16", optimizer="adamw",
                            kernels=Kernels(attention_kernel=k))
            times[k] = predict_step_time(spec, cluster, work, Layout("fsdp", dp=8)).compute_s
        assert (times["flash3"] < times["flash2"] * 0.95) if faster else times["flash3"] == times["flash2"]
