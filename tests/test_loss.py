"""Chunked cross-entropy (shardwise.loss): same loss and gradients as the dense head + loss, in one
process and under FSDP at 2 ranks; clear refusals where it cannot run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from shardwise.core import config
from shardwise.core.config import ParallelConfig
from shardwise.errors import ConfigError
from shardwise.loss import (
    chunked_cross_entropy,
    install_chunked_head,
    parse_loss_chunks,
    token_loss_context,
)
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.testing import run_distributed
from shardwise.workloads import cross_entropy_loss

# A vocabulary 8x the hidden size: 'auto' turns chunking on.
CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=False)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_cross_entropy_matches_dense(chunk: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # A trained model's scale: logits of a few units (fp32 rounding of far larger ones exceeds 1e-6).
    h = (torch.randn(4, 16, 32, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(100, 32, generator=g) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, 100, (4, 16), generator=g)
    t[0, :3] = -100  # ignored tokens: no loss, no gradient
    upstream = torch.rand(4, 16, generator=g, dtype=dtype)
    dense = F.cross_entropy((h @ w.t()).flatten(0, 1), t.flatten(), reduction="none").view(4, 16)
    (dense * upstream).sum().backward()
    dh, dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    mine = chunked_cross_entropy(h, w, t, chunk)
    (mine * upstream).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(mine, dense, atol=tol, rtol=tol)
    torch.testing.assert_close(h.grad, dh, atol=tol, rtol=tol)
    torch.testing.assert_close(w.grad, dw, atol=tol, rtol=tol)
    assert float(mine.detach()[0, :3].abs().sum()) == 0.0


def _grads_after(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, chunked: bool) -> tuple:
    if chunked:
        with token_loss_context(model, cross_entropy_loss, y) as loss_fn:
            loss = loss_fn(model(x), y)
    else:
        loss = cross_entropy_loss(model(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_model(dense: torch.nn.Module, vocab: int, chunks: int | str, *, whole: bool = False) -> None:
    """``whole``: the head must hand the loss its logits whole ('auto' on a micro-batch whose logits
    are small); else it must return per-token losses (chunks)."""
    chunked = copy.deepcopy(dense)
    plan = install_chunked_head(chunked, chunks)
    assert plan.enabled
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (3, 32), generator=g)
    y = torch.randint(0, vocab, (3, 32), generator=g)
    with token_loss_context(chunked, cross_entropy_loss, y), torch.no_grad():
        out = chunked(x)
        out = getattr(out, "logits", out)
    assert tuple(out.shape) == ((3, 32, vocab) if whole else (3, 32)), out.shape
    loss_d, grads_d = _grads_after(dense, x, y, chunked=False)
    loss_c, grads_c = _grads_after(chunked, x, y, chunked=True)
    assert abs(loss_d - loss_c) < 1e-6
    for name, grad in grads_d.items():
        torch.testing.assert_close(grads_c[name], grad, atol=1e-6, rtol=1e-5, msg=name)
    # Outside the loss context (generation, a user's own loss) the head gives the logits again.
    torch.testing.assert_close(chunked(x), dense(x))


def test_gpt_chunked_head_same_loss_and_grads(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    _check_model(GPT(CFG), CFG.vocab_size, 5)
    # 'auto' leaves a micro-batch whose fp32 logits are within AUTO_DENSE_LOGITS_BYTES whole ...
    _check_model(GPT(CFG), CFG.vocab_size, "auto", whole=True)
    # ... and chunks one past it (the bound lowered below these 3 x 32 x 256 fp32 logits).
    monkeypatch.setattr(config, "AUTO_DENSE_LOGITS_BYTES", 4 * 3 * 32 * CFG.vocab_size - 1)
    _check_model(GPT(CFG), CFG.vocab_size, "auto")


def test_auto_chunks_only_large_logits_and_the_planner_agrees() -> None:
    """The rule of ``train.loss_chunks = auto`` (core.config.auto_chunks_logits), asked by the runtime's
    head per call and by the planner: GPT-2's 8 x 1024 tokens at a 50,304 vocabulary (1.5 GiB of fp32
    logits) stay whole; Llama 3's 128,256 vocabulary at 8,192 tokens (3.9 GiB) is chunked."""
    from shardwise.plan.cp import chunked_loss_off

    assert not config.auto_chunks_logits(8 * 1024, 50304)
    assert config.auto_chunks_logits(8192, 128256)
    assert config.auto_chunks_logits(config.AUTO_DENSE_LOGITS_BYTES // (4 * 1000) + 1, 1000)
    assert not config.auto_chunks_logits(config.AUTO_DENSE_LOGITS_BYTES // (4 * 1000), 1000)
    assert "builds them whole" in chunked_loss_off("gpt", 50304, 768, None, tokens=8 * 1024)
    assert chunked_loss_off("llama", 128256, 4096, None, tokens=8192) == ""
    assert chunked_loss_off("gpt", 50304, 768, 8, tokens=8 * 1024) == ""  # an explicit N always chunks


def test_hf_llama_chunked_head_same_loss_and_grads() -> None:
    pytest.importorskip("transformers")
    from shardwise.models.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("llama-tiny", vocab_size=512)
    _check_model(model, 512, 3)


def test_auto_off_where_it_does_not_pay_or_cannot_run() -> None:
    small = GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=1, n_head=2, n_embd=32))
    assert not install_chunked_head(small, "auto").enabled  # 65 < 4 x 32: logits are not the big tensor
    assert not install_chunked_head(GPT(CFG), "auto", tp=2).enabled
    assert not install_chunked_head(GPT(CFG), 0).enabled
    with pytest.raises(ConfigError, match="tensor parallel already splits the logits"):
        install_chunked_head(GPT(CFG), 4, tp=2)
    with pytest.raises(ConfigError, match="pipeline parallel"):
        install_chunked_head(GPT(CFG), "4", pp=2)
    with pytest.raises(ConfigError, match="no plain output head"):
        install_chunked_head(torch.nn.Linear(4, 4), 2)
    for bad in ("many", -1, 1.5, True):
        with pytest.raises(ConfigError, match="train.loss_chunks must be"):
            parse_loss_chunks(bad)
    assert parse_loss_chunks("auto") is None and parse_loss_chunks("0") == 0 and parse_loss_chunks(8) == 8


def test_config_rejects_bad_loss_chunks() -> None:
    from shardwise.core.config import load_config

    with pytest.raises(ConfigError, match="train.loss_chunks must be"):
        load_config(None, ["train.loss_chunks=lots"])


def _session_run(rank: int, world: int, strategy: str, loss_chunks: int | str) -> dict:
    from shardwise.runtime.session import Session
    from shardwise.testing import fixed_batches, train_fixed_batches

    session = Session(parallel=ParallelConfig(strategy=strategy), seed=3, loss_chunks=loss_chunks)
    model = session.build(lambda: GPT(CFG))
    model, opt = session.prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-2))
    assert session.loss_plan.enabled == (loss_chunks != 0)
    out = train_fixed_batches(session, model, opt, fixed_batches(3, 4, 32, CFG.vocab_size),
                              loss_fn=cross_entropy_loss, max_norm=1.0)
    x = fixed_batches(1, 4, 32, CFG.vocab_size, seed=9)[0]
    out["eval"] = float(session.eval_loss(model, x[:, :-1], x[:, 1:], cross_entropy_loss))
    return out


def _both(rank: int, world: int) -> list[dict]:
    return [_session_run(rank, world, "fsdp", c) for c in (0, 4)]


def test_session_chunked_equals_dense_single_and_fsdp() -> None:
    single = [_session_run(0, 1, "single", c) for c in (0, "auto")]
    fsdp = run_distributed(_both, 2, timeout_s=120)[0]
    for dense, chunked in (single, fsdp):
        for a, b in zip(dense["losses"] + [dense["eval"]], chunked["losses"] + [chunked["eval"]]):
            assert abs(a - b) < 1e-5, (dense, chunked)
        for a, b in zip(dense["norms"], chunked["norms"]):
            assert abs(a - b) < 1e-5
    for a, b in zip(single[0]["losses"], fsdp[0]["losses"]):
        assert abs(a - b) < 1e-4
