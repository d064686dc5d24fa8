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

``ep_candidates`` lists the EP degrees a world admits, for the planner's search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardwise.plan.spec import ModelSpec

__all__ = ["MOE_SPECS", "MoEInfo", "active_params", "all_to_all_s", "ep_candidates", "ep_degrees",
           "expert_bytes_per_rank", "expert_unit_bytes", "inactive_matmul_params", "moe_llama_spec", "moe_of_gpt"]


@dataclass(frozen=True)
class MoEInfo:
    """The mixture-of-experts shape of a model, for the planner."""

    n_experts: int
    top_k: int
    n_moe_layers: int
    params_per_expert: int  # one routed expert of one layer (all its matrices)
    hidden: int

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


def ep_degrees(n_experts: int) -> list[int]:
    """EP degrees an MoE layer of ``n_experts`` admits: the divisors of the count (each rank of an
    expert group holds ``n_experts / ep`` whole experts). The one owner of that rule: the planner's
    ``--ep`` check, its search and the runtime's ``parallel.ep.check_moe_model`` ask it."""
    if n_experts <= 0:
        return [1]
    return [d for d in range(1, n_experts + 1) if n_experts % d == 0]


def ep_candidates(dp_shard: int, n_experts: int) -> list[int]:
    """EP degrees that fit: divisors of the FSDP shard degree that also divide the expert count."""
    return [d for d in ep_degrees(n_experts) if dp_shard % d == 0]


def moe_of_gpt(cfg: Any) -> MoEInfo | None:
    """The MoE shape of shardwise's built-in ``GPT(cfg)`` (None when dense)."""
    if not cfg.n_experts:
        return None
    return MoEInfo(n_experts=cfg.n_experts, top_k=cfg.moe_top_k,
                   n_moe_layers=sum(cfg.is_moe_block(i) for i in range(cfg.n_layer)),
                   params_per_expert=2 * cfg.n_embd * cfg.expert_hidden, hidden=cfg.n_embd)


def moe_llama_spec(name: str, *, n_layers: int, hidden: int, n_heads: int, n_kv_heads: int, vocab: int,
                   n_experts: int, top_k: int, moe_ffn: int, head_dim: int | None = None,
                   shared_ffn: int = 0, max_seq: int = 4096, tied: bool = False, family: str = "mixtral",
                   qk_norm: bool = False, qkv_bias: bool = False, qk_norm_full: bool = False) -> ModelSpec:
    """A Mixtral / Qwen-MoE-style spec: Llama attention, every block's MLP an MoE of SwiGLU experts.

    Expert tensors are the fused 3-D ones transformers 5.x stores (``mlp.experts.gate_up_proj``
    ``(E, 2f, h)``, ``mlp.experts.down_proj`` ``(E, h, f)``) plus the router ``mlp.gate.weight``.
    ``shared_ffn``: Qwen2-MoE's shared expert and its (1, h) gate; ``qk_norm_full``: OLMoE's q/k
    norms over all heads (Qwen3-MoE's are per head).
    """
    import dataclasses

    from shardwise.plan.spec import ParamInfo, from_llama_like

    base = from_llama_like(name, n_layers=n_layers, hidden=hidden, n_heads=n_heads, ffn_hidden=moe_ffn,
                           vocab=vocab, n_kv_heads=n_kv_heads, head_dim=head_dim, max_seq=max_seq,
                           tied=tied, family=family, qkv_bias=qkv_bias)
    params = []
    for p in base.params:
        if ".mlp." not in p.name:
            params.append(p)
            continue
        if not p.name.endswith("mlp.gate_proj.weight"):
            continue  # gate/up/down are replaced by the layer's experts once, here
        pre = p.name[: -len("gate_proj.weight")]
        params += [ParamInfo(pre + "gate.weight", (n_experts, hidden), p.unit),
                   ParamInfo(pre + "experts.gate_up_proj", (n_experts, 2 * moe_ffn, hidden), p.unit),
                   ParamInfo(pre + "experts.down_proj", (n_experts, hidden, moe_ffn), p.unit)]
        if shared_ffn:
            params += [ParamInfo(pre + f"shared_expert.{n}.weight", s, p.unit) for n, s in
                       (("gate_proj", (shared_ffn, hidden)), ("up_proj", (shared_ffn, hidden)),
                        ("down_proj", (hidden, shared_ffn)))]
            params.append(ParamInfo(pre + "shared_expert_gate.weight", (1, hidden), p.unit))
        if qk_norm:
            hd = head_dim or hidden // n_heads
            widths = (n_heads * hd, base.n_kv_heads * hd) if qk_norm_full else (hd, hd)
            params += [ParamInfo(pre.replace("mlp.", "self_attn.") + f"{n}.weight", (w,), p.unit)
                       for n, w in zip(("q_norm", "k_norm"), widths)]
    info = MoEInfo(n_experts=n_experts, top_k=top_k, n_moe_layers=n_layers,
                   params_per_expert=3 * hidden * moe_ffn, hidden=hidden)
    return dataclasses.replace(base, n_params=sum(p.numel for p in params), params=tuple(params), moe=info)


# Published MoE architectures, sized exactly as transformers 5.x builds them (the bundled configs
# ``mixtral-8x7b`` / ``qwen3-30b-a3b`` build the same models); ``plan.presets.MODEL_PRESETS`` lists them.
MOE_SPECS = {
    # 46.7B total, 12.9B active.
    "mixtral-8x7b": lambda: moe_llama_spec("mixtral-8x7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8,
                                           vocab=32000, n_experts=8, top_k=2, moe_ffn=14336, max_seq=32768),
    # 128 experts, top-8: 30.5B total, 3.3B active.
    "qwen3-30b-a3b": lambda: moe_llama_spec("qwen3-30b-a3b", n_layers=48, hidden=2048, n_heads=32, n_kv_heads=4,
                                            head_dim=128, vocab=151936, n_experts=128, top_k=8, moe_ffn=768,
                                            max_seq=40960, family="qwen3_moe", qk_norm=True),
}
