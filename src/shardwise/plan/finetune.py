"""Fine-tune plans: a local Hugging Face folder (``--pretrained DIR``), optionally with LoRA adapters.

The model's shape comes from the folder's own ``config.json``. With ``--lora`` the planner builds
the model exactly as ``train`` does (``build_hf_model(pretrained=..., lora=...)``) on the meta
device, so the adapters' shapes, the frozen base (no gradient, no optimizer state) and the blocks
FSDP wraps are the runtime's own: the predicted bytes are the ledger's.

The printed command is the ``hf-finetune`` recipe with ``model.pretrained`` set to the folder, or
``hf-sft`` when ``--data FILE`` holds chat or prompt/response records; the only placeholders are
what the planner cannot know: ``$DATA`` (the data, without ``--data``) and, when the folder carries
no tokenizer, ``$TOKENIZER``.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.core.config import LoraConfig, toml_string
from shardwise.core.families import RECORD_KINDS
from shardwise.data.records import RECORD_SUFFIXES, is_hf_disk, read_records, record_kind
from shardwise.errors import ConfigError
from shardwise.models.adapter import tokenizer_home
from shardwise.models.pretrained import inspect_pretrained
from shardwise.plan.spec import ModelSpec, from_hf_config, from_module

if TYPE_CHECKING:
    from shardwise.models.pretrained import PretrainedFolder

FINETUNE_RECIPE = "hf-finetune"
SFT_RECIPE = "hf-sft"  # chat / prompt-response records
DPO_RECIPE = "hf-dpo"  # preference records (prompt, chosen, rejected)
DATA_PLACEHOLDER = "$DATA"
TOKENIZER_PLACEHOLDER = "$TOKENIZER"
PLACEHOLDERS = (DATA_PLACEHOLDER, TOKENIZER_PLACEHOLDER)
# Files a save_pretrained tokenizer folder holds (any one is enough for data.tokenizer = the folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def checked_folder(path: str) -> PretrainedFolder:
    """The pretrained folder (or LoRA adapter folder and its base), checked the way ``train`` checks it."""
    return inspect_pretrained(path)


def pretrained_spec(path: str, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> ModelSpec:
    """The folder's ModelSpec; with LoRA, the runtime's own adapted model built on the meta device."""
    pretrained = checked_folder(path)
    folder = pretrained.source  # an adapter folder's shapes are its base's (the adapter is merged)
    if lora_rank < 0:
        raise ConfigError(f"--lora must be a positive adapter rank (e.g. 8 or 16), got {lora_rank}.")
    if not lora_rank:
        if lora_targets:
            raise ConfigError("--lora-targets names the modules that get LoRA adapters: give --lora RANK too.")
        spec = from_hf_config(pretrained.path)
        return _named(spec, folder.name)
    import torch  # defers torch

    from shardwise.models.hf import build_hf_model  # defers torch

    with torch.device("meta"):
        model = build_hf_model(pretrained=str(folder), lora=LoraConfig(rank=lora_rank, targets=list(lora_targets)))
    return from_module(model, name=f"{folder.name}+lora{lora_rank}")


def _named(spec: ModelSpec, name: str) -> ModelSpec:
    return dataclasses.replace(spec, name=name)


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def data_kind(path: str) -> str:
    """What ``train`` would read from ``path``: "chat" or "instruct" records (the first record
    decides, ``data.records.record_kind``), else "text"."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--data {path!r} does not exist; pass the file or folder the run will train on.")
    if p.is_file() and p.suffix.lower() == ".jsonl":
        with open(p, "rb") as f:
            for raw in f:
                if raw.strip():
                    try:
                        return record_kind(json.loads(raw)) or "text"
                    except (ValueError, RecursionError):
                        return "text"
        return "text"
    if is_hf_disk(p) or (p.is_file() and p.suffix.lower() in RECORD_SUFFIXES):
        records = read_records(p, "--data")
        return record_kind(records[0][1]) or "text"
    return "text"


def finetune_sets(path: str, seq: int, lora_rank: int = 0, lora_targets: tuple[str, ...] = (),
                  data: str | None = None, recipe: str = "") -> tuple[str, tuple[str, ...], list[str]]:
    """(the recipe, ``--set`` overrides that make it fine-tune the folder, warnings).

    ``data``: the file the run trains on: its records choose ``hf-sft`` (chat / instruct records)
    or ``hf-finetune`` (text); without it the recipe is ``recipe`` or hf-finetune and the data ``$DATA``.
    """
    folder = checked_folder(path).source
    kind = data_kind(data) if data else ""
    if not recipe:
        recipe = DPO_RECIPE if kind == "preference" else SFT_RECIPE if kind in RECORD_KINDS else FINETUNE_RECIPE
    sets = [f"model.pretrained={toml_string(str(folder.resolve()))}", f"model.overrides.block_size={seq}"]
    if lora_rank:
        sets.append(f"lora.rank={lora_rank}")
        if lora_targets:
            sets.append("lora.targets=[" + ", ".join(toml_string(t) for t in lora_targets) + "]")
    warnings = []
    if data:
        sets.append(f"data.path={toml_string(str(Path(data).resolve()))}")
        if kind == "instruct":
            sets.append("data.kind=instruct")
        if kind in RECORD_KINDS and recipe == FINETUNE_RECIPE:
            warnings.append(f"{data} holds {kind} records, which {FINETUNE_RECIPE} reads as text; the "
                            f"{SFT_RECIPE} recipe trains on them (drop --recipe).")
        if (kind == "preference") != (recipe == DPO_RECIPE):
            warnings.append(f"{data} holds {kind} records and the recipe is {recipe}: the {DPO_RECIPE} recipe "
                            "trains on preference records (prompt, chosen, rejected), and only on them.")
    else:
        sets.append(f"data.path={DATA_PLACEHOLDER}")
        what = ("your chat records (a .jsonl of {\"messages\": [...]})" if recipe == SFT_RECIPE else
                "your preference records (a .jsonl of {\"prompt\", \"chosen\", \"rejected\"})"
                if recipe == DPO_RECIPE else
                "your text (a .txt/.md/.jsonl file or a folder of them)")
        warnings.append(f"the commands train on {DATA_PLACEHOLDER}: set it to {what} before running them, or "
                        "give the planner --data FILE (chat or prompt/response records choose the hf-sft recipe, "
                        "preference records hf-dpo).")
    if not has_tokenizer(Path(tokenizer_home(str(folder)))):
        sets.append(f"data.tokenizer={TOKENIZER_PLACEHOLDER}")
        warnings.append(f"{folder} holds no tokenizer: set {TOKENIZER_PLACEHOLDER} to the tokenizer the model "
                        "was trained with (a save_pretrained folder or a tokenizer.json).")
    return recipe, tuple(sets), warnings


def shell_word(setting: str) -> str:
    """One ``--set`` value for a shell: single-quoted, or double-quoted where it holds a placeholder
    the shell must expand (the rest of such a value is plain: a key and '=')."""
    if any(p in setting for p in PLACEHOLDERS):
        if any(c in setting for c in '"`\\') or setting.count("$") != 1:
            raise ValueError(f"cannot quote {setting!r} around a placeholder")
        return f'"{setting}"'
    return shlex.quote(setting)
