"""The ``shardwise plan`` sub-command: arguments in, a table (or JSON) and a recommendation out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from importlib import resources

from shardwise.core.config import DataConfig, load_raw, parse_loss_chunks, parse_override
from shardwise.core.families import FAMILIES, RECORD_KINDS
from shardwise.core.pp_schedules import PP_SCHEDULES, schedule_info
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.models.hf_config import bundled_configs
from shardwise.plan import finetune, offload, presets, spec
from shardwise.plan.advice import (
    GIB,
    RUNTIME_RESERVE_GIB,
    TRAIN_PRECISION,
    Candidate,
    Cluster,
    Plan,
    Workload,
    runtime_batch,
)
from shardwise.plan.cost import flops_per_token
from shardwise.plan.cpu_target import cpu_target
from shardwise.plan.memory import (
    CHECKPOINT_MODES,
    GRAD_SYNC_MODES,
    OPTIMIZERS,
    PRECISIONS,
    TRAIN_SPELLINGS,
    StateBytes,
    staging_host_bytes,
)
from shardwise.plan.optim_state import muon_cost, muon_line
from shardwise.plan.predict import RunPrediction, predict_run
from shardwise.plan.preference import OBJECTIVES, REFERENCES, reference_for
from shardwise.plan.search import device_gib, gib, make_plan, runtime_refusal, searched, tps
from shardwise.plan.stacks import STACK_KEYS, stack_settings
from shardwise.rehearse.plan import format_rows, rehearse_candidates


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` sub-command to the main CLI's sub-parsers."""
    p = subparsers.add_parser(
        "plan", help="will it fit, and how should I split it? (pure arithmetic, no GPUs needed)",
        description="Predict per-GPU memory and step time for every parallel strategy and recommend one.")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (give exactly one)")
    m.add_argument("--model", "--preset", dest="model", metavar="NAME",
                   help=f"built-in model: {', '.join(presets.MODEL_PRESETS)}")
    m.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json, its folder or a bundled name "
                   "(every family in shardwise.core.families)")
    m.add_argument("--model-factory", metavar="MODULE:FUNCTION",
                   help="a function returning an nn.Module; called on the meta device")
    m.add_argument("--pretrained", metavar="DIR",
                   help="a local Hugging Face model folder (config.json + safetensors) to fine-tune: the commands "
                   "run the hf-finetune recipe on it (hf-sft with --data FILE of chat or prompt/response records)")
    m.add_argument("--params", type=float, metavar="N", help="a bare parameter count (e.g. 7e9)")
    m.add_argument("--layers", type=int, help="with --params: number of blocks")
    m.add_argument("--hidden", type=int, help="with --params: hidden size")
    m.add_argument("--heads", type=int, help="with --params: attention heads")
    m.add_argument("--vocab", type=int, help="with --params: vocabulary size")
    f = p.add_argument_group("fine-tuning")
    f.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="with --pretrained: LoRA adapters of this rank on the frozen model (lora.rank)")
    f.add_argument("--lora-targets", nargs="+", default=(), metavar="NAME",
                   help="modules that get adapters (lora.targets; default: peft's for the model family)")
    p.add_argument("--rehearse", nargs="?", type=int, const=1, default=0, metavar="K",
                   help="rehearse the top K recommendations (default 1) at full size on this machine, on fake "
                   "tensors, and print each one's measured peak beside the plan's (shardwise rehearse)")
    f.add_argument("--data", metavar="FILE",
                   help="with --pretrained: the data the run trains on (data.path); chat or prompt/response "
                   "records make the commands run the hf-sft recipe, text the hf-finetune one")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", default=None, help=f"GPU kind: {', '.join(presets.GPUS)} (default h100-sxm), or cpu: "
                   "this machine's CPU ranks over gloo (its measured matmul rate, its memory shared by the ranks)")
    c.add_argument("--gpu-spec", metavar="FILE",
                   help="a TOML/JSON file describing a GPU not in the catalog (keys: "
                   f"{', '.join(presets.GPU_SPEC_KEYS)}; 'base' names a catalog GPU to start from)")
    c.add_argument("--gpu-memory-gib", type=float, metavar="GIB",
                   help="override the GPU's memory (e.g. 94 for an H100 NVL, 96 for H100 96GB HBM2e)")
    c.add_argument("--gpu-tflops", type=float, metavar="TFLOPS",
                   help="override the GPU's dense bf16 peak (e.g. a power-limited part)")
    c.add_argument("--gpus-per-node", "--nproc", type=int, default=None,
                   help="GPUs (ranks) per node (default 8; with --gpu cpu: the ranks train would start here)")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--intra-link", help=f"intra-node link preset: {', '.join(presets.LINKS)}")
    c.add_argument("--inter-link", help="inter-node link preset (same names)")
    c.add_argument("--intra-gbs", type=float, help="override intra-node GB/s per GPU per direction")
    c.add_argument("--inter-gbs", type=float, help="override inter-node GB/s per GPU per direction")
    c.add_argument("--host-ram-gib", type=float, help="host RAM per node, for fsdp-offload")
    c.add_argument("--nvme-gbs", type=float, help="NVMe GB/s per GPU, for zero3-nvme when nothing fits on the GPUs "
                   "(default: the GPU kind's servers, plan.offload)")
    w = p.add_argument_group("workload")
    w.add_argument("--seq", type=int, help="sequence length (default: the model's context, at most 8192)")
    w.add_argument("--micro-batch", type=int,
                   help="sequences per GPU per micro-batch (default: searched, the global batch held fixed)")
    w.add_argument("--global-batch", type=int, help="sequences per optimizer step (default micro-batch x GPUs)")
    w.add_argument("--grad-accum", type=int, help="micro-batches per step (instead of --global-batch)")
    w.add_argument("--precision", default=None,
                   help=f"{', '.join(PRECISIONS)}, or train's spellings {', '.join(TRAIN_SPELLINGS)} "
                        "(default bf16; fp32 on --gpu cpu)")
    w.add_argument("--optimizer", default=None,
                   help=f"{', '.join(OPTIMIZERS)} (default adamw; where AdamW fits at no layout, the plan "
                   "says so and plans adafactor, unless --optimizer is given)")
    w.add_argument("--objective", choices=OBJECTIVES, default=None,
                   help="lm (next-token loss) or dpo (preference tuning of a --pretrained folder: the batch sizes "
                   "count pairs, two sequences each, and the reference model is planned; default: dpo when --data "
                   "holds preference records, else lm)")
    w.add_argument("--dpo-reference", choices=REFERENCES, default=None,
                   help="with --objective dpo: how the reference is held (default: adapters with --lora, else a "
                   "frozen copy sharded like the policy; precomputed: its log-probs scored once before training)")
    w.add_argument("--checkpoint",
                   help=f"activation checkpointing: {', '.join(CHECKPOINT_MODES)} "
                   "(as parallel.activation_checkpointing; default: searched per layout)")
    w.add_argument("--grad-sync", choices=GRAD_SYNC_MODES,
                   help="when sharded gradients are reduced under accumulation: once per step (no_sync) or every "
                   "micro-batch (parallel.grad_sync; default: searched per layout)")
    w.add_argument("--compile", action="store_true", help="torch.compile each block (train.compile) in the commands")
    w.add_argument("--ac-every", type=int, default=2,
                   help="with --checkpoint selective: checkpoint every k-th block (parallel.ac_every, default 2)")
    w.add_argument("--attention", default="sdpa", help="sdpa (flash/efficient, default) or math")
    w.add_argument("--tp", type=int, help="only consider this tensor-parallel degree")
    w.add_argument("--pp", type=int, help="only consider this pipeline-parallel degree")
    w.add_argument("--cp", type=int, help="only consider this context-parallel degree (parallel.cp; default: "
                   "searched from --seq 8192 on)")
    w.add_argument("--cp-impl", default="auto", choices=("auto", "alltoall", "ring"),
                   help="how context parallel runs (parallel.cp_impl): alltoall (Ulysses: heads divisible by cp), "
                   "ring (K/V blocks passed around the cp ranks; sequence a multiple of 2 x cp; no head rule) or "
                   "auto (the runtime's: alltoall, and ring for a cp degree the heads refuse the all-to-all)")
    w.add_argument("--ep", type=int, help="only consider this expert-parallel degree for a mixture-of-experts "
                   "model (parallel.ep; default: searched)")
    w.add_argument("--loss-chunks", default="auto", metavar="auto|0|N",
                   help="the chunked loss as train.loss_chunks: auto (the runtime's default: on where the "
                   "vocabulary dwarfs the hidden size), 0 (off) or N chunks per micro-batch")
    w.add_argument("--pp-schedule", default="1f1b", choices=PP_SCHEDULES,
                   help="pipeline schedule of the pipeline candidates (default 1f1b)")
    w.add_argument("--pp-stages-per-rank", type=int, metavar="V",
                   help="pipeline stages per rank (interleaved/looped schedules: 2 or more, searched when "
                   "left out; shrinks the bubble V times; V-shaped schedules: 2)")
    w.add_argument("--pp-first-stage-fewer", type=int, metavar="K",
                   help="parallel.pp_first_stage_fewer of the pipeline candidates: the embedding and the head + "
                   "loss each take K blocks' place in the stage split, so the end stages hold K blocks fewer "
                   "(and may hold none; default: 0 and 1 searched per layout)")
    w.add_argument("--sequence-parallel", default="on", choices=("on", "off"),
                   help="parallel.sequence_parallel of the tensor-parallel candidates (default on, the runtime's)")
    w.add_argument("--stack", default="shardwise", help="whose training stack the times and memory describe "
                   "(plan/stacks.py): shardwise (default), torchtitan, megatron or deepspeed; the printed "
                   "commands always run shardwise")
    w.add_argument("--stack-set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"one stack property alone (repeatable): {', '.join(STACK_KEYS)} (plan.memory.Kernels "
                   "says what each means; ep_groups: which ranks expert groups come from, dp-shard, dp or tp-dp)")
    w.add_argument("--margin", type=float, default=0.10, help="safety margin on usable memory (default 0.10)")
    w.add_argument("--recipe", help="recipe (built-in name or TOML) for the printed commands (default: "
                   "gpt-shakespeare for the built-in GPTs and --model-factory, hf-shakespeare for Hugging Face "
                   "models); the commands still select the planned model with --set")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _spec_from_args(args: argparse.Namespace) -> spec.ModelSpec:
    """The ModelSpec named by exactly one model source flag."""
    given = [k for k in ("model", "hf_config", "model_factory", "pretrained", "params") if getattr(args, k) is not None]
    if len(given) != 1:
        flags = ", ".join("--" + k.replace("_", "-") for k in given) or "none"
        raise ConfigError(f"give exactly one model source (--model, --hf-config, --model-factory, --pretrained or "
                          f"--params); got {flags}. Built-in models: {', '.join(presets.MODEL_PRESETS)}.")
    if (args.lora or args.lora_targets) and args.pretrained is None:
        raise ConfigError("--lora trains adapters on a frozen pretrained model: give the model folder with "
                          "--pretrained DIR (a local Hugging Face folder with config.json and safetensors).")
    if args.pretrained is not None:
        return finetune.pretrained_spec(args.pretrained, args.lora, tuple(args.lora_targets))
    if args.model is not None:
        return presets.model_preset(args.model)
    if args.hf_config is not None:
        return spec.from_hf_config(args.hf_config)
    if args.model_factory is not None:
        return spec.from_factory(args.model_factory)
    return spec.from_param_count(int(args.params), n_layers=args.layers, hidden=args.hidden, n_heads=args.heads,
                                 vocab=args.vocab)


def run_target(args: argparse.Namespace, model: spec.ModelSpec, seq: int) -> tuple[str, tuple[str, ...], list[str]]:
    """(recipe, --set overrides, warnings) that make ``shardwise train`` build the planned model.

    The overrides name the model itself (``model.kind`` plus the preset, the bundled or given
    config.json, or the factory) and the planned sequence length, so a command runs as printed with
    any recipe. A bare parameter count names no model: no recipe, no command.
    """
    warnings: list[str] = []
    if args.objective == "dpo" and args.pretrained is None:
        raise ConfigError("--objective dpo plans preference tuning of a pretrained model: give its folder with "
                          "--pretrained DIR (an SFT export, for instance).")
    if args.pretrained is not None:
        recipe, sets, warnings = finetune.finetune_sets(
            args.pretrained, seq, args.lora, tuple(args.lora_targets), data=args.data,
            recipe=args.recipe or (finetune.DPO_RECIPE if args.objective == "dpo" else ""))
        if dpo_objective(args, recipe) and args.dpo_reference == "precomputed":
            sets += ("preference.precompute_reference=true",)
        return recipe, sets, warnings
    if args.data is not None:
        raise ConfigError("--data names the records or text a fine-tune trains on: give the model folder with "
                          "--pretrained DIR too.")
    if args.model is not None and model.family == "gpt":  # shardwise's own Shakespeare GPTs
        sets = ["model.kind=gpt", f"model.preset={model.name.removeprefix('gpt-')}"]
        if model.max_seq and seq != model.max_seq:
            sets.append(f"model.overrides.block_size={seq}")
        return args.recipe or "gpt-shakespeare", tuple(sets), warnings
    config = model.name if args.model is not None else args.hf_config
    if args.model is not None and model.name not in bundled_configs():
        warnings.append(f"{model.name} has no bundled config.json, so no command is printed.")
        return "", (), warnings
    if config is not None:
        sets = ["model.kind=hf", f"model.hf_config={config}", f"model.overrides.block_size={seq}"]
        if model.max_seq and seq > model.max_seq:
            # From scratch, the positions are the user's to choose: train refuses a block_size above them.
            positions = "n_positions" if model.family == "gpt2" else "max_position_embeddings"
            sets.append(f"model.overrides.{positions}={seq}")
        if args.recipe is None:
            sets += _bundled_text_sets(seq)
        return args.recipe or "hf-shakespeare", tuple(sets), warnings
    if args.model_factory is not None:
        warnings.append("the printed commands train the factory's model on the recipe's data, whose sequence "
                        "length comes from model.overrides.block_size (default 128), not --seq; pass your own "
                        "recipe with --recipe to train on your data.")
        return args.recipe or "gpt-shakespeare", ("model.kind=custom", f"model.factory={args.model_factory}"), warnings
    return "", (), warnings


def _bundled_text_sets(seq: int) -> list[str]:
    """``data.val_fraction`` for the default recipe's bundled Tiny Shakespeare where its default
    validation tenth is shorter than one window of ``seq`` + 1 characters (from --seq ~111k on;
    data/shakespeare.py splits the text so), so that the printed command runs as printed."""
    n_chars = len((resources.files("shardwise") / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8"))
    default = DataConfig().val_fraction
    if n_chars - int(n_chars * (1 - default)) > seq:
        return []
    fraction = math.ceil(100 * (seq + 2) / n_chars) / 100  # one window, rounded up to a whole percent
    return [f"data.val_fraction={fraction:g}"] if int(n_chars * (1 - fraction)) > seq else []


def dpo_objective(args: argparse.Namespace, recipe: str) -> bool:
    """Whether the plan is for DPO: --objective dpo, or (left out) the hf-dpo recipe the data chose."""
    return args.objective == "dpo" or (args.objective is None and recipe == finetune.DPO_RECIPE)


def gpu_from_args(args: argparse.Namespace) -> presets.GPU:
    """The GPU: --gpu-spec FILE or --gpu KIND (not both), then --gpu-memory-gib / --gpu-tflops."""
    if args.gpu_spec and args.gpu:
        raise ConfigError("give either --gpu or --gpu-spec, not both (a spec file can start from a catalog "
                          "GPU with base = \"h100-sxm\").")
    if is_cpu_target(args):
        return presets.customize_gpu(cpu_target(args.gpus_per_node), memory_gib=args.gpu_memory_gib,
                                     tflops=args.gpu_tflops)
    base = presets.load_gpu_spec(args.gpu_spec) if args.gpu_spec else presets.gpu(args.gpu or "h100-sxm")
    return presets.customize_gpu(base, memory_gib=args.gpu_memory_gib, tflops=args.gpu_tflops)


def is_cpu_target(args: argparse.Namespace) -> bool:
    return (args.gpu or "").lower() == "cpu"


def _resolve_target_defaults(args: argparse.Namespace) -> None:
    """--gpus-per-node and --precision when left out: 8 GPUs and bf16, or on --gpu cpu the ranks
    ``train`` starts here and fp32 (the CPU's fast path)."""
    cpu = is_cpu_target(args)
    if args.gpus_per_node is None and not cpu:
        args.gpus_per_node = 8
    elif args.gpus_per_node is None:
        from shardwise.device import default_nproc  # torch: only a plan for this machine's CPUs asks

        args.gpus_per_node = default_nproc()
    if args.precision in TRAIN_SPELLINGS:
        args.precision = TRAIN_SPELLINGS[args.precision]
    if args.precision is None:  # what train's "auto" picks: bf16 on a GPU, fp32 on the CPU
        args.precision = "fp32" if cpu else "bf16"


def check_printable(args: argparse.Namespace, model: spec.ModelSpec, seq: int) -> None:
    """Refuse, before planning, what ``train`` would refuse in every printed command: a sequence above
    the model's positions, a pinned degree the model's family cannot use (``shardwise.core.families``)."""
    family = FAMILIES.get(model.family or "")
    if family is None:
        return
    if args.pretrained is not None and model.max_seq and seq > model.max_seq:
        # (A model trained from scratch gets its positions raised in the command: run_target.)
        raise ConfigError(f"--seq {seq} exceeds the model's max_position_embeddings={model.max_seq}; train refuses "
                          f"a longer sequence (model.overrides.block_size). Plan --seq {model.max_seq} or less.")
    pinned = {"tp": (args.tp, family.tp_plan, "tensor parallel"), "pp": (args.pp, family.pp_split, "pipeline parallel"),
              "cp": (args.cp, family.cp, "context parallel")}  # --ep: make_plan owns its checks
    for flag, (degree, supported, what) in pinned.items():
        if degree is not None and degree > 1 and not supported:
            able = [n for n, f in FAMILIES.items() if getattr(f, {"tp": "tp_plan", "pp": "pp_split", "cp": "cp"}[flag])]
            raise ConfigError(f"--{flag} {degree}: {what} does not run on the {model.family} family (model "
                              f"{model.name}); families with {what}: {', '.join(able)}. Leave --{flag} out (or "
                              f"--{flag} 1) to plan without it.")


def _trains_records(recipe: str, sets: tuple[str, ...]) -> bool:
    """Whether the printed command trains on chat/instruct records (``families.RECORD_KINDS``)."""
    given = dict(parse_override(s) for s in sets)
    return given.get("data.kind", load_raw(recipe).get("data", {}).get("kind")) in RECORD_KINDS


def build_plan(args: argparse.Namespace) -> Plan:
    """Parse the namespace into a Plan (raises ConfigError for user mistakes)."""
    _resolve_target_defaults(args)
    model = _spec_from_args(args)
    cluster = Cluster(
        gpu=gpu_from_args(args), gpus_per_node=args.gpus_per_node, nodes=args.nodes,
        intra=presets.link(args.intra_link) if args.intra_link else None,
        inter=presets.link(args.inter_link) if args.inter_link else None,
        intra_gbs=args.intra_gbs, inter_gbs=args.inter_gbs, host_ram_gib=args.host_ram_gib,
        nvme_gbs=args.nvme_gbs)
    if args.nvme_gbs is not None:
        offload.nvme_gbs_for(cluster.gpu.name, args.nvme_gbs)  # a clear error for a rate <= 0
    seq = args.seq or min(model.max_seq or 2048, 8192)
    check_printable(args, model, seq)
    recipe, sets, target_warnings = run_target(args, model, seq)
    # The stack's properties (plan/stacks.py); a grad_sync it implies counts as given.
    kernels, stack_sync = stack_settings(args.stack, args.stack_set)
    if stack_sync and args.grad_sync is None:
        args.grad_sync = stack_sync
    # What the user leaves out, the planner searches (per layout); what they give stays fixed.
    stages = schedule_info(args.pp_schedule).stages_per_rank  # "one", "two" (V) or "many" (searched)
    search = tuple(knob for knob, given in (
        ("checkpoint", args.checkpoint), ("micro_batch", args.micro_batch), ("grad_sync", args.grad_sync),
        ("pp_stages_per_rank", args.pp_stages_per_rank if stages == "many" else 1),
        # (only where a pipeline can be planned: a pinned --pp 1 or one GPU has none)
        ("pp_first_stage_fewer", args.pp_first_stage_fewer if args.pp != 1 and cluster.world > 1 else 0),
        ("optimizer", args.optimizer)) if given is None)
    work = Workload(seq=seq, micro_batch=args.micro_batch or 1, global_batch=args.global_batch, kernels=kernels,
                    grad_accum=args.grad_accum, precision=args.precision, optimizer=args.optimizer or "adamw",
                    checkpoint=args.checkpoint or "none", attention=args.attention, ac_every=args.ac_every,
                    grad_sync=args.grad_sync or "step", safety_margin=args.margin, pp_schedule=args.pp_schedule,
                    pp_stages_per_rank=args.pp_stages_per_rank or (1 if stages == "one" else 2), recipe=recipe,
                    pp_first_stage_fewer=args.pp_first_stage_fewer or 0,
                    sequence_parallel=args.sequence_parallel == "on",
                    extra_sets=sets, search=search, compile=args.compile, lora_rank=args.lora,
                    loss_chunks=parse_loss_chunks(args.loss_chunks), cp_impl=args.cp_impl,
                    objective="dpo" if dpo_objective(args, recipe) else "lm",
                    dpo_reference=args.dpo_reference or reference_for(args.lora, precompute=False))
    if args.attention not in ("sdpa", "math"):
        raise ConfigError(f"--attention must be 'sdpa' or 'math', got {args.attention!r}.")
    if args.checkpoint == "moe" and model.moe is None:  # train refuses it too (experts.ep.check_moe_model)
        raise ConfigError(f"--checkpoint moe recomputes the mixture-of-experts layers, but {model.name} is dense. "
                          "Use full, selective or selective-op (or leave --checkpoint out: searched).")
    cp, pp = args.cp, args.pp
    if model.moe is not None and recipe and _trains_records(recipe, sets):
        # train runs cp for an MoE model on records without a pipeline only (preflight: a stage has no
        # place for its chunk's real tokens, which the routers' balance needs).
        if cp is not None and cp > 1 and pp is not None and pp > 1:
            raise ConfigError(f"--cp {cp} with --pp {pp}: context parallel and pipeline parallel together do not "
                              f"run a mixture-of-experts model on chat or prompt/response records (recipe {recipe}); "
                              "each stage's routers would count the rows' padding. Pin one of the two.")
        if cp is not None and cp > 1:
            pp = 1
        elif cp is None:
            cp = 1  # proposed only when asked for (--cp): the pipeline is the planner's other way
    plan = make_plan(model, cluster, work, tp=args.tp, pp=pp, cp=cp, ep=args.ep)
    plan.warnings[:0] = target_warnings
    return plan


def run_prediction(plan: Plan) -> RunPrediction | None:
    """The recommended run's bytes per rank as ``train`` stores them (the runtime's precision: e.g.
    fp32 sharded parameters under bf16-mixed) - what ``train --dry-run`` prints and the run's
    memory ledger measures. The table's columns are the planner's general model (16-bit parameters
    plus an fp32 master copy, as Megatron and DeepSpeed keep them)."""
    c = plan.recommended
    if c is None or runtime_refusal(c.layout):  # another stack's ep or stage split: train refuses it
        return None
    w = plan.workload
    micro_batch_size, accum_steps = runtime_batch(c.layout, c.micro_batch, c.grad_accum)
    return predict_run(plan.spec, c.layout, precision=TRAIN_PRECISION[w.precision], seq=w.seq,
                       micro_batch_size=micro_batch_size, grad_accum_steps=accum_steps,
                       activation_checkpointing=c.checkpoint, ac_every=w.ac_every, grad_sync=c.grad_sync,
                       ranks_per_node=plan.cluster.gpus_per_node,
                       loss_chunks="auto" if w.loss_chunks is None else w.loss_chunks, optimizer=w.optimizer,
                       dpo_reference=w.dpo_reference if w.objective == "dpo" else None)


def _per_rank(pred: RunPrediction) -> list[dict]:
    """Per-rank bytes, ranks that hold the same grouped (a 512-rank plan stays short)."""
    groups: dict[tuple, list[int]] = {}
    by_key = {}
    for r in pred.ranks:
        key = tuple(r.to_dict().values())
        groups.setdefault(key, []).append(r.rank)
        by_key[key] = r.to_dict()
    return [{"ranks": ranks if len(ranks) <= 8 else f"{len(ranks)} ranks from {ranks[0]} to {ranks[-1]}",
             **by_key[key]} for key, ranks in groups.items()]


def _settings(c: Candidate) -> dict:
    """The settings the recommendation runs with (searched or given)."""
    return {"checkpoint": c.checkpoint, "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
            "grad_sync": c.grad_sync, "pp_stages_per_rank": c.layout.pp_stages_per_rank,
            "pp_first_stage_fewer": c.layout.pp_first_stage_fewer,
            "stage_layers": list(c.layout.stage_layers) or None, "zero1_group": c.layout.zero1_group or None,
            "cp": c.layout.cp,
            "cp_impl": c.cp_impl if c.layout.cp > 1 else None,
            "ep": c.layout.ep, "loss_chunked": c.loss_chunked, "verdict": c.verdict}


def plan_to_dict(plan: Plan) -> dict:
    s, c, w = plan.spec, plan.cluster, plan.workload
    return {
        "model": {"name": s.name, "params": s.n_params, "layers": s.n_layers, "hidden": s.hidden,
                  "heads": s.n_heads, "kv_heads": s.n_kv_heads, "ffn_hidden": s.ffn_hidden, "vocab": s.vocab,
                  "flops_per_token": flops_per_token(s, w.seq)},
        "cluster": {"gpu": c.gpu.name, "gpus_per_node": c.gpus_per_node, "nodes": c.nodes,
                    "memory_gib": c.gpu.memory_gib, "usable_gib": c.usable_gib, "bf16_tflops": c.gpu.bf16_tflops,
                    "mem_bw_tbs": c.gpu.mem_bw_tbs},
        "workload": {"seq": w.seq, "micro_batch": w.micro_batch, "global_batch": w.global_batch,
                     "precision": w.precision, "optimizer": w.optimizer, "checkpoint": w.checkpoint,
                     "ac_every": w.ac_every, "grad_sync": w.grad_sync, "compile": w.compile,
                     "loss_chunks": "auto" if w.loss_chunks is None else w.loss_chunks,
                     "cp_impl": w.cp_impl,
                     "safety_margin": w.safety_margin, "searched": list(searched(w))},
        "calibration": dataclasses.asdict(plan.calibration),
        "candidates": [cand.to_dict() for cand in plan.candidates],
        "recommended": plan.recommended.name if plan.recommended else None,
        "recommended_settings": _settings(plan.recommended) if plan.recommended else None,
        "recommended_per_rank": _per_rank(pred) if (pred := run_prediction(plan)) else None,
        "rejected": plan.rejected, "skipped": plan.skipped, "commands": plan.commands, "warnings": plan.warnings,
        "offload": [offload.to_dict(r) for r in plan.offload],
        "muon": (dataclasses.asdict(muon_cost(s, plan.recommended.layout))
                 if w.optimizer == "muon" and plan.recommended else None),
    }


def _param_count(n: int) -> str:
    """7.000B, 124.4M, 190.3K: three significant digits or more in the unit that fits."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3f}{unit}" if unit == "B" else f"{n / size:.1f}{unit}"
    return str(n)


def _ends(fewer: int, stage_layers: tuple[int, ...] = ()) -> str:
    """The recommendation's pipeline split, where its end stages are lighter (parallel.pp_first_stage_fewer)
    or the stack sets the blocks of each stage (Kernels.pp_split)."""
    if stage_layers:
        return f", pipeline stages of {'/'.join(map(str, stage_layers))} blocks (the stack's cost-balanced split)"
    if not fewer:
        return ""
    return f", pipeline end stages {fewer} block{'s' if fewer > 1 else ''} lighter (embedding, head)"


def format_table(plan: Plan) -> str:
    """The human-readable plan: header, one row per candidate, recommendation, commands."""
    s, c, w = plan.spec, plan.cluster, plan.workload
    lines = [
        f"model {s.name}: {_param_count(s.n_params)} params"
        + (f", {s.n_layers} layers, hidden {s.hidden}, {s.n_heads} heads ({s.kv_heads} kv), vocab {s.vocab}"
           if s.has_structure else ""),
        f"cluster: {c.nodes} x {c.gpus_per_node} x {c.gpu.name} ({c.gpu.memory_gib:.0f} GiB, "
        f"{c.usable_gib * (1 - w.safety_margin):.1f} GiB budget after {RUNTIME_RESERVE_GIB:.0f} GiB reserve and "
        f"{w.safety_margin:.0%} margin)",
        f"workload: seq {w.seq}, {w.precision}, {w.optimizer}, {flops_per_token(s, w.seq) / 1e9:.2f} GFLOP/token; "
        + (f"searched per layout: {', '.join(k.replace('_', '-') for k in searched(w))}"
           if w.search else "nothing searched")
        + ("" if "micro_batch" in w.search else f"; micro-batch {w.micro_batch}")
        + ("" if "checkpoint" in w.search else f"; checkpointing {w.checkpoint}"),
    ]
    if w.objective == "dpo":
        lines.append(f"objective: dpo (micro-batches count pairs, 2 sequences each; reference: {w.dpo_reference}"
                     + {"copy": ", a frozen copy sharded like the policy in the params column, its forward in "
                                "the compute column",
                        "adapters": ": the model with its LoRA adapters off, no copy; its forward in the compute "
                                    "column",
                        "precomputed": ": log-probs scored once before training, on the host"}[w.dpo_reference]
                     + ")")
    lines.append("")
    head = ["strategy", "ckpt", "mb", "accum", "sync", "params", "grads", "optim", "master", "activ", "transient",
            "frag", "total", "verdict", "step s", "compute", "comm", "bubble", "tok/s/GPU", "MFU"]
    rows = [head]
    for cand in plan.candidates:
        m, t = cand.memory, cand.time
        rows.append([cand.name, cand.checkpoint, str(cand.micro_batch), str(cand.grad_accum), cand.grad_sync]
                    + [gib(b) for b in (m.params, m.grads, m.optimizer, m.master, m.activations,
                                        m.transient, m.fragmentation, m.total)]
                    + [cand.verdict, f"{t.step_s:.3f}", f"{t.compute_s:.3f}",
                       f"{t.comm_exposed_s:.3f}", f"{t.bubble_s:.3f}", tps(t.tokens_per_s_per_gpu),
                       f"{t.mfu:.1%}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for i, r in enumerate(rows):
        lines.append("  ".join(x.ljust(wd) if j == 0 else x.rjust(wd) for j, (x, wd) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    lines.append("(GiB per GPU; transient = all-gather/reduce-scatter/DDP buckets, recompute, pipeline "
                 "in-flight, logits+loss; frag = caching-allocator overhead; step time = compute + exposed comm "
                 "+ bubble; verdict: fits the budget, tight = over the budget but within the device's memory, "
                 "no = above it; ckpt/mb/sync: the settings chosen for that layout)")
    cal = plan.calibration
    mm = presets.ceiling(c.gpu, "matmul", w.precision)[0]
    at = presets.attention_ceiling(c.gpu, w.kernels.attention_kernel, w.precision)[0]
    # --attention math: no fused kernel, its batched matmuls run at the matmul rate (cost.micro_batch_compute_s).
    attention = ("attention (math) as batched matmuls at the matmul rate" if w.attention == "math" else
                 f"attention ({w.kernels.attention_kernel}) {at:.2f} x {cal.attention_factor:.2f} = "
                 f"{at * cal.attention_factor:.2f} (unhalved causal FLOPs)")
    lines.append(f"(calibration {cal.name!r}: of peak, matmul {mm:.2f} ceiling x {cal.matmul_factor:.2f} "
                 f"fitted = {mm * cal.matmul_factor:.2f}, {attention}, links {cal.link_efficiency:.2f} of line "
                 "rate; " + (f"fitted on {cal.fitted_runs} published runs)" if cal.fitted_runs else "not fitted)"))
    if w.optimizer == "muon" and plan.recommended:
        lines.append(muon_line(s, plan.recommended.layout))
    lines.append("")
    if plan.recommended:
        r = plan.recommended
        lines.append(f"recommended: {r.name} ({r.verdict}) with checkpointing {r.checkpoint}, micro-batch "
                     f"{r.micro_batch} x {r.grad_accum} accumulation, grad sync {r.grad_sync}"
                     f"{', chunked loss' if r.loss_chunked else ''}"
                     f"{_ends(r.layout.pp_first_stage_fewer, r.layout.stage_layers)} - {gib(r.memory.total)} "
                     f"GiB of {gib(r.budget_bytes)} GiB budget, {gib(r.headroom_bytes)} GiB left of the device's "
                     f"{device_gib(c.gpu.memory_gib)} GiB; "
                     f"{tps(r.time.tokens_per_s_per_gpu)} tokens/s/GPU, MFU {r.time.mfu:.1%}")
        if r.note:
            lines.append(f"  note: {r.note}")
    if plan.recommended and (pred := run_prediction(plan)) is not None:
        lines += ["per rank as the run stores it (train --dry-run's prediction, checked against its memory "
                  "ledger):", *("  " + row for row in pred.table().splitlines())]
        lines.append(staging_line(pred, c, plan.recommended.memory.host_bytes))
    lines += [f"  not {x}" for x in plan.rejected]
    lines += [f"  not offered {x}" for x in plan.skipped]
    if plan.commands:
        lines += ["", "run it:", *(f"  {cmd}" for cmd in plan.commands)]
    lines += [f"warning: {x}" for x in plan.warnings]
    return "\n".join(lines)


def staging_line(pred: RunPrediction, cluster: Cluster, offload_host_bytes: int) -> str:
    """What the run's asynchronous checkpoints (``checkpoint.mode``'s default) hold in host memory: each
    rank's stored state once more (plan.memory.staging_host_bytes), and whether that fits beside the
    run on a node (80 % of its host RAM, as the offload check); where not, the sync mode."""
    per_rank = max(staging_host_bytes(StateBytes(params=r.param_bytes + r.host_param_bytes,
                                                 optimizer=r.optim_bytes + r.host_optim_bytes))
                   for r in pred.ranks)
    node = per_rank * cluster.gpus_per_node
    host = (cluster.host_ram_gib or cluster.gpu.host_ram_gib) * GIB
    line = (f"checkpoints: written in the background by default (checkpoint.mode = auto), staging "
            f"{gib(per_rank)} GiB of host memory per rank, {gib(node)} GiB per node")
    if node + offload_host_bytes > 0.8 * host:
        return (line + f": that does not fit beside the run in the node's {host / GIB:.0f} GiB of host memory "
                "(--host-ram-gib); add --set checkpoint.mode=sync to the command (each save then blocks until "
                "written)")
    return line + f", within the node's {host / GIB:.0f} GiB of host memory"


def run(args: argparse.Namespace) -> int:
    """Print the plan (table or JSON); 0 on success. ConfigError propagates to the main CLI (exit 2)."""
    plan = build_plan(args)
    if getattr(args, "rehearse", 0):
        # The top recommendations played at full size on this machine (shardwise.rehearse).
        rows = rehearse_candidates(plan, args.rehearse)
        if args.json:
            print(json.dumps({**plan_to_dict(plan), "rehearsed": rows}, indent=2))
        else:
            print(format_table(plan) + "\n\n" + format_rows(rows))
        return 0
    print(json.dumps(plan_to_dict(plan), indent=2) if args.json else format_table(plan))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m shardwise.plan.cli ...``."""
    parser = argparse.ArgumentParser(prog="shardwise plan")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ShardwiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
