"""Candidate strategies, whether each fits, the recommendation, and the commands that run it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from shardwise.errors import ConfigError, unknown_choice
from shardwise.plan.cost import Calibration, Fabric, StepTime, calibration_for, step_time
from shardwise.plan.memory import (
    CHECKPOINT_MODES,
    GRAD_SYNC_MODES,
    OPTIMIZERS,
    SHARDWISE_KERNELS,
    Kernels,
    Layout,
    MemoryBreakdown,
    memory_breakdown,
    precision,
)
from shardwise.plan.presets import GPU, Link
from shardwise.plan.spec import ModelSpec

GIB = 1024**3
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
        from shardwise.plan.presets import link

        g = self.gpus_per_node
        intra = self.intra_gbs or (self.intra.per_gpu_gbs(g) if self.intra else None) or self.gpu.intra_gbs \
            or link(self.gpu.intra_link).per_gpu_gbs(g)
        inter = self.inter_gbs or (self.inter.per_gpu_gbs(g) if self.inter else None) or self.gpu.inter_gbs \
            or link(self.gpu.inter_link).per_gpu_gbs(g)
        peak = self.gpu.tf32_tflops if precision_name == "fp32" else self.gpu.bf16_tflops
        eff = calib.link_efficiency
        return Fabric(g, intra * eff, inter * eff, peak, self.gpu.mem_bw_tbs)


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
    recipe: str = "RECIPE.toml"
    extra_sets: tuple[str, ...] = ()  # model-selection --set overrides for the printed commands

    def __post_init__(self) -> None:
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

    @property
    def name(self) -> str:
        lay = self.layout
        degrees = [f"tp{lay.tp}" if lay.tp > 1 else "", f"pp{lay.pp}" if lay.pp > 1 else ""]
        extra = ",".join(d for d in degrees if d)
        return f"{lay.strategy}({extra})" if extra else lay.strategy

    def to_dict(self) -> dict[str, Any]:
        m, t = self.memory, self.time
        return {
            "strategy": self.layout.strategy, "label": self.name, "dp": self.layout.dp, "tp": self.layout.tp,
            "pp": self.layout.pp, "shard": self.layout.shard, "grad_accum": self.grad_accum,
            "bytes": {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "master": m.master,
                      "activations": m.activations, "transient": m.transient, "fragmentation": m.fragmentation,
                      "allocated": m.allocated, "total": m.total},
            "transient_parts": m.transient_parts, "host_bytes_per_node": m.host_bytes,
            "fits": self.fits, "budget_bytes": int(self.budget_bytes),
            "step_s": t.step_s, "compute_s": t.compute_s, "comm_exposed_s": t.comm_exposed_s,
            "bubble_s": t.bubble_s, "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu, "mfu": t.mfu,
            "note": self.note,
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


def _strategy_for(base: str, tp: int, pp: int, dp: int) -> str:
    if tp == 1 and pp == 1:
        return base
    parts = [base] if dp > 1 else []
    parts += ["tp"] * (tp > 1) + ["pp"] * (pp > 1)
    return "+".join(parts) if parts else base


def enumerate_layouts(spec: ModelSpec, cluster: Cluster, tp: int | None = None, pp: int | None = None) -> list[Layout]:
    """Every candidate layout for the cluster: pure data parallel, then TP/PP compositions.

    TP stays inside a node (a divisor of gpus_per_node that divides the heads); PP spans nodes
    (one stage per node group) unless --pp asks otherwise; DP takes the rest.
    """
    world, g = cluster.world, cluster.gpus_per_node
    _validate_degrees(spec, cluster, tp, pp)
    out: list[Layout] = []
    if tp in (None, 1) and pp in (None, 1):
        if world == 1:
            out += [Layout("single"), Layout("fsdp-offload", shard=1, offload=True)]
        else:
            out += [Layout("ddp", dp=world), Layout("zero1", dp=world), Layout("zero2", dp=world, shard=world),
                    Layout("fsdp", dp=world, shard=world)]
            if cluster.nodes > 1:
                out.append(Layout("hsdp", dp=world, shard=g))
            out.append(Layout("fsdp-offload", dp=world, shard=world, offload=True))
    heads = spec.n_heads or 0
    tps = [tp] if tp else [t for t in range(2, g + 1) if g % t == 0 and heads and heads % t == 0
                           and spec.kv_heads % t == 0]
    pps = [pp] if pp else ([cluster.nodes] if cluster.nodes > 1 and (spec.n_layers or 0) >= cluster.nodes else [])
    combos = {(t, 1) for t in tps if t > 1} | {(1, p) for p in pps if p > 1} | {
        (t, p) for t in tps for p in pps if t > 1 and p > 1}
    for t, p in sorted(combos):
        if world % (t * p):
            continue
        dp = world // (t * p)
        bases = ["fsdp"] if p == 1 else ["ddp", "fsdp"]
        for base in bases:
            if dp == 1 and base == "fsdp" and len(bases) > 1:
                continue
            out.append(Layout(_strategy_for(base, t, p, dp), dp=dp, tp=t, pp=p, shard=dp if base == "fsdp" else 1))
    return out


def _validate_degrees(spec: ModelSpec, cluster: Cluster, tp: int | None, pp: int | None) -> None:
    if tp is not None:
        if tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {tp}.")
        if spec.n_heads and spec.n_heads % tp:
            divisors = [d for d in range(1, spec.n_heads + 1) if spec.n_heads % d == 0]
            raise ConfigError(f"--tp {tp} does not divide the {spec.n_heads} attention heads of {spec.name}; "
                              f"allowed: {', '.join(map(str, divisors))}.")
        if cluster.gpus_per_node % tp:
            raise ConfigError(f"--tp {tp} must divide --gpus-per-node {cluster.gpus_per_node} "
                              "(tensor parallelism stays inside a node).")
    if pp is not None:
        if pp < 1:
            raise ConfigError(f"--pp must be >= 1, got {pp}.")
        if spec.n_layers and pp > spec.n_layers:
            raise ConfigError(f"--pp {pp} asks for more pipeline stages than {spec.name}'s {spec.n_layers} layers; "
                              f"use at most {spec.n_layers}.")
    if cluster.world % ((tp or 1) * (pp or 1)):
        raise ConfigError(f"--tp {tp or 1} x --pp {pp or 1} must divide the {cluster.world} GPUs.")


def _grad_accum(work: Workload, layout: Layout, world: int) -> tuple[int, str]:
    if work.grad_accum is not None:
        return work.grad_accum, ""
    global_batch = work.global_batch or work.micro_batch * world
    per_pass = work.micro_batch * layout.dp
    accum = max(1, math.ceil(global_batch / per_pass))
    note = "" if accum * per_pass == global_batch else f"global batch rounded to {accum * per_pass}"
    return accum, note


def predict_step_time(spec: ModelSpec, cluster: Cluster, work: Workload, layout: Layout,
                      calib: Calibration | None = None) -> StepTime:
    """Step time of one layout alone (``evaluate`` without the memory model)."""
    calib = calib or cluster.calibration
    accum, _ = _grad_accum(work, layout, cluster.world)
    return step_time(spec, layout, precision(work.precision), cluster.fabric(work.precision, calib), seq=work.seq,
                     micro_batch=work.micro_batch, grad_accum=accum, checkpoint=work.checkpoint,
                     every=work.ac_every, grad_sync=work.grad_sync, kernels=work.kernels, calib=calib)


def evaluate(spec: ModelSpec, cluster: Cluster, work: Workload, layout: Layout,
             calib: Calibration | None = None) -> Candidate:
    """Memory and time of one layout (``calib``: the GPU's fitted constants unless given)."""
    calib = calib or cluster.calibration
    prec = precision(work.precision)
    accum, note = _grad_accum(work, layout, cluster.world)
    mem = memory_breakdown(spec, layout, prec, work.optimizer, seq=work.seq, micro_batch=work.micro_batch,
                           checkpoint=work.checkpoint, grad_accum=accum, gpus_per_node=cluster.gpus_per_node,
                           attention=work.attention, every=work.ac_every, grad_sync=work.grad_sync,
                           fragmentation=calib.fragmentation, kernels=work.kernels)
    time = predict_step_time(spec, cluster, work, layout, calib)
    budget = cluster.usable_gib * GIB * (1 - work.safety_margin)
    host_ram = (cluster.host_ram_gib or cluster.gpu.host_ram_gib) * GIB
    host_fits = mem.host_bytes <= 0.8 * host_ram  # leave 20% of host RAM to the OS, data loaders
    return Candidate(layout, accum, mem, time, mem.total <= budget and host_fits, budget, host_fits, note)


# Planner precision (how bytes are stored) -> the trainer's parallel.precision setting.
TRAIN_PRECISION = {"fp32": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed", "bf16-fp32grad": "bf16-mixed"}


def launch_commands(cand: Candidate, cluster: Cluster, work: Workload) -> list[str]:
    """`shardwise train`, the plain single-node torchrun and the multi-node torchrun forms."""
    lay = cand.layout
    sets = list(work.extra_sets)
    sets += [f"parallel.precision={TRAIN_PRECISION[work.precision]}", f"train.micro_batch_size={work.micro_batch}",
             f"train.grad_accum_steps={cand.grad_accum}"]
    if work.checkpoint != "none":
        sets.append(f"parallel.activation_checkpointing={work.checkpoint}")
    if work.checkpoint == "selective":
        sets.append(f"parallel.ac_every={work.ac_every}")
    if lay.tp > 1:
        sets.append(f"parallel.tp={lay.tp}")
    if lay.pp > 1:
        sets += [f"parallel.pp={lay.pp}", f"parallel.pp_microbatches={cand.grad_accum}"]
    if lay.strategy == "hsdp":
        sets.append(f"parallel.hsdp_shard_size={lay.shard}")
    set_args = " ".join(f"--set {s}" for s in sets)
    args = f"{work.recipe} --strategy {lay.strategy} {set_args}"
    g, n = cluster.gpus_per_node, cluster.nodes
    train = f"shardwise train {work.recipe} --strategy {lay.strategy} --nproc {g} {set_args}"
    if n > 1:
        train += f"   # on each of the {n} nodes, or use the torchrun form below"
    return [
        train,
        f"torchrun --nproc-per-node={g} -m shardwise.runtime.worker {args}",
        f"torchrun --nproc-per-node={g} --nnodes={n} --node-rank=$NODE_RANK --rdzv-backend=c10d "
        f"--rdzv-endpoint=$MASTER_ADDR:29500 -m shardwise.runtime.worker {args}",
    ]


def make_plan(spec: ModelSpec, cluster: Cluster, work: Workload, *, tp: int | None = None,
              pp: int | None = None, calib: Calibration | None = None) -> Plan:
    """Evaluate every candidate; recommend the fastest one that fits with the safety margin.

    "Cheapest" is the highest predicted tokens/s per GPU (the fewest GPU-hours per token) on the
    cluster given; on a tie the simpler strategy (earlier in the list) wins.
    """
    calib = calib or cluster.calibration
    warnings: list[str] = []
    if not calib.fitted_runs:
        warnings.append(f"no published training run calibrates {cluster.gpu.name}: step times use the default "
                        "constants (docs/planner.md lists the GPUs that are calibrated); memory is unaffected.")
    if not spec.has_structure:
        warnings.append(f"{spec.name}: only a parameter count is known, so activations and the attention "
                        "FLOPs are not modelled (counted as 0). Pass --hf-config, a preset or "
                        "--layers/--hidden/--heads/--vocab for a complete answer.")
    if spec.max_seq and work.seq > spec.max_seq and spec.arch == "gpt" and spec.learned_positions:
        warnings.append(f"--seq {work.seq} exceeds {spec.name}'s {spec.max_seq} learned positions.")
    cands = [evaluate(spec, cluster, work, lay, calib) for lay in enumerate_layouts(spec, cluster, tp, pp)]
    fitting = [c for c in cands if c.fits]
    best = max(fitting, key=lambda c: c.time.tokens_per_s_per_gpu, default=None)
    rejected = []
    for c in cands:
        if c is best:
            continue
        if not c.fits:
            if not c.host_fits:
                why = (f"needs {c.memory.host_bytes / GIB:.0f} GiB of host RAM per node for offloaded state, "
                       f"has {cluster.host_ram_gib or cluster.gpu.host_ram_gib:.0f}")
            else:
                why = (f"needs {c.memory.total / GIB:.1f} GiB, has {cluster.gpu.memory_gib:.0f} "
                       f"({c.budget_bytes / GIB:.1f} usable after the {RUNTIME_RESERVE_GIB:.0f} GiB runtime "
                       f"reserve and {work.safety_margin:.0%} margin)")
        else:
            why = (f"fits ({c.memory.total / GIB:.1f} GiB) but slower: {c.time.tokens_per_s_per_gpu:,.0f} "
                   f"tokens/s/GPU vs {best.time.tokens_per_s_per_gpu:,.0f}") if best else "fits"
        rejected.append(f"{c.name}: {why}")
    commands = launch_commands(best, cluster, work) if best else []
    if best is None:
        warnings.append("nothing fits: try activation checkpointing (--checkpoint full), a smaller "
                        "--micro-batch or --seq, more GPUs, or a GPU with more memory.")
    return Plan(spec, cluster, work, cands, best, rejected, commands, warnings, calib)
