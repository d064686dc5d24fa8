"""LoRA adapters on a Hugging Face model, through the ``peft`` library.

``apply_lora`` injects peft's LoRA layers into the transformers model in place
(``peft.inject_adapter_in_model``, the in-place form of ``get_peft_model``: the same layers, the
same initialisation, the same random draws) and freezes everything else. In place, because the
module paths stay those of the Hugging Face model (``model.layers.0.self_attn.q_proj`` gains a
``base_layer``, ``lora_A.default`` and ``lora_B.default``): FSDP still finds one unit per decoder
layer, and the tensor-parallel plans find the base layers by their usual names
(``parallel/tensor/plans.py``).

Only the adapters are trainable, so only they reach the optimizer and the checkpoints; the frozen
base comes from ``model.pretrained`` every time. ``peft_adapter_name`` maps a checkpoint name to the
name PEFT's ``save_pretrained`` writes, so ``shardwise ckpt export --format peft`` gives a folder
that ``PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from shardwise.core.config import LoraConfig

__all__ = ["ADAPTER", "apply_lora", "lora_config_from_dict", "lora_targets", "peft_adapter_name", "peft_config_dict",
           "peft_lora_config"]

ADAPTER = "default"  # peft's adapter name; PEFT's saved files leave it out of the keys


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError("[lora] needs the peft package: pip install 'shardwise[lora]'.") from None
    return peft


def lora_targets(settings: LoraConfig, model_type: str) -> list[str]:
    """The module names that get adapters: ``lora.targets``, or peft's default for ``model_type``."""
    if settings.targets:
        return list(settings.targets)
    # defers peft (optional)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    _peft()
    if model_type not in DEFAULTS:
        raise ConfigError(f"peft has no default LoRA targets for model_type {model_type!r}; set lora.targets, "
                          "e.g. ['q_proj', 'v_proj'].")
    return list(DEFAULTS[model_type])


def peft_lora_config(settings: LoraConfig, model_type: str) -> Any:
    """peft's ``LoraConfig`` for shardwise's ``[lora]`` section on a ``model_type`` model."""
    peft = _peft()
    # GPT-2 keeps its projections in Conv1D modules, whose weights are stored transposed.
    return peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                           target_modules=lora_targets(settings, model_type), task_type="CAUSAL_LM",
                           fan_in_fan_out=model_type == "gpt2")


def _linear_names(hf: nn.Module) -> list[str]:
    from torch import nn  # defers torch

    names = set()
    for name, module in hf.named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def apply_lora(hf: nn.Module, settings: LoraConfig) -> dict[str, Any]:
    """Inject LoRA adapters into ``hf`` in place and freeze its other weights; return peft's config as a dict.

    Works on a meta-device model (the adapters' initialisation is then recorded and replayed per
    shard, see ``runtime.meta_init``).
    """
    peft = _peft()
    model_type = str(getattr(getattr(hf, "config", None), "model_type", ""))
    config = peft_lora_config(settings, model_type)
    try:
        peft.inject_adapter_in_model(config, hf, adapter_name=ADAPTER)
    except ValueError as e:
        if "not found in the base model" not in str(e):
            raise
        raise ConfigError(
            f"lora.targets {config.target_modules and sorted(config.target_modules)} name no module of this "
            f"{model_type} model. Linear layers it has: {', '.join(_linear_names(hf))}.") from None
    for name, p in hf.named_parameters():
        p.requires_grad_(".lora_" in name)
    return peft_config_dict(config)


def peft_config_dict(config: Any) -> dict[str, Any]:
    """JSON-ready form of a peft config, as ``adapter_config.json`` holds it."""
    out = config.to_dict()
    for key, value in list(out.items()):
        if isinstance(value, set):
            out[key] = sorted(value)
        elif isinstance(value, enum.Enum):
            out[key] = value.value
    return out


def lora_config_from_dict(data: dict[str, Any]) -> Any:
    """peft's ``LoraConfig`` from ``peft_config_dict``'s output (as a checkpoint manifest keeps it)."""
    peft = _peft()
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig) if f.init}
    return peft.LoraConfig(**{k: v for k, v in data.items() if k in fields})


def peft_adapter_name(name: str) -> str | None:
    """The key PEFT's ``save_pretrained`` writes for the adapter tensor ``name`` of an ``HFCausalLM``.

    ``hf.model.layers.0.self_attn.q_proj.lora_A.default.weight`` becomes
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; None for a non-adapter name.
    """
    if ".lora_" not in name or not name.startswith("hf."):
        return None
    return "base_model.model." + name[len("hf."):].replace(f".{ADAPTER}.", ".")
