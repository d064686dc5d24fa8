"""Rank functions for the Hugging Face mixture-of-experts tests (importable by spawned ranks)."""

from __future__ import annotations

import torch

from shardwise.core.config import ParallelConfig
from shardwise.models.hf import build_hf_model
from shardwise.models.moe import take_moe_stats, with_aux_loss
from shardwise.runtime.session import Session
from shardwise.testing import default_dtype, fixed_batches, lm_loss, train_fixed_batches
from tests.helpers.mp import full_params

VOCAB, SEQ = 64, 16


def hf_moe_train(rank: int, world_size: int, folder: str, strategy: str = "single", steps: int = 4,
                 global_batch: int = 4, ckpt_dir: str = "", load_dir: str = "", start: int = 0, moe: bool = True,
                 grad_accum_steps: int = 1, rows: list[int] | None = None, dtype: str = "float64",
                 **options: object) -> dict:
    """Train a pretrained HF MoE folder (meta build, each rank reads its shards) on fixed batches, the
    model in ``dtype`` (float64 for parity: see ``shardwise.testing.default_dtype``).
    ``moe=False``: a dense folder (no router logits to ask for). ``rows``: the global batch's rows
    in this order (a one-process reference accumulating a pipeline's micro-batches of every replica)."""
    with default_dtype(getattr(torch, dtype)):
        return _hf_moe_train(rank, world_size, folder, strategy, steps, global_batch, ckpt_dir, load_dir, start, moe,
                             grad_accum_steps, rows, **options)


def _hf_moe_train(rank: int, world_size: int, folder: str, strategy: str, steps: int, global_batch: int,
                  ckpt_dir: str, load_dir: str, start: int, moe: bool, grad_accum_steps: int,
                  rows: list[int] | None, **options: object) -> dict:
    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0,  # type: ignore[arg-type]
                      grad_accum_steps=grad_accum_steps)
    extra = {"output_router_logits": True} if moe else {}
    model = session.build(lambda: build_hf_model(pretrained=folder, **extra))
    if torch.get_default_dtype() == torch.float64:  # transformers' grouped_mm experts take no float64
        model.hf.config._experts_implementation = "eager"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    model, opt = session.prepare(model, opt)
    if load_dir:
        session.load(load_dir, model, opt)
    data = fixed_batches(steps, global_batch, SEQ, VOCAB)
    if rows is not None:
        data = data[:, rows]
    stats: list[dict] = []
    run = train_fixed_batches(session, model, opt, data, max_norm=1.0, loss_fn=with_aux_loss(lm_loss),
                              steps=range(start, steps), after_step=lambda s: stats.append(take_moe_stats(model)))
    if ckpt_dir:
        session.save(ckpt_dir, model, opt, step=steps)
    result = {"losses": run["losses"], "params": full_params(model), "stats": stats}
    session.close()
    return result


def hf_moe_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Several ``hf_moe_train`` configurations in one spawn."""
    return [hf_moe_train(rank, world_size, **case) for case in cases]
