"""Ring attention (parallel.cp_impl = ring): values and gradients equal to plain attention over the
whole sequence at cp=2 and cp=4 (causal, grouped kv heads, packed documents with padding) in one
spawn; the head-tail layout; what the ring allows that the all-to-all refuses. Training under ring
is verified against one process in tests/test_cp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.errors import ConfigError
from shardwise.parallel.context.cp import resolve_cp_impl, split_sequence
from shardwise.parallel.context.ring import ring_index
from shardwise.testing import run_distributed


def _doc_mask(seq: int) -> torch.Tensor:
    """[2, 1, S, S] bool: row 0 packs documents of 5, 9 and the rest tokens; row 1 is one document whose
    last 3 tokens are padding (keys hidden, a padding query sees itself), as models.masking builds."""
    from shardwise.models.masking import attention_mask_4d

    doc = torch.zeros(2, seq, dtype=torch.long)
    doc[0, 5:14], doc[0, 14:] = 1, 2
    pad = torch.ones(2, seq, dtype=torch.long)
    pad[1, -3:] = 0
    return attention_mask_4d({"doc_ids": doc, "attention_mask": pad})


def _ring_vs_dense(rank: int, world: int) -> list[tuple[str, float]]:
    import torch.distributed as dist

    from shardwise.parallel.context.ring import ring_attention

    # cp=4 over all ranks; cp=2 over {0, 1} and {2, 3} (every rank creates every group, same order).
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {4: (dist.group.WORLD, rank), 2: (pairs[rank // 2], rank % 2)}
    seq, errors = 32, []
    for cp, (group, cp_rank) in groups.items():
        for case in ("causal", "gqa", "documents"):
            g = torch.Generator().manual_seed(7)
            kv_heads = 2 if case == "gqa" else 4
            q = torch.randn(2, 4, seq, 8, generator=g)
            k, v = (torch.randn(2, kv_heads, seq, 8, generator=g) for _ in range(2))
            dout = torch.randn(2, 4, seq, 8, generator=g)
            mask = _doc_mask(seq) if case == "documents" else None
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, is_causal=mask is None,
                                                 enable_gqa=kv_heads != 4, scale=0.3)
            ref.backward(dout)
            at = ring_index(seq, cp_rank, cp)
            mine = [t[:, :, at].clone().requires_grad_() for t in (q, k, v)]
            bias = None if mask is None else torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
            out = ring_attention(*mine, group, scale=0.3, bias=bias)
            out.backward(dout[:, :, at])
            errors.append((f"cp={cp} {case} out", (out - ref[:, :, at]).abs().max().item()))
            for name, t, r in zip("qkv", mine, ref_in):
                errors.append((f"cp={cp} {case} d{name}", (t.grad - r.grad[:, :, at]).abs().max().item()))
    return errors


def test_ring_attention_equals_dense_attention_at_cp_2_and_4() -> None:
    results = run_distributed(_ring_vs_dense, 4, timeout_s=120)
    for rank, errors in enumerate(results):
        for what, err in errors:
            assert err < 2e-5, f"rank {rank}: {what} differs by {err}"


def test_head_tail_layout_and_ring_rules() -> None:
    # Each cp rank holds chunks r and 2cp-1-r of 2cp: equal causal work at every ring step.
    assert ring_index(8, 0, 2).tolist() == [0, 1, 6, 7] and ring_index(8, 1, 2).tolist() == [2, 3, 4, 5]
    every = torch.cat([ring_index(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    x = torch.arange(16).view(2, 8)
    assert split_sequence(x, 1, 2, "ring").tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    with pytest.raises(ConfigError, match="divisible by 2 x parallel.cp = 4"):
        split_sequence(torch.zeros(1, 6), 0, 2, "ring")
    assert resolve_cp_impl("ring", "cpu") == "ring" and resolve_cp_impl("auto", "cuda") == "alltoall"
    with pytest.raises(ConfigError, match="cp_impl = 'ring' cannot run on this mps run"):
        resolve_cp_impl("ring", "mps")


def test_ring_has_no_head_divisibility_rule() -> None:
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.context.cp import check_cp_model

    model = GPT(GPTConfig(vocab_size=8, block_size=24, n_layer=1, n_head=4, n_embd=16))
    with pytest.raises(ConfigError, match="cp_impl = 'ring' has no such rule"):
        check_cp_model(model, 3)
    check_cp_model(model, 3, impl="ring")  # 4 heads over 3 ranks: each keeps all heads of its tokens


def test_a_mask_for_one_ranks_tokens_is_refused_under_ring() -> None:
    from shardwise.parallel.context.cp import CPState, _RingMode, _two_chunk_mask

    # What transformers builds from a ring rank's jumping positions (two "documents"): recognised.
    at = torch.arange(4)
    two = (at[:, None] >= at[None, :]) & ((at[:, None] < 2) == (at[None, :] < 2))
    assert _two_chunk_mask(two[None, None], 4) and not _two_chunk_mask(torch.ones(4, 4).tril().bool(), 4)
    padding = two.clone()
    padding[:, 1] = False
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ConfigError, match="mask built for this rank's tokens.*session.forward_backward"), \
            _RingMode(None, 2, CPState("ring")):
        F.scaled_dot_product_attention(q, q, q, attn_mask=padding)
