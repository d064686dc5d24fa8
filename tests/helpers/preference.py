"""Preference records and configs for the DPO tests (tiny Qwen2 folders come from tests.helpers.sft)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.helpers.sft import CHATML  # noqa: F401  (the template the folders carry)

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone", "seven", "nine"]


def preference_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` records: chat prompts (every third one plain text) with different chosen/rejected answers."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b, c = (WORDS[k] for k in rng.choice(len(WORDS), 3, replace=False))
        question = f"Which word goes with {a} number {i}?"
        prompt = question if i % 3 == 0 else [{"role": "user", "content": question}]
        chosen = f"It is {b}, clearly {b}." if i % 2 else [{"role": "assistant", "content": f"{b} {b}"}]
        out.append({"prompt": prompt, "chosen": chosen, "rejected": f"Maybe {c} or {a}, not sure at all."})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def dpo_overrides(model: Path, data: Path, strategy: str, *extra: str) -> list[str]:
    return [f'model.pretrained="{model}"', f'data.path="{data}"', "model.overrides.block_size=128",
            "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=0", "train.eval_every=0",
            "train.progress=false", "checkpoint.every=0", f'parallel.strategy="{strategy}"', "data.val_fraction=0.2",
            "preference.beta=0.5", *extra]


def dpo_metrics(cfg, steps: int, out: str) -> dict:
    """Train ``steps`` DPO steps of ``cfg`` on this rank; the window's global metrics and the
    held-out evaluation (every rank gets the same numbers)."""
    from shardwise.runtime.session import Session
    from shardwise.runtime.trainer import Trainer

    t = cfg.train
    session = Session(parallel=cfg.parallel, grad_accum_steps=t.grad_accum_steps, seed=t.seed)
    try:
        trainer = Trainer(cfg, out, session)
        batches = trainer.train_loader.forever()
        for _ in range(steps):
            trainer.train_step(batches)
        window = trainer.objective.take_metrics()
        val_loss, val = trainer.objective.evaluate(trainer.val_loader, t.eval_batches)
        return {**window, "val_loss": val_loss, **val, "dp_size": session.dp_size}
    finally:
        session.close()


def dpo_rank(rank: int, world_size: int, cases: list[dict], metrics: list[dict]) -> dict:
    """Rank function of one spawn: ``verify_cases`` and then ``dpo_metrics`` of each metrics config."""
    from tests.helpers.sft import verify_cases

    return {"verify": verify_cases(rank, world_size, cases), "metrics": [dpo_metrics(**m) for m in metrics]}
