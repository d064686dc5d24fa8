"""Per-rank bytes for every strategy: model state, activations and transient buffers.

Model state (conventions; see docs/planner.md for the derivation and the measurements):

* bytes per parameter = param + grad + master + optimizer state, by precision and optimizer.
  Mixed-precision AdamW with fp32 master weights: 2 + 2 + 4 + 8 = 16 bytes/param (ZeRO paper's
  "2+2+K" with K=12); with fp32 gradients 18; plain fp32 training 4 + 4 + 0 + 8 = 16.
  torch's AdamW also keeps a 0-dim fp32 ``step`` tensor per parameter tensor: 4 bytes each.
* ``ddp``: everything replicated. ``zero1`` (ZeroRedundancyOptimizer): optimizer state and master
  weights partitioned *by whole tensors*, greedily by size (reproduced exactly below).
  ``zero2``/``fsdp``/``hsdp``/``fsdp-offload`` (FSDP2 ``fully_shard``): every tensor is split on
  dim 0 with torch.chunk semantics; parameter and gradient storage is padded to ceil(dim0/N) rows
  on every rank, optimizer state is created from the unpadded local shard.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from shardwise.core.layout import EP_GROUPS, Layout, stage_layer_ranges, tp_indivisible
from shardwise.core.pp_schedules import (
    cross_rank_receives,
    peak_in_flight,
    peak_weight_passes_due,
    schedule_info,
    stages_in_backward,
)
from shardwise.core.strategies import AC_MODES, GRAD_SYNC_MODES
from shardwise.errors import ConfigError, unknown_choice
from shardwise.optim.names import OPTIMIZER_NAMES
from shardwise.plan.cp import cp_degree, cp_impl_for, logits_bytes
from shardwise.plan.moe import expert_unit_bytes
from shardwise.plan.optim_state import tensor_state_bytes
from shardwise.plan.spec import ROOT_UNIT, ModelSpec, ParamInfo


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each copy of the model; ``act`` is the activation element size."""

    name: str
    param: int
    grad: int
    master: int  # fp32 master copy kept next to 16-bit params (0 when params are already fp32)
    act: int


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", 4, 4, 0, 4),
    "bf16": Precision("bf16", 2, 2, 4, 2),
    "fp16": Precision("fp16", 2, 2, 4, 2),
    "bf16-fp32grad": Precision("bf16-fp32grad", 2, 4, 4, 2),
    # train's parallel.precision = "bf16-true": parameters, gradients and AdamW's moments stored in
    # bfloat16, no master copy (state_bytes halves AdamW's moments; its step counters stay fp32).
    "bf16-true": Precision("bf16-true", 2, 2, 0, 2),
}

# train's parallel.precision spellings, which the planner takes as its own (a user copies them from a
# run's config.toml or a printed command): the mixed-precision runs keep fp32 master weights, as "bf16".
TRAIN_SPELLINGS = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "auto": None}

OPTIMIZERS = OPTIMIZER_NAMES  # the ones the trainer builds (optim/names.py)
# The runtime's parallel.activation_checkpointing and parallel.grad_sync modes, defined once in
# shardwise.core.strategies (the planner plans exactly what the runtime runs).
CHECKPOINT_MODES = AC_MODES
LOSS_KINDS = ("torch", "fused", "compiled", "chunked")
STATE_KINDS = ("fp32-params", "master-copy")
NORM_KINDS = ("eager", "fused")
# How a gated MLP (SwiGLU, GeGLU) keeps its activation for backward (Kernels.glu).
GLU_KINDS = ("eager", "fused")
ATTENTION_KERNELS = ("flash1", "flash2", "flash3")
# How a stack overlaps its tensor-parallel collectives with the matmuls (Kernels.tp_overlap).
TP_OVERLAP_KINDS = ("none", "backward", "full")
GRAD_BUFFER_KINDS = ("ddp", "contiguous", "deepspeed-bf16")
# How a stack splits the blocks into pipeline stages (Kernels.pp_split).
PP_SPLIT_KINDS = ("layers", "cost")


@dataclass(frozen=True)
class Kernels:
    """How the training stack implements the pieces whose bytes and time differ between stacks.

    The defaults are shardwise's own runtime; the other values describe published runs of other
    stacks (benchmarks/published_runs.json) so the same model can be checked against them.

    * ``loss``: "torch" is F.cross_entropy on fp32-upcast logits (log_softmax keeps an fp32 copy,
      backward makes another); "fused" a fused cross-entropy kernel (flash-attn's, Liger) that keeps
      the logits and a per-token log-sum-exp and writes the gradient in place; "compiled" the
      runtime's loss under ``train.compile`` (inductor fuses the up-cast, log-softmax and NLL: it keeps
      the same as "fused", and its backward writes a new 16-bit gradient of the logits beside them,
      read from inductor's generated code); "chunked" shardwise's
      chunked loss (``train.loss_chunks``, plan/cp.py): one chunk of logits at a time.
    * ``norm``: "eager" is RMSNorm written in PyTorch ops (HF, torchtitan's default: keeps an fp32
      copy of its input and the normalised value); "fused" a fused RMSNorm kernel that keeps only
      its input and the per-token rstd. (LayerNorm is one fused op in PyTorch either way.)
    * ``glu``: a gated MLP's activation (SwiGLU, GeGLU). "eager" (transformers, torchtitan, shardwise:
      ``act(gate) * up`` in PyTorch ops) keeps the gate and up outputs, the activation's output and
      the product: 4 x ffn per token (routed slot, for experts). "fused" (Megatron's
      ``bias_swiglu_impl`` / ``bias_geglu_impl`` and its experts' ``weighted_bias_swiglu_impl``,
      on by default in Megatron-LM and NeMo: one autograd function that saves only its 2 x ffn input
      and recomputes the activation in backward; fc2 keeps the product): 3 x ffn.
    * ``attention_kernel``: the class of the attention kernel, which sets the rate the step time
      prices attention at (presets.KERNEL_CEILINGS): "flash2" FlashAttention-2 (torch SDPA's flash
      backend, first in SDPA's priority on every GPU: shardwise's and torchtitan's attention);
      "flash3" a Hopper kernel, FlashAttention-3 or cuDNN's fused attention (Transformer Engine
      prefers cuDNN's on Hopper: Megatron-Core, NeMo). On a GPU with no newer kernel (the A100)
      both rate at FlashAttention-2's figure. "flash1": FlashAttention-1's class (FlashAttention,
      its Triton port that MPT runs as attn_impl "triton", xformers' memory-efficient kernel), half
      FlashAttention-2's rate (presets.FLASH1_OF_FLASH2). With ``--attention math`` (no fused kernel)
      the attention's two batched matmuls run at the matmul rate on the FLOPs they execute, the
      whole s x s (cost.micro_batch_compute_s), and this property does not apply.
    * ``tp_overlap``: how the TP collectives overlap the matmuls. "none" (shardwise: torch's tensor
      parallel, every collective on the critical path); "backward" (Megatron-LM's linear layers
      without --tp-comm-overlap, nanotron's async linears): only the column-parallel linears'
      backward collective (the reduce-scatter or all-reduce of the input gradient) is issued before
      the weight-gradient GEMM and runs under it -- a quarter of a block's collectives under
      sequence parallel, half without it, none of the forward's or the recomputed forward's; "full" (Megatron's
      --tp-comm-overlap with Transformer Engine's userbuffers, torch's async TP): every collective
      is pipelined with its GEMM, hidden up to the step's compute. ``--stack-set tp_overlap=true``
      / ``false`` read as "full" / "none".
    * ``dp_overlap``: Megatron's distributed optimizer with --overlap-grad-reduce and
      --overlap-param-gather (a "zero1" data-parallel kind): gradients are reduce-scattered (not
      all-reduced) in buckets of max(40M, 1M x dp) parameters during the last micro-batch's
      backward, and the updated parameters all-gathered bucket by bucket during the next step's
      first forward (megatron/core/distributed/distributed_data_parallel.py).
    * ``state``: how the stack stores the model state under 16-bit training. "fp32-params"
      (shardwise, torch FSDP2 / FSDP1 with a mixed-precision policy, torch.autocast): fp32
      parameters and gradients, no separate master copy; "master-copy" (Megatron, DeepSpeed):
      16-bit parameters and gradients next to an fp32 master copy. Applied to the runtime's own
      layouts (an external stack's layout keeps the workload's precision as given).
    * ``ep_overlap``: the expert-parallel all-to-alls of one micro-batch run while another
      micro-batch computes (Megatron-Core's 1F1B A2A overlap, DeepSeek's DualPipe): hidden up to
      the compute of the step. shardwise's runtime does not overlap them.
    * ``grad_allreduce_after_backward``: Megatron-LM 2021's "local" DDP: one all-reduce of the
      contiguous gradient buffer after the last micro-batch's backward has finished, not
      overlapped (megatron/training.py train_step at 903f746c, April 2021).
    * ``grad_buffer``: where a replicated / ZeRO-1 data-parallel stack keeps the gradients it
      reduces (what ``plan`` runs is "ddp"; the others describe published stacks):

      - "ddp": torch DDP copies every gradient into its own flat buckets
        (gradient_as_bucket_view=False): one more gradient-sized buffer for the whole step.
      - "contiguous": Megatron-LM's local DDP (2021) and its distributed optimizer (2024): the
        backward hooks add each gradient into one contiguous fp32 buffer (``main_grad``) and free
        the 16-bit one; the collective reduces that buffer in place, so there is no copy
        (megatron/model/distributed.py at 903f746c; megatron/core/distributed/).
      - "deepspeed-bf16": DeepSpeed's BF16_Optimizer under its pipeline engine (BLOOM): after each
        micro-batch's backward ``update_hp_grads(clear_lp_grads=False)`` adds the bf16 gradients
        into a flat fp32 buffer and keeps them, so every parameter also has a bf16 gradient
        until the next backward; after the last micro-batch ``_bf16_reduce_grads`` hands that
        buffer to ``allreduce_no_retain``, whose ``allreduce_bucket`` flattens it (one flat
        tensor: torch's ``flatten_dense_tensors`` returns a view, no copy) and casts it to bf16,
        the engine's ``communication_data_type`` for bf16, for the all-reduce. That bf16 copy
        exists only after the schedule, when the pipeline's activations are freed: the peak is
        the larger of the schedule's and the reduce's (deepspeed/runtime/bf16_optimizer.py,
        engine.py, pipe/engine.py at 56c522386, the merge of the branch BLOOM trained with).
    * ``pp_receive_buffers``: torch.distributed.pipelining (shardwise, torchtitan) allocates one
      receive buffer per micro-batch of a schedule step for each stage input or output gradient
      that comes from another rank, and keeps them for the run (core/pp_schedules.py
      ``cross_rank_receives``). False: a pipeline engine that receives into the buffers of its
      in-flight micro-batches (Megatron's p2p_communication allocates each received tensor, which
      is that micro-batch's saved input; DeepSpeed's pipe engine keeps ``num_pipe_buffers``, the
      in-flight count): nothing beyond the in-flight activations.
    * ``ep_dispatch_copy``: the stack's expert-parallel token dispatch keeps one copy of the routed
      token slots per MoE layer for backward, outside the experts' own tensors and outside the
      selective-op policy (``ep_dispatch_bytes``; measured on shardwise's dispatcher,
      parallel/experts/ep.py). False for Megatron-Core's and DeepSpeed's dispatchers, whose
      published runs fit only without it (calibration: 9 Megatron MoE verdicts of 9 turn "no").
    * ``experts_whole_on_tp``: under tensor parallel every TP rank runs the whole router and experts
      on the whole (SP-gathered) sequence, so a MoE layer's saved tensors are not split tp ways
      (shardwise: ``MOE_WHOLE_PARTS``). False where each TP rank routes only its own tokens or
      holds a TP slice of each expert (Megatron-Core's MoE parallel folding, torchtitan's
      expert-tensor-parallel = tp, DeepSpeed): the MoE interior is split tp ways as the MLP's is.
    * ``experts_tp``: the routed experts' weights are tensor-parallel over tp (expert-tensor-parallel =
      tp: torchtitan's default, Megatron-Core before its parallel folding), each TP rank holding a
      slice of every expert's FFN dimension (``Layout.experts_tp``). False: whole on every TP rank
      (shardwise's TP plan; DeepSpeed-MoE without expert tensor parallelism; Megatron's folding with
      ETP 1, whose ep spans the TP ranks instead).
    * ``ep_groups``: which ranks the stack carves expert-parallel groups from (core/layout.py
      ``EP_GROUPS``, the one owner of each rule): "dp-shard" (shardwise, torchtitan: the FSDP shard
      ranks), "dp" (DeepSpeed-MoE: the data-parallel ranks of any kind), "tp-dp" (Megatron-Core's
      MoE parallel folding with expert-tensor-parallel 1: tp x dp x cp of a pipeline stage). The
      planner resolves its layouts with it (advice.candidate_layouts); ``train`` runs "dp-shard" only.
    * ``sp_regather``: under sequence parallel the stack keeps only each linear's 1/tp input shard and
      all-gathers it again in backward (Megatron's sequence parallel, Korthikanti et al. 2022's 34/t).
      False (shardwise, torchtitan): torch's tensor parallel saves the all-gathered whole-sequence
      input of the attention and the MLP (``layer_activation_bytes``).
    * ``pp_split``: how the stack splits the blocks into pipeline stages. "layers": by block count,
      the runtime's rule (``core.layout.stage_layer_ranges``, with ``parallel.pp_first_stage_fewer``;
      Megatron, torchtitan). "cost": nanotron's, which balances an estimated cost per stage -- each
      block 4 h (heads x head_dim) + 3 h ffn, the head V h, the embedding nothing -- greedily
      (``plan.pipeline.cost_balanced_stage_layers``), so the stage holding the head gets fewer blocks.
    * ``zero1_group``: the ranks a ZeRO-1 stack shards its optimizer state and master copy over. 0:
      every data-parallel rank (shardwise, DeepSpeed ZeRO-1, Megatron's distributed optimizer). g:
      each group of g consecutive dp ranks shards them and the dp / g groups replicate them, so the
      updated parameters are gathered within the group only (InternEvo's ``zero1`` size,
      Megatron-Core's ``--num-distributed-optimizer-instances`` dp / g). ``Layout.zero1_group``.
    """

    loss: str = "torch"
    norm: str = "eager"
    glu: str = "eager"
    attention_kernel: str = "flash2"
    tp_overlap: str = "none"
    dp_overlap: bool = False
    ep_overlap: bool = False
    grad_allreduce_after_backward: bool = False
    grad_buffer: str = "ddp"
    state: str = "fp32-params"
    pp_receive_buffers: bool = True
    ep_groups: str = "dp-shard"
    ep_dispatch_copy: bool = True
    experts_whole_on_tp: bool = True
    experts_tp: bool = False
    sp_regather: bool = False
    pp_split: str = "layers"
    zero1_group: int = 0

    def __post_init__(self) -> None:
        # Each named-choice property and what its error calls it.
        for name, what, allowed in (("ep_groups", "expert-group rule", tuple(EP_GROUPS)),
                                    ("state", "model-state storage", STATE_KINDS),
                                    ("loss", "loss implementation", LOSS_KINDS),
                                    ("norm", "norm implementation", NORM_KINDS),
                                    ("glu", "gated-MLP activation", GLU_KINDS),
                                    ("tp_overlap", "TP overlap", TP_OVERLAP_KINDS),
                                    ("attention_kernel", "attention kernel", ATTENTION_KERNELS),
                                    ("grad_buffer", "gradient buffer", GRAD_BUFFER_KINDS),
                                    ("pp_split", "pipeline stage split", PP_SPLIT_KINDS)):
            if getattr(self, name) not in allowed:
                raise unknown_choice(what, getattr(self, name), allowed)
        if isinstance(self.zero1_group, bool) or not isinstance(self.zero1_group, int) or self.zero1_group < 0:
            raise ConfigError(f"zero1_group={self.zero1_group!r}: the ZeRO-1 shard group is an integer >= 0 "
                              "(0: every data-parallel rank).")
        if self.experts_tp and (self.experts_whole_on_tp or self.ep_groups == "tp-dp"):
            raise ConfigError(
                "experts_tp=true (each TP rank a slice of every expert) needs experts_whole_on_tp=false "
                "and expert groups other than Megatron's folding (ep_groups tp-dp, expert-tensor-parallel 1).")

    @property
    def grad_comm_bytes(self) -> int | None:
        """Bytes per element of the data-parallel gradient collective when the stack fixes it
        (DeepSpeed casts its fp32 buffer to bf16 for the all-reduce); None: the gradient dtype."""
        return 2 if self.grad_buffer == "deepspeed-bf16" else None


SHARDWISE_KERNELS = Kernels()
REDUCE_BYTES = 4  # FSDP reduces (and accumulates unsharded) gradients in fp32 (precision.fsdp_mp_policy)


def reduce_bytes(prec: Precision) -> int:
    """Bytes per element of the gradients FSDP reduce-scatters and accumulates unsharded: fp32 under
    a mixed-precision policy and for fp32 parameters (REDUCE_BYTES), the parameters' own bfloat16
    under bf16-true, whose policy is a no-op (precision.fsdp_mp_policy). Checked on FSDP2 with
    set_requires_gradient_sync(False): the accumulated unsharded gradient is float32 under
    bf16-mixed and bfloat16 under bf16-true (2026-11-29)."""
    return prec.grad if prec.name == "bf16-true" else REDUCE_BYTES


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise unknown_choice("precision", name, PRECISIONS)
    return PRECISIONS[name]


@dataclass
class StateBytes:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    master: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.master


def staging_host_bytes(state: StateBytes, checkpoint_mode: str = "async") -> int:
    """Host bytes a rank keeps for asynchronous checkpoint staging (0 for ``sync``).

    DCP's stager copies every tensor of the checkpointed state into a host buffer of the same
    size and keeps it for the next save (runtime.checkpoint.background): this rank's parameters,
    optimizer state and fp32 master copy — not its gradients, which are not saved. When it does
    not fit beside the run in host memory, recommend ``checkpoint.mode = "sync"``.
    """
    if checkpoint_mode == "sync":
        return 0
    return state.params + state.optimizer + state.master


def _local_params(spec: ModelSpec, layout: Layout, stage: int) -> list[ParamInfo]:
    """Parameters one rank holds before data-parallel sharding: its pipeline stage, its TP slice."""
    params = _tp_params(spec, layout.tp, layout.experts_tp)
    if layout.pp > 1:
        # ``stage`` is the pipeline rank; it holds the blocks of every stage the runtime gives it
        # (``Layout.stage_ranges``: the runtime's own split, interleaved stages included).
        layout = _with_blocks(spec, layout)
        owned = layout.rank_layers(stage)
        first, last = layout.holds_first_stage(stage), layout.holds_last_stage(stage)

        def root_on_stage(p: ParamInfo) -> bool:
            is_embedding = "emb" in p.name or ".wte." in p.name or ".wpe." in p.name
            # Embeddings live on the first stage, final norm and head on the last; a tied
            # embedding is duplicated on both (as Megatron does).
            return (first and is_embedding) or (last and (not is_embedding or spec.tied_embeddings))

        # Positions by unit (cached on the spec), so a stage costs its own tensors, not the model's.
        positions = spec.unit_positions
        picked = [i for i in positions.get(ROOT_UNIT, []) if root_on_stage(params[i])]
        for unit in owned:
            picked += positions.get(unit, [])
        return [params[i] for i in sorted(picked)]  # registration order (ZeRO-1 ties depend on it)
    return list(params)


def ddp_bucket_count(spec: ModelSpec, layout: Layout, bytes_per_element: int, cap_bytes: float,
                     first_bytes: float) -> int | None:
    """All-reduces DDP issues per step on the busiest pipeline rank: torch's bucket assignment of that
    rank's trainable parameters (its stage, its TP slice) in gradient-ready order, taken as reverse
    registration order: a bucket closes once it holds ``first_bytes`` (the first) or ``cap_bytes``, so
    a tensor larger than the cap is a bucket of its own (``dist._compute_bucket_assignment_by_size``;
    equal to the all-reduces the rehearsal counts on gpt2, 13, and gpt2-xl, 145, where bytes / cap
    gives 19 and 238). None without the spec's parameter list."""
    if not spec.params:
        return None
    most = 0
    for stage in range(max(layout.pp, 1)):
        count, held, limit = 0, 0.0, first_bytes
        for p in reversed(_local_params(spec, layout, stage)):
            if not p.trainable:
                continue
            held += p.numel * bytes_per_element
            if held >= limit:
                count, held, limit = count + 1, 0.0, cap_bytes
        most = max(most, count + (1 if held else 0))
    return most


def _tp_params(spec: ModelSpec, tp: int, experts_tp: bool = False) -> tuple[ParamInfo, ...]:
    """Every parameter of the model as one TP rank holds it, in registration order.

    Matrices are split tp ways on the dimension their plan splits (column-parallel and vocab-parallel
    rows, row-parallel columns); vectors (norm weights, most biases) are replicated. The dimension
    matters beyond the total: FSDP then shards dim 0 of the TP shard, padded to whole rows, so a
    row-parallel (out, in / tp) weight holds out / shard rows of in / tp, not (out / tp) / shard rows
    of in (which rounds up to a whole row of twice the width once the shards outnumber the rows: rank
    0 of hf-llama-tiny at tp 2 x dp 64 held 14.7 % less than planned). Once per (spec, tp): the
    search asks for it per candidate and stage, and a 405B model has thousands of tensors.
    ``experts_tp``: the routed experts are split too (Layout.experts_tp; whole otherwise).
    """

    def compute() -> tuple[ParamInfo, ...]:
        params = tuple(spec.params) or (ParamInfo("all", (spec.n_params,), ROOT_UNIT),)  # bare count: one flat tensor
        return tuple(_tp_shard(p, tp, experts_tp) for p in params) if tp > 1 else params

    return _memo(("tp", id(spec), tp, experts_tp), spec, compute)


# The row-parallel linear layers of the tensor-parallel plans (``parallel/tensor/plans.py``; the rest
# are column-parallel), by their last name. Kept here as names: the planner does not import torch.
ROWWISE_LAYERS = ("o_proj", "down_proj", "proj")
# What an MoE block keeps whole on every TP rank (``parallel/tensor/tp.py`` skips it; experts are split by
# expert parallelism instead): routers, routed experts, shared experts (built-in GPT, Hugging Face).
MOE_WHOLE_PARTS = (".router.", ".mlp.gate.", ".experts.", ".mlp.shared.", ".shared_expert.", ".shared_expert_gate.")


# GPT-2's Conv1D layers store their weight transposed, (in, out): the column-parallel ones
# (``tensor.gpt2.Conv1DColwise``) split dim 1, the row-parallel ``c_proj`` dim 0.
CONV1D_COLWISE_LAYERS = ("c_attn", "c_fc")
# Routed-expert tensors whose FFN dimension is their last (what expert-tensor-parallel splits).
EXPERT_FFN_LAST = ("down_proj", "w2", "w_in")


def _tp_split_dim(p: ParamInfo, experts_tp: bool = False) -> int | None:
    """The dimension tensor parallel splits ``p`` on (None: every TP rank holds it whole).

    Routed experts stay whole unless ``experts_tp`` (expert-tensor-parallel = tp), which splits each
    expert's FFN dimension as the dense MLP's: the up / gate projections' output rows, the down
    projection's input columns (per-expert 2-D weights or the stacked (experts, out, in) tensors).

    LoRA adapters follow their base layer (``tensor.plans.with_lora``): a column-parallel base splits
    ``lora_B`` (out, r) on its rows and keeps ``lora_A`` whole, a row-parallel base splits ``lora_A``
    (r, in) on its columns and keeps ``lora_B``.
    """
    if experts_tp and ".experts." in p.name and len(p.shape) >= 2:
        # The FFN dimension is the last one of Hugging Face's down projections ((E, D, I), w2 (D, I))
        # and of the built-in GPT's w_in (E, D, F), the one before it elsewhere (gate_up (E, 2I, D),
        # w1 / w3 (I, D), the built-in's w_out (E, F, D)).
        parts = p.name.split(".")
        name = parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]
        return len(p.shape) - 1 if name in EXPERT_FFN_LAST else len(p.shape) - 2
    if len(p.shape) < 2 or any(part in p.name for part in MOE_WHOLE_PARTS):
        return None
    for adapter, split_under_rowwise in ((".lora_A.", True), (".lora_B.", False)):
        if adapter in p.name:
            layer = p.name.split(adapter)[0].rsplit(".", 1)[-1]
            if (layer in ROWWISE_LAYERS) != split_under_rowwise:
                return None
            return 1 if split_under_rowwise else 0
    path = p.name.replace(".base_layer.", ".").split(".")  # the layer's name precedes "weight"
    layer = path[-2] if len(path) > 1 else ""
    return 1 if layer in ROWWISE_LAYERS or layer in CONV1D_COLWISE_LAYERS else 0


def _tp_shard(p: ParamInfo, tp: int, experts_tp: bool = False) -> ParamInfo:
    """``p`` as one TP rank holds it: its split dimension divided by ``tp`` (rounded up, as torch's
    ``Shard`` gives the first ranks the larger pieces)."""
    dim = _tp_split_dim(p, experts_tp)
    if dim is None:
        return p
    shape = list(p.shape)
    shape[dim] = math.ceil(shape[dim] / tp)
    return ParamInfo(p.name, tuple(shape), p.unit, p.trainable)


def _with_blocks(spec: ModelSpec, layout: Layout) -> Layout:
    """The layout with the model's block count (so its stage ranges exist)."""
    if layout.n_blocks is None:
        return layout.with_blocks(spec.n_layers or 1)
    return layout


def _zero1_owned(params: list[ParamInfo], numels: list[int], world: int) -> list[list[int]]:
    """ZeRO-1's partition of the trainable tensors (the optimizer's), as indices into ``params``."""
    trainable = [i for i, p in enumerate(params) if p.trainable]
    if len(trainable) == len(params):
        return zero1_partition(numels, world)
    return [[trainable[j] for j in owned] for owned in zero1_partition([numels[i] for i in trainable], world)]


def zero1_partition(numels: list[int], world: int) -> list[list[int]]:
    """Indices of the tensors each rank owns, exactly as ZeroRedundancyOptimizer partitions them.

    Sorted by size, largest first (a stable sort, so equal sizes keep registration order); each
    goes to the rank with the smallest total so far (lowest rank on ties).
    """
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
    # A heap of (total so far, rank): the smallest total, lowest rank on ties, in O(log world)
    # (a 512-rank group would otherwise cost seconds per planned candidate).
    heap = [(0, r) for r in range(world)]
    owned: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        size, rank = heapq.heappop(heap)
        owned[rank].append(i)
        heapq.heappush(heap, (size + numels[i], rank))
    return owned


def _chunk_rows(dim0: int, n: int, rank: int) -> tuple[int, int]:
    """(padded rows, actual rows) of ``rank``'s torch.chunk shard of ``dim0`` rows over ``n`` ranks."""
    padded = math.ceil(dim0 / n)
    return padded, max(0, min(padded, dim0 - rank * padded))


# The search evaluates each layout under many settings (checkpointing, micro-batch, gradient sync)
# that do not change its model state: compute that once per (spec, layout, precision, optimizer).
# Keyed by the spec's identity (hashing its parameter list would cost as much as the sum); the
# spec is kept in the value so a recycled id never matches.
_STATE_MEMO: dict[tuple, tuple[ModelSpec, object]] = {}
_MEMO_LIMIT = 4096


def _memo(key: tuple, spec: ModelSpec, compute):
    hit = _STATE_MEMO.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_STATE_MEMO) >= _MEMO_LIMIT:
        _STATE_MEMO.clear()
    value = compute()
    _STATE_MEMO[key] = (spec, value)
    return value


def state_bytes(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str,
                rank: int | None = None, stage: int = 0) -> StateBytes:
    """Model-state bytes held by one rank (``rank`` in the data-parallel group and ``stage`` its
    pipeline rank; rank None = the largest over every rank and stage).

    Exact for the tensors in ``spec.params``.
    Offloaded state is still counted here (it lives in host RAM; see MemoryBreakdown.host_bytes).
    """
    held = _memo(("state", id(spec), layout, prec, optimizer, rank, stage), spec,
                 lambda: _state_bytes(spec, layout, prec, optimizer, rank, stage))
    return replace(held)  # a copy: StateBytes is mutable


def local_numel(spec: ModelSpec, layout: Layout, stage: int = 0) -> int:
    """Elements of the parameters one rank's pipeline stage holds unsharded (after TP)."""
    return _memo(("numel", id(spec), layout, stage), spec,
                 lambda: sum(p.numel for p in _local_params(spec, layout, stage)))


def stage_boundary_bytes(spec: ModelSpec, layout: Layout, seq: int, micro_batch: int, act_bytes: int) -> int:
    """Bytes of one micro-batch's tensor at a pipeline stage boundary: the residual stream a stage sends
    forward and the gradient it sends back (this rank's sequence chunk under context parallel, its
    sequence-parallel shard under TP + SP): one receive buffer, one point-to-point message."""
    tokens = micro_batch * (seq // cp_degree(layout))
    return tokens * (spec.hidden or 0) * act_bytes // (layout.tp if layout.sequence_parallel else 1)


def gathered_unit_numels(spec: ModelSpec, layout: Layout) -> dict[int, int]:
    """Elements FSDP2 gathers per unit (block index; ROOT_UNIT: the embeddings, head and final norm)
    on one rank without a pipeline: every tensor's TP slice with its dim 0 padded to a multiple of
    the shard count, as the all-gather output (and the reduce-scatter input) is laid out. The padding
    is nothing on a large model and most of a tiny one at hundreds of shards (hf-llama-tiny's
    64-row q projection gathers 256 rows at 256 shards)."""
    shard = max(layout.shard, 1)

    def compute() -> dict[int, int]:
        units: dict[int, int] = {}
        for p in _local_params(spec, layout, 0):
            rows = p.shape[0] if p.shape else 1
            units[p.unit] = units.get(p.unit, 0) + math.ceil(rows / shard) * shard * (p.numel // max(rows, 1))
        return units

    return _memo(("gathered", id(spec), layout), spec, compute)


def routed_expert_numel(spec: ModelSpec, layout: Layout, stage: int = 0) -> int:
    """Elements of routed-expert tensors (``.experts.``) on one rank's pipeline stage, before EP:
    the MoE layers of that stage only (0 for a dense model)."""
    if spec.moe is None:
        return 0
    return _memo(("experts", id(spec), layout, stage), spec,
                 lambda: sum(p.numel for p in _local_params(spec, layout, stage) if ".experts." in p.name))


def held_unsharded_numel(spec: ModelSpec, layout: Layout, stage: int = 0) -> int:
    """Elements a rank's stage holds unsharded: ``local_numel`` less the routed experts of its MoE
    layers that live on the other ``ep - 1`` ranks of its expert group (each holds n_experts / ep)."""
    ep = getattr(layout, "ep", 1) or 1
    full = local_numel(spec, layout, stage)
    return full - routed_expert_numel(spec, layout, stage) * (ep - 1) // ep


def _ep_split_experts(spec: ModelSpec, layout: Layout, params: list[ParamInfo]) -> list[bool] | None:
    """Which of ``params`` are routed-expert tensors that expert parallel splits ep ways on a
    replicating / ZeRO-1 stack (None when none are: no ep, no MoE, or FSDP, whose shards already
    cover the experts: plan/moe.py)."""
    if layout.ep <= 1 or spec.moe is None or layout.sharding not in ("replicate", "zero1"):
        return None
    return [".experts." in p.name for p in params]


def _state_bytes(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str,
                 rank: int | None, stage: int) -> StateBytes:
    if rank is None:
        best = StateBytes()
        for stage in range(layout.pp):
            params = _local_params(spec, layout, stage)
            numels = [p.numel for p in params]
            owned, busiest = None, 0  # FSDP's first shard is the largest (chunks pad the last ones)
            if layout.sharding == "zero1":
                experts = _ep_split_experts(spec, layout, params)
                # Expert tensors split by ep have their state sharded over the expert data-parallel
                # ranks instead (_state_bytes_one): only the others are dealt out over dp.
                dealt = [0 if e else n for n, e in zip(numels, experts)] if experts else numels
                owned = _zero1_owned(params, dealt, layout.zero1_shards)
                if spec.params:
                    # ZeRO-1's ranks hold the same parameters and gradients and differ only in the
                    # optimizer state and master copy of the tensors each owns: the busiest is the
                    # first with the most, found with each tensor's state computed once (once per
                    # rank was O(dp x tensors): seconds per candidate for a 405B model at dp 256).
                    loads = [sum(tensor_state_bytes(params[i], params[i].shape, optimizer) + prec.master * numels[i]
                                 for i in mine if not (experts and experts[i])) for mine in owned]
                    busiest = loads.index(max(loads))
            sb = _state_bytes_one(spec, layout, prec, optimizer, busiest, params, owned, numels)
            if sb.total > best.total:
                best = sb
        return best
    return _state_bytes_one(spec, layout, prec, optimizer, rank, _local_params(spec, layout, stage))


def _state_bytes_one(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str, rank: int,
                     params: list[ParamInfo], zero1_owned: list[list[int]] | None = None,
                     numels: list[int] | None = None) -> StateBytes:
    """One rank's model state. Under ``bf16-true`` AdamW's moments follow the bfloat16 parameters (4
    bytes an element, not 8; its ``step`` counters stay fp32): one fp32 moment's worth less, which is
    SGD's single fp32 buffer on the same tensors. The runtime's other optimizers keep their fp32
    state (plan/predict.py)."""
    sb = _state_bytes_of(spec, layout, prec, optimizer, rank, params, zero1_owned, numels)
    if prec.name == "bf16-true" and optimizer == "adamw":
        one_moment = _state_bytes_of(spec, layout, prec, "sgd", rank, params, zero1_owned, numels).optimizer
        sb.optimizer -= one_moment
    return sb


def _state_bytes_of(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str, rank: int,
                    params: list[ParamInfo], zero1_owned: list[list[int]] | None = None,
                    numels: list[int] | None = None) -> StateBytes:
    out = StateBytes()
    if layout.sharding in ("replicate", "zero1"):
        numels = numels if numels is not None else [p.numel for p in params]
        experts = _ep_split_experts(spec, layout, params)
        if experts:
            # Expert parallel under a replicating / ZeRO-1 stack (Megatron, DeepSpeed-MoE): this rank
            # holds n_experts / ep of each of its stage's MoE layers' experts, their gradients too,
            # and their optimizer state and master copy are sharded over the expert data-parallel
            # group (Layout.expert_dp; replicated under plain DDP), not over dp.
            numels = [n // layout.ep if e else n for n, e in zip(numels, experts)]
            edp = layout.expert_dp if layout.sharding == "zero1" else 1
            for n, p, e in zip(numels, params, experts):
                if e and p.trainable:
                    share = math.ceil(n / edp)
                    out.optimizer += tensor_state_bytes(p, (share,), optimizer)
                    out.master += prec.master * share
        total = sum(numels)
        out.params = prec.param * total
        out.grads = prec.grad * sum(n for n, p in zip(numels, params) if p.trainable)
        if layout.sharding == "zero1" and not spec.params:
            # Bare count: no tensor boundaries known, so assume an even split of the flat state.
            share = math.ceil(numels[0] / layout.zero1_shards)
            out.optimizer = tensor_state_bytes(params[0], (share,), optimizer)
            out.master = prec.master * share
            return out
        if layout.sharding == "replicate":
            owned: range | list[int] = [i for i, p in enumerate(params) if p.trainable and not (experts and experts[i])]
        else:
            dealt = [0 if e else n for n, e in zip(numels, experts)] if experts else numels
            owned = [i for i in (zero1_owned or _zero1_owned(params, dealt, layout.zero1_shards))
                     [rank % layout.zero1_shards] if not (experts and experts[i])]
        for i in owned:
            out.optimizer += tensor_state_bytes(params[i], params[i].shape, optimizer)
            out.master += prec.master * numels[i]
        return out
    for p in params:
        (padded, actual), local_shape = fsdp_chunk(spec, layout, p, rank)
        out.params += prec.param * padded  # FSDP2 pads parameter and gradient storage
        if not p.trainable:
            continue  # frozen (LoRA base): no gradient, no optimizer state, no master copy
        out.grads += prec.grad * padded
        out.optimizer += tensor_state_bytes(p, local_shape, optimizer)
        out.master += prec.master * actual
    return out


def expert_split(spec: ModelSpec, layout: Layout, p: ParamInfo) -> tuple[int, int, int] | None:
    """(local experts, ranks sharding them, the dim FSDP shards) for a routed-expert tensor the runtime
    splits ep ways and FSDP-shards over the rest of its shard group (ep_groups "dp-shard": shardwise's
    and torchtitan's): by experts when they split evenly over those ranks, else dim 1
    (``parallel/experts/ep.expert_shard_placement``); None for any other tensor or rule."""
    ep = layout.ep
    if (ep <= 1 or spec.moe is None or layout.ep_groups != "dp-shard" or ".experts." not in p.name
            or layout.shard % ep or p.shape[0] % ep):
        return None
    experts, ranks = p.shape[0] // ep, layout.shard // ep
    return experts, ranks, 0 if experts % ranks == 0 or len(p.shape) < 2 else 1


def fsdp_chunk(spec: ModelSpec, layout: Layout, p: ParamInfo, rank: int) -> tuple[tuple[int, int], tuple[int, ...]]:
    """((padded, actual) elements, local shape) of ``p``'s FSDP2 shard on shard rank ``rank``.

    FSDP2 chunks dim 0 as torch.chunk does and pads the storage to the largest chunk. A routed-expert
    tensor under expert parallel is first split ep ways along its experts (each group of ep
    consecutive shard ranks), then sharded over the shard / ep ranks holding the same experts, along
    the dim ``expert_split`` names (1 expert over 2 ranks by rows would leave one rank the whole
    expert and the other none). Megatron's folding
    (ep_groups "tp-dp"): the experts, whole on each TP rank, are chunked over tp x shard ranks.
    """
    split = expert_split(spec, layout, p)
    if split is not None:
        experts, ranks, dim = split
        if dim == 0:
            padded, actual = _chunk_rows(experts, ranks, rank // layout.ep)
            rest = math.prod(p.shape[1:])
            return (padded * rest, actual * rest), (actual, *p.shape[1:])
        padded, actual = _chunk_rows(p.shape[1], ranks, rank // layout.ep)
        rest = experts * math.prod(p.shape[2:])
        return (padded * rest, actual * rest), (experts, actual, *p.shape[2:])
    folded = layout.ep > 1 and layout.ep_groups == "tp-dp" and layout.tp > 1 and spec.moe is not None
    padded, actual = _chunk_rows(p.shape[0], layout.shard * layout.tp if folded and ".experts." in p.name
                                 else layout.shard, rank)
    rest = math.prod(p.shape[1:])
    return (padded * rest, actual * rest), (actual, *p.shape[1:])


# ---------------------------------------------------------------------------------------------
# Activations


@dataclass
class ActivationBytes:
    """Bytes one rank keeps for backward for ONE micro-batch, and the extra peak while recomputing."""

    saved: int
    recompute_peak: int  # what one block rematerialises while it is recomputed (AC modes)
    per_layer_full: int  # one block's activations without checkpointing
    outer: int  # embeddings, final norm and loss, outside the blocks


def layer_activation_bytes(spec: ModelSpec, seq: int, micro_batch: int, act_bytes: int, *, tp: int = 1,
                           sp: bool = True, attention: str = "sdpa", kernels: Kernels = SHARDWISE_KERNELS,
                           autocast: bool = False, ep: int = 1, moe_layer: bool = True) -> int:
    """Bytes one transformer block saves for backward (no checkpointing), from its structure.

    Korthikanti et al. 2022, eq. (1)-(2): s*b*h*(34 + 5*a*s/h) bytes at 2-byte activations with
    dropout masks and a materialised softmax. We count the same tensors from the block's code:

    * gpt (LayerNorm, GELU 4h MLP): LN1 in/out, LN2 in/out (4h), q,k,v (3h), attention output
      (h), fc output and GELU output (2 x 4h): 16h elements = 32 s*b*h bytes at 2 bytes, the
      paper's 34 minus its two 1-byte dropout masks (our dropout is 0). LayerNorm also keeps
      fp32 mean and rstd (2 x 4 bytes per token each).
    * llama (HF RMSNorm, rotary, SwiGLU): each RMSNorm keeps its fp32 up-cast input (4h bytes),
      its normalised value and its output (2 x h elements) and an fp32 rsqrt; attention keeps
      rotated q and k, v and the output; the MLP keeps gate, up, silu(gate) and their product.
    * attention="sdpa" (flash / memory-efficient, what F.scaled_dot_product_attention runs on CPU
      and on recent GPUs) keeps the output and an fp32 log-sum-exp per head and token instead of
      the s x s matrix: the paper's 5*a*s/h term becomes 4*a bytes per token.
      attention="math" keeps the softmax output (a*s elements per token) and, with dropout, its
      1-byte mask and the dropped-out copy: the paper's 5*a*s*b*s bytes at 2 bytes.

    Tensor parallelism (degree tp) divides the attention and MLP interiors; with sequence
    parallelism (sp) the norm regions are divided too (the paper's 34/t), without it they are
    replicated (10 + 24/t).

    ``autocast``: 16-bit activations from ``torch.autocast`` (``Layout.casts_with_autocast``: DDP,
    ZeRO-1, TP/PP without FSDP) rather than from parameters cast to 16 bits (FSDP2's policy). The
    parameters, the embedding's output and so the residual stream stay fp32, and autocast casts
    per op (measured on real CPU tensors, ``tests/test_plan_measure.py``): a norm's saved input
    and normalised value are fp32; its fp32 output is not saved, but every linear reading it
    saves its own 16-bit cast of it (q, k and v three, gate and up two); and each linear saves
    the 16-bit copy of its weight autocast made for this forward (``autocast_weight_bytes``).

    ``moe_layer=False``: without what a mixture-of-experts layer keeps inside itself (its router,
    routed slots and experts; under autocast also the router's 16-bit copy of the norm output and
    the experts' and router's weight copies), what a block keeps when that layer is checkpointed
    (``activation_checkpointing = "moe"``). Its input is the norm's output, kept by the block.
    """
    if not spec.has_structure:
        return 0
    assert spec.hidden and spec.n_heads and spec.ffn_hidden
    h, a, f, e = spec.hidden, spec.n_heads, spec.ffn_hidden, act_bytes
    d = spec.dim_head
    qd, kvd = a * d, spec.kv_heads * d
    tokens = seq * micro_batch
    norm_div = tp if sp else 1
    mask = 1 if spec.dropout > 0 else 0
    cast = autocast and e < 4
    attn_in, mlp_in = _norm_readers(spec)
    # shardwise runs a mixture of experts' router and experts whole on every TP rank (MOE_WHOLE_PARTS,
    # as parallel/tensor/tp.py applies it), on the whole sequence (gathered under SP): not split tp
    # ways (Kernels.experts_whole_on_tp; Mixtral tp 2 rehearsed, 2026-11-28: its 4 unwrapped blocks a
    # stage kept 4.3 GiB more than a tp-split MoE interior).
    whole = 0
    dropped = spec.moe is not None and not moe_layer  # a checkpointed MoE layer keeps nothing inside
    if dropped:
        mlp_in = 0  # the router's 16-bit copy of the norm output is made inside the layer
    mlp = 0 if dropped else (2 + spec.act_extra) * f  # fc out, GELU out (and a Python GELU's own: act_extra)
    # ``read``: what the linears after a norm save of its output. Under torch's sequence parallel
    # they read it all-gathered over the sequence (parallel/tensor/plans.py gathers once per
    # attention and MLP), so it is a whole-sequence tensor on every TP rank, not a 1/tp shard like
    # the rest of the norm region (llama-3-8b tp 8, seq 8192, no checkpointing, rehearsed
    # 2026-11-28: 112 MiB a layer more than planned, 2 x s*h*2 bytes x (1 - 1/8)). A stack that
    # gathers it again in backward (Kernels.sp_regather, Megatron) keeps the shard.
    if spec.arch == "gpt" and cast:
        # LayerNorm keeps its fp32 input and stats; its linears their own 16-bit copies of its output.
        norm_region = 2 * 4 * h + 2 * 2 * 4 + 2 * mask * h
        read = (attn_in + mlp_in) * h * e
        inner = (qd + 2 * kvd + qd + mlp) * e
    elif spec.arch == "gpt":
        norm_region = 2 * h * e + 2 * 2 * 4 + 2 * mask * h  # LN inputs, fp32 stats, residual-dropout masks
        read = 2 * h * e  # LN outputs
        inner = (qd + 2 * kvd + qd + mlp) * e  # q, k, v, attention out, fc out, GELU out
    else:
        # Two RMSNorms: eager keeps the fp32 input copy, the normalised value, the output and rstd;
        # a fused kernel keeps its input, the output and rstd.
        norm_region = 2 * (4 * h + h * e + 4) if kernels.norm == "eager" else 2 * (h * e + 4)
        read = 2 * h * e
        if cast:  # fp32 input and normalised value; each reading linear's 16-bit copy of the output
            norm_region = 2 * (4 * h + 4 * h + 4)
            read = (attn_in + mlp_in) * h * e
        inner = (2 * qd + 2 * kvd) * e  # rotated q, k, v, attention out
        if spec.moe is not None and kernels.experts_whole_on_tp:
            whole = 0 if dropped else _mlp_interior(spec, e, kernels.glu)
        elif not dropped:
            inner += _mlp_interior(spec, e, kernels.glu)  # the MLP, split tp ways with the attention
        if _has_qk_norm(spec):  # Qwen3's per-head RMSNorms on q and k: the same tensors per head row
            heads = a + spec.kv_heads
            inner += (4 * (qd + kvd) + 2 * (qd + kvd) * e + 4 * heads) if kernels.norm == "eager" else (
                2 * (qd + kvd) * e + 4 * heads)
    if attention == "sdpa":
        inner += 4 * a  # fp32 log-sum-exp per head
    elif attention == "math":
        inner += a * seq * e + mask * a * seq * (1 + e)  # softmax (+ dropout mask and output)
    else:
        raise unknown_choice("attention implementation", attention, ("sdpa", "math"))
    copies = autocast_weight_bytes(spec, e, tp=tp, ep=ep, moe_layer=not dropped) if cast else 0
    if kernels.sp_regather:
        norm_region, read = norm_region + read, 0
    return tokens * (norm_region // norm_div + read + inner // tp + whole) + copies


def ep_dispatch_bytes(spec: ModelSpec, tokens: int, act_bytes: int, *, ep: int = 1) -> int:
    """What one MoE layer keeps for backward beyond its experts' own tensors when expert parallel
    dispatches its tokens (``parallel/experts/ep.py``): one copy of the routed token slots in the
    compute dtype (``tokens x top_k x hidden``). It is kept with no checkpointing and under
    ``selective-op`` alike (the policy does not decide it), not inside a fully checkpointed block.
    Measured with the rehearsal's tracker: Qwen3-30B-A3B under selective-op exactly 128 MiB a layer
    at 4,096 tokens (2026-11-28), and the tiny Qwen3-MoE at 256 tokens +0.13 MiB over its 2 layers
    with ep 2 against ep 1, under ``none`` and ``selective-op``, nothing under ``full``. The routers
    and experts run whole on every TP rank, so it is not split tp ways."""
    if ep <= 1 or spec.moe is None or not spec.hidden:
        return 0
    return tokens * spec.moe.top_k * spec.hidden * act_bytes


def _norm_readers(spec: ModelSpec) -> tuple[int, int]:
    """How many linears read each norm's output: (attention, MLP). q, k and v are separate
    projections unless the family fuses them (GPT-2's ``c_attn``); a SwiGLU MLP's gate and up
    both read it, a GELU MLP's fc alone, a mixture of experts' router (its experts read the
    routed copies ``_mlp_interior`` counts)."""
    fused = _memo(("fused_qkv", id(spec)), spec, lambda: any(p.name.endswith("c_attn.weight") for p in spec.params))
    mlp = 1 if spec.arch == "gpt" or spec.moe is not None else 2
    return (1 if fused else 3), mlp


def autocast_weight_bytes(spec: ModelSpec, act_bytes: int, *, tp: int = 1, ep: int = 1,
                          moe_layer: bool = True) -> int:
    """The 16-bit copies of one block's linear weights that ``torch.autocast`` makes in a forward
    and autograd keeps for backward (a cast is cached per weight for the autocast region, so once
    per forward): the block's matmul weights split tp ways, a mixture of experts' every local
    expert (its experts hold n_experts / ep each). ``moe_layer=False``: without the router's and
    experts' (a checkpointed MoE layer keeps none)."""
    moe_names = ("experts ", "router") if spec.moe is not None else ()
    dense = sum(i * o for name, i, o, _ in block_matmuls(spec)
                if not name.startswith("experts ") and (moe_layer or not name.startswith(moe_names)))
    experts = 0
    if spec.moe is not None and moe_layer:
        experts = spec.moe.n_experts // max(ep, 1) * 3 * (spec.hidden or 0) * (spec.ffn_hidden or 0)
    return (dense + experts) * act_bytes // tp


def _mlp_interior(spec: ModelSpec, e: int, glu: str = "eager") -> int:
    """Bytes per token a llama-like block's MLP keeps for backward.

    Dense SwiGLU: gate, up, silu(gate) and their product (4 x ffn_hidden elements; 3 with a fused
    activation, ``Kernels.glu = "fused"``: its 2 x ffn input and the product). A mixture of
    experts (transformers' experts module, one pass per expert hit) sends each token to ``top_k``
    experts, and per routed slot keeps the gathered input and the expert's output (2 x hidden), the
    gate/up output, the activation and the product (4 x the expert width, as dense), the routing
    weight, and two int64 indices (token, slot); the router keeps its fp32 softmax (n_experts) and
    the top-k indices (int64) and fp32 weights, before and after normalising."""
    f = spec.ffn_hidden or 0
    width = 3 if glu == "fused" else 4
    if spec.moe is None:
        return width * f * e
    h, k, n = spec.hidden or 0, spec.moe.top_k, spec.moe.n_experts
    routed = k * ((2 * h + width * f + 1) * e + 2 * 8)
    router = 4 * n + k * (8 + 2 * 4)
    return routed + router


def _has_qk_norm(spec: ModelSpec) -> bool:
    # Asked per layer per candidate; a scan of a 405B spec's parameter list each time was a third of
    # a plan's search time: once per spec.
    return _memo(("qk_norm", id(spec)), spec,
                 lambda: any(p.name.endswith("self_attn.q_norm.weight") for p in spec.params))


def korthikanti_layer_bytes(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                            sp: bool = False, recompute: str = "none") -> float:
    """The published per-layer formula (Korthikanti et al. 2022, Table 2), 2-byte activations."""
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    if recompute == "full":
        return 2 * s * b * h
    attn = 0 if recompute == "selective" else 5 * a * s / (h * t)
    if sp:
        return s * b * h * (34 / t + attn)
    return s * b * h * (10 + 24 / t + attn)


def outer_activation_bytes(spec: ModelSpec, seq: int, micro_batch: int, act_bytes: int, *, tp: int = 1,
                           first_stage: bool = True, last_stage: bool = True,
                           kernels: Kernels = SHARDWISE_KERNELS, autocast: bool = False, sp: bool = False) -> int:
    """Bytes saved outside the blocks: token ids, rotary tables, final norm, and what the loss keeps
    (``torch``: the fp32 log-softmax; ``fused``: the logits and an fp32 log-sum-exp per token).
    Under ``autocast`` (``layer_activation_bytes``) the rotary tables and the final norm are fp32
    and the head keeps its 16-bit copies of its input and weight. Under sequence parallelism
    (``sp`` with ``tp`` > 1) the final norm runs on this rank's sequence shard and only the head's
    input, gathered for its column-parallel matmul, is the whole sequence."""
    if not spec.has_structure:
        return 0
    assert spec.hidden and spec.vocab
    h, e, tokens = spec.hidden, act_bytes, seq * micro_batch
    cast = autocast and e < 4
    total = 0
    if first_stage:
        total += 8 * tokens + (8 * seq if spec.learned_positions else 2 * seq * spec.dim_head * (4 if cast else e))
    if last_stage:
        final_norm = 2 * h * e + 8 if spec.arch == "gpt" else (
            4 * h + 2 * h * e + 4 if kernels.norm == "eager" else 2 * h * e + 4)
        if cast:
            final_norm = (4 * h + 8 if spec.arch == "gpt" else 4 * h + 4 * h + 4) + h * e
            total += spec.vocab * h * e // tp  # the head's weight copy
        if sp and tp > 1:
            # Each form above holds one h * e for the head's input; the rest is the norm's own, on
            # seq / tp tokens. Counted whole until 2026-11-28: llama-3-405b's last stage (tp 8, SP)
            # was planned 896 MiB over what a rehearsal of it saves.
            final_norm = (final_norm - h * e) // tp + h * e
        # The loss up-casts logits to fp32 and log_softmax keeps its fp32 output (vocab-parallel
        # under TP); a fused loss keeps the logits themselves instead.
        # The chunked loss keeps no logits between forward and backward (plan/cp.logits_bytes
        # counts its chunk and per-token log-sum-exp as a transient).
        kept = (4 * spec.vocab // tp if kernels.loss == "torch" else
                0 if kernels.loss == "chunked" else e * spec.vocab // tp + 4)
        total += tokens * (final_norm + kept)
    return total


def block_matmuls(spec: ModelSpec) -> list[tuple[str, int, int, bool]]:
    """The block's matmuls in execution order: (name, in features, out features, row-parallel under TP).

    The order matters for ``selective-op``, which keeps every other matmul output (the 1st, 3rd, ...).
    """
    assert spec.hidden and spec.ffn_hidden
    h, f = spec.hidden, spec.ffn_hidden
    qd, kvd = (spec.n_heads or 0) * spec.dim_head, spec.kv_heads * spec.dim_head
    attn = [("q", h, qd, False), ("k", h, kvd, False), ("v", h, kvd, False), ("o", qd, h, True)]
    if spec.arch == "gpt":
        return attn + [("fc", h, f, False), ("proj", f, h, True)]
    if spec.moe is not None:  # the router, then each token's top_k experts (per-token widths)
        kf = spec.moe.top_k * f
        return attn + [("router", h, spec.moe.n_experts, False), ("experts gate", h, kf, False),
                       ("experts up", h, kf, False), ("experts down", kf, h, True)]
    return attn + [("gate", h, f, False), ("up", h, f, False), ("down", f, h, True)]


def op_sac_saved(spec: ModelSpec) -> list[tuple[str, int, int, bool]]:
    """The matmuls whose outputs ``selective-op`` keeps: the 1st, 3rd, 5th, ... of the block's
    ``aten.mm`` calls. A mixture of experts' experts run as per-expert slices or grouped kernels,
    not ``aten.mm`` (seen on a tiny Qwen3-MoE: 5 mm calls per block, attention and router): the
    policy neither counts nor keeps them, so they are always recomputed."""
    mms = [m for m in block_matmuls(spec) if not m[0].startswith("experts ")]
    return mms[0::2]


def op_sac_layer_bytes(spec: ModelSpec, seq: int, micro_batch: int, act_bytes: int, *, tp: int = 1,
                       sp: bool = True, autocast: bool = False, kernels: Kernels = SHARDWISE_KERNELS) -> int:
    """Bytes one block keeps under ``selective-op`` (torchtitan's per-op policy), per micro-batch.

    The checkpoint keeps the block's input; the policy keeps the outputs of every other matmul
    and of the attention kernel (its output and fp32 log-sum-exp per head); everything else is
    recomputed in backward. Under TP a column-parallel output is 1/tp of its width, a row-parallel
    one is the full-width partial sum. With sequence parallelism the policy also keeps every
    row-parallel matmul's reduce-scatter output, whether or not it keeps the matmul's (the
    attention's output projection is a recomputed one: rehearsed, the tiny Llama's 64 bytes a
    token a block under tp 2). Under ``autocast`` the block input is the fp32 residual stream.
    A mixture of experts' router runs whole on every TP rank (``Kernels.experts_whole_on_tp``):
    its output is not split; a model that returns its routers' probabilities for the aux loss
    (``MoEInfo.router_outputs``) keeps them as the block's output (fp32, ``checkpoint_outputs_bytes``).
    """
    if not spec.has_structure:
        return 0
    assert spec.hidden and spec.n_heads
    h, e, a = spec.hidden, act_bytes, spec.n_heads
    qd = a * spec.dim_head
    per_token = h * (4 if autocast else e) / (tp if sp else 1)  # the block input (sequence-sharded under SP)
    whole = spec.moe is not None and kernels.experts_whole_on_tp
    for name, _in, out, row_parallel in op_sac_saved(spec):
        if row_parallel:
            per_token += out * e
        else:
            per_token += out * e / (1 if whole and name == "router" else tp)
    if sp and tp > 1:  # the reduce-scatters the policy saves: the TP-split row-parallel matmuls'
        per_token += sum(h * e / tp for name, _in, _out, row_parallel in block_matmuls(spec)
                         if row_parallel and not (whole and name.startswith("experts ")))
    per_token += (qd * e + 4 * a) / tp  # attention output and its log-sum-exp
    return math.ceil(seq * micro_batch * per_token) + checkpoint_outputs_bytes(spec, seq * micro_batch)


def checkpoint_outputs_bytes(spec: ModelSpec, tokens: int) -> int:
    """What a checkpointed block returns beyond its hidden state and so keeps whatever the policy
    recomputes: a mixture of experts' router probabilities when the model returns them for its
    load-balancing loss (transformers' ``output_router_logits``; fp32, every expert, on the whole
    sequence on every TP rank). Rehearsed on the tiny Mixtral (tp 2, SP, selective-op): 4,096
    bytes a block at 256 tokens, 16 bytes a token with 4 experts. Without checkpointing the same
    tensor is the router softmax's saved output (``_mlp_interior``)."""
    if spec.moe is None or not spec.moe.router_outputs:
        return 0
    return tokens * 4 * spec.moe.n_experts


def checkpointed_blocks(n_layers: int, checkpoint: str, every: int = 2) -> int:
    """How many of ``n_layers`` blocks the mode wraps whole (``selective``: blocks every-1, 2*every-1,
    ...; ``moe`` wraps only the blocks' MoE layers: no block whole)."""
    if checkpoint in ("none", "moe"):
        return 0
    if checkpoint == "selective":
        return n_layers // max(every, 1)
    return n_layers


@dataclass(frozen=True)
class RecomputeShare:
    """Fractions of the blocks' forward work done a second time in backward, by kind of work."""

    matmul: float  # of the blocks' matmul FLOPs
    attention: float  # of the attention-core FLOPs
    elementwise: float  # of the memory-bound (norm, activation, rotary, residual) traffic
    tp_collectives: float  # of the forward's TP/SP collectives, re-run during recomputation
    # Of the attention's context-parallel exchanges, and of the MoE layers' dispatch and combine
    # (None: as tp_collectives; they differ where a mode recomputes the MoE layer alone).
    cp_collectives: float | None = None
    ep_collectives: float | None = None

    def __post_init__(self) -> None:
        for name in ("cp_collectives", "ep_collectives"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.tp_collectives)


def recompute_share(spec: ModelSpec, checkpoint: str, every: int = 2) -> RecomputeShare:
    """What each checkpointing mode recomputes (``full``: the whole forward of every block)."""
    if checkpoint not in CHECKPOINT_MODES:
        raise unknown_choice("activation checkpointing mode", checkpoint, CHECKPOINT_MODES)
    layers = spec.n_layers or 1
    if checkpoint == "none":
        return RecomputeShare(0.0, 0.0, 0.0, 0.0)
    if checkpoint in ("full", "selective"):
        share = checkpointed_blocks(layers, checkpoint, every) / layers
        return RecomputeShare(share, share, share, share)
    if checkpoint == "moe":
        # The MoE layers' forward again: the router's and the active experts' matmuls, their share
        # of the block's memory-bound work, the SP gather around the layer (half the block's TP
        # collectives), every dispatch and combine; no attention, no cp exchange.
        if spec.moe is None or not spec.has_structure:
            return RecomputeShare(0.0, 0.0, 0.0, 0.0)
        mms = block_matmuls(spec)
        moe = sum(i * o for name, i, o, _ in mms if name.startswith(("router", "experts ")))
        # The memory-bound share as a ratio of one token's saved bytes at 16-bit activations.
        full = layer_activation_bytes(spec, 1, 1, 2)
        inside = full - layer_activation_bytes(spec, 1, 1, 2, moe_layer=False)
        return RecomputeShare(moe / sum(i * o for _, i, o, _ in mms), 0.0, inside / full, 0.5,
                              cp_collectives=0.0, ep_collectives=1.0)
    if not spec.has_structure:
        return RecomputeShare(0.5, 0.0, 1.0, 0.5)
    mms = block_matmuls(spec)
    total = sum(i * o for _, i, o, _ in mms)
    kept = sum(i * o for _, i, o, _ in op_sac_saved(spec))
    # Attention output is kept; every non-saved elementwise op is recomputed; the input
    # all-gathers of the recomputed column-parallel matmuls run again, the reduce-scatters do not.
    return RecomputeShare((total - kept) / total, 0.0, 1.0, 0.5)


def unplanned_caveat(layout: Layout, checkpoint: str) -> str:
    """A known gap of this memory model for the layout, as one line ('' when none is known): what
    the plan and ``train --dry-run`` print beside the figures so a user reads them rightly.

    Checkpointing under a V-shaped zero-bubble schedule: rank 0 (both ends of the V) is planned as if
    its terms all peaked together, which they do not (rehearsed at llama-3-405b tp 8 pp 8, 2026-11-28:
    rank 0 6 % (zbv) and 18 % (dualpipev) under its planned peak, the middle ranks within 2 %). It
    said "under-planned" until the runtime's weight pass stopped recomputing each block once per
    parameter group (parallel/pipeline/pp._recompute_once), whose copies the rehearsal had held."""
    info = schedule_info(layout.pp_schedule)
    if layout.pp > 1 and checkpoint != "none" and info.zero_bubble and info.placement == "v":
        return (f"memory over-planned on pipeline rank 0 under '{layout.pp_schedule}' with activation checkpointing: "
                "it holds both ends of the V and its planned terms do not all peak together (rehearsed: llama-3-405b "
                "rank 0 6-18 % below its planned peak, the middle ranks within 2 %); its figure is an upper bound, "
                "shardwise rehearse measures it")
    return ""


def activation_bytes(spec: ModelSpec, seq: int, micro_batch: int, act_bytes: int, *, checkpoint: str = "none",
                     tp: int = 1, sp: bool = True, attention: str = "sdpa", n_layers: int | None = None,
                     first_stage: bool = True, last_stage: bool = True, every: int = 2,
                     kernels: Kernels = SHARDWISE_KERNELS, autocast: bool = False, ep: int = 1) -> ActivationBytes:
    """Activation bytes for one micro-batch on one rank holding ``n_layers`` blocks (default: all).

    ``every`` is ``parallel.ac_every`` (the ``selective`` period); ``kernels`` the stack (Kernels);
    ``autocast`` whether 16-bit activations come from torch.autocast (``layer_activation_bytes``).
    """
    if checkpoint not in CHECKPOINT_MODES:
        raise unknown_choice("activation checkpointing mode", checkpoint, CHECKPOINT_MODES)
    layers = (spec.n_layers or 0) if n_layers is None else n_layers
    full = layer_activation_bytes(spec, seq, micro_batch, act_bytes, tp=tp, sp=sp, attention=attention,
                                  kernels=kernels, autocast=autocast, ep=ep)
    outer = outer_activation_bytes(spec, seq, micro_batch, act_bytes, tp=tp, first_stage=first_stage,
                                   last_stage=last_stage, kernels=kernels, autocast=autocast, sp=sp)
    # Expert parallel's routed slots, kept by every block that is not fully checkpointed (the
    # recomputation of a wrapped block does not hold them beyond what ``full`` counts: measured).
    dispatch = ep_dispatch_bytes(spec, seq * micro_batch, act_bytes, ep=ep) if kernels.ep_dispatch_copy else 0
    if checkpoint == "none":
        return ActivationBytes(layers * (full + dispatch) + outer, 0, full, outer)
    if checkpoint == "selective-op":
        kept = op_sac_layer_bytes(spec, seq, micro_batch, act_bytes, tp=tp, sp=sp, autocast=autocast,
                                  kernels=kernels) + dispatch
        # Backward of one block rematerialises what the policy did not keep.
        return ActivationBytes(layers * kept + outer, max(full - kept, 0), full, outer)
    if checkpoint == "moe":
        # Each MoE layer keeps only its input (the norm's output, which the block keeps anyway);
        # its backward rematerialises the layer's interior and, under expert parallel, the routed copy.
        kept = layer_activation_bytes(spec, seq, micro_batch, act_bytes, tp=tp, sp=sp, attention=attention,
                                      kernels=kernels, autocast=autocast, ep=ep, moe_layer=False)
        kept += checkpoint_outputs_bytes(spec, seq * micro_batch)
        return ActivationBytes(layers * kept + outer, max(full - kept, 0) + dispatch, full, outer)
    # full / selective: a wrapped block keeps only its input (split tp ways under sequence parallelism),
    # fp32 under autocast (the residual stream).
    kept = seq * micro_batch * (spec.hidden or 0) * (4 if autocast else act_bytes) // (tp if sp else 1)
    kept += checkpoint_outputs_bytes(spec, seq * micro_batch)
    wrapped = checkpointed_blocks(layers, checkpoint, every)
    saved = wrapped * kept + (layers - wrapped) * (full + dispatch) + outer
    return ActivationBytes(saved, full if wrapped else 0, full, outer)


# ---------------------------------------------------------------------------------------------
# Everything together


@dataclass
class MemoryBreakdown:
    """Per-GPU bytes of one candidate, by category. ``transient`` details its parts.

    ``fragmentation`` is the caching allocator's overhead over the live tensors (reserved minus
    allocated, what published "peak memory" figures include), a calibrated fraction of the rest.
    """

    params: int
    grads: int
    optimizer: int
    master: int
    activations: int
    transient: int
    transient_parts: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0  # per node, for fsdp-offload
    fragmentation: int = 0

    @property
    def allocated(self) -> int:
        """Peak bytes of live tensors (what ``torch.cuda.max_memory_allocated`` reports)."""
        return self.params + self.grads + self.optimizer + self.master + self.activations + self.transient

    @property
    def total(self) -> int:
        """Peak reserved bytes: live tensors plus the allocator's fragmentation."""
        return self.allocated + self.fragmentation


def indivisible_tp_sizes(spec: ModelSpec, tp: int) -> str:
    """The sizes of ``spec`` the runtime's TP plans split that ``tp`` does not divide, worded for a
    refusal ("32 attention heads, 11008 MLP width"); empty when it divides them all
    (``ModelSpec.tp_sizes``, the layout's one rule ``tp_indivisible``)."""
    return ", ".join(f"{size} {name}" for name, size in tp_indivisible(tp, spec.tp_sizes()).items())


def _autocasts(layout: Layout, kernels: Kernels) -> bool:
    """Whether ``layout``'s 16-bit activations come from torch.autocast: the runtime's own layouts
    that keep fp32 parameters (``Layout.casts_with_autocast``); a stack with a master copy
    (Megatron's, DeepSpeed's) casts its parameters to 16 bits whatever its data-parallel kind."""
    return layout.casts_with_autocast and layout.external is None and kernels.state == "fp32-params"


def _experts_own_unit(spec: ModelSpec, layout: Layout) -> bool:
    """Whether this runtime's FSDP shards a MoE block's experts as a unit apart from the rest of the
    block: under expert parallel (``parallel/experts/ep.shard_experts``), not on another stack."""
    return (spec.moe is not None and (getattr(layout, "ep", 1) or 1) > 1 and layout.external is None)


def _peak_moment(spec: ModelSpec, layout: Layout, prec: Precision, act: ActivationBytes, kernels: Kernels, *,
                 seq: int, micro_batch: int, unit: int, block_unit: int, head_unit: int, loss_parts: dict[str, int],
                 norm_backward: int, no_sync: bool, absent_grads: int = 0) -> dict[str, int]:
    """The transients of the moment of a micro-batch's backward that holds the most, on a rank
    without a pipeline, and the saved activations already freed then as a negative part.

    Not all of a step's buffers are alive at once, and each moment has freed some of the forward's
    saved tensors, so the moments are compared on what they hold beyond the activations column
    (the columns then add up to the peak, as the rehearsal reads them):

    * the loss: the logits, beside the units FSDP kept gathered after the forward (the final norm
      + head unit, run last, and the last block, run first in backward: ``parallel/data/fsdp.py``);
    * the final norm's backward: its working set (``norm_backward``) and the head's weight
      gradient (unsharded in the compute dtype until its unit's backward ends); freed by then: the
      loss's fp32 log-softmax, the head's input (the norm's output) and the normalised value the
      norm's weight multiplied (its first backward op);
    * the first block's backward: its own and the prefetched next block gathered, the MLP's backward
      (the gradient of its widest tensor and one per branch: SwiGLU's gate and up, GPT's GELU input;
      the routed top-k copies of a token in an MoE block), the block recomputed under checkpointing,
      the head unit's reduce-scatter input; the loss's and the final norm's saved tensors freed;
    * a later block's backward: the same with a block's reduce-scatter input and one more block's
      saved tensors freed.

    The reduce-scatter input (fp32) is extra only without no_sync accumulation: under it, FSDP
    copies the accumulated unsharded gradients (counted for the whole step) into it and frees them.

    ``absent_grads``: the gradient shards the state counts that do not exist yet when a step reduces
    its gradients once, in its only or (no_sync) its last micro-batch (zero_grad sets them to None;
    each unit's shard appears at its reduce-scatter):
    all of them at the loss and the final norm, all but the head unit's at the first block, all but
    the head's and one block's at a later one.
    """
    fsdp, sharded = layout.sharding == "fsdp", layout.sharding in ("zero2", "fsdp")
    tokens = seq * micro_batch
    last_outer = outer_activation_bytes(spec, seq, micro_batch, prec.act, tp=layout.tp, first_stage=False,
                                        kernels=kernels, autocast=_autocasts(layout, kernels))
    log_softmax = tokens * 4 * (spec.vocab or 0) // layout.tp if kernels.loss == "torch" and spec.vocab else 0
    sp = layout.tp if layout.sequence_parallel else 1
    norm_freed = log_softmax + 2 * tokens * (spec.hidden or 0) * prec.act // sp if norm_backward else 0
    kept = {"gathered after forward (head unit, last block)": prec.param * (head_unit + block_unit)} if fsdp else {}
    loss = {**kept, **loss_parts}
    head_weights = math.ceil(spec.outer_unit_params[-1] / layout.tp) if spec.params and spec.outer_unit_params else 0
    norm = {**kept, "final norm backward (fp32) + head weight grads":  # the gradients have the unpadded shapes
            norm_backward + (prec.param * head_weights if sharded else 0)}
    block: dict[str, int] = {}
    if spec.has_structure and spec.ffn_hidden:
        width = spec.ffn_hidden * spec.moe.top_k if spec.moe is not None else spec.ffn_hidden // layout.tp
        block["MLP backward (1 block)"] = (2 if spec.arch == "gpt" else 3) * tokens * width * prec.act
    if act.recompute_peak:
        block["recompute (1 block)"] = act.recompute_peak
    rs = sharded and not no_sync
    prefetch = {"all-gather (2 units, prefetch)": 2 * prec.param * block_unit}
    prefetch_later = {"all-gather (2 units, prefetch)": prec.param * (block_unit + unit)}
    if fsdp and _experts_own_unit(spec, layout):
        # The runtime shards a block's experts as an FSDP unit of their own (parallel/data/fsdp.py),
        # so backward gathers the experts and the rest of a block in turn, each prefetching the
        # other: one block's parameters at most, never two (a played Mixtral fsdp ep 2 rank held
        # its last block's experts and attention, 1,424 MiB, at its peak; 2,848 were planned).
        prefetch = prefetch_later = {"all-gather (1 block: its experts' unit and the rest, in turn)":
                                     prec.param * block_unit}
    first = {**(prefetch if fsdp else {}),
             **({"reduce-scatter (1 unit)": reduce_bytes(prec) * head_unit} if rs else {}), **block}
    later = {**(prefetch_later if fsdp else {}),
             **({"reduce-scatter (1 unit)": reduce_bytes(prec) * block_unit} if rs else {}), **block}
    if absent_grads:
        label = "gradient shards not created yet (reduced once a step)"
        head_shard = math.ceil(head_unit / max(layout.shard, 1)) * prec.grad
        block_shard = math.ceil(block_unit / max(layout.shard, 1)) * prec.grad
        loss, norm = {**loss, label: -absent_grads}, {**norm, label: -absent_grads}
        first = {**first, label: -max(0, absent_grads - head_shard)}
        # The second block's backward (the later moment that holds the most: each later one has
        # freed another block's activations, far more than the one shard it adds) holds the head's
        # and the last block's shards only. A played Mixtral fsdp ep 8 rank (one micro-batch) held
        # 8 of 2,784 MiB of gradients at its peak; this moment counted them all until 2026-11-28.
        later = {**later, label: -max(0, absent_grads - head_shard - block_shard)}
    layers = spec.n_layers or 1
    moments = [(loss, 0), (norm, norm_freed), (first, last_outer)]
    if layers > 1:
        moments.append((later, last_outer + (act.saved - act.outer) // layers))
    held, freed = max(moments, key=lambda m: sum(m[0].values()) - m[1])
    return {**held, **({"saved activations freed by then": -freed} if freed else {})}


_STAGE_PARAMS = "unsharded stage params (pp schedule)"  # a pipeline rank's part, read by _pipeline_moment


def _pipeline_moment(parts: dict[str, int], *, in_flight: int, saved: int, kept: int,
                     loss_keys: tuple[str, ...]) -> dict[str, int]:
    """The transients of a one-stage-per-rank pipeline rank (1F1B, GPipe) under FSDP, at the larger of
    the schedule's two kinds of moment (``parts``: everything the rank holds at some point of it).

    A stage's units reshard after their forward (all but the last block) and not after their
    backward (torch's schedule sets ``reshard_after_backward(False)`` until its last backward), so
    the stage's unsharded parameters are all alive only from the end of a backward to the next
    forward, which frees them unit by unit:

    * a backward right after a forward (the last stage's every backward, 1F1B's steady state): all
      ``in_flight`` micro-batches saved, the loss's tensors on the last stage, and of the stage's
      unsharded parameters only the units kept or gathered for it (``kept``: the last block, the
      one prefetched, the head on the last stage);
    * a backward right after another (1F1B's cool-down, GPipe's backwards) or the end of one: the
      whole stage unsharded, one micro-batch fewer saved (the one whose backward just ended; on the
      last stage of 1F1B none), the loss freed.

    Played on llama-3-405b tp 8 pp 8 (2026-11-28), the first stage peaked in its second backward of
    eight, a cool-down one: every unit unsharded, 7 of 8 micro-batches saved.
    """
    after_forward = {k: v for k, v in parts.items() if k != _STAGE_PARAMS}
    after_forward["unsharded units kept or gathered (backward after a forward)"] = kept
    after_backward = {k: v for k, v in parts.items() if k not in loss_keys and not k.startswith("pipeline in-flight")}
    if in_flight > 2:
        after_backward[f"pipeline in-flight ({in_flight - 1} stage micro-batches, one freed)"] = (in_flight - 2) * saved
    elif in_flight == 1:
        after_backward["saved activations freed by then"] = -saved
    if parts.get(_STAGE_PARAMS, 0) <= kept:  # nothing to gain: the stage is as small as what a backward gathers
        return parts
    return max((after_forward, after_backward), key=lambda m: sum(m.values()))


def memory_breakdown(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str, *, seq: int,
                     micro_batch: int, checkpoint: str = "none", grad_accum: int = 1, gpus_per_node: int = 1,
                     attention: str = "sdpa", every: int = 2, grad_sync: str = "step",
                     fragmentation: float = 0.0, kernels: Kernels = SHARDWISE_KERNELS,
                     loss_chunks: int | None = None, state_prec: Precision | None = None,
                     stage: int | None = None) -> MemoryBreakdown:
    """Per-GPU peak bytes of ``layout``: the worst pipeline rank (``stage`` None), or pipeline rank
    ``stage``'s own activations and transients. Model state is the largest rank's either way.

    ``prec`` sizes what a step materialises (gathers, buckets, activations); ``state_prec``, when
    given, what the run stores (parameters, gradients, master copy), else ``prec``.

    ``loss_chunks`` (``train.loss_chunks``: None auto-sized chunks, N) sizes the chunks when
    ``kernels.loss`` is "chunked".

    ``every`` is the ``selective`` checkpointing period; ``grad_sync`` says when gradients are
    reduced (GRAD_SYNC_MODES); ``fragmentation`` the allocator overhead as a fraction.
    """
    sizes = indivisible_tp_sizes(spec, layout.tp)
    if sizes:
        raise ConfigError(f"tensor-parallel degree {layout.tp} does not divide the {sizes} of {spec.name} "
                          "(tensor parallel splits each); use a divisor of all of them.")
    if layout.pp > 1 and spec.n_layers and not layout.stage_layers:
        stage_layer_ranges(spec.n_layers, layout.n_stages, layout.pp_first_stage_fewer)  # the layout's rule

    if grad_sync not in GRAD_SYNC_MODES:
        raise unknown_choice("gradient sync mode", grad_sync, GRAD_SYNC_MODES)
    state = state_bytes(spec, layout, state_prec or prec, optimizer)
    layout = _with_blocks(spec, layout)
    if stage is None:
        if layout.pp == 1:
            stage = 0
        else:  # the first rank (most micro-batches in flight) or the last (the head and the loss)
            kwargs = dict(seq=seq, micro_batch=micro_batch, checkpoint=checkpoint, grad_accum=grad_accum,
                          gpus_per_node=gpus_per_node, attention=attention, every=every, grad_sync=grad_sync,
                          fragmentation=fragmentation, kernels=kernels, loss_chunks=loss_chunks,
                          state_prec=state_prec)
            return max((memory_breakdown(spec, layout, prec, optimizer, stage=s, **kwargs)
                        for s in (0, layout.pp - 1)), key=lambda m: m.total)
    layers_here = len(layout.rank_layers(stage)) if layout.pp > 1 else (spec.n_layers or 1)
    # Pipeline rank ``stage``: its blocks, the embeddings on the first, the head and the loss on the
    # last, and its schedule's micro-batches in flight. With one stage, both ends are local.
    # Context parallel (plan/cp.py): each rank's activations are those of seq / cp tokens.
    act = activation_bytes(spec, seq // cp_degree(layout), micro_batch, prec.act, checkpoint=checkpoint, tp=layout.tp,
                           sp=layout.sequence_parallel, attention=attention, n_layers=layers_here,
                           first_stage=layout.holds_first_stage(stage) if layout.pp > 1 else True,
                           last_stage=layout.holds_last_stage(stage), every=every,
                           kernels=kernels, ep=layout.ep, autocast=_autocasts(layout, kernels))
    cp = cp_degree(layout)
    if (cp > 1 and spec.has_structure and spec.hidden and spec.n_heads and layout.external is None
            and checkpoint in ("none", "selective", "moe")
            and cp_impl_for("auto", spec.n_heads, layout.tp, cp) == "alltoall"):
        # The all-to-all attention (parallel/context/cp.py) keeps, in each block it does not recompute,
        # one more hidden-wide tensor: the heads gathered back are a new tensor, so the attention's
        # output and the output projection's input are two (one storage without cp). And with fewer
        # key/value heads per TP rank than cp ranks, k and v are repeated to one per query head
        # before the exchange, and kept at that width. Read on played llama-3-8b ranks: +32 MiB a
        # layer at cp 2 (4,096 local tokens), +160 MiB a layer at cp 16 (8,192: 64 + 96 for k, v).
        tokens_local = seq // cp * micro_batch
        heads, kv = spec.n_heads // layout.tp, spec.kv_heads // layout.tp
        per_layer = tokens_local * spec.hidden // layout.tp * prec.act
        if kv != heads and kv % cp:
            per_layer += 2 * tokens_local * (heads - kv) * spec.dim_head * prec.act
        unwrapped = layers_here - checkpointed_blocks(layers_here, checkpoint, every)
        act = replace(act, saved=act.saved + unwrapped * per_layer)
    last_share = 0
    if layout.pp > 1 and spec.has_structure:
        last = layout.holds_last_stage(stage)
        output = 0
        if layout.external is None:
            # torch's schedule keeps each stage's output in its forward cache until that micro-batch's
            # backward: the boundary tensor a stage sends on, or the last stage's logits (vocabulary-split
            # under TP), beside what the stage's modules saved. A rehearsed llama-3-405b first stage held
            # 32 MiB a micro-batch more than its blocks' (its boundary), the last its 250 MiB of logits.
            # (A fused loss's kept logits are that tensor: outer_activation_bytes counts them already.)
            output = (0 if kernels.loss in ("fused", "compiled") else
                      seq // cp_degree(layout) * micro_batch * (spec.vocab or 0) // layout.tp * prec.act) if last \
                else stage_boundary_bytes(spec, layout, seq, micro_batch, prec.act)
            act = replace(act, saved=act.saved + output, outer=act.outer + output)
        # Any interleaved schedule (torch's, Megatron's: its last rank runs each loss-chunk micro-batch's
        # backward right after its forward) holds the last stage's tensors for one micro-batch at a time.
        if last and layout.pp_stages_per_rank > 1:
            # The last stage's share of one micro-batch (its blocks, final norm, head input, loss and
            # logits): a loss stage runs each micro-batch's backward right after its forward, so the
            # schedule's other in-flight micro-batches are this rank's other stages' (in-flight below).
            last_blocks = len(layout.stage_ranges[layout.n_stages - 1]) * (act.saved - act.outer) // max(layers_here, 1)
            last_share = last_blocks + output + outer_activation_bytes(
                spec, seq // cp_degree(layout), micro_batch, prec.act, tp=layout.tp, first_stage=False,
                last_stage=True, kernels=kernels, autocast=_autocasts(layout, kernels), sp=layout.sequence_parallel)
    parts: dict[str, int] = {}
    unit = spec.largest_unit_params()
    # Expert parallel (plan/moe.py): FSDP gathers a MoE block's n_experts / ep experts, not all.
    ep = getattr(layout, "ep", 1) or 1
    if ep > 1 and spec.moe is not None:
        unit -= spec.moe.n_experts * spec.moe.params_per_expert - int(expert_unit_bytes(spec, ep, 1))
    if layout.tp > 1:
        unit = math.ceil(unit / layout.tp)
    # The largest block unit (its own experts under EP), and the final norm + head unit (the root unit
    # when the embeddings are tied to the head), TP-split.
    blocks = [n for k, n in spec.unit_params().items() if k != ROOT_UNIT] if spec.params else []
    block_unit = max(blocks) if blocks else spec.largest_unit_params()
    head_unit = spec.outer_unit_params[-1] if spec.params and spec.outer_unit_params else 0
    if ep > 1 and spec.moe is not None and blocks:
        block_unit -= spec.moe.n_experts * spec.moe.params_per_expert - int(expert_unit_bytes(spec, ep, 1))
    elif blocks and layout.pp == 1:
        # As gathered: TP-split and padded to the shard count (the head unit's share of the root's padding).
        gathered = gathered_unit_numels(spec, layout)
        block_unit = max(n for k, n in gathered.items() if k != ROOT_UNIT) * layout.tp
        head_unit = math.ceil(gathered.get(ROOT_UNIT, 0) * head_unit / sum(spec.outer_unit_params)) * layout.tp
    block_unit, head_unit = math.ceil(block_unit / layout.tp), math.ceil(head_unit / layout.tp)
    full_local = local_numel(spec, layout, 0) if spec.params else math.ceil(
        spec.n_params / (layout.tp * layout.pp))
    # What stays unsharded on this rank (pipeline stage, no_sync accumulation): under expert
    # parallel only its own n_experts / ep experts of each of the stage's MoE layers.
    held_local = held_unsharded_numel(spec, layout, 0) if spec.params else full_local
    grads = state.grads
    reduce_copies = 0  # bytes that exist only while the gradients are reduced, after the schedule
    if layout.sharding == "replicate" and layout.dp > 1 or layout.sharding == "zero1":
        # Where the stack keeps the gradients it reduces (Kernels.grad_buffer).
        # (held_local: the parameters this rank holds, its n_experts / ep experts under expert parallel.)
        if kernels.grad_buffer == "ddp":
            # DDP copies every gradient into its own flat buckets (gradient_as_bucket_view=False).
            parts["ddp buckets"] = prec.grad * held_local
        elif kernels.grad_buffer == "deepspeed-bf16":
            # The bf16 gradients stay next to the fp32 accumulation buffer (the state's grads);
            # the bf16 cast of that buffer for the all-reduce comes after the schedule.
            grads += 2 * held_local
            reduce_copies = 2 * held_local
        # "contiguous": reduced in place in the fp32 buffer the state already counts.
    elif layout.sharding in ("zero2", "fsdp") and layout.pp > 1:
        # torch.distributed.pipelining keeps each stage unsharded for the whole schedule
        # (set_reshard_after_backward(False)) and accumulates its unsharded fp32 gradients until
        # the last micro-batch (set_requires_gradient_sync(False)).
        stages_held = held_local
        v = layout.pp_stages_per_rank
        if layout.external is None and v > 1:
            # Only the stages between their first and last backward hold these (core.pp_schedules.
            # stages_in_backward): a played llama-3-405b interleaved rank (tp 8, pp 8, 2 stages,
            # m 8) held one stage's of each.
            stages_held = math.ceil(held_local * stages_in_backward(layout.pp_schedule, layout.pp,
                                                                    layout.pp_microbatches, v) / v)
        parts[_STAGE_PARAMS] = prec.param * stages_held
        parts["unsharded stage grads (pp schedule)"] = reduce_bytes(prec) * stages_held
    elif layout.sharding == "zero2":
        # reshard_after_forward=False: every unsharded parameter stays from forward to backward.
        parts["unsharded params (fwd->bwd)"] = prec.param * full_local
    no_sync = layout.sharding in ("zero2", "fsdp") and layout.pp == 1 and grad_accum > 1 and grad_sync == "step"
    if no_sync:
        # no_sync under gradient accumulation (set_requires_gradient_sync(False)): FSDP keeps every
        # unit's unsharded gradients, in the reduce dtype (fp32; bf16 under bf16-true), until the
        # last micro-batch.
        parts["unsharded grads (no_sync accumulation)"] = reduce_bytes(prec) * held_local
    if act.recompute_peak and layout.pp > 1:
        parts["recompute (1 block)"] = act.recompute_peak
    if layout.pp > 1:
        # The activations column is one micro-batch through this rank's v stages; its schedule holds
        # up to peak_in_flight stage-micro-batches (one stage's blocks each) within one schedule
        # step of pp_microbatches (core/pp_schedules.py: counted on torch's action orders).
        v = layout.pp_stages_per_rank
        chunks = peak_in_flight(layout.pp_schedule, layout.pp, layout.pp_microbatches, v, stage)
        if chunks > v:
            # Each in-flight micro-batch of the first stage also keeps its token ids and rotary tables (73 KiB
            # per hf-llama-tiny micro-batch on ZBV's rank 0, not counted before 2026-11-27).
            # A rank holding the last stage: each in-flight micro-batch is one of its other stages'
            # (the mean of those), not the mean of all v with the loss's tensors. Charged the mean of all v
            # until 2026-11-28: llama-3-405b's ZBV rank 0 was planned 12.4 GiB of in-flight tensors where
            # it held 5.5 (its first stage's checkpoint inputs; docs/rehearse.md).
            per_chunk = (act.saved - last_share) / (v - 1) if last_share else act.saved / v
            parts[f"pipeline in-flight ({chunks} stage micro-batches)"] = math.ceil((chunks - v) * per_chunk)
        # The zero-bubble schedules split each backward: the input-gradient pass keeps the gradients
        # of every weight op's output (the block's matmuls: column-parallel ones 1/tp wide) for the
        # deferred weight-gradient pass, stage-micro-batch by stage-micro-batch.
        due = peak_weight_passes_due(layout.pp_schedule, layout.pp, layout.pp_microbatches, v, stage)
        if due and layout.sharding in ("zero2", "fsdp") and prec.param < reduce_bytes(prec):
            # The weight pass sets each weight's gradient in the compute dtype; FSDP casts it to fp32 and
            # adds it to the stage's accumulated gradients only in its next post-backward, which runs
            # in the next input pass: one stage's weight gradients wait. (Their fp32 copy was counted too
            # until 2026-11-28: read at llama-3-405b's ZBV peak, the fp32 gradients alive are the stage's
            # unsharded accumulations alone, above, and the copy over-planned every rank by 11.4 GiB.)
            parts["zero-bubble weight grads awaiting FSDP (1 stage)"] = prec.param * math.ceil(held_local / v)
        if due and spec.has_structure:
            widths = sum(out if row_parallel else out / layout.tp for _, _, out, row_parallel in block_matmuls(spec))
            # And the gradient of each of the block's two norms' outputs (the intermediate leading to the
            # linears' weights after it): fp32 under autocast (a norm's fp32 weight), sequence-sharded under
            # SP (reduce-scattered back to the norm's shard). Rehearsed under ZBV, two layers a stage, per
            # pending stage micro-batch beyond the matmuls' outputs': a tiny Llama's `pp` rank kept four fp32
            # residual-width gradients, its fsdp+tp+pp rank at tp 2 four bf16 ones without SP and four
            # half-sequence ones with SP.
            norms = 2 * (spec.hidden or 0) * (4 if _autocasts(layout, kernels) else prec.act) / (
                layout.tp if layout.sequence_parallel else 1)
            parts[f"weight-op output gradients ({due} stage micro-batches, zero bubble)"] = math.ceil(
                due * layers_here / v * micro_batch * (seq // cp_degree(layout)) * (widths * prec.act + norms))
        # torch's receive buffers, one per micro-batch of a step for each input or output gradient
        # that comes from another rank, kept for the run: the residual stream at a stage boundary
        # (this rank's sequence shard under sequence parallel).
        receives = cross_rank_receives(layout.pp_schedule, layout.pp, v, stage)
        boundary = stage_boundary_bytes(spec, layout, seq, micro_batch, prec.act)
        if receives and boundary and kernels.pp_receive_buffers:
            parts[f"pipeline receive buffers ({receives} x {layout.pp_microbatches})"] = (
                receives * layout.pp_microbatches * boundary)
    tokens_here = seq // cp_degree(layout) * micro_batch  # context parallel: seq / cp tokens per rank
    if ep > 1 and spec.moe is not None:
        # Dispatch/combine buffers: this rank's routed token copies sent and received.
        parts["all-to-all buffers (ep)"] = 2 * tokens_here * spec.moe.top_k * spec.moe.hidden * prec.act
    # The loss's logits: on the rank with the head, and still charged to the first rank too (the
    # earlier model's conservative count; moving them to the last rank alone lowers every BLOOM
    # peak by 1.6-3.3 GiB, below the nvidia-smi readings by up to 6.5 GiB: not settled).
    holds_loss = layout.holds_last_stage(stage) or stage == 0
    loss_parts: dict[str, int] = {}
    if spec.has_structure and spec.vocab and kernels.loss == "torch" and holds_loss:
        # Loss: logits in the activation dtype, their fp32 copy, then the fp32 gradient. (A fused
        # loss keeps the logits, counted with the activations, and writes the gradient in place.)
        per_logit = prec.act + 4
        if layout.tp > 1 and layout.external is None:
            # The runtime's TP loss is torch's loss_parallel, whose backward computes
            # ``(grad_input + exp(x)) * grad_output`` in fp32 over the rank's vocabulary shard: three
            # fp32 copies alive at once (the one-hot gradient, exp(x) or the sum, the result). A played
            # llama-3-70b tp 4 rank (8,192 tokens) peaked there with 3,006 MiB against 1,503 planned.
            per_logit = max(per_logit, 3 * 4)
        elif layout.external is None:
            # The runtime's eager F.cross_entropy: nll_loss's backward writes an fp32 gradient of the
            # log-probabilities and log_softmax's backward another for the logits, both alive at once
            # (the 16-bit logits are freed by then). A played Qwen3-30B-A3B fsdp ep 4 rank (8,192
            # tokens of a 151,936 vocabulary) peaked there with 9,496 MiB of temporaries: 8 bytes a logit.
            per_logit = max(per_logit, 2 * 4)
        loss_parts["logits + loss"] = tokens_here * (spec.vocab // layout.tp) * per_logit
    elif spec.has_structure and spec.vocab and kernels.loss == "compiled" and holds_loss:
        # inductor's backward of the compiled loss allocates the logits' gradient (the activation
        # dtype, the logits' shape) while the saved 16-bit logits are still held: the generated code
        # of ``torch.compile(workloads.cross_entropy_loss)`` (torch 2.13) keeps the logits, the
        # per-token max and log-sum-exp, and its backward returns a new (tokens, vocab) buffer.
        # GPT-2 124M, 8 x 1,024 tokens, on an H200: 6.14 GiB measured, 5.67 planned without it.
        loss_parts["logits gradient (compiled loss backward)"] = tokens_here * (spec.vocab // layout.tp) * prec.act
    elif spec.has_structure and spec.vocab and kernels.loss == "chunked" and holds_loss:
        loss_parts["logits + loss (chunked)"] = logits_bytes(tokens_here, spec.vocab, chunked=True, chunks=loss_chunks)
        if spec.hidden:
            # shardwise.loss's chunked backward accumulates the head's weight gradient in fp32 and adds
            # each chunk's product in the compute dtype through its fp32 copy
            # (``grad_w += (d_logits.t() @ h).to(fp32)``): 4 + 2 + 4 bytes a head weight in bf16.
            # Played llama-3-70b fsdp cp 4 / llama-3-8b fsdp ranks peaked there: 10,147 / 5,169 MiB
            # of temporaries against 10,020 / 5,010 MiB by this term (2026-11-28).
            loss_parts["head weight gradient (chunked loss backward)"] = spec.vocab * spec.hidden * (
                4 + prec.act + (4 if prec.act < 4 else 0))
    loss_bytes = sum(loss_parts.values())
    # The backward's own working set, beyond what it frees: right after the loss's backward, every
    # block's activations are still saved when the last norm's backward runs. An eager RMSNorm
    # (up-cast to fp32, x * rsqrt(mean(x^2))) holds five fp32 tensors of its width at once there:
    # the up-cast output gradient, the two partial input gradients (through x and through the
    # variance), the variance branch's expanded gradient, and their sum (tracked on hf-llama-tiny:
    # 5 x tokens x hidden x 4 bytes, with fp32 activations too: the output gradient times the weight
    # is a new fp32 tensor there). It follows the loss's logits, which are freed by then, so the peak
    # holds the larger of the two. LayerNorm and fused norms are one kernel with one gradient.
    norm_backward = 0
    if spec.has_structure and spec.arch != "gpt" and kernels.norm == "eager" and spec.hidden:
        norm_backward = 5 * 4 * tokens_here * spec.hidden // (layout.tp if layout.sequence_parallel else 1)
    # A step of one micro-batch starts without gradients (the trainer's zero_grad sets them to None):
    # under FSDP/ZeRO-2 each unit's shard appears at its reduce-scatter, under DDP/ZeRO-1 each whole
    # gradient as autograd makes it, so the loss and the first backward moments hold none of the
    # gradients the state counts (a played llama-3-8b fsdp rank: 0 bytes of gradients at its peak, in
    # the head's backward, 2026-11-28; played gpt2 and gpt2-xl ddp and zero1 ranks likewise, their
    # peaks inside lm_head's backward, where DDP's persistent buckets are all the rank holds of them).
    # So does a step whose sharded gradients are reduced once, after its last micro-batch (no_sync):
    # zero_grad freed the shards and each reappears only at its unit's reduce-scatter in that
    # micro-batch's backward (played llama-3-8b fsdp ranks, grad_accum 2: 1,915 MiB of bf16-true
    # shards and 3,829 MiB of bf16-mixed ones planned at the peak that were not there, 2026-11-29).
    absent_grads = (state.grads if (grad_accum == 1 or no_sync) and layout.external is None
                    and not layout.offload else 0)
    if layout.pp > 1:
        # A pipeline rank (whose rehearsed peaks fall in that backward: 1F1B and interleaved, both
        # ends) holds its in-flight micro-batches and buffers through the whole schedule.
        parts.update(loss_parts)
        if norm_backward > loss_bytes:
            parts["norm backward (fp32, beyond the loss's)"] = norm_backward - loss_bytes
        if (layout.sharding in ("zero2", "fsdp") and layout.external is None and not layout.offload
                and grad_accum <= layout.pp_microbatches):
            # One schedule run a step: zero_grad set the gradient shards to None and torch's schedule
            # creates them in its reduce after the last backward (``perform_reduce_grad``), as the
            # unsharded ones are freed: no moment of the schedule holds them (a played llama-3-405b
            # first stage: 416 of 2,975 MiB of gradients at its peak, a unit's 16-bit gradient).
            parts["gradient shards not created yet (pipeline schedule)"] = -state.grads
        if (layout.sharding == "fsdp" and layout.external is None and not layout.offload
                and not schedule_info(layout.pp_schedule).multi_stage):
            in_flight = peak_in_flight(layout.pp_schedule, layout.pp, layout.pp_microbatches, 1, stage)
            kept = prec.param * (2 * block_unit + (head_unit if layout.holds_last_stage(stage) else 0))
            parts = _pipeline_moment(parts, in_flight=in_flight, saved=act.saved, kept=kept,
                                     loss_keys=(*loss_parts, "norm backward (fp32, beyond the loss's)"))
    else:
        parts.update(_peak_moment(spec, layout, prec, act, kernels, seq=seq // cp_degree(layout),
                                  micro_batch=micro_batch, unit=unit,
                                  block_unit=block_unit, head_unit=head_unit, loss_parts=loss_parts,
                                  norm_backward=norm_backward,
                                  no_sync=no_sync, absent_grads=absent_grads))
    if reduce_copies > act.saved + sum(parts.values()):
        # The reduce's copies outgrow the schedule's activations and buffers, which are freed
        # by then: the peak is the reduce's, counted as what it adds beyond the schedule's.
        parts["grad reduce copies (after the schedule)"] = reduce_copies - act.saved - sum(parts.values())
    host = 0
    params, opt, master = state.params, state.optimizer, state.master
    if layout.offload:
        # CPUOffloadPolicy: sharded params, grads and optimizer state live in (pinned) host RAM.
        host = state.total * gpus_per_node
        params = grads = opt = master = 0
    out = MemoryBreakdown(params, grads, opt, master, act.saved, sum(parts.values()), parts, host)
    out.fragmentation = math.ceil(fragmentation * out.allocated)
    return out
