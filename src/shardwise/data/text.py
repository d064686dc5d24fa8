"""Your own text: a text or JSONL file, or a folder of them, tokenised once into a cached token file.

Documents: a plain text file (``.txt``, ``.text``, ``.md`` or any other suffix when named
directly) is one document; each line of a ``.jsonl``/``.ndjson`` file is one, its text under
``data.text_field`` (default ``"text"``). A folder contributes its text and JSONL files, recursively,
in sorted path order (hidden files skipped). Each document is tokenised without special tokens and
followed by the tokenizer's EOS token; the ids are written one after the other into a flat token
file in the cache (``data.cache_dir``), which ``data.tokens`` then memory-maps and packs into
sequences exactly like a pre-tokenised ``.bin``.

Large plain text files are tokenised in pieces of about 1 MiB cut after a newline that starts a
non-blank line (the way Hugging Face's own text loader works line by line), so memory stays bounded.

The cache entry is keyed by every source file's path, size and modification time, the tokenizer's
files and the libraries' versions: a second run reads it without tokenising; changing any of
those re-tokenises. Not the sequence length: packing is a view of the flat ids, so another
``block_size`` reuses the same entry.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.core.config import DataConfig
from shardwise.data.cache import build_root, cache_key, cache_root, exclusive, file_identity, where_built
from shardwise.data.records import kind_hint
from shardwise.data.tokenizer import NEEDS_TOKENIZER, TextTokenizer, load_tokenizer, tokenizer_fingerprint
from shardwise.data.tokens import LMData, TokenFile, pack
from shardwise.errors import ConfigError
from shardwise.fsutil import atomic_write_json, fsync_dir, what_is

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
CACHE_FORMAT = 1
_PIECE_BYTES = 1 << 20  # plain text is tokenised in pieces of about this size
_BATCH_CHARS = 4 << 20  # characters handed to the tokenizer per call


def find_text_files(path: Path, key: str) -> list[Path]:
    """The text/JSONL files ``key`` (``data.path``/``data.val_path``) names; ConfigError if none."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"{key} {str(path)!r} {what_is(path)}; point it at a text or JSONL file, or a "
                          "folder of them.")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    files = [f for f in files if f.stat().st_size > 0]  # an empty file in a folder adds nothing
    if not files:
        raise ConfigError(f"{key} folder {str(path)!r} holds no non-empty text or JSONL files (suffixes "
                          f"{', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)}).")
    return files


def _decode(data: bytes, file: Path, offset: int = 0, line: int | None = None) -> str:
    """``data`` (from byte ``offset``, or line ``line``) as UTF-8; ConfigError for binary or non-UTF-8."""

    def where(i: int) -> str:
        return f"line {line}" if line is not None else f"byte {offset + i}"

    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{str(file)!r} looks like a binary file (a NUL byte at {where(nul)}), not text. "
                          "data.kind = 'text' reads UTF-8 text or JSONL; for token ids use data.kind = 'tokens'.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{str(file)!r} is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at "
                          f"{where(e.start)}); convert it, e.g. `iconv -f latin1 -t utf-8`.") from None


def _cut_point(data: bytes) -> int:
    """Index just after the last newline that is followed by a non-blank byte (0: none)."""
    end = len(data) - 1
    while True:
        i = data.rfind(b"\n", 0, end)
        if i < 0:
            return 0
        if data[i + 1] not in b" \t\r\n":
            return i + 1
        end = i


def _text_pieces(file: Path) -> Iterator[str]:
    """A plain text file in pieces of about ``_PIECE_BYTES``, cut after a newline before non-blank text."""
    with open(file, "rb") as f:
        pending, offset = b"", 0
        while True:
            block = f.read(_PIECE_BYTES)
            data = pending + block
            if offset == 0 and data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is not text
                data, offset = data[3:], 3
            if not block:
                if data:
                    yield _decode(data, file, offset)
                return
            cut = _cut_point(data)
            if cut == 0:  # no cut point yet: keep reading (a single very long line)
                pending = data
                continue
            yield _decode(data[:cut], file, offset)
            pending, offset = data[cut:], offset + cut


def _jsonl_documents(file: Path, text_field: str) -> Iterator[str]:
    with open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, file, line=number).strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{str(file)!r} line {number} is not valid JSON ({e.msg} at column "
                                  f"{e.colno}); each line of a JSONL file must be one JSON object.") from None
            except RecursionError:
                raise ConfigError(f"{str(file)!r} line {number} is nested too deeply to read; each line of a "
                                  "JSONL file must be one JSON object with a text field.") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{str(file)!r} line {number} holds a JSON {type(record).__name__}, not an "
                                  f"object with a {text_field!r} field.")
            if text_field not in record:
                keys = ", ".join(sorted(map(str, record))[:10]) or "none"
                raise ConfigError(f"{str(file)!r} line {number} has no {text_field!r} field (its fields: "
                                  f"{keys}); set data.text_field to the field holding the text.{kind_hint(record)}")
            text = record[text_field]
            if not isinstance(text, str):
                raise ConfigError(f"{str(file)!r} line {number}: field {text_field!r} is a "
                                  f"{type(text).__name__}, not a string.")
            if text:
                yield text


def iter_pieces(files: list[Path], text_field: str) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) for every piece of every document of ``files``, in order."""
    for file in files:
        if file.stat().st_size == 0:
            raise ConfigError(f"data file {str(file)!r} is empty.")
        if file.suffix.lower() == ".json":
            with open(file, "rb") as f:
                head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
            if head != b"{":
                raise ConfigError(
                    f"{str(file)!r} is a JSON file (not one JSON object per line): data.kind = 'text' would train "
                    "on its JSON syntax. Write the documents as JSONL (one {\"text\": ...} object per line), or "
                    "use data.kind = 'instruct' (prompt/response records) or 'chat' (messages records), which "
                    "read JSON arrays.")
        if file.suffix.lower() in JSONL_SUFFIXES + (".json",):
            for doc in _jsonl_documents(file, text_field):
                yield doc, True
        else:
            previous = None
            for piece in _text_pieces(file):
                if previous is not None:
                    yield previous, False
                previous = piece
            if previous is not None:
                yield previous, True


def tokenize_files(files: list[Path], tokenizer: TextTokenizer, text_field: str, out: Any) -> dict[str, int]:
    """Write the token ids of ``files`` (each document followed by EOS) to the binary file ``out``."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    count = documents = 0
    max_id = tokenizer.eos_id
    batch: list[tuple[str, bool]] = []
    chars = 0

    def flush() -> None:
        nonlocal count, documents, max_id, batch, chars
        if not batch:
            return
        ids: list[int] = []
        for piece_ids, (_, ends) in zip(tokenizer.encode_batch([t for t, _ in batch]), batch):
            ids.extend(piece_ids)
            if ends:
                ids.append(tokenizer.eos_id)
                documents += 1
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size:
            max_id = max(max_id, int(arr.max()))
            arr.astype(dtype).tofile(out)
        count += arr.size
        batch, chars = [], 0

    for text, ends in iter_pieces(files, text_field):
        batch.append((text, ends))
        chars += len(text)
        if chars >= _BATCH_CHARS or len(batch) >= 1024:
            flush()
    flush()
    return {"tokens": count, "documents": documents, "max_id": max_id, "dtype": np.dtype(dtype).name}


def _cached_tokens(files: list[Path], dc: DataConfig, what: str) -> tuple[TokenFile, dict[str, Any], bool]:
    """The token file of ``files`` from the cache, built first if absent; (tokens, meta, was_cached)."""
    if not dc.tokenizer:
        raise ConfigError(NEEDS_TOKENIZER)
    tok_path = Path(dc.tokenizer).expanduser()
    root = cache_root(dc.cache_dir)
    key = cache_key({
        "format": CACHE_FORMAT, "files": [file_identity(f) for f in files],
        "tokenizer": tokenizer_fingerprint(tok_path),
        # Only JSONL documents depend on the field name.
        "text_field": dc.text_field if any(f.suffix.lower() in JSONL_SUFFIXES for f in files) else None,
    })
    bin_path, meta_path = root / f"text-{key}.bin", root / f"text-{key}.json"
    with exclusive(root / f"text-{key}.lock"):
        cached = _read_entry(bin_path, meta_path)
        if cached is None:
            # A dry run builds the entry in its scratch folder: the cache is left as it was.
            real_root, root = root, build_root(root)
            bin_path, meta_path = root / bin_path.name, root / meta_path.name
            tokenizer = load_tokenizer(dc.tokenizer)
            size_mb = sum(f.stat().st_size for f in files) / 1e6
            # Once per corpus (the ranks then find the entry), and possibly long: say what is going on.
            print(f"shardwise: tokenising {what} ({len(files)} file(s), {size_mb:.1f} MB) with "
                  f"{str(tok_path)!r} {where_built(real_root)}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            tmp = bin_path.with_name(f"{bin_path.name}.tmp-{os.getpid()}")
            try:
                with open(tmp, "wb") as out:
                    meta = tokenize_files(files, tokenizer, dc.text_field, out)
                    out.flush()
                    os.fsync(out.fileno())
                meta.update(vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id,
                            tokenizer=str(tok_path.resolve()), files=[str(f) for f in files],
                            tokenize_s=round(time.perf_counter() - t0, 3))
                if meta["tokens"] == 0:
                    raise ConfigError(f"{what} holds no text to train on (every document is empty).")
                # The metadata first, the token file last: a published .bin always has its metadata.
                atomic_write_json(meta_path, meta, durable=True)
                os.replace(tmp, bin_path)
                fsync_dir(root)
            finally:
                tmp.unlink(missing_ok=True)
            cached = _read_entry(bin_path, meta_path)
            assert cached is not None
            return cached[0], cached[1], False
    return cached[0], cached[1], True


def _read_entry(bin_path: Path, meta_path: Path) -> tuple[TokenFile, dict[str, Any]] | None:
    """A complete cache entry (token file + matching metadata), or None."""
    if not (bin_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        itemsize = np.dtype(meta["dtype"]).itemsize
        if bin_path.stat().st_size != meta["tokens"] * itemsize:
            return None  # not the file this metadata describes: rebuild
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damaged metadata: rebuild the entry rather than trust it
    return TokenFile(bin_path, meta["dtype"], 0, meta["tokens"]), meta


class _LazyTokenizer:
    """Loads the tokenizer only when a text sample is decoded (a cache hit never needs it)."""

    def __init__(self, path: str, eos_id: int) -> None:
        self.path, self.eos_id = path, eos_id
        self._tok: TextTokenizer | None = None

    @property
    def sample_prompt(self) -> list[int]:
        return [self.eos_id]

    def encode(self, text: str) -> list[int]:
        return self._load().encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._load().decode(ids)

    def _load(self) -> TextTokenizer:
        if self._tok is None:
            self._tok = load_tokenizer(self.path)
        return self._tok


def load_text(dc: DataConfig, block_size: int) -> LMData:
    """Train/val sequences of the text corpus named by ``dc`` (``data.kind = 'text'``)."""
    if not dc.path:
        raise ConfigError("data.kind = 'text' needs data.path: a text or JSONL file, or a folder of them "
                          "(e.g. --set data.path=notes.txt).")
    notes = []
    train_files = find_text_files(Path(dc.path).expanduser(), "data.path")
    train, meta, hit = _cached_tokens(train_files, dc, f"data.path {dc.path!r}")
    notes.append(_describe("data.path", dc.path, train_files, meta, hit, train.path))
    val = None
    if dc.val_path:
        val_files = find_text_files(Path(dc.val_path).expanduser(), "data.val_path")
        val, val_meta, val_hit = _cached_tokens(val_files, dc, f"data.val_path {dc.val_path!r}")
        notes.append(_describe("data.val_path", dc.val_path, val_files, val_meta, val_hit, val.path))
        meta = {**meta, "max_id": max(meta["max_id"], val_meta["max_id"])}
    train_set, val_set = pack(train, val, dc.val_fraction, block_size, f"data.path {dc.path!r}")
    notes.append(f"data: {len(train_set):,} training and {len(val_set):,} validation sequences of "
                 f"{block_size + 1} tokens; vocabulary {meta['vocab_size']:,} (EOS id {meta['eos_id']})")
    return LMData(train=train_set, val=val_set, max_token_id=int(meta["max_id"]),
                  vocab_size=int(meta["vocab_size"]), tokenizer=_LazyTokenizer(dc.tokenizer, int(meta["eos_id"])),
                  notes=notes)


def _describe(key: str, path: str, files: list[Path], meta: dict[str, Any], hit: bool, cache: Path) -> str:
    how = f"cache hit, {cache}" if hit else f"tokenised in {meta['tokenize_s']:.2f}s, cached in {cache}"
    return (f"data: {key} {path!r}: {len(files)} file(s), {meta['documents']:,} documents, "
            f"{meta['tokens']:,} tokens ({how})")
