"""Context parallel on the Hugging Face mixture-of-experts families (Mixtral, Qwen3-MoE): losses
(with transformers' router aux loss) and parameters equal to one process (fp32, 4 steps) for
fsdp+cp and fsdp+cp+ep at 2 and 4 ranks, on plain token sequences and on packed records (chat-like
rows: several documents per row, padding at the end, labels -100 on prompts and padding). On packed
rows each cp rank's routers leave its chunk's padding out of the load balancing (the chunk's
``real_tokens``, parallel/cp.chunk_batch) and the loss is the trainer's token sum over the global
batch (runtime.token_loss), so the chunks' unequal numbers of trained tokens change nothing.

CI time: two spawns (2 and 4 ranks) of 2-layer models, about a minute and a half on 2 idle cores."""

from __future__ import annotations

import pytest
import torch

from shardwise.core.config import ParallelConfig
from shardwise.testing import fixed_batches, run_distributed, train_fixed_batches

SEQ, VOCAB, STEPS, BATCH = 16, 64, 4, 4
FAMILIES = {"mixtral": "mixtral-tiny", "qwen3_moe": "qwen3-moe-tiny"}


def packed_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 11) -> list[tuple[dict, torch.Tensor]]:
    """Global batches of packed records: each row 1-3 documents and 0-3 padding tokens at its end
    (``doc_ids`` -1), positions restarting per document, labels -100 on each document's first
    tokens (a prompt), across documents and on padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        doc = torch.full((batch, seq), -1)
        pos = torch.zeros((batch, seq), dtype=torch.long)
        for r in range(batch):
            real = seq - int(torch.randint(0, 4, (1,), generator=g))
            cuts = sorted(int(c) for c in torch.randint(1, real, (int(torch.randint(0, 3, (1,), generator=g)),),
                                                        generator=g).unique())
            for d, (a, b) in enumerate(zip([0, *cuts], [*cuts, real], strict=True)):
                doc[r, a:b], pos[r, a:b] = d, torch.arange(b - a)
        y = torch.full((batch, seq), -100)
        same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, :-1] >= 0)
        y[:, :-1] = torch.where(same, ids[:, 1:], -100)
        y[pos < 2] = -100  # a prompt: trained on the response only
        out.append(({"input_ids": ids, "position_ids": pos, "doc_ids": doc}, y))
    return out


def _train_packed(session, model, opt) -> dict:  # noqa: ANN001 - the test's own loop
    """The built-in trainer's step on packed records, written out on the Session: the loss is a token
    sum scaled by the global batch's trained tokens (runtime.token_loss), the aux loss added after."""
    from shardwise.models.moe import with_aux_loss
    from shardwise.runtime.token_loss import step_scale, token_sum, token_sum_loss

    losses, norms = [], []
    per = BATCH // session.dp_size
    for x, y in packed_batches(STEPS, BATCH, SEQ, VOCAB):
        rows = slice(session.dp_rank * per, (session.dp_rank + 1) * per)
        x, y = {k: v[rows] for k, v in x.items()}, y[rows]
        scale, _ = step_scale(session, [(x, y)])
        loss_fn = token_sum(with_aux_loss(lambda output, target, s=scale: token_sum_loss(output, target) * s))
        loss = session.forward_backward(model, x, y, loss_fn)
        norms.append(float(torch.as_tensor(session.step(opt, max_norm=1.0))))
        # Each rank's share of the global token mean (and its aux term, whose rank mean is one
        # process's): their mean over the ranks is the step's loss.
        losses.append(session.all_reduce(float(loss), op="mean"))
    return {"losses": losses, "norms": norms}


def _train(family: str, strategy: str = "single", packed: bool = False, **options: int) -> dict:
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
    if packed:
        out = _train_packed(session, model, opt)
    else:
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

    refs = {(family, packed): _train(family, packed=packed) for family in FAMILIES for packed in (False, True)}
    two = ([(f, "fsdp", {"cp": 2}) for f in FAMILIES] + [(f, "fsdp", {"cp": 2, "ep": 2}) for f in FAMILIES]
           + [(f, "fsdp", {"cp": 2, "ep": 2, "packed": True}) for f in FAMILIES])
    four = ([(f, "fsdp", {"cp": 2, "ep": 2}) for f in FAMILIES] + [("qwen3_moe", "fsdp", {"cp": 2, "ep": 4})]
            + [(f, "fsdp", {"cp": 2, "ep": 2, "packed": True}) for f in FAMILIES])
    for world, cases in ((2, two), (4, four)):
        results = run_distributed(_cases, world, timeout_s=300, cases=cases)
        for i, (family, strategy, opts) in enumerate(cases):
            for r in results:
                report = compare(refs[family, bool(opts.get("packed"))], r[i], "fp32")
                assert report.passed, f"{family} {strategy} {opts} at {world} ranks:\n{report.table()}"
                assert r[i]["seq_seen"] == SEQ // opts["cp"]  # each rank ran on its chunk only


def test_a_chunks_padding_is_left_out_of_the_routers_balance() -> None:
    """Without a chunk's ``real_tokens`` the packed case above would differ from one process: the
    routers would balance over padding (the defect the test above rules out at 2 and 4 ranks)."""
    from shardwise.models.masking import real_token_mask
    from shardwise.parallel.context.cp import CPState, chunk_batch

    (x, y), = packed_batches(1, BATCH, SEQ, VOCAB)
    assert not bool(real_token_mask(x).all())  # the batches have padding
    whole = real_token_mask(x)
    for impl in ("alltoall", "ring"):
        pieces = []
        for rank in range(2):
            chunk, _ = chunk_batch(x, y, rank, 2, CPState(impl), real_tokens=True)
            assert set(chunk) == {"input_ids", "position_ids", "real_tokens"}
            pieces.append(chunk["real_tokens"])
        assert sum(int(p.sum()) for p in pieces) == int(whole.sum())  # every real token, on one rank
        plain, _ = chunk_batch(x, y, 0, 2, CPState(impl))
        assert "real_tokens" not in plain  # a pipeline's stages take no such input


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_the_moe_families_without_cp_are_refused_by_name(family: str) -> None:
    """Qwen2-MoE and OLMoE have no cp proof here: one refusal that names the family and what does run,
    with no dead-end suggestion (no "train on unpacked text")."""
    from shardwise.core.families import MOE_FAMILIES
    from shardwise.errors import ConfigError
    from shardwise.parallel.context.cp import check_cp_family

    assert family in MOE_FAMILIES
    with pytest.raises(ConfigError) as refused:
        check_cp_family(family, 2)
    text = str(refused.value)
    assert f"{family} is not one of them" in text and "parallel.ep" in text and "unpacked" not in text
