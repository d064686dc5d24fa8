"""A PEFT LoRA adapter folder as ``model.pretrained``: its base model with the adapter merged in.

What PEFT's ``save_pretrained`` (or ``shardwise ckpt export --format peft``) writes --
``adapter_config.json`` and ``adapter_model.safetensors``, no ``config.json`` -- names its base in
``base_model_name_or_path``. ``read_adapter`` checks such a folder torch-free, from the JSON and the
safetensors header: the base must be a local model folder (a relative path is taken from the
adapter folder; shardwise never downloads), the adapter plain LoRA on linear layers (no DoRA,
trained biases, modules_to_save, ...), and every A/B pair must fit a weight the base holds.

``models.pretrained`` then loads the base exactly as it loads any folder and ``merge_adapter`` adds
``scale * B @ A`` (PEFT's LoRA formula, ``scale = lora_alpha / r``, or ``/ sqrt(r)`` with
``use_rslora``) to each target, every rank to the shard it holds: the run starts from the model
``PeftModel.from_pretrained(base, DIR).merge_and_unload()`` gives, under every strategy, through the
one loading path.

Merged rather than kept as adapters, because the merged model is the model a run continues from
(an SFT result, say): without ``[lora]`` the run trains its every weight; with ``[lora]`` it trains
fresh adapters on top, so the DPO reference (adapters off) is that SFT model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from shardwise.errors import ConfigError
from shardwise.models.confine import confined_file
from shardwise.models.hf_config import read_json_object
from shardwise.models.safetensors_header import FLOAT_DTYPES, read_safetensors_header

if TYPE_CHECKING:
    import torch

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LoraAdapter", "adapter_base", "is_adapter_folder", "merge_adapter",
           "model_folders", "read_adapter", "tokenizer_home"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's saved key of one LoRA factor: base_model.model.<module path>.lora_A.weight (adapter name left out).
_LORA_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])\.weight")
# adapter_config.json keys that do not change the merged weights, whatever their value: bookkeeping,
# which modules got adapters (the weight file says that exactly), dropout, and the configs of
# initialisation schemes (a scheme that changes the base is refused by init_lora_weights below).
_NO_EFFECT = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "lora_alpha", "use_rslora", "fan_in_fan_out", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "lora_dropout", "megatron_config", "megatron_core",
    "qalora_group_size", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "runtime_config",
    "ensure_weight_tying"})
# Initialisations that leave the base as it is (PiSSA, OLoRA, LoftQ, CorDA... rewrite the base weights:
# their adapters apply to a changed base, not to base_model_name_or_path).
_PLAIN_INITS = ("gaussian", "eva")  # and true/false
# Every other key must hold its "off" value (null, false, empty) or the one named here.
_DEFAULTS = {"bias": "none"}
_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json")  # a save_pretrained tokenizer folder
_MERGE_WITH_PEFT = ("Merge it with peft instead -- PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()"
                    ".save_pretrained(OUT) -- and set model.pretrained to OUT.")


@dataclass(frozen=True)
class LoraAdapter:
    """A checked LoRA adapter folder: its base, the scale of ``B @ A`` and each target weight's factors."""

    path: Path
    base: Path  # the base model folder (config.json + weights), resolved
    rank: int
    alpha: float
    scale: float
    fan_in_fan_out: bool  # the targets store (in, out) weights (GPT-2's Conv1D): the update is transposed
    targets: dict[str, tuple[str, str]] = field(repr=False)  # {base file key: (lora_A key, lora_B key)}

    def describe(self) -> str:
        """One line for the run's log: the adapter, its base and which modules it changes."""
        kinds = sorted({key.rsplit(".", 2)[-2] for key in self.targets})
        return (f"model.pretrained {str(self.path)!r} is a LoRA adapter (r = {self.rank}, lora_alpha = {self.alpha:g}) "
                f"on {str(self.base)!r}: merged into {len(self.targets)} weights ({', '.join(kinds)}) as the base "
                "loads")


def _where(path: Path) -> str:
    return f"model.pretrained {str(path)!r}"


def is_adapter_folder(path: Path) -> bool:
    """Whether ``path`` is a PEFT adapter folder; ConfigError when it is a model folder as well."""
    if not (path / ADAPTER_CONFIG).is_file():
        return False
    if (path / "config.json").is_file():
        raise ConfigError(
            f"{_where(path)} holds both config.json (a whole model) and {ADAPTER_CONFIG} (a LoRA adapter on "
            "another model), so which model it means is ambiguous. Keep the adapter in a folder of its own "
            f"(model.pretrained = that folder merges it into its base), or remove {ADAPTER_CONFIG} to train the "
            "folder's own weights.")
    return True


def _read_config(path: Path) -> dict[str, Any]:
    return read_json_object(path / ADAPTER_CONFIG, f"the PEFT adapter config of {_where(path)}")


def _base_path(path: Path, config: dict[str, Any]) -> Path:
    """The local base folder ``base_model_name_or_path`` names (relative to the adapter folder)."""
    name = config.get("base_model_name_or_path")
    fix = (f"set base_model_name_or_path in {str(path / ADAPTER_CONFIG)!r} to the local folder of the base model "
           "(config.json + safetensors; a relative path is taken from the adapter folder)")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{_where(path)} is a LoRA adapter that names no base model (base_model_name_or_path is "
                          f"{name!r}); {fix}.")
    base = (path / Path(name).expanduser()).resolve()  # an absolute name replaces the adapter folder
    if (base / "config.json").is_file():
        return base
    if not base.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith("."):
        raise ConfigError(
            f"{_where(path)} is a LoRA adapter on {name!r}, which is no folder next to the adapter; as a Hugging Face "
            f"Hub id it would need a download, and shardwise never downloads. Download the base once (e.g. `hf "
            f"download {name} --local-dir DIR`) or find its local copy, and {fix}.")
    what = "has no config.json" if base.is_dir() else "does not exist"
    raise ConfigError(f"{_where(path)} is a LoRA adapter on {name!r}, but {str(base)!r} {what}: the base model "
                      f"must be a local model folder. Restore it there, or {fix}.")


def _check_options(path: Path, config: dict[str, Any]) -> tuple[int, float, float]:
    """(r, lora_alpha, scale) of a plain LoRA adapter config; ConfigError for anything a merge cannot honour."""
    file = str(path / ADAPTER_CONFIG)
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise ConfigError(f"{_where(path)} is a PEFT adapter of type {peft_type!r}; shardwise merges LoRA adapters "
                          f"only. {_MERGE_WITH_PEFT}")
    for key, value in config.items():
        if key in _NO_EFFECT or not value or value == _DEFAULTS.get(key):
            continue
        if key == "init_lora_weights" and (value is True or value in _PLAIN_INITS):
            continue
        raise ConfigError(f"{file} sets {key} = {json.dumps(value)[:80]}, which shardwise's merge does not support "
                          f"(it merges plain LoRA on linear layers: W += lora_alpha / r * B @ A). {_MERGE_WITH_PEFT}")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ConfigError(f"{file}: r must be a positive integer, got {r!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConfigError(f"{file}: lora_alpha must be a positive number, got {alpha!r}.")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, float(alpha), scale


def _base_key(module: str, base_tensors: dict[str, Any]) -> str | None:
    """The key under which the base holds ``module``'s weight (older saves leave out the first prefix)."""
    for key in (f"{module}.weight", f"{module.split('.', 1)[-1]}.weight"):
        if key in base_tensors:
            return key
    return None


def adapter_base(path: Path) -> Path:
    """The base model folder of the LoRA adapter folder ``path``; ConfigError when the adapter is not
    one shardwise merges or the base is not a local model folder."""
    config = _read_config(path)
    _check_options(path, config)
    return _base_path(path, config)


def read_adapter(path: Path, base_tensors: dict[str, Any]) -> LoraAdapter:
    """The checked LoRA adapter in folder ``path`` whose base holds ``base_tensors`` ({key: entry with
    ``.shape``}); ConfigError naming the file and what to do otherwise. Reads no tensor data."""
    config = _read_config(path)
    rank, alpha, scale = _check_options(path, config)
    base = _base_path(path, config)
    weights = confined_file(path, ADAPTER_WEIGHTS, "the adapter's weight file")
    if not weights.is_file():
        pickles = sorted(p.name for p in path.glob("adapter_model*.bin"))
        hint = (f" It holds {pickles[0]}, a PyTorch pickle, which shardwise does not load (unpickling can run code)."
                if pickles else "")
        raise ConfigError(f"{_where(path)} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}.{hint} Save the adapter "
                          "with peft's save_pretrained (safetensors is its default).")
    header = read_safetensors_header(weights)
    factors: dict[str, dict[str, str]] = {}
    for key, entry in header.items():
        m = _LORA_KEY.fullmatch(key)
        if m is None:
            raise ConfigError(
                f"{weights} holds {key!r}, which is not a LoRA A/B weight of a linear layer: shardwise merges plain "
                "LoRA only (no DoRA magnitudes, embedding adapters, trained biases, modules_to_save copies or "
                f"trainable tokens). {_MERGE_WITH_PEFT}")
        if entry["dtype"] not in FLOAT_DTYPES:
            raise ConfigError(f"{weights}: {key!r} is {entry['dtype']}, not floating point (a quantised adapter); "
                              "save the adapter in float16, bfloat16 or float32.")
        factors.setdefault(m["module"], {})[m["factor"]] = key
    if not factors:
        raise ConfigError(f"{weights} holds no LoRA weights; save the adapter again.")
    targets: dict[str, tuple[str, str]] = {}
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    for module, pair in sorted(factors.items()):
        if len(pair) != 2:
            raise ConfigError(f"{weights} holds lora_{next(iter(pair))} of {module!r} without its partner; the file "
                              "is incomplete. Save the adapter again.")
        a, b = header[pair["A"]]["shape"], header[pair["B"]]["shape"]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise ConfigError(f"{weights}: {module!r} has lora_A {list(a)} and lora_B {list(b)}, which are not "
                              f"(r, in) and (out, r) with r = {rank} from {ADAPTER_CONFIG}. Per-module ranks are "
                              f"not supported. {_MERGE_WITH_PEFT}")
        key = _base_key(module, base_tensors)
        if key is None:
            raise ConfigError(f"{_where(path)} adapts {module!r}, but its base {str(base)!r} holds no "
                              f"{module}.weight: the adapter was trained on another model. Point "
                              "base_model_name_or_path at the model it was trained on.")
        update = (b[0], a[1]) if not fan_in_fan_out else (a[1], b[0])
        have = tuple(base_tensors[key].shape)
        if have != update:
            raise ConfigError(f"{_where(path)}: the update B @ A of {module!r} is {list(update)}, but the base "
                              f"weight {key} is {list(have)}: the adapter was trained on another model. Point "
                              "base_model_name_or_path at the model it was trained on.")
        targets[key] = (pair["A"], pair["B"])
    return LoraAdapter(path, base, rank, alpha, scale, fan_in_fan_out, targets)


def model_folders(pretrained: str | Path) -> list[Path]:
    """The folders ``model.pretrained`` stands for, the one it names first: [adapter, base] for an
    adapter folder, else [the folder]; ConfigError for an adapter folder whose base is not found.
    Files beside the weights (tokenizer) are looked up in this order: PEFT saves none with an adapter."""
    path = Path(pretrained).expanduser()
    return [path, adapter_base(path)] if is_adapter_folder(path) else [path]


def tokenizer_home(pretrained: str) -> str:
    """The folder of model.pretrained's own tokenizer: the folder itself, or the base of an adapter
    folder that carries none."""
    own, *base = model_folders(pretrained)
    if base and not any((own / name).is_file() for name in _TOKENIZER_MARKERS):
        return str(base[0])
    return pretrained


# ---------------------------------------------------------------------------------------------
# Merging into a loaded (possibly sharded) model.


def merge_adapter(adapter: LoraAdapter, landings: list[tuple[torch.Tensor, str, int]]) -> None:
    """Add ``scale * B @ A`` to each loaded tensor the adapter changes, on this rank's shard only.

    ``landings``: (the model tensor, the base file key it holds, the column of the file tensor
    where it starts -- non-zero for a slice such as GPT-2's q/k/v parts of ``c_attn``). Only the
    rows and columns of the update this rank holds are computed, in float32 on the tensor's device.
    """
    import torch  # defers torch

    from shardwise.runtime.meta_init import local_region  # defers torch

    with safe_open(str(adapter.path / ADAPTER_WEIGHTS), framework="pt") as f, torch.no_grad():
        for dest, key, column in landings:
            local, region = local_region(dest)
            rows, cols = region
            cols = slice(cols.start + column, cols.stop + column)
            a_key, b_key = adapter.targets[key]
            a = f.get_tensor(a_key).to(local.device, torch.float32)  # (r, in)
            b = f.get_tensor(b_key).to(local.device, torch.float32)  # (out, r)
            # A fan_in_fan_out weight is (in, out): its update is (B @ A) transposed.
            update = (b[cols] @ a[:, rows]).T if adapter.fan_in_fan_out else b[rows] @ a[:, cols]
            local.add_((adapter.scale * update).to(local.dtype))
