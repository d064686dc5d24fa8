"""ModelSpec: the shape of a model, as much as the planner needs, from wherever the user has it.

Every constructor returns the same dataclass. When the per-parameter shapes are known (presets,
HF configs, GPTConfig, meta-device modules) the planner shards them exactly the way ZeRO-1 and
FSDP2 do; with a bare parameter count it falls back to an even split and says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from shardwise.core.families import HF_FAMILIES, LLAMA_LIKE, MOE_FAMILIES
from shardwise.errors import ConfigError
from shardwise.models.gpt_config import gpt_param_shapes
from shardwise.models.hf_config import read_hf_config, resolve_hf_config, with_canonical_keys
from shardwise.plan.moe import MoEInfo, moe_of_gpt

# Architecture families the activation model knows (see memory.activation_bytes):
#   "gpt"   LayerNorm, GELU MLP, learned positions (our GPT and GPT-2);
#   "llama" HF-style RMSNorm (upcasts to fp32), rotary embeddings, SwiGLU MLP, optional GQA
#           (Llama, Mistral, Qwen2).
ARCHS = ("gpt", "llama")

ROOT_UNIT = -1  # unit index of parameters outside the repeated blocks (embeddings, final norm, head)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor: its name, shape and the FSDP unit (block index, or ROOT_UNIT) it belongs to."""

    name: str
    shape: tuple[int, ...]
    unit: int
    # False for a frozen tensor (a LoRA base weight): it has no gradient and no optimizer state.
    trainable: bool = True
    # Element count, computed once: the planner sums it over every tensor of every candidate.
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", math.prod(self.shape))


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows about a model. Structural fields are None when unknown."""

    name: str
    n_params: int
    arch: str | None = None
    n_layers: int | None = None
    hidden: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    max_seq: int | None = None
    tied_embeddings: bool = False
    learned_positions: bool = False
    dropout: float = 0.0
    # Which runtime model this is, as the strategy registry names families: "gpt" (shardwise's
    # built-in GPT), a Hugging Face model_type ("llama", "mistral", "gpt2", ...), "" when unknown.
    # Decides which strategies can run it (tensor-parallel plans, pipeline stages).
    family: str = ""
    # Exact per-parameter shapes in module registration order (ZeRO-1's greedy partition depends on
    # the order of equal-sized tensors). Empty for a bare parameter count.
    params: tuple[ParamInfo, ...] = field(default=(), repr=False)
    # Mixture of experts: a ``plan.moe.MoEInfo`` (experts, top-k, ...); None when dense.
    moe: Any = field(default=None, repr=False)
    # MLP-width tensors a GPT MLP's activation keeps for backward beyond its input and its output:
    # 0 for a fused GELU (F.gelu, MPT's, Megatron's); 3 for transformers' "gelu_new" (GPT-2's default),
    # written in Python ops (tanh's output, 1 + tanh, 0.5 x: measured on a played gpt2 rank, +216 MiB).
    act_extra: int = 0

    @property
    def has_structure(self) -> bool:
        """True when layers, hidden, heads and vocab are all known (activations can be modelled)."""
        return None not in (self.arch, self.n_layers, self.hidden, self.n_heads, self.vocab, self.ffn_hidden)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads or 1

    def tp_sizes(self) -> dict[str, int | None]:
        """The sizes the runtime's tensor-parallel plans split (``parallel/adapters.py`` per model
        layout): attention heads, key/value heads, the hidden size and a dense MLP's width (an MoE
        block's experts stay whole under TP). The planner's one list; ``core.layout.tp_indivisible``
        is the one rule on it. Unknown sizes are None (a bare parameter count)."""
        return {"attention heads": self.n_heads, "key/value heads": self.n_kv_heads or self.n_heads,
                "hidden size": self.hidden, "MLP width": self.ffn_hidden if self.moe is None else None}

    @property
    def dim_head(self) -> int:
        if self.head_dim:
            return self.head_dim
        if self.hidden and self.n_heads:
            return self.hidden // self.n_heads
        return 0

    def unit_params(self) -> dict[int, int]:
        """Parameter count per FSDP unit (block index -> count; ROOT_UNIT -> everything else)."""
        return dict(self._unit_params)

    @cached_property
    def _unit_params(self) -> dict[int, int]:
        # Computed once per spec (frozen): every candidate of a plan asks for it.
        units: dict[int, int] = {}
        for p in self.params:
            units[p.unit] = units.get(p.unit, 0) + p.numel
        return units

    @cached_property
    def unit_positions(self) -> dict[int, list[int]]:
        """Indices into ``params`` of each unit's tensors, in registration order."""
        out: dict[int, list[int]] = {}
        for i, p in enumerate(self.params):
            out.setdefault(p.unit, []).append(i)
        return out

    @cached_property
    def block_matrix_params(self) -> int:
        """Parameters of the matrices inside the repeated blocks (what checkpointing recomputes)."""
        return sum(p.numel for p in self.params if p.unit != ROOT_UNIT and len(p.shape) >= 2)

    @cached_property
    def outer_unit_params(self) -> tuple[int, ...]:
        """Parameter counts of the units FSDP makes of what is outside the blocks, as the runtime
        does (``parallel.blocks.outer_modules``): the embeddings (registered before the blocks) and
        the final norm + head (after them) as two units, torchtitan's; one root unit holding both
        when the embeddings are tied to the head (or no blocks are known)."""
        root = [(i, p) for i, p in enumerate(self.params) if p.unit == ROOT_UNIT]
        blocks = [i for i, p in enumerate(self.params) if p.unit != ROOT_UNIT]
        if not root:
            return ()
        if self.tied_embeddings or not blocks:
            return (sum(p.numel for _, p in root),)
        before = sum(p.numel for i, p in root if i < blocks[0])
        after = sum(p.numel for i, p in root if i > blocks[0])
        return tuple(n for n in (before, after) if n)

    def largest_unit_params(self) -> int:
        """Parameters of the biggest unit FSDP gathers at once (a block, the embeddings, or the
        final norm + head; see ``outer_unit_params``)."""
        units = self.unit_params()
        if units:
            return max([v for k, v in units.items() if k != ROOT_UNIT] + list(self.outer_unit_params))
        # Bare count: assume the blocks hold everything, evenly.
        return math.ceil(self.n_params / (self.n_layers or 1))

    def embedding_params(self) -> int:
        """Parameters used as look-up tables (no matmul FLOPs): input embeddings unless tied, positions."""
        if not self.has_structure:
            return 0
        assert self.vocab is not None and self.hidden is not None
        emb = 0 if self.tied_embeddings else self.vocab * self.hidden
        if self.learned_positions and self.max_seq:
            emb += self.max_seq * self.hidden
        return emb


def _check_positive(name: str, what: str, **values: Any) -> None:
    for key, value in values.items():
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ConfigError(f"model {name!r}: {key} must be a positive integer, got {value!r} ({what}).")


# ---------------------------------------------------------------------------------------------
# Shapes generated from a config, in the same order the real modules register them.


def llama_params(
    *, n_layers: int, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_hidden: int, vocab: int,
    tied: bool, qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False, qk_norm: bool = False,
) -> tuple[ParamInfo, ...]:
    """Parameters of ``transformers`` LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM (``qk_norm``: Qwen3's per-head RMSNorm on queries and keys)."""
    out = [ParamInfo("model.embed_tokens.weight", (vocab, hidden), ROOT_UNIT)]
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    for i in range(n_layers):
        pre = f"model.layers.{i}."
        shapes: list[tuple[str, tuple[int, ...]]] = [("self_attn.q_proj.weight", (q, hidden))]
        if qkv_bias:
            shapes.append(("self_attn.q_proj.bias", (q,)))
        shapes.append(("self_attn.k_proj.weight", (kv, hidden)))
        if qkv_bias:
            shapes.append(("self_attn.k_proj.bias", (kv,)))
        shapes.append(("self_attn.v_proj.weight", (kv, hidden)))
        if qkv_bias:
            shapes.append(("self_attn.v_proj.bias", (kv,)))
        shapes.append(("self_attn.o_proj.weight", (hidden, q)))
        if o_bias:
            shapes.append(("self_attn.o_proj.bias", (hidden,)))
        if qk_norm:
            shapes += [("self_attn.q_norm.weight", (head_dim,)), ("self_attn.k_norm.weight", (head_dim,))]
        for proj, shape in (("gate_proj", (ffn_hidden, hidden)), ("up_proj", (ffn_hidden, hidden)),
                            ("down_proj", (hidden, ffn_hidden))):
            shapes.append((f"mlp.{proj}.weight", shape))
            if mlp_bias:
                shapes.append((f"mlp.{proj}.bias", (shape[0],)))
        shapes += [("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,))]
        out += [ParamInfo(pre + n, s, i) for n, s in shapes]
    out.append(ParamInfo("model.norm.weight", (hidden,), ROOT_UNIT))
    if not tied:
        out.append(ParamInfo("lm_head.weight", (vocab, hidden), ROOT_UNIT))
    return tuple(out)


def gpt2_params(*, n_layers: int, hidden: int, vocab: int, n_positions: int, ffn_hidden: int) -> tuple[ParamInfo, ...]:
    """Parameters of ``transformers`` GPT2LMHeadModel (Conv1D weights are stored (in, out); head tied)."""
    h, f = hidden, ffn_hidden
    out = [ParamInfo("transformer.wte.weight", (vocab, h), ROOT_UNIT),
           ParamInfo("transformer.wpe.weight", (n_positions, h), ROOT_UNIT)]
    for i in range(n_layers):
        pre = f"transformer.h.{i}."
        shapes = [("ln_1.weight", (h,)), ("ln_1.bias", (h,)), ("attn.c_attn.weight", (h, 3 * h)),
                  ("attn.c_attn.bias", (3 * h,)), ("attn.c_proj.weight", (h, h)), ("attn.c_proj.bias", (h,)),
                  ("ln_2.weight", (h,)), ("ln_2.bias", (h,)), ("mlp.c_fc.weight", (h, f)),
                  ("mlp.c_fc.bias", (f,)), ("mlp.c_proj.weight", (f, h)), ("mlp.c_proj.bias", (h,))]
        out += [ParamInfo(pre + n, s, i) for n, s in shapes]
    out += [ParamInfo("transformer.ln_f.weight", (h,), ROOT_UNIT), ParamInfo("transformer.ln_f.bias", (h,), ROOT_UNIT)]
    return tuple(out)


def from_llama_like(
    name: str, *, n_layers: int, hidden: int, n_heads: int, ffn_hidden: int, vocab: int,
    n_kv_heads: int | None = None, head_dim: int | None = None, max_seq: int = 4096, tied: bool = False,
    qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False, family: str = "llama",
    qk_norm: bool = False,
) -> ModelSpec:
    """A Llama/Mistral/Qwen2-family spec from its hyper-parameters (``family``: the HF model_type)."""
    n_kv_heads = n_kv_heads or n_heads
    _check_positive(name, "from the config", n_layers=n_layers, hidden=hidden, n_heads=n_heads,
                    ffn_hidden=ffn_hidden, vocab=vocab, n_kv_heads=n_kv_heads)
    head_dim = head_dim or hidden // n_heads
    if n_heads % n_kv_heads:
        raise ConfigError(f"model {name!r}: num_attention_heads={n_heads} is not a multiple of "
                          f"num_key_value_heads={n_kv_heads}.")
    params = llama_params(n_layers=n_layers, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads,
                          head_dim=head_dim, ffn_hidden=ffn_hidden, vocab=vocab, tied=tied,
                          qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=qk_norm)
    return ModelSpec(name=name, n_params=sum(p.numel for p in params), arch="llama", n_layers=n_layers,
                     hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     ffn_hidden=ffn_hidden, vocab=vocab, max_seq=max_seq, tied_embeddings=tied, params=params,
                     family=family)


def moe_llama_spec(name: str, *, n_layers: int, hidden: int, n_heads: int, n_kv_heads: int, vocab: int,
                   n_experts: int, top_k: int, moe_ffn: int, head_dim: int | None = None,
                   shared_ffn: int = 0, max_seq: int = 4096, tied: bool = False, family: str = "mixtral",
                   qk_norm: bool = False, qkv_bias: bool = False, qk_norm_full: bool = False,
                   router_outputs: bool = False) -> ModelSpec:
    """A Mixtral / Qwen-MoE-style spec: Llama attention, every block's MLP an MoE of SwiGLU experts.

    Expert tensors are the fused 3-D ones transformers 5.x stores (``mlp.experts.gate_up_proj``
    ``(E, 2f, h)``, ``mlp.experts.down_proj`` ``(E, h, f)``) plus the router ``mlp.gate.weight``.
    ``shared_ffn``: Qwen2-MoE's shared expert and its (1, h) gate; ``qk_norm_full``: OLMoE's q/k
    norms over all heads (Qwen3-MoE's are per head). ``router_outputs``: the config's
    ``output_router_logits`` (the model returns its routers' probabilities for the aux loss).
    """
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
                   params_per_expert=3 * hidden * moe_ffn, hidden=hidden, router_outputs=router_outputs)
    return replace(base, n_params=sum(p.numel for p in params), params=tuple(params), moe=info)


def from_gpt2_like(name: str, *, n_layers: int, hidden: int, n_heads: int, vocab: int = 50257,
                   n_positions: int = 1024, ffn_hidden: int | None = None, act_extra: int = 0) -> ModelSpec:
    """A GPT-2-family spec (tied head, learned positions, biases everywhere); ``act_extra``: see
    ``ModelSpec.act_extra`` (3 for transformers' GPT-2, whose default activation is "gelu_new")."""
    ffn_hidden = ffn_hidden or 4 * hidden
    _check_positive(name, "from the config", n_layers=n_layers, hidden=hidden, n_heads=n_heads, vocab=vocab)
    params = gpt2_params(n_layers=n_layers, hidden=hidden, vocab=vocab, n_positions=n_positions,
                         ffn_hidden=ffn_hidden)
    return ModelSpec(name=name, n_params=sum(p.numel for p in params), arch="gpt", n_layers=n_layers,
                     hidden=hidden, n_heads=n_heads, n_kv_heads=n_heads, ffn_hidden=ffn_hidden, vocab=vocab,
                     max_seq=n_positions, tied_embeddings=True, learned_positions=True, params=params,
                     family="gpt2", act_extra=act_extra)


def gelu_extra(activation: str) -> int:
    """``ModelSpec.act_extra`` for a transformers ``activation_function``: "gelu_new" (GPT-2's
    default, Python ops) keeps 3 more MLP-width tensors; torch's own GELUs none. (Other Python
    activations, e.g. "gelu_fast", keep more and are not modelled.)"""
    return 3 if activation == "gelu_new" else 0


# ---------------------------------------------------------------------------------------------
# HF config.json


def from_hf_config_dict(cfg: dict[str, Any], name: str = "hf-config") -> ModelSpec:
    """Spec from a parsed ``config.json`` of a Hugging Face family (``shardwise.core.families``), in any
    key spelling transformers writes (``models.hf_config.with_canonical_keys``)."""
    cfg = with_canonical_keys(cfg)
    model_type = str(cfg.get("model_type", "")).lower()
    try:
        return _spec_of(cfg, model_type, name)
    except KeyError as e:
        raise ConfigError(f"{name}: config.json of model_type {model_type!r} lacks the key {e.args[0]!r}.") from None


def _spec_of(cfg: dict[str, Any], model_type: str, name: str) -> ModelSpec:
    if model_type in LLAMA_LIKE or (not model_type and "hidden_size" in cfg):
        return from_llama_like(
            name,
            n_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], n_heads=cfg["num_attention_heads"],
            ffn_hidden=cfg["intermediate_size"], vocab=cfg["vocab_size"],
            n_kv_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
            max_seq=cfg.get("max_position_embeddings", 4096), tied=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases and no o_proj bias; Llama exposes both switches.
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            o_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
            family=model_type or "llama", qk_norm=model_type == "qwen3",
        )
    if model_type in MOE_FAMILIES:  # Hugging Face MoE (plan/moe.py)
        dense = cfg.get("mlp_only_layers") or []
        if dense or int(cfg.get("decoder_sparse_step", 1) or 1) != 1:
            raise ConfigError(f"{name}: config.json makes some layers dense (mlp_only_layers={dense}, "
                              f"decoder_sparse_step={cfg.get('decoder_sparse_step')}); the planner counts "
                              "models whose every layer is a mixture of experts. Use --model-factory "
                              "module:function to count it on the meta device.")
        qkv_bias = bool(cfg.get("qkv_bias", True) if model_type == "qwen2_moe" else cfg.get("attention_bias", False))
        return moe_llama_spec(
            name, n_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
            n_heads=cfg["num_attention_heads"], n_kv_heads=cfg.get("num_key_value_heads"),
            head_dim=cfg.get("head_dim"), vocab=cfg["vocab_size"], n_experts=cfg["num_experts"],
            top_k=cfg["num_experts_per_tok"],
            moe_ffn=cfg["intermediate_size" if model_type in ("mixtral", "olmoe") else "moe_intermediate_size"],
            shared_ffn=int(cfg.get("shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0,
            max_seq=cfg.get("max_position_embeddings", 4096), tied=bool(cfg.get("tie_word_embeddings", False)),
            family=model_type, qk_norm=model_type in ("qwen3_moe", "olmoe"), qkv_bias=qkv_bias,
            qk_norm_full=model_type == "olmoe", router_outputs=bool(cfg.get("output_router_logits", False)))
    if model_type == "gpt2":
        return from_gpt2_like(name, n_layers=cfg.get("num_hidden_layers", 12), hidden=cfg.get("hidden_size", 768),
                              n_heads=cfg.get("num_attention_heads", 12), vocab=cfg.get("vocab_size", 50257),
                              n_positions=cfg.get("max_position_embeddings", 1024), ffn_hidden=cfg.get("n_inner"),
                              act_extra=gelu_extra(cfg.get("activation_function", "gelu_new")))
    raise ConfigError(f"{name}: model_type {model_type or '(missing)'!r} is not supported by the planner; "
                      f"supported: {', '.join(HF_FAMILIES)}. Use --model-factory module:function to count "
                      "any nn.Module on the meta device, or --params N for a bare count.")


def from_hf_config(path: str | Path) -> ModelSpec:
    """Spec from a ``config.json`` path, a folder holding one, or a bundled name (as ``model.hf_config``)."""
    try:
        p = resolve_hf_config(path)
    except ConfigError:
        raise ConfigError(f"--hf-config: no file at {str(path)!r}; pass a config.json, the folder holding it, "
                          "or a bundled name.") from None
    cfg = read_hf_config(p)
    bundled = p.parent.name == "hf_configs" and p.stem != "config"
    return from_hf_config_dict(cfg, name=p.stem if bundled else p.parent.name or p.name)


# ---------------------------------------------------------------------------------------------
# nn.Module (meta device), GPTConfig, bare count


def from_module(module: Any, name: str = "module") -> ModelSpec:
    """Spec from an ``nn.Module`` (build it under ``torch.device('meta')``: no memory is touched).

    Parameter counts and shapes are exact (shared/tied tensors counted once). Blocks are found by
    the runtime's own rule (``shardwise.parallel.blocks.find_blocks``: the container FSDP wraps,
    activation checkpointing wraps and the pipeline splits). Hidden size, heads and vocabulary come
    from ``module.config`` (or ``module.hf.config`` for a wrapped Hugging Face model) when it looks
    like a GPTConfig or an HF config.
    """
    from shardwise.parallel.blocks import find_blocks, model_family  # defers torch

    blocks = find_blocks(module)
    unit_of: dict[str, int] = {}
    if blocks is not None:
        prefix = f"{blocks.path}." if blocks.path else ""
        unit_of = {f"{prefix}{k}.": i for i, k in enumerate(blocks.names)}
    params: list[ParamInfo] = []
    for pname, p in module.named_parameters():
        unit = next((u for pre, u in unit_of.items() if pname.startswith(pre)), ROOT_UNIT)
        params.append(ParamInfo(pname, tuple(p.shape), unit, trainable=bool(p.requires_grad)))
    n_params = sum(p.numel for p in params)
    cfg = getattr(module, "config", None) or getattr(getattr(module, "hf", None), "config", None)
    structure: dict[str, Any] = {}
    if cfg is not None and hasattr(cfg, "n_embd") and hasattr(cfg, "n_layer"):  # GPTConfig / GPT-2 style
        structure = dict(arch="gpt", n_layers=cfg.n_layer, hidden=cfg.n_embd, n_heads=cfg.n_head,
                         n_kv_heads=cfg.n_head,
                         ffn_hidden=getattr(cfg, "n_inner", None) or 4 * cfg.n_embd, vocab=cfg.vocab_size,
                         max_seq=getattr(cfg, "block_size", getattr(cfg, "n_positions", None)),
                         dropout=float(getattr(cfg, "dropout", 0.0)), learned_positions=True,
                         tied_embeddings=not any(p.name.split(".")[-2:-1] == ["lm_head"] for p in params),
                         moe=moe_of_gpt(cfg) if getattr(cfg, "n_experts", 0) else None,
                         # transformers' GPT-2 names its activation; shardwise's GPT runs F.gelu
                         act_extra=gelu_extra(getattr(cfg, "activation_function", "gelu")))
    elif cfg is not None and hasattr(cfg, "hidden_size") and hasattr(cfg, "intermediate_size"):
        n_heads = cfg.num_attention_heads
        structure = dict(arch="llama", n_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, n_heads=n_heads,
                         n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
                         head_dim=getattr(cfg, "head_dim", None), ffn_hidden=cfg.intermediate_size,
                         vocab=cfg.vocab_size, max_seq=getattr(cfg, "max_position_embeddings", None),
                         tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))
        if str(getattr(cfg, "model_type", "")).lower() in MOE_FAMILIES:
            # The MoE shape (experts, top-k, the experts' width) as plan --hf-config reads the same
            # config: without it --dry-run sized the activations of a dense MLP of the config's
            # intermediate_size (Qwen3-30B-A3B: 6,144 wide against its experts' 768; 37.4 against the plan's 25.6 GiB).
            hf = from_hf_config_dict(cfg.to_dict())
            structure.update(ffn_hidden=hf.ffn_hidden, moe=hf.moe)
    elif blocks is not None:
        structure = dict(n_layers=len(blocks))
    return ModelSpec(name=name, n_params=n_params, params=tuple(params), family=model_family(module), **structure)


def from_gpt_config(cfg: Any, name: str = "gpt") -> ModelSpec:
    """Spec of shardwise's own ``GPT(cfg)``, exact, from its torch-free parameter list."""
    params = []
    for pname, shape in gpt_param_shapes(cfg):
        unit = int(pname.split(".")[1]) if pname.startswith("blocks.") else ROOT_UNIT
        params.append(ParamInfo(pname, shape, unit))
    return ModelSpec(name=name, n_params=sum(p.numel for p in params), arch="gpt", n_layers=cfg.n_layer,
                     hidden=cfg.n_embd, n_heads=cfg.n_head, n_kv_heads=cfg.n_head, ffn_hidden=4 * cfg.n_embd,
                     vocab=cfg.vocab_size, max_seq=cfg.block_size, dropout=float(cfg.dropout),
                     learned_positions=True, tied_embeddings=False, params=tuple(params), family="gpt",
                     moe=moe_of_gpt(cfg))


def from_factory(spec: str) -> ModelSpec:
    """Spec from ``module:function`` returning an nn.Module; the call runs under the meta device."""
    import torch  # defers torch

    from shardwise.workloads import import_factory  # defers torch

    fn: Callable[[], Any] = import_factory(spec, "--model-factory")
    with torch.device("meta"):
        model = fn()
    from torch import nn  # defers torch

    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model-factory {spec!r} returned {type(model).__name__}, not an nn.Module.")
    return from_module(model, name=spec)


def from_param_count(n_params: int, *, n_layers: int | None = None, hidden: int | None = None,
                     n_heads: int | None = None, vocab: int | None = None) -> ModelSpec:
    """Spec from a bare count. Without layers/hidden/heads/vocab, activations cannot be modelled."""
    if n_params <= 0:
        raise ConfigError(f"--params must be a positive number of parameters, got {n_params}.")
    _check_positive("--params", "given on the command line", n_layers=n_layers, hidden=hidden,
                    n_heads=n_heads, vocab=vocab)
    structure: dict[str, Any] = {}
    if n_layers and hidden and n_heads and vocab:
        structure = dict(arch="gpt", ffn_hidden=4 * hidden, n_kv_heads=n_heads)
    spec = ModelSpec(name=f"{n_params / 1e9:.3g}B params" if n_params >= 1e8 else f"{n_params} params",
                     n_params=n_params, n_layers=n_layers, hidden=hidden, n_heads=n_heads, vocab=vocab, **structure)
    return replace(spec)
