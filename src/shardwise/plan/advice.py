"""Candidate strategies, whether each fits, the recommendation, and the commands that run it."""

from __future__ import annotations

import dataclasses
import itertools
import math
import shlex
from dataclasses import dataclass, field
from typing import Any

from shardwise.core.config import PP_SCHEDULES, OptimizerConfig, ParallelConfig, parse_loss_chunks
from shardwise.core.families import CP_FAMILIES
from shardwise.core.layout import data_parallel_degree, ep_degrees, resolve_layout, stage_layer_ranges
from shardwise.core.pp_schedules import compile_refusal, schedule_info, tied_weights_refusal
from shardwise.core.strategies import REGISTRY, StrategyInfo
from shardwise.errors import ConfigError, unknown_choice
from shardwise.optim.rules import check_optimizer
from shardwise.plan.choices import (
    FALLBACKS,
    SEARCHABLE,
    degree_sets,
    first_stage_fewer_choices,
    stages_per_rank_choices,
)
from shardwise.plan.cost import Calibration, Fabric, StepTime, calibration_for, step_time
from shardwise.plan.cp import CP_IMPLS, chunked_loss_off, cp_impl_for, cp_multiple
from shardwise.plan.finetune import shell_word
from shardwise.plan.memory import (
    CHECKPOINT_MODES,
    GRAD_SYNC_MODES,
    OPTIMIZERS,
    SHARDWISE_KERNELS,
    TRAIN_SPELLINGS,
    Kernels,
    Layout,
    MemoryBreakdown,
    Precision,
    indivisible_tp_sizes,
    memory_breakdown,
    precision,
    unplanned_caveat,
)
from shardwise.plan.pipeline import with_stack_split
from shardwise.plan.predict import RUNTIME_PRECISIONS, compute_precision, loss_kernels, planner_batch
from shardwise.plan.preference import OBJECTIVES, REFERENCES, dpo_breakdown, dpo_layout_refusal, dpo_step_time
from shardwise.plan.presets import GPU, Link, ceiling, gpu, link
from shardwise.plan.spec import ModelSpec

GIB = 1024**3
LOSS_CHUNKS_DEFAULT = None  # train.loss_chunks = "auto", parsed (config.parse_loss_chunks)
RUNTIME_RESERVE_GIB = 2.0  # CUDA context, NCCL and cuBLAS workspaces: never available to tensors


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1
    intra: Link | None = None  # None: the GPU's default link
    inter: Link | None = None
    intra_gbs: float | None = None  # explicit overrides of the link presets, GB/s per GPU per direction
    inter_gbs: float | None = None
    host_ram_gib: float | None = None
    nvme_gbs: float | None = None  # NVMe GB/s per GPU for zero3-nvme (None: the GPU kind's default, plan.offload)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ConfigError(f"the cluster needs at least one GPU: got --gpus-per-node {self.gpus_per_node} "
                              f"and --nodes {self.nodes}; both must be >= 1.")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_gib(self) -> float:
        return self.gpu.memory_gib - RUNTIME_RESERVE_GIB

    @property
    def calibration(self) -> Calibration:
        """The fitted constants for this cluster's GPU (cost.CALIBRATIONS; defaults when uncalibrated)."""
        return calibration_for(self.gpu.calibration)

    def fabric(self, precision_name: str, calib: Calibration) -> Fabric:
        """Per-GPU link bandwidths after ``calib.link_efficiency``, and the compute/memory peaks.

        Precedence for each link: the --intra-gbs/--inter-gbs override, then an explicit link
        preset, then the GPU's own figure (a --gpu-spec), then the GPU's default preset.
        """
        g = self.gpus_per_node
        intra = self.intra_gbs or (self.intra.per_gpu_gbs(g) if self.intra else None) or self.gpu.intra_gbs \
            or link(self.gpu.intra_link).per_gpu_gbs(g)
        inter = self.inter_gbs or (self.inter.per_gpu_gbs(g) if self.inter else None) or self.gpu.inter_gbs \
            or link(self.gpu.inter_link).per_gpu_gbs(g)
        peak = self.gpu.peak_tflops(precision_name)
        eff = calib.link_efficiency
        return Fabric(g, intra * eff, inter * eff, peak, self.gpu.mem_bw_tbs,
                      matmul_ceiling=ceiling(self.gpu, "matmul", precision_name)[0],
                      attention_ceiling=ceiling(self.gpu, "attention", precision_name)[0],
                      attention_flash2_ceiling=ceiling(self.gpu, "attention-flash2", precision_name)[0])


@dataclass(frozen=True)
class Workload:
    seq: int
    micro_batch: int = 1
    global_batch: int | None = None  # sequences per optimizer step; default micro_batch * world
    grad_accum: int | None = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    checkpoint: str = "none"
    attention: str = "sdpa"
    ac_every: int = 2  # period of "selective" checkpointing (parallel.ac_every)
    grad_sync: str = "step"  # when gradients are reduced under accumulation (memory.GRAD_SYNC_MODES)
    # The training stack's kernels (memory.Kernels): shardwise's by default; other stacks' when
    # planning their published runs (benchmarks/calibrate_planner.py).
    kernels: Kernels = SHARDWISE_KERNELS
    safety_margin: float = 0.10
    # Pipeline candidates: schedule and stages per rank (interleaved 1F1B needs >= 2).
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    # parallel.pp_first_stage_fewer: the embedding and the head + loss each take k blocks' place in
    # the stage split (core.layout.stage_layer_ranges; an end stage may hold no block).
    pp_first_stage_fewer: int = 0
    # parallel.sequence_parallel of the tp candidates (the runtime's default: on; LoRA runs without).
    sequence_parallel: bool = True
    # What the printed commands train: a recipe (built-in name or TOML) and the --set overrides
    # that select the planned model. No recipe: the model is not one shardwise can build (a bare
    # parameter count), so no command is printed.
    recipe: str = ""
    extra_sets: tuple[str, ...] = ()
    # Settings the planner searches per layout instead of taking the value above
    # (choices.SEARCHABLE; the CLI leaves open what the user did not give), and "optimizer" where the
    # user named none (choices.FALLBACKS: Adafactor where AdamW fits nowhere).
    search: tuple[str, ...] = ()
    # torch.compile each block (train.compile): printed in the commands (its speed-up is not yet
    # part of the cost model; docs/planner.md).
    compile: bool = False
    # LoRA adapters' rank (0: every weight trains); the spec already holds the adapters. The
    # runtime runs LoRA without sequence parallelism, so TP candidates turn it off.
    lora_rank: int = 0
    # train.loss_chunks parsed (config.parse_loss_chunks): None auto (the runtime's default), 0 off,
    # N chunks. 0 here by default so other stacks' published runs keep their own loss; the CLI
    # passes the runtime's default (auto) unless --loss-chunks says otherwise.
    loss_chunks: int | None = 0
    # parallel.cp_impl the cp candidates run with (plan/cp.py cp_impl_for): auto is the runtime's
    # (the all-to-all), and the ring where the heads refuse the all-to-all a cp degree.
    cp_impl: str = "auto"
    # The training objective (plan/preference.py): "lm" (next-token loss) or "dpo", where micro_batch
    # and global_batch count pairs (2 sequences each) and ``dpo_reference`` is how the reference is held.
    objective: str = "lm"
    dpo_reference: str = "copy"

    def __post_init__(self) -> None:
        if self.cp_impl not in CP_IMPLS:
            raise unknown_choice("--cp-impl", self.cp_impl, CP_IMPLS)
        if self.objective not in OBJECTIVES:
            raise unknown_choice("--objective", self.objective, OBJECTIVES)
        if self.dpo_reference not in REFERENCES:
            raise unknown_choice("--dpo-reference", self.dpo_reference, REFERENCES)
        for key, value in (("--seq", self.seq), ("--micro-batch", self.micro_batch)):
            if value < 1:
                raise ConfigError(f"{key} must be a positive integer, got {value}.")
        if self.global_batch is not None and self.global_batch < 1:
            raise ConfigError(f"--global-batch must be a positive number of sequences, got {self.global_batch}.")
        if self.grad_accum is not None and self.grad_accum < 1:
            raise ConfigError(f"--grad-accum must be >= 1, got {self.grad_accum}.")
        if self.global_batch is not None and self.grad_accum is not None:
            raise ConfigError("give either --global-batch or --grad-accum, not both: one determines the other.")
        precision(self.precision)
        if self.optimizer not in OPTIMIZERS:
            raise unknown_choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.checkpoint not in CHECKPOINT_MODES:
            raise unknown_choice("activation checkpointing mode", self.checkpoint, CHECKPOINT_MODES)
        if self.ac_every < 1:
            raise ConfigError(f"--ac-every must be >= 1 (checkpoint every k-th block), got {self.ac_every}.")
        if self.grad_sync not in GRAD_SYNC_MODES:
            raise unknown_choice("gradient sync mode", self.grad_sync, GRAD_SYNC_MODES)
        if not 0 <= self.safety_margin < 1:
            raise ConfigError(f"--margin must be in [0, 1), got {self.safety_margin}.")
        if self.pp_schedule not in PP_SCHEDULES:
            raise unknown_choice("pipeline schedule", self.pp_schedule, PP_SCHEDULES)
        if self.pp_stages_per_rank < 1:
            raise ConfigError(f"--pp-stages-per-rank must be >= 1, got {self.pp_stages_per_rank}.")
        if self.pp_first_stage_fewer < 0:
            raise ConfigError(f"--pp-first-stage-fewer must be >= 0, got {self.pp_first_stage_fewer}.")
        if self.pp_first_stage_fewer and self.kernels.pp_split != "layers":
            raise ConfigError(f"--pp-first-stage-fewer {self.pp_first_stage_fewer} and --stack-set "
                              f"pp_split={self.kernels.pp_split} both set the pipeline stage sizes; give one.")
        unknown = set(self.search) - set(SEARCHABLE) - set(FALLBACKS)
        if unknown:
            raise ConfigError(f"cannot search {sorted(unknown)}: the planner searches "
                              f"{', '.join(SEARCHABLE + FALLBACKS)}.")
        multi = schedule_info(self.pp_schedule).multi_stage
        if multi != (self.pp_stages_per_rank > 1):
            raise ConfigError(
                f"--pp-schedule {self.pp_schedule} runs {'several stages' if multi else 'one stage'} per rank: "
                f"give it --pp-stages-per-rank {'>= 2' if multi else '1'} (got {self.pp_stages_per_rank}).")


def layout_label(strategy: str, tp: int, pp: int, stages_per_rank: int = 1, cp: int = 1, ep: int = 1,
                 cp_impl: str = "alltoall") -> str:
    """A candidate's name in tables: the strategy and its model-parallel degrees, e.g. fsdp+tp(tp4)
    (``v3``: three interleaved pipeline stages per rank; ``cp2`` context parallel by all-to-all,
    ``cp2-ring`` by ring attention, ``ep4`` expert parallel)."""
    extra = ",".join(f"{d}{n}" + ("-ring" if d == "cp" and cp_impl == "ring" else "")
                     for d, n in (("tp", tp), ("cp", cp), ("ep", ep), ("pp", pp), ("v", stages_per_rank)) if n > 1)
    return f"{strategy}({extra})" if extra else strategy


def layout_key(layout: Layout) -> tuple:
    """What makes two layouts one table row: the strategy and its degrees (not searched settings)."""
    return (layout.strategy, layout.tp, layout.pp, layout.cp, layout.ep)


def replicas(layout: Layout) -> int:
    """Data-parallel replicas that read different sequences: dp without its context-parallel ranks."""
    return layout.dp // layout.cp


def layout_cp_impl(spec: ModelSpec, layout: Layout, work: Workload) -> str:
    """The parallel.cp_impl this layout runs cp with under ``work.cp_impl`` (plan/cp.py cp_impl_for)."""
    return cp_impl_for(work.cp_impl, spec.n_heads, layout.tp, layout.cp) or work.cp_impl


def loss_chunked(spec: ModelSpec, layout: Layout, work: Workload) -> bool:
    """Whether the runtime chunks this candidate's loss (plan/cp.chunked_loss_off: the runtime's rule)."""
    sequences = work.micro_batch * (2 if work.objective == "dpo" else 1)  # a DPO pair is two sequences
    return work.kernels.loss == "torch" and not chunked_loss_off(
        spec.family, spec.vocab, spec.hidden, work.loss_chunks, tp=layout.tp, pp=layout.pp,
        tokens=sequences * max(1, work.seq // max(1, layout.cp)))


@dataclass
class Candidate:
    layout: Layout
    grad_accum: int
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    budget_bytes: float
    host_fits: bool = True
    note: str = ""
    grad_sync: str = "step"  # parallel.grad_sync the candidate runs with
    checkpoint: str = "none"  # parallel.activation_checkpointing it runs with
    micro_batch: int = 1  # sequences per GPU per micro-batch
    device_bytes: float = 0.0  # the GPU's whole memory (the line between "tight" and "no")
    loss_chunked: bool = False  # the runtime chunks the loss (train.loss_chunks) on this layout
    cp_impl: str = "alltoall"  # parallel.cp_impl it runs cp with (plan/cp.py cp_impl_for)

    @property
    def name(self) -> str:
        lay = self.layout
        return layout_label(lay.strategy, lay.tp, lay.pp, lay.pp_stages_per_rank, lay.cp, lay.ep, self.cp_impl)

    @property
    def verdict(self) -> str:
        """``fits`` the usable budget; ``tight``: over it but within the device's memory; ``no``."""
        if self.fits:
            return "fits"
        if self.host_fits and self.memory.total <= self.device_bytes:
            return "tight"
        return "no"

    @property
    def headroom_bytes(self) -> float:
        """Device memory left over the predicted peak (negative: above the device)."""
        return self.device_bytes - self.memory.total

    def to_dict(self) -> dict[str, Any]:
        m, t = self.memory, self.time
        return {
            "strategy": self.layout.strategy, "label": self.name, "dp": self.layout.dp, "tp": self.layout.tp,
            "pp": self.layout.pp, "cp": self.layout.cp, "cp_impl": self.cp_impl if self.layout.cp > 1 else None,
            "ep": self.layout.ep,
            "shard": self.layout.shard, "grad_accum": self.grad_accum,
            "grad_sync": self.grad_sync, "checkpoint": self.checkpoint, "micro_batch": self.micro_batch,
            "pp_stages_per_rank": self.layout.pp_stages_per_rank, "loss_chunked": self.loss_chunked,
            "bytes": {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "master": m.master,
                      "activations": m.activations, "transient": m.transient, "fragmentation": m.fragmentation,
                      "allocated": m.allocated, "total": m.total},
            "transient_parts": m.transient_parts, "host_bytes_per_node": m.host_bytes,
            "fits": self.fits, "verdict": self.verdict, "budget_bytes": int(self.budget_bytes),
            "device_bytes": int(self.device_bytes), "headroom_bytes": int(self.headroom_bytes),
            "step_s": t.step_s, "compute_s": t.compute_s, "comm_exposed_s": t.comm_exposed_s,
            "bubble_s": t.bubble_s, "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu,
            "note": self.note, "layout": self.layout.to_dict(),
        }


@dataclass
class Plan:
    spec: ModelSpec
    cluster: Cluster
    workload: Workload
    candidates: list[Candidate]
    recommended: Candidate | None
    rejected: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    calibration: Calibration = field(default_factory=Calibration)
    # Layouts the runtime cannot run for this model (unsupported model family, too few
    # micro-batches for the pipeline, ...), each with the reason; never candidates.
    skipped: list[str] = field(default_factory=list)
    # ZeRO-3 offload rows (plan.offload.OffloadEstimate) when nothing fits on the GPUs; then
    # ``commands`` run the first one.
    offload: list[Any] = field(default_factory=list)


def _tp_divides(spec: ModelSpec, tp: int) -> bool:
    """Whether ``tp`` divides every size the runtime's TP plans split (``memory.indivisible_tp_sizes``)."""
    return bool(spec.n_heads) and not indivisible_tp_sizes(spec, tp)


def _is_duplicate(info: StrategyInfo, dp: int, world: int, nodes: int) -> bool:
    """True for a registry entry that, here, is only another name for a simpler candidate."""
    if info.max_world is not None:
        return world > info.max_world
    if world == 1 and not info.model_parallel:
        return info.name != "fsdp-offload"  # on one GPU: single, or offload to fit
    if info.hybrid:
        return nodes == 1  # one shard group per node: on a single node hsdp is fsdp
    if info.model_parallel and "dp" in info.degrees and dp == 1:
        # fsdp+tp / ddp+pp / fsdp+pp without data parallelism are tp / pp; 3-D has no 2-D twin.
        rest = tuple(d for d in info.degrees if d != "dp")
        return any(other.degrees == rest for other in REGISTRY.values())
    return False


def _compile_refusal(work: Workload, tp: int, pp: int, cp: int) -> str:
    """Why the runtime refuses ``train.compile`` for these degrees ('' when it compiles): the same
    rules preflight applies (context parallel, the zero-bubble schedules' split backward)."""
    if cp > 1:
        return "context parallel's attention (all-to-all or ring) is not compiled"
    return (compile_refusal(work.pp_schedule) or "") if pp > 1 else ""


def candidate_layouts(spec: ModelSpec, cluster: Cluster, work: Workload, tp: int | None = None,
                      pp: int | None = None, cp: int | None = None,
                      ep: int | None = None) -> tuple[list[Layout], list[str]]:
    """Every layout the runtime can run for this model and cluster, and why the others are left out.

    Candidates come from the strategy registry (the runtime's own list), each resolved by the
    runtime's ``resolve_layout`` from the settings its printed command carries, so a candidate is
    exactly what that command runs. TP stays inside a node (a divisor of gpus_per_node that divides
    the heads and widths); PP spans nodes (one stage group per node) unless --pp asks otherwise; DP
    takes the rest. Strategies whose model family the runtime cannot split (TP plans, pipeline
    stages) are skipped with the reason. Context / expert parallel degrees the search adds on its own
    (``choices.degree_sets``) are left out quietly where the runtime refuses them (e.g. ep under ddp);
    pinned ones (``--cp``, ``--ep``) say why.
    """
    world, g = cluster.world, cluster.gpus_per_node
    fewer = max(first_stage_fewer_choices(work))  # the most stages any tried split allows
    _validate_degrees(spec, cluster, tp, pp, cp, ep, work.cp_impl, work.seq, fewer)
    layouts: list[Layout] = []
    skipped: list[str] = refused_degrees(spec, cluster, cp=cp)
    for degrees in degree_sets(spec, cluster, tp=tp, pp=pp, tp_ok=lambda t: _tp_divides(spec, t), cp=cp, ep=ep,
                               seq=work.seq, cp_impl=work.cp_impl):
        t, p, c, x = degrees["tp"], degrees["pp"], degrees["cp"], degrees["ep"]
        dp = data_parallel_degree(world, tp=t, pp=p)
        quiet = (c > 1 and cp is None) or (x > 1 and ep is None)  # the search's own extras
        for info in REGISTRY.values():
            if not info.planned:  # DeepSpeed kinds: plan/offload.py, added by the search
                continue
            if ("tp" in info.degrees) != (t > 1) or ("pp" in info.degrees) != (p > 1):
                continue
            if ("dp" not in info.degrees and dp > 1) or _is_duplicate(info, dp, world, cluster.nodes):
                continue
            label = layout_label(info.name, t, p, cp=c, ep=x, cp_impl=cp_impl_for(work.cp_impl, spec.n_heads, t, c))
            if not info.supports(spec.family):
                if not quiet:
                    skipped.append(f"{label}: {info.unsupported_reason(spec.family)}")
                continue
            if work.loss_chunks and (why := chunked_loss_off(spec.family, spec.vocab, spec.hidden,
                                                             work.loss_chunks, tp=t, pp=p)):
                if not quiet:
                    skipped.append(f"{label}: train.loss_chunks = {work.loss_chunks} cannot run here: {why}")
                continue
            if dp % c:
                continue
            if work.compile and (why := _compile_refusal(work, t, p, c)):
                if not quiet:
                    skipped.append(f"{label}: train.compile cannot run here: {why}")
                continue
            accum, _ = _grad_accum(work, dp // c, world)
            if p > 1 and accum < p:
                if quiet:
                    continue
                skipped.append(f"{label}: its {p} pipeline stages need at least {p} micro-batches per step, but "
                               f"the global batch gives {accum} per replica; raise --global-batch or --grad-accum")
                continue
            errors = []
            pipeline_settings = (itertools.product(stages_per_rank_choices(work), first_stage_fewer_choices(work))
                                 if p > 1 else [(1, 0)])
            for v, k in pipeline_settings:
                options = ParallelConfig(
                    strategy=info.name, tp=t, pp=p, cp=c, ep=x, hsdp_shard_size=g if info.hybrid else 0,
                    precision=TRAIN_PRECISION[work.precision],
                    # The runtime runs LoRA without sequence parallel.
                    sequence_parallel=t > 1 and work.sequence_parallel and not work.lora_rank,
                    pp_schedule=work.pp_schedule if p > 1 else "1f1b", pp_stages_per_rank=v,
                    pp_first_stage_fewer=k,
                    # One pipeline schedule per step runs all of a replica's micro-batches.
                    pp_microbatches=accum if p > 1 else 0)
                try:
                    # The stack's expert-group rule (Kernels.ep_groups): shardwise's unless the plan
                    # describes another stack (--stack megatron), whose ep train would refuse.
                    layout = resolve_layout(options, world, ranks_per_node=g, n_blocks=spec.n_layers,
                                            ep_groups=work.kernels.ep_groups,
                                            experts_tp=work.kernels.experts_tp,
                                            zero1_group=work.kernels.zero1_group)
                    layout = with_stack_split(spec, layout, work.kernels.pp_split)  # the stack's own stage split
                except ConfigError as e:
                    errors.append(e)
                    continue
                if spec.tied_embeddings and (why := tied_weights_refusal(layout)):
                    errors.append(ConfigError(why))  # the runtime's rule (parallel/pipeline/ties.py)
                    continue
                # (pairs: runtime_batch makes a pipeline's micro-batch a multiple of its microbatches)
                if work.objective == "dpo" and (why := dpo_layout_refusal(layout, False, work.dpo_reference)):
                    errors.append(ConfigError(why))  # the DPO step's rule (plan/preference.py)
                    continue
                try:  # the optimizer's rule (optim/build.py: Muon and Adafactor need the state on the device)
                    check_optimizer(OptimizerConfig(name=work.optimizer), layout)
                except ConfigError as e:
                    errors.append(e)
                    continue
                layouts.append(layout)
            if errors and not quiet and not any(layout_key(lay) == (info.name, t, p, c, x) for lay in layouts):
                skipped.append(f"{label}: {errors[0]}")
    return layouts, skipped


def refused_degrees(spec: ModelSpec, cluster: Cluster, *, cp: int | None = None) -> list[str]:
    """Why pinned degrees give no layout at all, by name (the search would otherwise come back
    empty without a word): context parallel for a family whose attention the runtime cannot split.
    A pinned ep is the layout's to refuse (``Layout._check_ep``: ep divides dp_shard x cp; groups
    over tp or pp ranks are named there), per strategy, in ``candidate_layouts``'s skipped lines."""
    out = []
    if cp and cp > 1 and spec.family and spec.family not in CP_FAMILIES:
        kind = "mixture-of-experts " if spec.moe is not None else ""
        out.append(f"cp{cp}: context parallel does not run the {kind}{spec.family} family's attention (the runtime "
                   f"splits the sequence for {', '.join(CP_FAMILIES)}); drop --cp, or use a shorter --seq")
    return out


def _validate_degrees(spec: ModelSpec, cluster: Cluster, tp: int | None, pp: int | None, cp: int | None = None,
                      ep: int | None = None, cp_impl: str = "auto", seq: int = 0, fewer: int = 0) -> None:
    for flag, value in (("--cp", cp), ("--ep", ep)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}.")
    if ep is not None and ep > 1 and spec.moe is None:
        raise ConfigError(f"--ep {ep}: {spec.name} has no mixture-of-experts layers to split over expert-parallel "
                          "ranks; expert parallel applies to MoE models (e.g. --model gpt-moe-lab).")
    if ep is not None and spec.moe is not None and ep not in ep_degrees(spec.moe.n_experts):
        raise ConfigError(f"--ep {ep} does not divide the {spec.moe.n_experts} experts of {spec.name}; allowed: "
                          f"{', '.join(map(str, ep_degrees(spec.moe.n_experts)))}.")
    if cp is not None and cp > 1 and not cp_impl_for(cp_impl, spec.n_heads, 1, cp):
        divisors = [d for d in range(1, spec.n_heads + 1) if spec.n_heads % d == 0]
        raise ConfigError(f"--cp {cp} does not divide the {spec.n_heads} attention heads of {spec.name} (each "
                          f"context-parallel rank of the all-to-all attends over heads / cp heads); allowed: "
                          f"{', '.join(map(str, divisors))}, or --cp-impl ring (or auto), which has no head rule.")
    if cp is not None and cp > 1 and seq:
        impl = cp_impl_for(cp_impl, spec.n_heads, 1, cp)
        if seq % cp_multiple(cp, impl):
            how = "2 x --cp (the ring's head-tail chunks)" if impl == "ring" else "--cp"
            raise ConfigError(f"--cp {cp}: the sequence --seq {seq} must be a multiple of {how} = "
                              f"{cp_multiple(cp, impl)}.")
    if tp is not None:
        if tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {tp}.")
        sizes = indivisible_tp_sizes(spec, tp)
        if sizes:
            divisors = [d for d in range(1, (spec.n_heads or 1) + 1) if not indivisible_tp_sizes(spec, d)]
            raise ConfigError(f"--tp {tp} does not divide the {sizes} of {spec.name} (tensor parallel splits each); "
                              f"allowed: {', '.join(map(str, divisors))}.")
        if cluster.gpus_per_node % tp:
            raise ConfigError(f"--tp {tp} must divide --gpus-per-node {cluster.gpus_per_node} "
                              "(tensor parallelism stays inside a node).")
        if tp > 1 and not REGISTRY["tp"].supports(spec.family):
            raise ConfigError(f"--tp {tp}: {REGISTRY['tp'].unsupported_reason(spec.family)}.")
    if pp is not None:
        if pp < 1:
            raise ConfigError(f"--pp must be >= 1, got {pp}.")
        if spec.n_layers:
            try:
                stage_layer_ranges(spec.n_layers, pp, fewer)  # the layout's rule: each stage needs a layer
            except ConfigError:
                most = spec.n_layers + (2 if fewer else 0)
                ends = " (the first and the last stage may hold none: --pp-first-stage-fewer)" if fewer else ""
                raise ConfigError(f"--pp {pp} asks for more pipeline stages than {spec.name}'s {spec.n_layers} "
                                  f"layers{ends}; use at most {most}.") from None
        if pp > 1 and not REGISTRY["pp"].supports(spec.family):
            raise ConfigError(f"--pp {pp}: {REGISTRY['pp'].unsupported_reason(spec.family)}.")
    if cluster.world % ((tp or 1) * (pp or 1)):
        raise ConfigError(f"--tp {tp or 1} x --pp {pp or 1} must divide the {cluster.world} GPUs.")


def _grad_accum(work: Workload, dp: int, world: int) -> tuple[int, str]:
    """Micro-batches of ``work.micro_batch`` sequences per step and replica, and a rounding note."""
    if work.grad_accum is not None:
        return work.grad_accum, ""
    global_batch = work.global_batch or work.micro_batch * world
    per_pass = work.micro_batch * dp
    accum = max(1, math.ceil(global_batch / per_pass))
    note = "" if accum * per_pass == global_batch else f"global batch rounded to {accum * per_pass}"
    return accum, note


def predict_step_time(spec: ModelSpec, cluster: Cluster, work: Workload, layout: Layout,
                      calib: Calibration | None = None, grad_sync: str | None = None) -> StepTime:
    """Step time of one layout alone (``evaluate`` without the memory model)."""
    calib = calib or cluster.calibration
    accum, _ = _grad_accum(work, replicas(layout), cluster.world)
    kernels = work.kernels
    if loss_chunked(spec, layout, work):
        kernels = dataclasses.replace(kernels, loss="chunked")
    return step_time(spec, layout, precision(work.precision), cluster.fabric(work.precision, calib), seq=work.seq,
                     micro_batch=work.micro_batch, grad_accum=accum, checkpoint=work.checkpoint,
                     every=work.ac_every, grad_sync=grad_sync or work.grad_sync, kernels=kernels, calib=calib,
                     cp_impl=layout_cp_impl(spec, layout, work), attention=work.attention)


def predict_step_for_spec(spec: ModelSpec, layout: Layout, cfg: Any, *, seq: int, gpu_name: str,
                          gpus_per_node: int, nodes: int, plain_ce: bool = True) -> Any:
    """The planner's step time (``plan.cost.StepTime``: compute, exposed communication, bubble) for a
    ``RunConfig`` on ``nodes`` x ``gpus_per_node`` GPUs of kind ``gpu_name``: what ``plan`` prints for
    the same settings, with the batch read as ``predict_run`` reads it (a pipeline's micro-batches)."""
    from shardwise.runtime.auto import resolve_precision  # defers torch

    precision = resolve_precision(cfg.parallel.precision).value
    micro_batch, micro_batches = planner_batch(layout, cfg.train.micro_batch_size, cfg.train.grad_accum_steps)
    work = Workload(seq=seq, micro_batch=micro_batch, grad_accum=micro_batches,
                    precision=TRAIN_SPELLINGS.get(precision) or precision,
                    checkpoint=cfg.parallel.activation_checkpointing, ac_every=cfg.parallel.ac_every,
                    grad_sync=cfg.parallel.grad_sync, pp_schedule=layout.pp_schedule,
                    pp_stages_per_rank=layout.pp_stages_per_rank,
                    loss_chunks=parse_loss_chunks(getattr(cfg.train, "loss_chunks", 0)) if plain_ce else 0)
    cluster = Cluster(gpu=gpu(gpu_name), gpus_per_node=gpus_per_node, nodes=nodes)
    return predict_step_time(spec, cluster, work, layout)


def stored_precisions(work: Workload, layout: Layout) -> tuple[Precision, Precision | None]:
    """(what a step materialises, what the run stores or None for the same): for the runtime's own
    layouts under ``Kernels.state`` "fp32-params", exactly what ``train`` keeps (plan/predict.py:
    fp32 state, FSDP2's 16-bit gathers and fp32 reduces, autocast's fp32 gradients), so the plan's
    columns are ``train --dry-run``'s; else the workload's precision as given."""
    if work.kernels.state != "fp32-params" or layout.external is not None:
        return precision(work.precision), None
    runtime = TRAIN_PRECISION[work.precision]
    return compute_precision(runtime, layout), RUNTIME_PRECISIONS[runtime]


def evaluate(spec: ModelSpec, cluster: Cluster, work: Workload, layout: Layout,
             calib: Calibration | None = None, grad_sync: str | None = None) -> Candidate:
    """Memory and time of one layout (``calib``: the GPU's fitted constants unless given;
    ``grad_sync``: when gradients are reduced under accumulation, ``work.grad_sync`` unless given)."""
    calib = calib or cluster.calibration
    grad_sync = grad_sync or work.grad_sync
    prec, state_prec = stored_precisions(work, layout)
    accum, note = _grad_accum(work, replicas(layout), cluster.world)
    chunked = loss_chunked(spec, layout, work)
    kernels = work.kernels
    if work.kernels.loss == "torch":  # the runtime's loss (another stack's published kernels stay as given)
        kernels = dataclasses.replace(kernels, loss=loss_kernels(chunked, work.compile, layout.tp).loss)
    options = dict(state_prec=state_prec, checkpoint=work.checkpoint, grad_accum=accum,
                   gpus_per_node=cluster.gpus_per_node, attention=work.attention, every=work.ac_every,
                   grad_sync=grad_sync, fragmentation=calib.fragmentation,
                   kernels=kernels, loss_chunks=work.loss_chunks)
    if work.objective == "dpo":
        mem = dpo_breakdown(spec, layout, prec, work.optimizer, seq=work.seq, micro_batch_pairs=work.micro_batch,
                            reference=work.dpo_reference, **options)
        sequences = dataclasses.replace(work, micro_batch=2 * work.micro_batch, objective="lm",
                                        global_batch=2 * work.global_batch if work.global_batch else None)
        time = dpo_step_time(predict_step_time(spec, cluster, sequences, layout, calib, grad_sync),
                             work.dpo_reference)
    else:
        mem = memory_breakdown(spec, layout, prec, work.optimizer, seq=work.seq, micro_batch=work.micro_batch,
                               **options)
        time = predict_step_time(spec, cluster, work, layout, calib, grad_sync)
    note = "; ".join(filter(None, [note, unplanned_caveat(layout, work.checkpoint)]))
    budget = cluster.usable_gib * GIB * (1 - work.safety_margin)
    host_ram = (cluster.host_ram_gib or cluster.gpu.host_ram_gib) * GIB
    host_fits = mem.host_bytes <= 0.8 * host_ram  # leave 20% of host RAM to the OS, data loaders
    return Candidate(layout, accum, mem, time, mem.total <= budget and host_fits, budget, host_fits, note,
                     grad_sync, work.checkpoint, work.micro_batch, cluster.gpu.memory_gib * GIB, chunked,
                     layout_cp_impl(spec, layout, work))


# Planner precision (how bytes are stored) -> the trainer's parallel.precision setting.
TRAIN_PRECISION = {"fp32": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed", "bf16-fp32grad": "bf16-mixed",
                   "bf16-true": "bf16-true"}


def runtime_batch(layout: Layout, micro_batch: int, micro_batches: int) -> tuple[int, int]:
    """(train.micro_batch_size, train.grad_accum_steps) that run ``micro_batches`` micro-batches of
    ``micro_batch`` sequences per step and replica.

    A pipeline splits each ``train.micro_batch_size`` batch into ``parallel.pp_microbatches``
    pieces and runs them in one schedule, so its batch is all of the step's micro-batches at once.
    """
    if layout.pp > 1:
        return micro_batch * layout.pp_microbatches, micro_batches // layout.pp_microbatches
    return micro_batch, micro_batches


def train_settings(cand: Candidate, work: Workload) -> list[str]:
    """The ``--set`` overrides that make ``shardwise train`` run this candidate (model selection first)."""
    lay = cand.layout
    micro_batch_size, accum_steps = runtime_batch(lay, cand.micro_batch, cand.grad_accum)
    sets = list(work.extra_sets)
    sets += [f"parallel.precision={TRAIN_PRECISION[work.precision]}", f"train.micro_batch_size={micro_batch_size}",
             f"train.grad_accum_steps={accum_steps}"]
    if cand.checkpoint != "none":
        sets.append(f"parallel.activation_checkpointing={cand.checkpoint}")
    if cand.checkpoint == "selective":
        sets.append(f"parallel.ac_every={work.ac_every}")
    if lay.tp > 1:
        sets += [f"parallel.tp={lay.tp}", f"parallel.sequence_parallel={str(lay.sequence_parallel).lower()}"]
    if lay.pp > 1:
        sets += [f"parallel.pp={lay.pp}", f"parallel.pp_microbatches={lay.pp_microbatches}",
                 f"parallel.pp_schedule={lay.pp_schedule}"]
        if lay.pp_stages_per_rank > 1:
            sets.append(f"parallel.pp_stages_per_rank={lay.pp_stages_per_rank}")
        if lay.pp_first_stage_fewer:
            sets.append(f"parallel.pp_first_stage_fewer={lay.pp_first_stage_fewer}")
    if lay.cp > 1:
        sets.append(f"parallel.cp={lay.cp}")
        if cand.cp_impl == "ring":  # the runtime's auto is the all-to-all
            sets.append("parallel.cp_impl=ring")
    if lay.ep > 1:
        sets.append(f"parallel.ep={lay.ep}")
    if lay.info.hybrid:
        sets.append(f"parallel.hsdp_shard_size={lay.shard}")
    if cand.grad_sync != "step":
        sets.append(f"parallel.grad_sync={cand.grad_sync}")
    if work.compile:
        sets.append("train.compile=true")
    if work.loss_chunks != LOSS_CHUNKS_DEFAULT:  # the runtime's default (auto) goes unsaid
        sets.append(f"train.loss_chunks={work.loss_chunks}")
    if work.optimizer != "adamw":  # the runtime's default goes unsaid; the planned state is this one's
        sets.append(f"optimizer.name={work.optimizer}")
    return sets


def launch_commands(cand: Candidate, cluster: Cluster, work: Workload, run_name: str = "") -> list[str]:
    """`shardwise train` and the equivalent plain torchrun command, with every flag they need.

    Multi-node commands run on every node, with ``$MASTER_ADDR`` (the first node's address) set
    by the user (``shardwise train`` inside a Slurm job finds it, and the node count, by itself).
    Empty when ``work`` names no runnable model.
    """
    if not work.recipe:
        return []
    lay = cand.layout
    settings = " ".join(f"--set {shell_word(s)}" for s in train_settings(cand, work))
    args = f"{shlex.quote(work.recipe)} --strategy {lay.strategy} {settings}"
    g, n = cluster.gpus_per_node, cluster.nodes
    if n == 1:
        return [f"shardwise train {args} --nproc {g}",
                f"torchrun --standalone --nproc-per-node={g} -m shardwise.job.worker {args}"]
    # `shardwise train`: the nodes agree on the run directory through the endpoint. Plain torchrun
    # ranks name it themselves, so every node is given the same --out (on a shared file system).
    # The c10d rendezvous numbers the nodes itself: no --node-rank.
    out = shlex.quote(f"runs/{run_name or 'plan'}-{lay.strategy.replace('+', '_')}")
    return [
        f"shardwise train {args} --nproc {g} --nnodes {n} --rdzv-endpoint $MASTER_ADDR:29500",
        f"torchrun --nproc-per-node={g} --nnodes={n} --rdzv-backend=c10d "
        f"--rdzv-endpoint=$MASTER_ADDR:29500 -m shardwise.job.worker {args} --out {out}",
    ]

