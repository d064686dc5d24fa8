"""Pretrained Hugging Face folders: checked before any rank starts, then read shard by shard.

A folder as ``save_pretrained`` writes it: ``config.json`` plus either one ``model.safetensors`` or
several ``model-0000i-of-0000N.safetensors`` named by ``model.safetensors.index.json``.
``inspect_pretrained`` reads only the JSON and each file's safetensors header (a few KiB, torch-free):
it finds a folder without weights, an index naming absent files or keys, truncated files,
dtypes that contradict ``config.json`` and, with ``check_model_tensors``, names and shapes that do
not match the model built from the config -- each as one ConfigError naming the file and what to
do. The pre-launch check runs it, so bad input never starts a rank.

``load_pretrained`` then fills a model that the strategy has already sharded (FSDP2, DTensor TP) or
kept whole (ddp): PyTorch DCP's ``HuggingFaceStorageReader`` plans which slice of which tensor each
rank needs from the parameters' own placements, and reads only those bytes with safetensors'
``get_slice``, so no rank ever reads or holds the whole model. We use DCP rather than our own
``get_slice`` arithmetic because its planner already knows every DTensor placement, FSDP2's
strided TP+FSDP shards included, and is the same code that reshards shardwise checkpoints.

``model.pretrained`` may also name a PEFT LoRA adapter folder: ``inspect_pretrained`` then checks
its base folder as above and the adapter against it, and ``load_pretrained`` merges the adapter into
the base weights as they load (``models.adapter``).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from shardwise.core.run_files import CHECKPOINTS_DIR
from shardwise.errors import ConfigError
from shardwise.models.adapter import LoraAdapter, adapter_base, is_adapter_folder, merge_adapter, read_adapter
from shardwise.models.confine import confined_file
from shardwise.models.hf_config import hf_family
from shardwise.models.names import CHECKPOINT_PREFIX
from shardwise.models.safetensors_header import FLOAT_DTYPES, read_safetensors_header

if TYPE_CHECKING:
    from torch import nn

__all__ = ["INDEX_FILE", "SINGLE_FILE", "PretrainedFolder", "TensorEntry", "check_adapter_targets",
           "check_model_tensors", "hf_name", "inspect_pretrained", "load_pretrained", "tensor_groups", "tie_sources"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a pretrained folder: the file holding it, its dtype code and shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PretrainedFolder:
    """What ``inspect_pretrained`` found: the config, the weight files and every tensor's entry."""

    path: Path
    config: dict[str, Any]
    files: tuple[str, ...]
    tensors: dict[str, TensorEntry] = field(repr=False)
    index: bool  # sharded with model.safetensors.index.json
    total_bytes: int
    # model.pretrained named a LoRA adapter folder on this one: merged into the weights as they load.
    adapter: LoraAdapter | None = None

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def source(self) -> Path:
        """The folder model.pretrained names: the adapter's, or this model folder."""
        return self.adapter.path if self.adapter is not None else self.path


def _where(path: Path) -> str:
    return f"model.pretrained {str(path)!r}"


def _read_json(file: Path, what: str) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {what} {str(file)!r} as JSON ({e}).") from None


def _config_dtype(config: dict[str, Any]) -> str | None:
    value = config.get("dtype", config.get("torch_dtype"))
    return value.removeprefix("torch.") if isinstance(value, str) else None


def _run_directory_hint(path: Path) -> str | None:
    """What to do when ``path`` is a shardwise run directory or checkpoint (an SFT run, say) rather than
    a model folder: export it first, with the command."""
    # Deferred: the checkpoint layout's names live with the checkpoint engine (a layer above models).
    from shardwise.runtime.checkpoint.manifest import MANIFEST  # defers torch

    checkpoint = (path / MANIFEST).is_file()
    if not (checkpoint or (path / CHECKPOINTS_DIR).is_dir()):
        return None
    what = "a shardwise checkpoint" if checkpoint else "a shardwise run directory"
    out = (path.parent if checkpoint else path) / "hf"
    return (f"{_where(path)} is {what}, not a model folder: export it as a Hugging Face folder first, "
            f"`shardwise ckpt export {path} --format hf --out {out}` (add --merge for a LoRA run: its adapters "
            f"folded into the base; or --format peft for the adapter folder, which model.pretrained takes "
            f"too), then --set model.pretrained={out}.")


def inspect_pretrained(folder: str | Path) -> PretrainedFolder:
    """Return the checked contents of a pretrained folder; ConfigError with one clear paragraph otherwise."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        what = "a file" if path.exists() else "missing"
        raise ConfigError(f"{_where(path)} must be a folder as save_pretrained writes it (config.json + "
                          f"*.safetensors, or a PEFT adapter's adapter_config.json); the path is {what}.")
    if is_adapter_folder(path):
        return _inspect_adapter(path)
    if not (path / "config.json").is_file():
        if (hint := _run_directory_hint(path)) is not None:
            raise ConfigError(hint)
        raise ConfigError(f"{_where(path)} has no config.json: it is neither a Hugging Face model folder "
                          "(save_pretrained writes config.json next to the weights) nor a PEFT adapter folder "
                          "(adapter_config.json).")
    config = _read_json(path / "config.json", "the model config")
    if not isinstance(config, dict):
        raise ConfigError(f"{path / 'config.json'} holds JSON that is not an object.")
    hf_family(path)  # the architecture must be one shardwise supports
    index_file = path / INDEX_FILE
    if index_file.is_file():
        index = _read_json(index_file, "the index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index_file} has no weight_map; the folder is damaged. Save the model again.")
        # Every name is confined to the folder before any file is opened (models.confine).
        for name, file in weight_map.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{index_file}: the weight_map key {name!r} is not a tensor name (a string).")
            confined_file(path, file, f"the index {INDEX_FILE}")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (path / f).is_file()]
        if absent:
            raise ConfigError(
                f"{index_file} names {len(absent)} weight file(s) that are not in the folder: "
                f"{', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''}. The download or copy is "
                "incomplete; fetch the missing shards.")
        headers = {f: read_safetensors_header(path / f) for f in files}
        tensors: dict[str, TensorEntry] = {}
        for name, file in weight_map.items():
            entry = headers[file].get(name)
            if entry is None:
                raise ConfigError(f"{index_file} says {name!r} is in {file}, but that file does not hold it: "
                                  "the index and the shards come from different saves. Save the model again.")
            tensors[name] = TensorEntry(file, entry["dtype"], entry["shape"])
    elif (path / SINGLE_FILE).is_file() or (path / SINGLE_FILE).is_symlink():
        confined_file(path, SINGLE_FILE, "the folder's single weight file")
        files = [SINGLE_FILE]
        tensors = {name: TensorEntry(SINGLE_FILE, e["dtype"], e["shape"])
                   for name, e in read_safetensors_header(path / SINGLE_FILE).items()}
    else:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
        if pickles:
            raise ConfigError(
                f"{_where(path)} holds only PyTorch pickle weights ({', '.join(pickles[:3])}), which shardwise "
                "does not load: unpickling can run code. Convert them once with transformers: "
                "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder) writes model.safetensors.")
        others = sorted(p.name for p in path.glob("*.safetensors"))
        hint = (f" It has {', '.join(others[:3])} but no {INDEX_FILE} naming them." if others else "")
        raise ConfigError(f"{_where(path)} has no weights: neither {SINGLE_FILE} nor {INDEX_FILE}.{hint} "
                          "Point it at a folder written by save_pretrained.")
    if not tensors:
        raise ConfigError(f"{_where(path)}: the weight files hold no tensors.")
    _check_dtypes(path, config, tensors)
    total = sum((path / f).stat().st_size for f in files)
    return PretrainedFolder(path, config, tuple(files), tensors, index_file.is_file(), total)


def _inspect_adapter(path: Path) -> PretrainedFolder:
    """The adapter's base folder, checked, with the adapter to merge into it (``models.adapter``)."""
    base_path = adapter_base(path)
    try:
        base = inspect_pretrained(base_path)
    except ConfigError as e:
        raise ConfigError(f"{_where(path)} is a LoRA adapter on {str(base_path)!r}, which does not load: {e}") from None
    return dataclasses.replace(base, adapter=read_adapter(path, base.tensors))


def _check_dtypes(path: Path, config: dict[str, Any], tensors: dict[str, TensorEntry]) -> None:
    bad = {n: e.dtype for n, e in tensors.items() if e.dtype not in FLOAT_DTYPES}
    if bad:
        name, dtype = next(iter(bad.items()))
        raise ConfigError(
            f"{_where(path)} holds {len(bad)} non-floating-point tensor(s), e.g. {name!r} in {dtype}: "
            "quantised weights are not supported. Use the model's float16/bfloat16/float32 release.")
    declared = _config_dtype(config)
    if declared in FLOAT_DTYPES.values():
        off = {n: FLOAT_DTYPES[e.dtype] for n, e in tensors.items() if FLOAT_DTYPES[e.dtype] != declared}
        if off:
            name, dtype = next(iter(off.items()))
            raise ConfigError(
                f"{_where(path)}: config.json says the weights are {declared}, but {len(off)} tensor(s) are "
                f"not, e.g. {name!r} is {dtype} in {tensors[name].file}. The folder mixes files of different "
                "saves, or config.json is wrong; fix its 'dtype' (or 'torch_dtype') or save the model again.")


# ---------------------------------------------------------------------------------------------
# Names: the model's tensors as Hugging Face names them (what the files hold).

LORA_WRAPPED = ".base_layer"  # peft keeps the module it wraps under this name


def hf_name(name: str) -> str:
    """The Hugging Face name of a registered tensor name (peft's ``.base_layer`` and activation
    checkpointing's wrapper prefix removed: a meta-built model is filled after the strategy wrapped
    its layers)."""
    return name.replace(LORA_WRAPPED, "").replace(CHECKPOINT_PREFIX, "")


def tensor_groups(hf: nn.Module) -> list[list[str]]:
    """Registered names of each parameter and persistent buffer of ``hf``, tied names grouped.

    LoRA adapters are left out (they are not in the pretrained files); within a group the first
    name is the one ``named_parameters`` keeps, the others alias the same tensor (tied weights).
    """
    groups: dict[int, list[str]] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        if ".lora_" not in name:
            groups.setdefault(id(p), []).append(name)
    persistent = set(hf.state_dict().keys())
    for name, b in hf.named_buffers(remove_duplicate=False):
        if name in persistent:
            groups.setdefault(id(b), []).append(name)
    return list(groups.values())


def tie_sources(hf: nn.Module) -> dict[str, str]:
    """{name: name of the tensor it is tied to} as transformers declares the model's ties, when the
    config ties them (``tie_word_embeddings``); ``save_pretrained`` writes only the target.

    A pipeline's last stage holds the head without the embedding (``parallel/pipeline/ties.py``), so the
    head's alias is not among its registered names: this says where the files keep it.
    """
    if not getattr(getattr(hf, "config", None), "tie_word_embeddings", False):
        return {}
    keys = getattr(hf, "_tied_weights_keys", None)
    return dict(keys) if isinstance(keys, dict) else {}


def file_key(aliases: list[str], tensors: dict[str, Any], base_prefix: str) -> str | None:
    """The key under which the files hold a tensor registered as ``aliases``, or None.

    Older saves leave out the base model's prefix (``h.0.attn...`` for ``transformer.h.0.attn...``);
    transformers accepts both, and so do we.
    """
    for candidate in map(hf_name, aliases):
        if candidate in tensors:
            return candidate
        if base_prefix and candidate.startswith(base_prefix + ".") and candidate[len(base_prefix) + 1:] in tensors:
            return candidate[len(base_prefix) + 1:]
    return None


_EXPERTS = "<experts>:"  # mapping value of a fused expert tensor read from per-expert keys
_PART = "<part>:"  # mapping value "<part>:START:LENGTH:KEY" of a slice (last dim) of a file tensor


def _moe_key(aliases: list[str], shape: tuple[int, ...], tensors: dict[str, Any], base_prefix: str) -> str | None:
    """A Hugging Face MoE tensor under its original name: Mixtral's ``block_sparse_moe`` router, or
    fused experts (``experts.gate_up_proj``) stored per expert (``models/hf_moe.py``)."""
    from shardwise.models.hf_moe import expert_sources, legacy_key  # defers torch

    for name in map(hf_name, aliases):
        old = legacy_key(name)
        if old is not None and (key := file_key([old], tensors, base_prefix)) is not None:
            return key
        sources = expert_sources(name, shape, tensors)
        if sources is not None:
            _check_expert_shapes(name, shape, sources, tensors)
            return _EXPERTS + name
    return None


def _check_expert_shapes(name: str, shape: tuple[int, ...], sources: list[list[str]], tensors: dict[str, Any]) -> None:
    for keys in sources:
        parts = [tuple(tensors[k].shape) for k in keys]
        rows = sum(p[0] for p in parts)
        if any(len(p) != 2 for p in parts) or (rows, *parts[0][1:]) != tuple(shape[1:]):
            raise ConfigError(
                f"the pretrained expert tensors {', '.join(keys)} have shapes {[list(p) for p in parts]}, which do "
                f"not make one expert of {name} {list(shape[1:])}. model.overrides must not change the "
                "architecture of a pretrained model (expert sizes, number of experts).")


def check_model_tensors(folder: PretrainedFolder, hf: nn.Module) -> dict[str, str]:
    """Return {registered tensor name of ``hf``: file key}; ConfigError on any mismatch.

    ``hf`` may be a meta-device model, sharded or not. Every parameter and persistent buffer must
    be in the files with the model's shape (tied aliases map to the one key the files hold);
    tensors the files hold beyond those are ignored, as transformers does.
    """
    base_prefix = getattr(hf, "base_model_prefix", "")
    tensors = dict(hf.named_parameters(remove_duplicate=False))
    tensors.update(hf.named_buffers(remove_duplicate=False))
    mapping: dict[str, str] = {}
    missing, wrong = [], []
    from shardwise.models.gpt2_qkv import fused_sources  # defers torch

    parts = fused_sources(hf)
    tied = tie_sources(hf)
    for group in tensor_groups(hf):
        key = file_key(group + [tied[n] for n in group if n in tied], folder.tensors, base_prefix)
        if key is None and group[0] in parts:
            # A slice of a fused tensor the files hold whole (GPT-2's c_attn split for TP); always
            # the base Conv1D's, cut along its last dim (a LoRA B's parts are not in the files).
            source, start, length, _ = parts[group[0]]
            key = file_key([source], folder.tensors, base_prefix)
            have = tuple(folder.tensors[key].shape) if key is not None else ()
            want = tuple(tensors[group[0]].shape)
            if key is not None and (have[:-1] != want[:-1] or have[-1] < start + length):
                wrong.append(f"{key} is {list(have)} in {folder.tensors[key].file}, the config builds a slice "
                             f"{list(want)} of it at {start}")
                continue
            if key is not None:
                mapping.update(dict.fromkeys(group, f"{_PART}{start}:{length}:{key}"))
                continue
        if key is None:
            key = _moe_key(group, tuple(tensors[group[0]].shape), folder.tensors, base_prefix)
        if key is None:
            missing.append(hf_name(group[0]))
            continue
        if key.startswith(_EXPERTS):
            mapping.update(dict.fromkeys(group, key))  # built from per-expert keys: shapes checked there
            continue
        want, have = tuple(tensors[group[0]].shape), tuple(folder.tensors[key].shape)
        if want != have:
            wrong.append(f"{key} is {list(have)} in {folder.tensors[key].file}, the config builds {list(want)}")
        mapping.update(dict.fromkeys(group, key))
    where = _where(folder.path)
    if missing:
        raise ConfigError(
            f"{where} lacks {len(missing)} tensor(s) the model built from its config.json needs, e.g. "
            f"{', '.join(missing[:4])}. The weights belong to another architecture or the save is incomplete; "
            "use the folder's own config.json (no model.overrides that change shapes).")
    if wrong:
        raise ConfigError(
            f"{where}: {len(wrong)} tensor(s) do not have the shape the config builds: {'; '.join(wrong[:3])}"
            f"{' ...' if len(wrong) > 3 else ''}. model.overrides must not change the architecture of a "
            "pretrained model (hidden size, layers, heads, vocab_size), and config.json must be the one saved "
            "with these weights.")
    return mapping


def check_adapter_targets(folder: PretrainedFolder, hf: nn.Module) -> None:
    """ConfigError unless every weight the folder's LoRA adapter changes is a tensor of ``hf``, the
    whole model as built (a pipeline stage later holds only some of them)."""
    if folder.adapter is None:
        return
    landed = {key for key, _ in _adapter_landings(folder.adapter, check_model_tensors(folder, hf)).values()}
    stray = sorted(set(folder.adapter.targets) - landed)
    if stray:
        # Per-expert weights of an MoE family, which transformers holds fused (models/hf_moe.py).
        raise ConfigError(
            f"{_where(folder.source)} adapts {len(stray)} weight(s) that the model shardwise builds does not hold "
            f"as such, e.g. {', '.join(stray[:3])} (MoE experts are fused). Merge the adapter with peft and set "
            "model.pretrained to the merged folder.")


def _adapter_landings(adapter: LoraAdapter, mapping: dict[str, str]) -> dict[str, tuple[str, int]]:
    """{registered name: (adapter target key, its first column in the file tensor)} of every tensor
    the adapter changes: a whole target, or a slice of one (``_PART``); fused experts never are."""
    out = {}
    for name, value in mapping.items():
        key, column = value, 0
        if value.startswith(_PART):
            start, _, key = value[len(_PART):].split(":", 2)
            column = int(start)
        if key in adapter.targets:
            out[name] = (key, column)
    return out


# ---------------------------------------------------------------------------------------------
# Loading into a (sharded) model.


def load_pretrained(hf: nn.Module, folder: PretrainedFolder) -> None:
    """Fill ``hf``'s pretrained tensors from the folder, each rank reading only its own shards.

    ``hf`` is the Hugging Face module inside the model the strategy prepared (FSDP2, TP or plain
    modules, a pipeline rank's stages; not yet wrapped in DDP), its tensors already allocated.
    Collective when a process group exists: DCP plans the reads of all ranks together. A LoRA
    adapter folder's update is then added to the weights it targets, each rank to its own shards.
    """
    import torch  # defers torch
    import torch.distributed as dist  # defers torch
    import torch.distributed.checkpoint as dcp  # defers torch

    mapping = check_model_tensors(folder, hf)
    tensors = dict(hf.named_parameters(remove_duplicate=False))
    tensors.update(hf.named_buffers(remove_duplicate=False))
    state: dict[str, torch.Tensor] = {}
    for name, key in mapping.items():
        if key.startswith(_EXPERTS):
            # Fused experts stored per expert: each rank reads the experts it holds (models/hf_moe.py).
            from shardwise.models.hf_moe import expert_sources, load_fused_experts  # defers torch

            sources = expert_sources(hf_name(name), tuple(tensors[name].shape), folder.tensors)
            assert sources is not None, name  # checked by check_model_tensors
            load_fused_experts(tensors[name].detach(), sources, folder)
            continue
        if key.startswith(_PART):
            _load_part(tensors[name].detach(), key, folder)
            continue
        # One destination per key: tied aliases share it. detach() keeps the storage (a DTensor's
        # local shard), so DCP writes straight into the parameter.
        state.setdefault(key, tensors[name].detach())
    distributed = dist.is_available() and dist.is_initialized()
    with torch.no_grad(), warnings.catch_warnings():
        # One process without a process group is intended here; DCP would warn that it "assumes" so.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=_make_reader(folder), no_dist=not distributed)
    if folder.adapter is not None:
        # Added to the loaded base values (a GPT-2 q/k/v slice filled by _load_part included); tied
        # aliases share one tensor, which gets the update once.
        landings = {(key, column): tensors[name].detach()
                    for name, (key, column) in _adapter_landings(folder.adapter, mapping).items()}
        merge_adapter(folder.adapter, [(dest, key, column) for (key, column), dest in landings.items()])


def _load_part(dest: Any, value: str, folder: PretrainedFolder) -> None:
    """Fill ``dest`` (plain or DTensor) with its slice ``value`` (``_PART``) of a tensor in the files.

    Reads the part's columns of the fused tensor only (each rank then keeps its own shard of them):
    for GPT-2's q/k/v that is a third of ``c_attn`` per part, per layer, held briefly.
    """
    import torch  # defers torch

    from shardwise.runtime.meta_init import _copy_into  # defers torch

    start, length, key = value[len(_PART):].split(":", 2)
    begin, end = int(start), int(start) + int(length)
    with safe_open(str(folder.path / folder.tensors[key].file), framework="pt") as f:
        piece = f.get_slice(key)
        rank = len(piece.get_shape())
        part = piece[tuple([slice(None)] * (rank - 1) + [slice(begin, end)])]
    with torch.no_grad():
        _copy_into(dest, part.to(dtype=dest.dtype, device=dest.device))


def _make_reader(folder: PretrainedFolder) -> Any:
    import torch  # defers torch
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # defers torch
    from torch.distributed.checkpoint._hf_utils import _HFStorageInfo  # defers torch
    from torch.distributed.checkpoint.metadata import (  # defers torch
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    class FolderReader(HuggingFaceStorageReader):
        """DCP's Hugging Face reader, limited to the files and keys the checked index names.

        The stock reader lists every ``*.safetensors`` in the folder; a folder may also hold other
        files (an adapter, a consolidated copy with other names), so the metadata is built from the
        already verified index instead.
        """

        def read_metadata(self) -> Metadata:
            sd_meta: dict[str, TensorStorageMetadata] = {}
            storage: dict[MetadataIndex, Any] = {}
            for name, entry in folder.tensors.items():
                dtype = getattr(torch, FLOAT_DTYPES[entry.dtype])
                size = torch.Size(entry.shape)
                zeros = torch.Size([0] * len(entry.shape))
                sd_meta[name] = TensorStorageMetadata(TensorProperties(dtype=dtype), size,
                                                      [ChunkStorageMetadata(offsets=zeros, sizes=size)])
                storage[MetadataIndex(fqn=name, offset=zeros)] = _HFStorageInfo(
                    relative_path=str(folder.path / entry.file), shape=size, dtype=dtype)
            meta = Metadata(state_dict_metadata=sd_meta, storage_data=storage)  # type: ignore[arg-type]
            meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return FolderReader(str(folder.path))
