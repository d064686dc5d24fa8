"""The built-in trainer, written on exactly the public Session API a user's own loop uses.

AdamW with warmup + cosine decay, gradient clipping, gradient accumulation, periodic evaluation
(validation loss averaged across ranks), rank-0 metrics, and a text sample at the end.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.config import RunConfig, TrainConfig
from shardwise.runtime.rundir import RunDir
from shardwise.runtime.session import Session
from shardwise.workloads import Workload, build_workload


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate after ``step`` optimizer steps: linear warmup, then cosine down to min_lr."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on biases, norms' scales or 1-d params)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas)


@dataclass
class TrainState:
    """What advances as training goes; all of it is checkpointed."""

    step: int = 0
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    last_train_loss: float = float("nan")
    last_val_loss: float = float("nan")


@torch.no_grad()
def evaluate(session: Session, model: nn.Module, workload: Workload, loader: Any,
             max_batches: int) -> float:
    """Mean validation loss over the first ``max_batches`` batches, averaged across ranks."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=session.device, dtype=torch.float64), 0
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        loss = session.eval_loss(model, x.to(session.device), y.to(session.device), workload.loss_fn)
        total += loss.double()
        count += 1
    model.train(was_training)
    return session.all_reduce(float(total) / max(count, 1), op="mean")


class Trainer:
    """Runs one training job on this rank; ``run()`` returns the summary dict."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path | None = None,
                 session: Session | None = None) -> None:
        self.cfg = cfg
        t = cfg.train
        self.session = session or Session(
            parallel=cfg.parallel, grad_accum_steps=t.grad_accum_steps, seed=t.seed,
            collective_timeout_s=cfg.watchdog.collective_timeout_s,
        )
        self.workload = build_workload(cfg.model, cfg.data)
        self.run_dir = RunDir(out_dir or cfg.out_dir, enabled=self.session.is_main)
        self.state = TrainState()
        model = self.workload.build_model()
        self.model, self.optimizer = self.session.prepare(model, build_optimizer(model, t))
        self.train_loader = self.session.dataloader(self.workload.train_set, t.micro_batch_size,
                                                    seed=t.seed, num_workers=cfg.data.num_workers)
        self.val_loader = self.session.dataloader(self.workload.val_set, t.micro_batch_size,
                                                  shuffle=False)

    # -------------------------------------------------------------- one optimizer step
    def train_step(self, batches: Any) -> tuple[float, float]:
        """Run grad_accum_steps micro-batches and one optimizer step; return (loss, grad_norm)."""
        s, t = self.session, self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.state.step, t)
        loss_sum = torch.zeros((), device=s.device)
        for _ in range(t.grad_accum_steps):
            x, y = next(batches)
            x, y = x.to(s.device, non_blocking=True), y.to(s.device, non_blocking=True)
            loss = s.forward_backward(self.model, x, y, self.workload.loss_fn)
            loss_sum += loss.float()
        grad_norm = s.step(self.optimizer, max_norm=t.grad_clip)
        self.state.step += 1
        return float(loss_sum) / t.grad_accum_steps, grad_norm

    # -------------------------------------------------------------- the loop
    def run(self) -> dict[str, Any]:
        s, t, st = self.session, self.cfg.train, self.state
        self.run_dir.write_config(self.cfg)
        tokens_per_step = (t.micro_batch_size * t.grad_accum_steps * s.dp_size
                           * self.workload.tokens_per_sample)
        s.log(f"strategy={s.strategy_name} world_size={s.world_size} device={s.device} "
              f"global_batch={t.micro_batch_size * t.grad_accum_steps * s.dp_size} "
              f"steps={t.steps} out={self.run_dir.path}")
        bar = s.progress(t.steps, desc="train", enabled=t.progress, initial=st.step)
        batches = self.train_loader.forever()
        wall0 = time.perf_counter()
        while st.step < t.steps:
            t0 = time.perf_counter()
            local_loss, grad_norm = self.train_step(batches)
            step_time = time.perf_counter() - t0
            st.step_times_s.append(step_time)
            st.tokens_per_s.append(tokens_per_step / step_time)
            last = st.step == t.steps
            if st.step % t.log_every == 0 or last or st.step == 1:
                st.last_train_loss = s.all_reduce(local_loss, op="mean")
                self.run_dir.log_metrics({
                    "step": st.step, "loss": st.last_train_loss, "lr": lr_at(st.step - 1, t),
                    "grad_norm": grad_norm, "step_time_s": step_time,
                    "tokens_per_s": tokens_per_step / step_time,
                })
            if (t.eval_every and st.step % t.eval_every == 0) or last:
                st.last_val_loss = evaluate(s, self.model, self.workload, self.val_loader,
                                            t.eval_batches)
                self.run_dir.log_metrics({"step": st.step, "val_loss": st.last_val_loss})
                if not last:
                    s.log(f"step {st.step}: val_loss {st.last_val_loss:.4f}")
            bar.update(1, loss=st.last_train_loss, val=st.last_val_loss)
        bar.close()
        wall_s = time.perf_counter() - wall0
        summary = self.summary(wall_s)
        self.run_dir.write_summary(summary)
        s.print(f"final train loss {summary['final_train_loss']:.4f} | "
                f"final val loss {summary['final_val_loss']:.4f} | "
                f"{summary['tokens_per_s']:.0f} tokens/s | {wall_s:.1f}s")
        self.sample()
        return summary

    def summary(self, wall_s: float) -> dict[str, Any]:
        s, st = self.session, self.state
        return {
            "strategy": s.strategy_name, "world_size": s.world_size,
            "precision": self.cfg.parallel.precision, "steps": st.step,
            "final_train_loss": st.last_train_loss, "final_val_loss": st.last_val_loss,
            "tokens_per_s": statistics.median(st.tokens_per_s) if st.tokens_per_s else 0.0,
            "step_time_s": statistics.median(st.step_times_s) if st.step_times_s else 0.0,
            "wall_s": wall_s, "device": str(s.device),
        }

    def sample(self) -> str | None:
        """Generate and print a text sample (every rank computes it: sharded models need all)."""
        n = self.cfg.train.sample_tokens
        if not n or self.workload.sample_text is None:
            return None
        text = self.workload.sample_text(self.session.unwrap(self.model), self.session.device, n,
                                         self.cfg.train.seed)
        self.session.print("--- sample ---\n" + text.strip() + "\n--------------")
        return text


def train(cfg: RunConfig, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Train ``cfg`` on this rank (inside torchrun, or as one process) and return the summary."""
    trainer = Trainer(cfg, out_dir)
    try:
        return trainer.run()
    finally:
        trainer.session.close()
