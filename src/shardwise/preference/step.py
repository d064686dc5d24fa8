"""The built-in trainer's DPO objective (``train.objective = "dpo"``), on the public Session API.

Per micro-batch: the reference's log-probs of the batch's pairs (adapters off, the frozen copy, or
the precomputed ones that came with the data), then ONE policy forward over chosen and rejected
together (``preference.batches``) whose loss is the micro-batch's mean DPO loss, through
``Session.forward_backward`` like any loss. Every micro-batch holds ``micro_batch_size`` pairs, so
Session's 1/A and data-parallel averaging make the step's gradient that of the global batch's mean.

Metrics (``dpo/...`` in metrics.jsonl and the trackers) are sums over the logging window's pairs of
every rank, all-reduced at logging steps and divided by the pair count: global, not rank 0's.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from shardwise.errors import ConfigError
from shardwise.models.masking import real_token_count
from shardwise.models.moe import adds_aux_loss, with_aux_loss
from shardwise.plan.preference import dpo_layout_refusal, reference_for
from shardwise.preference import pipeline as pipe
from shardwise.preference import reference as refs
from shardwise.preference.objective import answer_lengths, answer_logps, pair_halves, pair_scores, preference_losses
from shardwise.runtime.collective import gather

# Window sums: pairs, loss, chosen reward, rejected reward, correct pairs, chosen logp, rejected logp.
_SLOTS = 7


def check_layout(layout: Any, strategy: Any, cfg: Any) -> None:
    """ConfigError where the DPO step of ``cfg`` cannot run under this layout (preflight asks before
    launch; every rank asks again; the rule is ``plan.preference.dpo_layout_refusal``'s)."""
    reference = reference_for(cfg.lora.rank, cfg.preference.precompute_reference)
    why = dpo_layout_refusal(layout, strategy.owns_step, reference)
    if why:
        raise ConfigError(why)


class PreferenceStep:
    """The DPO step, evaluation, metrics and reference model of one trainer (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        cfg, s = trainer.cfg, trainer.session
        check_layout(s.layout, s.strategy, cfg)
        self.session, self.pc, self.model = s, cfg.preference, trainer.model
        self.pack = cfg.data.packed
        # A mixture-of-experts model's router losses join each micro-batch's DPO loss (scale 1, as
        # beside the language-model loss: models/moe.py), as TRL adds them; the reference's never do.
        self.aux = adds_aux_loss(trainer.workload.loss_fn)
        self.mode = reference_for(cfg.lora.rank, self.pc.precompute_reference)
        # Pipeline parallel: pairs kept whole in each microbatch, every batch at one width.
        self.width = 0
        if s.layout.pp > 1:
            self.width = pipe.row_width(trainer.workload.tokens_per_sample, self.pack)
        self.ref_model = None
        self.scores: dict[str, np.ndarray] | None = None
        t0 = time.perf_counter()
        if self.mode == "copy":
            self.ref_model = refs.frozen_copy(s, trainer.workload.build_model, trainer.model)
        elif self.mode == "precomputed":
            self._precompute(trainer)
        self.setup_s = time.perf_counter() - t0
        mine = refs.reference_bytes(self.mode, self.ref_model, self.scores)
        self.reference_bytes = [int(b) for b in _gather(s, mine)]
        s.log(f"dpo: {self.pc.loss} loss, beta {self.pc.beta:g}, label smoothing {self.pc.label_smoothing:g}; "
              f"reference: {self.describe()} ({max(self.reference_bytes) / 2**20:.1f} MiB per rank, set up in "
              f"{self.setup_s:.2f}s)")
        self._window = torch.zeros(_SLOTS, dtype=torch.float64, device=s.device)
        self._calls: list[torch.Tensor] = []  # a pipeline step's window sums, call by call

    def describe(self) -> str:
        return {"adapters": "the model with its LoRA adapters off (no copy)",
                "copy": "a frozen copy sharded like the policy",
                "precomputed": "log-probs scored once before training"}[self.mode]

    # ------------------------------------------------------------------ the reference
    def _precompute(self, trainer: Any) -> None:
        s, cfg = self.session, trainer.cfg
        train_set, val_set = trainer.workload.train_set, trainer.workload.val_set
        # The file holds summed log-probs whatever the loss (files keyed by the loss held IPO's means).
        key = refs.fingerprint(train_set, {"val": refs.fingerprint(val_set, {}), "model": cfg.model.pretrained,
                                           "lora": cfg.lora.rank, "logps": "sums",
                                           "precision": cfg.parallel.precision, "pack": self.pack})
        path = trainer.run_dir.path / refs.REFERENCE_FILE
        scores = refs.load_scores(path, key) if s.is_main else None
        scores = s.broadcast_object(scores) if s.is_distributed else scores
        if scores is None:
            collate, b = trainer.workload.collate_fn, cfg.train.micro_batch_size
            per_row = 2 if self.pack else 1
            scores = {part: refs.score_pairs(s, self.model, data, collate, b, per_row, width=self.width)
                      for part, data in (("train", train_set), ("val", val_set))}
            if s.is_main:
                refs.save_scores(path, key, scores)
            s.log(f"dpo: scored the reference on {len(train_set) + len(val_set):,} pairs; kept in {path}")
        else:
            s.log(f"dpo: reference log-probs read from {path}")
        train_set.ref, val_set.ref = scores["train"], scores["val"]
        self.scores = scores

    def _reference(self, inputs: Any, targets: dict[str, torch.Tensor], answers: int) -> tuple[torch.Tensor, ...]:
        if "ref" in targets:
            return targets["ref"][:, 0], targets["ref"][:, 1]
        if self.mode == "adapters":
            with refs.adapters_off(self.model):
                return refs.score_batch(self.session, self.model, inputs, targets, answers, width=self.width)
        if self.ref_model is None:
            raise ConfigError("the precomputed reference log-probs are missing from this batch")
        return refs.score_batch(self.session, self.ref_model, inputs, targets, answers, width=self.width)

    # ------------------------------------------------------------------ one step
    def _answers(self, targets: dict[str, torch.Tensor]) -> int:
        rows = targets["labels"].shape[0]
        return 2 * rows if self.pack else rows

    def _to_device(self, batch: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        inputs, targets = batch
        return self.session.to_device(inputs), {k: v.to(self.session.device) for k, v in targets.items()}

    def _lengths(self, targets: dict[str, torch.Tensor], answers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (chosen, rejected) answers' token counts of a batch."""
        return pair_halves(answer_lengths(targets["labels"], targets["segments"], answers))

    def _terms(self, chosen: torch.Tensor, rejected: torch.Tensor, ref: tuple[torch.Tensor, ...],
               lengths: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair losses, this batch's window sums) from the pairs' policy and reference log-prob
        sums and their answers' token counts."""
        pc = self.pc
        losses, r_c, r_r = preference_losses(chosen, rejected, ref[0], ref[1], beta=pc.beta,
                                             label_smoothing=pc.label_smoothing, loss=pc.loss, lengths=lengths)
        sums = torch.stack([torch.full_like(losses[0], losses.shape[0]), losses.sum(), r_c.sum(), r_r.sum(),
                            (r_c > r_r).to(losses.dtype).sum(), chosen.sum(), rejected.sum()])
        return losses, sums.detach().double()

    def _loss_fn(self, segments: torch.Tensor, answers: int, ref: tuple[torch.Tensor, ...],
                 lengths: tuple[torch.Tensor, torch.Tensor]) -> Any:
        s = self.session
        # Under context parallel each rank scores its chunk of every answer: the segments are cut as
        # the labels are, and the answers' sums added over the cp ranks (differentiably) before the loss.
        segments = s.sequence_chunk(segments, -1)

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            chosen, rejected = pair_scores(logits, labels, segments, answers, s.sequence_sum)
            losses, sums = self._terms(chosen, rejected, ref, lengths)
            self._window += sums
            return losses.mean()
        return with_aux_loss(loss_fn) if self.aux else loss_fn

    def _pipeline_loss_fn(self, per_row: int) -> Any:
        """The loss of one pipeline microbatch, from its share of ``pipeline.pipeline_batch``'s target."""
        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            labels, answer, n, ref = pipe.decode(target, per_row)
            sums = answer_logps(logits, labels, answer, n)[0]
            lengths = pipe.halves(answer_lengths(labels, answer, n))
            losses, window = self._terms(*pipe.halves(sums), pipe.halves(ref), lengths)
            self._calls.append(window)
            return losses.mean()
        return with_aux_loss(loss_fn) if self.aux else loss_fn

    def micro_batches(self, trainer: Any, batches: Any, steps: int) -> torch.Tensor:
        """Run one optimizer step's ``steps`` micro-batches (forward + backward); return their loss sum.

        A live reference scores every micro-batch of the step before the first training forward:
        under pipeline parallel each switch between evaluation and training sets torch's schedule
        up again (a forward and backward of shape inference, parallel/pipeline/pp.py), so one block of
        evaluations per step costs one set-up instead of one per micro-batch."""
        s = self.session
        loss_sum = torch.zeros((), device=s.device)
        real = 0
        micro = []
        for _ in range(steps):
            t0 = time.perf_counter()
            inputs, targets = self._to_device(next(batches))
            trainer.data_wait_s += time.perf_counter() - t0
            real += real_token_count(inputs)
            micro.append((inputs, targets, self._answers(targets)))
        references = [self._reference(inputs, targets, answers) for inputs, targets, answers in micro]
        for (inputs, targets, answers), ref in zip(micro, references):
            if self.width:
                inputs, target, per_row = pipe.pipeline_batch(inputs, targets, ref, self.width)
                self._calls = []
                loss_sum += s.forward_backward(self.model, inputs, target, self._pipeline_loss_fn(per_row)).float()
                # The last stage's calls: torch's shape inference calls the loss first (on a forward of
                # microbatch 0, when the schedule (re)initialises), then once per microbatch.
                for window in self._calls[-s.layout.pp_microbatches:]:
                    self._window += window
                continue
            loss_fn = self._loss_fn(targets["segments"], answers, ref, self._lengths(targets, answers))
            loss_sum += s.forward_backward(self.model, inputs, targets["labels"], loss_fn).float()
        # Tokens of both answers' sequences on every data-parallel rank (what tokens/s counts).
        trainer.real_tokens = trainer.real_tokens + self._global_count(real)
        return loss_sum

    def _global_count(self, value: float) -> torch.Tensor:
        s = self.session
        t = torch.tensor(float(value), dtype=torch.float64, device=s.device)
        if s.is_distributed:
            t = s.all_reduce(t, op="sum") / (s.world_size // s.dp_size)
        return t

    # ------------------------------------------------------------------ metrics and evaluation
    def _means(self, sums: torch.Tensor, prefix: str, last_stage_only: bool = False) -> dict[str, float]:
        s = self.session
        if s.is_distributed:  # tp peers hold the same pairs: count them once
            peers = s.world_size // s.dp_size
            # A pipeline's training loss runs on its last stage only: the other stages add zeros.
            sums = s.all_reduce(sums, op="sum") / (peers // s.layout.pp if last_stage_only else peers)
        v = [float(x) for x in sums]
        n = max(v[0], 1.0)
        return {f"{prefix}loss": v[1] / n, f"{prefix}reward_chosen": v[2] / n, f"{prefix}reward_rejected": v[3] / n,
                f"{prefix}margin": (v[2] - v[3]) / n, f"{prefix}accuracy": v[4] / n,
                f"{prefix}logp_chosen": v[5] / n, f"{prefix}logp_rejected": v[6] / n, f"{prefix}pairs": v[0]}

    def take_metrics(self) -> dict[str, float]:
        """The logging window's global means (a collective: every rank calls it at logging steps)."""
        out = self._means(self._window, "dpo/", last_stage_only=self.width > 0)
        self._window.zero_()
        return out

    @torch.no_grad()
    def evaluate(self, loader: Any, max_batches: int) -> tuple[float, dict[str, float]]:
        """(mean held-out DPO loss, its global reward/accuracy means) over ``max_batches`` batches."""
        s = self.session
        sums = torch.zeros(_SLOTS, dtype=torch.float64, device=s.device)
        for i, batch in enumerate(loader):
            if i >= max_batches:
                break
            inputs, targets = self._to_device(batch)
            answers = self._answers(targets)
            ref = self._reference(inputs, targets, answers)
            chosen, rejected = refs.score_batch(s, self.model, inputs, targets, answers, width=self.width)
            sums += self._terms(chosen, rejected, ref, self._lengths(targets, answers))[1]
        out = self._means(sums, "val_")
        return out.pop("val_loss"), out

    def summary(self, memory: dict[str, Any] | None = None) -> dict[str, Any]:
        """The objective's part of summary.json; the reference's bytes join the ledger's rows."""
        for entry in (memory or {}).get("ranks", []):
            entry["reference_bytes"] = self.reference_bytes[entry["rank"]]
        return {"objective": "dpo", "loss": self.pc.loss, "beta": self.pc.beta,
                "label_smoothing": self.pc.label_smoothing, "reference": self.mode,
                "reference_bytes_per_rank": self.reference_bytes, "reference_setup_s": round(self.setup_s, 3)}


def _gather(session: Any, value: int) -> list[int]:
    return gather(value) if session.is_distributed else [value]


def build_objective(trainer: Any) -> PreferenceStep | None:
    """The trainer's objective step for ``train.objective`` (None: the language-model loss)."""
    return PreferenceStep(trainer) if trainer.cfg.train.objective == "dpo" else None
