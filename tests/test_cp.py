"""Context parallel (parallel.cp, all-to-all and ring attention): losses and parameters equal to one
process (fp32, 5 steps) for fsdp+cp at 2 and 4 ranks (dp_shard=2 x cp=2 among them) and fsdp+tp+cp at
4 ranks, on the built-in GPT and a tiny Hugging Face Llama with grouped kv heads; the layout's rules
(dp_shard excludes cp, torchtitan's arithmetic) and refusals."""

from __future__ import annotations

import pytest
import torch

from shardwise.core.config import ParallelConfig
from shardwise.core.layout import Layout, resolve_layout
from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.context.cp import resolve_cp_impl
from shardwise.testing import fixed_batches, run_distributed, train_fixed_batches
from shardwise.workloads import cross_entropy_loss

SEQ, VOCAB, STEPS, BATCH = 16, 96, 5, 4
GPT_CFG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=False)


def _build(kind: str) -> torch.nn.Module:
    if kind == "gpt":
        return GPT(GPT_CFG)
    from shardwise.models.hf import build_hf_model

    sizes = {"vocab_size": VOCAB, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 2}
    if kind == "mistral":
        # Every layer slides over 10 tokens of the 16: a cp chunk (8) fits inside the window, so the
        # window must be applied over the whole sequence by cp itself.
        return build_hf_model("mistral-7b", sliding_window=10, **sizes)
    # 4 query heads, 2 kv heads: cp=2 splits both; cp=4 (not run here) would repeat the kv heads.
    return build_hf_model("llama-tiny", **sizes)


def _train(kind: str, strategy: str = "single", **options: int) -> dict:
    from shardwise.runtime.session import Session
    from tests.helpers.mp import full_params

    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=5, loss_chunks=0)
    model = session.build(lambda: _build(kind))
    model, opt = session.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-2))
    out = train_fixed_batches(session, model, opt, fixed_batches(STEPS, BATCH, SEQ, VOCAB), max_norm=1.0,
                              loss_fn=cross_entropy_loss)
    out["params"] = full_params(model)
    out["dp"] = (session.dp_rank, session.dp_size, session.cp_rank)
    return out


def _cases(rank: int, world: int, cases: list) -> list[dict]:
    return [_train(kind, strategy, **opts) for kind, strategy, opts in cases]


def _assert_same(ref: dict, got: dict, what: str) -> None:
    # verify's own verdict at fp32 (losses within 1e-5 + 1e-4 relative, parameters within its tolerance).
    from shardwise.verify import compare

    report = compare(ref, got, "fp32")
    assert report.passed, f"{what}:\n{report.table()}"


def test_cp_equals_one_process_at_2_and_4_ranks() -> None:
    pytest.importorskip("transformers")
    refs = {kind: _train(kind) for kind in ("gpt", "llama", "mistral")}
    # One spawn per world size, several cases each: cp=2 alone (FSDP, and DDP averaging over the cp
    # ranks); cp=2 x dp_shard=2; tp=2 x cp=2 (FSDP over the cp ranks).
    # parallel.cp_impl = ring (torch's load-balanced ring attention) in the same spawns.
    ring = {"cp": 2, "cp_impl": "ring"}
    two = [("llama", "fsdp", {"cp": 2}), ("gpt", "ddp", {"cp": 2}), ("gpt", "fsdp", ring), ("llama", "fsdp", ring),
           ("mistral", "fsdp", {"cp": 2}), ("mistral", "fsdp", ring)]
    # Ring at cp=4 over the Llama's 2 kv heads (alltoall would repeat them): no head rule.
    # torchtitan's spelling, dp_shard excluding cp: dp_shard=2 x cp=2 on 4 ranks (strategy 'auto').
    four = [("gpt", "fsdp", {"cp": 2}), ("llama", "fsdp+tp", {"cp": 2, "tp": 2}), ("llama", "fsdp", ring),
            ("gpt", "fsdp+tp", {**ring, "tp": 2}), ("llama", "fsdp", {**ring, "cp": 4}),
            ("gpt", "auto", {"dp_shard": 2, "cp": 2})]
    got2 = run_distributed(_cases, 2, timeout_s=240, cases=two)
    got4 = run_distributed(_cases, 4, timeout_s=300, cases=four)
    assert [r[0]["dp"] for r in got2] == [(0, 1, 0), (0, 1, 1)]  # both ranks read the same sequences
    assert [r[0]["dp"] for r in got4] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    for results, cases in ((got2, two), (got4, four)):
        for i, (kind, strategy, opts) in enumerate(cases):
            for r in results:
                _assert_same(refs[kind], r[i], f"{kind} {strategy} {opts}")


def test_layout_cp_rules() -> None:
    layout = resolve_layout(ParallelConfig(strategy="fsdp", cp=2), 4)
    assert [layout.dp_coords(r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [layout.cp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert "cp 2 (alltoall" in layout.describe() and layout.to_dict()["cp"] == 2
    assert "cp 2 (ring: each rank holds 1/2" in layout.describe("ring")
    tp = resolve_layout(ParallelConfig(strategy="fsdp+tp", tp=2, cp=2), 8)
    assert [tp.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [tp.dp_coords(r)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ConfigError, match="parallel.cp=3 must divide the data-parallel ranks"):
        resolve_layout(ParallelConfig(strategy="fsdp", cp=3), 4)
    pp = Layout("fsdp+pp", dp=2, pp=2, cp=2)  # cp x pp runs (tests/test_pp_packed.py)
    assert [pp.cp_rank(r) for r in range(4)] == [0, 1, 0, 1] and pp.dp_coords(1) == (0, 1)
    assert resolve_cp_impl("auto", "cpu") == "alltoall" and resolve_cp_impl("ring", "cpu") == "ring"


@pytest.mark.parametrize("options, world, expect", [
    # torchtitan's arithmetic: dp_replicate x dp_shard x cp x tp x pp = world size, dp_shard without cp.
    (dict(dp_shard=2, cp=2), 4, ("fsdp", 1, 2, 2, 4)),
    (dict(dp_shard=1, cp=2), 2, ("fsdp", 1, 1, 2, 2)),  # FSDP shards over dp_shard x cp
    (dict(dp_replicate=2, dp_shard=2, cp=2), 8, ("hsdp", 2, 2, 2, 8)),
    (dict(dp_shard=2, cp=2, tp=2), 8, ("fsdp+tp", 1, 2, 2, 4)),
    (dict(dp_shard=2, cp=2, pp=2), 8, ("fsdp+pp", 1, 2, 2, 4)),
    (dict(strategy="ddp", cp=2), 4, ("ddp", 2, 1, 2, 4)),
    (dict(strategy="hsdp", hsdp_shard_size=4, cp=2), 8, ("hsdp", 2, 2, 2, 8)),
])
def test_dp_shard_excludes_cp(options: dict, world: int, expect: tuple) -> None:
    layout = resolve_layout(ParallelConfig(**options), world)
    got = (layout.strategy, layout.dp_replicate, layout.dp_shard, layout.cp, layout.dp)
    assert got == expect
    assert layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp * layout.pp == world
    assert layout.shard == (layout.dp_shard * layout.cp if layout.sharding == "fsdp" else 1)


def test_dp_shard_counting_cp_is_refused_with_what_changed() -> None:
    # The old meaning (dp_shard counted the cp ranks): a product of 8 on 4 ranks, and the message says so.
    with pytest.raises(ConfigError, match="dp_shard excludes cp .*divide its dp_shard by cp"):
        resolve_layout(ParallelConfig(dp_shard=4, cp=2), 4)
    with pytest.raises(ConfigError, match="cp=2 must divide hsdp's shard group of 3 ranks"):
        resolve_layout(ParallelConfig(strategy="hsdp", hsdp_shard_size=3, cp=2), 6)


def test_cp_refuses_heads_it_cannot_split() -> None:
    from shardwise.parallel.context.cp import check_cp_model

    with pytest.raises(ConfigError, match="must divide the attention heads"):
        check_cp_model(GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=6, n_embd=12)), 4)
    refused = r"runs the model families .*; Linear is not one of them\. Set parallel\.cp = 1"
    with pytest.raises(ConfigError, match=refused):
        check_cp_model(torch.nn.Linear(2, 2), 2)


def test_planner_counts_cp_and_chunked_logits() -> None:
    from shardwise.plan.cost import Fabric, step_time
    from shardwise.plan.cp import alltoall_bytes_per_layer, cp_candidates, logits_bytes
    from shardwise.plan.memory import memory_breakdown, precision
    from shardwise.plan.presets import model_preset

    spec = model_preset("llama-3-8b")  # 32 heads, 8 kv heads
    bf16 = precision("bf16")
    fabric = Fabric(gpus_per_node=8, intra_gbs=450, nic_gbs=50, peak_tflops=989)
    mem = {cp: memory_breakdown(spec, Layout("fsdp", dp=8, cp=cp), bf16, "adamw", seq=32768, micro_batch=1)
           for cp in (1, 2, 4)}
    assert mem[1].activations > 1.9 * mem[2].activations > 3.6 * mem[4].activations
    assert mem[1].params == mem[4].params  # model state is sharded over dp_shard x cp all the same
    t1 = step_time(spec, Layout("fsdp", dp=8), bf16, fabric, seq=32768, micro_batch=1, grad_accum=1)
    t4 = step_time(spec, Layout("fsdp", dp=8, cp=4), bf16, fabric, seq=32768, micro_batch=1, grad_accum=1)
    assert t4.tokens_per_step * 4 == t1.tokens_per_step and t4.compute_s < t1.compute_s
    assert t4.comm_exposed_s > t1.comm_exposed_s  # the all-to-alls are counted
    # kv heads (8) split over cp=4; over cp=16 they would be repeated to the 32 query heads.
    assert alltoall_bytes_per_layer(spec, 32768, 1, 2, cp=4) == (2 * 32 + 2 * 8) * 8192 * 128 * 2
    assert logits_bytes(32768, 128256, chunked=True) < logits_bytes(32768, 128256) / 20
    assert cp_candidates(64, 4096, 32) == [1]
    assert cp_candidates(8, 32768, 32) == [1, 2, 4, 8] and cp_candidates(8, 32768, 32, tp=2) == [1, 2, 4]


def test_refused_before_any_rank_starts() -> None:
    from shardwise.core.config import load_config
    from shardwise.preflight import check_run

    def check(world: int, *overrides: str) -> None:
        check_run(load_config(None, list(overrides)), world)

    with pytest.raises(ConfigError, match=r"parallel.cp=3 must divide the attention heads"):
        check(3, "parallel.strategy=fsdp", "parallel.cp=3")  # the tiny GPT has 4 heads
    check(3, "parallel.strategy=fsdp", "parallel.cp=3", "parallel.cp_impl=ring")  # the ring keeps every head
    with pytest.raises(ConfigError, match="train.loss_chunks = 4 cannot run here: tensor parallel"):
        check(2, "parallel.strategy=fsdp+tp", "parallel.tp=2", "train.loss_chunks=4")
    check(2, "parallel.strategy=fsdp", "parallel.cp=2")
    with pytest.raises(ConfigError, match="train.compile does not run with context parallel"):
        check(2, "parallel.strategy=fsdp", "parallel.cp=2", "train.compile=true")  # one owner: check_compile
