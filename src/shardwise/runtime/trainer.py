"""The built-in trainer, written on exactly the public Session API a user's own loop uses.

The ``[optimizer]`` (AdamW by default) with the ``[schedule]`` (warm-up + cosine by default),
gradient clipping, gradient accumulation, periodic evaluation
(validation loss averaged across ranks), rank-0 metrics, and a text sample at the end.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise import logs
from shardwise.core.config import OptimizerConfig, RunConfig, ScheduleConfig, TrainConfig
from shardwise.errors import CheckpointError, NonFiniteError, count_of
from shardwise.models.moe import adds_aux_loss, take_moe_stats, with_aux_loss
from shardwise.observe.hooks import RunHooks
from shardwise.observe.phase_table import format_table as format_phase_table
from shardwise.observe.throughput import Peak, ThroughputMeter, device_peak
from shardwise.optim.build import build_optimizer as build_named_optimizer
from shardwise.optim.build import check_optimizer, optimizer_name
from shardwise.optim.schedule import lr_at as schedule_lr
from shardwise.optim.schedule import set_lr
from shardwise.optim.switch import resets_state, saved_state
from shardwise.parallel.pipeline.pp import fixed_shape_collate
from shardwise.plan.cost import flops_per_token
from shardwise.plan.predict import compare as compare_prediction
from shardwise.plan.predict import format_comparison, model_name, predict_for_spec
from shardwise.plan.spec import from_module
from shardwise.preference.step import build_objective
from shardwise.runtime import faults, ledger
from shardwise.runtime.auto import job_key, record_run, resolved_config
from shardwise.runtime.checkpoint.locate import latest_checkpoint, resume_source
from shardwise.runtime.checkpoint.preflight import truncate_metrics
from shardwise.runtime.collective import gather
from shardwise.runtime.lifeline import launcher_record
from shardwise.runtime.rng import restore_rng_state
from shardwise.runtime.run_dir import RunDir
from shardwise.runtime.session import Session
from shardwise.runtime.token_loss import step_scale, token_sum, token_sum_loss
from shardwise.workloads import Workload, build_workload

# "No non-finite step yet" in the device-side first-bad-step tensor (a min-reduce picks the first).
_NO_BAD_STEP = 2**62


def lr_at(step: int, t: TrainConfig, schedule: ScheduleConfig | None = None) -> float:
    """Learning rate after ``step`` optimizer steps (``optim.schedule``; default warm-up + cosine)."""
    return schedule_lr(step, t, schedule)


def build_optimizer(model: nn.Module, t: TrainConfig, device: torch.device | str = "cpu",
                    o: OptimizerConfig | None = None) -> torch.optim.Optimizer:
    """The ``[optimizer]`` the run names (default AdamW), built by ``optim.build``."""
    return build_named_optimizer(model, t, o, device)


@dataclass
class TrainState:
    """What advances as training goes; all of it is checkpointed."""

    step: int = 0
    # One value per logging window (observe.throughput: only logging steps wait for the device).
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
    if workload.token_loss:  # the mean over every trained token of the evaluated batches (runtime.token_loss)
        sums = torch.zeros(2, device=session.device, dtype=torch.float64)
        for i, (x, y) in enumerate(loader):
            if i >= max_batches:
                break
            loss = session.eval_loss(model, session.to_device(x), y.to(session.device), token_sum_loss)
            # Each cp rank's loss covers its sequence chunk, but it read the whole batch's labels.
            trained = (y != -100).sum().double() / session.layout.cp
            sums += torch.stack([loss.double(), trained.to(session.device)])
        model.train(was_training)
        sums = session.all_reduce(sums, op="sum")
        return float(sums[0] / sums[1].clamp(min=1))
    for i, (x, y) in enumerate(loader):
        if i >= max_batches:
            break
        loss = session.eval_loss(model, session.to_device(x), y.to(session.device), workload.loss_fn)
        total += loss.double()
        count += 1
    model.train(was_training)
    return session.all_reduce(float(total) / max(count, 1), op="mean")


class Trainer:
    """Runs one training job on this rank; ``run()`` returns the summary dict."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path | None = None,
                 session: Session | None = None, attempt: int = 0, launch_id: str | None = None) -> None:
        self.cfg = cfg
        # Elastic attempt (torchrun's restart count): a restarted attempt resumes by itself.
        self.attempt = attempt
        self.resumed_from: str | None = None
        self._stop_signal: int | None = None
        self._saved_step = -1
        self._ckpt_logged = 0  # background saves already in metrics.jsonl
        self._watchdog: Any = None
        self.data_wait_s = 0.0  # time this step waited on the data loader (train_step adds to it)
        self.real_tokens: Any = 0  # real (non-padding) tokens of the global batch this step (token_loss data)
        t = cfg.train
        self.session = session or Session(
            parallel=cfg.parallel, grad_accum_steps=t.grad_accum_steps, seed=t.seed,
            collective_timeout_s=cfg.watchdog.collective_timeout_s, launch_id=launch_id,
            compile=t.compile, loss_chunks=t.loss_chunks, steps=t.steps,
        )
        # What the session decided for "auto" precision/compile (runtime.auto) is what this run records.
        self.cfg = cfg = resolved_config(cfg, self.session)
        # A node that rejoins a multi-node job after a node loss starts over at torchrun's restart
        # count 0 while the surviving nodes count on: the job's attempt is the largest, so every
        # rank decides the same way whether to resume.
        self.attempt = max(gather(attempt))
        logs.configure(self.session.rank, level=cfg.log.level, all_ranks=cfg.log.all_ranks)
        # Non-finite losses/gradients. "stop": the first bad step is kept in a device tensor,
        # updated every step without a host sync, and read at logging steps, before every save
        # and at the end. "skip": the session decides per step (one sync) and this counts.
        self._first_bad_step = torch.full((), _NO_BAD_STEP, dtype=torch.int64, device=self.session.device)
        self.skipped_steps = 0
        self._skips_in_a_row = 0
        # Profiler and experiment trackers (observe.hooks); checks their extras on every rank.
        self.hooks = RunHooks(cfg, self.session)
        self.workload = build_workload(cfg.model, cfg.data, cfg.lora, cfg.preference)
        if not self.workload.plain_token_ce:
            # The chunked head computes the token-mean CE only; other losses see whole logits
            # (an explicit train.loss_chunks was refused before launch: preflight).
            self.session.loss_chunks = 0
        # train.compile: the loss is compiled beside the blocks (torchtitan does the same).
        # Records with -100 labels train on the global batch's token mean (runtime.token_loss).
        self._train_loss_fn = self.session.compile_loss(
            token_sum_loss if self.workload.token_loss else self.workload.loss_fn)
        for note in self.workload.notes:
            self.session.log(note)
        self.run_dir = RunDir(out_dir or cfg.out_dir, enabled=self.session.is_main)
        self.state = TrainState()
        # On the meta device (model.init = "meta"): prepare() shards it, then allocates and fills
        # only this rank's shards (random init replayed, or pretrained weights read).
        t0 = time.perf_counter()
        model = self.session.build(self.workload.build_model, init=cfg.model.init)
        # The model's shapes for the planner's prediction, taken before the strategy shards or
        # prunes it (a pipeline rank deletes the stages it does not run).
        spec = from_module(model, name=model_name(cfg.model))
        # Model FLOPs per token by the planner's own counting, for MFU (observe.throughput).
        self.flops_per_token = flops_per_token(spec, self.workload.tokens_per_sample)
        # For an engine strategy's "auto" config values (DeepSpeed); ignored by the others.
        self.session.engine_hints.update(micro_batch_size=t.micro_batch_size, weight_decay=t.weight_decay)
        check_optimizer(cfg.optimizer, self.session.layout)
        self.model, self.optimizer = self.session.prepare(model, build_optimizer(model, t, self.session.device,
                                                                                  cfg.optimizer))
        for note in self.session.notes:
            self.session.log(note)
        # checkpoint.mode: a save blocks the step only while it is staged (runtime.checkpoint.background).
        mode_note = self.session.set_checkpoint_mode(cfg.checkpoint.mode)
        if mode_note:
            self.session.log(mode_note)
        self.save_blocked_s: list[float] = []  # every save's blocked time, sync or not
        self.session.log(f"model ready in {time.perf_counter() - t0:.2f}s (model.init = {cfg.model.init!r}"
                         f"{', pretrained: ' + cfg.model.pretrained if cfg.model.pretrained else ''}"
                         f"{f', LoRA rank {cfg.lora.rank}' if cfg.lora.rank else ''})")
        # What the planner predicts this run holds per rank; the summary sets it next to the
        # ledger's measurements, so every job checks the planner.
        # The same call as --dry-run's (predict_for_spec): the two predictions cannot drift.
        self.prediction = predict_for_spec(spec, self.session.layout, cfg, seq=self.workload.tokens_per_sample,
                                           ranks_per_node=self.session.ranks_per_node,
                                           plain_ce=self.workload.plain_token_ce)
        collate_fn = self.workload.collate_fn
        if collate_fn is not None and self.session.layout.pp > 1:
            collate_fn = fixed_shape_collate(collate_fn)
        self.train_loader = self.session.dataloader(self.workload.train_set, t.micro_batch_size,
                                                    seed=t.seed, num_workers=cfg.data.num_workers,
                                                    collate_fn=collate_fn)
        val_batch = t.micro_batch_size
        if self.workload.token_loss:
            # A token-mean validation loss does not depend on the batch size: a small held-out set of
            # records (a few packed rows) is read in smaller batches rather than refused.
            val_batch = max(1, min(val_batch, len(self.workload.val_set) // self.session.dp_size))
            # A pipeline cuts every batch into its microbatches (Layout.check_batch): a multiple of them.
            m = self.session.layout.pp_microbatches
            val_batch = max(m, val_batch - val_batch % m)
        self.val_loader = self.session.dataloader(self.workload.val_set, val_batch, shuffle=False,
                                                  collate_fn=collate_fn)
        # train.objective = "dpo": its own micro-batches, evaluation and metrics (shardwise.preference).
        self.objective = build_objective(self)

    # -------------------------------------------------------------- one optimizer step
    def train_step(self, batches: Any, *, measure: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Run grad_accum_steps micro-batches and one optimizer step; return (mean loss, pre-clip grad
        norm) as device tensors: nothing here waits for the device (``float()`` them to log).

        ``measure``: take the memory ledger's gradient walk (a logging step). The time spent
        waiting on the data loader is added to ``self.data_wait_s``.
        """
        s, t = self.session, self.cfg.train
        set_lr(self.optimizer.param_groups, self.state.step, t, self.cfg.schedule)
        loss_sum = torch.zeros((), device=s.device)
        loss_fn = self._loss_fn()
        micro: list[Any] = []
        micro_batches = t.grad_accum_steps
        if self.objective is not None:
            loss_sum = self.objective.micro_batches(self, batches, micro_batches)
            micro_batches = 0
        if self.workload.token_loss:
            # The step's micro-batches first: their trained-token count scales every loss (runtime.token_loss).
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(t.grad_accum_steps)]
            self.data_wait_s += time.perf_counter() - t0
            scale, real = step_scale(s, micro)
            self.real_tokens = self.real_tokens + real
            sum_fn = loss_fn
            scaled = lambda output, target: sum_fn(output, target) * scale  # noqa: E731
            if adds_aux_loss(self.workload.loss_fn):
                # An MoE model's aux losses join AFTER the token scale: each micro-batch's keeps scale 1
                # (its own global-batch normalisation, models/moe.py), as without records.
                scaled = with_aux_loss(scaled)
            # Still a token sum (scaled): a pipeline adds it up over its micro-batches (token_loss).
            loss_fn = token_sum(scaled)
        for k in range(micro_batches):
            t0 = time.perf_counter()
            x, y = micro[k] if micro else next(batches)
            self.data_wait_s += time.perf_counter() - t0
            x, y = s.to_device(x), y.to(s.device, non_blocking=True)
            loss = s.forward_backward(self.model, x, y, loss_fn)
            loss_sum += loss.float()
        skip = t.nonfinite == "skip"
        grad_norm = s.step(self.optimizer, max_norm=t.grad_clip, skip_nonfinite=skip, loss=loss_sum,
                           measure_grad_bytes=measure)
        self.state.step += 1
        if skip:
            self._count_skip(s.last_step_skipped)
        else:
            self._flag_nonfinite(loss_sum, grad_norm)
        return loss_sum / t.grad_accum_steps, grad_norm

    # -------------------------------------------------------------- non-finite losses
    def _flag_nonfinite(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Record the first step whose loss or gradient norm is NaN/inf, on the device (no sync)."""
        bad = ~torch.isfinite(loss)
        if grad_norm is not None and not self.session.uses_loss_scaling:
            # Under fp16-mixed an overflowing gradient is the loss scaler's to skip, not an error.
            bad = bad | ~torch.isfinite(grad_norm.to(bad.device))
        first = self._first_bad_step
        self._first_bad_step = torch.where(bad & (first == _NO_BAD_STEP), self.state.step, first)

    def check_finite(self) -> None:
        """Raise NonFiniteError (on every rank) if any step so far had a non-finite loss or gradient norm.

        A collective: one tiny min-reduce, and the only host sync of the non-finite check.
        """
        if self.cfg.train.nonfinite != "stop":
            return
        first = int(self.session.all_reduce(self._first_bad_step, op="min"))
        if first != _NO_BAD_STEP:
            raise self._nonfinite_error(f"the loss or gradient norm became non-finite (NaN/inf) at step "
                                        f"{first}", 'train.nonfinite = "stop"')

    def _count_skip(self, skipped: bool) -> None:
        st, t = self.state, self.cfg.train
        if not skipped:
            self._skips_in_a_row = 0
            return
        self.skipped_steps += 1
        self._skips_in_a_row += 1
        self.session.log(f"step {st.step}: non-finite loss or gradient norm; optimizer step skipped "
                         f"({self._skips_in_a_row} in a row, {self.skipped_steps} in all)")
        if self._skips_in_a_row >= t.max_nonfinite_skips:
            raise self._nonfinite_error(
                f"{self._skips_in_a_row} optimizer steps in a row had a non-finite (NaN/inf) loss or "
                f"gradient norm (steps {st.step - self._skips_in_a_row + 1}-{st.step}); skipping more "
                "will not recover", f"train.max_nonfinite_skips = {t.max_nonfinite_skips}")

    def _check_weights_finite(self) -> None:
        """Raise NonFiniteError (on every rank) when any parameter holds NaN/inf: never save such weights."""
        flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()
                 for p in self.model.parameters()]
        ok = torch.stack(flags).all().float() if flags else torch.ones((), device=self.session.device)
        if self.session.all_reduce(ok, op="min") < 1:
            raise self._nonfinite_error(f"the model's weights hold NaN/inf values after step {self.state.step}",
                                        "refusing to save them")

    def _nonfinite_error(self, what: str, why: str) -> NonFiniteError:
        # Every rank gets here together: let a checkpoint still being written in the background be
        # published first, so the message names the last good one (a failed write publishes nothing).
        with contextlib.suppress(CheckpointError):
            self.session.wait_checkpoint()
        latest = None
        if self.session.is_main:
            with contextlib.suppress(CheckpointError):  # a damaged pointer: say nothing about it
                latest = latest_checkpoint(self.run_dir.checkpoints)
        if latest is not None:
            where = (f"The last good checkpoint is {latest}; after changing the settings, continue "
                     f"from it with: shardwise train --out {self.run_dir.path} --resume.")
        elif self.resumed_from:
            where = f"No checkpoint was saved in this run; it started from {self.resumed_from}."
        else:
            where = "No checkpoint was saved before it."
        return NonFiniteError(
            f"training stopped: {what} ({why}). {where} Usual causes: a learning rate too high for "
            "this model (train.lr), too short a warmup (train.warmup_steps), no gradient clipping "
            "(train.grad_clip = 0) or fp16 overflow; train.nonfinite = \"skip\" skips such steps instead."
        )

    def _loss_fn(self) -> Any:
        d, loss_fn = self.cfg.debug, self._train_loss_fn
        step = self.state.step + 1  # the step being computed
        if (d.nan_loss_at_step and d.nan_loss_at_step <= step < d.nan_loss_at_step + d.nan_loss_steps
                and d.nan_loss_rank in (-1, self.session.rank) and (self.attempt == 0 or d.every_attempt)):
            return lambda output, target: loss_fn(output, target) * float("nan")
        return loss_fn

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all data-parallel replicas."""
        t = self.cfg.train
        return t.micro_batch_size * t.grad_accum_steps * self.session.dp_size

    # -------------------------------------------------------------- the loop
    def run(self) -> dict[str, Any]:
        s, t, st = self.session, self.cfg.train, self.state
        self.run_dir.write_config(self.cfg)
        tokens_per_step = self.global_batch * self.workload.tokens_per_sample
        s.log(f"strategy={s.strategy_name} world_size={s.world_size} device={s.device} "
              f"global_batch={self.global_batch} "
              f"steps={t.steps} out={self.run_dir.path}\n{s.layout.describe(s.cp_impl)}")
        self._watchdog = s.watch(self.run_dir.path, self.cfg.watchdog.timeout_s, attempt=self.attempt,
                                 first_step_timeout_s=self.cfg.watchdog.first_step_timeout_s)
        self._watchdog.beat(st.step, "resume")
        old_handlers = self._install_signal_handlers()
        try:
            rng = self.resume()
            self.meter = self._throughput_meter(tokens_per_step)
            self.hooks.start(self.run_dir.path, first_step=st.step + 1)
            self.run_dir.sinks.append(self.hooks.log)
            return self._loop(tokens_per_step, rng)
        finally:
            self.hooks.end(None, failed=True)  # a no-op after the loop's own end(summary)
            self._watchdog.stop()
            for signum, handler in old_handlers.items():
                signal.signal(signum, handler)

    def _loop(self, tokens_per_step: int, rng: dict[str, Any] | None) -> dict[str, Any]:
        s, t, st, ck = self.session, self.cfg.train, self.state, self.cfg.checkpoint
        bar = s.progress(t.steps, desc="train", enabled=t.progress, initial=st.step)
        # Every rank's step phases (observe.step_phases): gathered at logging steps, slow ranks named.
        phases = s.time_phases()
        batches = faults.slow_rank(self.train_loader.forever(), s.unwrap(self.model), s.rank)  # SHARDWISE_DEBUG_SLOW
        if rng is not None:
            # DataLoader draws its base seed from the global RNG when an epoch's iterator is
            # created. Mid-epoch, the uninterrupted run drew it before the save, so create the
            # iterator first (prefetching one batch) and only then continue the saved streams.
            if self.train_loader.batch_in_epoch > 0:
                batches = itertools.chain([next(batches)], batches)
            restore_rng_state(rng)
        wall0 = time.perf_counter()
        interrupted = False
        while st.step < t.steps:
            step = st.step + 1  # the step about to run
            last = step == t.steps
            log_step = step % t.log_every == 0 or last or step == 1
            save_step = bool(ck.every) and step % ck.every == 0
            # Only logging and checkpoint steps wait for the device: the loss, the non-finite
            # flag and the stop signal are settled there in one all-reduce (``_agree``). Other
            # steps only queue work, so the host runs ahead of the device.
            phases.begin_step()
            t0 = time.perf_counter()
            self.data_wait_s = 0.0
            loss, grad_norm = self.train_step(batches, measure=log_step)
            if log_step or save_step:
                phases.start("collective")  # the agreement waits for every rank's step
                mean_loss, stop = self._agree(loss)
                phases.stop("collective")
            else:  # one process needs no agreement: its own flag is the answer
                stop = not s.is_distributed and self._stop_signal is not None
            # Record data counts real tokens (not padding) for tokens/s and MFU.
            self.meter.add_step(time.perf_counter() - t0, self.data_wait_s,
                                tokens=self.real_tokens if self.workload.token_loss or self.objective else None)
            self.real_tokens = 0
            phases.end_step(self.data_wait_s)
            self.hooks.step(st.step)
            if log_step:
                st.last_train_loss = mean_loss
                window = self.meter.window()
                st.step_times_s.append(window.get("step_time_s", 0.0))
                st.tokens_per_s.append(window.get("tokens_per_s", 0.0))
                # The per-logging-step record: metrics.jsonl, then every RunDir sink (trackers).
                record = {"step": st.step, "loss": st.last_train_loss,
                          "lr": lr_at(st.step - 1, t, self.cfg.schedule),
                          "grad_norm": float(grad_norm), **window}
                if t.nonfinite == "skip":
                    record["skipped_steps"] = self.skipped_steps
                record.update(phases.window())  # every rank: one small gather
                if "slow_rank_message" in record:
                    s.log(f"step {st.step}: {record['slow_rank_message']}")
                # MoE routing over the window (every rank: one small all-reduce); {} if dense.
                moe = take_moe_stats(self.model)
                record.update(moe)
                if self.objective is not None:  # global DPO means over the window (a collective)
                    record.update(self.objective.take_metrics())
                if moe:
                    s.log(f"step {st.step}: moe tokens/expert min {moe['moe/tokens_per_expert_min']:.0f} mean "
                          f"{moe['moe/tokens_per_expert_mean']:.0f} max {moe['moe/tokens_per_expert_max']:.0f}, "
                          f"aux {moe['moe/aux_loss']:.4f}, z {moe['moe/z_loss']:.4f}, dropped 0")
                self.run_dir.log_metrics(record)
            if (t.eval_every and st.step % t.eval_every == 0) or last:
                extra: dict[str, float] = {}
                if self.objective is not None:
                    st.last_val_loss, extra = self.objective.evaluate(self.val_loader, t.eval_batches)
                else:
                    st.last_val_loss = evaluate(s, self.model, self.workload, self.val_loader,
                                                t.eval_batches)
                self.run_dir.log_metrics({"step": st.step, "val_loss": st.last_val_loss, **extra})
                if not last:
                    s.log(f"step {st.step}: val_loss {st.last_val_loss:.4f}")
            # No val= before the first evaluation (a NaN there reads as a diverged run).
            bar.update(1, loss=st.last_train_loss,
                       **({} if math.isnan(st.last_val_loss) else {"val": st.last_val_loss}))
            s.heartbeat(st.step, "train")
            if stop:
                s.log(f"interrupted by signal {self._stop_signal or 'on another rank'}: saving a "
                      f"checkpoint at step {st.step} and stopping")
                self.save_checkpoint()
                interrupted = True
                break
            if save_step:
                self.save_checkpoint()
            self._inject_faults()
        bar.close()
        self.check_finite()
        if not interrupted and ck.at_end and self._saved_step != st.step:
            self.save_checkpoint()
        self.finish_checkpoints()
        s.heartbeat(st.step, "finish")
        wall_s = time.perf_counter() - wall0
        summary = self.summary(wall_s)
        summary.update(interrupted=interrupted, resumed_from=self.resumed_from,
                       checkpoint=str(latest_checkpoint(self.run_dir.checkpoints) or "") or None)
        # Per-rank bytes in parameters/gradients/optimizer state and peak (a collective), each
        # next to the planner's prediction for that rank.
        summary["memory"] = memory = ledger.collect(s, self.model, self.optimizer)
        if s.is_main:
            summary["step_phases"] = phases.summary()
            s.log("step phases per rank (ms per step)\n" + format_phase_table(summary["step_phases"]))
            # This job's measured step times: train.compile = "auto" decides from them next time.
            record_run(job_key(self.cfg, s.device, s.world_size), s.compile, phases.host_step_s)
        predicted = {r.rank: r.to_dict() for r in self.prediction.ranks}
        for entry in memory["ranks"]:
            entry["predicted"] = predicted[entry["rank"]]
        memory["prediction"] = {k: v for k, v in self.prediction.to_dict().items() if k != "ranks"}
        memory["predicted_vs_measured"] = rows = compare_prediction(self.prediction, memory)
        if self.objective is not None:
            summary["preference"] = self.objective.summary(memory)
        s.log("memory per rank (MiB)\n" + ledger.format_table(memory))
        peak_note = ("" if any("peak_bytes" in r for r in rows) else
                     f"\n(peak not compared: measured as {memory['peak_source']}, which is not what the "
                     "planner predicts; on CUDA it is max_memory_allocated)")
        s.log("planner prediction vs measured (MiB)\n" + format_comparison(rows) + peak_note)
        self.run_dir.write_summary(summary)
        self.hooks.end(summary)
        # Training and the final save are done: nothing left can hang the job's work, and a long
        # text sample must not be reported as a hang.
        self._watchdog.stop()
        s.print(f"final train loss {summary['final_train_loss']:.4f} | "
                f"final val loss {summary['final_val_loss']:.4f} | "
                f"{summary['tokens_per_s']:.0f} tokens/s | {wall_s:.1f}s")
        if not interrupted:
            self.sample()
        return summary

    # -------------------------------------------------------------- checkpoints and faults
    def _resume_source(self) -> str | None:
        """Where this attempt resumes from (None: a fresh start); see ``resume_source``."""
        restart = f"elastic restart {self.attempt}" if self.attempt > 0 else ""
        return resume_source(self.cfg.checkpoint.resume, self.run_dir.checkpoints, restart=restart)

    def resume(self) -> dict[str, Any] | None:
        """Load the resume checkpoint, if any; return this rank's saved RNG streams (or None)."""
        source = self._resume_source()
        if source is None:
            if self.attempt > 0:
                self.session.log(f"elastic restart {self.attempt}: no checkpoint yet, starting over")
            return None
        s = self.session
        t0 = time.perf_counter()
        saved, where = saved_state(source)
        name = optimizer_name(self.optimizer)
        reset = resets_state(saved, name, self.cfg.optimizer.on_switch, where)
        optimizer, s.optimizer = s.optimizer, (None if reset else s.optimizer)
        try:  # a switch allowed: the model and data position load, the optimizer keeps its fresh state
            loaded = s.load(source, self.model, None if reset else self.optimizer, loader=self.train_loader,
                            restore_rng=False)
        finally:
            s.optimizer = optimizer
        if reset:
            s.log(f"warning: resumed {where} (optimizer {saved.get('optimizer', 'adamw')!r}) under optimizer "
                  f"{name!r} with fresh optimizer state (optimizer.on_switch = reset)", logging.WARNING)
        load_s = time.perf_counter() - t0
        self.state.step = self._saved_step = loaded.step
        self.state.last_train_loss = loaded.state.get("last_train_loss", float("nan"))
        self.state.last_val_loss = loaded.state.get("last_val_loss", float("nan"))
        self.resumed_from = str(loaded.path)
        if s.is_main:
            truncate_metrics(self.run_dir.path / "metrics.jsonl", loaded.step)
        global_batch = self.global_batch
        saved_batch = loaded.state.get("global_batch", global_batch)
        if saved_batch != global_batch:
            loaded.notes.append(f"the global batch is {global_batch}, the saved run used "
                                f"{saved_batch}: the data order continues, but training is no longer "
                                "equivalent to the saved run (keep ranks x micro-batch x accumulation)")
        saved_seed = loaded.state.get("seed", self.cfg.train.seed)
        if saved_seed != self.cfg.train.seed:
            loaded.notes.append(f"train.seed is {self.cfg.train.seed}, the saved run used {saved_seed}: the "
                                "data order from here on differs from the saved run's (keep train.seed to "
                                "continue it exactly)")
        for note in loaded.notes:
            s.log(note)
        s.log(f"resumed from {loaded.path} at step {loaded.step} (saved by "
              f"{loaded.manifest['strategy']} on {count_of(loaded.manifest['world_size'], 'rank')}; "
              f"loaded in {load_s:.2f}s)")
        return loaded.rng

    def save_checkpoint(self) -> Path:
        """Save a checkpoint of the current step into <run>/checkpoints; return its directory."""
        s, st, t = self.session, self.state, self.cfg.train
        state = {"last_train_loss": st.last_train_loss, "last_val_loss": st.last_val_loss,
                 # lr is a pure function of the step (lr_at); recorded for people reading it.
                 "next_lr": lr_at(st.step, t, self.cfg.schedule),
                 "global_batch": self.global_batch, "seed": t.seed,
                 "optimizer": optimizer_name(self.optimizer),
                 "model": {"kind": self.cfg.model.kind, "preset": self.cfg.model.preset,
                           "overrides": self.cfg.model.overrides}}
        # A checkpoint never holds NaN weights: check the flag and the weights first.
        self.check_finite()
        self._check_weights_finite()
        t0 = time.perf_counter()
        out = s.save(self.run_dir.checkpoints, self.model, self.optimizer, step=st.step,
                      state=state, loader=self.train_loader, keep_last=self.cfg.checkpoint.keep_last,
                      on_written=lambda partial, step=st.step: self._fault_in_checkpoint(step))
        self._saved_step = st.step
        self.save_blocked_s.append(s.last_save_blocked_s)
        self._log_checkpoint_metrics()  # the previous background save finished inside save()
        if isinstance(out, Path):
            s.log(f"checkpoint {out} ({time.perf_counter() - t0:.2f}s)")
            self.run_dir.log_metrics({"step": st.step, "checkpoint_blocked_s": s.last_save_blocked_s})
            return out
        s.log(f"checkpoint {out.path.name}: started in {s.last_save_blocked_s:.2f}s, copying and writing in the "
              "background")
        return out.path

    def finish_checkpoints(self) -> None:
        """Wait for the checkpoint being written in the background (raises its CheckpointError)."""
        path = self.session.wait_checkpoint()
        if path is not None:
            self.session.log(f"checkpoint {path} published")
        self._log_checkpoint_metrics()

    def _log_checkpoint_metrics(self) -> None:
        """One metrics.jsonl record per finished background save (rank 0's shard files)."""
        for stats in self.session.background_saves[self._ckpt_logged:]:
            self.run_dir.log_metrics({
                "step": stats["step"], "checkpoint_blocked_s": stats["blocked_s"],
                "checkpoint_write_s": stats["write_s"], "checkpoint_bytes": stats["bytes"],
                "checkpoint_mib_per_s": stats["mib_per_s"],
                "checkpoint_waited_for_s": stats.get("waited_for_s", 0.0)})
            self._ckpt_logged += 1

    def _install_signal_handlers(self) -> dict[int, Any]:
        # SIGTERM (schedulers, torchrun) and SIGINT (Ctrl-C) finish the current step, save and
        # stop. Handlers can only be set from the main thread.
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, frame: Any) -> None:
            self._stop_signal = signum

        return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _agree(self, loss: torch.Tensor) -> tuple[float, bool]:
        """Return (this step's loss averaged over ranks, whether any rank was asked to stop).

        One all-reduce of [loss, stop flag, non-finite flag] and one host sync: the only ones of a
        logging or checkpoint step. All ranks must agree on stopping, or one would save (a
        collective) while the others train on; so a signal is acted on at the next logging or
        checkpoint step. Raises NonFiniteError (on every rank) when any step so far was non-finite.
        """
        s = self.session
        bad = (self._first_bad_step != _NO_BAD_STEP) if self.cfg.train.nonfinite == "stop" else torch.zeros(
            (), dtype=torch.bool, device=s.device)
        flags = torch.stack([loss.detach().to(s.device, torch.float64),
                             torch.full((), float(self._stop_signal is not None), dtype=torch.float64,
                                        device=s.device),
                             bad.to(torch.float64)])
        total = s.all_reduce(flags, op="sum")
        # float() per element (item(): the first waits for the device, the others are free) rather
        # than tolist(), whose host copy the sync-count test could not see on the CPU.
        total_loss, stops, bads = float(total[0]), float(total[1]), float(total[2])
        if bads > 0:
            self.check_finite()  # a min-reduce names the first bad step, then raises everywhere
        return total_loss / s.world_size, stops > 0

    def _throughput_meter(self, tokens_per_step: int) -> ThroughputMeter:
        """The MFU/throughput meter; rank 0 (which writes the metrics) looks up or measures the peak."""
        s = self.session
        peak = device_peak(s.device, self.cfg.parallel.precision) if s.is_main else Peak(None, "rank 0 reports")
        if s.is_main:
            where = (f"{peak.tflops:.4g} TFLOP/s per device ({peak.source})" if peak.tflops
                     else f"no peak: {peak.source}")
            s.log(f"MFU: {self.flops_per_token:.4g} model FLOPs/token (planner's count) against {where}")
        return ThroughputMeter(tokens_per_step=tokens_per_step, flops_per_token=self.flops_per_token,
                               devices=s.world_size, peak=peak)

    def _fault_active(self, rank: int, step: int, at_step: int | None = None) -> bool:
        d = self.cfg.debug
        at_step = self.state.step if at_step is None else at_step
        return (rank == self.session.rank and step == at_step and step > 0
                and (self.attempt == 0 or d.every_attempt))

    def _inject_faults(self) -> None:
        d = self.cfg.debug
        if not d.kill_in_checkpoint and self._fault_active(d.kill_rank, d.kill_at_step):
            os.kill(self._kill_target(), signal.SIGKILL)
        if self._fault_active(d.hang_rank, d.hang_at_step):
            while True:  # stop participating; the watchdog must notice
                time.sleep(3600)
        faults.signal_after_step(self.state.step, self.session.rank)  # SHARDWISE_DEBUG_SIGNAL (tests)

    def _fault_in_checkpoint(self, saved_step: int) -> None:
        # Runs on the writing thread, after this rank's files of ``saved_step`` are on disk: with a
        # background write, training may already be past that step.
        d = self.cfg.debug
        if d.kill_in_checkpoint and self._fault_active(d.kill_rank, d.kill_at_step, saved_step):
            os.kill(self._kill_target(), signal.SIGKILL)

    def _kill_target(self) -> int:
        """This rank, or with ``debug.kill_launcher`` the launcher that started the job (its process
        record is in the ranks' environment, runtime.lifeline)."""
        record = launcher_record()
        return int(record["pid"]) if self.cfg.debug.kill_launcher and record else os.getpid()

    def summary(self, wall_s: float) -> dict[str, Any]:
        s, st = self.session, self.state
        ckpt = s.checkpoint_stats
        return {
            "strategy": s.strategy_name, "world_size": s.world_size, "layout": s.layout.to_dict(),
            "precision": self.cfg.parallel.precision, "steps": st.step,
            "final_train_loss": st.last_train_loss, "final_val_loss": st.last_val_loss,
            # tokens_per_s, step_time_s, tflops_per_device, mfu, data_fraction, flops_per_token,
            # peak_tflops_per_device, peak_source, devices (observe.throughput)
            **self.meter.summary(),
            "wall_s": wall_s, "device": str(s.device), "skipped_steps": self.skipped_steps,
            "compile": self.session.compile,
            # Time each save blocked training, and the background writes (runtime.checkpoint.background).
            # A background save also blocks the first optimizer step that waits for its copy.
            "checkpoint_io": {**ckpt, "saves": len(self.save_blocked_s),
                           "blocked_s_total": sum(self.save_blocked_s) + ckpt["staging_wait_s_total"],
                           "blocked_s_max": max([*self.save_blocked_s,
                                                 *(b.get("blocked_s", 0.0) for b in s.background_saves)],
                                                default=0.0)},
        }

    def sample(self) -> str | None:
        """Generate and print a text sample (every rank computes it: sharded models need all)."""
        n = self.cfg.train.sample_tokens
        if not n or self.workload.sample_text is None:
            return None
        reason = self.session.strategy.generation_unsupported()
        if self.session.layout.cp > 1:  # attention expects 1/cp of a sequence per rank
            reason = "context parallel (parallel.cp > 1) runs attention on sequence chunks"
        if reason:
            self.session.log(f"skipping the text sample under {self.session.strategy_name}: {reason}.")
            return None
        text = self.workload.sample_text(self.session.unwrap(self.model), self.session.device, n,
                                         self.cfg.train.seed)
        self.session.print("--- sample ---\n" + text.strip() + "\n--------------")
        return text


def train(cfg: RunConfig, out_dir: str | Path | None = None, attempt: int = 0,
          launch_id: str | None = None) -> dict[str, Any]:
    """Train ``cfg`` on this rank (inside torchrun, or as one process) and return the summary."""
    trainer = Trainer(cfg, out_dir, attempt=attempt, launch_id=launch_id)
    try:
        return trainer.run()
    finally:
        trainer.session.close()
