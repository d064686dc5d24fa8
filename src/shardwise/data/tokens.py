"""Pre-tokenised data: flat token arrays on disk, memory-mapped and packed into training sequences.

The nanoGPT convention: a ``.bin`` file is the raw token ids of a whole corpus, one after the other
(uint16, or uint32 for vocabularies over 65,536: ``data.token_dtype``); a folder holds ``train.bin``
and optionally ``val.bin``. A ``.npy`` file is a 1-D integer array and carries its own dtype. Both are
memory-mapped, never read whole: each process opens the file itself (a pickled dataset holds the
path, not the data), so DataLoader workers and ranks share the page cache.

``PackedSequences`` cuts a token range into sequences of ``block_size + 1`` tokens that overlap by
one: item ``i`` is ``(x, y)`` with ``x = tokens[i*B : i*B + B]`` and ``y`` the same shifted by one,
so every token is a target exactly once per epoch (the Shakespeare workload's (x, y) shape, which
the built-in trainer and every strategy take unchanged). The tail shorter than a sequence is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from shardwise.core.config import TOKEN_DTYPES, DataConfig
from shardwise.data.cache import build_root, cache_key, cache_root, file_identity
from shardwise.errors import ConfigError
from shardwise.fsutil import atomic_write_json

__all__ = ["TOKEN_DTYPES", "LMData", "PackedSequences", "TokenFile", "load_tokens", "open_token_file", "pack"]

TOKEN_SUFFIXES = (".bin", ".npy")
_SCAN_CHUNK = 1 << 24  # tokens per step of the min/max scan (64 MiB of uint32)


class TokenFile:
    """``count`` token ids of ``dtype`` at byte ``offset`` of ``path``, memory-mapped on first use."""

    def __init__(self, path: Path, dtype: str, offset: int, count: int) -> None:
        self.path, self.dtype, self.offset, self.count = Path(path), dtype, offset, count
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r",
                                    offset=self.offset, shape=(self.count,))
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into DataLoader workers (and spawned processes): the path, never the mapped data.
        return {**self.__dict__, "_array": None}

    def ids(self, start: int, stop: int) -> torch.Tensor:
        """Token ids ``[start, stop)`` as an int64 tensor."""
        return torch.from_numpy(np.asarray(self.array[start:stop], dtype=np.int64))


def open_token_file(path: Path, token_dtype: str, what: str) -> TokenFile:
    """Open a ``.bin``/``.npy`` token file after checking it; ConfigError naming ``what`` otherwise."""
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist.")
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"{what} {str(path)!r} is empty.")
    if path.suffix == ".bin":
        itemsize = np.dtype(token_dtype).itemsize
        if size % itemsize:
            raise ConfigError(
                f"{what} {str(path)!r} has {size} bytes, not a whole number of {token_dtype} tokens "
                f"({itemsize} bytes each); is data.token_dtype right? (nanoGPT's .bin files are uint16)"
            )
        return TokenFile(path, token_dtype, 0, size // itemsize)
    if path.suffix == ".npy":
        return _open_npy(path, what)
    raise ConfigError(f"{what} {str(path)!r} is not a token file: use a .bin file (flat {token_dtype} "
                      "token ids, the nanoGPT convention) or a 1-D integer .npy array.")


def _open_npy(path: Path, what: str) -> TokenFile:
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise ConfigError(f"{what} {str(path)!r} is not a .npy file (it lacks the NumPy header); "
                              "write it with np.save, or use a flat .bin file.")
    # allow_pickle=False: an object array (which would unpickle, i.e. run code) is refused.
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ConfigError(f"{what} {str(path)!r} is not a readable .npy array ({e}).") from None
    dtype, shape = arr.dtype, arr.shape
    offset = getattr(arr, "offset", None)
    del arr
    if dtype.kind not in "ui":
        raise ConfigError(f"{what} {str(path)!r} holds {dtype} values; token ids must be an integer "
                          "array (uint16, uint32, int32 or int64). Convert it with arr.astype(np.uint32).")
    if len(shape) != 1:
        raise ConfigError(f"{what} {str(path)!r} has shape {tuple(shape)}; token files are one flat "
                          "1-D stream of ids (np.save(path, arr.reshape(-1)) flattens a 2-D one).")
    if shape[0] == 0 or offset is None:
        raise ConfigError(f"{what} {str(path)!r} holds no tokens.")
    return TokenFile(path, dtype.str, int(offset), int(shape[0]))


def id_range(tokens: TokenFile, cache_dir: str) -> tuple[int, int]:
    """(smallest, largest) token id of ``tokens``, scanned once and remembered in the cache."""
    root = cache_root(cache_dir)
    key = cache_key({"kind": "id-range", "file": file_identity(tokens.path), "dtype": tokens.dtype,
                     "offset": tokens.offset, "count": tokens.count})
    stats = root / f"id-range-{key}.json"
    if stats.is_file():
        data = json.loads(stats.read_text(encoding="utf-8"))
        return int(data["min"]), int(data["max"])
    low, high = None, None
    arr = tokens.array
    for start in range(0, tokens.count, _SCAN_CHUNK):
        chunk = arr[start:start + _SCAN_CHUNK]
        lo, hi = int(chunk.min()), int(chunk.max())
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    assert low is not None and high is not None
    # A dry run remembers it in its scratch folder (removed at its end): the cache stays as it was.
    atomic_write_json(build_root(root) / stats.name, {"min": low, "max": high, "file": str(tokens.path)})
    return low, high


class PackedSequences(Dataset):
    """Sequences of ``block_size + 1`` tokens of ``tokens[start:stop]``, overlapping by one; item = (x, y)."""

    def __init__(self, tokens: TokenFile, start: int, stop: int, block_size: int) -> None:
        self.tokens, self.start, self.block_size = tokens, start, block_size
        self.n = max(0, (stop - start - 1) // block_size)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        begin = self.start + i * self.block_size
        chunk = self.tokens.ids(begin, begin + self.block_size + 1)
        return chunk[:-1], chunk[1:]


@dataclass
class LMData:
    """Train and validation sequences of a language-model corpus, and what the model must match."""

    train: Dataset
    val: Dataset
    max_token_id: int
    vocab_size: int | None = None  # the tokenizer's, when known (the text kind)
    tokenizer: Any = None  # for text samples: encode/decode (the text kind)
    notes: list[str] = field(default_factory=list)


def pack(train: TokenFile, val: TokenFile | None, val_fraction: float, block_size: int,
         what: str) -> tuple[PackedSequences, PackedSequences]:
    """Train and validation sequences: ``val`` whole, or else the last ``val_fraction`` of ``train``."""
    need = block_size + 1
    if val is None:
        cut = int(train.count * (1 - val_fraction))
        train_set = PackedSequences(train, 0, cut, block_size)
        val_set = PackedSequences(train, cut, train.count, block_size)
        if train.count < need:
            raise ConfigError(f"{what} has {train.count} tokens, fewer than one training sequence of "
                              f"{need} (block_size {block_size} + 1); use more data or a smaller block_size.")
        if len(val_set) == 0 or len(train_set) == 0:
            part, size = ("validation", train.count - cut) if len(val_set) == 0 else ("training", cut)
            raise ConfigError(
                f"{what} has {train.count} tokens; data.val_fraction = {val_fraction} leaves {size} for "
                f"{part}, fewer than one sequence of {need} tokens (block_size {block_size} + 1). Change "
                "data.val_fraction, give a separate validation set with data.val_path, use more data, "
                "or a smaller block_size."
            )
        return train_set, val_set
    for tokens, part in ((train, "training"), (val, "validation")):
        if tokens.count < need:
            raise ConfigError(f"the {part} data {str(tokens.path)!r} has {tokens.count} tokens, fewer "
                              f"than one sequence of {need} (block_size {block_size} + 1).")
    return PackedSequences(train, 0, train.count, block_size), PackedSequences(val, 0, val.count, block_size)


def _resolve_token_paths(dc: DataConfig) -> tuple[Path, Path | None]:
    if not dc.path:
        raise ConfigError("data.kind = 'tokens' needs data.path: a .bin/.npy token file, or a folder "
                          "holding train.bin (and val.bin), as nanoGPT's prepare scripts write them.")
    path = Path(dc.path).expanduser()
    val = Path(dc.val_path).expanduser() if dc.val_path else None
    if path.is_dir():
        found = [path / f"{split}{suffix}" for split in ("train",) for suffix in TOKEN_SUFFIXES
                 if (path / f"{split}{suffix}").is_file()]
        if len(found) != 1:
            raise ConfigError(
                f"data.path {str(path)!r} is a folder, so it must hold exactly one of train.bin or "
                f"train.npy (found {len(found) or 'neither'}); or point data.path at the token file itself."
            )
        if val is None:
            vals = [path / f"val{suffix}" for suffix in TOKEN_SUFFIXES if (path / f"val{suffix}").is_file()]
            if len(vals) > 1:
                raise ConfigError(f"data.path {str(path)!r} holds both val.bin and val.npy; keep one, "
                                  "or name it with data.val_path.")
            val = vals[0] if vals else None
        path = found[0]
    elif not path.exists():
        raise ConfigError(f"data.path {str(path)!r} does not exist.")
    return path, val


def load_tokens(dc: DataConfig, block_size: int) -> LMData:
    """Train/val sequences of the pre-tokenised corpus named by ``dc`` (``data.kind = 'tokens'``)."""
    train_path, val_path = _resolve_token_paths(dc)
    train = open_token_file(train_path, dc.token_dtype, "data.path")
    val = open_token_file(val_path, dc.token_dtype, "data.val_path") if val_path else None
    low, high = id_range(train, dc.cache_dir)
    if val is not None:
        vlow, vhigh = id_range(val, dc.cache_dir)
        low, high = min(low, vlow), max(high, vhigh)
    if low < 0:
        raise ConfigError(f"the token data {str(train_path)!r} holds a negative id ({low}); token ids "
                          "are non-negative integers.")
    train_set, val_set = pack(train, val, dc.val_fraction, block_size, f"data.path {str(train_path)!r}")
    notes = [f"data: {train.count:,} training tokens from {train_path}"
             + (f", {val.count:,} validation tokens from {val.path}" if val is not None else
                f" (the last {dc.val_fraction:g} for validation)")
             + f"; {len(train_set):,} training sequences of {block_size + 1} tokens; largest id {high}"]
    return LMData(train=train_set, val=val_set, max_token_id=high, notes=notes)
