"""Hugging Face ``transformers`` causal LMs built from a local config.json (never the hub).

``HFCausalLM`` makes such a model look like the built-in GPT to the trainer: token ids in, logits
out. The HF module itself sits under ``.hf`` with its own names intact, so tensor/pipeline plans
address it as ``hf.model.layers.0.self_attn.q_proj`` and checkpoints keep the HF parameter names
behind an ``hf.`` prefix.

Weights are freshly initialised by transformers from torch's global RNG (the runtime seeds it), or
loaded from a pretrained folder (``pretrained=``), in fp32 either way: precision is the runtime's
job (``parallel.precision``), not the config file's ``dtype``. ``lora=`` adds peft adapters and
freezes the rest (``models.lora``).

Built inside ``Session.build`` the model lives on the meta device and its pretrained weights are
read later, each rank reading only its own shards (``Session.prepare``); built anywhere else it is
a whole model with its weights already loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardwise.errors import ConfigError, did_you_mean
from shardwise.habits import other_tools_hint
from shardwise.models import varlen
from shardwise.models.hf_config import (
    SEQ_LEN_KEYS,
    SUPPORTED_FAMILIES,
    bundled_config_dir,
    bundled_configs,
    hf_family,
    load_hf_config_dict,
    resolve_hf_config,
)
from shardwise.models.hf_moe import attach_hf_moe, watch_real_tokens
from shardwise.models.lora import apply_lora
from shardwise.models.masking import hf_document_masks, split_inputs
from shardwise.models.pretrained import check_adapter_targets, check_model_tensors, inspect_pretrained, load_pretrained

if TYPE_CHECKING:
    from shardwise.core.config import LoraConfig
    from shardwise.models.pretrained import PretrainedFolder

__all__ = ["SEQ_LEN_KEYS", "SUPPORTED_FAMILIES", "HFCausalLM", "build_hf_model", "bundled_config_dir",
           "bundled_configs", "hf_family", "load_hf_config_dict", "resolve_hf_config"]


class HFCausalLM(nn.Module):
    """A transformers causal LM as ``input_ids (B, T) -> logits (B, T, vocab)``; the HF model is ``.hf``.

    Beside the module it keeps what an export back to Hugging Face needs: ``export_config`` (the
    config.json it was built from, overrides applied, dropout as the user set it), ``pretrained``
    (the checked folder its weights come from, or None) and ``lora`` (peft's adapter config as a
    dict, or None).
    """

    def __init__(self, hf: nn.Module, *, export_config: dict[str, Any] | None = None,
                 pretrained: PretrainedFolder | None = None, lora: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.hf = hf
        self.export_config = export_config if export_config is not None else hf.config.to_dict()
        self.pretrained = pretrained
        self.lora = lora

    def forward(self, input_ids: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of token ids ``(B, T)``, or of a mapping with ``input_ids`` and optionally
        ``position_ids``/``doc_ids``/``attention_mask`` (packed or padded rows, see models.masking).

        Packed rows reach the HF model as ``position_ids`` (rotary positions restart per document)
        and an explicit 4-D boolean mask (causal within each document), which transformers passes
        to SDPA as is: exact on CPU and CUDA alike. After ``models.varlen.enable(model)`` they go as
        the documents' ``cu_seqlens`` to variable-length attention instead (no T x T mask; the
        FlashAttention varlen kernel on CUDA, one SDPA call per document elsewhere).
        """
        ids, extra = split_inputs(input_ids)
        kwargs: dict[str, Any] = {}
        if "position_ids" in extra:
            kwargs["position_ids"] = extra["position_ids"]
        if "doc_ids" in extra and varlen.enabled(self.hf):
            # Variable-length attention (models.varlen): the documents as cu_seqlens, no T x T mask;
            # the 2-D all-ones mask keeps transformers from building one from the positions.
            cu, longest = varlen.cu_seqlens(extra["doc_ids"])
            kwargs.update(attention_mask=torch.ones_like(ids), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                          max_length_q=longest, max_length_k=longest)
        elif "doc_ids" in extra:
            kwargs["attention_mask"] = hf_document_masks(self.hf.config, extra)
        elif "attention_mask" in extra:
            kwargs["attention_mask"] = extra["attention_mask"]  # HF's own 2-D padding mask
        if getattr(self.hf.config, "output_router_logits", False):
            # An MoE model's aux loss is shardwise's own (models/hf_moe.py, over the global batch):
            # transformers' would be computed and thrown away, and it takes only a 2-D padding mask
            # (it fails on the 4-D document mask of packed rows).
            kwargs["output_router_logits"] = False
        # No KV cache: training never reuses it, and it would hold activations across steps.
        return self.hf(input_ids=ids, use_cache=False, **kwargs).logits

    # ------------------------------------------------------------------ pretrained weights
    def pretrained_tensors(self) -> dict[str, str]:
        """{name in this module: key in the pretrained files} of every tensor the folder provides."""
        if self.pretrained is None:
            return {}
        return {f"hf.{name}": key for name, key in check_model_tensors(self.pretrained, self.hf).items()}

    def load_pretrained(self) -> None:
        """Read the pretrained weights into this (possibly sharded) module; collective under a process group."""
        if self.pretrained is not None:
            load_pretrained(self.hf, self.pretrained)

    def export_info(self) -> dict[str, Any]:
        """What ``shardwise ckpt export --format hf/peft`` needs, as JSON data for the checkpoint manifest."""
        folder = self.pretrained
        # "pretrained": what model.pretrained named (a merge at export reads it the same way);
        # "pretrained_base": the model folder under it when that was a LoRA adapter folder.
        return {"format": "hf", "prefix": "hf.", "config": self.export_config, "lora": self.lora,
                "pretrained": str(folder.source.resolve()) if folder is not None else None,
                "pretrained_base": str(folder.path.resolve()) if folder is not None and folder.adapter else None}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.kind = 'hf' needs the transformers package: pip install 'shardwise[hf]'.") from None
    return transformers


def _no_init_weights(transformers: Any) -> Any:
    """transformers' context that skips weight initialisation (moved between v4 and v5)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights


def _config_kwargs(transformers: Any, raw: dict[str, Any], model_type: str,
                   overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge the JSON, zeroed dropouts and the user's overrides into config constructor kwargs."""
    probe = transformers.AutoConfig.for_model(model_type, **raw)
    defaults = probe.to_dict()
    valid = set(defaults) | set(type(probe).attribute_map) | set(raw)
    for key in overrides:
        if key not in valid:
            raise ConfigError(f"unknown model.overrides key {key!r} for a {model_type} config."
                              f"{did_you_mean(key, valid)}{other_tools_hint(f'model.overrides.{key}')} "
                              f"Valid: {', '.join(sorted(valid))}.")
    # Dropout draws random masks that differ between a 1-rank and an N-rank run, which would break
    # the parity tests; the tiny workloads do not need it. An explicit override still wins.
    no_dropout = {k: 0.0 for k, v in defaults.items()
                  if k.endswith(("dropout", "pdrop")) and isinstance(v, float)}
    return {**raw, **no_dropout, **overrides}


def _build_config(transformers: Any, config_path: str, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the transformers config to build, the config.json to export) from a config path and overrides."""
    raw = load_hf_config_dict(config_path)
    model_type = hf_family(config_path)
    raw.pop("model_type", None)
    for key in ("dtype", "torch_dtype"):  # build in fp32 (see module docstring); v5 and v4 spellings
        raw.pop(key, None)
    seq_lens = {k: overrides.pop(k) for k in SEQ_LEN_KEYS if k in overrides}
    for key, seq in seq_lens.items():
        if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
            raise ConfigError(f"model.overrides.{key} must be a positive integer, got {seq!r}.")
    kwargs = _config_kwargs(transformers, raw, model_type, overrides)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    max_pos = getattr(config, "max_position_embeddings", None)
    for key, seq in seq_lens.items():
        if max_pos is not None and seq > max_pos:
            raise ConfigError(f"model.overrides.{key}={seq} exceeds the model's max_position_embeddings={max_pos}; "
                              "lower it or raise max_position_embeddings in the overrides.")
    # The exported config.json: the user's config with their overrides, dropout as they set it
    # (zeroed only for training, see _config_kwargs).
    export = transformers.AutoConfig.for_model(model_type, **{**raw, **overrides}).to_dict()
    return config, export


def build_hf_model(config_path: str = "", *, pretrained: str = "", lora: LoraConfig | None = None,
                   **overrides: Any) -> HFCausalLM:
    """Return an HF causal LM from a local config, with ``overrides`` applied to it.

    ``config_path``: a config.json, a folder holding one, or a bundled name (``bundled_configs()``);
    the pretrained folder's own config.json when ``pretrained`` is given. ``pretrained``: a folder
    (config.json + safetensors) whose weights the model gets (checked first, see
    ``models.pretrained``), or a PEFT LoRA adapter folder, merged into its base's weights
    (``models.adapter``); without it the weights are freshly initialised from torch's RNG.
    ``lora``: peft adapters on the frozen model. ``block_size``/``seq_len`` overrides are the
    training sequence length: checked against the model's position limit, not written into the config.
    """
    transformers = _transformers()
    folder = None
    if pretrained:
        folder = inspect_pretrained(pretrained)
        config_path = config_path or str(folder.path)
    if not config_path:
        raise ConfigError("build_hf_model needs a config (a config.json, a folder or a bundled name) or a "
                          "pretrained folder.")
    config, export = _build_config(transformers, config_path, dict(overrides))
    if folder is None:
        # sdpa runs on CPU and CUDA alike with no extra package (flash-attention would need CUDA).
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    else:
        # Every weight comes from the folder: initialising them first would only waste time and
        # random draws (and the draws would change what a LoRA adapter starts from).
        with _no_init_weights(transformers)():
            hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        hf.tie_weights()  # skipped with the init above; the files hold only one of tied tensors
    moe = attach_hf_moe(hf)  # MoE families: router statistics and the global-batch aux loss (models/hf_moe.py)
    model = HFCausalLM(hf, export_config=export, pretrained=folder)
    if folder is not None and folder.adapter is not None:
        check_adapter_targets(folder, hf)  # here, where the model is whole (meta or not)
    watch_real_tokens(model, moe)  # the aux loss counts real tokens only (padding of records, packed rows)
    if folder is not None and not any(p.is_meta for p in hf.parameters()):
        # Built for real (outside Session.build, or with model.init = "eager"): load now, whole.
        model.load_pretrained()
    if lora is not None and lora.rank > 0:
        if folder is None:
            raise ConfigError("LoRA adapters train on a frozen pretrained model: pass pretrained=FOLDER.")
        model.lora = apply_lora(hf, lora)
    return model
