"""Tiny tokenizers and corpora made in the test (never downloaded) for the text/tokens data kinds."""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.data.shakespeare import bundled_text_path

EOS = "<|endoftext|>"


def corpus_text(chars: int = 6000, start: int = 0) -> str:
    """A slice of the bundled Tiny Shakespeare."""
    return bundled_text_path().read_text(encoding="utf-8")[start:start + chars]


def make_tokenizer(folder: Path, vocab_size: int = 300, *, eos: str | None = EOS, bare: bool = False) -> Path:
    """Train a byte-level BPE on Shakespeare and save it to ``folder``; return the path to use.

    ``bare=True`` writes only ``folder/tokenizer.json`` (returned) instead of the save_pretrained
    layout; ``eos=None`` saves a tokenizer without any end-of-document token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos] if eos else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus_text(20000)], trainer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if bare:
        tok.save(str(folder / "tokenizer.json"))
        return folder / "tokenizer.json"
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **({"eos_token": eos} if eos else {})).save_pretrained(folder)
    return folder


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    """Write one JSON object per document, its text under ``field``."""
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def text_overrides(data: Path, tokenizer: Path, cache: Path, steps: int = 3, micro_batch: int = 4) -> list[str]:
    """--set overrides for a few quick steps of the nano GPT on ``data`` tokenised by ``tokenizer``."""
    return [
        "model.preset=nano", f"train.steps={steps}", "train.eval_every=0", "train.eval_batches=1",
        "train.sample_tokens=8", "train.progress=false", "train.log_every=1", "train.warmup_steps=1",
        f"train.micro_batch_size={micro_batch}", "data.kind=text", f'data.path="{data}"',
        f'data.tokenizer="{tokenizer}"', f'data.cache_dir="{cache}"', "data.val_fraction=0.2",
        "checkpoint.at_end=false",
    ]
