"""Tensor parallel with sequence parallel (fsdp+tp, tp = 2, ``parallel.sequence_parallel``) on packed
documents and instruction records trains the same model as one process (``verify``'s own comparison,
fp32, 3 steps), through the built-in trainer's step, in one spawn of 2 gloo ranks:

* packed text (``data.pack = true``) on the built-in GPT: the norms see a sequence shard, the
  attention the whole sequence with its document mask and per-document learned positions;
* chat records packed (response-only loss) on a tiny Qwen2 folder: the 4-D mask and the restarted
  rotary positions reach every layer's attention under the sequence-parallel plan;
* prompt/response records padded (dynamic padding: a row length not a multiple of tp is padded
  to one by the plan's input) with gradient accumulation.

The references run in this process."""

import pytest

pytest.importorskip("transformers")

from shardwise.core.config import load_config  # noqa: E402
from shardwise.testing import run_distributed  # noqa: E402
from shardwise.verify import compare, reference_config, run_steps  # noqa: E402
from tests.helpers.sft import verify_cases  # noqa: E402
from tests.test_cp_packed import packed_inputs  # noqa: E402

STEPS = 3
COMMON = ["train.lr=1e-3", "train.warmup_steps=1", "train.eval_every=0", "train.progress=false",
          "checkpoint.every=0", "parallel.nproc=2", "parallel.tp=2", "parallel.sequence_parallel=true",
          'parallel.strategy="fsdp+tp"']


def _sft(tmp, model, data, kind, *extra):
    return load_config("hf-sft", [
        f'model.pretrained="{model}"', f'data.path="{data}"', f'data.kind="{kind}"',
        f'data.cache_dir="{tmp / "cache"}"', "train.micro_batch_size=2", *COMMON, *extra])


def test_sequence_parallel_on_packed_text_and_records_equals_one_process(tmp_path):
    tok, docs, model, chat, instruct = packed_inputs(tmp_path)
    cases = {
        "gpt-text-packed": load_config(None, [
            "model.preset=nano", "model.overrides.block_size=64", "model.overrides.n_head=4", "data.kind=text",
            f'data.path="{docs}"', f'data.tokenizer="{tok}"', f'data.cache_dir="{tmp_path / "tcache"}"',
            "data.pack=true", "train.micro_batch_size=4", *COMMON]),
        "qwen2-chat-packed": _sft(tmp_path, model, chat, "chat", "model.overrides.block_size=192"),
        "qwen2-instruct-padded-accum": _sft(tmp_path, model, instruct, "instruct", "data.pack=false",
                                            "model.overrides.block_size=96", "train.grad_accum_steps=2"),
    }
    assert cases["gpt-text-packed"].data.packed and cases["qwen2-chat-packed"].data.packed
    refs = {name: run_steps(reference_config(cfg, 1), STEPS, tmp_path / f"ref-{name}") for name, cfg in cases.items()}
    ranks = run_distributed(verify_cases, 2, timeout_s=300, cases=[
        {"cfg": cfg, "steps": STEPS, "out": str(tmp_path / f"run-{name}")} for name, cfg in cases.items()])
    failed = []
    for i, name in enumerate(cases):
        got = ranks[0][i]
        assert got["dp_size"] == 1, name  # both ranks are one tp group reading the same sequences
        assert refs[name]["losses"][-1] < refs[name]["losses"][0], name  # it trained
        report = compare(refs[name], got, "fp32")
        if not report.passed:
            failed.append(f"{name}:\n{report.table()}")
    assert not failed, "\n".join(failed)
