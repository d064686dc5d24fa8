"""Instruction tuning data: prompt/response and chat records -> token ids with response-only labels.

``data.kind = "instruct"``: records with a prompt and a response (field names configurable; by
default the first present of prompt/instruction/question and of response/completion/output/answer),
an optional ``system`` and ``input``. ``data.kind = "chat"``: records with ``messages``, a list of
``{"role": "system"|"user"|"assistant"|"tool", "content": str}`` turns, and an optional ``system``.

Rendering. Chat records go through the tokenizer's own chat template (``apply_chat_template``), or
a Jinja file named by ``data.chat_template``. Instruct records go through the same template as one
user turn and one assistant turn when the tokenizer has one, else (or with ``chat_template =
"none"``) they are the plain concatenation ``prompt + response + EOS``.

Labels (``-100`` = not trained). By default only the assistant/response tokens are trained
(``data.train_on_prompt = false``). Plain records: prompt and response are tokenised separately and
joined, so the boundary is exact (after the tokenizer's BOS where it adds one). Templated records:
a template with ``{% generation %}`` blocks marks its assistant tokens itself; otherwise each
assistant turn's character span (its content, what the template adds after the generation prompt,
and its end-of-turn marker) is found from renderings of the record (``data.template_spans``), and a
token is trained when it overlaps a span (offsets from the fast tokenizer). A template that renders
no such span for a turn is an error naming the record and the turn.

Records longer than the sequence (``block_size + 1`` tokens, since targets are the inputs shifted
by one): ``data.truncation = "right"`` keeps the first tokens (the prompt is never lost; a record
whose response is cut away entirely is dropped), ``"drop"`` leaves it out, ``"error"`` refuses.
Counts are reported at start.

The validation split is by record: ``data.val_path`` (a separate file/folder, or a datasets folder's
``validation``/``test`` split), else a seeded choice of ``data.val_fraction`` of the records.
Sequences: ``data.pack = true`` puts several records in a row (``data.packing``), else one record
per row, right-padded; see ``InstructSequences`` for the batch layout.

The tokenised records are cached (``data.cache_dir``) under a key of the record files, the
tokenizer's files, the template and every setting above, built by the first process (the launcher's
check, or rank 0 of a job) while the others wait and read it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardwise.core.config import DataConfig
from shardwise.data.cache import build_root, cache_key, cache_root, exclusive, file_identity, where_built
from shardwise.data.records import (
    PROMPT_FIELDS,
    RESPONSE_FIELDS,
    Record,
    hf_disk_splits,
    is_hf_disk,
    read_records,
    record_files,
)
from shardwise.data.template_spans import assistant_spans, has_generation_markers, trained_tokens
from shardwise.data.tokenizer import EOS_CANDIDATES, tokenizer_fingerprint
from shardwise.errors import ConfigError
from shardwise.fsutil import atomic_write_json, fsync_dir, what_is

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
CACHE_FORMAT = 2  # 2: template spans by sentinel rendering, {% generation %} markers, BOS of plain records
_VAL_SEED = 1234  # the record split's own seed: independent of train.seed, so changing it keeps the split


@dataclasses.dataclass
class Encoded:
    """Token ids and labels (same length; ``-100`` where not trained) of every kept record."""

    ids: list[np.ndarray]
    labels: list[np.ndarray]
    records: int = 0  # records read
    truncated: int = 0  # records cut on the right
    dropped: int = 0  # records left out (too long, or nothing left to train)
    tokens_lost: int = 0  # tokens cut or dropped

    def describe(self, what: str) -> str:
        kept = len(self.ids)
        tokens = sum(len(i) for i in self.ids)
        trained = sum(int((lab != IGNORE_INDEX).sum()) for lab in self.labels)
        return (f"data: {what}: {self.records:,} records, {kept:,} kept ({self.truncated:,} truncated, "
                f"{self.dropped:,} dropped, {self.tokens_lost:,} tokens lost); {tokens:,} tokens, "
                f"{trained:,} trained")


# ------------------------------------------------------------------------------ tokenizer


def load_hf_tokenizer(path_str: str, chat_template: str = "") -> Any:
    """A transformers tokenizer (fast, with offsets) from a local folder or tokenizer.json."""
    if not path_str:
        raise ConfigError("data.kind = 'chat'/'instruct' needs data.tokenizer (a local tokenizer folder, e.g. the "
                          "pretrained model folder, or a tokenizer.json); with model.pretrained it defaults to it.")
    path = Path(path_str).expanduser()
    if not path.is_file() and not path.is_dir():
        raise ConfigError(f"data.tokenizer {str(path)!r} {what_is(path)}; point it at a local tokenizer folder "
                          "(what save_pretrained writes) or a tokenizer.json file.")
    try:
        import transformers
    except ImportError:
        raise ConfigError("chat/instruct data needs the transformers package: pip install 'shardwise[hf]'.") from None
    bare = path if path.is_file() else None
    if path.is_dir() and not (path / "tokenizer_config.json").is_file() and (path / "tokenizer.json").is_file():
        bare = path / "tokenizer.json"
    try:
        if bare is not None:
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bare))
        else:
            tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure inside the library means "does not load"
        raise ConfigError(f"data.tokenizer {str(path)!r} does not load: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}.") from None
    if not getattr(tok, "is_fast", False):
        raise ConfigError(f"data.tokenizer {str(path)!r} is a slow (Python) tokenizer; chat/instruct data needs a "
                          "fast one (a folder with tokenizer.json) for the character offsets of the labels.")
    if tok.eos_token_id is None:
        vocab = tok.get_vocab()
        eos = next((t for t in EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise ConfigError(f"data.tokenizer {str(path)!r} has no end-of-sequence token (no eos_token and none "
                              f"of {', '.join(EOS_CANDIDATES)}); save it with one.")
        tok.eos_token = eos
    if chat_template and chat_template != "none":
        file = Path(chat_template).expanduser()
        if not file.is_file():
            raise ConfigError(f"data.chat_template {chat_template!r} is not a file; name a Jinja chat template "
                              "file, or leave it empty to use the tokenizer's own.")
        tok.chat_template = file.read_text(encoding="utf-8")
    elif chat_template == "none":
        tok.chat_template = None
    return tok


def _template_fingerprint(dc: DataConfig) -> str:
    if dc.chat_template and dc.chat_template != "none" and Path(dc.chat_template).expanduser().is_file():
        return hashlib.sha256(Path(dc.chat_template).expanduser().read_bytes()).hexdigest()
    return dc.chat_template


# ------------------------------------------------------------------------------ one record


class RecordRenderer:
    """Turns one record into (ids, labels) for ``data.kind`` chat or instruct."""

    def __init__(self, tok: Any, dc: DataConfig) -> None:
        self.tok, self.dc = tok, dc
        self.kind = dc.kind
        self.has_template = bool(getattr(tok, "chat_template", None)) and dc.chat_template != "none"
        self.marked = self.has_template and has_generation_markers(tok.chat_template)
        if self.kind == "chat" and not self.has_template:
            raise ConfigError(
                f"data.kind = 'chat' renders messages with the tokenizer's chat template, but "
                f"{str(dc.tokenizer)!r} has none (no chat_template in tokenizer_config.json or "
                "chat_template.jinja). Name a Jinja template file with data.chat_template, or write the records "
                "as prompt/response pairs with data.kind = 'instruct'.")

    # --- fields
    def _field(self, record: dict[str, Any], where: str, names: tuple[str, ...], what: str) -> str:
        for name in names:
            if name in record and record[name] is not None:
                value = record[name]
                if not isinstance(value, str):
                    raise ConfigError(f"{where}: field {name!r} is a {type(value).__name__}, not a string.")
                return value
        fields = ", ".join(sorted(map(str, record))[:12]) or "none"
        raise ConfigError(f"{where} has no {what} field (looked for {', '.join(map(repr, names))}; its fields: "
                          f"{fields}). Set data.{what}_field to the field that holds it, or use data.kind = 'chat' "
                          "for records with a messages list.")

    def _optional(self, record: dict[str, Any], where: str, name: str) -> str:
        value = record.get(name)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{where}: field {name!r} is a {type(value).__name__}, not a string.")
        return value

    def messages(self, record: dict[str, Any], where: str) -> list[dict[str, str]]:
        """The record's turns, checked (chat), or its prompt/response as two turns (instruct)."""
        dc = self.dc
        system = self._optional(record, where, dc.system_field)
        if self.kind == "instruct":
            prompt = self._field(record, where, (dc.prompt_field,) if dc.prompt_field else PROMPT_FIELDS, "prompt")
            extra = self._optional(record, where, dc.input_field)
            response = self._field(record, where, (dc.response_field,) if dc.response_field else RESPONSE_FIELDS,
                                   "response")
            turns = [{"role": "user", "content": prompt + (f"\n\n{extra}" if extra else "")},
                     {"role": "assistant", "content": response}]
        else:
            raw = record.get(dc.messages_field)
            if raw is None:
                fields = ", ".join(sorted(map(str, record))[:12]) or "none"
                raise ConfigError(f"{where} has no {dc.messages_field!r} field (its fields: {fields}); a chat "
                                  "record holds a list of {role, content} turns (set data.messages_field), or use "
                                  "data.kind = 'instruct' for prompt/response records.")
            if not isinstance(raw, list) or not raw:
                got = "an empty list" if raw == [] else type(raw).__name__
                raise ConfigError(f"{where}: {dc.messages_field!r} must be a non-empty list of "
                                  f"{{role, content}} turns, got {got}.")
            turns = []
            for i, m in enumerate(raw):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                    raise ConfigError(f"{where}: turn {i} of {dc.messages_field!r} must be an object with 'role' "
                                      f"and 'content', got {json.dumps(m)[:80]}.")
                if m["role"] not in ROLES:
                    raise ConfigError(f"{where}: turn {i} has role {m['role']!r}; allowed roles: "
                                      f"{', '.join(ROLES)}.")
                if not isinstance(m["content"], str):
                    raise ConfigError(f"{where}: turn {i} ({m['role']}) has content of type "
                                      f"{type(m['content']).__name__}; it must be a string.")
                turns.append({"role": m["role"], "content": m["content"]})
            if not any(t["role"] == "assistant" for t in turns):
                raise ConfigError(f"{where} has no assistant turn: nothing to train on. Every chat record needs at "
                                  "least one turn with role 'assistant'.")
        if system and not (turns and turns[0]["role"] == "system"):
            turns = [{"role": "system", "content": system}, *turns]
        return turns

    # --- encoding
    def encode(self, record: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        turns = self.messages(record, where)
        if not self.has_template:
            return self._plain(turns)
        return self._templated(turns, where)

    def _plain(self, turns: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        prompt = "\n\n".join(t["content"] for t in turns[:-1] if t["content"])
        p_ids = self.tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        # The BOS a tokenizer adds itself (Llama, Mistral, Gemma): the model was trained after it.
        bos = self.tok.bos_token_id
        if bos is not None and self.tok("", add_special_tokens=True)["input_ids"][:1] == [bos]:
            p_ids = [bos, *p_ids]
        r_ids = self.tok(turns[-1]["content"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = np.asarray(p_ids + r_ids, dtype=np.int64)
        labels = ids.copy()
        if not self.dc.train_on_prompt:
            labels[:len(p_ids)] = IGNORE_INDEX
        return ids, labels

    def _render(self, turns: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    def assistant_spans(self, turns: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its assistant turns (``data.template_spans``)."""
        try:
            return assistant_spans(self._render, turns, where, self._token_ends)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a template raising (Jinja errors, raise_exception) is bad input
            raise ConfigError(f"{where}: the chat template fails on this record: {type(e).__name__}: {e}") from None

    def _token_ends(self, text: str) -> list[int]:
        return [e for _, e in self.tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]

    def _templated(self, turns: list[dict[str, str]], where: str) -> tuple[np.ndarray, np.ndarray]:
        if self.dc.train_on_prompt:
            enc = self.tok(self._render(turns, False), add_special_tokens=False)
            ids = np.asarray(enc["input_ids"], dtype=np.int64)
            return ids, ids.copy()
        if self.marked:
            return self._generation_marked(turns, where)
        full, spans = self.assistant_spans(turns, where)
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        labels = ids.copy()
        labels[~np.asarray(trained_tokens(enc["offset_mapping"], spans), dtype=bool)] = IGNORE_INDEX
        return ids, labels

    def _generation_marked(self, turns: list[dict[str, str]], where: str) -> tuple[np.ndarray, np.ndarray]:
        """The template's own assistant tokens: its ``{% generation %}`` blocks (transformers'
        ``assistant_masks``)."""
        try:
            enc = self.tok.apply_chat_template(turns, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
        except Exception as e:  # noqa: BLE001 - a template raising (Jinja errors, raise_exception) is bad input
            raise ConfigError(f"{where}: the chat template fails on this record: {type(e).__name__}: {e}") from None
        ids = np.asarray(enc["input_ids"], dtype=np.int64).reshape(-1)
        mask = np.asarray(enc["assistant_masks"], dtype=bool).reshape(-1)
        if not mask.any():
            raise ConfigError(f"{where}: the chat template's {{% generation %}} blocks mark no token of this record "
                              "as the assistant's; put them around the assistant turns' output, or use "
                              "data.train_on_prompt = true.")
        labels = ids.copy()
        labels[~mask] = IGNORE_INDEX
        return ids, labels


# ------------------------------------------------------------------------------ many records


def encode_records(records: list[Record], renderer: RecordRenderer, block_size: int, truncation: str) -> Encoded:
    """Encode every record and apply ``data.truncation`` to those longer than ``block_size + 1`` tokens."""
    limit = block_size + 1
    out = Encoded([], [], records=len(records))
    for where, record in records:
        ids, labels = renderer.encode(record, where)
        if len(ids) > limit:
            if truncation == "error":
                raise ConfigError(f"{where} is {len(ids)} tokens long, more than the sequence of {limit} "
                                  f"(block_size {block_size} + 1), and data.truncation = 'error'. Raise the "
                                  "block size, or set data.truncation = 'right' (cut) or 'drop'.")
            if truncation == "drop":
                out.dropped += 1
                out.tokens_lost += len(ids)
                continue
            out.truncated += 1
            out.tokens_lost += len(ids) - limit
            ids, labels = ids[:limit], labels[:limit]
        if len(ids) < 2 or not (labels[1:] != IGNORE_INDEX).any():
            out.dropped += 1  # nothing left to predict (a response cut away entirely)
            out.tokens_lost += len(ids)
            continue
        out.ids.append(ids)
        out.labels.append(labels)
    return out


def split_by_record(n: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) record indices: a seeded choice of ``val_fraction`` of ``n`` records, each
    part in its original order. Deterministic, and a record is never in both."""
    n_val = max(1, int(n * val_fraction))
    if n_val >= n:
        raise ConfigError(f"there are {n} records; data.val_fraction = {val_fraction} leaves none for training. "
                          "Use more records, a smaller data.val_fraction, or data.val_path.")
    order = np.random.default_rng(_VAL_SEED).permutation(n)
    val = np.sort(order[:n_val])
    train = np.sort(order[n_val:])
    return train, val


# ------------------------------------------------------------------------------ the cache


def _sources(path: Path, key: str) -> list[Any]:
    if is_hf_disk(path):
        return [file_identity(f) for f in sorted(path.rglob("*")) if f.is_file()]
    return [file_identity(f) for f in record_files(path, key)]


def _save(entry: Path, enc: Encoded) -> None:
    lengths = np.asarray([len(i) for i in enc.ids], dtype=np.int64)
    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}.npz")
    with open(tmp, "wb") as f:
        np.savez(f, lengths=lengths,
                 ids=np.concatenate(enc.ids) if enc.ids else np.zeros(0, np.int64),
                 labels=np.concatenate(enc.labels) if enc.labels else np.zeros(0, np.int64),
                 counts=np.asarray([enc.records, enc.truncated, enc.dropped, enc.tokens_lost], dtype=np.int64))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, entry)


def _load(entry: Path) -> Encoded | None:
    try:
        with np.load(entry) as z:
            lengths, ids, labels, counts = z["lengths"], z["ids"], z["labels"], z["counts"]
    except (OSError, ValueError, KeyError):
        return None
    cuts = np.cumsum(lengths)[:-1]
    return Encoded(list(np.split(ids, cuts)) if len(lengths) else [],
                   list(np.split(labels, cuts)) if len(lengths) else [], *map(int, counts))


def _part_source(dc: DataConfig, part: str) -> tuple[Path, str, str | None]:
    """(the file or folder ``part`` is read from, its config key, the datasets folder's validation split)."""
    path = Path(dc.path).expanduser()
    val_path = Path(dc.val_path).expanduser() if dc.val_path else None
    splits = hf_disk_splits(path) if is_hf_disk(path) else []
    hf_val = next((s for s in ("validation", "test") if s in splits), None) if val_path is None else None
    if part == "val" and val_path is not None:
        return val_path, "data.val_path", None
    return path, "data.path", hf_val


def records_of_part(dc: DataConfig, part: str) -> list[Record]:
    """The records of ``part`` ("train" or "val"): ``data.val_path``, else a datasets folder's
    validation/test split, else a seeded ``data.val_fraction`` of ``data.path``'s records."""
    source, key, hf_val = _part_source(dc, part)
    if part == "val" and hf_val is not None:
        return read_records(source, key, hf_val)
    if key == "data.val_path":
        return read_records(source, key)
    records = read_records(source, key, "train")
    if not dc.val_path and hf_val is None:
        train_idx, val_idx = split_by_record(len(records), dc.val_fraction)
        records = [records[i] for i in (train_idx if part == "train" else val_idx)]
    return records


def encoded_split(dc: DataConfig, block_size: int, part: str) -> tuple[Encoded, bool]:
    """The encoded ``part`` ("train" or "val") records of ``dc``, from the cache or built now."""
    source, key, _ = _part_source(dc, part)
    settings = {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc)
                if f.name not in ("num_workers", "cache_dir", "pack", "factory", "token_dtype", "text_field")}
    parts = {"format": CACHE_FORMAT, "part": part, "sources": _sources(source, key), "block_size": block_size,
             "tokenizer": tokenizer_fingerprint(Path(dc.tokenizer).expanduser()),
             "template": _template_fingerprint(dc), "settings": settings}
    root = cache_root(dc.cache_dir)
    name = cache_key(parts)
    entry = root / f"{dc.kind}-{name}.npz"
    with exclusive(root / f"{dc.kind}-{name}.lock"):
        if entry.is_file():
            cached = _load(entry)
            if cached is not None:
                return cached, True
        # A dry run builds the entry in its scratch folder: the cache is left as it was.
        real_root, root = root, build_root(root)
        entry = root / entry.name
        t0 = time.perf_counter()
        tok = load_hf_tokenizer(dc.tokenizer, dc.chat_template)
        renderer = RecordRenderer(tok, dc)
        records = records_of_part(dc, part)
        print(f"shardwise: tokenising {len(records):,} {dc.kind} records ({part}) of {str(source)!r} "
              f"{where_built(real_root)}", file=sys.stderr, flush=True)
        enc = encode_records(records, renderer, block_size, dc.truncation)
        if not enc.ids:
            raise ConfigError(f"{key} {str(source)!r}: no {part} record is left to train on ({enc.records} read, "
                              f"{enc.dropped} dropped as too long or with nothing to train); check "
                              "data.truncation and the block size.")
        _save(entry, enc)
        fsync_dir(root)
        atomic_write_json(entry.with_suffix(".json"), {**parts, "tokenize_s": round(time.perf_counter() - t0, 3)})
        return enc, False
