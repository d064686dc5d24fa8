"""Hugging Face ``transformers`` causal LMs built from a local config.json (never the hub).

``HFCausalLM`` makes such a model look like the built-in GPT to the trainer: token ids in, logits
out. The HF module itself sits under ``.hf`` with its own names intact, so tensor/pipeline plans
address it as ``hf.model.layers.0.self_attn.q_proj`` and checkpoints keep the HF parameter names
behind an ``hf.`` prefix.

Weights are freshly initialised by transformers from torch's global RNG (the runtime seeds it), in
fp32: precision is the runtime's job (``parallel.precision``), not the config file's ``dtype``.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError, did_you_mean

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
# Overrides that size the data, not the model (see ``workloads.block_size_of``); checked against
# the model's position limit, then dropped.
SEQ_LEN_KEYS = ("block_size", "seq_len")


def bundled_config_dir() -> Path:
    """Folder of the tiny config.json files shipped with shardwise (``llama-tiny``, ``gpt2-tiny``)."""
    return Path(str(resources.files("shardwise") / "models" / "hf_configs"))


def bundled_configs() -> list[str]:
    """Names accepted as ``model.hf_config`` without a path, e.g. ``"llama-tiny"``."""
    return sorted(p.stem for p in bundled_config_dir().glob("*.json"))


def resolve_hf_config(config_path: str | Path) -> Path:
    """Return the config.json file meant by a file path, a folder holding config.json, or a bundled name."""
    p = Path(config_path).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "config.json").is_file():
            return p / "config.json"
        raise ConfigError(f"model.hf_config folder {str(p)!r} has no config.json in it.")
    name = str(config_path).removesuffix(".json")
    if name in bundled_configs():
        return bundled_config_dir() / f"{name}.json"
    raise ConfigError(
        f"model.hf_config {str(config_path)!r} is neither a file, a folder holding config.json, nor a "
        f"bundled config.{did_you_mean(name, bundled_configs())} Bundled: {', '.join(bundled_configs())}."
    )


def load_hf_config_dict(config_path: str | Path) -> dict[str, Any]:
    """Return the parsed JSON object of the config named by ``config_path`` (see ``resolve_hf_config``)."""
    p = resolve_hf_config(config_path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.hf_config: cannot read {str(p)!r} as JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"model.hf_config: {str(p)!r} holds a JSON {type(raw).__name__}, not an object.")
    return raw


def hf_family(config_path: str | Path) -> str:
    """Return the config's model family ("llama", "mistral", "qwen2", "gpt2"); ConfigError otherwise."""
    model_type = str(load_hf_config_dict(config_path).get("model_type", "")).lower()
    if model_type not in SUPPORTED_FAMILIES:
        raise ConfigError(
            f"model.hf_config {str(config_path)!r}: model_type {model_type or '(missing)'!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}. For another architecture use model.kind = 'custom' "
            "with a factory that builds it."
        )
    return model_type


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
