"""Hugging Face ``config.json`` files: the bundled ones, and how a ``model.hf_config`` value is found.

Torch-free, so the planner can read the same configs the runtime builds from. Bundled configs are
the tiny test models (``llama-tiny``, ``gpt2-tiny``) and one per planner preset (``llama-3-70b``,
``mistral-7b``, ``gpt2-xl``, ...): ``model.hf_config = "llama-3-70b"`` trains that architecture from
scratch, and ``shardwise plan --model llama-3-70b`` prints commands that name it.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from shardwise.core.families import HF_FAMILIES
from shardwise.errors import ConfigError, did_you_mean

SUPPORTED_FAMILIES = HF_FAMILIES  # the one family list: shardwise.core.families
# Overrides that size the data, not the model (see ``workloads.block_size_of``); checked against
# the model's position limit, then dropped.
SEQ_LEN_KEYS = ("block_size", "seq_len")
# Every spelling transformers writes for one config attribute of the supported families (the
# families' ``attribute_map``s: GPT-2's n_embd/n_layer/n_head/n_positions; Mixtral and Qwen3-MoE
# save ``num_local_experts``, Qwen2-MoE and OLMoE ``num_experts``). The first name is the one
# shardwise reads; tests/test_hf_folders.py checks the table against the installed transformers.
KEY_SPELLINGS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "num_experts": ("num_experts", "num_local_experts"),
}


def bundled_config_dir() -> Path:
    """Folder of the config.json files shipped with shardwise (``llama-tiny``, ``llama-3-70b``, ...)."""
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


def read_json_object(file: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``file``; ConfigError, starting with ``what`` the file is, when it cannot be
    read or holds something else."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what}: cannot read {str(file)!r} as JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what}: {str(file)!r} holds a JSON {type(raw).__name__}, not an object.")
    return raw


def load_hf_config_dict(config_path: str | Path) -> dict[str, Any]:
    """Return the parsed JSON object of the config named by ``config_path`` (see ``resolve_hf_config``)."""
    return read_json_object(resolve_hf_config(config_path), "model.hf_config")


def with_canonical_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` plus each ``KEY_SPELLINGS`` attribute under its first name, whichever spelling the
    file used (a new dict; the file's own keys are kept)."""
    out = dict(raw)
    for name, spellings in KEY_SPELLINGS.items():
        if name not in out:
            for spelling in spellings[1:]:
                if spelling in out:
                    out[name] = out[spelling]
                    break
    return out


def read_hf_config(config_path: str | Path) -> dict[str, Any]:
    """The config.json named by ``config_path`` (a file, a model folder or a bundled name) with every
    attribute under shardwise's name (``with_canonical_keys``): what ``train`` and ``plan`` both read."""
    return with_canonical_keys(load_hf_config_dict(config_path))


def hf_family(config_path: str | Path) -> str:
    """Return the config's model family (one of ``shardwise.core.families.HF_FAMILIES``); ConfigError otherwise."""
    model_type = str(load_hf_config_dict(config_path).get("model_type", "")).lower()
    if model_type not in SUPPORTED_FAMILIES:
        raise ConfigError(
            f"model.hf_config {str(config_path)!r}: model_type {model_type or '(missing)'!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}. For another architecture use model.kind = 'custom' "
            "with a factory that builds it."
        )
    return model_type
