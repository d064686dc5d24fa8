"""Mixture-of-experts feed-forward for the built-in GPT: softmax top-k router, dropless dispatch.

Plain single-device code, like the rest of the model. Two seams let parallel code act from outside
without the model knowing (``shardwise.parallel.experts.ep``):

* ``GroupedExperts.forward(tokens, counts)`` takes the tokens already sorted by expert and the
  number per expert. Expert parallelism wraps exactly this call (torchtitan's ``distribute_module``
  input/output hooks): tokens go to the rank holding their expert and come back in the same order.
* ``MoE.stats_group``: the process group over which the router's token counts are summed for the
  load-balancing loss (None: this process alone). Set by ``parallel.experts.ep.route_moe``.

Under pipeline parallel a forward hook (``parallel/pipeline/moe.py``) takes each forward's aux loss out
of ``_pending`` and attaches it to the layer's output (Megatron's aux-loss auto-scaler), and
``take_moe_stats`` gathers the layers of every stage (``model.moe_pp_group``).

Dispatch is dropless: every token reaches all of its top-k experts, whatever the imbalance (no
capacity factor, so ``dropped`` tokens are always 0 and reported as such). Tokens are sorted by
expert id (a stable argsort) and each expert runs one matmul over its contiguous slice.

Auxiliary losses (what ``with_aux_loss`` adds to the training loss)
-------------------------------------------------------------------
Over the REAL tokens of a micro-batch: padding (``doc_ids == -1`` of packed rows, a record's
``attention_mask == 0``; ``models.masking.real_token_mask``) is routed and computed like any token
but counts for nothing, as in transformers' ``load_balancing_loss_func`` with an attention mask.
n_r real tokens on rank r, N = sum_r n_r over the global micro-batch (every data-parallel rank of
``stats_group``, R of them), E experts, k per token, router probabilities p_{t,e} = softmax(z_t)_e.

* Load balancing (Switch Transformer eq. 4, Mixtral): ``aux = a * E * sum_e f_e * P_e`` with
  f_e = (slots routed to e) / (N * k), the fraction of all routing slots e received, and P_e =
  (1/N) sum_t p_{t,e}. f carries no gradient; balanced routing gives ``aux = a``.
* Router z-loss (ST-MoE eq. 5): ``z = b * (1/N) sum_t (logsumexp_e z_{t,e})^2``.

Over the GLOBAL batch. Data-parallel training averages the ranks' gradients: the step follows
(1/R) sum_r grad L_r. A per-rank aux loss built from per-rank f_e would optimise the mean of R
small-batch balance losses, a different objective from one process's (balance is non-linear in
the counts). Instead f_e is formed from the counts summed over ``stats_group`` (one all-reduce of E
integers per MoE layer, no gradient; their sum is N k, so N comes with them), and each rank takes
its own tokens' probability sums, scaled by R / N:

    aux_r = a * E * sum_e f_e * (R / N) sum_{t in r} p_{t,e},
    (1/R) sum_r aux_r = a * E * sum_e f_e * (1/N) sum_t p_{t,e} = one process's aux over the batch,

and likewise z_r = b * (R / N) sum_{t in r} lse_t^2. The averaged gradient is therefore exactly
the gradient of one process's aux loss, whatever the ranks' token counts (records and packed rows
give ranks different numbers of real tokens; with equal counts R / N is 1 / n_r, the local mean).

The same holds per micro-batch under gradient accumulation (global micro-batch j is one process's
micro-batch j) and whatever the cross-entropy's normalisation: with records the cross-entropy is
a token SUM scaled by the step's global trained-token count (``runtime.token_loss``), while each
micro-batch's aux loss keeps scale 1 (``with_aux_loss`` adds it after that scaling), so the step
minimises ``CE_token_mean(step) + (1/A) sum_j aux_j`` on any number of ranks.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate

from shardwise.models.gpt_config import GPTConfig
from shardwise.models.names import clean_name

__all__ = ["MoE", "GroupedExperts", "adds_aux_loss", "discard_aux_losses", "is_moe_layer", "moe_layers",
           "pop_aux_loss", "take_moe_stats", "with_aux_loss"]

# Aux losses of the forward passes since the last ``pop_aux_loss`` (one per MoE layer per forward).
_pending: list[torch.Tensor] = []
_MAX_PENDING = 4096


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or kept in its own dtype where that is wider (float64 runs stay float64:
    the parity tests compare in float64, where a cast to float32 would bring its rounding back)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _in_backward() -> bool:
    # Activation checkpointing re-runs forward inside backward: that recomputation must not add its
    # aux loss (or its counts) a second time.
    return torch._C._current_graph_task_id() != -1


def queue_aux_loss(aux: torch.Tensor) -> None:
    """Record one forward's aux loss for ``pop_aux_loss`` (``with_aux_loss`` adds it to the loss)."""
    if len(_pending) >= _MAX_PENDING:
        # Nobody consumes them (a custom loop whose loss is not wrapped by with_aux_loss): drop
        # them rather than keep every forward's autograd graph alive.
        warnings.warn("MoE aux losses are recorded but never added to the loss; wrap the loss function "
                      "with shardwise.models.moe.with_aux_loss (the routers will not balance otherwise)",
                      stacklevel=3)
        _pending.clear()
    _pending.append(aux)


def pop_aux_loss() -> torch.Tensor | None:
    """The sum of the aux losses recorded since the last call (None when none), and forget them."""
    if not _pending:
        return None
    total = torch.stack([at_least_fp32(t) for t in _pending]).sum()
    _pending.clear()
    return total


def discard_aux_losses() -> None:
    """Forget the aux losses recorded so far: a forward whose loss did not take them (a forward for
    logging, a loss not wrapped by ``with_aux_loss``) must not add them to the next micro-batch's
    loss, whose backward would then run through that forward's graph (freed, or never meant to train).
    ``Session.forward_backward`` and ``eval_loss`` call it before their forward."""
    _pending.clear()


def with_aux_loss(loss_fn: Any) -> Any:
    """Wrap ``loss_fn(output, target)`` so the MoE layers' aux losses of that forward are added."""

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        base = loss_fn(output, target)
        aux = pop_aux_loss()
        if aux is None:
            return base
        aux = aux.to(base.device)
        if hasattr(base, "device_mesh"):
            # Under tensor parallel the cross-entropy is a (replicated) DTensor from loss_parallel;
            # the aux loss is the same on every TP rank, so it joins it as a replicated DTensor.
            aux = DTensor.from_local(aux, base.device_mesh, [Replicate()] * base.device_mesh.ndim)
        return base + aux

    loss.__name__ = getattr(loss_fn, "__name__", "loss") + "_with_moe_aux"
    loss._shardwise_moe_aux = True  # type: ignore[attr-defined]  # adds_aux_loss asks
    return loss


def adds_aux_loss(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` was made by ``with_aux_loss`` (the workload of an MoE model)."""
    return bool(getattr(loss_fn, "_shardwise_moe_aux", False))


def _local(t: torch.Tensor) -> torch.Tensor:
    # Under expert parallelism the unsharded weights are DTensors sharded by expert over the ``ep``
    # mesh; each rank computes with the experts it holds.
    return t.to_local() if hasattr(t, "to_local") else t


def expert_counts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Routing slots per expert of a flat index tensor: an ``index_add_`` of fixed shape, not
    ``bincount`` (whose output shape depends on the values: a rehearsal's fake tensors have none)."""
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


class GroupedExperts(nn.Module):
    """E feed-forward experts stored as fused 3-D tensors ``w_in (E, D, H)``, ``w_out (E, H, D)``."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w_out = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``tokens`` (sum(counts), D) sorted by expert; ``counts`` (experts held,) -> same order."""
        w_in, w_out = _local(self.w_in), _local(self.w_out)
        sizes = self._sizes(tokens, counts)
        if len(sizes) != w_in.shape[0]:
            raise ValueError(f"{len(sizes)} expert counts for {w_in.shape[0]} experts")
        outs = [F.gelu(chunk @ w_in[e]) @ w_out[e] for e, chunk in enumerate(tokens.split(sizes)) if sizes[e]]
        return torch.cat(outs) if outs else tokens.new_zeros(0, w_out.shape[-1])

    def _sizes(self, tokens: torch.Tensor, counts: torch.Tensor) -> list[int]:
        """``counts`` as host integers: the expert-parallel dispatch already knows them (no sync); a
        rehearsal's fake tensors carry no routing, so their tokens are spread evenly (the planner's
        assumption too)."""
        dispatcher = getattr(self, "ep_dispatcher", None)
        if dispatcher is not None:
            return list(dispatcher.local_sizes)
        if is_fake(counts):
            n, e = tokens.shape[0], counts.shape[0]
            return [n // e + (i < n % e) for i in range(e)]
        return counts.tolist()


class SharedExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden, bias=bias)
        self.proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class MoE(nn.Module):
    """Router + routed experts (+ shared experts): the feed-forward of an MoE block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if not 1 <= cfg.moe_top_k <= cfg.n_experts:
            raise ValueError(f"moe_top_k={cfg.moe_top_k} must be between 1 and n_experts={cfg.n_experts}")
        self.n_experts, self.top_k = cfg.n_experts, cfg.moe_top_k
        self.norm_topk = cfg.moe_norm_topk
        self.aux_coef, self.z_coef = cfg.moe_aux_coef, cfg.moe_z_coef
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.n_embd, cfg.expert_hidden)
        self.shared = (SharedExperts(cfg.n_embd, cfg.expert_hidden * cfg.moe_shared_experts, cfg.bias)
                       if cfg.moe_shared_experts else None)
        self.drop = nn.Dropout(cfg.dropout)
        self.stats_group: Any = None  # set from outside (parallel.experts.ep.route_moe); None: this process
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start a new metrics window (plain attributes, not buffers: never checkpointed)."""
        self.window_counts: torch.Tensor | None = None  # global tokens per expert, summed
        self.window_aux: torch.Tensor | float = 0.0
        self.window_z: torch.Tensor | float = 0.0
        self.window_calls = 0

    def forward(self, x: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (..., D); ``real``: which of its tokens are real (the aux losses skip padding), or None."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = at_least_fp32(self.router(x))
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        counts = expert_counts(flat, self.n_experts)
        # Dropless dispatch: tokens sorted by expert (stable, so each expert sees them in token order).
        order = flat.argsort(stable=True)
        token = order // self.top_k
        routed = self.experts(x[token], counts)
        scale = weights.reshape(-1)[order].to(routed.dtype).unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, token, routed * scale)
        if self.shared is not None:
            out = out + self.shared(x)
        self._record(logits, probs, flat, counts, real)
        return self.drop(out).reshape(shape)

    def _record(self, logits: torch.Tensor, probs: torch.Tensor, flat: torch.Tensor, counts: torch.Tensor,
                real: torch.Tensor | None) -> None:
        """Aux losses over the global batch's real tokens (see the module docstring) and the window's
        statistics."""
        if not (self.training and torch.is_grad_enabled()):
            return
        keep = None
        if real is not None:
            keep = real.reshape(-1)
            if keep.numel() != logits.shape[0]:
                raise ValueError(f"the MoE layer got {logits.shape[0]} tokens but a real-token mask of "
                                 f"{keep.numel()}")
            # Slots of real tokens only (``flat`` is token-major: token t's k slots are t*k .. t*k+k-1);
            # no boolean indexing, so no host sync.
            slots = keep.repeat_interleave(self.top_k).to(counts.dtype)
            counts = torch.zeros_like(counts).index_add_(0, flat, slots)
            keep = keep.to(probs.dtype)
        global_counts = counts.detach().clone()
        ranks = 1
        if self.stats_group is not None:
            dist.all_reduce(global_counts, group=self.stats_group)
            ranks = dist.get_world_size(self.stats_group)
        # R / N: N real tokens in the global micro-batch (k slots each).
        weight = (ranks * self.top_k / global_counts.sum().clamp(min=1).double()).to(probs.dtype)
        aux = logits.new_zeros(())
        if self.aux_coef > 0:
            f = global_counts.to(probs.dtype) / global_counts.sum().clamp(min=1)
            prob_sum = (probs if keep is None else probs * keep.unsqueeze(-1)).sum(dim=0)
            aux = aux + self.aux_coef * self.n_experts * (f * prob_sum).sum() * weight
        z = logits.new_zeros(())
        if self.z_coef > 0:
            lse2 = torch.logsumexp(logits, dim=-1).square()
            z = self.z_coef * (lse2 if keep is None else lse2 * keep).sum() * weight
        if _in_backward():
            # Activation checkpointing re-runs the forward inside backward: the aux losses' ops run
            # again (checkpointing requires the same saved tensors, and backward uses them, so the
            # counts are all-reduced again too), but nothing is recorded a second time.
            return
        queue_aux_loss(aux + z)
        self.window_counts = global_counts if self.window_counts is None else self.window_counts + global_counts
        # Device tensors: read (one host sync) only when the logging window closes.
        self.window_aux = self.window_aux + aux.detach()
        self.window_z = self.window_z + z.detach()
        self.window_calls += 1


def is_moe_layer(module: nn.Module | None) -> bool:
    """Whether ``module`` is a mixture-of-experts layer: a built-in ``MoE`` or a Hugging Face MoE
    block hooked by ``models/hf_moe.py``. The block's own attribute, not one reached through a
    wrapper: a checkpoint wrapper (``activation_checkpointing = "moe"``) forwards attribute reads to
    the block it wraps, and counting both made every layer twice (its experts sharded twice)."""
    return isinstance(module, MoE) or (module is not None and vars(module).get("shardwise_moe") is not None)


def moe_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """Every MoE layer of ``model`` with its (wrapper-free) name: ``MoE`` modules, and the
    ``HFMoELayer`` records of Hugging Face MoE blocks (``models/hf_moe.py``)."""
    out: list[tuple[str, Any]] = []
    for name, m in model.named_modules():
        if is_moe_layer(m):  # a Hugging Face MoE block carries its record (models/hf_moe.py)
            # A module's name, not a parameter's: a checkpoint-wrapped layer's ends in the wrapper's
            # attribute, with no dot after it (clean_name strips the prefix "<wrapper>.").
            out.append((clean_name(name + ".")[:-1], m if isinstance(m, MoE) else m.shardwise_moe))
    return out


def take_moe_stats(model: nn.Module) -> dict[str, float]:
    """Metrics of the window since the last call (and start a new one); {} for a dense model.

    A collective when the layers have a ``stats_group``: call it on every rank.

    Tokens per expert are global routing slots (every data-parallel rank's tokens, k per token),
    summed over the window (every micro-batch of every step since the last call):
    ``moe/tokens_per_expert_{min,mean,max}`` over all experts of all layers, the same per layer
    (``moe/<layer>/...``), ``moe/max_over_mean`` (1.0 is perfect balance), the mean aux and z
    losses per layer and micro-batch, and ``moe/dropped_tokens`` (0: dispatch is dropless).
    """
    layers = moe_layers(model)
    per_layer: dict[str, torch.Tensor] = {}
    aux = z = 0.0
    calls = 0
    device = None
    for name, layer in layers:
        counts = layer.window_counts
        if counts is not None:
            device = counts.device  # the collective's device (NCCL needs the accelerator's)
            short = name.replace("hf.model.layers.", "").replace("blocks.", "").replace(".mlp", "")
            per_layer[short] = counts.double().cpu()
        aux += float(layer.window_aux)
        z += float(layer.window_z)
        calls += layer.window_calls
        layer.reset_stats()
    pp_group = getattr(model, "moe_pp_group", None)  # set by parallel/pipeline/moe.py under pipeline parallel
    if not per_layer and pp_group is None:
        return {}
    group = next((layer.stats_group for _, layer in layers if layer.stats_group is not None), None)
    if group is not None and per_layer:
        # Each rank's aux loss uses its own router probabilities: their mean is the global loss.
        pair = torch.tensor([aux, z], dtype=torch.float64, device=device)
        dist.all_reduce(pair, group=group)
        aux, z = (pair / dist.get_world_size(group)).tolist()
    if pp_group is not None:
        # Each pipeline rank holds its stages' layers: gather them all (every rank reports all).
        gathered: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, (per_layer, aux, z, calls), group=pp_group)
        per_layer = {k: v for part in gathered for k, v in part[0].items()}
        aux, z, calls = (sum(part[i] for part in gathered) for i in (1, 2, 3))
        if not per_layer:
            return {}
    out: dict[str, float] = {}
    for short in sorted(per_layer, key=lambda k: (len(k), k)):
        c = per_layer[short]
        out.update({f"moe/{short}/tokens_min": float(c.min()), f"moe/{short}/tokens_mean": float(c.mean()),
                    f"moe/{short}/tokens_max": float(c.max())})
    allc = torch.cat(list(per_layer.values()))
    out.update({"moe/tokens_per_expert_min": float(allc.min()), "moe/tokens_per_expert_mean": float(allc.mean()),
                "moe/tokens_per_expert_max": float(allc.max()),
                "moe/max_over_mean": float(allc.max() / allc.mean()) if allc.mean() > 0 else math.nan,
                "moe/aux_loss": aux / max(calls, 1), "moe/z_loss": z / max(calls, 1), "moe/dropped_tokens": 0.0})
    return out
