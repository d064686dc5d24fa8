"""Hugging Face ``transformers`` causal LMs built from a local config.json (never the hub).

``HFCausalLM`` makes such a model look like the built-in GPT to the trainer: token ids in, logits
out. The HF module itself sits under ``.hf`` with its own names intact, so tensor/pipeline plans
address it as ``hf.model.layers.0.self_attn.q_proj`` and checkpoints keep the HF parameter names
behind an ``hf.`` prefix.

Weights are freshly initialised by transformers from torch's global RNG (the runtime seeds it), in
fp32: precision is the runtime's job (``parallel.precision``), not the config file's ``dtype``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError, did_you_mean
from shardwise.models.hf_config import (
    SEQ_LEN_KEYS,
    SUPPORTED_FAMILIES,
    bundled_config_dir,
    bundled_configs,
    hf_family,
    load_hf_config_dict,
    resolve_hf_config,
)

__all__ = ["SEQ_LEN_KEYS", "SUPPORTED_FAMILIES", "HFCausalLM", "build_hf_model", "bundled_config_dir",
           "bundled_configs", "hf_family", "load_hf_config_dict", "resolve_hf_config"]


class HFCausalLM(nn.Module):
    """A transformers causal LM as ``input_ids (B, T) -> logits (B, T, vocab)``; the HF model is ``.hf``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # No KV cache: training never reuses it, and it would hold activations across steps.
        return self.hf(input_ids=input_ids, use_cache=False).logits


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.kind = 'hf' needs the transformers package: pip install 'shardwise[hf]'.") from None
    return transformers


def _config_kwargs(transformers: Any, raw: dict[str, Any], model_type: str,
                   overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge the JSON, zeroed dropouts and the user's overrides into config constructor kwargs."""
    probe = transformers.AutoConfig.for_model(model_type, **raw)
    defaults = probe.to_dict()
    valid = set(defaults) | set(type(probe).attribute_map) | set(raw)
    for key in overrides:
        if key not in valid:
            raise ConfigError(f"unknown model.overrides key {key!r} for a {model_type} config."
                              f"{did_you_mean(key, valid)} Valid: {', '.join(sorted(valid))}.")
    # Dropout draws random masks that differ between a 1-rank and an N-rank run, which would break
    # the parity tests; the tiny workloads do not need it. An explicit override still wins.
    no_dropout = {k: 0.0 for k, v in defaults.items()
                  if k.endswith(("dropout", "pdrop")) and isinstance(v, float)}
    return {**raw, **no_dropout, **overrides}


def build_hf_model(config_path: str, **overrides: Any) -> HFCausalLM:
    """Return a freshly initialised HF causal LM from a local config, with ``overrides`` applied to it.

    ``config_path``: a config.json, a folder holding one, or a bundled name (``bundled_configs()``).
    ``block_size``/``seq_len`` overrides are the training sequence length: checked against the
    model's position limit, not written into the config.
    """
    transformers = _transformers()
    raw = load_hf_config_dict(config_path)
    model_type = hf_family(config_path)
    raw.pop("model_type", None)
    for key in ("dtype", "torch_dtype"):  # build in fp32 (see module docstring); v5 and v4 spellings
        raw.pop(key, None)
    seq_lens = {k: overrides.pop(k) for k in SEQ_LEN_KEYS if k in overrides}
    for key, seq in seq_lens.items():
        if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
            raise ConfigError(f"model.overrides.{key} must be a positive integer, got {seq!r}.")
    config = transformers.AutoConfig.for_model(model_type, **_config_kwargs(transformers, raw, model_type, overrides))
    max_pos = getattr(config, "max_position_embeddings", None)
    for key, seq in seq_lens.items():
        if max_pos is not None and seq > max_pos:
            raise ConfigError(f"model.overrides.{key}={seq} exceeds the model's max_position_embeddings={max_pos}; "
                              "lower it or raise max_position_embeddings in the overrides.")
    # sdpa runs on CPU and CUDA alike with no extra package (flash-attention would need CUDA).
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return HFCausalLM(hf)
