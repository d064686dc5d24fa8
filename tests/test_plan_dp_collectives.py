"""Data-parallel collectives at scale (issue 32, round i32-r6): NCCL's tree all-reduce, whose latency
grows with log2 of the nodes where the ring's grows with the ranks, and a ZeRO-1 stack that shards
its optimizer state within groups of G data-parallel ranks (``--stack-set zero1_group=G``). Hand
computations against the cost and memory model; pure arithmetic, one process.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardwise.core.layout import Layout
from shardwise.errors import ConfigError
from shardwise.plan import cli as plan_cli
from shardwise.plan.advice import Cluster, Workload, predict_step_time
from shardwise.plan.cost import CALIBRATIONS, Fabric, all_gather_s, all_reduce_s
from shardwise.plan.memory import Kernels, precision, state_bytes
from shardwise.plan.presets import gpu, model_preset
from shardwise.plan.search import runtime_refusal
from shardwise.plan.stacks import stack_settings
from tests.test_plan_grid import plan_args


def test_all_reduce_takes_the_tree_latency_across_nodes():
    alpha = 5e-6
    # One node: ring and tree (a chain through the node) take the same 2 (n - 1) hops.
    assert all_reduce_s(8, 0, 100, calls=1, alpha_s=alpha) == pytest.approx(14 * alpha)
    assert all_reduce_s(8, 0, 100, calls=1, alpha_s=alpha, nodes=1) == pytest.approx(14 * alpha)
    # 1,024 ranks on 128 nodes: the ring's 2,046 hops, the tree's 2 (7 + 7) = 28.
    assert all_reduce_s(1024, 0, 100, calls=3, alpha_s=alpha, nodes=128) == pytest.approx(3 * 28 * alpha)
    # Two ranks on two nodes: the ring's 2 hops are fewer than the tree's 2 (0 + 1) = 2: equal.
    assert all_reduce_s(2, 0, 100, calls=1, alpha_s=alpha, nodes=2) == pytest.approx(2 * alpha)
    # The bytes move at the ring's rate either way.
    assert all_reduce_s(1024, 1e9, 10, nodes=128) == pytest.approx(2 * 1023 / 1024 * 1e9 / 10e9)
    # Gathers and reduce-scatters stay rings (NCCL has no tree for them).
    assert all_gather_s(1024, 0, 100, calls=1, alpha_s=alpha) == pytest.approx(1023 * alpha)


def test_nodes_spanned_counts_the_group_members_per_node():
    fab = Fabric(gpus_per_node=8, intra_gbs=100, nic_gbs=10, peak_tflops=100)
    assert fab.nodes_spanned(8, 1) == 1          # a node's ranks
    assert fab.nodes_spanned(1024, 1) == 128     # dp over 128 nodes of 8
    assert fab.nodes_spanned(64, 2) == 16        # dp under TP 2: 4 members per node
    assert fab.nodes_spanned(16, 8) == 16        # one member per node under TP 8


def test_zero1_group_shards_the_state_within_the_group():
    spec = model_preset("llama-2-7b")
    prec = precision("bf16")
    whole = Layout.external_stack("zero1", "zero1", dp=64)
    grouped = Layout.external_stack("zero1", "zero1", dp=64, zero1_group=8)
    assert (whole.zero1_shards, grouped.zero1_shards) == (64, 8)
    w, g = state_bytes(spec, whole, prec, "adamw"), state_bytes(spec, grouped, prec, "adamw")
    # Parameters and gradients are whole on every rank either way; the AdamW moments and the fp32
    # master copy are dealt (whole tensors, largest first) over 8 ranks instead of 64: the busiest
    # of 8 holds at least an eighth of them.
    assert (g.params, g.grads) == (w.params, w.grads)
    assert g.optimizer + g.master >= 12 * spec.n_params / 8 > 4 * (w.optimizer + w.master)
    # A rank of the second group owns what the same rank of the first does.
    assert state_bytes(spec, grouped, prec, "adamw", rank=9) == state_bytes(spec, grouped, prec, "adamw", rank=1)


def test_zero1_group_gathers_the_updated_parameters_inside_the_group():
    spec = model_preset("llama-2-7b")
    cluster = Cluster(gpu("a100-80gb"), gpus_per_node=8, nodes=16)
    calib = CALIBRATIONS["a100"]
    kernels, _ = stack_settings("shardwise", ["grad_buffer=contiguous"])
    work = Workload(seq=2048, micro_batch=2, grad_accum=4, precision="bf16", checkpoint="none", kernels=kernels,
                    safety_margin=0.0)
    whole = Layout.external_stack("zero1", "zero1", dp=128)
    grouped = dataclasses.replace(whole, zero1_group=8)
    t_whole = predict_step_time(spec, cluster, work, whole, calib)
    t_group = predict_step_time(spec, cluster, work, grouped, calib)
    fab = cluster.fabric("bf16", calib)
    params, calls = math.ceil(spec.n_params), len(spec.params)
    # The post-step broadcast: over all 128 dp ranks (16 nodes) or inside one node's 8.
    bc_whole = all_gather_s(128, 2 * params, fab.collective_gbs(128, 1), calls, calib.hop_latency_s)
    bc_group = all_gather_s(8, 2 * params, fab.collective_gbs(8, 1), calls, calib.hop_latency_s)
    assert t_whole.comm_exposed_s - t_group.comm_exposed_s == pytest.approx(bc_whole - bc_group, rel=1e-9)
    assert t_whole.compute_s == t_group.compute_s


def test_zero1_group_is_checked_and_planned_but_not_run():
    with pytest.raises(ConfigError, match="must divide the 12 data-parallel ranks"):
        Layout.external_stack("zero1", "zero1", dp=12, zero1_group=8)
    with pytest.raises(ConfigError, match="integer >= 0"):
        Kernels(zero1_group=-1)
    with pytest.raises(ConfigError, match="whole number"):
        stack_settings("shardwise", ["zero1_group=eight"])
    # Not ZeRO-1, or a group of every dp rank: nothing to group.
    assert Layout.external_stack("fsdp", "fsdp", dp=16, shard=16, zero1_group=8).zero1_group == 0
    assert Layout.external_stack("zero1", "zero1", dp=8, zero1_group=8).zero1_group == 0
    plan = plan_cli.build_plan(plan_args("--model", "llama-2-7b", "--gpu", "a100", "--gpus-per-node", "8",
                                         "--nodes", "4", "--seq", "2048", "--global-batch", "256",
                                         "--stack-set", "zero1_group=8"))
    zero1 = [c for c in plan.candidates if c.layout.sharding == "zero1"]
    assert zero1 and all(c.layout.zero1_group == 8 for c in zero1)
    # shardwise's train shards ZeRO-1 over every dp rank: such a layout gets no command.
    assert "zero1_group" in runtime_refusal(zero1[0].layout)
    assert runtime_refusal(dataclasses.replace(zero1[0].layout, zero1_group=0)) == ""
