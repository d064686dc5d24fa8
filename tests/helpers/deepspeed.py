"""A user's own loop on the Session API under a DeepSpeed kind (module-level: spawned ranks import it)."""

from __future__ import annotations

import torch

from shardwise.core.config import ParallelConfig
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime.session import Session
from shardwise.testing import fixed_batches, train_fixed_batches


def user_loop(rank: int, world_size: int, strategy: str = "single", ds_config: str = "", steps: int = 5,
              global_batch: int = 8, accum: int = 2) -> dict:
    """AdamW + a warmup LambdaLR, accumulate/backward/step(max_norm) written out as a user would."""
    cfg = GPT_PRESETS["nano"]
    session = Session(parallel=ParallelConfig(strategy=strategy, deepspeed_config=ds_config),
                      grad_accum_steps=accum, seed=0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    model, opt, sched = session.prepare(model, opt, sched)
    data = fixed_batches(steps, global_batch, cfg.block_size, cfg.vocab_size)
    out = train_fixed_batches(session, model, opt, data, max_norm=0.5, explicit_loop=True,
                              after_step=lambda step: sched.step())
    session.close()
    return {"losses": out["losses"], "norms": out["norms"]}
