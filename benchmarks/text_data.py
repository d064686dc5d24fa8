"""Tokenising your own text once, then reading it from the cache (issue figures, not a test).

    .venv/bin/python benchmarks/text_data.py --mb 20
    .venv/bin/python benchmarks/text_data.py --text my_corpus.txt --tokenizer path/to/tokenizer

Without ``--text``, writes ``--mb`` MB of Tiny Shakespeare (repeated) as a text file and as JSONL
(one document per paragraph); without ``--tokenizer``, trains a byte-level BPE of ``--vocab``
tokens on it first. Then times ``load_text`` cold (tokenise + write the cache) and warm (cache
hit), and how fast the packed sequences come out of ``ShardedLoader`` (one rank).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _tokenizer(folder: Path, text: str, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[:2_000_000]], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def main() -> int:
    from shardwise.core.config import DataConfig
    from shardwise.data.shakespeare import bundled_text_path
    from shardwise.data.text import load_text
    from shardwise.runtime.data import ShardedLoader

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=20.0, help="corpus size to write (without --text)")
    p.add_argument("--text", default="", help="your own text/JSONL file or folder instead")
    p.add_argument("--tokenizer", default="", help="a local tokenizer folder (default: train a BPE)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batches", type=int, default=500)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="shardwise-text-bench-"))
    sources: list[tuple[str, Path]] = []
    if args.text:
        sources.append(("your data", Path(args.text)))
        sample = Path(args.text).read_text(encoding="utf-8")[:2_000_000] if Path(args.text).is_file() else ""
    else:
        base = bundled_text_path().read_text(encoding="utf-8")
        text = base * max(1, int(args.mb * 1e6 / len(base.encode())))
        (work / "corpus.txt").write_text(text, encoding="utf-8")
        with open(work / "corpus.jsonl", "w", encoding="utf-8") as f:
            for para in text.split("\n\n"):
                f.write(json.dumps({"text": para}) + "\n")
        sources += [("text file", work / "corpus.txt"), ("JSONL", work / "corpus.jsonl")]
        sample = text
    tok = args.tokenizer or str(_tokenizer(work / "tok", sample, args.vocab))

    print(f"tokenizer: {tok}; block_size {args.block_size}; cache in {work / 'cache'}")
    print("| source | MB | tokens | cold: tokenise + cache s | MB/s | warm: cache hit s | batches/s (B=32) |")
    print("|---|---|---|---|---|---|---|")
    for name, path in sources:
        size_mb = sum(f.stat().st_size for f in ([path] if path.is_file() else path.rglob("*")) if f.is_file()) / 1e6
        dc = DataConfig(kind="text", path=str(path), tokenizer=tok, cache_dir=str(work / "cache"), val_fraction=0.01)
        t0 = time.perf_counter()
        lm = load_text(dc, args.block_size)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        lm = load_text(dc, args.block_size)
        warm = time.perf_counter() - t0
        loader = ShardedLoader(lm.train, 32, num_replicas=1, rank=0)
        batches = loader.forever()
        t0 = time.perf_counter()
        for _ in range(args.batches):
            next(batches)
        rate = args.batches / (time.perf_counter() - t0)
        tokens = lm.train.tokens.count
        print(f"| {name} | {size_mb:.1f} | {tokens:,} | {cold:.2f} | {size_mb / cold:.1f} | {warm:.3f} | {rate:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
