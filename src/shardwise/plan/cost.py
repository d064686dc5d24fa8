"""FLOPs, step time (compute, exposed communication, pipeline bubble), tokens/s and MFU.

Conventions (also in docs/planner.md):

* Model FLOPs per token = 6 * N_matmul + 12 * L * (a * d_head) * s: forward + backward = 3 x
  forward, a multiply-add is 2 FLOPs, embedding look-ups are free (N_matmul = all parameters minus
  untied input-embedding and position tables; a tied head counts once as a matmul), and the
  attention score and value products are counted in full, with no halving for the causal mask
  (the PaLM appendix-B / nanoGPT / Megatron MFU convention). MFU always uses model FLOPs.
* Compute time of a micro-batch has three parts, each at its own rate:
  matmul FLOPs (recomputed ones included) at ``peak * matmul ceiling * matmul_factor``;
  attention-core FLOPs at ``peak * attention ceiling * attention_factor`` (the ceilings: the GPU's
  published kernel measurements, presets.KERNEL_CEILINGS; the factors fitted inside FACTOR_BANDS);
  and the memory-bound ops (norms, activations, rotary, residual
  adds, the loss's log-softmax) as bytes moved at the GPU's memory bandwidth, estimated as
  ``elementwise_passes`` times the bytes those ops save for backward. The last term is why small
  models and GPUs with a high FLOP/byte ratio (H100) reach a lower MFU than large models on A100.
* Ring collectives over n ranks of a message of S bytes at bus bandwidth B: all-reduce
  2(n-1)/n * S/B; all-gather and reduce-scatter (n-1)/n * S/B; point-to-point S/B, plus a hop
  latency per ring step. B inside a node is the intra-node link; a group spanning nodes uses its
  members' share of the node's NICs (``Fabric.collective_gbs``: NCCL runs one ring per NIC, so k
  members per node move data at k NICs' rate), never one GPU's NIC for the whole node.
* The constants (``Calibration``) are fitted per GPU generation on published training runs by
  ``benchmarks/calibrate_planner.py`` (data: ``benchmarks/published_runs.json``); the fitted values
  live in ``CALIBRATIONS`` below. Never tuned per case.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from shardwise.core.pp_schedules import p2p_messages_per_step, recompute_passes, waited_transfers
from shardwise.plan.cp import cp_comm_s, cp_degree
from shardwise.plan.memory import (
    SHARDWISE_KERNELS,
    Kernels,
    Layout,
    Precision,
    _memo,
    ddp_bucket_count,
    layer_activation_bytes,
    outer_activation_bytes,
    recompute_share,
    reduce_bytes,
    routed_expert_numel,
    stage_boundary_bytes,
)
from shardwise.plan.moe import all_to_all_s as ep_all_to_all_s
from shardwise.plan.moe import inactive_matmul_params
from shardwise.plan.pipeline import idle_ratio
from shardwise.plan.presets import FLASH1_OF_FLASH2, UNMEASURED_CEILINGS, training_attention_fraction
from shardwise.plan.spec import ModelSpec

# Typical fractions of the dense peak where nothing better is known: the weak priors of the
# calibration fit (benchmarks/calibrate_planner.py) and, over the unmeasured GPUs' ceilings, a
# hand-built Calibration's factors. Large training GEMMs at 0.6; flash attention at
# FlashAttention-2's typical A100 rate, the midpoint of its published 50-73 % of peak (Dao 2023,
# arXiv:2307.08691, abstract; FLOPs a causal kernel runs), in the planner's convention
# (presets.training_attention_fraction: unhalved causal FLOPs, backward = 2 forwards): 1.05.
# It was 0.5 until 2026-11-29: the published percentage taken as a fraction of the unhalved FLOPs,
# half the rate the paper measured.
TYPICAL_OF_PEAK: dict[str, float] = {"matmul": 0.6, "attention": training_attention_fraction(0.615, 0.615)}


@dataclass(frozen=True)
class Calibration:
    """Constants of the time and memory model for one GPU generation (see CALIBRATIONS)."""

    name: str = "default"
    # Fraction of the GPU's measured GEMM ceiling (presets.ceiling: the best shape's rate) that a
    # training run's GEMMs reach; fitted inside FACTOR_BANDS.
    matmul_factor: float = TYPICAL_OF_PEAK["matmul"] / UNMEASURED_CEILINGS["matmul"]
    # Fraction of the GPU's measured flash-attention ceiling that a run's attention reaches (the
    # ceiling counts unhalved FLOPs: a causal kernel skips the masked half); fitted inside FACTOR_BANDS.
    attention_factor: float = TYPICAL_OF_PEAK["attention"] / UNMEASURED_CEILINGS["attention"]
    # Fraction of a link's line rate that NCCL reaches (bus bandwidth / line rate).
    link_efficiency: float = 0.75
    # Bytes the memory-bound ops move (forward and backward) per byte they save for backward.
    elementwise_passes: float = 4.0
    # Caching-allocator overhead: published peaks are reserved memory, the model counts live
    # tensors; reserved = allocated x (1 + fragmentation).
    fragmentation: float = 0.05
    # Host-side AdamW for fsdp-offload: bytes of optimizer traffic per second per node
    # (read p, g, m, v and write p, m, v: 28 bytes per fp32 parameter).
    host_optimizer_gbs: float = 25.0
    host_link_gbs: float = 25.0  # effective pinned-memory PCIe copy rate per GPU
    # Per-hop latency of a ring step (alpha in the alpha-beta model); what makes many small
    # collectives (TP on a tiny model, FSDP with many units) cost more than their bytes say.
    hop_latency_s: float = 5e-6
    ddp_bucket_bytes: float = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per bucket
    fitted_runs: int = 0  # published runs the constants were fitted on (0: defaults, not fitted)


# How far a fit may move each rate below its published ceiling (presets.KERNEL_CEILINGS), per
# generation, and why (docs/planner.md, "Calibration per GPU generation"):
# * matmul: at most 1.0 (a run's GEMMs never beat the best measured shape); at least the fraction
#   at which a GEMM-bound layout still reaches the highest FLOPs utilisation a published run of that
#   generation reached (benchmarks/published_runs.json; the FLOPs a run executes: causal attention
#   halved), rounded up to 0.05: A100 61.8 % (MPT-7B on 8 A100 80GB) / 0.869 -> 0.75; H100 56.1 %
#   (NeMo's Llama 3.1 405B proxy, 7 layers, on 32 H100: dgxc-benchmarking) / 0.803 -> 0.70 (0.65
#   until that source was added, 2026-11-28, when the highest was Megatron-LM 2024's GPT 16B). So no
#   fit can cap the predicted MFU below what a published run reached (tests/test_plan_calibration.py
#   checks this rule against every run of the data).
# * attention 0.35-1.0: the ceiling is the run's own kernel class (Kernels.attention_kernel:
#   FlashAttention-2, or the generation's newest, FlashAttention-3 / cuDNN on H100); the published
#   stacks also ran older ones still, FlashAttention-1 at 25-40 % of the A100's peak against
#   FlashAttention-2's 73 % (0.34-0.55), non-causal.
ATTENTION_BAND = (0.35, 1.0)
FACTOR_BANDS: dict[str, dict[str, tuple[float, float]]] = {
    "a100": {"matmul_factor": (0.75, 1.0), "attention_factor": ATTENTION_BAND},
    "h100": {"matmul_factor": (0.70, 1.0), "attention_factor": ATTENTION_BAND},
}

# Fitted by benchmarks/calibrate_planner.py on benchmarks/published_runs.json (run it to
# reproduce; it prints these lines). Shared constants (elementwise, fragmentation) are fitted
# jointly over all generations; the factors and the link efficiency per generation, each with a
# weak prior (calibrate_planner.PRIORS, GENERATION_PRIORS) and inside FACTOR_BANDS.
CALIBRATIONS: dict[str, Calibration] = {
    "a100": Calibration("a100", matmul_factor=0.7712, attention_factor=0.9999, link_efficiency=0.6908,
                        elementwise_passes=9.616, fragmentation=0.1428, fitted_runs=41),
    "h100": Calibration("h100", matmul_factor=0.7291, attention_factor=0.9999, link_efficiency=0.7615,
                        elementwise_passes=9.616, fragmentation=0.1428, fitted_runs=20),
}

# GPUs no published run calibrates (L40S, RTX 4090, MI300X, a custom spec without a calibration
# key): the mean of the fitted generations, flagged as not fitted so `plan` warns.
DEFAULT_CALIBRATION = Calibration(
    "default", **{k: sum(getattr(c, k) for c in CALIBRATIONS.values()) / len(CALIBRATIONS)
                  for k in ("matmul_factor", "attention_factor", "link_efficiency", "elementwise_passes",
                            "fragmentation")})
CALIBRATION = DEFAULT_CALIBRATION  # kept for callers that want the uncalibrated defaults
# DDP's first bucket once it has rebuilt its buckets in gradient-ready order (and from the start under
# find_unused_parameters): torch's dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB.
DDP_FIRST_BUCKET_BYTES = 2**20


def calibration_for(calibration_key: str) -> Calibration:
    """The fitted constants for a GPU's ``calibration`` key ("" or unknown: the defaults)."""
    return CALIBRATIONS.get(calibration_key, DEFAULT_CALIBRATION)


def matmul_params(spec: ModelSpec) -> int:
    """Parameters that take part in a matmul (see the module docstring)."""
    # MoE: a token passes through top_k of the experts only (plan/moe.py).
    return spec.n_params - spec.embedding_params() - inactive_matmul_params(spec)


def block_matmul_params(spec: ModelSpec) -> int:
    """Matmul parameters inside the repeated blocks (what checkpointing recomputes)."""
    if spec.params:
        return spec.block_matrix_params - inactive_matmul_params(spec)
    return max(matmul_params(spec) - (0 if spec.tied_embeddings else (spec.vocab or 0) * (spec.hidden or 0)), 0)


def attention_flops_per_token(spec: ModelSpec, seq: int) -> float:
    """Training FLOPs of the attention core per token: 3 x (QK^T + AV) = 12 * L * a * d * s."""
    if not spec.has_structure:
        return 0.0
    return 12.0 * (spec.n_layers or 0) * (spec.n_heads or 0) * spec.dim_head * seq


def flops_per_token(spec: ModelSpec, seq: int) -> float:
    """Model training FLOPs per token: 6 * N_matmul plus the full (unhalved) attention term."""
    return 6.0 * matmul_params(spec) + attention_flops_per_token(spec, seq)


def hardware_flops_per_token(spec: ModelSpec, seq: int, checkpoint: str, every: int = 2) -> float:
    """FLOPs actually executed: model FLOPs plus the forward work checkpointing repeats."""
    share = recompute_share(spec, checkpoint, every)
    return (flops_per_token(spec, seq) + 2.0 * block_matmul_params(spec) * share.matmul
            + attention_flops_per_token(spec, seq) / 3 * share.attention)


def all_reduce_s(n: int, size_bytes: float, gbs: float, calls: float = 0, alpha_s: float = 0.0,
                 nodes: int = 1) -> float:
    """All-reduce of S bytes over ``n`` ranks on ``nodes`` nodes: 2(n-1)/n * S/B, plus per call the
    latency of the fewer hops NCCL's two algorithms take (its tuner, graph/tuning.cc, times both and
    runs the faster): the ring's 2(n-1), or the double binary tree's 2((n/nodes - 1) + log2(nodes))
    -- a chain through each node's ranks, a tree across the nodes (NCCL >= 2.4). Inside one node
    the two are the same; across 128 nodes of 8 a call's 2,046 ring hops become 28. The bytes move
    at the ring's bus rate either way (NCCL's trees reach it for large messages)."""
    if n <= 1:
        return 0.0
    hops = 2 * (n - 1)
    if nodes > 1:
        hops = min(hops, 2 * (max(1, n // nodes) - 1) + 2 * math.ceil(math.log2(nodes)))
    return 2 * (n - 1) / n * size_bytes / (gbs * 1e9) + calls * hops * alpha_s


def all_gather_s(n: int, size_bytes: float, gbs: float, calls: float = 0, alpha_s: float = 0.0) -> float:
    """Ring all-gather or reduce-scatter (same cost): (n-1)/n * S/B, plus (n-1) hops per call."""
    return 0.0 if n <= 1 else (n - 1) / n * size_bytes / (gbs * 1e9) + calls * (n - 1) * alpha_s


@dataclass(frozen=True)
class Fabric:
    """What one rank sees: link bandwidths (GB/s per GPU per direction, after efficiency), peaks."""

    gpus_per_node: int
    intra_gbs: float
    nic_gbs: float  # this GPU's share of its node's inter-node bandwidth
    peak_tflops: float
    mem_bw_tbs: float = 2.0
    # The GPU's published kernel ceilings as fractions of ``peak_tflops`` (presets.ceiling); a
    # Fabric built by hand gets the unmeasured GPUs' values.
    matmul_ceiling: float = UNMEASURED_CEILINGS["matmul"]
    attention_ceiling: float = UNMEASURED_CEILINGS["attention"]  # the GPU's best attention kernel
    attention_flash2_ceiling: float = UNMEASURED_CEILINGS["attention"]  # FlashAttention-2's on it

    @property
    def inter_gbs(self) -> float:
        return self.nic_gbs

    def collective_gbs(self, group: int, stride: int) -> float:
        """Bus bandwidth of a ring collective over ``group`` ranks ``stride`` ranks apart.

        Inside a node: the intra-node link. Across nodes: NCCL builds one ring per NIC, so the
        k members of the group on each node move data at k NICs' rate (k = gpus_per_node / stride,
        at most the group size), capped by the intra-node link the rings also cross. A data-parallel
        group of one rank per node (stride >= gpus_per_node, e.g. under TP 8) gets one NIC.
        """
        if group * stride <= self.gpus_per_node:
            return self.intra_gbs
        return min(self.intra_gbs, self._members_per_node(group, stride) * self.nic_gbs)

    def _members_per_node(self, group: int, stride: int) -> int:
        """Members of a group of ``group`` ranks ``stride`` apart that share a node (one at least)."""
        return max(1, min(group, self.gpus_per_node // max(stride, 1)))

    def nodes_spanned(self, group: int, stride: int) -> int:
        """Nodes a group of ``group`` ranks ``stride`` ranks apart spans."""
        if group * stride <= self.gpus_per_node:
            return 1
        return math.ceil(group / self._members_per_node(group, stride))

    def link_for(self, group: int, stride: int) -> float:
        """Alias of ``collective_gbs`` (older name)."""
        return self.collective_gbs(group, stride)

    def matmul_flops_per_s(self, calib: Calibration) -> float:
        """The rate of the training GEMMs: peak x measured ceiling x the fitted factor."""
        return self.peak_tflops * 1e12 * self.matmul_ceiling * calib.matmul_factor

    def attention_flops_per_s(self, calib: Calibration, kernel: str = "flash2") -> float:
        """The rate of the attention core on unhalved FLOPs: peak x the measured ceiling of ``kernel``
        (memory.ATTENTION_KERNELS: "flash1" FlashAttention-1's class, "flash2" FlashAttention-2, "flash3" the
        GPU's best) x the fitted factor."""
        top = self.attention_ceiling if kernel == "flash3" else self.attention_flash2_ceiling
        if kernel == "flash1":
            top *= FLASH1_OF_FLASH2
        return self.peak_tflops * 1e12 * top * calib.attention_factor


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


def micro_batch_compute_s(spec: ModelSpec, prec: Precision, fabric: Fabric, *, seq: int, micro_batch: int,
                          checkpoint: str, every: int, calib: Calibration, tp: int = 1, pp: int = 1,
                          kernels: Kernels = SHARDWISE_KERNELS, attention: str = "sdpa") -> float:
    """Seconds one GPU computes on one micro-batch (its 1/(tp*pp) share of the replica's work).

    ``attention`` "math" materialises each head's s x s scores (softmax, dropout): their bytes join
    the memory-bound traffic, as every tensor a block saves for backward does."""
    tokens = seq * micro_batch
    share = recompute_share(spec, checkpoint, every)
    attn = attention_flops_per_token(spec, seq) * (1 + share.attention / 3)
    matmul = hardware_flops_per_token(spec, seq, checkpoint, every) - attn
    # Without a fused kernel ("math") the scores and the weighted sum are cuBLAS batched matmuls over
    # the whole s x s (the causal mask applied after): the unhalved FLOPs, at the matmul rate.
    attn_rate = (fabric.matmul_flops_per_s(calib) if attention == "math"
                 else fabric.attention_flops_per_s(calib, kernels.attention_kernel))
    t = tokens * (matmul / fabric.matmul_flops_per_s(calib) + attn / attn_rate)
    if spec.has_structure:
        # Memory-bound ops: proportional to what they save for backward (per block and the loss),
        # and repeated for the recomputed share of the forward.
        layer = layer_activation_bytes(spec, seq, micro_batch, prec.act, kernels=kernels, attention=attention)
        outer = outer_activation_bytes(spec, seq, micro_batch, prec.act, kernels=kernels)
        moved = calib.elementwise_passes * ((spec.n_layers or 0) * layer * (1 + share.elementwise / 3) + outer)
        t += moved / (fabric.mem_bw_tbs * 1e12)
    return t / (tp * pp)


def step_time(spec: ModelSpec, layout: Layout, prec: Precision, fabric: Fabric, *, seq: int, micro_batch: int,
              grad_accum: int, checkpoint: str = "none", every: int = 2, grad_sync: str = "step",
              kernels: Kernels = SHARDWISE_KERNELS, offload_state_bytes: int = 0,
              calib: Calibration = DEFAULT_CALIBRATION, cp_impl: str = "alltoall", attention: str = "sdpa") -> StepTime:
    """Predicted time of one optimizer step (``grad_accum`` micro-batches per data-parallel replica).

    ``cp_impl``: how context parallel moves the sequence (plan/cp.py): the all-to-alls (not
    overlapped) or the ring (its steps hide behind the attention kernels of the remote blocks).

    ``grad_sync`` "step" reduces gradients once per step (shardwise's no_sync); "microbatch"
    reduce-scatters after every micro-batch (FSDP1 / torchtitan). ``kernels`` describes the stack
    (memory.Kernels; shardwise's by default: TP collectives do not overlap the matmuls).
    """
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    tokens_micro = seq * micro_batch
    compute_micro = micro_batch_compute_s(spec, prec, fabric, seq=seq, micro_batch=micro_batch,
                                          checkpoint=checkpoint, every=every, calib=calib, tp=tp, pp=pp,
                                          kernels=kernels, attention=attention)
    # The zero-bubble schedules recompute a checkpointed block in each of their two backward passes
    # (core/pp_schedules.recompute_passes): the second costs what the first does.
    passes = recompute_passes(layout.pp_schedule) if pp > 1 and checkpoint != "none" else 1
    if passes > 1:
        plain = micro_batch_compute_s(spec, prec, fabric, seq=seq, micro_batch=micro_batch, checkpoint="none",
                                      every=every, calib=calib, tp=tp, pp=pp, kernels=kernels, attention=attention)
        compute_micro += (passes - 1) * (compute_micro - plain)
    # Context parallel (plan/cp.py): each rank computes 1/cp of every sequence (attention: the
    # whole sequence for heads/cp heads, or its queries against every K/V block on the ring), plus
    # the all-to-alls around attention (not overlapped) or the ring's steps.
    cp = cp_degree(layout)
    compute_micro /= cp
    compute_micro *= stage_imbalance(spec, layout, seq, checkpoint, every)
    share = recompute_share(spec, checkpoint, every)
    cp_s = cp_comm_s(spec, layout, fabric, prec.act, seq=seq, micro_batch=micro_batch,
                     layers=_busiest_stage_layers(spec, layout), recompute=share.cp_collectives * passes,
                     alpha_s=calib.hop_latency_s, impl=cp_impl) * grad_accum
    cp_exposed = cp_s
    if cp > 1 and cp_impl == "ring":
        # torch's ring sends each K/V block before computing on the one it holds: the transfers hide
        # behind the attention kernels of the cp-1 remote blocks (forward, backward and recompute).
        attn_s = (seq * micro_batch * attention_flops_per_token(spec, seq) * (1 + share.attention / 3)
                  / fabric.attention_flops_per_s(calib, kernels.attention_kernel) / (tp * pp * cp))
        cp_exposed = max(0.0, cp_s - attn_s * (cp - 1) / cp * grad_accum)
    if kernels.loss == "chunked" and spec.hidden and spec.vocab:
        # The chunked loss recomputes each chunk's logits in backward: one more head forward.
        compute_micro += 2 * seq // cp * micro_batch * spec.hidden * spec.vocab / fabric.matmul_flops_per_s(calib)
    # Expert parallel (plan/moe.py): token dispatch + combine all-to-alls, forward, backward and
    # recompute, for the MoE layers of this rank's pipeline stage(s) only; the ep ranks are
    # ``Layout.ep_stride`` apart (consecutive data-parallel ranks, tp apart; consecutive ranks under
    # Megatron's folding), so the group's link is NVLink while it fits in a node. Exposed unless
    # the stack overlaps them with another micro-batch's compute (Kernels.ep_overlap).
    ep = getattr(layout, "ep", 1) or 1
    ep_s = ep_all_to_all_s(spec, seq // cp * micro_batch, ep, fabric.collective_gbs(ep, layout.ep_stride), prec.act,
                           calib.hop_latency_s, layers=moe_layers_on_busiest_stage(spec, layout),
                           recompute=share.ep_collectives) * grad_accum if ep > 1 else 0.0
    compute = compute_micro * grad_accum
    ep_exposed = max(0.0, ep_s - compute) if kernels.ep_overlap else ep_s

    # Mesh order, innermost first: tp (stride 1), then the data-parallel dims, then pp.
    local_params = math.ceil(spec.n_params / (tp * pp))
    exposed = total = 0.0
    alpha = calib.hop_latency_s
    # Expert parallel under a replicating / ZeRO-1 stack (Megatron, DeepSpeed-MoE): a rank holds
    # n_experts / ep of its stage's experts (whole under TP), whose gradients are reduced over the
    # expert data-parallel group (Layout.expert_dp, ranks ep_stride x ep apart), the rest over dp.
    # (FSDP kinds shard the experts with the rest: plan/moe.py.)
    expert_local, edp, edp_stride = _expert_reduce_group(spec, layout)
    if expert_local:
        local_params = max(0, local_params - math.ceil(spec.moe.routed_params / (tp * pp)))
    units = (spec.n_layers or 1) / pp + 1  # FSDP units on this rank: its blocks and the root
    sharding = layout.sharding
    if layout.strategy.startswith("hsdp"):
        shard, replicate = layout.shard, dp // layout.shard
    else:
        shard, replicate = (dp, 1) if sharding in ("fsdp", "zero2") else (1, dp)
    if sharding == "zero1" and dp > 1 and kernels.dp_overlap:
        # Megatron's distributed optimizer (Kernels.dp_overlap): a bucketed reduce-scatter of the
        # gradients hidden behind the last micro-batch's backward (2/3 of its compute) and a
        # bucketed all-gather of the parameters behind the next step's first forward (1/3).
        # Under a shard group of g < dp ranks (Kernels.zero1_group: Megatron's distributed-optimizer
        # instances) the reduce-scatter and the all-gather stay inside the group, and each rank's
        # 1/g shard of the gradients is all-reduced across the dp / g instances.
        group = layout.zero1_shards
        bw = fabric.collective_gbs(group, tp)
        buckets = math.ceil(local_params / max(40e6, 1e6 * group))
        rs = all_gather_s(group, prec.grad * local_params, bw, buckets, alpha)
        ag = all_gather_s(group, prec.param * local_params, bw, buckets, alpha)
        if group < dp:
            copies = dp // group
            rs += all_reduce_s(copies, prec.grad * local_params / group, fabric.collective_gbs(copies, tp * group),
                               buckets, alpha, fabric.nodes_spanned(copies, tp * group))
        if expert_local:  # the experts' buffer: its own buckets over the expert data-parallel group
            ebw, ebuckets = fabric.collective_gbs(edp, edp_stride), math.ceil(expert_local / max(40e6, 1e6 * edp))
            rs += all_gather_s(edp, prec.grad * expert_local, ebw, ebuckets, alpha)
            ag += all_gather_s(edp, prec.param * expert_local, ebw, ebuckets, alpha)
        exposed += max(0.0, rs - compute_micro * 2 / 3) + max(0.0, ag - compute_micro / 3)
        total += rs + ag
    elif sharding in ("replicate", "zero1") and dp > 1:
        bw = fabric.collective_gbs(dp, tp)
        # The gradient dtype, unless the stack casts for the collective (Kernels.grad_comm_bytes).
        grad_bytes = (kernels.grad_comm_bytes or prec.grad) * local_params
        if kernels.grad_allreduce_after_backward:  # one buffer, reduced after backward (Kernels)
            ar = all_reduce_s(dp, grad_bytes, bw, 1, alpha, fabric.nodes_spanned(dp, tp))
        else:
            buckets = ddp_bucket_count(spec, layout, kernels.grad_comm_bytes or prec.grad, calib.ddp_bucket_bytes,
                                       DDP_FIRST_BUCKET_BYTES)
            ar = all_reduce_s(dp, grad_bytes, bw, buckets or math.ceil(grad_bytes / calib.ddp_bucket_bytes), alpha,
                              fabric.nodes_spanned(dp, tp))
        if expert_local:  # the experts' gradients: over the expert data-parallel group
            expert_bytes = (kernels.grad_comm_bytes or prec.grad) * expert_local
            ar += all_reduce_s(edp, expert_bytes, fabric.collective_gbs(edp, edp_stride),
                               math.ceil(expert_bytes / calib.ddp_bucket_bytes), alpha,
                               fabric.nodes_spanned(edp, edp_stride))
        if kernels.grad_allreduce_after_backward:
            exposed += ar
        else:
            # Gradients sync once per step (no_sync during accumulation); DDP overlaps the
            # all-reduce with the last micro-batch's backward (2/3 of its compute).
            exposed += max(0.0, ar - compute_micro * 2 / 3)
        total += ar
        if sharding == "zero1":  # updated parameters are broadcast after the step: not overlapped
            # (within the shard group, Kernels.zero1_group: every dp rank unless the stack groups them)
            group = layout.zero1_shards
            bc = all_gather_s(group, prec.param * local_params, fabric.collective_gbs(group, tp),
                              len(spec.params) or 1, alpha)
            if expert_local:
                bc += all_gather_s(edp, prec.param * expert_local, fabric.collective_gbs(edp, edp_stride), 1, alpha)
            exposed += bc
            total += bc
    if sharding in ("zero2", "fsdp") and shard > 1:
        bw = fabric.collective_gbs(shard, tp)
        gather = all_gather_s(shard, prec.param * local_params, bw, units, alpha)
        scatter = all_gather_s(shard, reduce_bytes(prec) * local_params, bw, units, alpha)
        if pp > 1:
            # Under a pipeline schedule the stage stays unsharded from its first forward to the
            # step (torch.distributed.pipelining): one gather and one reduce-scatter per step.
            comm, gathers_per_micro = gather + scatter, 0.0
        else:
            gathers_per_micro = 1 if sharding == "zero2" else 2  # zero2 keeps params through backward
            scatters = grad_accum if grad_sync == "microbatch" else 1
            comm = grad_accum * gathers_per_micro * gather + scatters * scatter
        # Prefetching overlaps the collectives with compute; the first unit's gather of each
        # micro-batch cannot be hidden.
        first_unit = all_gather_s(shard, prec.param * spec.largest_unit_params() / tp, bw, 1, alpha)
        exposed += max(0.0, comm - compute) + (grad_accum if gathers_per_micro else 1) * first_unit
        total += comm
        if replicate > 1:  # HSDP: all-reduce of the shard across replicas, once per step
            ar = all_reduce_s(replicate, reduce_bytes(prec) * local_params / shard,
                              fabric.collective_gbs(replicate, tp * shard), units, alpha,
                              fabric.nodes_spanned(replicate, tp * shard))
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
        tp_s = grad_accum * tp_comm_s(spec, layout, prec, fabric, seq=seq, micro_batch=micro_batch,
                                      checkpoint=checkpoint, every=every, alpha_s=alpha)
        # The forward and backward collectives alone (the recomputed forward's aside).
        tp_plain = grad_accum * tp_comm_s(spec, layout, prec, fabric, seq=seq, micro_batch=micro_batch,
                                          alpha_s=alpha)
        if passes > 1:  # the second recomputation's collectives
            tp_s += (passes - 1) * (tp_s - tp_plain)
        exposed += tp_exposed_s(tp_s, tp_plain, compute, kernels.tp_overlap, sp=layout.sequence_parallel)
        total += tp_s
    bubble = 0.0
    if pp > 1:
        p2p, p2p_exposed = pipeline_p2p_s(spec, layout, prec, fabric, seq=seq, micro_batch=micro_batch,
                                          micro_batches=grad_accum, compute_s=compute, alpha_s=alpha)
        exposed += p2p_exposed
        total += p2p
        # Idle time per schedule (plan/pipeline.py): compute * (p-1)/(v*m) for 1F1B-like schedules,
        # a third of that for the zero-bubble ones.
        bubble = compute * idle_ratio(layout.pp_schedule, pp, grad_accum, layout.pp_stages_per_rank)
    exposed += cp_exposed + ep_exposed
    total += cp_s + ep_s
    tokens_per_step = tokens_micro * grad_accum * dp // cp  # cp ranks share their sequences
    return StepTime(compute, exposed, bubble, total, tokens_per_step, layout.world,
                    flops_per_token(spec, seq), fabric.peak_tflops)


def tp_exposed_s(tp_s: float, tp_plain_s: float, compute_s: float, overlap: str, *, sp: bool = True) -> float:
    """The part of a step's TP collectives (``tp_s``; ``tp_plain_s`` of it the forward's and the
    backward's, without recomputation) left on the critical path by the stack's overlap
    (memory.Kernels.tp_overlap).

    "full" pipelines every collective with its GEMM: hidden up to the step's compute. "backward"
    issues only the column-parallel linears' input-gradient collective before their weight-gradient
    GEMM, hidden up to those GEMMs (a third of the compute): under sequence parallel (``sp``) the
    reduce-scatters after QKV's and fc1's input gradients, one of a block's four all-reduce-sized
    collectives (forward: all-gather + reduce-scatter around attention and around the MLP; backward:
    the row linears' all-gathers and those reduce-scatters); without it their two all-reduces, half
    of the block's four (the forward's two follow the row linears). The forward's and the recomputed
    forward's stay exposed. "none": all exposed.
    """
    if overlap == "full":
        return max(0.0, tp_s - compute_s)
    if overlap == "backward":
        return tp_s - min(tp_plain_s / (4 if sp else 2), compute_s / 3)
    return tp_s


def tp_comm_s(spec: ModelSpec, layout: Layout, prec: Precision, fabric: Fabric, *, seq: int, micro_batch: int,
              checkpoint: str = "none", every: int = 2, alpha_s: float = 0.0) -> float:
    """Tensor-parallel collective seconds of one micro-batch on the busiest pipeline rank.

    Megatron TP(+SP): per block, 2 all-reduces (or all-gather + reduce-scatter pairs, same volume)
    in forward and 2 in backward, plus the forward's again where it is recomputed, each of one
    activation of the rank's tokens: ``micro_batch x seq / cp`` under context parallel (a cp rank's
    blocks see only its share of the sequence; the whole sequence was charged before 2026-11-28,
    16 times too much for the Llama 3 paper's CP-16 run).
    """
    if layout.tp == 1:
        return 0.0
    act = micro_batch * (seq // cp_degree(layout)) * (spec.hidden or 0) * prec.act
    redo = recompute_share(spec, checkpoint, every).tp_collectives
    per_layer = (4 + 2 * redo) * all_reduce_s(layout.tp, act, fabric.collective_gbs(layout.tp, 1), 1, alpha_s)
    return per_layer * _busiest_stage_layers(spec, layout)


def pipeline_p2p_s(spec: ModelSpec, layout: Layout, prec: Precision, fabric: Fabric, *, seq: int, micro_batch: int,
                   micro_batches: int, compute_s: float, alpha_s: float) -> tuple[float, float]:
    """Seconds the busiest pipeline rank's links carry its point-to-point messages in one step, and the
    part of them the step waits on: ``(total, exposed)``.

    The count per rank is the schedule's (``core.pp_schedules.p2p_messages_per_step``: every stage
    boundary a rank holds that joins another rank, once per micro-batch, so an interleaved rank with v
    stages sends about 2v messages per micro-batch where 1F1B's end rank sends one); each message is one
    micro-batch's boundary tensor (``memory.stage_boundary_bytes``: its cp chunk, its sequence-parallel
    shard). A rank receives as many as it sends, on the other direction of its links, so one message's
    transfer per message sent; the ranks move in lockstep, at the busiest one's pace.

    Exposed: the transfers the schedule waits on one after another (``waited_transfers``: all of them
    under 1F1B and GPipe, the fill and drain's where torch posts receives early, the gradients under
    DualPipeV), plus whatever the links carry beyond the step's compute.
    """
    v = layout.pp_stages_per_rank
    message = stage_boundary_bytes(spec, layout, seq, micro_batch, prec.act)
    # One transfer per message: the pp group's ranks are tp x dp apart (mesh order tp, dp, pp).
    per_message = message / (fabric.collective_gbs(layout.pp, layout.tp * layout.dp) * 1e9) + alpha_s
    sent, waited = _pipeline_transfers(layout.pp_schedule, layout.pp, v, micro_batches)
    total = sent * per_message
    return total, min(total, waited * per_message + max(0.0, total - compute_s))


@functools.lru_cache(maxsize=256)
def _pipeline_transfers(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> tuple[int, int]:
    """The busiest rank's messages in one step and the transfers the step waits on (core.pp_schedules);
    cached: each walks the stage placement, and the search and the calibration's fit ask the same few."""
    sent = max(p2p_messages_per_step(schedule, pp, stages_per_rank, microbatches, r) for r in range(pp))
    return sent, waited_transfers(schedule, pp, stages_per_rank, microbatches)


def _expert_reduce_group(spec: ModelSpec, layout: Layout) -> tuple[int, int, int]:
    """(expert parameters one rank holds and reduces apart from the rest, the expert data-parallel
    degree, the stride between its ranks) under a replicating / ZeRO-1 stack with expert parallel;
    (0, 1, 1) otherwise. The busiest pipeline rank's MoE layers (moe_layers_on_busiest_stage),
    n_experts / ep of each; the expert data-parallel ranks are an expert group's width apart."""
    info = getattr(spec, "moe", None)
    if info is None or layout.ep <= 1 or layout.sharding not in ("replicate", "zero1"):
        return 0, 1, 1
    layers = moe_layers_on_busiest_stage(spec, layout)
    per_rank = (info.n_moe_layers if layers is None else layers) * info.n_experts // layout.ep * info.params_per_expert
    return per_rank, layout.expert_dp, layout.ep_stride * layout.ep


def _split(spec: ModelSpec, layout: Layout) -> Layout:
    """``layout`` with the model's blocks split into its stages, as the runtime splits them."""
    return layout.with_blocks(spec.n_layers or 1) if layout.n_blocks is None else layout


def moe_layers_on_busiest_stage(spec: ModelSpec, layout: Layout) -> int | None:
    """MoE layers on the pipeline rank that holds the most of them (None: no pipeline, every MoE
    layer): counted from the routed-expert tensors of each rank's stages, which TP leaves whole."""
    info = getattr(spec, "moe", None)
    if info is None or layout.pp == 1 or not spec.params:
        return None
    per_layer = info.n_experts * info.params_per_expert

    def busiest() -> int:
        split = _split(spec, layout)
        return max(round(routed_expert_numel(spec, split, r) / per_layer) for r in range(split.pp))

    return _memo(("moe-busiest", id(spec), layout), spec, busiest)


def stage_imbalance(spec: ModelSpec, layout: Layout, seq: int, checkpoint: str = "none", every: int = 2) -> float:
    """The busiest pipeline rank's compute over an even 1/pp share (1.0 without a pipeline).

    The schedule moves at its slowest rank's pace. A rank computes its blocks, and the one holding
    the last stage also the output head (6 h V FLOPs a token, never recomputed: a Llama 3 8B head is
    1.8 blocks of work at 8,192 tokens), so a split by layer count alone leaves the last rank behind;
    ``parallel.pp_first_stage_fewer`` gives the ends fewer blocks to even it out.
    """
    if layout.pp == 1 or not spec.has_structure or not spec.n_layers:
        return 1.0

    def factor() -> float:
        total = hardware_flops_per_token(spec, seq, checkpoint, every)
        head = 6.0 * (spec.hidden or 0) * (spec.vocab or 0)
        block = max(total - head, 0.0) / spec.n_layers
        split = _split(spec, layout)
        busiest = max(len(split.rank_layers(r)) * block + (head if split.holds_last_stage(r) else 0.0)
                      for r in range(split.pp))
        return layout.pp * busiest / total

    return _memo(("imbalance", id(spec), layout, seq, checkpoint, every), spec, factor)


def _busiest_stage_layers(spec: ModelSpec, layout: Layout) -> int:
    """Blocks on the busiest pipeline rank, split as the runtime splits them (all of them without PP)."""
    if layout.pp == 1:
        return spec.n_layers or 1

    def busiest() -> int:
        split = _split(spec, layout)
        return max(len(split.rank_layers(r)) for r in range(split.pp))

    # Memoised per (spec, layout): the search and the calibration's fit ask it for the same layout
    # under many settings, and the stage split is a third of a step-time evaluation.
    return _memo(("busiest", id(spec), layout), spec, busiest)


def bubble_fraction(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1)/(v*m+p-1) (v=1: GPipe and 1F1B), i.e. idle time =
    compute * (p-1)/(v*m) with m micro-batches and v stages per rank (interleaved 1F1B)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)
