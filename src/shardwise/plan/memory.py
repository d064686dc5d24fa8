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

import functools
import heapq
import math
from dataclasses import dataclass, field

from shardwise.errors import ConfigError, unknown_choice
from shardwise.layout import Layout
from shardwise.plan.spec import ROOT_UNIT, ModelSpec, ParamInfo

# ``Layout`` (imported above) is the runtime's layout object: strategy, dp, tp, pp, shard, offload,
# pipeline schedule, stages per rank, micro-batches, stage layer ranges. The planner uses it as is.


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
}

OPTIMIZERS = ("adamw", "sgd", "adafactor")
CHECKPOINT_MODES = ("none", "selective", "full")
STEP_BYTES = 4  # torch.optim's per-tensor 0-dim fp32 ``step`` (AdamW, Adafactor)


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise unknown_choice("precision", name, PRECISIONS)
    return PRECISIONS[name]


def optimizer_state_bytes(shape: tuple[int, ...], optimizer: str) -> int:
    """fp32 optimizer-state bytes for one (local) tensor of ``shape``, excluding ``step``."""
    numel = math.prod(shape)
    if numel == 0:
        return 0
    if optimizer == "adamw":
        return 8 * numel  # exp_avg + exp_avg_sq
    if optimizer == "sgd":
        return 4 * numel  # momentum buffer
    if optimizer == "adafactor":
        # Factored second moment (row + column statistics) for >=2-D tensors, full for vectors; no
        # first moment (torch.optim.Adafactor's default beta1=None).
        if len(shape) >= 2:
            return 4 * (numel // shape[-1] + numel // shape[-2])
        return 4 * numel
    raise unknown_choice("optimizer", optimizer, OPTIMIZERS)


def _step_bytes(optimizer: str) -> int:
    return 0 if optimizer == "sgd" else STEP_BYTES


@dataclass
class StateBytes:
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    master: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.master


def _local_params(spec: ModelSpec, layout: Layout, stage: int) -> list[ParamInfo]:
    """Parameters one rank holds before data-parallel sharding: its pipeline stage, its TP slice."""
    params = list(spec.params)
    if not params:  # bare count: one flat pseudo-tensor
        params = [ParamInfo("all", (spec.n_params,), ROOT_UNIT)]
    if layout.pp > 1:
        # ``stage`` is the pipeline rank; it holds the blocks of every stage the runtime gives it
        # (``Layout.stage_ranges``: the runtime's own split, interleaved stages included).
        layout = _with_blocks(spec, layout)
        owned = set(layout.rank_layers(stage))
        first, last = layout.holds_first_stage(stage), layout.holds_last_stage(stage)

        def on_stage(p: ParamInfo) -> bool:
            if p.unit != ROOT_UNIT:
                return p.unit in owned
            is_embedding = "emb" in p.name or ".wte." in p.name or ".wpe." in p.name
            # Embeddings live on the first stage, final norm and head on the last; a tied
            # embedding is duplicated on both (as Megatron does).
            return (first and is_embedding) or (last and (not is_embedding or spec.tied_embeddings))

        params = [p for p in params if on_stage(p)]
    if layout.tp > 1:
        # Matrices are split tp ways (column- or row-wise, vocab-parallel embeddings); vectors
        # (norm weights, most biases) are replicated. Modelled as a dim-0 split.
        params = [ParamInfo(p.name, (math.ceil(p.shape[0] / layout.tp), *p.shape[1:]), p.unit)
                  if len(p.shape) >= 2 else p for p in params]
    return params


def _with_blocks(spec: ModelSpec, layout: Layout) -> Layout:
    """The layout with the model's block count (so its stage ranges exist)."""
    if layout.n_blocks is None:
        return layout.with_blocks(spec.n_layers or 1)
    return layout


def zero1_partition(numels: list[int], world: int) -> list[list[int]]:
    """Indices of the tensors each rank owns, exactly as ZeroRedundancyOptimizer partitions them.

    Sorted by size, largest first (a stable sort, so equal sizes keep registration order); each
    goes to the rank with the smallest total so far (lowest rank on ties).
    """
    return [list(owned) for owned in _zero1_partition(tuple(numels), world)]


@functools.lru_cache(maxsize=256)
def _zero1_partition(numels: tuple[int, ...], world: int) -> tuple[tuple[int, ...], ...]:
    # A heap of (total so far, rank) pops the smallest total, lowest rank on ties: the same choice
    # as scanning for the minimum, in O(log world) per tensor (a 512-rank plan stays instant).
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
    heap = [(0, rank) for rank in range(world)]
    owned: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        size, rank = heapq.heappop(heap)
        owned[rank].append(i)
        heapq.heappush(heap, (size + numels[i], rank))
    return tuple(tuple(o) for o in owned)


def _zero1_heaviest_rank(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str, stage: int) -> int:
    """The ZeRO-1 rank that owns the most optimizer state and master weights (lowest on ties)."""
    if not spec.params:
        return 0  # bare count: an even split, every rank alike
    params = _local_params(spec, layout, stage)
    step = _step_bytes(optimizer)
    load = [sum(optimizer_state_bytes(params[i].shape, optimizer) + step + prec.master * params[i].numel
                for i in owned) for owned in zero1_partition([p.numel for p in params], layout.dp)]
    return load.index(max(load))


def _chunk_rows(dim0: int, n: int, rank: int) -> tuple[int, int]:
    """(padded rows, actual rows) of ``rank``'s torch.chunk shard of ``dim0`` rows over ``n`` ranks."""
    padded = math.ceil(dim0 / n)
    return padded, max(0, min(padded, dim0 - rank * padded))


def state_bytes(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str,
                rank: int | None = None, stage: int = 0) -> StateBytes:
    """Model-state bytes held by one rank (``rank`` in the data-parallel group and ``stage`` its
    pipeline rank; rank None = the largest over every rank and stage).

    Exact for the tensors in ``spec.params``.
    Offloaded state is still counted here (it lives in host RAM; see MemoryBreakdown.host_bytes).
    """
    if rank is None:
        best = StateBytes()
        for stage in range(layout.pp):
            # Parameters and gradients are alike on every rank of a stage; ZeRO-1's optimizer share
            # is not (whole tensors), FSDP's rank 0 holds the most (padding only shortens the tail).
            r = _zero1_heaviest_rank(spec, layout, prec, optimizer, stage) if layout.sharding == "zero1" else 0
            sb = _state_bytes_one(spec, layout, prec, optimizer, r, stage)
            if sb.total > best.total:
                best = sb
        return best
    return _state_bytes_one(spec, layout, prec, optimizer, rank, stage)


def _state_bytes_one(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str,
                     rank: int, stage: int) -> StateBytes:
    params = _local_params(spec, layout, stage)
    step = _step_bytes(optimizer)
    out = StateBytes()
    if layout.sharding in ("replicate", "zero1"):
        numels = [p.numel for p in params]
        out.params = prec.param * sum(numels)
        out.grads = prec.grad * sum(numels)
        if layout.sharding == "zero1" and not spec.params:
            # Bare count: no tensor boundaries known, so assume an even split of the flat state.
            share = math.ceil(numels[0] / layout.dp)
            out.optimizer = optimizer_state_bytes((share,), optimizer) + step
            out.master = prec.master * share
            return out
        owned = range(len(params)) if layout.sharding == "replicate" else zero1_partition(numels, layout.dp)[rank]
        for i in owned:
            out.optimizer += optimizer_state_bytes(params[i].shape, optimizer) + step
            out.master += prec.master * numels[i]
        return out
    n = layout.shard
    for p in params:
        padded, actual = _chunk_rows(p.shape[0], n, rank)
        rest = math.prod(p.shape[1:])
        out.params += prec.param * padded * rest  # FSDP2 pads parameter and gradient storage
        out.grads += prec.grad * padded * rest
        local_shape = (actual, *p.shape[1:])
        out.optimizer += optimizer_state_bytes(local_shape, optimizer) + step
        out.master += prec.master * actual * rest
    return out


# ---------------------------------------------------------------------------------------------
# Activations


@dataclass
class ActivationBytes:
    """Bytes one rank keeps for backward for ONE micro-batch, and the extra peak while recomputing."""

    saved: int
    recompute_peak: int  # one block's full activations, live while it is recomputed (AC modes)
    per_layer_full: int  # one block's activations without checkpointing
    outer: int  # embeddings, final norm and loss, outside the blocks


def layer_activation_bytes(spec: ModelSpec, seq: int, micro_batch: int, act_bytes: int, *, tp: int = 1,
                           sp: bool = True, attention: str = "sdpa") -> int:
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
    if spec.arch == "gpt":
        norm_region = 4 * h * e + 2 * 2 * 4 + 2 * mask * h  # LN in/out x2, fp32 stats, residual-dropout masks
        inner = (qd + 2 * kvd + qd + 2 * f) * e  # q, k, v, attention out, fc out, GELU out
    else:
        norm_region = 2 * (4 * h + 2 * h * e + 4)  # two RMSNorms
        inner = (2 * qd + 2 * kvd + 4 * f) * e  # rotated q, k, v, attention out, 4 MLP tensors
    if attention == "sdpa":
        inner += 4 * a  # fp32 log-sum-exp per head
    elif attention == "math":
        inner += a * seq * e + mask * a * seq * (1 + e)  # softmax (+ dropout mask and output)
    else:
        raise unknown_choice("attention implementation", attention, ("sdpa", "math"))
    return tokens * (norm_region // norm_div + inner // tp)


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
                           first_stage: bool = True, last_stage: bool = True) -> int:
    """Bytes saved outside the blocks: token ids, rotary tables, final norm, fp32 log-softmax of the loss."""
    if not spec.has_structure:
        return 0
    assert spec.hidden and spec.vocab
    h, e, tokens = spec.hidden, act_bytes, seq * micro_batch
    total = 0
    if first_stage:
        total += 8 * tokens + (8 * seq if spec.learned_positions else 2 * seq * spec.dim_head * e)
    if last_stage:
        final_norm = 2 * h * e + 8 if spec.arch == "gpt" else 4 * h + 2 * h * e + 4
        # The loss up-casts logits to fp32 and log_softmax keeps its fp32 output (vocab-parallel
        # under TP).
        total += tokens * (final_norm + 4 * spec.vocab // tp)
    return total


def activation_bytes(spec: ModelSpec, seq: int, micro_batch: int, act_bytes: int, *, checkpoint: str = "none",
                     tp: int = 1, sp: bool = True, attention: str = "sdpa", n_layers: int | None = None,
                     first_stage: bool = True, last_stage: bool = True) -> ActivationBytes:
    """Activation bytes for one micro-batch on one rank holding ``n_layers`` blocks (default: all)."""
    if checkpoint not in CHECKPOINT_MODES:
        raise unknown_choice("activation checkpointing mode", checkpoint, CHECKPOINT_MODES)
    layers = (spec.n_layers or 0) if n_layers is None else n_layers
    full = layer_activation_bytes(spec, seq, micro_batch, act_bytes, tp=tp, sp=sp, attention=attention)
    outer = outer_activation_bytes(spec, seq, micro_batch, act_bytes, tp=tp, first_stage=first_stage,
                                   last_stage=last_stage)
    if checkpoint == "none":
        return ActivationBytes(layers * full + outer, 0, full, outer)
    if checkpoint == "full":
        # Only each block's input survives the forward (split tp ways under sequence parallelism).
        kept = seq * micro_batch * (spec.hidden or 0) * act_bytes // (tp if sp else 1)
        return ActivationBytes(layers * kept + outer, full, full, outer)
    # selective: drop only the attention core (softmax and its dropout), which the flash/SDPA path
    # never stores in the first place.
    core = full - layer_activation_bytes(spec, seq, micro_batch, act_bytes, tp=tp, sp=sp, attention="sdpa")
    core = max(core, 0)
    return ActivationBytes(layers * (full - core) + outer, core, full, outer)


# ---------------------------------------------------------------------------------------------
# Everything together


@dataclass
class MemoryBreakdown:
    """Per-GPU bytes of one candidate, by category. ``transient`` details its parts."""

    params: int
    grads: int
    optimizer: int
    master: int
    activations: int
    transient: int
    transient_parts: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0  # per node, for fsdp-offload

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.master + self.activations + self.transient


def memory_breakdown(spec: ModelSpec, layout: Layout, prec: Precision, optimizer: str, *, seq: int,
                     micro_batch: int, checkpoint: str = "none", grad_accum: int = 1, gpus_per_node: int = 1,
                     attention: str = "sdpa") -> MemoryBreakdown:
    """Per-GPU peak bytes of ``layout`` (worst rank / pipeline stage)."""
    if layout.tp > 1 and spec.n_heads and spec.n_heads % layout.tp:
        raise ConfigError(f"tensor-parallel degree {layout.tp} does not divide the {spec.n_heads} attention "
                          f"heads of {spec.name}; use a divisor of {spec.n_heads}.")
    if layout.pp > 1 and spec.n_layers and layout.pp > spec.n_layers:
        raise ConfigError(f"{layout.pp} pipeline stages but {spec.name} has only {spec.n_layers} layers; "
                          f"use at most {spec.n_layers} stages.")
    state = state_bytes(spec, layout, prec, optimizer)
    layout = _with_blocks(spec, layout)
    layers_here = len(layout.rank_layers(0)) if layout.pp > 1 else (spec.n_layers or 1)
    # The first pipeline stage holds the most: its blocks plus embeddings, and (1F1B) up to pp
    # micro-batches in flight. With one stage, both ends are local.
    act = activation_bytes(spec, seq, micro_batch, prec.act, checkpoint=checkpoint, tp=layout.tp,
                           sp=layout.sequence_parallel, attention=attention, n_layers=layers_here,
                           first_stage=True, last_stage=layout.holds_last_stage(0))
    parts: dict[str, int] = {}
    unit = spec.largest_unit_params()
    if layout.tp > 1:
        unit = math.ceil(unit / layout.tp)
    full_local = sum(p.numel for p in _local_params(spec, layout, 0)) if spec.params else math.ceil(
        spec.n_params / (layout.tp * layout.pp))
    if layout.sharding == "replicate" and layout.dp > 1 or layout.sharding == "zero1":
        # DDP copies every gradient into its own flat buckets (gradient_as_bucket_view=False).
        parts["ddp buckets"] = prec.grad * full_local
    elif layout.sharding == "zero2":
        # reshard_after_forward=False: every unsharded parameter stays from forward to backward.
        parts["unsharded params (fwd->bwd)"] = prec.param * full_local
        parts["reduce-scatter (1 unit)"] = prec.grad * unit
    elif layout.sharding == "fsdp":
        parts["all-gather (2 units, prefetch)"] = 2 * prec.param * unit
        parts["reduce-scatter (1 unit)"] = prec.grad * unit
    if act.recompute_peak:
        parts["recompute (1 block)"] = act.recompute_peak
    if layout.pp > 1:
        in_flight = min(layout.pp, grad_accum) if layout.pipeline_schedule != "gpipe" else grad_accum
        if in_flight > 1:
            parts[f"pipeline in-flight ({in_flight} micro-batches)"] = (in_flight - 1) * (act.saved - act.outer)
    if spec.has_structure and spec.vocab:
        # Loss: logits in the activation dtype, their fp32 copy, then the fp32 gradient.
        parts["logits + loss"] = seq * micro_batch * (spec.vocab // layout.tp) * (prec.act + 4)
    host = 0
    params, grads, opt, master = state.params, state.grads, state.optimizer, state.master
    if layout.offload:
        # CPUOffloadPolicy: sharded params, grads and optimizer state live in (pinned) host RAM.
        host = state.total * gpus_per_node
        params = grads = opt = master = 0
    return MemoryBreakdown(params, grads, opt, master, act.saved, sum(parts.values()), parts, host)
