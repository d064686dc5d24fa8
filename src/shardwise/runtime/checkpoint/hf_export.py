"""Export a checkpoint back to Hugging Face: a model folder, or a PEFT adapter folder.

``export_hf`` writes what ``save_pretrained`` writes -- ``config.json``, sharded
``model-0000i-of-0000N.safetensors`` with the original Hugging Face tensor names (no ``hf.``
prefix) and ``model.safetensors.index.json`` -- from a checkpoint of any strategy and rank count,
so that ``AutoModelForCausalLM.from_pretrained(DIR)`` gives the model shardwise trained. Shards are
read from the checkpoint one output file at a time (DCP loads just those tensors), so memory stays
at about one output shard. A LoRA checkpoint holds only adapters: ``merge=True`` loads the base from
its ``model.pretrained`` folder, puts the adapters in with peft and merges them
(``merge_and_unload``), which needs the whole model in host memory once.

``export_peft`` writes PEFT's adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
that ``PeftModel.from_pretrained(base, DIR)`` loads. A run whose ``model.pretrained`` was itself a
LoRA adapter folder (merged into its base as it loaded, ``models.adapter``) exports with
``--format hf`` (``--merge`` for new adapters: the base is read and merged the same way again);
``--format peft`` is refused there, as the new adapters' base would be a model no folder holds.

Every export is written into a hidden sibling folder and renamed into place when complete: a
crashed or interrupted export never leaves a folder that looks like a finished one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardwise.errors import CheckpointError
from shardwise.fsutil import default_file_mode
from shardwise.models.gpt2_qkv import PARTS
from shardwise.models.hf import _build_config, _no_init_weights, _transformers
from shardwise.models.lora import lora_config_from_dict, peft_adapter_name
from shardwise.models.pretrained import inspect_pretrained, load_pretrained, tensor_groups
from shardwise.runtime.checkpoint.engines import engine_for
from shardwise.runtime.checkpoint.export import _model_entries
from shardwise.runtime.checkpoint.locate import resolve_checkpoint
from shardwise.runtime.checkpoint.manifest import DCP_METADATA, corruption_error, engine_of, read_manifest, verify_files
from shardwise.runtime.checkpoint.safe_read import SafeFileSystemReader, SafeLoadPlanner, read_dcp_metadata
from shardwise.runtime.checkpoint.state import single_process_ok

__all__ = ["DEFAULT_MAX_SHARD", "EXPORT_DTYPES", "export_hf", "export_peft", "parse_size"]

DEFAULT_MAX_SHARD = "5GB"  # save_pretrained's default
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files of a model folder, other than weights and config, that a user loads beside the model.
_COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def parse_size(text: str) -> int:
    """Bytes of a size such as "5GB", "500MB", "2GiB" or "1000000" (transformers' convention: GB = 10^9)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise CheckpointError(f"--max-shard-size {text!r} is not a size; use e.g. 5GB, 500MB or 2GiB.")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    size = int(value * scale)
    if size < 1:
        raise CheckpointError(f"--max-shard-size must be positive, got {text!r}.")
    return size


# ---------------------------------------------------------------------------------------------
# Reading the checkpoint


class _Checkpoint:
    """A verified checkpoint, read by name without a process group."""

    def __init__(self, source: str | os.PathLike) -> None:
        self.path = resolve_checkpoint(source)
        self.manifest = read_manifest(self.path)
        problems = verify_files(self.path, self.manifest)
        if problems:
            raise corruption_error(self.path, problems)
        self._engine_state: dict[str, torch.Tensor] | None = None
        engine = engine_for(engine_of(self.manifest))
        if engine is not None:
            # e.g. DeepSpeed's ZeRO shards, consolidated by its zero_to_fp32 (files verified just above).
            self._engine_state, self.tensors = engine.engine_entries(self.path, self.manifest)
            return
        # Shapes checked against the manifest before anything is allocated (a forged .metadata
        # cannot make an export allocate more than the checkpoint's files hold).
        self.tensors: dict[str, TensorStorageMetadata] = _model_entries(
            self.path, self.manifest, read_dcp_metadata(self.path, self.manifest))

    @property
    def export(self) -> dict[str, Any]:
        info = self.manifest.get("export")
        if not info or info.get("format") != "hf":
            raise CheckpointError(
                f"checkpoint {self.path} was not trained from a Hugging Face model (model.kind = 'hf'), so it "
                "has no Hugging Face config or names to export to. Use --format safetensors.")
        # The manifest is checksummed but may come from someone else: its export fields are data
        # with fixed types, never trusted to be well formed.
        kinds = {"prefix": (str,), "config": (dict,), "lora": (dict, type(None)), "pretrained": (str, type(None)),
                 "pretrained_base": (str, type(None))}
        bad = [k for k, types in kinds.items() if not isinstance(info.get(k), types)]
        if bad or not isinstance(info["config"].get("model_type"), str):
            raise CheckpointError(
                f"checkpoint {self.path} has a malformed 'export' entry in its manifest "
                f"({', '.join(bad) or 'config.model_type'} missing or of the wrong type); it was not written by "
                "shardwise's trainer. Use --format safetensors.")
        return info

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full (consolidated) tensors ``names`` of the model, read from every rank's shards."""
        if self._engine_state is not None:
            return {n: self._engine_state[n] for n in names}
        model = {n: torch.empty(self.tensors[n].size, dtype=self.tensors[n].properties.dtype) for n in names}
        reader = SafeFileSystemReader(self.path, self.manifest["files"][DCP_METADATA]["sha256"])
        payload = {"model": model}
        with single_process_ok():
            dcp.load(payload, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        return payload["model"]


# ---------------------------------------------------------------------------------------------
# Writing a folder atomically


def _publish(out: Path, write: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Run ``write(tmp_dir)`` and rename the folder to ``out`` once it is complete."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} already exists and is not an empty folder; pick a new folder "
                              "(an export never overwrites files).")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        result = write(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); rename() cannot replace it on every platform
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**result, "out": str(out)}


def _shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into files of at most ``max_bytes`` (a bigger tensor gets its own)."""
    out: list[list[str]] = []
    current: list[str] = []
    total = 0
    for name, size in sizes.items():
        if current and total + size > max_bytes:
            out.append(current)
            current, total = [], 0
        current.append(name)
        total += size
    if current:
        out.append(current)
    return out


def _write_model_files(folder: Path, names: list[str], sizes: dict[str, int], read: Callable[[list[str]], dict],
                       max_bytes: int, metadata: dict[str, str]) -> dict[str, Any]:
    groups = _shards(sizes, max_bytes)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = read(group)
        save_file({n: tensors[n].contiguous() for n in group}, str(folder / file), metadata=metadata)
        default_file_mode(folder / file)  # safetensors writes 0600
        weight_map.update(dict.fromkeys(group, file))
        del tensors
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": {n: weight_map[n] for n in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return {"files": len(groups), "tensors": len(names), "bytes": sum(sizes.values())}


def _copy_companions(info: dict[str, Any], folder: Path) -> list[str]:
    """Copy the tokenizer and generation config of the pretrained folder, when it is still there
    (a LoRA adapter folder's own files first, then its base's)."""
    sources = [Path(p) for p in (info.get("pretrained"), info.get("pretrained_base")) if p and Path(p).is_dir()]
    copied = []
    for name in _COMPANION_FILES:
        source = next((s / name for s in sources if (s / name).is_file()), None)
        if source is not None:
            shutil.copy2(source, folder / name)
            copied.append(name)
    return copied


def _hf_skeleton(config: dict[str, Any]) -> Any:
    """The transformers model of ``config`` on the meta device (names, shapes and tying only)."""
    transformers = _transformers()
    cfg = transformers.AutoConfig.for_model(config["model_type"],
                                            **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _config_json(info: dict[str, Any], dtype: torch.dtype) -> str:
    config = dict(info["config"])
    config["dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------------------------
# The exports


def export_hf(source: str | os.PathLike, out: str | os.PathLike, *, merge: bool = False,
              max_shard_size: str = DEFAULT_MAX_SHARD, dtype: str | None = None,
              base: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write a checkpoint's model as a Hugging Face folder ``out``; return what was written.

    ``merge``: a LoRA checkpoint's adapters merged into its pretrained base (needed for LoRA
    checkpoints, refused for others). ``dtype``: float32, bfloat16 or float16 (default: as trained).
    ``base``: the pretrained folder (merge weights, tokenizer files to copy); default: the one the
    run trained from, as its manifest records it.
    """
    ck = _Checkpoint(source)
    info = _with_base(ck.export, base)
    max_bytes = parse_size(max_shard_size)
    lora = bool(ck.manifest.get("frozen_excluded"))
    if lora and not merge:
        raise CheckpointError(
            f"checkpoint {ck.path} holds only LoRA adapters (the frozen base is in {info.get('pretrained')}). "
            "Export the adapter with --format peft, or merged full weights with --format hf --merge.")
    if merge and not lora:
        raise CheckpointError(f"--merge merges LoRA adapters into their base, but checkpoint {ck.path} trained "
                              "every weight (no adapters); drop --merge.")
    out_dtype = _dtype(dtype)
    if merge:
        state = _merged_state(ck, info)
        read = lambda group: {n: state[n] for n in group}  # noqa: E731
        trained = {n: t.dtype for n, t in state.items()}
    else:
        skeleton = _hf_skeleton(info["config"])
        prefix = info.get("prefix", "hf.")
        names = [group[0] for group in tensor_groups(skeleton)]
        # A tensor trained as slices (GPT-2's c_attn as c_attn.q/k/v under TP) is written fused again.
        split = {n: parts for n in names if prefix + n not in ck.tensors
                 and (parts := _split_parts(prefix + n, ck.tensors)) is not None}
        absent = [n for n in names if prefix + n not in ck.tensors and n not in split]
        if absent:
            raise CheckpointError(
                f"checkpoint {ck.path} lacks {len(absent)} tensor(s) of its Hugging Face config, e.g. "
                f"{', '.join(absent[:3])}: it was saved by another model. Export it with --format safetensors.")
        state = {}
        trained = {n: ck.tensors[split[n][0] if n in split else prefix + n].properties.dtype for n in names}

        def read(group: list[str]) -> dict[str, torch.Tensor]:
            whole = ck.read([prefix + n for n in group if n not in split])
            out = {n[len(prefix):]: t for n, t in whole.items()}
            for n in group:
                if n in split:
                    pieces = ck.read(split[n])
                    out[n] = torch.cat([pieces[p] for p in split[n]], dim=-1)
            return out

    names = list(trained)
    final_dtype = out_dtype or next(iter(trained.values()))
    converted = (lambda group: {n: t.to(final_dtype) for n, t in read(group).items()})  # noqa: E731
    if not merge:
        state.update({n: torch.empty(sum(ck.tensors[p].size.numel() for p in parts), device="meta")
                      for n, parts in split.items()})
    sizes = {n: _numel(ck, info, n, state) * torch.empty((), dtype=final_dtype).element_size() for n in names}

    def write(folder: Path) -> dict[str, Any]:
        (folder / "config.json").write_text(_config_json(info, final_dtype), encoding="utf-8")
        written = _write_model_files(folder, names, sizes, converted, max_bytes,
                                     {"format": "pt", "step": str(ck.manifest["step"]), "source": "shardwise"})
        return {**written, "companions": _copy_companions(info, folder), "step": ck.manifest["step"],
                "dtype": str(final_dtype).removeprefix("torch."), "merged": merge}

    return _publish(Path(out), write)


def _split_parts(name: str, tensors: dict[str, Any]) -> list[str] | None:
    """The checkpoint names of ``name``'s q/k/v slices (``parallel/tensor/gpt2.py``), or None."""
    stem, _, leaf = name.rpartition(".")
    parts = [f"{stem}.{part}.{leaf}" for part in PARTS]
    return parts if all(p in tensors for p in parts) else None


def _with_base(info: dict[str, Any], base: str | os.PathLike | None) -> dict[str, Any]:
    """The export info with the pretrained folder replaced by ``base`` (checked), when given."""
    if base is None:
        return info
    folder = inspect_pretrained(str(base))
    return {**info, "pretrained": str(folder.source.resolve()),
            "pretrained_base": str(folder.path.resolve()) if folder.adapter is not None else None}


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in EXPORT_DTYPES:
        raise CheckpointError(f"--dtype {name!r} is not one of {', '.join(EXPORT_DTYPES)}.")
    return EXPORT_DTYPES[name]


def _numel(ck: _Checkpoint, info: dict[str, Any], name: str, state: dict[str, torch.Tensor]) -> int:
    if name in state:
        return state[name].numel()
    return ck.tensors[info.get("prefix", "hf.") + name].size.numel()


def _adapter_state(ck: _Checkpoint) -> dict[str, torch.Tensor]:
    """The LoRA adapter tensors under the names PEFT's save_pretrained writes."""
    names = [n for n in ck.tensors if peft_adapter_name(n) is not None]
    if not names:
        raise CheckpointError(f"checkpoint {ck.path} holds no LoRA adapter tensors.")
    return {peft_adapter_name(n): t for n, t in ck.read(names).items()}  # type: ignore[misc]


def _merged_state(ck: _Checkpoint, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The base model with the adapters merged in (peft's merge_and_unload), as a state dict."""
    from peft import get_peft_model  # defers peft (optional)
    from peft.utils import set_peft_model_state_dict  # defers peft (optional)

    base = info.get("pretrained")
    if not base or not Path(base).is_dir():
        raise CheckpointError(f"merging needs the pretrained base the adapters were trained on, {base!r}, which "
                              "is not there any more. Restore that folder, or export the adapter alone with "
                              "--format peft.")
    transformers = _transformers()
    folder = inspect_pretrained(base)
    config, _ = _build_config(transformers, str(folder.path), {})
    with _no_init_weights(transformers)():
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    hf.tie_weights()
    with single_process_ok():
        load_pretrained(hf, folder)
    peft_model = get_peft_model(hf, lora_config_from_dict(info["lora"]))
    result = set_peft_model_state_dict(peft_model, _adapter_state(ck))
    if result.unexpected_keys:
        raise CheckpointError(f"the adapters of {ck.path} do not fit the base in {base}: unexpected "
                              f"{', '.join(result.unexpected_keys[:3])}.")
    merged = peft_model.merge_and_unload()
    params = dict(merged.named_parameters(remove_duplicate=False))
    params.update(merged.named_buffers())
    return {group[0]: params[group[0]].detach() for group in tensor_groups(merged)}


def export_peft(source: str | os.PathLike, out: str | os.PathLike,
                base: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write a LoRA checkpoint's adapters as a PEFT folder (``PeftModel.from_pretrained`` loads it).

    ``base`` is written as the adapter's ``base_model_name_or_path`` (default: the folder the run
    trained from).
    """
    ck = _Checkpoint(source)
    info = _with_base(ck.export, base)
    if not info.get("lora"):
        raise CheckpointError(f"checkpoint {ck.path} has no LoRA adapters ([lora] rank = 0 when it was trained); "
                              "export the whole model with --format hf.")
    if info.get("pretrained_base"):
        # PEFT folders name one base model; this run's base is another adapter merged into its base.
        raise CheckpointError(
            f"checkpoint {ck.path} trained LoRA adapters on the LoRA adapter {info['pretrained']} merged into "
            f"{info['pretrained_base']}; a PEFT folder of them would name a base that does not hold those merged "
            "weights. Export the whole model with --format hf --merge, or write the merged starting model once "
            "(PeftModel.from_pretrained(base, ADAPTER).merge_and_unload().save_pretrained(DIR)) and pass it "
            "as --base DIR.")
    adapters = _adapter_state(ck)
    config = lora_config_from_dict(info["lora"])
    config.base_model_name_or_path = info.get("pretrained")

    def write(folder: Path) -> dict[str, Any]:
        config.save_pretrained(str(folder))
        save_file({k: v.contiguous() for k, v in adapters.items()}, str(folder / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        default_file_mode(folder / "adapter_model.safetensors")  # safetensors writes 0600
        return {"files": 2, "tensors": len(adapters), "step": ck.manifest["step"],
                "bytes": sum(t.numel() * t.element_size() for t in adapters.values())}

    return _publish(Path(out), write)
