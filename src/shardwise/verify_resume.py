"""``shardwise verify --resume``: is an interrupted and resumed run the uninterrupted one?

Runs the user's configuration three times through ``shardwise train`` itself (so every path the
user's job takes — their model and data factories, strategy, checkpoint mode — is what is
checked):

1. uninterrupted for N steps;
2. the same, stopped by SIGTERM after step k1 (the run saves its interrupt checkpoint mid-epoch,
   exactly as under a scheduler's preemption; ``runtime.faults`` sends the signal);
3. resumed, stopped again by SIGINT after step k2; then resumed to step N (on
   ``--resume-nproc`` ranks when given).

It compares every step's training loss and the final weights (the last checkpoint, consolidated)
and names the first step that differs. Same world size and strategy: expected bit for bit.
Across a world-size change the data order and global batch are kept, but gradients are summed
over a different number of ranks in another order, so losses and weights are only close: they
are compared within the precision's tolerance of ``shardwise verify``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.runtime.faults import SIGNAL_ENV


@dataclass
class ResumeReport:
    steps: int
    interrupts: tuple[int, int]
    exact: bool  # bit for bit expected (same world size); else within tolerance
    reference: dict[int, float]
    resumed: dict[int, float]
    weight_diff: float
    worst_param: str
    tolerance: tuple[float, float] = (0.0, 0.0)  # loss atol, param atol (0 when exact)
    notes: list[str] = field(default_factory=list)

    def first_difference(self) -> int | None:
        """The first step whose loss differs (beyond the tolerance), or is missing; None when all agree."""
        atol = self.tolerance[0]
        for step in range(1, self.steps + 1):
            a, b = self.reference.get(step), self.resumed.get(step)
            if a is None or b is None or (a != b if self.exact else abs(a - b) > atol + atol * abs(a)):
                return step
        return None

    @property
    def passed(self) -> bool:
        weights_ok = self.weight_diff == 0.0 if self.exact else self.weight_diff <= self.tolerance[1]
        return self.first_difference() is None and weights_ok

    def table(self) -> str:
        k1, k2 = self.interrupts
        rows = [f"{'step':>5} {'uninterrupted':>16} {'interrupted+resumed':>20}  diff"]
        for step in range(1, self.steps + 1):
            a, b = self.reference.get(step), self.resumed.get(step)
            diff = "missing" if a is None or b is None else f"{abs(a - b):.3g}"
            # A signal after step k is acted on at the end of step k + 1, which is saved.
            mark = "  <- resumed here" if step - 2 in (k1, k2) else ""
            rows.append(f"{step:>5} {a if a is not None else float('nan'):>16.8f} "
                        f"{b if b is not None else float('nan'):>20.8f}  {diff}{mark}")
        what = "bit for bit" if self.exact else (f"within loss {self.tolerance[0]:g} (+ relative) and "
                                                  f"weights {self.tolerance[1]:g}")
        first = self.first_difference()
        verdict = (f"PASS: the run signalled after steps {k1} and {k2} (saved at {k1 + 1} and {k2 + 1}) and "
                   "resumed equals the "
                   f"uninterrupted one {what} (losses of all {self.steps} steps, final weights)."
                   if self.passed else
                   f"FAIL: expected {what}; " + (f"first differing step: {first}. " if first else "")
                   + f"largest final weight difference {self.weight_diff:.3g} ({self.worst_param or '-'}).")
        return "\n".join([*rows, *self.notes, verdict])

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "interrupts": list(self.interrupts), "exact": self.exact,
                "reference_losses": self.reference, "resumed_losses": self.resumed,
                "max_weight_diff": self.weight_diff, "worst_param": self.worst_param,
                "first_difference": self.first_difference(), "passed": self.passed}


def interrupt_points(steps: int) -> tuple[int, int]:
    """The steps after which the run is interrupted: about a third and two thirds of the way."""
    if steps < 4:
        raise ConfigError(f"verify --resume needs --steps >= 4 (two interrupts and a resume between "
                          f"and after them), got {steps}.")
    k1 = max(1, steps // 3)
    return k1, max(k1 + 2, (2 * steps) // 3) if steps >= k1 + 3 else k1 + 1


def _losses(run: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[int(record["step"])] = float(record["loss"])
    return out


def _train(base: list[str], out: Path, nproc: int, extra: list[str], env: dict[str, str]) -> int:
    cmd = [sys.executable, "-m", "shardwise", "train", *base, "--nproc", str(nproc), "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).returncode


def verify_resume(recipe: str | None, overrides: list[str], *, strategy: str | None, nproc: int, steps: int,
                  out: str | os.PathLike, reshard_tolerance: tuple[float, float], resume_nproc: int | None = None,
                  env: dict[str, str] | None = None) -> ResumeReport:
    """Run the three legs described in the module docstring under ``out``; return the comparison.

    ``reshard_tolerance``: (loss, parameter) bounds for a resume on another number of ranks
    (``verify.TOLERANCES`` of the run's precision); a resume on the same ranks must be exact."""
    import torch  # defers torch

    from shardwise.runtime.checkpoint.export import read_full_model_state  # defers torch

    k1, k2 = interrupt_points(steps)
    out = Path(out)
    env = dict(os.environ if env is None else env)
    env.pop(SIGNAL_ENV, None)
    sets = [*overrides, f"train.steps={steps}", "train.log_every=1", "checkpoint.at_end=true"]
    base = [*([recipe] if recipe else []), *(["--strategy", strategy] if strategy else [])]
    for o in sets:
        base += ["--set", o]
    ref, run = out / "uninterrupted", out / "interrupted"
    legs = [(ref, nproc, [], {}), (run, nproc, [], {SIGNAL_ENV: f"step={k1},signal=TERM"}),
            (run, nproc, ["--resume"], {SIGNAL_ENV: f"step={k2},signal=INT"}),
            (run, resume_nproc or nproc, ["--resume"], {})]
    names = ("uninterrupted", "first interrupted", "second interrupted", "last resumed")
    for i, (where, n, extra, fault) in enumerate(legs):
        rc = _train(base, where, n, ["--overwrite"] if i in (0, 1) else extra, {**env, **fault})
        want = 130 if fault else 0  # an interrupted run saves and exits 130
        if rc != want:
            raise ConfigError(f"verify --resume: the {names[i]} run in {where} exited with {rc} (expected "
                              f"{want}); see its rank logs in {where / 'logs'}.")
    exact = resume_nproc in (None, nproc)
    ref_w, _ = read_full_model_state(ref / "checkpoints")
    run_w, _ = read_full_model_state(run / "checkpoints")
    worst, worst_name = 0.0, ""
    for name, a in ref_w.items():
        b = run_w.get(name)
        diff = float("inf") if b is None or b.shape != a.shape else (
            0.0 if torch.equal(a, b) else (a.double() - b.double()).abs().max().item())
        if diff > worst:
            worst, worst_name = diff, name
    notes = [] if exact else [f"resumed the last part on {resume_nproc} ranks (saved on {nproc}): losses and "
                              "weights are expected close, not equal (gradients are reduced over another "
                              "number of ranks)."]
    return ResumeReport(steps=steps, interrupts=(k1, k2), exact=exact, reference=_losses(ref),
                        resumed=_losses(run), weight_diff=worst, worst_param=worst_name,
                        tolerance=(0.0, 0.0) if exact else reshard_tolerance, notes=notes)
