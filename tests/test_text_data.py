"""data.kind = "text" (own text/JSONL + local tokenizer, cached) and "tokens" (.bin/.npy), and their bad inputs.

Every tokenizer here is trained in the test on a Shakespeare slice (tests.helpers.text); nothing
is downloaded.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from shardwise.cli import main
from shardwise.core.config import DataConfig, ModelConfig, load_config
from shardwise.data import text as text_data
from shardwise.errors import ConfigError
from shardwise.models.hf import load_hf_config_dict
from shardwise.workloads import build_workload
from tests.helpers.ckpt import cli_args, losses, run_cli
from tests.helpers.text import EOS, corpus_text, make_tokenizer, text_overrides, write_jsonl


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def _encode(hf_tok, text: str) -> list[int]:
    return hf_tok(text, add_special_tokens=False)["input_ids"]


def _text_workload(tmp_path, path, tok, block_size=None, **data):
    overrides = {"block_size": block_size} if block_size else {}
    dc = DataConfig(kind="text", path=str(path), tokenizer=str(tok), cache_dir=str(tmp_path / "cache"), **data)
    return build_workload(ModelConfig(preset="nano", overrides=overrides), dc)


def _stream(workload) -> list[int]:
    """The whole cached token stream behind a workload's training set."""
    tokens = workload.train_set.tokens
    return tokens.ids(0, tokens.count).tolist()


# --------------------------------------------------------------------------- text: what is built
def test_text_file_is_tokenised_with_eos_and_packed_into_shifted_sequences(tmp_path, tok_dir, hf_tok):
    text = corpus_text(6000)
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    work = _text_workload(tmp_path, tmp_path / "a.txt", tok_dir)
    eos = hf_tok.convert_tokens_to_ids(EOS)
    ids = _encode(hf_tok, text) + [eos]
    assert _stream(work) == ids
    block = 32  # the nano preset's block_size
    assert work.tokens_per_sample == block and work.build_model().lm_head.weight.shape[0] == len(hf_tok)
    x, y = work.train_set[2]
    assert x.tolist() == ids[2 * block:3 * block] and y.tolist() == ids[2 * block + 1:3 * block + 1]
    # The last 10% of the tokens is validation; sequences overlap by one token, so every token
    # but the very first of each split is a target exactly once.
    cut = int(len(ids) * 0.9)
    assert len(work.train_set) == (cut - 1) // block and len(work.val_set) == (len(ids) - cut - 1) // block
    assert work.val_set[0][0].tolist() == ids[cut:cut + block]
    assert x.dtype == torch.long and any("tokenised in" in n for n in work.notes)


def test_folder_of_text_and_jsonl_files_in_sorted_order(tmp_path, tok_dir, hf_tok):
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    a = corpus_text(3000)
    docs = [corpus_text(2000, start=5000), "", corpus_text(1500, start=9000)]  # the empty doc is skipped
    (folder / "a.txt").write_text(a, encoding="utf-8")
    write_jsonl(folder / "b" / "c.jsonl", docs, field="body")
    (folder / ".hidden.txt").write_text("never read")
    (folder / "empty.md").write_text("")
    (folder / "notes.pdf").write_bytes(b"%PDF\0binary")  # not a text suffix: ignored
    work = _text_workload(tmp_path, folder, tok_dir, text_field="body")
    eos = hf_tok.convert_tokens_to_ids(EOS)
    expected = _encode(hf_tok, a) + [eos] + _encode(hf_tok, docs[0]) + [eos] + _encode(hf_tok, docs[2]) + [eos]
    assert _stream(work) == expected
    assert "2 file(s), 3 documents" in work.notes[0]


def test_bare_tokenizer_json_gives_the_same_ids(tmp_path, tok_dir):
    (tmp_path / "a.txt").write_text(corpus_text(4000), encoding="utf-8")
    bare = make_tokenizer(tmp_path / "bare", bare=True)
    assert bare.name == "tokenizer.json"
    assert _stream(_text_workload(tmp_path, tmp_path / "a.txt", bare)) == \
        _stream(_text_workload(tmp_path, tmp_path / "a.txt", tok_dir))


def test_plain_text_is_read_in_pieces_cut_before_a_new_line_of_text(tmp_path, monkeypatch):
    monkeypatch.setattr(text_data, "_PIECE_BYTES", 64)
    text = "first line\n\n  indented\nnext paragraph é\n" * 20
    file = tmp_path / "t.txt"
    file.write_bytes(b"\xef\xbb\xbf" + text.encode())
    pieces = list(text_data._text_pieces(file))
    assert "".join(pieces) == text and len(pieces) > 5  # the byte-order mark is dropped
    for piece, following in zip(pieces, pieces[1:]):
        assert piece.endswith("\n") and not following[0].isspace()
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok line\n" * 30 + b"caf\xe9\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(invalid byte 0xe9 at byte 243\)"):
        list(text_data._text_pieces(bad))


# --------------------------------------------------------------------------- text: the cache
def test_second_build_reads_the_cache_without_tokenising(tmp_path, tok_dir, monkeypatch):
    file = tmp_path / "a.txt"
    file.write_text(corpus_text(5000), encoding="utf-8")
    first = _text_workload(tmp_path, file, tok_dir)
    entry = first.train_set.tokens.path
    stamp = entry.stat().st_mtime_ns

    def forbidden(*args, **kwargs):
        raise AssertionError("re-tokenised although the cache holds this corpus")

    monkeypatch.setattr(text_data, "tokenize_files", forbidden)
    monkeypatch.setattr(text_data, "load_tokenizer", forbidden)  # a hit does not even load the tokenizer
    again = _text_workload(tmp_path, file, tok_dir, block_size=16)  # another sequence length: same entry
    assert again.train_set.tokens.path == entry and entry.stat().st_mtime_ns == stamp
    assert "cache hit" in again.notes[0] and again.train_set[0][0].shape == (16,)
    assert again.train_set[0][0].tolist() == _stream(first)[:16]

    monkeypatch.undo()
    calls = []
    real = text_data.tokenize_files
    monkeypatch.setattr(text_data, "tokenize_files", lambda *a, **k: calls.append(1) or real(*a, **k))
    file.write_text(corpus_text(5000) + "\nMORE TEXT\n", encoding="utf-8")  # changed size and mtime
    changed = _text_workload(tmp_path, file, tok_dir)
    assert calls == [1] and changed.train_set.tokens.path != entry
    other_tok = make_tokenizer(tmp_path / "tok200", vocab_size=200)
    _text_workload(tmp_path, file, other_tok)
    assert calls == [1, 1]  # another tokenizer is another entry


def test_concurrent_builders_tokenise_once_and_read_a_whole_entry(tmp_path, tok_dir, monkeypatch):
    """Two ranks (here: threads, each with its own lock file handle) racing for one entry."""
    file = tmp_path / "a.txt"
    file.write_text(corpus_text(5000), encoding="utf-8")
    calls = []
    real = text_data.tokenize_files

    def slow(*args, **kwargs):
        calls.append(1)
        out = real(*args, **kwargs)
        time.sleep(0.5)  # the other builder arrives while this one is still writing
        return out

    monkeypatch.setattr(text_data, "tokenize_files", slow)
    results, errors = [], []

    def build():
        try:
            results.append(_stream(_text_workload(tmp_path, file, tok_dir)))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and calls == [1] and len(results) == 3 and results[0] == results[1] == results[2]
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if ".tmp" in p.name]
    assert leftovers == []


# --------------------------------------------------------------------------- tokens
def test_nanogpt_bin_folder_npy_and_uint32(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "owt"
    folder.mkdir()
    train_ids = rng.integers(0, 97, 2000).astype(np.uint16)
    val_ids = rng.integers(0, 97, 300).astype(np.uint16)
    train_ids.tofile(folder / "train.bin")
    val_ids.tofile(folder / "val.bin")
    dc = DataConfig(kind="tokens", path=str(folder), cache_dir=str(tmp_path / "cache"))
    work = build_workload(ModelConfig(preset="nano"), dc)
    assert work.build_model().lm_head.weight.shape[0] == int(train_ids.max()) + 1  # sized to the data
    x, y = work.train_set[3]
    assert x.tolist() == train_ids[96:128].tolist() and y.tolist() == train_ids[97:129].tolist()
    assert work.val_set[0][0].tolist() == val_ids[:32].tolist()
    assert len(work.train_set) == 1999 // 32 and len(work.val_set) == 299 // 32

    npy = tmp_path / "ids.npy"
    np.save(npy, rng.integers(0, 50, 1000).astype(np.int32))
    work = build_workload(ModelConfig(preset="nano", overrides={"vocab_size": 64}),
                          DataConfig(kind="tokens", path=str(npy), val_fraction=0.25, cache_dir=str(tmp_path / "c")))
    assert work.train_set[0][0].tolist() == np.load(npy)[:32].tolist() and len(work.val_set) == 249 // 32
    assert work.build_model().lm_head.weight.shape[0] == 64

    big = tmp_path / "big.bin"
    np.array([70000, 1, 2, 3] * 100, dtype=np.uint32).tofile(big)
    work = build_workload(ModelConfig(preset="nano", overrides={"vocab_size": 70001}),
                          DataConfig(kind="tokens", path=str(big), token_dtype="uint32", cache_dir=str(tmp_path / "c")))
    assert work.train_set[0][0][:4].tolist() == [70000, 1, 2, 3]
    with pytest.raises(ConfigError, match="token id 70000.*70000 entries"):
        build_workload(ModelConfig(preset="nano", overrides={"vocab_size": 70000}),
                       DataConfig(kind="tokens", path=str(big), token_dtype="uint32", cache_dir=str(tmp_path / "c")))


def test_tokens_with_a_hf_model_are_checked_against_its_config_vocab(tmp_path):
    ids = tmp_path / "ids.bin"
    np.arange(1000, dtype=np.uint16).__mod__(65).astype(np.uint16).tofile(ids)
    dc = DataConfig(kind="tokens", path=str(ids), cache_dir=str(tmp_path / "c"))
    work = build_workload(ModelConfig(kind="hf", hf_config="llama-tiny", overrides={"block_size": 16}), dc)
    assert work.tokens_per_sample == 16  # llama-tiny's vocab (65) is kept and holds every id
    np.array([64, 65] * 100, dtype=np.uint16).tofile(ids)
    with pytest.raises(ConfigError, match="produces token id 65, but the model's vocabulary has 65 entries"):
        build_workload(ModelConfig(kind="hf", hf_config="llama-tiny", overrides={"block_size": 16}), dc)


def test_text_with_a_hf_model_keeps_a_config_vocab_that_holds_the_tokenizer(tmp_path, tok_dir):
    (tmp_path / "a.txt").write_text(corpus_text(4000), encoding="utf-8")
    dc = DataConfig(kind="text", path=str(tmp_path / "a.txt"), tokenizer=str(tok_dir), cache_dir=str(tmp_path / "c"))

    def vocab(hf_config):
        work = build_workload(ModelConfig(kind="hf", hf_config=hf_config, overrides={"block_size": 16}), dc)
        return work.build_model().hf.get_input_embeddings().weight.shape[0]

    assert vocab("llama-tiny") == 300  # its 65 entries cannot hold the tokenizer's ids: grown to 300
    config = {**load_hf_config_dict("llama-tiny"), "vocab_size": 512}  # e.g. a padded vocabulary
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vocab(str(tmp_path / "config.json")) == 512  # the model's own embedding shape is kept


# --------------------------------------------------------------------------- bad input
def _bad_text(tmp_path, tok_dir, case):
    """(DataConfig kwargs, model overrides) for one bad text input."""
    f = tmp_path / "data.txt"
    f.write_text(corpus_text(3000), encoding="utf-8")
    kw = {"path": str(f), "tokenizer": str(tok_dir)}
    if case == "missing-file":
        kw["path"] = str(tmp_path / "nope.txt")
    elif case == "empty-file":
        f.write_text("")
    elif case == "binary-file":
        f.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    elif case == "not-utf8":
        f.write_bytes("Ünïcödé in latin-1\n".encode("latin-1"))
    elif case == "no-text-in-folder":
        (tmp_path / "empty_dir").mkdir()
        (tmp_path / "empty_dir" / "x.csv").write_text("a,b")
        kw["path"] = str(tmp_path / "empty_dir")
    elif case == "no-tokenizer":
        kw["tokenizer"] = ""
    elif case == "tokenizer-missing":
        kw["tokenizer"] = str(tmp_path / "no-such-tokenizer")
    elif case == "tokenizer-broken":
        broken = tmp_path / "broken_tok"
        broken.mkdir()
        (broken / "tokenizer.json").write_text("{not json")
        (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
        kw["tokenizer"] = str(broken)
    elif case == "tokenizer-without-eos":
        kw["tokenizer"] = str(make_tokenizer(tmp_path / "noeos", eos=None, bare=True))
    elif case == "shorter-than-a-sequence":
        f.write_text("To be.", encoding="utf-8")
    elif case == "val-split-too-small":
        f.write_text(corpus_text(300), encoding="utf-8")
    elif case in ("jsonl-invalid", "jsonl-missing-field", "jsonl-not-string"):
        j = tmp_path / "data.jsonl"
        line = {"jsonl-invalid": '{"text": "ok"', "jsonl-missing-field": '{"body": "x"}',
                "jsonl-not-string": '{"text": 42}'}[case]
        j.write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
        kw["path"] = str(j)
    elif case == "vocab-smaller-than-tokenizer":
        return kw, {"vocab_size": 100}
    return kw, {}


@pytest.mark.parametrize("case, match", [
    ("missing-file", r"data.path '.*nope.txt' does not exist"),
    ("empty-file", r"data file '.*data.txt' is empty"),
    ("binary-file", r"looks like a binary file \(a NUL byte at byte 7\)"),
    ("not-utf8", r"is not UTF-8 text \(invalid byte 0xdc at byte 0\)"),
    ("no-text-in-folder", r"holds no non-empty text or JSONL files"),
    ("no-tokenizer", r"data.kind = 'text' needs data.tokenizer"),
    ("tokenizer-missing", r"data.tokenizer '.*no-such-tokenizer' does not exist"),
    ("tokenizer-broken", r"data.tokenizer '.*broken_tok' does not load: .*complete tokenizer folder"),
    ("tokenizer-without-eos", r"has no end-of-document token"),
    ("shorter-than-a-sequence", r"has \d+ tokens, fewer than one training sequence of 33"),
    ("val-split-too-small", r"data.val_fraction = 0.1 leaves \d+ for validation, fewer than one sequence"),
    ("jsonl-invalid", r"data.jsonl' line 2 is not valid JSON"),
    ("jsonl-missing-field", r"line 2 has no 'text' field \(its fields: body\); set data.text_field"),
    ("jsonl-not-string", r"line 2: field 'text' is a int, not a string"),
    ("vocab-smaller-than-tokenizer", r"produces token id \d+, but the model's vocabulary has 100 entries"),
])
def test_bad_text_input_is_one_clear_config_error(tmp_path, tok_dir, case, match):
    kw, overrides = _bad_text(tmp_path, tok_dir, case)
    dc = DataConfig(kind="text", cache_dir=str(tmp_path / "cache"), **kw)
    with pytest.raises(ConfigError, match=match):
        build_workload(ModelConfig(preset="nano", overrides=overrides), dc)
    # Nothing half-written is left; a corpus that cannot be read leaves no cache entry either (one
    # that tokenised fine but is too short or too wide for the model stays cached: it is correct).
    cache = tmp_path / "cache"
    left = [p.name for p in cache.iterdir()] if cache.exists() else []
    assert not [n for n in left if ".tmp" in n]
    if case not in ("shorter-than-a-sequence", "val-split-too-small", "vocab-smaller-than-tokenizer"):
        assert not [n for n in left if n.endswith(".bin")]


def _bad_tokens(tmp_path, case):
    f = tmp_path / "ids.bin"
    np.arange(500, dtype=np.uint16).__mod__(60).astype(np.uint16).tofile(f)
    if case == "missing":
        return str(tmp_path / "nope.bin"), {}
    if case == "empty":
        f.write_bytes(b"")
    elif case == "odd-size":
        f.write_bytes(b"\x01\x00\x02")
    elif case == "unknown-suffix":
        f = f.rename(tmp_path / "ids.txt")
    elif case == "id-over-vocab":
        return str(f), {"vocab_size": 50}
    elif case == "too-short":
        np.arange(20, dtype=np.uint16).tofile(f)
    elif case == "folder-without-train":
        (tmp_path / "dir").mkdir()
        return str(tmp_path / "dir"), {}
    else:
        f = tmp_path / "ids.npy"
        if case == "npy-float":
            np.save(f, np.ones(100, dtype=np.float32))
        elif case == "npy-2d":
            np.save(f, np.ones((10, 33), dtype=np.uint16))
        elif case == "npy-object":
            np.save(f, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        elif case == "npy-negative":
            np.save(f, np.array([5, -3] * 50, dtype=np.int32))
        elif case == "npy-not-npy":
            f.write_bytes(b"hello, not numpy")
    return str(f), {}


@pytest.mark.parametrize("case, match", [
    ("missing", r"data.path '.*nope.bin' does not exist"),
    ("empty", r"data.path '.*ids.bin' is empty"),
    ("odd-size", r"has 3 bytes, not a whole number of uint16 tokens"),
    ("unknown-suffix", r"is not a token file: use a .bin file"),
    ("id-over-vocab", r"produces token id 59, but the model's vocabulary has 50 entries"),
    ("too-short", r"has 20 tokens, fewer than one training sequence of 33"),
    ("folder-without-train", r"must hold exactly one of train.bin or train.npy \(found neither\)"),
    ("npy-float", r"holds float32 values; token ids must be an integer array"),
    ("npy-2d", r"has shape \(10, 33\); token files are one flat 1-D stream"),
    ("npy-object", r"is not a readable .npy array"),
    ("npy-negative", r"holds a negative id \(-3\)"),
    ("npy-not-npy", r"is not a .npy file \(it lacks the NumPy header\)"),
])
def test_bad_token_input_is_one_clear_config_error(tmp_path, case, match):
    path, overrides = _bad_tokens(tmp_path, case)
    with pytest.raises(ConfigError, match=match):
        build_workload(ModelConfig(preset="nano", overrides=overrides),
                       DataConfig(kind="tokens", path=path, cache_dir=str(tmp_path / "cache")))


def test_new_data_fields_are_validated():
    with pytest.raises(ConfigError, match="unknown data.token_dtype 'int8'.*"
                       "Valid values of data.token_dtype: uint16, uint32"):
        load_config(None, ["data.token_dtype=int8"])
    with pytest.raises(ConfigError, match="data.text_field must not be empty"):
        load_config(None, ['data.text_field=""'])


def test_bad_data_stops_the_cli_before_any_rank_starts(tmp_path, tok_dir, capsys):
    data = tmp_path / "a.txt"
    data.write_text(corpus_text(3000), encoding="utf-8")
    out = tmp_path / "run"
    overrides = text_overrides(data, tmp_path / "no-such-tokenizer", tmp_path / "cache")
    code = main(["train", "--nproc", "2", "--out", str(out), *cli_args(overrides)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: data.tokenizer") and "does not exist" in err and err.count("\n") == 1
    assert not out.exists()  # refused before the run directory or any rank existed


# --------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_shardwise_train_on_a_text_file_with_a_local_tokenizer(tmp_path, tok_dir, cli_env, capsys):
    """One process (tokenises, in preflight), then 2 pipeline-parallel ranks that read the cache."""
    data = tmp_path / "corpus.txt"
    data.write_text(corpus_text(12000), encoding="utf-8")
    cache = tmp_path / "cache"
    overrides = text_overrides(data, tok_dir, cache)
    assert main(["train", "--nproc", "1", "--strategy", "single", "--out", str(tmp_path / "one"),
                 *cli_args(overrides)]) == 0
    printed = capsys.readouterr()
    assert "--- sample ---" in printed.out  # generated with the nano GPT, decoded by the tokenizer
    assert printed.err.count("shardwise: tokenising") == 1  # in preflight; the trainer then hits the cache
    entry = next(cache.glob("text-*.bin"))
    stamp = entry.stat().st_mtime_ns
    assert sorted(losses(tmp_path / "one")) == [1, 2, 3]
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert np.isfinite(summary["final_val_loss"]) and summary["final_train_loss"] < 6.0  # ln(300) = 5.7

    two = run_cli(["train", "--nproc", "2", "--strategy", "pp", "--out", str(tmp_path / "two"),
                   *cli_args(overrides)], cli_env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "cache hit" in two.stderr and "tokenising" not in two.stderr  # no re-tokenising
    assert entry.stat().st_mtime_ns == stamp and list(cache.glob("text-*.bin")) == [entry]
    assert sorted(losses(tmp_path / "two")) == [1, 2, 3]
