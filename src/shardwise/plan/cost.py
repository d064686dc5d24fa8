"""FLOPs, step time (compute, exposed communication, pipeline bubble), tokens/s and MFU.

Conventions (also in docs/planner.md):

* FLOPs per token = 6 * N_matmul + 12 * L * (a * d_head) * s: forward + backward = 3 x forward,
  a multiply-add is 2 FLOPs, embedding look-ups are free (N_matmul = all parameters minus untied
  input-embedding and position tables; a tied head counts once as a matmul), and the attention
  score and value products are counted in full, with no halving for the causal mask (the PaLM
  appendix-B / nanoGPT / Megatron MFU convention). Activation recomputation adds hardware FLOPs
  but not model FLOPs: MFU always uses model FLOPs.
* Ring collectives over n ranks of a message of S bytes on a per-GPU, per-direction link of B:
  all-reduce 2(n-1)/n * S/B; all-gather and reduce-scatter (n-1)/n * S/B; point-to-point S/B.
  A mesh dimension that fits inside a node uses the intra-node link, otherwise the inter-node one.
* One calibration set, used for every model and cluster (never tuned per case): see CALIBRATION.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.plan.memory import Layout, Precision
from shardwise.plan.spec import ModelSpec


@dataclass(frozen=True)
class Calibration:
    # Fraction of the dense peak that a transformer step's compute reaches once it is not waiting
    # on communication (kernel efficiency, non-matmul ops, launch gaps). Large-model training
    # reports 40-55 % MFU on A100/H100 (Megatron-LM, torchtitan); 0.45 sits in that band.
    achievable_mfu: float = 0.45
    # Fraction of link bandwidth NCCL reaches on large messages (bus bandwidth / line rate).
    comm_efficiency: float = 0.75
    # Host-side AdamW for fsdp-offload: bytes of optimizer traffic per second per node
    # (read p, g, m, v and write p, m, v: 28 bytes per fp32 parameter).
    host_optimizer_gbs: float = 25.0
    host_link_gbs: float = 25.0  # effective pinned-memory PCIe copy rate per GPU
    # Per-hop latency of a ring step (alpha in the alpha-beta model); what makes many small
    # collectives (TP on a tiny model, FSDP with many units) cost more than their bytes say.
    hop_latency_s: float = 5e-6
    ddp_bucket_bytes: float = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per bucket


CALIBRATION = Calibration()


def matmul_params(spec: ModelSpec) -> int:
    """Parameters that take part in a matmul (see the module docstring)."""
    return spec.n_params - spec.embedding_params()


def flops_per_token(spec: ModelSpec, seq: int) -> float:
    """Model training FLOPs per token: 6 * N_matmul plus the full (unhalved) attention term."""
    attn = 12.0 * (spec.n_layers or 0) * (spec.n_heads or 0) * spec.dim_head * seq if spec.has_structure else 0.0
    return 6.0 * matmul_params(spec) + attn


def hardware_flops_per_token(spec: ModelSpec, seq: int, checkpoint: str) -> float:
    """FLOPs actually executed: full checkpointing re-runs each block's forward (+1/3)."""
    base = flops_per_token(spec, seq)
    return base * 4 / 3 if checkpoint == "full" else base


def all_reduce_s(n: int, size_bytes: float, gbs: float, calls: float = 0, alpha_s: float = 0.0) -> float:
    """Ring all-reduce: 2(n-1)/n * S/B, plus 2(n-1) hops of latency per call."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * size_bytes / (gbs * 1e9) + calls * 2 * (n - 1) * alpha_s


def all_gather_s(n: int, size_bytes: float, gbs: float, calls: float = 0, alpha_s: float = 0.0) -> float:
    """Ring all-gather or reduce-scatter (same cost): (n-1)/n * S/B, plus (n-1) hops per call."""
    return 0.0 if n <= 1 else (n - 1) / n * size_bytes / (gbs * 1e9) + calls * (n - 1) * alpha_s


@dataclass(frozen=True)
class Fabric:
    """Link bandwidths one rank sees (per GPU, per direction, GB/s), already scaled by efficiency."""

    gpus_per_node: int
    intra_gbs: float
    inter_gbs: float
    peak_tflops: float

    def link_for(self, group: int, stride: int) -> float:
        """Bandwidth of a group of ``group`` ranks ``stride`` apart: intra-node if it fits in a node."""
        return self.intra_gbs if group * stride <= self.gpus_per_node else self.inter_gbs


@dataclass
class StepTime:
    compute_s: float
    comm_exposed_s: float
    bubble_s: float
    comm_total_s: float
    tokens_per_step: int
    world: int
    model_flops_per_token: float
    peak_tflops: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_exposed_s + self.bubble_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.world if self.step_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_s_per_gpu / (self.peak_tflops * 1e12)


def step_time(spec: ModelSpec, layout: Layout, prec: Precision, fabric: Fabric, *, seq: int, micro_batch: int,
              grad_accum: int, checkpoint: str = "none", offload_state_bytes: int = 0,
              calib: Calibration = CALIBRATION) -> StepTime:
    """Predicted time of one optimizer step (``grad_accum`` micro-batches per data-parallel replica)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    tokens_micro = seq * micro_batch
    peak = fabric.peak_tflops * 1e12
    # Each GPU does 1/(tp*pp) of its replica's FLOPs (layers split across stages, matmuls across TP).
    flops_micro = hardware_flops_per_token(spec, seq, checkpoint) * tokens_micro / (tp * pp)
    compute_micro = flops_micro / (peak * calib.achievable_mfu)
    compute = compute_micro * grad_accum

    # Mesh order, innermost first: tp (stride 1), then the data-parallel dims, then pp.
    local_params = math.ceil(spec.n_params / (tp * pp))
    exposed = total = 0.0
    alpha = calib.hop_latency_s
    units = (spec.n_layers or 1) / pp + 1  # FSDP units on this rank: its blocks and the root
    sharding = layout.sharding
    if layout.strategy.startswith("hsdp"):
        shard, replicate = layout.shard, dp // layout.shard
    else:
        shard, replicate = (dp, 1) if sharding in ("fsdp", "zero2") else (1, dp)
    if sharding in ("replicate", "zero1") and dp > 1:
        bw = fabric.link_for(dp, tp)
        grad_bytes = prec.grad * local_params
        ar = all_reduce_s(dp, grad_bytes, bw, math.ceil(grad_bytes / calib.ddp_bucket_bytes), alpha)
        # Gradients sync once per step (no_sync during accumulation); DDP overlaps the all-reduce
        # with the last micro-batch's backward (2/3 of its compute).
        exposed += max(0.0, ar - compute_micro * 2 / 3)
        total += ar
        if sharding == "zero1":  # updated parameters are broadcast after the step: not overlapped
            bc = all_gather_s(dp, prec.param * local_params, bw, len(spec.params) or 1, alpha)
            exposed += bc
            total += bc
    if sharding in ("zero2", "fsdp") and shard > 1:
        bw = fabric.link_for(shard, tp)
        gathers = 1 if sharding == "zero2" else 2  # zero2 keeps params unsharded through backward
        per_micro = (gathers * all_gather_s(shard, prec.param * local_params, bw, units, alpha)
                     + all_gather_s(shard, prec.grad * local_params, bw, units, alpha))
        # Prefetching overlaps the collectives with compute; the first unit's gather cannot be hidden.
        first_unit = all_gather_s(shard, prec.param * spec.largest_unit_params() / tp, bw, 1, alpha)
        exposed += grad_accum * (max(0.0, per_micro - compute_micro) + first_unit)
        total += grad_accum * per_micro
        if replicate > 1:  # HSDP: all-reduce of the shard across replicas, once per step
            ar = all_reduce_s(replicate, prec.grad * local_params / shard, fabric.link_for(replicate, tp * shard),
                              units, alpha)
            exposed += max(0.0, ar - compute_micro * 2 / 3)
            total += ar
    if layout.offload:
        # Sharded params in, gradients out over PCIe each micro-batch (overlapped like the
        # gathers); the optimizer step then runs on the host and is fully exposed.
        shard_bytes = local_params / max(shard, 1)
        h2d = grad_accum * shard_bytes * (prec.param + prec.grad) / (calib.host_link_gbs * 1e9)
        exposed += max(0.0, h2d - compute)
        host_opt = (shard_bytes * 28 * fabric.gpus_per_node) / (calib.host_optimizer_gbs * 1e9)
        exposed += host_opt
        total += h2d
    if tp > 1 and spec.has_structure:
        # Megatron TP(+SP): per block, 2 all-reduces (or all-gather + reduce-scatter pairs, same
        # volume) in forward and 2 in backward, plus 2 more when the forward is recomputed.
        act = tokens_micro * (spec.hidden or 0) * prec.act
        per_layer = (6 if checkpoint == "full" else 4) * all_reduce_s(tp, act, fabric.link_for(tp, 1), 1, alpha)
        tp_s = grad_accum * per_layer * _busiest_stage_layers(spec, layout)
        exposed += tp_s
        total += tp_s
    bubble = 0.0
    if pp > 1:
        # Activations cross each stage boundary forward and gradients backward, per micro-batch.
        act = tokens_micro * (spec.hidden or 0) * prec.act
        p2p = grad_accum * 2 * (act / (fabric.link_for(pp, tp * dp) * 1e9) + alpha)
        exposed += p2p
        total += p2p
        # 1F1B / GPipe idle fraction (p-1)/(m+p-1) of the step; interleaved with v chunks per rank:
        # (p-1)/(v*m+p-1). Equivalently, idle time = compute * (p-1)/(v*m).
        v = layout.virtual_stages
        bubble = compute * (pp - 1) / (v * grad_accum)
    tokens_per_step = tokens_micro * grad_accum * dp
    return StepTime(compute, exposed, bubble, total, tokens_per_step, layout.world,
                    flops_per_token(spec, seq), fabric.peak_tflops)


def _busiest_stage_layers(spec: ModelSpec, layout: Layout) -> int:
    """Blocks on the busiest pipeline rank, split as the runtime splits them (all of them without PP)."""
    n_layers = spec.n_layers or 1
    if layout.pp == 1:
        return n_layers
    if layout.n_blocks is None:
        layout = layout.with_blocks(n_layers)
    return max(len(layout.rank_layers(r)) for r in range(layout.pp))


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1)/(v*m+p-1) (v=1: GPipe and 1F1B)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)
