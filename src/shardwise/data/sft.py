"""``data.kind = "chat" | "instruct"``: records -> encoded (cached) -> packed or padded rows."""

from __future__ import annotations

from pathlib import Path

from shardwise.core.config import DataConfig
from shardwise.data.instruct import encoded_split, load_hf_tokenizer
from shardwise.data.packing import RowSequences
from shardwise.data.tokens import LMData
from shardwise.errors import ConfigError


def load_instruct(dc: DataConfig, block_size: int) -> LMData:
    """Train/val rows of the chat or instruct records named by ``dc``."""
    if not dc.path:
        raise ConfigError(f"data.kind = {dc.kind!r} needs data.path: a JSONL/JSON/CSV/Parquet file of records, a "
                          "folder of them, or a Hugging Face datasets folder written by save_to_disk.")
    if not Path(dc.path).expanduser().exists():
        raise ConfigError(f"data.path {dc.path!r} does not exist; point it at a JSONL/JSON/CSV/Parquet file of "
                          "records, a folder of them, or a Hugging Face datasets folder written by save_to_disk.")
    notes = []
    parts = {}
    for part in ("train", "val"):
        enc, hit = encoded_split(dc, block_size, part)
        notes.append(enc.describe(f"{part} ({'cache hit' if hit else 'tokenised'})"))
        parts[part] = enc
    tok = load_hf_tokenizer(dc.tokenizer, dc.chat_template)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train = RowSequences(parts["train"].ids, parts["train"].labels, block_size, dc.packed, pad_id)
    val = RowSequences(parts["val"].ids, parts["val"].labels, block_size, dc.packed, pad_id)
    notes += [train.describe("train"), val.describe("val")]
    max_id = max(int(max(i.max() for i in e.ids)) for e in parts.values())
    return LMData(train=train, val=val, max_token_id=max(max_id, pad_id), vocab_size=len(tok), tokenizer=None,
                  notes=notes)
