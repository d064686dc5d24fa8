"""Context parallel (parallel.cp = 2, all-to-all attention; ring attention for the packed cases) on
packed documents and instruction records trains the same model as one process (``verify``'s own
comparison, fp32, 3 steps), through the built-in trainer's step, in one spawn of 2 gloo ranks:

* packed text (``data.pack = true``, own JSONL documents) on the built-in GPT under fsdp: the
  document mask and the per-document positions of the whole sequence reach every rank's heads;
* chat records packed (response-only loss) on a tiny Qwen2 folder under fsdp;
* prompt/response records padded (dynamic padding gives lengths that are not a multiple of cp)
  under ddp with gradient accumulation: the token-sum loss's denominator spans the cp ranks;
* the trainer's validation loss (token mean) of packed chat records.

The references run in this process."""

import pytest
import torch

pytest.importorskip("transformers")

from shardwise.core.config import load_config, replace_in  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402
from shardwise.verify import compare, reference_config, run_steps  # noqa: E402
from tests.helpers.sft import chat_records, instruct_records, save_qwen2, verify_cases, write_jsonl  # noqa: E402
from tests.helpers.text import corpus_text, make_tokenizer  # noqa: E402
from tests.helpers.text import write_jsonl as write_text_jsonl  # noqa: E402

STEPS = 3


def _val_loss(cfg, out) -> float:
    """The trainer's validation loss (token mean over 3 batches) of ``cfg``'s freshly built model."""
    from shardwise.runtime.session import Session
    from shardwise.runtime.trainer import Trainer, evaluate

    with Session(parallel=cfg.parallel, seed=cfg.train.seed, loss_chunks=cfg.train.loss_chunks) as session:
        trainer = Trainer(cfg, out, session)
        return evaluate(session, trainer.model, trainer.workload, trainer.val_loader, 3)


def _cp_rank(rank: int, world_size: int, cases: list[dict], val_cfg, val_out: str) -> dict:
    """Rank function of the one spawn: ``verify_cases``, then the validation loss of ``val_cfg``."""
    return {"verify": verify_cases(rank, world_size, cases), "val": _val_loss(val_cfg, val_out)}
COMMON = ["train.lr=1e-3", "train.warmup_steps=1", "train.eval_every=0", "train.progress=false",
          "checkpoint.every=0", "parallel.nproc=2", "parallel.cp=2"]


def _sft(tmp, model, data, kind, strategy, *extra):
    return load_config("hf-sft", [
        f'model.pretrained="{model}"', f'data.path="{data}"', f'data.kind="{kind}"',
        f'data.cache_dir="{tmp / "cache"}"', "train.micro_batch_size=2", f'parallel.strategy="{strategy}"',
        *COMMON, *extra])


def _documents(n: int) -> list[str]:
    text = corpus_text(30000)
    g = torch.Generator().manual_seed(3)
    docs = []
    for _ in range(n):
        start = int(torch.randint(0, len(text) - 200, (1,), generator=g))
        size = int(torch.randint(20, 160, (1,), generator=g))
        docs.append(text[start:start + size].strip() or "ok")
    return docs


def packed_inputs(tmp_path) -> tuple:
    """A tokenizer, packed-text documents, a pretrained Qwen2 folder, chat and instruct records:
    the inputs every packed-data spawn (cp, sp, pp) trains on."""
    return (make_tokenizer(tmp_path / "tok"),
            write_text_jsonl(tmp_path / "docs.jsonl", _documents(120)),
            save_qwen2(tmp_path / "my-qwen", seed=1),
            write_jsonl(tmp_path / "chat.jsonl", chat_records(60, seed=1)),
            write_jsonl(tmp_path / "instruct.jsonl", instruct_records(60, seed=2)))


def test_cp_on_packed_text_and_records_equals_one_process(tmp_path):
    tok, docs, model, chat, instruct = packed_inputs(tmp_path)
    cases = {
        # 64-token rows of documents of ~5-40 tokens: several documents per row, cut across ranks.
        "gpt-text-packed-fsdp": load_config(None, [
            "model.preset=nano", "model.overrides.block_size=64", "model.overrides.n_head=4", "data.kind=text",
            f'data.path="{docs}"', f'data.tokenizer="{tok}"', f'data.cache_dir="{tmp_path / "tcache"}"',
            "data.pack=true", "data.val_fraction=0.1", "train.micro_batch_size=4", 'parallel.strategy="fsdp"',
            *COMMON]),
        "qwen2-chat-packed-fsdp": _sft(tmp_path, model, chat, "chat", "fsdp", "model.overrides.block_size=192",
                                       "data.val_fraction=0.25"),
        "qwen2-instruct-padded-ddp-accum": _sft(tmp_path, model, instruct, "instruct", "ddp", "data.pack=false",
                                                "model.overrides.block_size=96", "train.grad_accum_steps=2"),
    }
    assert cases["gpt-text-packed-fsdp"].data.packed and cases["qwen2-chat-packed-fsdp"].data.packed
    refs = {name: run_steps(reference_config(cfg, 1), STEPS, tmp_path / f"ref-{name}") for name, cfg in cases.items()}
    # The ring (parallel.cp_impl = ring): the document mask cut per ring step; same references.
    for name in ("gpt-text-packed-fsdp", "qwen2-chat-packed-fsdp"):
        cases[f"{name}-ring"] = replace_in(cases[name], **{"parallel.cp_impl": "ring"})
        refs[f"{name}-ring"] = refs[name]
    val_cfg = cases["qwen2-chat-packed-fsdp"]
    val_ref = _val_loss(reference_config(val_cfg, 1), tmp_path / "ref-val")
    ranks = run_distributed(_cp_rank, 2, timeout_s=300, cases=[
        {"cfg": cfg, "steps": STEPS, "out": str(tmp_path / f"run-{name}")} for name, cfg in cases.items()],
        val_cfg=val_cfg, val_out=str(tmp_path / "run-val"))
    # Validation: the token mean over the whole sequences, each cp rank holding a chunk's token sum.
    assert [r["val"] for r in ranks] == pytest.approx([val_ref] * 2, rel=1e-5)
    failed = []
    for i, name in enumerate(cases):
        got = ranks[0]["verify"][i]
        assert got["dp_size"] == 1, name  # both ranks are one cp group reading the same sequences
        assert refs[name]["losses"][-1] < refs[name]["losses"][0], name  # it trained
        report = compare(refs[name], got, "fp32")
        if not report.passed:
            failed.append(f"{name}:\n{report.table()}")
    assert not failed, "\n".join(failed)


def test_chunk_batch_keeps_the_whole_sequence_mask_and_cuts_tokens_and_positions():
    from shardwise.models.masking import attention_mask_4d
    from shardwise.parallel.context.cp import CPState, chunk_batch

    ids = torch.arange(1, 15).view(2, 7)
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, -1, -1, -1]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 0, 0]])
    y = ids + 100
    y[1, 4:] = -100
    # 7 tokens over cp = 2: right-padded to 8 (doc -1, label -100), each rank 4 of them.
    padded_doc = torch.cat([doc, torch.full((2, 1), -1)], dim=1)
    whole = attention_mask_4d({"doc_ids": padded_doc})
    for rank, cols in ((0, slice(0, 4)), (1, slice(4, 8))):
        state = CPState()
        x, t = chunk_batch({"input_ids": ids, "doc_ids": doc, "position_ids": pos}, y, rank, 2, state)
        assert set(x) == {"input_ids", "position_ids"}  # the mask goes to the attention, not the model
        assert torch.equal(state.mask, whole)
        assert torch.equal(x["position_ids"], torch.cat([pos, torch.zeros(2, 1, dtype=pos.dtype)], 1)[:, cols])
        assert torch.equal(t, torch.cat([y, torch.full((2, 1), -100)], 1)[:, cols])
    assert not whole[0, 0, 3, 2] and whole[0, 0, 4, 3] and not whole[0, 0, 5, 4]  # documents 0 | 1 | 2
    # Padded records (attention_mask): positions 0..T-1 of the whole row, cut; plain ids: no mask.
    state = CPState()
    x, _ = chunk_batch({"input_ids": ids[:, :6], "attention_mask": (doc[:, :6] >= 0).long()}, y[:, :6], 1, 2, state)
    assert x["position_ids"].tolist() == [[3, 4, 5]] * 2 and state.mask.shape == (2, 1, 6, 6)
    x, _ = chunk_batch(ids[:, :6], y[:, :6], 1, 2, state)
    assert state.mask is None and torch.equal(x, ids[:, 3:6])


def test_a_chunk_mask_without_the_whole_sequence_is_refused():
    import torch.nn.functional as F

    from shardwise.errors import ConfigError
    from shardwise.parallel.context.cp import CPState, _UlyssesMode

    q = torch.zeros(1, 2, 4, 8)
    refused = pytest.raises(ConfigError, match="attention mask built for one chunk.*session.forward_backward")
    with refused, _UlyssesMode(None, 2, CPState()):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
