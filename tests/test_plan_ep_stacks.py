"""Expert groups by stack (issue 32): the planner plans an ep that another stack's rule allows
(Megatron-Core's MoE parallel folding: ep over tp x dp x cp of a pipeline stage), while
shardwise's own rule (ep over dp_shard x cp, core/layout.py ``EP_GROUPS``) and its refusal stay
exactly as they are for ``--stack shardwise`` and ``train``. Pure arithmetic, one process.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.core.layout import EP_GROUPS, Layout
from shardwise.errors import ConfigError
from shardwise.plan import cli as plan_cli
from shardwise.plan.advice import Cluster, Workload, predict_step_time
from shardwise.plan.memory import precision, state_bytes
from shardwise.plan.presets import gpu, model_preset
from shardwise.plan.stacks import STACKS, stack_settings
from tests.test_plan_grid import plan_args

# qwen3-30b-a3b: 48 layers, 128 experts of gate_up (1536 x 2048) + down (2048 x 768), top-8, hidden 2048.
PINNED = ("--model", "qwen3-30b-a3b", "--gpus-per-node", "8", "--nodes", "32", "--gpu", "h100",
          "--tp", "2", "--pp", "8", "--ep", "32", "--seq", "4096", "--global-batch", "1024",
          "--micro-batch", "1", "--checkpoint", "none", "--pp-first-stage-fewer", "0")
EXPERTS_PER_LAYER = 128 * (1536 * 2048 + 2048 * 768)
REFUSAL = ("parallel.ep=32 must divide the ranks that FSDP shards over, dp_shard x cp = 16 (expert groups are made "
           "of those ranks). Valid ep here: 1, 2, 4, 8, 16. Expert groups that span tensor-parallel ranks "
           "(Megatron's expert-tensor-parallel) or pipeline ranks are not implemented: ep is borrowed from "
           "dp_shard x cp only (torchtitan's layout).")


def test_every_stack_names_an_ep_rule_the_layout_owns():
    for name in STACKS:
        kernels, _ = stack_settings(name)
        assert kernels.ep_groups in EP_GROUPS
    assert stack_settings("megatron")[0].ep_groups == "tp-dp"
    assert stack_settings("shardwise")[0].ep_groups == "dp-shard" == stack_settings("torchtitan")[0].ep_groups
    with pytest.raises(ConfigError, match="expert-group rule"):
        stack_settings("shardwise", ["ep_groups=tp"])


def test_megatron_ep_over_tp_x_dp_is_planned_with_hand_computed_experts_and_all_to_all():
    plan = plan_cli.build_plan(plan_args(*PINNED, "--stack", "megatron"))
    best = plan.recommended
    assert best is not None and best.layout.ep == 32 and best.layout.ep_groups == "tp-dp"
    layout = best.layout
    assert (layout.tp, layout.dp, layout.pp, layout.ep_stride, layout.expert_dp) == (2, 16, 8, 1, 1)
    # train would refuse it: no command, and the warning quotes the runtime's refusal.
    assert not plan.commands and any(REFUSAL in w for w in plan.warnings), plan.warnings
    assert plan_cli.run_prediction(plan) is None  # no "as train stores it" table for a run train refuses
    # All-to-all buffers: a rank's 4096 tokens x top-8 copies x hidden 2048, bf16, sent and received.
    assert best.memory.transient_parts["all-to-all buffers (ep)"] == 2 * 4096 * 8 * 2048 * 2
    # Experts at rest: pipeline rank 0 holds layers 0-5; folded over tp x dp = 32 ranks, each keeps
    # 128 / 32 = 4 experts of each (FSDP over 16 dp ranks alone would keep 8).
    prec = precision("bf16")
    folded = state_bytes(plan.spec, layout, prec, "adamw", rank=0, stage=0)
    plain = state_bytes(plan.spec, dataclasses.replace(layout, ep=1), prec, "adamw", rank=0, stage=0)
    assert plain.params - folded.params == prec.param * 6 * EXPERTS_PER_LAYER * (1 / 16 - 1 / 32)


def test_megatron_all_to_all_time_and_link_by_hand():
    spec = model_preset("qwen3-30b-a3b")
    cluster = Cluster(gpu("h100"), gpus_per_node=8, nodes=32)
    kernels, _ = stack_settings("megatron")
    work = Workload(seq=4096, micro_batch=1, grad_accum=16, checkpoint="none", kernels=kernels)
    layout = Layout("fsdp+tp+pp", dp=16, tp=2, pp=8, ep=32, ep_groups="tp-dp", pp_microbatches=16,
                    sequence_parallel=True)
    fabric = cluster.fabric(work.precision, cluster.calibration)
    # 32 consecutive ranks (etp 1: ep innermost) span 4 nodes: the network, 8 NICs' worth per node.
    gbs = fabric.collective_gbs(32, layout.ep_stride)
    assert gbs == min(fabric.intra_gbs, 8 * fabric.nic_gbs) < fabric.intra_gbs
    alpha = cluster.calibration.hop_latency_s
    per_call = 31 / 32 * 4096 * 8 * 2048 * 2 / (gbs * 1e9) + 31 * alpha
    by_hand = 4 * 6 * per_call * 16  # dispatch + combine, fwd + bwd, 6 MoE layers per rank, 16 micro-batches
    with_ep = predict_step_time(spec, cluster, work, layout)
    without = predict_step_time(spec, cluster, work, dataclasses.replace(layout, ep=1))
    assert with_ep.comm_total_s - without.comm_total_s == pytest.approx(by_hand, rel=1e-9)


def test_megatron_zero1_layout_holds_experts_over_ep_and_their_state_over_expert_dp():
    spec = model_preset("qwen3-30b-a3b")
    prec = precision("bf16")
    ext = Layout.external_stack("zero1+tp+pp", "zero1", dp=16, tp=2, pp=8, ep=32, ep_groups="tp-dp")
    full = Layout.external_stack("zero1+tp+pp", "zero1", dp=16, tp=2, pp=8, ep=1, ep_groups="tp-dp")
    held, whole = state_bytes(spec, ext, prec, "adamw", rank=0, stage=0), state_bytes(spec, full, prec, "adamw",
                                                                                     rank=0, stage=0)
    assert whole.params - held.params == prec.param * 6 * EXPERTS_PER_LAYER * 31 // 32
    # edp = tp x dp / ep = 1: each rank keeps the master copy of its own 4 experts per layer.
    assert ext.expert_dp == 1
    assert held.master >= prec.master * 6 * EXPERTS_PER_LAYER // 32


def test_shardwise_stack_and_train_refuse_the_same_layout_by_name(capsys):
    plan = plan_cli.build_plan(plan_args(*PINNED))
    assert not plan.candidates and plan.recommended is None and not plan.commands
    assert any(line.startswith("fsdp+tp+pp(tp2,ep32,pp8): " + REFUSAL) for line in plan.skipped), plan.skipped
    with pytest.raises(ConfigError) as refused:
        Layout("fsdp+tp+pp", dp=16, tp=2, pp=8, ep=32)
    assert str(refused.value) == REFUSAL
    from shardwise.cli import main

    code = main(["train", "--dry-run", "--strategy", "fsdp+tp+pp", "--nproc", "256", "--set", "model.preset=moe-nano",
                 "--set", "parallel.tp=2", "--set", "parallel.pp=8", "--set", "parallel.ep=32"])
    out = capsys.readouterr()
    assert code == 2 and REFUSAL in out.err and "Traceback" not in out.err, out.err
    assert "dry run" not in out.out


def test_expert_tensor_parallel_splits_the_experts_state_where_the_stack_does():
    """Kernels.experts_tp, a stack property (Layout.experts_tp): a stack whose experts are
    tensor-parallel (torchtitan's expert-tensor-parallel = tp; Megatron-Core before its parallel
    folding) holds 1/tp of each expert's FFN dimension on a rank; shardwise's runtime and
    DeepSpeed-MoE keep them whole, and Megatron's folding (ETP 1, "tp-dp") divides them by an ep that
    spans the TP ranks instead. By hand for qwen3-30b-a3b at tp 2."""
    from shardwise.plan.memory import Kernels, routed_expert_numel

    assert not Kernels().experts_tp and not stack_settings("deepspeed")[0].experts_tp
    assert stack_settings("torchtitan")[0].experts_tp
    assert not stack_settings("megatron")[0].experts_tp  # ETP 1 under the folding
    # Megatron-Core 0.9 (NeMo 24.09): ep from the data-parallel ranks, experts tensor-parallel.
    assert stack_settings("megatron", ["ep_groups=dp", "experts_tp=true"])[0].experts_tp
    for bad in (["experts_tp=true"], ["experts_tp=true", "experts_whole_on_tp=false"]):  # whole; folding
        with pytest.raises(ConfigError, match="experts_tp"):
            stack_settings("shardwise" if len(bad) == 1 else "megatron", bad)
    from shardwise.plan.memory import _tp_split_dim
    from shardwise.plan.spec import ParamInfo

    # Each expert's FFN dimension: HF's stacked (E, 2I, D) / (E, D, I), the built-in GPT's (E, D, F) /
    # (E, F, D), per-expert w1 (I, D) / w2 (D, I).
    for name, shape, dim in (("l.mlp.experts.gate_up_proj", (8, 6, 4), 1), ("l.mlp.experts.down_proj", (8, 4, 3), 2),
                             ("b.mlp.experts.w_in", (4, 32, 64), 2), ("b.mlp.experts.w_out", (4, 64, 32), 1),
                             ("l.moe.experts.0.w1.weight", (6, 4), 0), ("l.moe.experts.0.w2.weight", (4, 6), 1)):
        assert _tp_split_dim(ParamInfo(name, shape, "u"), experts_tp=True) == dim, name
        assert _tp_split_dim(ParamInfo(name, shape, "u")) is None, name
    spec = model_preset("qwen3-30b-a3b")
    whole = routed_expert_numel(spec, Layout("fsdp+tp", dp=4, tp=2), 0)
    split = routed_expert_numel(spec, Layout("fsdp+tp", dp=4, tp=2, experts_tp=True), 0)
    assert whole == 48 * EXPERTS_PER_LAYER and split == whole // 2
    plan = plan_cli.build_plan(plan_args("--model", "qwen3-30b-a3b", "--gpus-per-node", "8", "--tp", "2",
                                         "--stack", "torchtitan"))
    assert plan.candidates and all(c.layout.experts_tp for c in plan.candidates if c.layout.tp > 1)
    plan = plan_cli.build_plan(plan_args("--model", "qwen3-30b-a3b", "--gpus-per-node", "8", "--tp", "2"))
    assert not any(c.layout.experts_tp for c in plan.candidates)
