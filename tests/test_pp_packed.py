"""Pipeline parallel (pp = 2) on packed documents and instruction records, and pipeline x context
parallel (pp 2 x cp 2 at 4 ranks), train the same model as one process (``verify``'s own
comparison, fp32), through the built-in trainer's step:

* 2 ranks, one spawn, 5 steps: packed text on the built-in GPT (fsdp+pp, ZBV zero-bubble, 2
  stages per rank, meta init: each stage's FSDP root is materialised on its own): every stage
  builds its microbatch's document mask and the first its per-document positions; packed chat
  records (response-only loss) on a tiny untied Qwen2 (pp, GPipe): the 4-D mask and the
  restarted rotary positions reach the second stage; padded prompt/response records with
  gradient accumulation and activation checkpointing (ddp+pp, 1F1B; the pretrained weights fill
  checkpoint-wrapped layers); packed chat records on a tiny GPT-2 (pp, 1F1B): its learned
  positions restart per record on the first stage and every stage masks across records; packed
  chat on the Qwen2 with ``model.attention = "varlen"`` (each stage attends document by document
  from the microbatch's cu_seqlens, no mask). Under a
  pipeline the trainer keeps record batches at their full row length
  (``parallel.pipeline.pp.fixed_shape_collate``). The loss is the token sum over the global batch's trained
  tokens, summed over the microbatches. In the same spawn: the trainer's validation loss (token
  mean) of packed chat records under pp, and the packing proof: every token's loss of a packed
  and of a padded chat batch through the two stages (``session.eval_loss``) equals one process's,
  for the Qwen2 and the GPT-2.
* 4 ranks, one spawn, 3 steps: pp 2 x cp 2 (fsdp+pp) on packed text for the GPT and on packed
  chat records for the Qwen2 (its rotary positions are the chunk's global positions on every
  stage; the whole-sequence mask of each microbatch reaches the all-to-all attention), the GPT with
  activation checkpointing (the backward recomputes attention under the microbatch's own mask);
  the Qwen2 with gradient accumulation (its GQA kv heads: transformers repeats them only where it
  guessed packed documents from a chunk's positions, and the cp ranks must still agree on them);
  and pp 2 x tp 2 with sequence parallel (fsdp+tp+pp) on the same data: a later stage receives a
  sequence shard, of a length tp may not divide (chat rows are padded to the batch's longest).

The references run in this process."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from shardwise.core.config import load_config  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402
from shardwise.verify import compare, reference_config, run_steps  # noqa: E402
from tests.helpers.sft import (  # noqa: E402
    chat_records,
    encoded_chat,
    save_gpt2,
    verify_cases,
)
from tests.test_cp_packed import _cp_rank, _val_loss, packed_inputs  # noqa: E402

COMMON = ["train.lr=1e-3", "train.warmup_steps=1", "train.eval_every=0", "train.progress=false",
          "checkpoint.every=0", "parallel.pp=2"]


def _gpt_text(tmp, docs, tok, strategy, *extra):
    return load_config(None, [
        "model.preset=nano", "model.overrides.block_size=64", "model.overrides.n_head=4",
        "model.overrides.n_layer=4", "data.kind=text", f'data.path="{docs}"', f'data.tokenizer="{tok}"',
        f'data.cache_dir="{tmp / "tcache"}"', "data.pack=true", "train.micro_batch_size=4",
        f'parallel.strategy="{strategy}"', *COMMON, *extra])


def _sft(tmp, model, data, kind, strategy, *extra):
    return load_config("hf-sft", [
        f'model.pretrained="{model}"', f'data.path="{data}"', f'data.kind="{kind}"',
        f'data.cache_dir="{tmp / "cache"}"', "train.micro_batch_size=2", "parallel.pp_microbatches=2",
        f'parallel.strategy="{strategy}"', *COMMON, *extra])


def _per_token(model, x, y):
    """Per-token losses ``(B, T)`` of ``model(x)`` in this process (-100 targets give 0)."""
    import torch.nn.functional as F

    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100,
                           reduction="none").view(y.shape)


def _batches(model_folder, records, block):
    from shardwise.data.collate import RecordCollator

    enc, pad = encoded_chat(Path(model_folder), records, block)
    return {"packed": RecordCollator(pad, pack=True, block_size=block)(enc), "padded": RecordCollator(pad)(enc)}


def _pp_rank(rank: int, world_size: int, cases: list[dict], val_cfg, val_out: str, model_folders: dict,
             records: list[dict]) -> dict:
    """``_cp_rank`` (verify cases, validation loss), then per-token losses of a packed and a padded
    chat batch under pp = 2 for each model folder, collected by the loss function on the last stage
    (rank 1)."""
    import torch.nn.functional as F

    from shardwise import Session
    from shardwise.core.config import ParallelConfig
    from shardwise.models.hf import build_hf_model

    out = _cp_rank(rank, world_size, cases, val_cfg, val_out)
    out["per_token"] = {}
    for name, model_folder in model_folders.items():
        for how, (x, y) in _batches(model_folder, records, 192).items():
            per: list = []

            def collect(logits, t, per=per):
                per.append(F.cross_entropy(logits.flatten(0, 1).float(), t.flatten(), ignore_index=-100,
                                           reduction="none").view(t.shape).detach())
                return per[-1].sum()

            with Session(parallel=ParallelConfig(strategy="pp", pp_microbatches=y.shape[0])) as session:
                model, _ = session.prepare(build_hf_model(pretrained=model_folder).eval())
                session.eval_loss(model, session.to_device(x), y, collect)
            out["per_token"][name, how] = torch.cat(per) if per else None
    return out


def _check(cases: dict, refs: dict, results: list) -> None:
    failed = []
    for name, got in zip(cases, results):
        assert refs[name]["losses"][-1] < refs[name]["losses"][0], name  # it trained
        report = compare(refs[name], got, "fp32")
        if not report.passed:
            failed.append(f"{name}:\n{report.table()}")
    assert not failed, "\n".join(failed)


@pytest.fixture
def data(tmp_path):
    return dict(zip(("tok", "docs", "model", "chat", "instruct"), packed_inputs(tmp_path)))


@pytest.fixture
def gpt2(tmp_path):
    return save_gpt2(tmp_path / "my-gpt2", seed=2)


def test_pp_on_packed_text_and_records_equals_one_process(tmp_path, data, gpt2):
    d = data
    cases = {
        "gpt-text-packed-fsdp+pp-zbv": _gpt_text(tmp_path, d["docs"], d["tok"], "fsdp+pp", "parallel.nproc=2",
                                                 'parallel.pp_schedule="zbv"', "parallel.pp_stages_per_rank=2"),
        "qwen2-chat-packed-pp-gpipe": _sft(tmp_path, d["model"], d["chat"], "chat", "pp", "parallel.nproc=2",
                                           "model.overrides.block_size=192", 'parallel.pp_schedule="gpipe"',
                                           "data.val_fraction=0.25"),
        "qwen2-instruct-padded-ddp+pp-accum-ac": _sft(
            tmp_path, d["model"], d["instruct"], "instruct", "ddp+pp", "parallel.nproc=2", "data.pack=false",
            "model.overrides.block_size=96", "train.grad_accum_steps=2", 'parallel.activation_checkpointing="full"'),
        # GPT-2's learned positions restart per record on the first stage; its tied head stays
        # exact without a data-parallel wrapper (parallel/pipeline/ties.py).
        "gpt2-chat-packed-pp-1f1b": _sft(tmp_path, gpt2, d["chat"], "chat", "pp", "parallel.nproc=2",
                                         "model.overrides.block_size=192", 'parallel.pp_schedule="1f1b"'),
        # Variable-length attention (models/varlen.py): every stage attends per document from the
        # microbatch's cu_seqlens, no mask (one SDPA call per document on CPU).
        "qwen2-chat-packed-pp-varlen": _sft(tmp_path, d["model"], d["chat"], "chat", "pp", "parallel.nproc=2",
                                            "model.overrides.block_size=192", 'model.attention="varlen"'),
    }
    assert cases["gpt-text-packed-fsdp+pp-zbv"].data.packed and cases["qwen2-chat-packed-pp-gpipe"].data.packed
    refs = {name: run_steps(reference_config(cfg, 1), 5, tmp_path / f"ref-{name}") for name, cfg in cases.items()}
    val_cfg = cases["qwen2-chat-packed-pp-gpipe"]
    val_ref = _val_loss(reference_config(val_cfg, 1), tmp_path / "ref-val")
    records = chat_records(10, seed=4)
    ranks = run_distributed(_pp_rank, 2, timeout_s=400, cases=[
        {"cfg": cfg, "steps": 5, "out": str(tmp_path / f"run-{name}")} for name, cfg in cases.items()],
        val_cfg=val_cfg, val_out=str(tmp_path / "run-val"), records=records,
        model_folders={"qwen2": str(d["model"]), "gpt2": str(gpt2)})
    # The packing proof under pp: each token's loss of a packed (and of a padded) chat batch through
    # the two stages equals one process's, so every record's losses do (tests/test_sft_verify.py
    # shows packed = padded = alone in one process).
    from shardwise.models.hf import build_hf_model

    for name, folder in (("qwen2", d["model"]), ("gpt2", gpt2)):
        one = build_hf_model(pretrained=str(folder)).eval()
        for how, (x, y) in _batches(folder, records, 192).items():
            got = ranks[1]["per_token"][name, how]  # the last stage's rank
            torch.testing.assert_close(got, _per_token(one, x, y), atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=name, h=how: f"{n} {h}: {m}")
    assert [r["val"] for r in ranks] == pytest.approx([val_ref] * 2, rel=1e-5)
    assert all(got["dp_size"] == 1 for got in ranks[0]["verify"])  # both ranks are one pipeline
    _check(cases, refs, ranks[0]["verify"])


def test_pp_with_cp_and_with_tp_sp_on_packed_data_equals_one_process(tmp_path, data):
    d = data
    four = ["parallel.nproc=4", "parallel.cp=2"]
    three_d = ["parallel.nproc=4", "parallel.tp=2", "parallel.sequence_parallel=true"]
    cases = {
        "gpt-text-packed-pp2-cp2-ac": _gpt_text(tmp_path, d["docs"], d["tok"], "fsdp+pp", *four,
                                                'parallel.activation_checkpointing="full"'),
        "qwen2-chat-packed-pp2-cp2-accum": _sft(tmp_path, d["model"], d["chat"], "chat", "fsdp+pp", *four,
                                                "model.overrides.block_size=192", "train.grad_accum_steps=2"),
        "gpt-text-packed-pp2-tp2-sp": _gpt_text(tmp_path, d["docs"], d["tok"], "fsdp+tp+pp", *three_d),
        "qwen2-chat-packed-pp2-tp2-sp": _sft(tmp_path, d["model"], d["chat"], "chat", "fsdp+tp+pp", *three_d,
                                             "model.overrides.block_size=192"),
    }
    refs = {name: run_steps(reference_config(cfg, 1), 3, tmp_path / f"ref-{name}") for name, cfg in cases.items()}
    ranks = run_distributed(verify_cases, 4, timeout_s=500, cases=[
        {"cfg": cfg, "steps": 3, "out": str(tmp_path / f"run-{name}")} for name, cfg in cases.items()])
    assert all(got["dp_size"] == 1 for got in ranks[0])  # 2 stages x one cp (or tp) pair: the same rows
    _check(cases, refs, ranks[0])
