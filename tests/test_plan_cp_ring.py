"""The planner's ring attention (``parallel.cp_impl = ring``, plan/cp.py): its traffic, the search's
choice between the all-to-all and the ring, and the printed ring command resolving as ``train --dry-run``.

Pure arithmetic, one process (the runtime-rule check builds tiny GPTs on CPU).
"""

from __future__ import annotations

import json

import pytest

from shardwise.core.layout import Layout
from shardwise.errors import ConfigError
from shardwise.plan import cli as plan_cli
from shardwise.plan.cost import Fabric, step_time
from shardwise.plan.cp import CP_IMPLS, cp_candidates, cp_comm_s, cp_impl_for, cp_multiple, ring_bytes_per_layer
from shardwise.plan.memory import precision
from shardwise.plan.presets import model_preset
from tests.test_plan_grid import dry_run_torchrun, dry_run_train, plan_args
from tests.test_plan_search import parse_table


def test_ring_bytes_and_time_per_layer_by_hand():
    spec = model_preset("llama-3-8b")  # 32 heads, 8 kv heads of 128, 32 layers
    block = 1 * (32768 // 4) * 8 * 128  # one K (or V) block: micro-batch x seq/cp x kv heads x head dim
    fwd = 3 * 2 * block * 2  # cp-1 = 3 steps of K and V in bf16
    bwd = fwd + 4 * 2 * block * 4  # K and V again, and dK/dV in fp32 over cp = 4 steps
    assert ring_bytes_per_layer(spec, 32768, 1, 2, cp=4) == (fwd, bwd)
    assert ring_bytes_per_layer(spec, 32768, 1, 2, cp=4, tp=2) == (fwd // 2, bwd // 2)  # 4 kv heads per tp rank
    assert ring_bytes_per_layer(spec, 32768, 1, 2, cp=1) == (0, 0)
    fabric = Fabric(gpus_per_node=8, intra_gbs=450, nic_gbs=50, peak_tflops=989)
    lay, alpha = Layout("fsdp", dp=8, cp=4), 5e-6
    by_hand = 32 * ((fwd / 450e9 + 3 * alpha) + (bwd / 450e9 + 4 * alpha))
    got = cp_comm_s(spec, lay, fabric, 2, seq=32768, micro_batch=1, layers=32, alpha_s=alpha, impl="ring")
    assert got == pytest.approx(by_hand)
    # Recomputed blocks repeat the forward's traffic.
    redo = cp_comm_s(spec, lay, fabric, 2, seq=32768, micro_batch=1, layers=32, alpha_s=alpha, impl="ring",
                     recompute=1.0)
    assert redo - got == pytest.approx(32 * (fwd / 450e9 + 3 * alpha))
    # In a step: the ring moves other bytes than the all-to-all, and hides behind the remote blocks' attention.
    bf16 = precision("bf16")
    ring = step_time(spec, lay, bf16, fabric, seq=32768, micro_batch=1, grad_accum=1, cp_impl="ring")
    a2a = step_time(spec, lay, bf16, fabric, seq=32768, micro_batch=1, grad_accum=1, cp_impl="alltoall")
    assert ring.comm_total_s != a2a.comm_total_s and ring.compute_s == a2a.compute_s
    assert ring.comm_exposed_s < ring.comm_total_s


def test_the_planners_cp_rules_are_the_runtimes():
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.context import cp as runtime

    assert CP_IMPLS == runtime.CP_IMPLS
    for cp in (1, 2, 3, 4, 8):
        for impl in ("alltoall", "ring"):
            assert cp_multiple(cp, impl) == runtime.cp_multiple(cp, impl)
    for heads in (4, 6):
        model = GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=heads, n_embd=2 * heads))
        for tp in (1, 2):
            for cp in (2, 3, 4):
                for impl in ("alltoall", "ring"):
                    try:
                        runtime.check_cp_model(model, cp, tp, impl)
                        runs = True
                    except ConfigError:
                        runs = False
                    assert runs == bool(cp_impl_for(impl, heads, tp, cp)), (heads, tp, cp, impl)
    assert cp_impl_for("auto", 6, 1, 4) == "ring" and cp_impl_for("auto", 6, 1, 2) == "alltoall"
    # The ring needs the sequence in 2 cp chunks.
    assert cp_candidates(4, 16384, 6) == [1, 2] and cp_candidates(4, 16384, 6, impl="auto") == [1, 2, 4]
    assert cp_candidates(4, 16388, 6, impl="auto") == [1, 2]  # 16388 = 4 x 4097: not a multiple of 8


def test_heads_that_refuse_the_all_to_all_get_a_ring_candidate_whose_command_dry_runs():
    # gpt-lab has 6 heads: cp=4 cannot split them, so auto offers cp=4 under the ring.
    argv = ("--model", "gpt-lab", "--gpus-per-node", "4", "--seq", "16384")
    plan = plan_cli.build_plan(plan_args(*argv))
    rows, _, _ = parse_table(plan_cli.format_table(plan))
    assert "fsdp(cp4-ring)" in rows and "fsdp(cp2)" in rows
    out = json.loads(json.dumps(plan_cli.plan_to_dict(plan)))
    impls = {c["label"]: c["cp_impl"] for c in out["candidates"]}
    assert impls["fsdp(cp4-ring)"] == "ring" and impls["fsdp(cp2)"] == "alltoall" and impls["fsdp"] is None
    assert out["workload"]["cp_impl"] == "auto"
    pinned = plan_cli.build_plan(plan_args(*argv, "--cp", "4"))
    assert {(c.layout.cp, c.cp_impl) for c in pinned.candidates} == {(4, "ring")}
    train, torchrun = pinned.commands
    assert "--set parallel.cp=4 --set parallel.cp_impl=ring" in train and "parallel.cp_impl=ring" in torchrun
    assert dry_run_train(train) == (pinned.recommended.layout.strategy, 4) == dry_run_torchrun(torchrun)
    assert plan_cli.plan_to_dict(pinned)["recommended_settings"]["cp_impl"] == "ring"
    # cp=2 runs the all-to-all and says nothing (the runtime's auto).
    two = plan_cli.build_plan(plan_args(*argv, "--cp", "2"))
    assert "cp_impl" not in two.commands[0] and two.recommended.cp_impl == "alltoall"
    # --cp-impl alltoall keeps the head rule; a ring sequence must split in 2 cp chunks.
    assert {c.layout.cp for c in plan_cli.build_plan(plan_args(*argv, "--cp-impl", "alltoall")).candidates} == {1, 2}
    with pytest.raises(ConfigError, match=r"--cp 4 does not divide the 6 attention heads.*--cp-impl ring"):
        plan_cli.build_plan(plan_args(*argv, "--cp", "4", "--cp-impl", "alltoall"))
    with pytest.raises(ConfigError, match=r"--seq 16388 must be a multiple of 2 x --cp .* = 8"):
        plan_cli.build_plan(plan_args("--model", "gpt-lab", "--gpus-per-node", "4", "--seq", "16388", "--cp", "4"))


def test_cp_impl_ring_changes_the_reported_comm_time():
    argv = ("--model", "llama-3-8b", "--nodes", "2", "--seq", "32768", "--cp", "4", "--json")
    ring = plan_cli.plan_to_dict(plan_cli.build_plan(plan_args(*argv, "--cp-impl", "ring")))
    a2a = plan_cli.plan_to_dict(plan_cli.build_plan(plan_args(*argv, "--cp-impl", "alltoall")))
    assert ring["workload"]["cp_impl"] == "ring" and a2a["workload"]["cp_impl"] == "alltoall"
    assert {c["cp_impl"] for c in ring["candidates"]} == {"ring"}
    assert {c["cp_impl"] for c in a2a["candidates"]} == {"alltoall"}
    by_ring = {(c["strategy"], c["tp"], c["pp"]): c for c in ring["candidates"]}
    same = [(c, by_ring[key]) for c in a2a["candidates"]
            if (key := (c["strategy"], c["tp"], c["pp"])) in by_ring and c["checkpoint"] == by_ring[key]["checkpoint"]
            and c["micro_batch"] == by_ring[key]["micro_batch"] and c["grad_sync"] == by_ring[key]["grad_sync"]]
    assert same
    for a, r in same:
        assert r["comm_exposed_s"] != a["comm_exposed_s"], a["label"]
    assert "--set parallel.cp_impl=ring" in ring["commands"][0] and "cp_impl" not in a2a["commands"][0]
    with pytest.raises(SystemExit):
        plan_args("--model", "gpt-lab", "--cp-impl", "ulysses")


def test_tensor_parallel_collectives_carry_a_cp_ranks_share_of_the_sequence():
    """Under context parallel a rank's blocks see seq / cp tokens, so its TP all-reduces move that
    many (the whole sequence was charged before: 16 times too much on the Llama 3 paper's CP-16 run,
    which the planner put at -61 % of its published throughput)."""
    from shardwise.plan.cost import all_reduce_s, tp_comm_s

    spec = model_preset("llama-3-8b")  # hidden 4096, 32 layers
    bf16 = precision("bf16")
    fabric = Fabric(gpus_per_node=8, intra_gbs=450, nic_gbs=50, peak_tflops=989)
    alpha = 5e-6
    for cp in (1, 4):
        lay = Layout("fsdp+tp", dp=8, tp=2, cp=cp)
        act = 2 * (32768 // cp) * 4096 * 2  # micro-batch 2 x the rank's tokens x hidden, bf16
        by_hand = 32 * 4 * all_reduce_s(2, act, fabric.collective_gbs(2, 1), 1, alpha)
        assert tp_comm_s(spec, lay, bf16, fabric, seq=32768, micro_batch=2, alpha_s=alpha) == pytest.approx(by_hand)
    # Full recompute repeats the forward's two all-reduces per block.
    lay = Layout("fsdp+tp", dp=8, tp=2, cp=4)
    full = tp_comm_s(spec, lay, bf16, fabric, seq=32768, micro_batch=2, checkpoint="full", alpha_s=alpha)
    assert full == pytest.approx(1.5 * tp_comm_s(spec, lay, bf16, fabric, seq=32768, micro_batch=2, alpha_s=alpha))
    assert tp_comm_s(spec, Layout("fsdp", dp=8, cp=4), bf16, fabric, seq=32768, micro_batch=2) == 0.0


def test_tp_overlap_modes_hide_what_each_stack_overlaps_by_hand():
    """``Kernels.tp_overlap``: "none" leaves every TP collective exposed; "backward" (Megatron-LM's
    linears without --tp-comm-overlap, nanotron's async linears) hides one of a block's four
    all-reduce-sized collectives under sequence parallel (two without it), the column linears'
    input-gradient ones, up to the weight-gradient GEMMs (a third of the compute) and none of the
    recomputed forward's; "full" hides all of them up
    to the step's compute. The same step otherwise: only the exposed TP time differs."""
    from shardwise.plan.cost import DEFAULT_CALIBRATION, tp_comm_s, tp_exposed_s
    from shardwise.plan.memory import Kernels

    spec = model_preset("llama-3-8b")
    bf16 = precision("bf16")
    fabric = Fabric(gpus_per_node=8, intra_gbs=450, nic_gbs=50, peak_tflops=989)
    lay = Layout("fsdp+tp", dp=4, tp=2, sequence_parallel=True)
    for checkpoint in ("none", "full"):
        kw = dict(seq=4096, micro_batch=2, grad_accum=3, checkpoint=checkpoint)
        steps = {mode: step_time(spec, lay, bf16, fabric, kernels=Kernels(tp_overlap=mode), **kw)
                 for mode in ("none", "backward", "full")}
        alpha = DEFAULT_CALIBRATION.hop_latency_s  # step_time's default calibration
        tp_s = 3 * tp_comm_s(spec, lay, bf16, fabric, seq=4096, micro_batch=2, checkpoint=checkpoint, alpha_s=alpha)
        plain = 3 * tp_comm_s(spec, lay, bf16, fabric, seq=4096, micro_batch=2, alpha_s=alpha)
        compute = steps["none"].compute_s
        assert all(s.compute_s == compute for s in steps.values())
        # The hand rule, independent of the code's helper.
        hidden = {"none": 0.0, "backward": min(plain / 4, compute / 3), "full": min(tp_s, compute)}
        for mode, s in steps.items():
            assert steps["none"].comm_exposed_s - s.comm_exposed_s == pytest.approx(hidden[mode], rel=1e-6), mode
            assert tp_exposed_s(tp_s, plain, compute, mode) == pytest.approx(tp_s - hidden[mode])
        if checkpoint == "full":  # the recomputed forward's collectives stay exposed under "backward"
            assert tp_s > plain and hidden["backward"] == pytest.approx(plain / 4)
    # Without sequence parallel the backward's two collectives are the QKV and fc1 input-gradient
    # all-reduces: half of the block's four hide.
    plain_lay = Layout("fsdp+tp", dp=4, tp=2)
    kw = dict(seq=4096, micro_batch=2, grad_accum=3)
    none, back = (step_time(spec, plain_lay, bf16, fabric, kernels=Kernels(tp_overlap=m), **kw)
                  for m in ("none", "backward"))
    plain = 3 * tp_comm_s(spec, plain_lay, bf16, fabric, seq=4096, micro_batch=2,
                          alpha_s=DEFAULT_CALIBRATION.hop_latency_s)
    assert none.comm_exposed_s - back.comm_exposed_s == pytest.approx(min(plain / 2, none.compute_s / 3), rel=1e-6)
    with pytest.raises(ConfigError, match="TP overlap"):
        Kernels(tp_overlap="sometimes")
