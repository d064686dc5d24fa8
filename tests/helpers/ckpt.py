"""Shared pieces of the checkpoint / resume / elastic / watchdog tests (spawned ranks import these)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from shardwise.core.config import load_config
from shardwise.data.shakespeare import bundled_text_path
from shardwise.testing import run_command

# A 6000-character corpus with half of it for validation: 3000 training characters give about
# 185 half-overlapping windows of the nano preset, i.e. 11 global batches of 16 per epoch, so a
# 14-step run crosses an epoch boundary and resumes mid-epoch.
SMALL_TEXT_CHARS = 6000


def small_text(directory: Path) -> Path:
    """Write the small training corpus into ``directory`` and return its path."""
    path = Path(directory) / "small.txt"
    if not path.exists():
        path.write_text(bundled_text_path().read_text(encoding="utf-8")[:SMALL_TEXT_CHARS], encoding="utf-8")
    return path


def fast_overrides(data_path: Path, steps: int = 14, every: int = 3, micro_batch: int = 8) -> list[str]:
    """--set overrides for a tiny, quick, deterministic GPT run (global batch 16 at any rank count)."""
    return [
        "model.preset=nano", f"train.steps={steps}", "train.eval_every=0", "train.eval_batches=2",
        "train.sample_tokens=0", "train.progress=false", "train.log_every=1",
        f"train.micro_batch_size={micro_batch}", f'data.path="{data_path}"', "data.val_fraction=0.5",
        f"checkpoint.every={every}", "train.lr=1e-3", "train.warmup_steps=2",
    ]


def cli_args(overrides: list[str]) -> list[str]:
    """The overrides as ``--set`` command-line arguments."""
    out: list[str] = []
    for o in overrides:
        out += ["--set", o]
    return out


def run_cli(argv: list[str], env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``python -m shardwise ARGV`` and return the finished process (text output)."""
    return run_command([sys.executable, "-m", "shardwise", *argv], env=env, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step training losses logged in ``run_dir``/metrics.jsonl."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """Full model weights of the run's latest checkpoint (read without a process group)."""
    from shardwise.runtime.checkpoint.export import read_full_model_state

    weights, _ = read_full_model_state(run_dir)
    return weights


def train_rank(rank: int, world_size: int, overrides: list[str], out: str) -> dict:
    """Run the built-in Trainer on this rank (the harness made the process group); return results."""
    from shardwise.runtime.trainer import Trainer

    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, out)
    summary = trainer.run()
    trainer.session.close()
    return {"steps": summary["steps"], "resumed_from": summary["resumed_from"]}


def async_resume_cases(rank: int, world_size: int, cases: list[tuple[str, list[str]]], data: str,
                       root: str) -> dict:
    """For each case (name, overrides): train 6 steps with async checkpoints every 2 (training goes
    on while each is written), then resume a second run from the step-4 checkpoint; return both
    runs' per-step losses and final weights (rank 0), for a bit-exact comparison."""
    import torch

    from shardwise.runtime.checkpoint.export import read_full_model_state
    from shardwise.runtime.trainer import Trainer

    out: dict = {}
    for name, extra in cases:
        base = [*fast_overrides(Path(data), steps=6, every=2), "checkpoint.mode=async", "checkpoint.keep_last=5",
                *extra]
        a, b = Path(root) / name / "a", Path(root) / name / "b"
        for run_dir, more in ((a, []), (b, [f'checkpoint.resume="{a / "checkpoints" / "step-00000004"}"'])):
            trainer = Trainer(load_config(None, [*base, *more]), run_dir)
            summary = trainer.run()
            trainer.session.close()
        if rank == 0:
            weights = [read_full_model_state(d / "checkpoints")[0] for d in (a, b)]
            out[name] = {"losses": [losses(a), losses(b)], "summary": summary["checkpoint_io"],
                         "same_weights": all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
                         and weights[0].keys() == weights[1].keys()}
    return out
