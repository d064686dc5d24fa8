"""Fine-tune plans: a local Hugging Face folder (``--pretrained DIR``), optionally with LoRA adapters.

The model's shape comes from the folder's own ``config.json``. With ``--lora`` the planner builds
the model exactly as ``train`` does (``build_hf_model(pretrained=..., lora=...)``) on the meta
device, so the adapters' shapes, the frozen base (no gradient, no optimizer state) and the blocks
FSDP wraps are the runtime's own: the predicted bytes are the ledger's.

The printed command is the ``hf-finetune`` recipe with ``model.pretrained`` set to the folder; the
only placeholders are what the planner cannot know: ``$DATA`` (the text to train on) and, when the
folder carries no tokenizer, ``$TOKENIZER``.
"""

from __future__ import annotations

from pathlib import Path

from shardwise.config import toml_string
from shardwise.errors import ConfigError
from shardwise.plan.spec import ModelSpec, from_hf_config

FINETUNE_RECIPE = "hf-finetune"
DATA_PLACEHOLDER = "$DATA"
TOKENIZER_PLACEHOLDER = "$TOKENIZER"
PLACEHOLDERS = (DATA_PLACEHOLDER, TOKENIZER_PLACEHOLDER)
# Files a save_pretrained tokenizer folder holds (any one is enough for data.tokenizer = the folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def folder_of(path: str) -> Path:
    """The pretrained folder, checked the way ``train`` checks it (config.json and weights)."""
    from shardwise.models.pretrained import inspect_pretrained

    return inspect_pretrained(path).path


def pretrained_spec(path: str, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> ModelSpec:
    """The folder's ModelSpec; with LoRA, the runtime's own adapted model built on the meta device."""
    folder = folder_of(path)
    if lora_rank < 0:
        raise ConfigError(f"--lora must be a positive adapter rank (e.g. 8 or 16), got {lora_rank}.")
    if not lora_rank:
        if lora_targets:
            raise ConfigError("--lora-targets names the modules that get LoRA adapters: give --lora RANK too.")
        spec = from_hf_config(folder)
        return _named(spec, folder.name)
    import torch

    from shardwise.config import LoraConfig
    from shardwise.models.hf import build_hf_model
    from shardwise.plan.spec import from_module

    with torch.device("meta"):
        model = build_hf_model(pretrained=str(folder), lora=LoraConfig(rank=lora_rank, targets=list(lora_targets)))
    return from_module(model, name=f"{folder.name}+lora{lora_rank}")


def _named(spec: ModelSpec, name: str) -> ModelSpec:
    import dataclasses

    return dataclasses.replace(spec, name=name)


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def finetune_sets(path: str, seq: int, lora_rank: int = 0,
                  lora_targets: tuple[str, ...] = ()) -> tuple[tuple[str, ...], list[str]]:
    """(``--set`` overrides that make ``hf-finetune`` fine-tune the folder, warnings)."""
    folder = folder_of(path)
    sets = [f"model.pretrained={toml_string(str(folder.resolve()))}", f"model.overrides.block_size={seq}"]
    if lora_rank:
        sets.append(f"lora.rank={lora_rank}")
        if lora_targets:
            sets.append("lora.targets=[" + ", ".join(toml_string(t) for t in lora_targets) + "]")
    sets.append(f"data.path={DATA_PLACEHOLDER}")
    warnings = [f"the commands train on {DATA_PLACEHOLDER}: set it to your text (a .txt/.md/.jsonl file or a "
                "folder of them) before running them."]
    if not has_tokenizer(folder):
        sets.append(f"data.tokenizer={TOKENIZER_PLACEHOLDER}")
        warnings.append(f"{folder} holds no tokenizer: set {TOKENIZER_PLACEHOLDER} to the tokenizer the model "
                        "was trained with (a save_pretrained folder or a tokenizer.json).")
    return tuple(sets), warnings


def shell_word(setting: str) -> str:
    """One ``--set`` value for a shell: single-quoted, or double-quoted where it holds a placeholder
    the shell must expand (the rest of such a value is plain: a key and '=')."""
    import shlex

    if any(p in setting for p in PLACEHOLDERS):
        if any(c in setting for c in '"`\\') or setting.count("$") != 1:
            raise ValueError(f"cannot quote {setting!r} around a placeholder")
        return f'"{setting}"'
    return shlex.quote(setting)
