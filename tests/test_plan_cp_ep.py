"""The planner's search over context parallel, expert parallel and the chunked loss.

Pure arithmetic, one process; the printed commands are resolved in-process as ``train --dry-run``
resolves them (``tests.test_plan_grid``'s resolvers: config, layout and preflight on the meta model).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from shardwise.errors import ConfigError
from shardwise.plan import cli as plan_cli
from shardwise.plan.advice import Cluster, Workload, evaluate
from shardwise.plan.choices import degree_sets
from shardwise.plan.cp import AUTO_CHUNK_BYTES, CHUNKED_HEAD_FAMILIES, chunked_loss_off
from shardwise.plan.memory import Layout
from shardwise.plan.presets import gpu, model_preset
from tests.test_plan_grid import dry_run_torchrun, dry_run_train, plan_args
from tests.test_plan_search import check_reasons, parse_table


def _plan(*argv: str):
    plan = plan_cli.build_plan(plan_args(*argv))
    text = plan_cli.format_table(plan)
    assert check_reasons(text, plan.cluster.gpu.memory_gib) == len(plan.candidates) - 1
    return plan, text


def test_long_sequences_search_cp_and_the_printed_cp_command_dry_runs():
    # A short sequence offers no cp; from plan.cp.LONG_SEQ on, the degrees that divide dp and the heads.
    spec = model_preset("gpt-lab")
    cluster = Cluster(gpu("h100"), gpus_per_node=4)
    assert {s["cp"] for s in degree_sets(spec, cluster, seq=2048)} == {1}
    assert {s["cp"] for s in degree_sets(spec, cluster, seq=16384, cp_impl="alltoall") if s["tp"] == 1} == {1, 2}
    # 6 heads: cp=4 only under the ring (auto takes it where the all-to-all cannot; tests/test_plan_cp_ring.py)
    assert {s["cp"] for s in degree_sets(spec, cluster, seq=16384) if s["tp"] == 1} == {1, 2, 4}
    plan, text = _plan("--model", "gpt-lab", "--gpus-per-node", "4", "--seq", "16384")
    rows, _, _ = parse_table(text)
    assert "fsdp(cp2)" in rows and "ddp(cp2)" in rows
    # Context parallel: activations of seq / cp tokens (per sequence: the search may pick another
    # micro-batch; at equal tokens a rank holds a little more under the all-to-all, plan.memory),
    # same model state, global batch held.
    by = {c.name: c for c in plan.candidates}
    per_sequence = {n: by[n].memory.activations / by[n].micro_batch for n in ("fsdp(cp2)", "fsdp")}
    assert per_sequence["fsdp(cp2)"] < 0.6 * per_sequence["fsdp"], per_sequence
    assert by["fsdp(cp2)"].memory.params == by["fsdp"].memory.params
    for c in plan.candidates:
        assert c.micro_batch * c.grad_accum * c.layout.dp // c.layout.cp == 4, c.name
    out = plan_cli.plan_to_dict(plan)
    assert {(c["label"], c["cp"]) for c in out["candidates"]} >= {("fsdp(cp2)", 2), ("fsdp", 1)}
    # --cp pins it, and the command runs it as printed.
    pinned, _ = _plan("--model", "gpt-lab", "--gpus-per-node", "4", "--seq", "16384", "--cp", "2")
    assert {c.layout.cp for c in pinned.candidates} == {2}
    train, torchrun = pinned.commands
    assert "--set parallel.cp=2" in train and "--set parallel.cp=2" in torchrun
    assert dry_run_train(train) == (pinned.recommended.layout.strategy, 4) == dry_run_torchrun(torchrun)
    assert json.loads(json.dumps(plan_cli.plan_to_dict(pinned)))["recommended_settings"]["cp"] == 2


def test_bad_cp_and_ep_pins_are_config_errors():
    with pytest.raises(ConfigError, match="--cp 4 does not divide the 6 attention heads"):
        plan_cli.build_plan(plan_args("--model", "gpt-lab", "--gpus-per-node", "4", "--cp", "4", "--cp-impl",
                                      "alltoall"))
    with pytest.raises(ConfigError, match="--cp 0 must be|--cp must be >= 1"):
        plan_cli.build_plan(plan_args("--model", "gpt-lab", "--gpus-per-node", "4", "--cp", "0"))
    with pytest.raises(ConfigError, match="no mixture-of-experts layers"):
        plan_cli.build_plan(plan_args("--model", "gpt-lab", "--gpus-per-node", "4", "--ep", "2"))
    with pytest.raises(ConfigError, match="--ep 3 does not divide the 8 experts"):
        plan_cli.build_plan(plan_args("--model", "gpt-moe-lab", "--gpus-per-node", "4", "--ep", "3"))
    with pytest.raises(ConfigError, match="train.loss_chunks must be"):
        plan_cli.build_plan(plan_args("--model", "gpt-lab", "--loss-chunks", "many"))


def test_chunked_loss_memory_flag_and_commands():
    # llama-3-8b: a 128k vocabulary beside 4k hidden, so 'auto' chunks it (as the runtime would).
    spec, cluster = model_preset("llama-3-8b"), Cluster(gpu("h100-sxm"))
    lay = Layout("fsdp", dp=8, shard=8)
    dense = evaluate(spec, cluster, Workload(seq=8192, loss_chunks=0), lay)
    auto = evaluate(spec, cluster, Workload(seq=8192, loss_chunks=None), lay)
    four = evaluate(spec, cluster, Workload(seq=8192, loss_chunks=4), lay)
    assert not dense.loss_chunked and auto.loss_chunked and four.loss_chunked
    assert "logits + loss" in dense.memory.transient_parts
    saved = dense.memory.allocated - auto.memory.allocated
    assert saved > 4 * 8192 * 128256  # at least the fp32 logits' bytes
    assert auto.memory.allocated < four.memory.allocated < dense.memory.allocated  # 4 chunks of 2k > 64 MiB
    assert auto.time.compute_s > dense.time.compute_s  # backward recomputes each chunk's logits
    # On the CLI: the default is the runtime's (auto, unsaid); 0 / N are printed and TP layouts,
    # which cannot chunk, are left out for an explicit N with the runtime's reason.
    plan, text = _plan("--model", "gpt-lab", "--gpus-per-node", "2")
    assert "train.loss_chunks" not in plan.commands[0]
    off, _ = _plan("--model", "gpt-lab", "--gpus-per-node", "2", "--loss-chunks", "0")
    assert "--set train.loss_chunks=0" in off.commands[0]
    n, text = _plan("--model", "llama-3-8b", "--loss-chunks", "8")
    assert all(c.layout.tp == 1 and c.loss_chunked for c in n.candidates)
    assert "not offered fsdp+tp(tp2): train.loss_chunks = 8 cannot run here: tensor parallel" in text
    assert "--set train.loss_chunks=8" in n.commands[0]
    assert plan_cli.plan_to_dict(n)["workload"]["loss_chunks"] == 8


def test_the_planners_chunk_rule_is_the_runtimes():
    import shardwise.loss as runtime_loss

    assert AUTO_CHUNK_BYTES == runtime_loss.AUTO_CHUNK_BYTES
    assert CHUNKED_HEAD_FAMILIES == runtime_loss._PLAIN_HEAD_FAMILIES
    assert chunked_loss_off("llama", 128256, 4096, None) == ""
    assert chunked_loss_off("gpt", 256, 384, None)  # small vocabulary: auto stays off
    assert chunked_loss_off("gpt", 256, 384, 4) == ""  # an explicit N runs
    assert "tensor parallel" in chunked_loss_off("llama", 128256, 4096, 4, tp=2)
    assert chunked_loss_off("gpt2", 50257, 768, None)


def test_moe_models_search_ep_and_the_printed_ep_command_dry_runs():
    spec = model_preset("gpt-moe-lab")
    assert {s["ep"] for s in degree_sets(spec, Cluster(gpu("h100"), gpus_per_node=4))} == {1, 2, 4}
    assert {s["ep"] for s in degree_sets(model_preset("gpt-lab"), Cluster(gpu("h100"), gpus_per_node=4))} == {1}
    plan, text = _plan("--model", "gpt-moe-lab", "--gpus-per-node", "4", "--checkpoint", "none",
                       "--micro-batch", "1")
    by = {c.name: c for c in plan.candidates}
    assert {"fsdp(ep2)", "fsdp(ep4)", "fsdp+tp(tp2,ep2)"} <= set(by)
    assert not any("ep" in n for n in by if not n.startswith("fsdp"))  # ep runs under fsdp / fsdp+tp only
    # EP: same bytes at rest, a smaller gathered expert unit, and all-to-all time on top.
    fsdp, ep2 = by["fsdp"], by["fsdp(ep2)"]
    assert ep2.memory.params == fsdp.memory.params
    def gathered(c: Any) -> int:
        return sum(v for k, v in c.memory.transient_parts.items() if k.startswith("all-gather"))

    # (under EP the experts are a unit of their own: one block gathered at a time, not two)
    assert "all-gather (1 block: its experts' unit and the rest, in turn)" in ep2.memory.transient_parts
    assert gathered(ep2) < gathered(fsdp)
    assert "all-to-all buffers (ep)" in ep2.memory.transient_parts
    assert ep2.time.comm_exposed_s > fsdp.time.comm_exposed_s
    # --ep pins it; the printed command sets parallel.ep and resolves as train --dry-run does.
    pinned, _ = _plan("--model", "gpt-moe-lab", "--gpus-per-node", "4", "--ep", "2")
    assert {c.layout.ep for c in pinned.candidates} == {2}
    assert {c.layout.strategy for c in pinned.candidates} <= {"fsdp", "fsdp+tp"}
    for cmd in pinned.commands:
        assert "--set parallel.ep=2" in cmd and "model.preset=moe-lab" in cmd
    train, torchrun = pinned.commands
    assert dry_run_train(train) == (pinned.recommended.layout.strategy, 4) == dry_run_torchrun(torchrun)
    tp_cmd = next(c for c in pinned.candidates if c.layout.tp > 1)
    assert tp_cmd.layout.sequence_parallel  # MoE runs with sequence parallel (parallel/tensor/plans.py)


def test_ep_over_dp_shard_x_cp_is_planned_and_dry_runs_and_ep_over_tp_is_refused_by_name():
    # 4 GPUs, cp 2: dp_shard 2, and ep 4 borrows the cp ranks too (torchtitan's ep over dp_shard x cp).
    plan, _ = _plan("--model", "gpt-moe-lab", "--gpus-per-node", "4", "--seq", "16384", "--cp", "2", "--ep", "4")
    best = plan.recommended.layout
    assert (best.ep, best.cp, best.shard // best.cp) == (4, 2, 2) and best.ep > best.shard // best.cp
    assert not any(line.startswith("ep4") for line in plan.skipped), plan.skipped
    train, torchrun = plan.commands
    assert "--set parallel.cp=2" in train and "--set parallel.ep=4" in train
    assert dry_run_train(train) == (best.strategy, 4) == dry_run_torchrun(torchrun)
    # The all-to-all moves each rank's own sequence chunk: seq / cp tokens (plan/moe.py).
    mem = plan.recommended.memory.transient_parts["all-to-all buffers (ep)"]
    assert mem == 2 * (16384 // 2) * plan.recommended.micro_batch * 2 * 384 * 2  # send + receive, top-2, bf16
    # The open search finds it as well: ep up to dp_shard x cp.
    assert {(s["cp"], s["ep"]) for s in degree_sets(model_preset("gpt-moe-lab"), Cluster(gpu("h100"), gpus_per_node=4),
                                                   seq=16384) if s["tp"] == 1} >= {(2, 4), (4, 4)}
    # ep over tensor-parallel ranks (Megatron's expert-tensor-parallel): refused before launch, by name.
    plan = plan_cli.build_plan(plan_args("--model", "gpt-moe-lab", "--gpus-per-node", "4", "--tp", "2", "--ep", "4"))
    assert not plan.candidates and plan.recommended is None and not plan.commands
    assert any("fsdp+tp(tp2,ep4)" in line and "expert-tensor-parallel" in line and "not implemented" in line
               for line in plan.skipped), plan.skipped


@pytest.mark.parametrize("world,tp,pp,cp,experts", [
    (4, 1, 1, 2, 8), (8, 2, 1, 2, 8), (8, 1, 2, 2, 4), (16, 2, 2, 2, 16), (8, 1, 1, 4, 6)])
def test_planner_and_runtime_allow_the_same_ep_degrees(world, tp, pp, cp, experts):
    """Ask both: the ep degrees the planner plans a layout for (pinned --tp/--pp/--cp/--ep) and
    those some strategy of the runtime resolves (resolve_layout) for an MoE layer of ``experts``."""
    from shardwise.core.config import ParallelConfig
    from shardwise.core.layout import ep_degrees, resolve_layout
    from shardwise.core.strategies import REGISTRY
    from shardwise.plan.advice import candidate_layouts

    base = model_preset("gpt-moe-lab")
    spec = dataclasses.replace(base, moe=dataclasses.replace(base.moe, n_experts=experts))
    cluster = Cluster(gpu("h100"), gpus_per_node=min(world, 8), nodes=max(1, world // 8))
    work = Workload(seq=16384, micro_batch=1, global_batch=64, checkpoint="full")

    def planner(ep: int) -> bool:
        try:
            layouts, _ = candidate_layouts(spec, cluster, work, tp=tp, pp=pp, cp=cp, ep=ep)
        except ConfigError:
            return False
        return bool(layouts)

    def runtime(ep: int) -> bool:
        for name in REGISTRY:
            try:
                resolve_layout(ParallelConfig(strategy=name, tp=tp, pp=pp, cp=cp, ep=ep, pp_microbatches=8 if pp > 1
                                              else 0), world, ranks_per_node=cluster.gpus_per_node,
                               n_blocks=spec.n_layers)
            except ConfigError:
                continue
            return ep in ep_degrees(experts)  # the runtime's expert-count check (parallel/experts/ep.py)
        return False

    degrees = range(1, world + 1)
    allowed = {ep for ep in degrees if planner(ep)}
    assert allowed == {ep for ep in degrees if runtime(ep)}
    assert max(allowed) == max(d for d in ep_degrees(experts) if (world // (tp * pp)) % d == 0)  # dp_shard x cp


def test_tp_keeps_moe_routers_and_experts_whole():
    """What parallel/tensor/tp.py does to an MoE block, the planner counts: attention splits over the TP
    ranks (the row-parallel output projection on its input columns, the rest on their rows), the router
    and the routed experts stay whole on each (expert parallel splits them)."""
    from shardwise.plan.memory import _local_params

    for name in ("gpt-moe-nano", "mixtral-8x7b"):
        spec = model_preset(name)
        local = {p.name: p.shape for p in _local_params(spec, Layout("fsdp+tp", dp=1, tp=2), 0)}
        for p in spec.params:
            whole = any(part in p.name for part in (".router.", ".mlp.gate.", ".experts.")) or len(p.shape) < 2
            if whole:
                assert local[p.name] == p.shape, (name, p.name)
                continue
            dim = 1 if ".o_proj." in p.name else 0
            split = tuple(-(-n // 2) if i == dim else n for i, n in enumerate(p.shape))
            assert local[p.name] == split, (name, p.name)


def test_moe_models_get_pipeline_layouts_where_the_runtime_cuts_them():
    """The built-in MoE GPT runs under pp (parallel/pipeline/moe.py): the search offers it, and the
    pinned command resolves as train --dry-run does; HF MoE families are cut too (parallel/pipeline/hf_moe.py)."""
    plan, _ = _plan("--model", "gpt-moe-lab", "--nodes", "2", "--gpus-per-node", "2", "--checkpoint", "none",
                    "--micro-batch", "1")
    assert {"ddp+pp(pp2)", "fsdp+pp(pp2)"} <= {c.name for c in plan.candidates}
    assert not any(c.layout.pp > 1 and c.layout.ep > 1 for c in plan.candidates)  # the layout refuses ep with pp
    pinned, _ = _plan("--model", "gpt-moe-lab", "--nodes", "2", "--gpus-per-node", "2", "--pp", "2")
    train, torchrun = pinned.commands
    assert dry_run_train(train) == (pinned.recommended.layout.strategy, 4) == dry_run_torchrun(torchrun)
    mixtral, text = _plan("--model", "mixtral-8x7b", "--nodes", "2")
    assert "fsdp+pp(pp2)" in {c.name for c in mixtral.candidates} and "no stage split" not in text
