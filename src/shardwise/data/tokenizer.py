"""A tokenizer from a LOCAL folder or ``tokenizer.json`` (``data.tokenizer``), behind one small interface.

A folder with ``tokenizer_config.json`` (what ``save_pretrained`` writes, or a downloaded model
folder) loads through ``transformers.AutoTokenizer`` with ``local_files_only=True`` (never the hub,
never remote code); a bare ``tokenizer.json`` file, or a folder holding only one, loads through the
``tokenizers`` library. Loading is lazy: a cache hit needs only the tokenizer's fingerprint (a hash
of its files), not the tokenizer, so a cached run does not pay for importing transformers.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.fsutil import what_is

# Special tokens that end a document, by tokenizer family, tried in order when the tokenizer does
# not declare an eos_token (a bare tokenizer.json never does).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
# Files of a tokenizer folder that decide how text is tokenised (model weights are not hashed).
_TOKENIZER_FILE_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges",
                            "spiece", "sentencepiece", "chat_template")
_TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken")
NEEDS_TOKENIZER = ("data.kind = 'text' needs data.tokenizer: a local tokenizer folder (as written by "
                   "save_pretrained, e.g. a downloaded model folder) or a tokenizer.json file. When fine-tuning, "
                   "set model.pretrained to the model folder instead: its own tokenizer is used by default.")


def tokenizer_files(path: Path) -> list[Path]:
    """The files that define the tokenizer at ``path`` (a file, or the relevant files of a folder)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"data.tokenizer {str(path)!r} {what_is(path)}; point it at a local tokenizer "
                          "folder (what save_pretrained writes) or a tokenizer.json file.")
    files = sorted(p for p in path.iterdir() if p.is_file() and (
        p.name.startswith(_TOKENIZER_FILE_PREFIXES) or p.suffix in _TOKENIZER_FILE_SUFFIXES))
    if not files:
        raise ConfigError(f"data.tokenizer folder {str(path)!r} holds no tokenizer files (tokenizer.json, "
                          "tokenizer_config.json, vocab/merges files or a sentencepiece .model).")
    extra = [path / "config.json"] if (path / "config.json").is_file() else []  # picks the class
    return files + extra


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def tokenizer_fingerprint(path: Path) -> str:
    """SHA-256 over the tokenizer's file names and contents and the tokenizing libraries' versions."""
    h = hashlib.sha256()
    for file in tokenizer_files(path):
        h.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    h.update(f"transformers={_version('transformers')} tokenizers={_version('tokenizers')}".encode())
    return h.hexdigest()


class TextTokenizer:
    """``encode_batch``/``decode`` plus the EOS id and vocabulary size of a local tokenizer."""

    def __init__(self, path: Path, encode_batch: Callable[[list[str]], list[list[int]]],
                 decode: Callable[[list[int]], str], eos_id: int, vocab_size: int) -> None:
        self.path = path
        self.encode_batch = encode_batch
        self._decode = decode
        self.eos_id = eos_id
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)

    @property
    def sample_prompt(self) -> list[int]:
        """Where a generated sample starts: a fresh document (the EOS that ends the previous one)."""
        return [self.eos_id]


def load_tokenizer(path_str: str) -> TextTokenizer:
    """Load the tokenizer named by ``data.tokenizer``; ConfigError saying why when it does not load."""
    if not path_str:
        raise ConfigError(NEEDS_TOKENIZER)
    path = Path(path_str).expanduser()
    tokenizer_files(path)  # existence and content checks, with their own messages
    bare = path if path.is_file() else None
    if path.is_dir() and not (path / "tokenizer_config.json").is_file() and (path / "tokenizer.json").is_file():
        bare = path / "tokenizer.json"
    try:
        return _from_tokenizers(bare) if bare is not None else _from_transformers(path)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure inside the libraries means "does not load"
        raise ConfigError(f"data.tokenizer {str(path)!r} does not load: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}. Check that it is a complete "
                          "tokenizer folder (tokenizer.json or the vocab files, tokenizer_config.json).") from None


def _from_tokenizers(file: Path) -> TextTokenizer:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("reading a tokenizer.json needs the tokenizers package: "
                          "pip install 'shardwise[hf]'.") from None
    tok = Tokenizer.from_file(str(file))
    vocab = tok.get_vocab(with_added_tokens=True)
    eos = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)
    if eos is None:
        raise ConfigError(_no_eos(file))

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return TextTokenizer(file, encode_batch, lambda ids: tok.decode(ids), eos,
                         tok.get_vocab_size(with_added_tokens=True))


def _from_transformers(folder: Path) -> TextTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("loading a tokenizer folder needs the transformers package: "
                          "pip install 'shardwise[hf]'.") from None
    # local_files_only: never the hub; trust_remote_code stays False: no code from the folder runs.
    tok: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = tok.eos_token_id
    if eos is None:
        vocab = tok.get_vocab()
        eos = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)
    if eos is None:
        raise ConfigError(_no_eos(folder))

    def encode_batch(texts: list[str]) -> list[list[int]]:
        # verbose=False: no "longer than the model's maximum length" warning; documents are packed.
        return tok(texts, add_special_tokens=False, verbose=False)["input_ids"]

    return TextTokenizer(folder, encode_batch, lambda ids: tok.decode(ids), int(eos), len(tok))


def _no_eos(where: Path) -> str:
    return (f"data.tokenizer {str(where)!r} has no end-of-document token, which separates packed "
            f"documents: it declares no eos_token and has none of {', '.join(EOS_CANDIDATES)}. Save it "
            "with one, e.g. PreTrainedTokenizerFast(..., eos_token='</s>').save_pretrained(folder).")
