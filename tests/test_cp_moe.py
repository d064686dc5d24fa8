"""Context parallel on the Hugging Face mixture-of-experts families (Mixtral, Qwen3-MoE) on plain
token sequences: losses (with transformers' router aux loss) and parameters equal to one process
(fp32, 4 steps) for fsdp+cp and fsdp+cp+ep at 2 and 4 ranks. Packed records stay refused with cp
on MoE models (the routers would count each chunk's padding; preflight says so).

CI time: two spawns (2 and 4 ranks) of 2-layer models, about a minute on 2 idle cores."""

from __future__ import annotations

import pytest
import torch

from shardwise.config import ParallelConfig
from shardwise.testing import fixed_batches, run_distributed, train_fixed_batches

SEQ, VOCAB, STEPS, BATCH = 16, 64, 4, 4
FAMILIES = {"mixtral": "mixtral-tiny", "qwen3_moe": "qwen3-moe-tiny"}


def _train(family: str, strategy: str = "single", **options: int) -> dict:
    from shardwise.models.hf import build_hf_model
    from shardwise.models.moe import with_aux_loss
    from shardwise.runtime.session import Session
    from shardwise.workloads import cross_entropy_loss
    from tests.helpers.mp import full_params

    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=5, loss_chunks=0)
    model = session.build(lambda: build_hf_model(FAMILIES[family], vocab_size=VOCAB, num_attention_heads=4,
                                                 num_key_value_heads=2, hidden_size=32, num_hidden_layers=2,
                                                 output_router_logits=True))
    seen: list[int] = []  # the sequence length the model is given: a cp rank's chunk
    model.hf.model.embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[-1]))
    model, opt = session.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-2))
    out = train_fixed_batches(session, model, opt, fixed_batches(STEPS, BATCH, SEQ, VOCAB), max_norm=1.0,
                              loss_fn=with_aux_loss(cross_entropy_loss))
    out["params"] = full_params(model)
    out["seq_seen"] = max(seen)
    session.close()
    return out


def _cases(rank: int, world: int, cases: list) -> list[dict]:
    return [_train(family, strategy, **opts) for family, strategy, opts in cases]


def test_cp_on_hf_moe_families_equals_one_process_at_2_and_4_ranks() -> None:
    pytest.importorskip("transformers")
    from shardwise.verify import compare

    refs = {family: _train(family) for family in FAMILIES}
    two = [(f, "fsdp", {"cp": 2}) for f in FAMILIES] + [(f, "fsdp", {"cp": 2, "ep": 2}) for f in FAMILIES]
    four = [(f, "fsdp", {"cp": 2, "ep": 2}) for f in FAMILIES] + [("qwen3_moe", "fsdp", {"cp": 2, "ep": 4})]
    for world, cases in ((2, two), (4, four)):
        results = run_distributed(_cases, world, timeout_s=300, cases=cases)
        for i, (family, strategy, opts) in enumerate(cases):
            for r in results:
                report = compare(refs[family], r[i], "fp32")
                assert report.passed, f"{family} {strategy} {opts} at {world} ranks:\n{report.table()}"
                assert r[i]["seq_seen"] == SEQ // opts["cp"]  # each rank ran on its chunk only
