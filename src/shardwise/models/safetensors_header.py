"""Safetensors headers, checked without reading any tensor data (torch-free).

A model folder's weight files and a PEFT adapter's ``adapter_model.safetensors`` come from wherever
the user got them: ``read_safetensors_header`` parses the header, bounds it, and checks that every
tensor's bytes lie inside the file with the size its dtype and shape imply, so a truncated
download or a file that is not safetensors is one ConfigError naming the file, before any rank
starts (``models.pretrained``, ``models.adapter``).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

__all__ = ["FLOAT_DTYPES", "read_safetensors_header"]

# safetensors dtype codes shardwise loads (floating point only: quantised weights are refused).
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_ITEM_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4,
               "U32": 4, "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit



def read_safetensors_header(file: Path) -> dict[str, Any]:
    """Return the tensor entries of a safetensors file's header; ConfigError if it is not one or is cut short.

    Checks, without reading any tensor data, that the header parses and that every tensor's bytes
    lie inside the file with the size its dtype and shape imply (a truncated download fails here).
    """
    if not file.is_file():
        raise ConfigError(f"{file} is not a regular file; weight files must be regular safetensors files.")
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{file} is not a safetensors file: too short for a header (a truncated "
                                  "download or an empty file). Download or copy it again.")
            (n,) = struct.unpack("<Q", head)
            # Never quote the number: for a file that is not safetensors it is 8 bytes of its text.
            if n < 2 or n > min(_MAX_HEADER_BYTES, size - 8):
                raise ConfigError(f"{file} is not a valid safetensors file: its header length is out of range "
                                  "for the file (truncated, or not a safetensors file). Download or copy it again.")
            raw = f.read(n)
    except OSError as e:
        raise ConfigError(f"cannot read {file}: {e.strerror or e}.") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ConfigError(f"{file} has a damaged safetensors header (not JSON, or nested too deeply); "
                          "download or copy it again.") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{file} has a damaged safetensors header; download or copy it again.")
    data_bytes = size - 8 - n
    out: dict[str, Any] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(entry)
        if problem:
            raise ConfigError(f"{file}: the header entry of tensor {name[:200]!r} {problem}; the file is damaged "
                              "or not a safetensors file. Download or copy it again.")
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if end > data_bytes:
            raise ConfigError(
                f"{file} is truncated: tensor {name!r} ends at byte {end} of the data, but the file holds "
                f"only {data_bytes} bytes of data. Download or copy the file again.")
        item = _ITEM_BYTES.get(dtype)
        if item is not None and end - begin != math.prod(shape) * item:
            raise ConfigError(f"{file}: tensor {name!r} has {end - begin} bytes for shape {list(shape)} of "
                              f"{dtype}; the file is damaged. Download or copy it again.")
        spans.append((begin, end, name))
        out[name] = {"dtype": dtype, "shape": shape}
    spans.sort()
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise ConfigError(f"{file}: the data of tensors {prev!r} and {name!r} overlap; the file is damaged. "
                              "Download or copy it again.")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one safetensors header entry (types, shape, offsets), None when it is sound."""
    if not isinstance(entry, dict):
        return "is not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not dtype:
        return "has no dtype string"
    if not isinstance(shape, list) or len(shape) > 64 or not all(_is_int(d) and d >= 0 for d in shape):
        return "has a shape that is not a list of non-negative integers"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        return "has data_offsets that are not two integers"
    begin, end = offsets
    if not 0 <= begin <= end:
        return "has negative or reversed data_offsets"
    return None
