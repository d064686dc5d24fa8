"""Pipeline stages for Hugging Face causal LMs of the Llama family (llama, mistral, qwen2, qwen3).

The built-in GPT is cut by ``parallel/pipeline/pp.py``; a transformers model needs three more things, all
done here from outside (the HF code is not touched):

* **Layer names that survive the cut.** ``model.layers`` is an ``nn.ModuleList``, whose names are
  positions: deleting layers 0-3 would rename layer 4 to ``layers.0`` and break checkpoints,
  pretrained loading and export. The union model (what a rank keeps) therefore holds its layers in
  an ``nn.ModuleDict`` keyed by their original index (torchtitan's choice for its own models), so
  every parameter keeps the name it has on one device: ``hf.model.layers.5.self_attn.q_proj.weight``.
  Parts a rank does not own (embeddings, final norm, head) are set to ``None``.
* **A stage forward.** ``HFStage`` runs what ``LlamaModel.forward`` runs, restricted to its slice:
  the first stage embeds token ids, every stage builds the rotary cos/sin and the causal mask(s)
  its layers need from the microbatch's ``position_ids`` / ``doc_ids`` / ``attention_mask``
  (keyword inputs the schedule hands every stage, ``parallel/pipeline/pp.py``; plain causal positions
  without them), so nothing but one activation tensor crosses a stage boundary; the last stage
  applies the final norm and the head and returns logits for the loss.
* **Per-stage weights.** Nothing here reads weights: the union holds only this rank's tensors, so
  the meta-init replay allocates only them and ``models.pretrained.load_pretrained`` asks DCP for
  only their keys (each rank reads just its stage's bytes from the safetensors files).

Why not ``transformers.distributed.pipeline_parallel`` (transformers 5.x): it replaces unowned
modules by identity layers inside the full model and runs a naive forward-only split with its own
blocking send/recv per step; it has no schedule (no microbatches, no 1F1B or zero-bubble), keeps
positional ``ModuleList`` names only because it leaves identity layers in place, and its layer
split ignores the embedding/head weight. torch's ``pipelining`` schedules need a stage module with a
tensor-in/tensor-out forward, which is what ``HFStage`` is; the layer split is the layout's
(``layout.stage_layer_ranges``), the same for GPT and HF models.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardwise.errors import ConfigError
from shardwise.models import varlen
from shardwise.models.masking import attention_mask_4d, layer_kind
from shardwise.models.pretrained import load_pretrained
from shardwise.parallel.pipeline.hf_moe import stage_routing

__all__ = ["HFStage", "check_hf_pp_model", "hf_stage", "prune_hf_to_stages"]



def hf_stage(union: nn.Module, stage: int, ranges: list[range]) -> nn.Module:
    """The stage module of a Llama-family Hugging Face union (GPT-2's is ``pipeline.gpt2.GPT2Stage``)."""
    return HFStage(union, stage, ranges)


def stage_hf(src_hf: nn.Module, inner_name: str, inner: nn.Module, last: bool) -> nn.Module:
    """A stage's stand-in for the union's transformers model: ``inner`` (this stage's share of the
    decoder) under the union's attribute name, the head on the last stage, and what the loaders
    and plans read from the original (config, prefix, tied-weight keys), so names stay the union's."""
    hf = nn.Module()
    setattr(hf, inner_name, inner)
    hf.lm_head = src_hf.lm_head if last else None
    hf.config = src_hf.config  # a plain attribute: model_family / plans read hf.config
    hf.base_model_prefix = getattr(src_hf, "base_model_prefix", inner_name)
    # Where the files keep a tied head this stage holds without its embedding (pretrained.tie_sources).
    hf._tied_weights_keys = getattr(src_hf, "_tied_weights_keys", None)
    return hf


def _inner(model: nn.Module) -> nn.Module:
    return model.hf.model  # type: ignore[union-attr,return-value]


def n_layers(model: nn.Module) -> int:
    """The decoder layers of an (unpruned or pruned) union model."""
    return int(model.hf.config.num_hidden_layers)  # type: ignore[union-attr]


def check_hf_pp_model(model: nn.Module) -> None:
    """Raise ConfigError when a Hugging Face model cannot be cut into pipeline stages.

    A tied embedding and head are no reason to refuse: the two stages keep one copy each
    (``parallel/pipeline/ties.py``, which refuses the layouts where that cannot be exact).
    """
    layers = _inner(model).layers
    if not isinstance(layers, nn.ModuleList) or len(layers) != n_layers(model):
        raise ConfigError(
            f"pipeline parallel expects the model's {n_layers(model)} decoder layers in hf.model.layers; "
            f"found {type(layers).__name__} of {len(layers)}. Pass the model as build_hf_model returns it.")
    return None


def prune_hf_to_stages(model: nn.Module, stage_ids: list[int], ranges: list[range]) -> nn.Module:
    """Delete (in place) every part of ``model`` that no local stage owns; return it (the union).

    The layers move into an ``nn.ModuleDict`` keyed by their original index (see module docstring).
    """
    inner = _inner(model)
    owned = sorted(i for s in stage_ids for i in ranges[s])
    layers = inner.layers
    inner.layers = nn.ModuleDict({str(i): layers[i] for i in owned})
    if 0 not in stage_ids:
        inner.embed_tokens = None
    if len(ranges) - 1 not in stage_ids:
        inner.norm = None
        model.hf.lm_head = None  # type: ignore[union-attr]
    return model


def _mask_kwargs(fn: Any, config: Any, hidden: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Keyword arguments of transformers' mask builders for a no-cache training step; ``attention_mask``
    is what ``HFCausalLM.forward`` hands the model (a 4-D document mask, a 2-D padding mask, or None).

    The builders' signature changed between 4.x (``cache_position``, ``past_key_values``) and 5.x
    (``cache``); only the names the installed version takes are passed.
    """
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": attention_mask}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    for name in ("cache", "past_key_values"):
        if name in params:
            kwargs[name] = None
    if "cache_position" in params:
        kwargs["cache_position"] = position_ids[0]
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids
    return kwargs


class HFStage(nn.Module):
    """One pipeline stage of a Llama-family ``HFCausalLM``: token ids or hidden states in, hidden states
    or logits out. Shares its modules with the union, under the same names (``hf.model.layers.5...``),
    so FSDP units, pretrained loading and state dicts see the single-device names.
    """

    def __init__(self, union: nn.Module, stage: int, ranges: list[range]) -> None:
        super().__init__()
        self.first = stage == 0
        self.last = stage == len(ranges) - 1
        src_hf, src = union.hf, _inner(union)  # type: ignore[union-attr]
        model = nn.Module()
        model.embed_tokens = src.embed_tokens if self.first else None
        model.layers = nn.ModuleDict({str(i): src.layers[str(i)] for i in ranges[stage]})
        model.norm = src.norm if self.last else None
        model.rotary_emb = src.rotary_emb  # every stage computes the positions its layers need
        self.hf = stage_hf(src_hf, "model", model, self.last)
        # Mixture-of-experts families: the routers' all-layer sums ride beside the hidden states
        # (parallel/pipeline/hf_moe.py); None for a dense model.
        self.moe_routing = stage_routing(src_hf, list(model.layers.values()), self.last)
        # What pretrained loading and the FSDP materialiser need from the union.
        self.pretrained = getattr(union, "pretrained", None)
        self._sp_mesh: Any = None

    def set_sequence_parallel(self, tp_mesh: Any) -> None:
        """Under TP + sequence parallel the residual stream is a sequence-sharded DTensor (the Llama
        plan keeps it one so HF code sees the global length). A pipeline boundary carries plain
        tensors, so this stage sends its local shard and wraps what it receives back into a DTensor."""
        self._sp_mesh = tp_mesh

    def load_pretrained(self) -> None:
        """Read this stage's tensors (only those) from the pretrained folder; collective like DCP."""
        if self.pretrained is not None:
            load_pretrained(self.hf, self.pretrained)

    def forward(self, x: torch.Tensor, routing: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> Any:
        """``x``: token ids (first stage) or hidden states; the keywords are the microbatch's side inputs
        of a packed or padded batch (``models.masking``), which the schedule hands every stage.
        ``routing``: an MoE model's carried router sums from the previous stage (``pipeline/hf_moe.py``);
        an MoE stage before the last returns ``(hidden, routing)``."""
        model, config = self.hf.model, self.hf.config
        hidden = model.embed_tokens(x) if self.first else stage_input(x, self._sp_mesh, position_ids, doc_ids,
                                                                      attention_mask)
        seq = hidden.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        position_embeddings = model.rotary_emb(hidden, position_ids)
        masks: dict[str, Any] = {}
        packed = varlen_kwargs(self.hf, doc_ids)
        for name, layer in model.layers.items():
            kind = _attention_kind(config, int(name))
            if packed:
                masks[kind] = None  # variable-length attention: the documents' cu_seqlens, no mask
            elif kind not in masks:
                window = int(config.sliding_window) if kind == "sliding_attention" else None
                mask = stage_attention_mask(doc_ids, attention_mask, window)
                masks[kind] = _build_mask(kind, config, hidden, position_ids, mask)
            out = layer(hidden, attention_mask=masks[kind], position_ids=position_ids,
                        position_embeddings=position_embeddings, use_cache=False, **packed)
            hidden = out[0] if isinstance(out, tuple) else out  # transformers 4.x returns a tuple
        if self.moe_routing is not None:
            extra = {k: v for k, v in (("doc_ids", doc_ids), ("attention_mask", attention_mask)) if v is not None}
            routing = self.moe_routing.carry(routing, hidden, extra)  # the last stage records the aux loss
        if self.last:
            if self.moe_routing is not None:
                # On the hidden states, not on the logits: the stage's output stays a fresh tensor
                # (FSDP warns about a view) and no (B, T, vocab) copy is made.
                hidden = self.moe_routing.attach(hidden)
            return self.hf.lm_head(model.norm(hidden))
        if self._sp_mesh is not None:
            # The sequence shard crosses the boundary; a copy, not the DTensor's view of it (FSDP
            # hooks the stage's output for its backward and warns about a view).
            hidden = hidden.to_local().clone()
        return hidden if routing is None else (hidden, routing)


def varlen_kwargs(hf: nn.Module, doc_ids: torch.Tensor | None) -> dict[str, Any]:
    """The attention keywords of a packed microbatch for a model switched to variable-length
    attention (``models.varlen``; as ``HFCausalLM.forward`` passes them), else none."""
    if doc_ids is None or not varlen.enabled(hf):
        return {}
    cu, longest = varlen.cu_seqlens(doc_ids)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def stage_input(x: torch.Tensor, sp_mesh: Any, position_ids: torch.Tensor | None, doc_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None) -> Any:
    """A later stage's hidden states: ``x`` itself, or under sequence parallel the received sequence
    shard wrapped back into the sequence-sharded DTensor the HF code expects (``set_sequence_parallel``)."""
    if sp_mesh is None:
        return x
    # The global length: a record batch's length need not divide by tp (dynamic padding; torch
    # shards it unevenly), so it comes from the side inputs, which span the whole sequence; a token
    # stream's length is a multiple of tp.
    side = position_ids if position_ids is not None else doc_ids if doc_ids is not None else attention_mask
    total = side.shape[-1] if side is not None else x.shape[1] * sp_mesh.size()
    shape = (x.shape[0], total, *x.shape[2:])
    return DTensor.from_local(x, sp_mesh, (Shard(1),), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def stage_attention_mask(doc_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
                         window: int | None = None) -> torch.Tensor | None:
    """What ``HFCausalLM.forward`` passes the HF model for the same batch, for a stage's mask builder:
    the documents' 4-D mask (one owner: ``models.masking``; with a sliding-window layer's ``window``,
    since an explicit 4-D mask replaces the builder's own), the records' 2-D padding mask, or None."""
    if doc_ids is None:
        return attention_mask
    extra = {"doc_ids": doc_ids} if attention_mask is None else {"doc_ids": doc_ids, "attention_mask": attention_mask}
    return attention_mask_4d(extra, window)


def _attention_kind(config: Any, index: int) -> str:
    """'full_attention' or 'sliding_attention' for layer ``index`` (the rule: ``models.masking.layer_kind``)."""
    return layer_kind(config, index)


def _build_mask(kind: str, config: Any, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> Any:
    from transformers import masking_utils  # defers transformers (optional)

    fn = (masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention"
          else masking_utils.create_causal_mask)
    # sdpa with no padding: the builder returns None and attention runs with is_causal=True.
    return fn(**_mask_kwargs(fn, config, hidden, position_ids, attention_mask))
