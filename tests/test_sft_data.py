"""Instruction/chat records as users have them, in one process: label masks checked token by
token against the rendered template, the response-only loss against a hand computation, packed rows
against each record run alone (built-in GPT and a Hugging Face Qwen2), the record-level validation
split, every malformed input refused with its file and line, and a datasets folder from save_to_disk."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from shardwise.core.config import DataConfig, ModelConfig  # noqa: E402
from shardwise.data.instruct import (  # noqa: E402
    IGNORE_INDEX,
    RecordRenderer,
    encode_records,
    load_hf_tokenizer,
    split_by_record,
)
from shardwise.data.packing import RowSequences, documents_of  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.runtime.token_loss import token_sum_loss  # noqa: E402
from shardwise.workloads import build_workload  # noqa: E402
from tests.helpers.sft import chat_records, instruct_records, save_qwen2, write_jsonl  # noqa: E402

SEQ = 128


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return save_qwen2(tmp_path_factory.mktemp("sft") / "my-qwen")


def _renderer(qwen: Path, kind: str, **kw) -> RecordRenderer:
    dc = DataConfig(kind=kind, tokenizer=str(qwen), **kw)
    return RecordRenderer(load_hf_tokenizer(dc.tokenizer, dc.chat_template), dc)


def test_chat_labels_cover_exactly_the_assistant_turns(qwen):
    r = _renderer(qwen, "chat")
    tok = r.tok
    rec = {"system": "Be brief.", "messages": [
        {"role": "user", "content": "What is the hour?"}, {"role": "assistant", "content": "Noon, my lord."},
        {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Still noon."}]}
    ids, labels = r.encode(rec, "rec")
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *rec["messages"]], tokenize=False)
    # By hand: each assistant span runs from after "<|im_start|>assistant\n" through its "<|im_end|>\n".
    spans, at = [], 0
    while (i := text.find("<|im_start|>assistant\n", at)) >= 0:
        lo = i + len("<|im_start|>assistant\n")
        hi = text.index("<|im_end|>\n", lo) + len("<|im_end|>\n")
        spans.append((lo, hi))
        at = hi
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ids.tolist() == enc["input_ids"]
    for t, (start, _end) in enumerate(enc["offset_mapping"]):
        inside = any(lo <= start < hi for lo, hi in spans)
        assert (labels[t] != IGNORE_INDEX) == inside, (t, tok.decode([ids[t]]))
        if inside:
            assert labels[t] == ids[t]
    trained = tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert trained == "Noon, my lord.<|im_end|>\nStill noon.<|im_end|>\n"
    # train_on_prompt: every token.
    ids2, labels2 = _renderer(qwen, "chat", train_on_prompt=True).encode(rec, "rec")
    assert (labels2 == ids2).all() and ids2.tolist() == ids.tolist()


def test_prompt_response_labels_plain_and_templated(qwen):
    r = _renderer(qwen, "instruct", chat_template="none")
    tok = r.tok
    ids, labels = r.encode({"instruction": "Name a king.", "input": "English.", "output": "Richard."}, "rec")
    prompt = tok("Name a king.\n\nEnglish.", add_special_tokens=False)["input_ids"]
    response = tok("Richard.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids.tolist() == prompt + response
    assert labels.tolist() == [IGNORE_INDEX] * len(prompt) + response
    # With the tokenizer's template: one user and one assistant turn, the assistant's trained.
    ids, labels = _renderer(qwen, "instruct").encode({"prompt": "Name a king.", "response": "Richard."}, "rec")
    assert tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]) == "Richard.<|im_end|>\n"
    # Configured field names.
    r = _renderer(qwen, "instruct", prompt_field="q", response_field="a", chat_template="none")
    ids, labels = r.encode({"q": "Hi", "a": "Ho"}, "rec")
    assert tok.decode(ids[labels != IGNORE_INDEX]) == "Ho<|im_end|>"


def _model_and_rows(qwen: Path, records: list[dict], pack: bool):
    from shardwise.models.hf import build_hf_model

    r = _renderer(qwen, "chat")
    enc = encode_records([(f"rec {i}", rec) for i, rec in enumerate(records)], r, SEQ, "right")
    rows = RowSequences(enc.ids, enc.labels, SEQ, pack, r.tok.pad_token_id)
    torch.manual_seed(0)
    model = build_hf_model(pretrained=str(qwen)).eval()
    return model, enc, rows


def _batch(rows: RowSequences):
    items = [rows[i] for i in range(len(rows))]
    x = {k: torch.stack([it[0][k] for it in items]) for k in items[0][0]}
    return x, torch.stack([it[1] for it in items])


def _alone(model, ids: np.ndarray, labels: np.ndarray) -> torch.Tensor:
    """Per-position losses of one record run by itself (positions with a trained target only)."""
    x = torch.from_numpy(ids[:-1])[None]
    y = torch.from_numpy(labels[1:])
    with torch.no_grad():
        logits = model(x)[0]
    return F.cross_entropy(logits.float(), y, ignore_index=IGNORE_INDEX, reduction="none")[y != IGNORE_INDEX]


@pytest.mark.parametrize("pack", [True, False])
def test_response_only_loss_equals_a_hand_computation_and_each_record_alone(qwen, pack):
    records = chat_records(12, seed=3)
    model, enc, rows = _model_and_rows(qwen, records, pack)
    if pack:
        assert len(rows) < len(enc.ids)  # several records per row
        assert rows.padding_fraction() < 0.5
    x, y = _batch(rows)
    with torch.no_grad():
        logits = model(x)
        total = token_sum_loss(logits, y)
    count = int((y != IGNORE_INDEX).sum())
    alone = [_alone(model, i, lab) for i, lab in zip(enc.ids, enc.labels)]
    hand = torch.cat(alone)
    assert count == hand.numel()
    torch.testing.assert_close(total / count, hand.mean(), atol=1e-5, rtol=1e-5)
    # Per record: the packed row's losses of each document equal that record run alone.
    per_pos = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                              reduction="none").view(y.shape)
    key = "doc_ids" if pack else "attention_mask"
    seen = []
    for row in range(len(rows)):
        docs = x[key][row]
        for d in (sorted(set(docs.tolist()) - {-1}) if pack else [1]):
            record = rows.rows[row][d if pack else 0]
            sel = (docs == d) & (y[row] != IGNORE_INDEX)
            torch.testing.assert_close(per_pos[row][sel], alone[record], atol=1e-5, rtol=1e-5)
            seen.append(record)
    assert sorted(seen) == list(range(len(alone)))


def test_packed_text_documents_match_each_document_alone_in_the_builtin_gpt():
    from shardwise.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=50, block_size=48, n_layer=2, n_head=2, n_embd=32, dropout=0.0)).eval()
    eos = 0
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 50, (n,), generator=g) for n in (7, 11, 5, 9)]
    stream = torch.cat([torch.cat([torch.tensor([eos]), d]) for d in docs])  # each document starts at its EOS
    doc_ids, pos = documents_of(stream, eos)
    assert pos.tolist()[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    with torch.no_grad():
        packed = gpt({"input_ids": stream[None], "position_ids": pos[None], "doc_ids": doc_ids[None]})[0]
        at = 0
        for d in docs:
            alone = gpt(torch.cat([torch.tensor([eos]), d])[None])[0]
            torch.testing.assert_close(packed[at:at + len(d) + 1], alone, atol=1e-5, rtol=1e-5)
            at += len(d) + 1


def test_validation_split_is_by_record_and_deterministic():
    train, val = split_by_record(200, 0.1)
    assert len(val) == 20 and len(train) == 180 and not set(train) & set(val)
    assert sorted([*train, *val]) == list(range(200))
    again = split_by_record(200, 0.1)
    assert (again[0] == train).all() and (again[1] == val).all()
    with pytest.raises(ConfigError, match="leaves none for training"):
        split_by_record(1, 0.5)


def test_workload_from_a_folder_user_records_and_truncation_counts(qwen, tmp_path):
    records = chat_records(40, seed=5) + [{"messages": [{"role": "user", "content": "x " * 200},
                                                        {"role": "assistant", "content": "y"}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    mc = ModelConfig(kind="hf", pretrained=str(qwen), overrides={"block_size": SEQ})
    dc = DataConfig(kind="chat", path=str(data), cache_dir=str(tmp_path / "cache"), pack=True, val_fraction=0.1)
    w = build_workload(mc, dc)
    assert w.token_loss and w.tokens_per_sample == SEQ
    text = "\n".join(w.notes)
    assert "records" in text and "truncated" in text and "dropped" in text and "padding" in text
    # The long record's prompt fills the block and its response is cut away entirely: dropped, counted.
    assert "1 dropped" in text or "1 dropped" in text.replace(",", ""), text
    x, y = w.train_set[0]
    assert set(x) == {"input_ids", "position_ids", "doc_ids"} and x["input_ids"].shape == (SEQ,)
    # A second build reads the cache; truncation = "error" refuses the long record by name.
    assert "cache hit" in "\n".join(build_workload(mc, dc).notes)
    with pytest.raises(ConfigError, match=r"line 41 is \d+ tokens long"):
        build_workload(mc, dataclasses.replace(dc, truncation="error"))


def test_a_datasets_folder_written_by_save_to_disk(qwen, tmp_path):
    datasets = pytest.importorskip("datasets")
    recs = instruct_records(30, seed=2)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(recs[:24]),
                               "validation": datasets.Dataset.from_list(recs[24:])})
    dd.save_to_disk(str(tmp_path / "ds"))
    mc = ModelConfig(kind="hf", pretrained=str(qwen), overrides={"block_size": SEQ})
    dc = DataConfig(kind="instruct", path=str(tmp_path / "ds"), cache_dir=str(tmp_path / "cache"))
    w = build_workload(mc, dc)
    notes = "\n".join(w.notes)
    assert "train (tokenised): 24 records" in notes and "val (tokenised): 6 records" in notes, notes
    assert set(w.train_set[0][0]) == {"input_ids", "position_ids", "doc_ids"}  # pack = "auto": packed
    w = build_workload(mc, dataclasses.replace(dc, pack="false"))
    assert set(w.train_set[0][0]) == {"input_ids", "attention_mask"}  # padded rows
    # Dynamic padding: the trainer's batches are as long as their longest record, not the block.
    x, y = w.collate_fn([w.train_set[i] for i in range(4)])
    longest = max(int(w.train_set[i][0]["attention_mask"].sum()) for i in range(4))
    assert y.shape == x["input_ids"].shape == x["attention_mask"].shape == (4, longest) and longest < SEQ


GOOD = ('{"prompt": "ok", "response": "fine", "messages": [{"role": "user", "content": "a"}, '
        '{"role": "assistant", "content": "b"}]}\n') * 9
BAD = [
    ("missing.jsonl", GOOD + '{"prompt": "a"}\n', "instruct", r"'.*missing.jsonl' line 10 has no response field"),
    ("role.jsonl", GOOD + '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}\n',
     "chat", r"line 10: turn 1 has role 'bot'; allowed roles: system, user, assistant, tool"),
    ("empty.jsonl", GOOD + '{"messages": []}\n', "chat", r"line 10: 'messages' must be a non-empty list"),
    ("noassistant.jsonl", GOOD + '{"messages": [{"role": "user", "content": "a"}]}\n', "chat",
     r"line 10 has no assistant turn"),
    ("array.jsonl", '[{"prompt": "a",\n "response": "b"}]\n', "instruct", r"starts a JSON array on line 1"),
    ("nofield.jsonl", GOOD + '{"text": "a"}\n', "chat", r"line 10 has no 'messages' field \(its fields: text\)"),
    ("bad.json", "[" + '{"prompt": "a", "response": "b"}, ' * 9 + "3]", "instruct",
     r"item 9 of the array holds a JSON int"),
]


@pytest.mark.parametrize("name,content,kind,message", BAD, ids=[b[0] for b in BAD])
def test_malformed_records_are_refused_with_file_and_line(qwen, tmp_path, name, content, kind, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    mc = ModelConfig(kind="hf", pretrained=str(qwen), overrides={"block_size": SEQ})
    with pytest.raises(ConfigError, match=message):
        build_workload(mc, DataConfig(kind=kind, path=str(path), cache_dir=str(tmp_path / "c")))


def test_non_utf8_template_problems_and_json_arrays_as_text(qwen, tmp_path):
    mc = ModelConfig(kind="hf", pretrained=str(qwen), overrides={"block_size": SEQ})
    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(b'{"prompt": "a", "response": "b"}\n' * 9 + b'{"prompt": "caf\xe9", "response": "b"}\n')
    with pytest.raises(ConfigError, match=r"line 10 is not UTF-8 text \(invalid byte 0xe9"):
        build_workload(mc, DataConfig(kind="instruct", path=str(bad), cache_dir=str(tmp_path / "c")))
    good = write_jsonl(tmp_path / "chat.jsonl", chat_records(4))
    # A template that drops earlier answers renders no span for them (record 0 has two).
    shifty = tmp_path / "shifty.jinja"
    shifty.write_text("{% for message in messages %}{% if message['role'] != 'assistant' or loop.last %}"
                      "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"chat.jsonl. line \d: the chat template renders no assistant span"):
        build_workload(mc, DataConfig(kind="chat", path=str(good), chat_template=str(shifty),
                                      cache_dir=str(tmp_path / "c")))
    # A tokenizer without a chat template: chat records are refused, saying how to give one.
    plain = save_qwen2(tmp_path / "plain", template=None)
    mc2 = ModelConfig(kind="hf", pretrained=str(plain), overrides={"block_size": SEQ})
    with pytest.raises(ConfigError, match="has none.*data.chat_template"):
        build_workload(mc2, DataConfig(kind="chat", path=str(good), cache_dir=str(tmp_path / "c")))
    # A .json array handed to data.kind = 'text' is refused (it would train on JSON syntax).
    arr = tmp_path / "records.json"
    arr.write_text(json.dumps(instruct_records(3)), encoding="utf-8")
    with pytest.raises(ConfigError, match="JSON"):
        build_workload(mc, DataConfig(kind="text", path=str(arr), cache_dir=str(tmp_path / "c")))


def test_best_fit_packing_keeps_every_record_once_within_the_row():
    from shardwise.data.packing import best_fit

    lengths = [int(v) for v in np.random.default_rng(0).integers(1, 60, 300)]
    rows = best_fit(lengths, 64)
    assert sorted(i for r in rows for i in r) == list(range(300))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows)
    assert len(rows) <= int(sum(lengths) / 64 * 1.15) + 1  # close to the bound
    assert rows == best_fit(lengths, 64)


def test_throughput_counts_the_real_tokens_it_is_given():
    from shardwise.models.masking import real_token_count
    from shardwise.observe.throughput import Peak, ThroughputMeter

    x = {"input_ids": torch.zeros(2, 8, dtype=torch.long),
         "doc_ids": torch.tensor([[0, 0, 1, 1, 1, -1, -1, -1], [0, 0, 0, 0, 0, 0, 0, -1]])}
    assert real_token_count(x) == 12
    assert real_token_count({"input_ids": x["input_ids"], "attention_mask": (x["doc_ids"] >= 0).long()}) == 12
    meter = ThroughputMeter(tokens_per_step=16, flops_per_token=1e6, devices=1, peak=Peak(1.0, "test"))
    meter.add_step(0.5, 0.0, tokens=torch.tensor(12.0))
    meter.add_step(0.5, 0.0, tokens=8)
    assert meter.window()["tokens_per_s"] == pytest.approx(20.0)
    meter.add_step(1.0, 0.0)  # no count given: the fixed tokens per step
    assert meter.window()["tokens_per_s"] == pytest.approx(16.0)
