"""Reading instruction/chat records from the files users have: JSONL, JSON arrays, CSV, Parquet and
Hugging Face ``datasets`` folders written by ``save_to_disk``.

Each record comes back as ``(where, record)``: ``where`` names its file and line (or array item,
or row) for messages, ``record`` is the dict. Nothing here knows about tokenizers or templates.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.fsutil import what_is

RECORD_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")
HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

Record = tuple[str, dict[str, Any]]
# The fields an instruct record's prompt and response may sit in (the first present is used).
PROMPT_FIELDS = ("prompt", "instruction", "question")
RESPONSE_FIELDS = ("response", "completion", "output", "answer")
# A tiny chat dataset shipped in the package (64 short records: capitals, sums, synonyms, ...), for
# the README's instruction-tuning example and the tests; in a clone it is src/shardwise/data/samples/.
SAMPLE_CHAT = Path(__file__).resolve().parent / "samples" / "chat.jsonl"


def is_hf_disk(path: Path) -> bool:
    """True for a folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and any((path / m).is_file() for m in HF_DISK_MARKERS)


def record_files(path: Path, key: str) -> list[Path]:
    """The record files ``key`` names (a file, or a folder's record files in sorted order)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"{key} {str(path)!r} {what_is(path)}; point it at a JSONL/JSON/CSV/Parquet file of "
                          "records, a folder of them, or a Hugging Face datasets folder (save_to_disk).")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in RECORD_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts)
                   and p.stat().st_size > 0)
    if not files:
        raise ConfigError(f"{key} folder {str(path)!r} holds no non-empty record files (suffixes "
                          f"{', '.join(RECORD_SUFFIXES)}) and is not a datasets folder written by save_to_disk.")
    return files


def _decode_line(raw: bytes, file: Path, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{str(file)!r} line {number} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at "
                          f"column {e.start + 1}); convert the file, e.g. `iconv -f latin1 -t utf-8`.") from None


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} holds a JSON {type(value).__name__}, not an object (a record with fields).")
    return value


def _jsonl(file: Path) -> Iterator[Record]:
    with open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode_line(raw, file, number).strip()
            if number == 1:
                line = line.removeprefix("\ufeff")
            if not line:
                continue
            if number == 1 and line.startswith("[") and not line.endswith("]"):
                raise ConfigError(f"{str(file)!r} starts a JSON array on line 1, but a {file.suffix} file holds one "
                                  "JSON object per line; name it .json (an array of records) or write one "
                                  "record per line.")
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{str(file)!r} line {number} is not valid JSON ({e.msg} at column {e.colno}); "
                                  "each line of a JSONL file must be one JSON object.") from None
            if isinstance(value, list):
                raise ConfigError(f"{str(file)!r} line {number} is a JSON array where one JSON object (a record) "
                                  "per line is expected; name the file .json if it is one array of records.")
            yield f"{str(file)!r} line {number}", _object(value, f"{str(file)!r} line {number}")


def _json(file: Path) -> Iterator[Record]:
    raw = file.read_bytes()
    head = raw.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if head != b"[":
        yield from _jsonl(file)  # JSON lines under a .json name
        return
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{str(file)!r} line {line} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x}); "
                          "convert the file, e.g. `iconv -f latin1 -t utf-8`.") from None
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{str(file)!r} line {e.lineno} is not valid JSON ({e.msg} at column {e.colno}); a "
                          ".json file holds one array of record objects (or one object per line).") from None
    for i, item in enumerate(items):
        where = f"{str(file)!r} item {i} of the array"
        yield where, _object(item, where)


def _csv(file: Path) -> Iterator[Record]:
    try:
        with open(file, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                yield f"{str(file)!r} line {reader.line_num}", dict(row)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{str(file)!r} is not UTF-8 text (invalid byte at byte {e.start}); convert it, e.g. "
                          "`iconv -f latin1 -t utf-8`.") from None


def _parquet(file: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"reading {str(file)!r} needs pyarrow: pip install 'shardwise[datasets]'.") from None
    for i, row in enumerate(pq.read_table(file).to_pylist()):
        yield f"{str(file)!r} row {i}", row


def _hf_disk(path: Path, split: str) -> Iterator[Record]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{str(path)!r} is a Hugging Face datasets folder; reading it needs the datasets "
                          "package: pip install 'shardwise[datasets]'.") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - any failure inside the library means "does not load"
        raise ConfigError(f"the datasets folder {str(path)!r} does not load: {type(e).__name__}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"the datasets folder {str(path)!r} has splits {', '.join(ds)}, no {split!r}.")
        ds = ds[split]
    for i, row in enumerate(ds):
        yield f"{str(path)!r} row {i}", dict(row)


def hf_disk_splits(path: Path) -> list[str]:
    """The split names of a DatasetDict folder ([] for a single Dataset)."""
    marker = path / "dataset_dict.json"
    if not marker.is_file():
        return []
    try:
        return list(json.loads(marker.read_text(encoding="utf-8")).get("splits", []))
    except (OSError, ValueError):
        return []


def read_records(path: Path, key: str, split: str = "train") -> list[Record]:
    """Every record that ``key`` (``data.path``/``data.val_path``) names, in order."""
    if is_hf_disk(path):
        return list(_hf_disk(path, split))
    out: list[Record] = []
    for file in record_files(path, key):
        suffix = file.suffix.lower()
        if suffix not in RECORD_SUFFIXES:
            raise ConfigError(f"{key} {str(file)!r}: records are read from {', '.join(RECORD_SUFFIXES)} files "
                              "or a datasets folder (save_to_disk), not from this file type.")
        reader = {".json": _json, ".csv": _csv, ".parquet": _parquet}.get(suffix, _jsonl)
        out.extend(reader(file))
    if not out:
        raise ConfigError(f"{key} {str(path)!r} holds no records.")
    return out


def record_kind(record: Any, messages_field: str = "messages") -> str | None:
    """The ``data.kind`` a record is written for: "preference" (a chosen and a rejected answer), "chat"
    (a list of turns), "instruct" (a prompt and a response field), or None (anything else, e.g. plain
    text)."""
    if not isinstance(record, dict):
        return None
    if "chosen" in record and "rejected" in record:
        return "preference"
    if isinstance(record.get(messages_field), list):
        return "chat"
    if any(f in record for f in PROMPT_FIELDS) and any(f in record for f in RESPONSE_FIELDS):
        return "instruct"
    return None


def kind_hint(record: Any) -> str:
    """' These are chat records: ...' for a record that the hf-sft recipe trains on, else ''."""
    kind = record_kind(record)
    if kind is None:
        return ""
    if kind == "preference":
        return (" These look like preference records (chosen / rejected answers): train them with the hf-dpo "
                "recipe (shardwise train hf-dpo --set model.pretrained=DIR --set data.path=FILE).")
    extra = "" if kind == "chat" else " --set data.kind=instruct"
    return (f" These look like {kind} records: train them with the hf-sft recipe (shardwise train hf-sft "
            f"--set model.pretrained=DIR --set data.path=FILE{extra}), which trains on the responses.")
