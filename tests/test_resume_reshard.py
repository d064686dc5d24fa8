"""Resharding: one training run continued across strategies and rank counts (DCP reshards on load).

fsdp on 4 ranks -> fsdp on 2 -> ddp on 2 -> single, with the global batch (16) kept, must follow
the uninterrupted single-process run step for step. The lr is held constant here so that each
segment's ``train.steps`` (where it stops) does not change the schedule.
Tolerance: float32 sums in a different order per layout; observed differences are ~2e-7, the
test allows 1e-5 absolute on the loss and 1e-4 on the parameters.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.core.config import load_config
from shardwise.runtime.trainer import Trainer
from shardwise.testing import run_distributed
from tests.helpers.ckpt import fast_overrides, final_weights, losses, small_text, train_rank

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 16


def _overrides(data, steps, strategy, ranks, resume=""):
    return [*fast_overrides(data, steps=steps, every=3, micro_batch=GLOBAL_BATCH // ranks),
            "train.warmup_steps=0", "train.min_lr=1e-3", f"parallel.strategy={strategy}",
            f'checkpoint.resume="{resume}"']


def _in_process(overrides, out):
    trainer = Trainer(load_config(None, overrides), out)
    try:
        return trainer.run()
    finally:
        trainer.session.close()


def test_fsdp4_to_fsdp2_to_ddp2_to_single_follows_the_reference(tmp_path):
    data = small_text(tmp_path)
    _in_process(_overrides(data, 12, "single", 1), tmp_path / "ref")
    chain = [("fsdp", 4, 3), ("fsdp", 2, 6), ("ddp", 2, 9), ("single", 1, 12)]
    previous, seen = "", {}
    for strategy, ranks, until in chain:
        out = tmp_path / f"{strategy}{ranks}"
        ov = _overrides(data, until, strategy, ranks, resume=previous)
        if ranks == 1:
            summary = _in_process(ov, out)
        else:
            summary = run_distributed(train_rank, ranks, timeout_s=300, overrides=ov, out=str(out))[0]
        assert summary["steps"] == until
        assert (summary["resumed_from"] or "").endswith(f"step-{until - 3:08d}") or not previous
        seen.update(losses(out))
        previous = str(out / "checkpoints")
    ref = losses(tmp_path / "ref")
    assert sorted(seen) == list(range(1, 13))
    for step in ref:
        assert seen[step] == pytest.approx(ref[step], abs=1e-5), step
    ref_w, got_w = final_weights(tmp_path / "ref"), final_weights(tmp_path / "single1")
    for name in ref_w:
        torch.testing.assert_close(got_w[name], ref_w[name], rtol=1e-4, atol=1e-4)
