"""PEFT LoRA adapter folders on the tiny model folders of the tests, saved by peft itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_lora_adapter(base: Path, out: Path, targets: list[str], *, seed: int = 0, **options: object) -> Path:
    """A LoRA adapter (r = 4, alpha = 8, ``options``) on the model folder ``base``, its B drawn at
    random (peft starts B at zero, which would change nothing), written by peft's save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, **options))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(str(out))
    return out


def edit_adapter_config(adapter: Path, **changes: object) -> None:
    file = adapter / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}), encoding="utf-8")


def peft_model(base: Path, adapter: Path, *, merged: bool = False) -> torch.nn.Module:
    """What peft users load: the base with the adapter on it (unmerged), or merged into it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                      str(adapter))
    return (model.merge_and_unload() if merged else model).eval()
