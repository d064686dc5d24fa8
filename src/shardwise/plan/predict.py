"""The planner's per-rank memory prediction for one concrete run, and its check against the ledger.

``train --dry-run`` prints it before anything starts; every run writes it into ``summary.json``
next to the memory ledger's measured bytes and prints the difference at the end, so the planner
is checked on every job. The prediction uses the planner's formulas (``plan.memory``) on the
run's own layout, model shapes and settings:

* precision: the runtime keeps fp32 parameters, gradients and AdamW state under ``fp32`` and the
  mixed modes (autocast or FSDP2's MixedPrecisionPolicy cast copies, which are transient), and
  bfloat16 for all three under ``bf16-true`` (AdamW's ``step`` counters stay fp32);
* micro-batches: a pipeline splits each ``train.micro_batch_size`` batch into
  ``pp_microbatches`` pieces, so the planner sees ``micro_batch_size / pp_microbatches`` samples
  per micro-batch and ``grad_accum_steps x pp_microbatches`` micro-batches per step;
* ranks: each rank's model state is computed for its own data-parallel shard and pipeline stage
  (FSDP padding, ZeRO-1's whole-tensor partition and the stage split are exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.core.config import parse_loss_chunks
from shardwise.core.layout import Layout
from shardwise.core.layout import ranks_per_node as rank_count_per_node
from shardwise.core.pp_schedules import p2p_messages_per_step
from shardwise.plan.cp import chunked_loss_off
from shardwise.plan.memory import (
    SHARDWISE_KERNELS,
    Kernels,
    Precision,
    StateBytes,
    _local_params,
    expert_split,
    memory_breakdown,
    stage_boundary_bytes,
    state_bytes,
    unplanned_caveat,
)
from shardwise.plan.preference import reference_for
from shardwise.plan.spec import from_module

if TYPE_CHECKING:
    from shardwise.plan.spec import ModelSpec

# The runtime's ``parallel.precision`` -> bytes per element of what it stores (see module docstring).
RUNTIME_PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", 4, 4, 0, 4),
    "bf16-mixed": Precision("bf16-mixed", 4, 4, 0, 2),
    "fp16-mixed": Precision("fp16-mixed", 4, 4, 0, 2),
    "bf16-true": Precision("bf16-true", 2, 2, 0, 2),
}


def compute_precision(precision: str, layout: Layout) -> Precision:
    """Bytes per element of what a step materialises (gathered parameters, reduced gradients,
    activations), which under mixed precision depend on the strategy.

    FSDP2's MixedPrecisionPolicy all-gathers parameters in 16 bits and reduce-scatters gradients in
    fp32 (``reduce_dtype``); under torch.autocast (DDP, ZeRO-1, TP/PP without FSDP) parameters and
    gradients stay fp32 and only activations are 16-bit.
    """
    state = RUNTIME_PRECISIONS[precision]
    if precision in ("bf16-mixed", "fp16-mixed") and not layout.casts_with_autocast:
        return Precision(f"{precision} (FSDP2 policy)", 2, 4, 0, 2)
    return state


# Categories shared by the prediction and the ledger (``runtime.ledger.FIELDS``).
STATE_FIELDS = ("param_bytes", "grad_bytes", "optim_bytes")
MIB = 2**20


@dataclass(frozen=True)
class RankPrediction:
    """Predicted bytes one rank holds: model state, activations saved for backward, transients."""

    rank: int
    param_bytes: int  # on the GPU
    grad_bytes: int
    optim_bytes: int
    activation_bytes: int
    transient_bytes: int
    # Model state an offload layout keeps in host memory (or on NVMe) instead: not on the GPU, not
    # in its peak, but still this rank's (the memory ledger counts it wherever it lives).
    host_param_bytes: int = 0
    host_grad_bytes: int = 0
    host_optim_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        """Model state on the GPU."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    @property
    def host_bytes(self) -> int:
        return self.host_param_bytes + self.host_grad_bytes + self.host_optim_bytes

    @property
    def peak_bytes(self) -> int:
        """GPU state + activations + transients: what ``torch.cuda.max_memory_allocated`` measures."""
        return self.state_bytes + self.activation_bytes + self.transient_bytes

    def held(self, key: str) -> int:
        """A state category wherever it lives (``param_bytes`` ...): what the ledger measures."""
        return getattr(self, key) + getattr(self, "host_" + key)

    def to_dict(self) -> dict[str, int]:
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes, "optim_bytes": self.optim_bytes,
                "activation_bytes": self.activation_bytes, "transient_bytes": self.transient_bytes,
                "peak_bytes": self.peak_bytes, "host_bytes": self.host_bytes}


@dataclass(frozen=True)
class RunPrediction:
    """The planner's prediction for every rank of one run."""

    model: str
    n_params: int
    layout: Layout
    precision: str
    seq: int
    micro_batch: int  # samples per micro-batch (per pipeline microbatch under PP)
    micro_batches: int  # micro-batches per optimizer step
    checkpoint: str
    ranks: tuple[RankPrediction, ...]
    notes: tuple[str, ...] = ()
    # A pipeline's message, each way, per micro-batch and stage boundary (0 without a pipeline).
    pp_message_bytes: int = 0
    # Messages each pipeline rank sends in one step, and as many it receives (core.pp_schedules
    # p2p_messages_per_step): what the step time's pp term charges, pp_message_bytes each.
    pp_messages: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "n_params": self.n_params, "precision": self.precision, "seq": self.seq,
                "micro_batch": self.micro_batch, "micro_batches": self.micro_batches,
                "activation_checkpointing": self.checkpoint, "notes": list(self.notes),
                "pp_message_bytes": self.pp_message_bytes, "pp_messages": list(self.pp_messages),
                "ranks": [{"rank": r.rank, **r.to_dict()} for r in self.ranks]}

    def table(self) -> str:
        """Per-rank MiB, one row per distinct prediction (ranks that hold the same are grouped)."""
        rows = ["ranks        params_MiB  grads_MiB  optim_MiB  activ_MiB  transient_MiB  peak_MiB  host_MiB"]
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in self.ranks:
            key = (r.param_bytes, r.grad_bytes, r.optim_bytes, r.activation_bytes, r.transient_bytes, r.host_bytes)
            groups.setdefault(key, []).append(r.rank)
        for key, ranks in groups.items():
            label = _ranks_label(ranks)
            values = [*key[:5], sum(key[:5]), key[5]]
            rows.append(f"{label:<11}" + "".join(f"{v / MIB:>{w}.2f}" for v, w in
                                                 zip(values, (12, 11, 11, 11, 15, 10, 10))))
        return "\n".join(rows)


def _ranks_label(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return str(ranks[0])
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks[:3])) + (",..." if len(ranks) > 3 else "")


def _state_rank(layout: Layout, rank: int) -> int:
    """Index of ``rank`` inside the group that partitions its model state (0 when replicated)."""
    coords = layout.coords(rank)
    if layout.sharding in ("zero2", "fsdp"):
        return coords["shard"] if layout.info.hybrid else coords.get("dp", 0)
    if layout.sharding == "zero1":
        return coords.get("dp", 0)
    return 0


def _full_shards(spec: ModelSpec, layout: Layout, stage: int) -> int:
    """How many leading FSDP shard ranks hold a full (unpadded) shard of every tensor: their state
    is identical, so one computation serves them all (a 512-rank prediction stays instant)."""
    if layout.sharding not in ("zero2", "fsdp") or not spec.params:
        return 1
    n = layout.shard
    full = n
    for p in _local_params(spec, layout, stage):
        split = expert_split(spec, layout, p)
        if split is None:
            full = min(full, max(1, p.shape[0] // -(-p.shape[0] // n)))
        else:
            experts, ranks, dim = split
            if (experts if dim == 0 else p.shape[1]) % ranks:
                return 1  # an uneven expert split: every rank computed (exact, a little slower)
    return full


def _runtime_state(spec: ModelSpec, layout: Layout, prec: Precision, rank: int, stage: int,
                   optimizer: str = "adamw") -> StateBytes:
    # Under bf16-true AdamW's moments are bfloat16: plan.memory.state_bytes counts them so.
    return state_bytes(spec, layout, prec, optimizer, rank=rank, stage=stage)


def loss_kernels(chunked: bool, compiled: bool, tp: int) -> Kernels:
    """The runtime's loss as the planner's ``Kernels``: the chunked head's; a compiled one's, which
    inductor fuses (up-cast, log-softmax and NLL in one kernel: it keeps the 16-bit logits and a
    per-token log-sum-exp, not the eager loss's fp32 copies, and its backward writes a new 16-bit
    gradient of the logits -- on an H200, GPT-2 124M at 8 x 1024 tokens peaked 1.0 GiB above its
    chunked run with the logits whole, where the eager loss's 10 bytes a logit would be 3.1 GiB);
    else torch's eager ``F.cross_entropy``. The trainer leaves the loss eager under tensor parallel
    (``Session.compile_loss``)."""
    if chunked:
        return Kernels(loss="chunked")
    if compiled and tp == 1:
        return Kernels(loss="compiled")
    return SHARDWISE_KERNELS


def planner_batch(layout: Layout, micro_batch_size: int, grad_accum_steps: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) as the planner counts them, from the
    ``[train]`` values: a pipeline cuts each micro-batch into ``pp_microbatches`` (the inverse of
    ``plan.advice.runtime_batch``)."""
    if layout.pp <= 1:
        return micro_batch_size, grad_accum_steps
    return max(1, micro_batch_size // layout.pp_microbatches), grad_accum_steps * layout.pp_microbatches


def predict_run(spec: ModelSpec, layout: Layout, *, precision: str, seq: int, micro_batch_size: int,
                grad_accum_steps: int = 1, activation_checkpointing: str = "none", ac_every: int = 2,
                grad_sync: str = "step", ranks_per_node: int = 1, loss_chunks: Any = 0,
                optimizer: str = "adamw", dpo_reference: str | None = None,
                compiled: bool = False) -> RunPrediction:
    """Predict every rank's bytes for ``spec`` trained under ``layout`` with ``optimizer`` (the
    trainer's ``[optimizer]``; under bf16-true only AdamW's state is predicted in bfloat16).
    ``dpo_reference``: a DPO run's reference (``plan.preference.REFERENCES``; None: not DPO): a
    micro-batch of pairs is twice as many sequences, and a frozen copy's bytes are noted per rank
    (the ledger's ``reference_bytes``, beside the params column).

    ``micro_batch_size`` and ``grad_accum_steps`` are the ``[train]`` values; ``seq`` is the
    tokens per sample (1 for images: activations are then not modelled); ``loss_chunks`` is
    ``train.loss_chunks`` (the chunked loss's logits where the runtime's rule turns it on);
    ``compiled``: ``train.compile`` is on (resolved), so the trainer compiles the loss beside the
    blocks (``Session.compile_loss``; not under TP) and whole logits go through a fused
    cross-entropy (``loss_kernels``).
    """
    chunks = parse_loss_chunks(loss_chunks)
    prec = RUNTIME_PRECISIONS[precision]
    if layout.n_blocks is None and spec.n_layers and layout.pp > 1:
        layout = layout.with_blocks(spec.n_layers)
    micro_batch, micro_batches = planner_batch(layout, micro_batch_size, grad_accum_steps)
    notes: list[str] = []
    if dpo_reference is not None:  # chosen and rejected of every pair in one forward (plan/preference.py)
        micro_batch *= 2
    chunked = not chunked_loss_off(spec.family, spec.vocab, spec.hidden, chunks, tp=layout.tp, pp=layout.pp,
                                   tokens=micro_batch * max(1, seq // max(1, layout.cp)))
    checkpoint = activation_checkpointing
    if not spec.has_structure:
        notes.append("activations not modelled: the model's layers/hidden/heads/vocab are unknown")
    if caveat := unplanned_caveat(layout, checkpoint):
        notes.append(caveat)
    # Activations and transients (gathers, buckets, recomputation, logits) in what a step
    # materialises; model state in what the run stores.
    # One breakdown per pipeline rank: its own activations, in-flight micro-batches and loss.
    breakdowns = [memory_breakdown(spec, layout, compute_precision(precision, layout), "adamw", seq=seq,
                                   micro_batch=micro_batch, checkpoint=checkpoint, grad_accum=micro_batches,
                                   gpus_per_node=ranks_per_node, every=ac_every, grad_sync=grad_sync,
                                   kernels=loss_kernels(chunked, compiled, layout.tp),
                                   loss_chunks=chunks, stage=s) for s in range(layout.pp)]
    ranks = []
    states: dict[tuple[int, int], StateBytes] = {}
    full = {stage: _full_shards(spec, layout, stage) for stage in range(layout.pp)}
    for rank in range(layout.world_size):
        stage = layout.coords(rank).get("pp", 0)
        state_rank = _state_rank(layout, rank)
        if state_rank < full[stage]:
            state_rank = 0  # same bytes as shard 0
        key = (state_rank, stage)
        if key not in states:
            states[key] = _runtime_state(spec, layout, prec, state_rank, stage, optimizer)
        sb = states[key]
        # Each pipeline rank saves activations for its own blocks (the first also the embeddings,
        # the last the head and loss); its in-flight micro-batches are transients.
        act, transient = breakdowns[stage].activations, breakdowns[stage].transient
        state = (sb.params + sb.master, sb.grads, sb.optimizer)
        if layout.offload:  # in host memory (or on NVMe): the host columns, not the GPU's
            ranks.append(RankPrediction(rank, 0, 0, 0, act, transient, *state))
        else:
            ranks.append(RankPrediction(rank, *state, act, transient))
    if dpo_reference == "copy":
        copy = max(sb.params for sb in states.values())
        notes.append(f"DPO reference: a frozen copy sharded like the policy, {copy / 2**20:.1f} MiB per rank at most "
                     "beside the params column (the ledger's reference_bytes)")
    elif dpo_reference is not None:
        notes.append(f"DPO reference: {dpo_reference} (no copy on the device)")
    if layout.offload:
        where = "on NVMe (parallel.nvme_path)" if layout.strategy == "zero3-nvme" else "in host memory"
        notes.append(f"{layout.strategy}: parameters, gradients and optimizer state live {where}")
    message = stage_boundary_bytes(spec, layout, seq, micro_batch, compute_precision(precision, layout).act) \
        if layout.pp > 1 and spec.has_structure else 0
    messages = tuple(p2p_messages_per_step(layout.pp_schedule, layout.pp, layout.pp_stages_per_rank, micro_batches, r)
                     for r in range(layout.pp)) if message else ()
    return RunPrediction(spec.name, spec.n_params, layout, precision, seq, micro_batch, micro_batches,
                         checkpoint, tuple(ranks), tuple(notes), message, messages)


def predict_for_spec(spec: ModelSpec, layout: Layout, cfg: Any, *, seq: int,
                     ranks_per_node: int | None = None, plain_ce: bool = True) -> RunPrediction:
    """``predict_run`` for a ``RunConfig``: the one place that turns a config into the planner's
    arguments, so ``--dry-run`` and the trainer's summary.json predict the same bytes.
    ``plain_ce``: the loss is the token-mean CE (``Workload.plain_token_ce``), else never chunked."""
    from shardwise.runtime.auto import compile_flag, resolve_precision  # defers torch

    # "auto" as this machine's ranks resolve it (a run's own config is already resolved; an
    # unresolved train.compile = "auto" is planned eager, the larger loss).
    return predict_run(spec, layout, precision=resolve_precision(cfg.parallel.precision).value, seq=seq,
                       micro_batch_size=cfg.train.micro_batch_size, grad_accum_steps=cfg.train.grad_accum_steps,
                       activation_checkpointing=cfg.parallel.activation_checkpointing,
                       ac_every=cfg.parallel.ac_every, grad_sync=cfg.parallel.grad_sync,
                       loss_chunks=getattr(cfg.train, "loss_chunks", 0) if plain_ce else 0,
                       optimizer=cfg.optimizer.name if hasattr(cfg, "optimizer") else "adamw",
                       dpo_reference=reference_for(cfg.lora.rank, cfg.preference.precompute_reference)
                       if getattr(cfg.train, "objective", "lm") == "dpo" else None,
                       ranks_per_node=ranks_per_node or rank_count_per_node(layout.world_size,
                                                                            nproc=cfg.parallel.nproc),
                       compiled=compile_flag(getattr(cfg.train, "compile", False)) == "true")


def predict_for_model(model: Any, layout: Layout, cfg: Any, *, seq: int, name: str = "",
                      ranks_per_node: int | None = None, plain_ce: bool = True) -> RunPrediction:
    """``predict_for_spec`` for an ``nn.Module`` (a meta-device copy is enough)."""
    spec = from_module(model, name=name or model_name(cfg.model))
    return predict_for_spec(spec, layout, cfg, seq=seq, ranks_per_node=ranks_per_node, plain_ce=plain_ce)


def model_name(m: Any) -> str:
    """A short name for the model a ``[model]`` config section builds (for reports)."""
    if m.kind == "gpt":
        return f"gpt-{m.preset}"
    if m.kind == "hf":
        return str(m.hf_config or Path(m.pretrained).name)
    return m.factory or m.kind


def compare(prediction: RunPrediction, memory: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank and category: predicted, measured and their difference (the ledger's ``collect`` dict).

    The peak is compared only where the ledger measured the same thing (CUDA's
    ``max_memory_allocated``); on the CPU it is the process's RSS, interpreter included.
    """
    comparable_peak = memory.get("peak_source") == "cuda.max_memory_allocated"
    by_rank = {r.rank: r for r in prediction.ranks}
    rows = []
    for entry in memory["ranks"]:
        pred = by_rank.get(entry["rank"])
        if pred is None:
            continue
        fields = [*STATE_FIELDS, *(("peak_bytes",) if comparable_peak else ())]
        row: dict[str, Any] = {"rank": entry["rank"]}
        for key in fields:
            p, m = (pred.held(key) if key in STATE_FIELDS else getattr(pred, key)), int(entry[key])
            row[key] = {"predicted": p, "measured": m, "diff_bytes": p - m,
                        "diff_pct": None if m == 0 else round(100.0 * (p - m) / m, 2)}
        rows.append(row)
    return rows


def format_comparison(rows: list[dict[str, Any]]) -> str:
    """predicted / measured MiB and the difference per rank and category, as the run prints it."""
    if not rows:
        return "(no ranks to compare)"
    keys = [k for k in rows[0] if k != "rank"]
    lines = ["rank  " + "  ".join(f"{k.removesuffix('_bytes') + ' pred/meas MiB (diff)':>34}" for k in keys)]
    for row in rows:
        cells = []
        for k in keys:
            c = row[k]
            pct = "n/a" if c["diff_pct"] is None else f"{c['diff_pct']:+.1f}%"
            cells.append(f"{c['predicted'] / MIB:>12.2f} / {c['measured'] / MIB:>9.2f} ({pct:>7})")
        lines.append(f"{row['rank']:>4}  " + "  ".join(f"{c:>34}" for c in cells))
    return "\n".join(lines)
