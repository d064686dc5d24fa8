"""Planner arithmetic for mixture-of-experts models and expert parallelism. No torch.

What MoE changes in the plan:

* **Parameters vs FLOPs.** A token passes through the router, its ``top_k`` routed experts and any
  shared experts, not all ``n_experts``: memory counts every parameter (``spec.n_params``), FLOPs
  count the *active* ones (``6 x active matmul parameters`` per token). ``inactive_matmul_params``
  is what ``cost.matmul_params`` leaves out.
* **Expert memory under EP.** Experts are split over ``ep`` ranks and FSDP-sharded over the
  remaining ``dp_shard / ep`` ranks, so at rest each rank holds ``1 / dp_shard`` of them -- the same
  as plain FSDP. What EP changes is the *working set*: FSDP gathers ``n_experts / ep`` experts of a
  layer at a time instead of all of them (``expert_unit_bytes``), and the gradient reduce-scatter
  and parameter all-gather of the experts run over ``dp_shard / ep`` ranks instead of ``dp_shard``.
* **All-to-all.** Per MoE layer, forward dispatch and combine each move the routed copies of a
  rank's tokens (``tokens x top_k x hidden`` elements; the ``(ep-1)/ep`` that leave the rank), and
  backward the same again: 4 all-to-alls per layer per micro-batch (``all_to_all_s``).

The EP degrees a world admits (``ep_degrees``, ``ep_candidates``) are the layout's rule (core/layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardwise.plan.spec import ModelSpec

__all__ = ["MoEInfo", "active_params", "all_to_all_s",
           "expert_bytes_per_rank", "expert_unit_bytes", "inactive_matmul_params", "moe_of_gpt"]


@dataclass(frozen=True)
class MoEInfo:
    """The mixture-of-experts shape of a model, for the planner."""

    n_experts: int
    top_k: int
    n_moe_layers: int
    params_per_expert: int  # one routed expert of one layer (all its matrices)
    hidden: int
    # The model returns every MoE layer's router probabilities for its load-balancing loss
    # (transformers' ``output_router_logits``): a checkpointed layer's are kept as its output.
    router_outputs: bool = False

    @property
    def routed_params(self) -> int:
        """Every routed expert of every MoE layer."""
        return self.n_moe_layers * self.n_experts * self.params_per_expert

    @property
    def inactive_params(self) -> int:
        """Routed-expert parameters a token does not pass through."""
        return self.n_moe_layers * (self.n_experts - self.top_k) * self.params_per_expert


def _moe(spec: ModelSpec) -> MoEInfo | None:
    return getattr(spec, "moe", None)


def inactive_matmul_params(spec: ModelSpec) -> int:
    """Matmul parameters a token skips (0 for a dense model): what FLOP counts leave out."""
    info = _moe(spec)
    return info.inactive_params if info else 0


def active_params(spec: ModelSpec) -> int:
    """Parameters one token uses (``n_params`` for a dense model)."""
    return spec.n_params - inactive_matmul_params(spec)


def expert_bytes_per_rank(spec: ModelSpec, dp_shard: int, ep: int, bytes_per_param: float = 4.0) -> float:
    """Bytes of routed-expert parameters one rank holds at rest: experts / (ep x dp_shard/ep)."""
    info = _moe(spec)
    if info is None:
        return 0.0
    if dp_shard % ep:
        raise ValueError(f"ep={ep} must divide dp_shard={dp_shard}")
    return info.routed_params * bytes_per_param / dp_shard


def expert_unit_bytes(spec: ModelSpec, ep: int, bytes_per_param: float = 4.0) -> float:
    """Bytes FSDP gathers for one MoE layer's experts during its forward/backward: E/ep experts."""
    info = _moe(spec)
    if info is None:
        return 0.0
    return info.n_experts // max(ep, 1) * info.params_per_expert * bytes_per_param


def all_to_all_s(spec: ModelSpec, tokens_per_rank: int, ep: int, gbs: float, act_bytes: float = 2.0,
                 alpha_s: float = 0.0, *, layers: int | None = None, recompute: float = 0.0) -> float:
    """Seconds of token all-to-all per micro-batch: dispatch + combine, forward + backward, for
    ``layers`` MoE layers (None: every MoE layer of the model; under a pipeline, the stage's).

    Each all-to-all sends ``(ep-1)/ep`` of ``tokens x top_k x hidden`` activations out of the rank
    (uniform routing) at ``gbs`` GB/s per direction; ``alpha_s`` is the per-call latency.
    ``recompute`` is the share of the forward that activation checkpointing runs again: its
    dispatch and combine run again with it (4 + 2 x recompute calls per layer).
    """
    info = _moe(spec)
    if info is None or ep <= 1:
        return 0.0
    size = tokens_per_rank * info.top_k * info.hidden * act_bytes
    per_call = (ep - 1) / ep * size / (gbs * 1e9) + (ep - 1) * alpha_s
    return (4 + 2 * recompute) * (info.n_moe_layers if layers is None else layers) * per_call


def moe_of_gpt(cfg: Any) -> MoEInfo | None:
    """The MoE shape of shardwise's built-in ``GPT(cfg)`` (None when dense)."""
    if not cfg.n_experts:
        return None
    return MoEInfo(n_experts=cfg.n_experts, top_k=cfg.moe_top_k,
                   n_moe_layers=sum(cfg.is_moe_block(i) for i in range(cfg.n_layer)),
                   params_per_expert=2 * cfg.n_embd * cfg.expert_hidden, hidden=cfg.n_embd)
