"""Collators for records (shardwise.data.collate), on the package's own tiny chat sample: dynamic
padding and packing give each record's own losses, the built-in trainer's settings (data.pack =
"auto"), and a user's own loop on the Session API training on padded and packed batches."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from shardwise.core.config import DataConfig, load_config  # noqa: E402
from shardwise.data.collate import RecordCollator, collate_rows  # noqa: E402
from shardwise.data.instruct import IGNORE_INDEX, RecordRenderer, encode_records, load_hf_tokenizer  # noqa: E402
from shardwise.data.packing import RowSequences  # noqa: E402
from shardwise.data.records import SAMPLE_CHAT  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.runtime.token_loss import token_sum_loss  # noqa: E402
from tests.helpers.sft import save_qwen2  # noqa: E402

SEQ = 128


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return save_qwen2(tmp_path_factory.mktemp("collate") / "qwen")


def _records(qwen: Path) -> tuple[list[dict], int]:
    """The shipped sample, encoded with the tiny model's tokenizer: [{input_ids, labels}], pad id."""
    dc = DataConfig(kind="chat", tokenizer=str(qwen))
    r = RecordRenderer(load_hf_tokenizer(str(qwen)), dc)
    lines = SAMPLE_CHAT.read_text(encoding="utf-8").splitlines()
    enc = encode_records([(f"line {i + 1}", json.loads(t)) for i, t in enumerate(lines)], r, SEQ, "error")
    assert len(enc.ids) == len(lines) >= 40
    return [{"input_ids": i, "labels": lab} for i, lab in zip(enc.ids, enc.labels)], r.tok.pad_token_id


def _per_record(model, x, y, key: str) -> list[torch.Tensor]:
    """Each record's per-token losses of a batch, in record order (rows first, then documents)."""
    with torch.no_grad():
        logits = model(x)
    per = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none").view(y.shape)
    out = []
    for row in range(y.shape[0]):
        docs = x[key][row]
        for d in (sorted(set(docs.tolist()) - {-1}) if key == "doc_ids" else [1]):
            out.append(per[row][(docs == d) & (y[row] != IGNORE_INDEX)])
    return out


def test_padded_and_packed_batches_give_each_records_own_loss(qwen):
    from shardwise.models.hf import build_hf_model

    records, pad = _records(qwen)
    batch = records[:9]
    model = build_hf_model(pretrained=str(qwen)).eval()
    alone = []
    for rec in batch:
        x, y = RecordCollator(pad)([rec])
        assert set(x) == {"input_ids", "attention_mask"} and x["attention_mask"].all()
        alone += _per_record(model, x, y, "attention_mask")

    # Dynamic padding: rows as long as the batch's longest record, not a block.
    x, y = RecordCollator(pad)(batch)
    assert y.shape == (9, max(len(r["input_ids"]) for r in batch) - 1)
    padded = _per_record(model, x, y, "attention_mask")
    # Packed into rows of 2 * SEQ tokens: fewer rows, positions restart per record.
    x, y = RecordCollator(pad, pack=True, block_size=2 * SEQ)(batch)
    assert set(x) == {"input_ids", "position_ids", "doc_ids"} and x["input_ids"].shape[0] < 9
    assert x["input_ids"].shape[1] <= 2 * SEQ
    rows = RowSequences([r["input_ids"] for r in batch], [r["labels"] for r in batch], 2 * SEQ, True, pad).rows
    order = [i for row in rows for i in row]
    packed = _per_record(model, x, y, "doc_ids")
    for k, i in enumerate(order):
        torch.testing.assert_close(packed[k], alone[i], atol=1e-5, rtol=1e-5)
    for k in range(9):
        torch.testing.assert_close(padded[k], alone[k], atol=1e-5, rtol=1e-5)
    # All in one row (no block_size): the same losses again.
    x, y = RecordCollator(pad, pack=True)(batch)
    assert x["input_ids"].shape[0] == 1
    torch.testing.assert_close(torch.cat(_per_record(model, x, y, "doc_ids")), torch.cat(alone), atol=1e-5,
                               rtol=1e-5)

    # The built-in trainer's collate: RowSequences rows of a whole block, cut to the batch's longest.
    rs = RowSequences([r["input_ids"] for r in batch], [r["labels"] for r in batch], SEQ, False, pad)
    x, y = collate_rows([rs[i] for i in range(4)])
    assert y.shape[1] == max(len(r["input_ids"]) for r in batch[:4]) - 1 < SEQ
    with pytest.raises(ValueError, match="record 0 of the batch has 200 tokens; rows hold block_size"):
        RecordCollator(pad, block_size=SEQ)([{"input_ids": np.arange(200) % 50, "labels": np.arange(200) % 50}])
    with pytest.raises(ValueError, match="3 input_ids and 2 labels"):
        RecordCollator(pad)([{"input_ids": [1, 2, 3], "labels": [1, 2]}])


def test_pack_auto_packs_records_but_not_text(qwen):
    sft = ["model.pretrained=" + json.dumps(str(qwen))]
    cfg = load_config("hf-sft", sft)
    assert cfg.data.pack == "auto" and cfg.data.packed
    assert not load_config(None, ["data.kind=text"]).data.packed
    assert load_config(None, ["data.kind=text", "data.pack=true"]).data.packed  # TOML true
    assert load_config("hf-sft", [*sft, "data.pack=false"]).data.pack == "false"
    assert not load_config("hf-sft", [*sft, "data.pack=false"]).data.packed
    with pytest.raises(ConfigError, match="data.pack"):
        load_config("hf-sft", [*sft, "data.pack=sometimes"])


@pytest.mark.parametrize("pack", [False, True])
def test_a_users_own_loop_trains_on_collated_records(qwen, pack):
    from shardwise import Session
    from shardwise.models.hf import build_hf_model

    records, pad = _records(qwen)
    torch.manual_seed(0)
    model = build_hf_model(pretrained=str(qwen))

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return token_sum_loss(logits, y) / (y != IGNORE_INDEX).sum().clamp(min=1)

    losses = []
    with Session() as session:
        model, opt = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        loader = session.dataloader(records, batch_size=8,
                                    collate_fn=RecordCollator(pad, pack=pack, block_size=SEQ))
        for step, (x, y) in enumerate(loader.forever()):
            losses.append(float(session.forward_backward(model, session.to_device(x), session.to_device(y),
                                                         loss_fn)))
            session.step(opt, max_norm=1.0)
            if step == 7:
                break
    assert all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < np.mean(losses[:2])


def test_gpt2_takes_packed_and_padded_records(tmp_path):
    """GPT-2 (learned absolute positions, no pipeline): packed rows restart its position embeddings
    at every record and the document mask keeps records apart, so each record's token losses
    packed, padded and alone are the same (1e-5), with and without a pipeline (test_pp_packed.py)."""
    from shardwise.models.hf import build_hf_model
    from tests.helpers.sft import chat_records, encoded_chat, per_record_losses, save_gpt2

    folder = save_gpt2(tmp_path / "gpt2", seed=3)
    enc, pad = encoded_chat(folder, chat_records(9, seed=5), SEQ)
    got = per_record_losses(build_hf_model(pretrained=str(folder)).eval(), enc, pad, 2 * SEQ)
    assert len(got["alone"]) == 9
    for how in ("packed", "padded"):
        for k in range(9):
            torch.testing.assert_close(got[how][k], got["alone"][k], atol=1e-5, rtol=1e-5)
    # Without the side inputs the packed row is one causal sequence: the losses differ (the
    # positions and the mask matter, so the equality above is not vacuous).
    x, y = RecordCollator(pad, pack=True, block_size=2 * SEQ)(enc)
    model = build_hf_model(pretrained=str(folder)).eval()
    with torch.no_grad():
        assert not torch.allclose(model(x), model(x["input_ids"]), atol=1e-3)
