"""LR-scheduler training runs for the scheduler tests (spawned ranks import these)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from shardwise.core.config import ParallelConfig
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime.session import Session
from shardwise.testing import fixed_batches, train_fixed_batches

STEPS = 6
GLOBAL_BATCH = 8


def warmup_cosine(step: int) -> float:
    """An lr factor that changes every step, so a stale learning rate shows in the losses."""
    return (step + 1) / 3 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / STEPS))


def make_scheduler(opt: torch.optim.Optimizer) -> Any:
    """Linear warmup for 2 steps, then cosine: a SequentialLR, whose state nests two schedulers."""
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.3, total_iters=2)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])


def _batches() -> torch.Tensor:
    cfg = GPT_PRESETS["nano"]
    return fixed_batches(STEPS, GLOBAL_BATCH, cfg.block_size, cfg.vocab_size)


def run_with_scheduler(strategy: str, ckpt_dir: str | None = None, split_at: int = 0,
                       callable_form: bool = False) -> dict[str, Any]:
    """Train nano GPT for STEPS steps with ``make_scheduler``; with ``ckpt_dir``, save after
    ``split_at`` steps and continue in a fresh session that loads it (a restart).

    Returns the global losses, the learning rate each step really used (read from the optimizer
    that stepped: ZeRO-1's inner one), and facts about the prepared scheduler.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    data = _batches()
    losses: list[float] = []
    used_lrs: list[float] = []
    facts: dict[str, Any] = {}

    def segment(steps: range, load: bool) -> None:
        session = Session(parallel=ParallelConfig(strategy=strategy), seed=0)
        model = GPT(GPT_PRESETS["nano"])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        sched_arg = make_scheduler if callable_form else make_scheduler(opt)
        model, opt, sched = session.prepare(model, opt, sched_arg)
        facts.update(repointed=sched.optimizer is opt, zero=isinstance(opt, ZeroRedundancyOptimizer),
                     children_repointed=all(s.optimizer is opt for s in sched._schedulers))
        if load:
            session.load(ckpt_dir, model, opt)  # the scheduler prepare() returned is restored too
            facts["last_epoch_after_load"] = sched.last_epoch

        def after_step(step: int) -> None:
            inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
            used_lrs.append(inner.param_groups[0]["lr"])
            sched.step()

        run = train_fixed_batches(session, model, opt, data, steps=steps, after_step=after_step)
        losses.extend(run["losses"])
        if ckpt_dir is not None and not load:
            path = session.save(ckpt_dir, model, opt, step=steps.stop)
            facts["checkpoint"] = str(path)
        session.close()

    if ckpt_dir is None:
        segment(range(STEPS), load=False)
    else:
        segment(range(split_at), load=False)
        segment(range(split_at, STEPS), load=True)
    return {"losses": losses, "lrs": used_lrs, **facts}


def zero1_scheduler_rank(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    """On each rank: zero1 uninterrupted, zero1 restarted from a checkpoint, and tp refusals."""
    out = {"full": run_with_scheduler("zero1"),
           "resumed": run_with_scheduler("zero1", ckpt_dir=ckpt_dir, split_at=3)}
    out["manifest_scheduler"] = (Path(ckpt_dir) / "step-00000003" / "manifest.json").read_text()
    out["tp_callable"] = run_with_scheduler("tp", callable_form=True)["losses"]
    try:
        run_with_scheduler("tp")
        out["tp_instance_error"] = None
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
        out["tp_instance_error"] = f"{type(e).__name__}: {e}"
    return out
