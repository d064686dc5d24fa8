"""Every layout the planner proposes, and every command it prints, is a run the runtime accepts.

The grid: every planner preset x 1, 2, 8 and 64 nodes x every GPU kind x every checkpointing mode.
For each plan, the ``shardwise train`` command of every candidate (what ``plan`` prints when it is
the recommended one) goes through the resolution of ``shardwise train --dry-run``, in-process: the
real CLI parser, then ``job.train.resolve_run`` (config, layout, the pipeline's batch check,
``check_model`` on a meta-device copy of the model); both printed commands (that one and the
torchrun form, through the worker's own parser and ``preflight.check_run``) likewise.
The shell placeholder ``$MASTER_ADDR`` is expanded as a shell would.

Cost: each distinct model is built once on the meta device (a 405B model is built once, not per
plan) and each distinct command resolved once; the plans themselves are pure arithmetic.

Also here: regression tests for the three planner/runtime disagreements found once, and the
planner's stage split and block finding checked against the runtime's.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import shutil

import pytest
import torch

from shardwise.cli import build_parser as cli_parser
from shardwise.core.config import load_config
from shardwise.core.layout import Layout
from shardwise.core.strategies import REGISTRY
from shardwise.errors import ConfigError
from shardwise.job.train import resolve_run
from shardwise.job.worker import build_parser as worker_parser_factory
from shardwise.plan import cli as plan_cli
from shardwise.plan.advice import Cluster, Workload, evaluate, launch_commands
from shardwise.plan.memory import PRECISIONS, state_bytes
from shardwise.plan.presets import GPUS, MODEL_PRESETS, gpu, model_preset
from shardwise.plan.search import make_plan
from shardwise.plan.spec import ROOT_UNIT, from_hf_config, from_module
from shardwise.preflight import check_run, meta_model, resolve_config
from shardwise.workloads import build_workload

NODES = (1, 2, 8, 64)
CHECKPOINTS = ("none", "selective", "full")
SHELL = {"$MASTER_ADDR": "10.0.0.1"}


@functools.cache
def _plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    return parser


def plan_args(*argv: str) -> argparse.Namespace:
    return _plan_parser().parse_args(["plan", *argv])


# The real parsers, built once (argparse parsers are reusable).
build_parser = functools.cache(cli_parser)
worker_parser = functools.cache(worker_parser_factory)


def shell_words(command: str) -> list[str]:
    """The argv a POSIX shell passes for ``command`` with the placeholders set."""
    for var, value in SHELL.items():
        command = command.replace(var, value)
    return shlex.split(command, comments=True)


@functools.cache
def workload_and_meta(recipe: str, model_sets: tuple[str, ...]) -> tuple:
    """The workload and meta model of a command's [model]/[data] sections, built once per model."""
    cfg = load_config(recipe, list(model_sets))
    workload = build_workload(cfg.model, cfg.data)
    return workload, meta_model(workload)


def _model_sets(words: list[str]) -> tuple[str, ...]:
    """The command's [model] and [data] settings: what its workload is built from."""
    return tuple(words[i + 1] for i, w in enumerate(words)
                 if w == "--set" and words[i + 1].startswith(("model.", "data.")))


@functools.cache
def dry_run_train(command: str) -> tuple[str, int]:
    """Resolve a printed ``shardwise train ...`` command as ``--dry-run`` does; (strategy, world)."""
    words = shell_words(command)
    assert words[:2] == ["shardwise", "train"], command
    args = build_parser().parse_args([*words[1:], "--dry-run"])
    assert args.dry_run and args.func.__name__ == "cmd_train"
    workload, meta = workload_and_meta(args.recipe, _model_sets(words))
    assert meta is not None, f"no meta model for {command}"
    run = resolve_run(args, workload=workload, meta=meta)
    return run.layout.strategy, run.layout.world_size


@functools.cache
def dry_run_torchrun(command: str) -> tuple[str, int]:
    """Resolve a printed ``torchrun ... -m shardwise.job.worker ...`` command as each rank would."""
    words = shell_words(command)
    assert words[0] == "torchrun", command
    split = words.index("-m")
    assert words[split + 1] == "shardwise.job.worker"
    flags = dict(w.removeprefix("--").split("=", 1) for w in words[1:split] if "=" in w)
    nnodes = int(flags.get("nnodes", 1))
    if nnodes > 1:
        assert "node-rank" not in flags and flags["rdzv-endpoint"] == "10.0.0.1:29500", command
    else:
        assert "--standalone" in words[1:split], command
    nproc = int(flags["nproc-per-node"])
    args = worker_parser().parse_args(words[split + 2:])
    overrides = [*args.overrides, f"parallel.strategy={args.strategy}"]
    cfg = load_config(args.recipe, overrides)
    workload, meta = workload_and_meta(args.recipe, _model_sets(words))
    checked = check_run(cfg, nproc * nnodes, ranks_per_node=nproc, workload=workload, meta=meta)
    return checked.layout.strategy, checked.layout.world_size


def test_every_candidate_and_printed_command_resolves_over_the_grid(monkeypatch):
    # A candidate's memory does not depend on the GPU kind (only what fits does): compute it once
    # per GPU-independent input instead of once per GPU kind. Time and fit are still per plan.
    from shardwise.plan import advice

    breakdowns: dict = {}
    compute = advice.memory_breakdown

    def memory_breakdown(spec, layout, *args, **kwargs):
        # Preset specs are built once per process, so their identity is a cheap exact key.
        key = (id(spec), layout, args, tuple(sorted(kwargs.items())))
        if key not in breakdowns:
            breakdowns[key] = compute(spec, layout, *args, **kwargs)
        return breakdowns[key]

    monkeypatch.setattr(advice, "memory_breakdown", memory_breakdown)
    # The checks walk a meta model's modules (a 405B model's thousands) for every command; the meta
    # models live in workload_and_meta's cache for the whole test, so each walk is done once per model.
    from shardwise.parallel.context import cp
    from shardwise.parallel.experts import ep

    def once_per_model(walk):
        walks: dict = {}

        def cached(model):
            hit = walks.get(id(model))
            if hit is None or hit[0] is not model:
                hit = walks[id(model)] = (model, walk(model))
            return hit[1]
        return cached

    monkeypatch.setattr(ep, "_moe_layers", once_per_model(ep._moe_layers))
    monkeypatch.setattr(cp, "_attention_modules", once_per_model(cp._attention_modules))
    # The NVMe offload commands check the swap disk's free space: give this machine a large one
    # (the plan is for the cluster's nodes, not for the machine the test runs on).
    from shardwise.parallel.deepspeed import setup as deepspeed_setup

    monkeypatch.setattr(deepspeed_setup.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**60, 0, 2**60))
    plans = checked = 0
    for model in MODEL_PRESETS:
        for nodes in NODES:
            for kind in GPUS:
                for ckpt in CHECKPOINTS:
                    plan = plan_cli.build_plan(plan_args("--model", model, "--gpu", kind, "--nodes", str(nodes),
                                                         "--checkpoint", ckpt))
                    plans += 1
                    assert plan.candidates, (model, nodes, kind, ckpt)
                    if plan.recommended:
                        assert len(plan.commands) == 2
                    elif plan.commands:
                        # Nothing fits on the GPUs but an offload engine does: one `train` command
                        # for the fastest offload row, which the runtime must accept too.
                        (offload_cmd,) = plan.commands
                        assert dry_run_train(offload_cmd) == (plan.offload[0].strategy, plan.cluster.world)
                    else:
                        assert not plan.offload
                    for cand in plan.candidates:
                        assert cand.layout.strategy in REGISTRY
                        train, _ = launch_commands(cand, plan.cluster, plan.workload, run_name=model)
                        assert dry_run_train(train) == (cand.layout.strategy, plan.cluster.world), train
                        checked += 1
                    if plan.recommended:
                        train, torchrun = plan.commands
                        want = (plan.recommended.layout.strategy, plan.cluster.world)
                        assert dry_run_train(train) == want == dry_run_torchrun(torchrun), torchrun
    assert plans == len(MODEL_PRESETS) * len(NODES) * len(GPUS) * len(CHECKPOINTS)
    # Commands are shared between plans (GPU kinds change what fits, not what runs): each
    # distinct one was resolved once.
    assert dry_run_train.cache_info().currsize > 100 and checked > plans


# ------------------------------------------------ the planner/runtime disagreements found once
def test_planner_never_proposes_a_strategy_the_registry_rejects():
    # Was: `ddp+tp+pp(...)` candidates, "unknown strategy 'ddp+tp+pp'" at launch.
    plan = make_plan(model_preset("gpt-lab"), Cluster(gpu("h100"), gpus_per_node=2, nodes=3),
                     Workload(seq=256, global_batch=24))
    names = {c.layout.strategy for c in plan.candidates}
    assert "fsdp+tp+pp" in names and "ddp+tp+pp" not in names and names <= set(REGISTRY)


def test_llama3_70b_on_4x8_h100_prints_commands_the_runtime_accepts():
    # Was: train.micro_batch_size=1 with parallel.pp_microbatches=32, refused by the pipeline.
    plan = plan_cli.build_plan(plan_args("--model", "llama-3-70b", "--gpu", "h100", "--nodes", "4", "--seq", "4096",
                                         "--global-batch", "64", "--checkpoint", "full"))
    assert plan.commands, plan.warnings
    train, torchrun = plan.commands
    assert "--set model.hf_config=llama-3-70b" in train and "RECIPE" not in train
    assert train.endswith("--nnodes 4 --rdzv-endpoint $MASTER_ADDR:29500")  # no --node-rank, no --out needed
    assert dry_run_train(train)[1] == dry_run_torchrun(torchrun)[1] == 32
    # The settings the old planner printed fail in preflight now, before any rank starts.
    cfg = load_config("gpt-shakespeare", ["parallel.strategy=ddp+pp", "parallel.pp=4", "train.micro_batch_size=1",
                                          "parallel.pp_microbatches=32"])
    with pytest.raises(ConfigError, match="per-rank batch of 1 samples"):
        resolve_config(cfg, 32)


def test_a_sharded_candidate_that_only_fits_reducing_every_microbatch_says_so():
    # Llama-3 70B, 4 x 8 H100, global batch 64 = 2 micro-batches per replica: syncing once per step
    # (no_sync) would keep a whole unsharded fp32 gradient (282 GiB) alive between micro-batches.
    plan = plan_cli.build_plan(plan_args("--model", "llama-3-70b", "--gpu", "h100", "--nodes", "4", "--seq", "4096",
                                         "--global-batch", "64", "--checkpoint", "full", "--micro-batch", "1"))
    best = plan.recommended
    assert best is not None and best.grad_sync == "microbatch" and best.grad_accum == 2
    step_wise = evaluate(plan.spec, plan.cluster, plan.workload, best.layout)
    assert not step_wise.fits and step_wise.memory.total > 3 * best.memory.total
    assert "--set parallel.grad_sync=microbatch" in plan.commands[0]
    cfg = load_config("hf-shakespeare", ["model.hf_config=llama-3-70b", "parallel.grad_sync=microbatch"])
    assert cfg.parallel.grad_sync == "microbatch"


def test_pipeline_commands_split_each_batch_into_the_planned_microbatches():
    plan = make_plan(model_preset("gpt-lab"), Cluster(gpu("h100"), gpus_per_node=2, nodes=2),
                     Workload(seq=256, micro_batch=2, global_batch=32, recipe="gpt-shakespeare",
                              extra_sets=("model.preset=lab",)), pp=2)
    for cand in plan.candidates:
        sets = dict(s.split("=", 1) for s in
                    shell_words(launch_commands(cand, plan.cluster, plan.workload)[0])[2:] if "=" in s)
        m, mbs = int(sets["parallel.pp_microbatches"]), int(sets["train.micro_batch_size"])
        # Planned: grad_accum micro-batches of 2 sequences per replica; run: one schedule of them.
        assert m == cand.grad_accum == cand.layout.pp_microbatches and mbs == 2 * m
        assert int(sets["train.grad_accum_steps"]) == 1 and mbs * cand.layout.dp == 32


def test_too_few_microbatches_for_the_pipeline_is_skipped_with_the_reason():
    plan = make_plan(model_preset("gpt-lab"), Cluster(gpu("h100"), gpus_per_node=2, nodes=4),
                     Workload(seq=256, global_batch=2), pp=4)
    assert not plan.candidates
    assert any("need at least 4 micro-batches per step" in s for s in plan.skipped)


def test_interleaved_pipeline_from_the_plan_cli():
    fixed = ("--micro-batch", "1", "--checkpoint", "none")  # the same settings for both plans
    plan = plan_cli.build_plan(plan_args("--model", "gpt-lab", "--gpus-per-node", "1", "--nodes", "2", "--pp", "2",
                                         "--global-batch", "8", "--pp-schedule", "interleaved-1f1b",
                                         "--pp-stages-per-rank", "3", *fixed))
    lay = plan.recommended.layout
    assert (lay.pp_schedule, lay.pp_stages_per_rank, lay.n_stages) == ("interleaved-1f1b", 3, 6)
    assert [len(r) for r in lay.stage_ranges] == [1] * 6
    assert "--set parallel.pp_stages_per_rank=3" in plan.commands[0]
    assert dry_run_train(plan.commands[0]) == ("pp", 2)
    # The cost model reads the layout's stages per rank: 3 interleaved stages shrink the bubble.
    one = plan_cli.build_plan(plan_args("--model", "gpt-lab", "--gpus-per-node", "1", "--nodes", "2", "--pp", "2",
                                        "--global-batch", "8", *fixed))
    assert plan.recommended.time.bubble_s == pytest.approx(one.recommended.time.bubble_s / 3)
    with pytest.raises(ConfigError, match="--pp-stages-per-rank >= 2"):
        plan_cli.build_plan(plan_args("--model", "gpt-lab", "--pp-schedule", "interleaved-1f1b",
                                      "--pp-stages-per-rank", "1"))
    # Left out, the stages per rank are searched: the chosen value is in the name and the command.
    searched = plan_cli.build_plan(plan_args("--model", "gpt-lab", "--gpus-per-node", "1", "--nodes", "2", "--pp", "2",
                                             "--global-batch", "8", "--pp-schedule", "interleaved-1f1b", *fixed))
    v = searched.recommended.layout.pp_stages_per_rank
    assert v >= 2 and searched.recommended.name == f"pp(pp2,v{v})"
    assert f"--set parallel.pp_stages_per_rank={v}" in searched.commands[0]
    assert dry_run_train(searched.commands[0]) == ("pp", 2)
    # The search weighs the bubble against the messages: each stage per rank more shrinks the bubble
    # and adds two boundaries to cross per micro-batch (core.pp_schedules.p2p_messages_per_step).
    assert searched.recommended.time.step_s <= plan.recommended.time.step_s


def test_end_stage_and_sequence_parallel_settings_from_the_plan_cli():
    """``plan --pp-first-stage-fewer K`` and ``--sequence-parallel off`` are the runtime's settings (the
    calibration's rows use them): planned with, printed in the command, and resolved by train --dry-run."""
    base = ("--model", "gpt-lab", "--gpus-per-node", "2", "--nodes", "4", "--pp", "4", "--global-batch", "16",
            "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "2", "--micro-batch", "1",
            "--checkpoint", "none")
    # 8 stages, 6 layers, ends not lighter: not offered, with the reason.
    refused = plan_cli.build_plan(plan_args(*base, "--pp-first-stage-fewer", "0"))
    assert not refused.candidates and any("exceed the model's 6 layers" in s for s in refused.skipped)
    plan = plan_cli.build_plan(plan_args(*base, "--pp-first-stage-fewer", "1"))
    assert plan_cli.build_plan(plan_args(*base)).recommended.layout == plan.recommended.layout  # searched: found
    lay = plan.recommended.layout
    assert [len(r) for r in lay.stage_ranges] == [0, 1, 1, 1, 1, 1, 1, 0]  # the ends hold no layer
    assert "--set parallel.pp_first_stage_fewer=1" in plan.commands[0]
    assert dry_run_train(plan.commands[0])[1] == 8
    with pytest.raises(ConfigError, match="use at most 8"):
        plan_cli.build_plan(plan_args("--model", "gpt-lab", "--pp", "9", "--pp-first-stage-fewer", "1"))
    sp = plan_cli.build_plan(plan_args("--model", "llama-3-8b", "--tp", "2", "--sequence-parallel", "off"))
    assert all(not c.layout.sequence_parallel for c in sp.candidates if c.layout.tp > 1)
    assert "--set parallel.sequence_parallel=false" in sp.commands[0]
    assert dry_run_train(sp.commands[0])[1] == 8


def test_hf_moe_models_are_planned_with_a_pinned_pipeline():
    # Mixtral has a stage split (parallel/pipeline/hf_moe.py): a pinned --pp is planned, not refused.
    plan = plan_cli.build_plan(plan_args("--model", "mixtral-8x7b", "--nodes", "2", "--pp", "2"))
    assert plan.candidates and all(c.layout.pp == 2 for c in plan.candidates)


def test_gpt2_pipeline_candidates_pass_train_dry_run_and_v_schedules_are_refused_for_its_tied_head():
    # GPT-2 has a stage split (parallel/pipeline/gpt2.py) and ties its head: pp is offered with 1F1B; a V
    # schedule under a data-parallel wrapper is not (pp_schedules.tied_weights_refusal, the runtime's rule).
    plan = plan_cli.build_plan(plan_args("--model", "gpt2", "--gpus-per-node", "2", "--pp", "2"))
    assert plan.recommended.layout.pp == 2
    assert dry_run_train(plan.commands[0])[1] == 2
    zbv = plan_cli.build_plan(plan_args("--model", "gpt2", "--gpus-per-node", "2", "--nodes", "2", "--pp", "2",
                                        "--pp-schedule", "zbv"))
    assert all(c.layout.strategy == "pp" for c in zbv.candidates)
    assert any("puts the first and the last pipeline stage on one rank" in s for s in zbv.skipped)


def test_gpt2_tensor_parallel_candidates_pass_train_dry_run():
    # GPT-2 has a TP plan (parallel/tensor/gpt2.py): the planner offers tp, and its command resolves.
    plan = plan_cli.build_plan(plan_args("--model", "gpt2", "--tp", "2"))
    assert plan.recommended.layout.tp == 2
    assert "--set parallel.tp=2" in plan.commands[0]
    strategy, world = dry_run_train(plan.commands[0])
    assert "tp" in strategy and world == 8


def test_planner_stage_split_and_blocks_are_the_runtimes():
    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.parallel.blocks import find_blocks
    from shardwise.parallel.pipeline.pp import prune_to_stages

    spec = model_preset("gpt-lab")
    layout = Layout("pp", pp=2, pp_schedule="interleaved-1f1b", pp_stages_per_rank=2, pp_first_stage_fewer=1)
    assert [len(r) for r in layout.with_blocks(6).stage_ranges] == [1, 2, 2, 1]
    fp32 = PRECISIONS["fp32"]
    for pp_rank in range(2):
        with torch.device("meta"):
            stage_model = prune_to_stages(GPT(GPT_PRESETS["lab"]), layout.stage_ids(pp_rank),
                                          list(layout.with_blocks(6).stage_ranges))
        held = sum(p.numel() for p in stage_model.parameters())
        assert state_bytes(spec, layout, fp32, "sgd", rank=0, stage=pp_rank).params == 4 * held
    # Blocks: the planner's units are the runtime's find_blocks container, for the GPT and an HF model.
    pytest.importorskip("transformers")
    from shardwise.models.hf import build_hf_model

    for model in (GPT(GPT_PRESETS["nano"]), build_hf_model("llama-tiny")):
        blocks = find_blocks(model)
        spec = from_module(model)
        assert spec.n_layers == len(blocks) and blocks.path in ("blocks", "hf.model.layers")
        for p in spec.params:
            inside = [i for i, key in enumerate(blocks.names) if p.name.startswith(f"{blocks.path}.{key}.")]
            assert p.unit == (inside[0] if inside else ROOT_UNIT), p.name


def test_bundled_preset_configs_are_the_presets():
    for name in MODEL_PRESETS:
        preset = model_preset(name)
        if preset.family == "gpt":
            continue  # shardwise's own GPTs are built by model.preset, not a config.json
        bundled = from_hf_config(name)
        assert bundled.params == preset.params and bundled.n_params == preset.n_params, name
        assert bundled.name == name


@pytest.mark.parametrize("name", ["gpt-nano", "gpt-lab"])
def test_gpt_spec_without_torch_equals_the_module(name):
    from shardwise.models.gpt import GPT, GPT_PRESETS

    with torch.device("meta"):
        module = GPT(GPT_PRESETS[name.removeprefix("gpt-")])
    spec, real = model_preset(name), from_module(module)
    assert [(p.name, p.shape, p.unit) for p in spec.params] == [(p.name, p.shape, p.unit) for p in real.params]


def test_plan_refuses_moe_checkpointing_for_a_dense_model():
    """``--checkpoint moe`` recomputes MoE layers: a dense model gets the message (as ``train`` gives), not a plan."""
    with pytest.raises(ConfigError, match="--checkpoint moe recomputes the mixture-of-experts layers, but "
                                          "llama-3-8b is dense"):
        plan_cli.build_plan(plan_args("--model", "llama-3-8b", "--gpus-per-node", "8", "--checkpoint", "moe"))
    moe = plan_cli.build_plan(plan_args("--model", "mixtral-8x7b", "--gpus-per-node", "8", "--nodes", "8",
                                        "--checkpoint", "moe"))
    assert moe.recommended is not None and moe.recommended.checkpoint == "moe"
