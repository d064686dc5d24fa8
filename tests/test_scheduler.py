"""LR schedulers through Session.prepare (re-pointed under zero1) and checkpoints (JSON, resumed exactly)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.runtime.checkpoint.manifest import read_manifest
from shardwise.runtime.session import Session
from shardwise.testing import run_distributed
from tests.helpers.sched import STEPS, run_with_scheduler, zero1_scheduler_rank


def _lambda(step: int) -> float:
    return 0.5 ** step


def test_prepare_returns_the_scheduler_instance_or_builds_the_callable():
    with Session() as s:
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lambda)
        out = s.prepare(model, opt, sched)
        assert len(out) == 3 and out[1] is opt and out[2] is sched and s.scheduler is sched
    with Session() as s:
        built = s.prepare(nn.Linear(3, 2), lambda p: torch.optim.SGD(p, lr=1.0),
                          lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1))
        assert built[2].optimizer is built[1] and len(built) == 3
    with Session() as s:
        model = nn.Linear(3, 2)
        assert len(s.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))) == 2


@pytest.mark.parametrize("case, match", [
    ("no-optimizer", "got a scheduler but no optimizer"),
    ("other-optimizer", "built on another optimizer"),
    ("not-a-scheduler", "the scheduler is a int"),
    ("callable-returns-junk", "must return an LR scheduler built on the optimizer it receives"),
])
def test_scheduler_misuse_is_refused(case, match):
    with Session() as s:
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        other = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=1.0)
        args = {"no-optimizer": (None, torch.optim.lr_scheduler.LambdaLR(opt, _lambda)),
                "other-optimizer": (opt, torch.optim.lr_scheduler.LambdaLR(other, _lambda)),
                "not-a-scheduler": (opt, 3),
                "callable-returns-junk": (opt, lambda o: "junk")}[case]
        with pytest.raises(ShardwiseError, match=match):
            s.prepare(model, *args)


def test_checkpoint_keeps_scheduler_state_as_json_and_resume_is_exact(tmp_path):
    """Single process: save after 3 steps, restart, load; the rest of the run is bit-identical."""
    full = run_with_scheduler("single")
    resumed = run_with_scheduler("single", ckpt_dir=str(tmp_path), split_at=3)
    assert resumed["losses"] == full["losses"] and resumed["lrs"] == full["lrs"]
    assert len(set(full["lrs"])) == STEPS  # the lr really changes every step
    assert resumed["last_epoch_after_load"] == 3
    manifest = read_manifest(tmp_path / "step-00000003")
    state = manifest["scheduler"]  # plain JSON inside the checksummed manifest; no pickle anywhere
    assert state["last_epoch"] == 3 and len(state["_schedulers"]) == 2 and "optimizer" not in state
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "rng-rank0.json"}


class _TensorFactor:
    """An lr lambda object whose state holds a tensor, which JSON cannot store."""

    def __init__(self) -> None:
        self.scale = torch.tensor(0.5)

    def __call__(self, step: int) -> float:
        return float(self.scale) ** step


def test_scheduler_state_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
    with Session() as s:
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt, _ = s.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _TensorFactor()))
        with pytest.raises(ShardwiseError, match=r"not JSON data .*never run code"):
            s.save(tmp_path / "ckpt", model, opt, step=1)
    assert not (tmp_path / "ckpt").exists()


def test_loading_a_checkpoint_without_scheduler_state_says_so(tmp_path):
    with Session() as s:
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        s.save(tmp_path, model, opt, step=1)
    with Session() as s:
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt, sched = s.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _lambda))
        loaded = s.load(tmp_path, model, opt)
        assert any("holds no LR scheduler state" in n for n in loaded.notes) and sched.last_epoch == 0


def test_zero1_repoints_the_scheduler_and_resumes_it(tmp_path):
    """2 ranks: zero1 swaps in a ZeroRedundancyOptimizer; the scheduler drives it, matches one
    process step for step, survives a save/restart/load, and tp refuses a pre-built scheduler."""
    reference = run_with_scheduler("single")
    r0, r1 = run_distributed(zero1_scheduler_rank, 2, timeout_s=420, ckpt_dir=str(tmp_path))
    for r in (r0, r1):
        assert r["full"]["zero"] and r["full"]["repointed"] and r["full"]["children_repointed"]
        # The learning rate the inner (sharded) optimizer really stepped with, every step.
        assert r["full"]["lrs"] == pytest.approx(reference["lrs"], rel=1e-12)
        assert r["full"]["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        # Restarted after step 3: same lrs (the outer optimizer got the restored lr back) and losses.
        assert r["resumed"]["lrs"] == r["full"]["lrs"]
        assert r["resumed"]["losses"] == pytest.approx(r["full"]["losses"], abs=1e-6)
        assert r["resumed"]["last_epoch_after_load"] == 3
    assert json.loads(r0["manifest_scheduler"])["scheduler"]["last_epoch"] == 3
    # Tensor parallel splits param groups: a pre-built scheduler is refused on every rank alike,
    # and the callable form trains.
    for r in (r0, r1):
        assert r["tp_instance_error"] and "split the optimizer's 1 param group(s) into 2" in r["tp_instance_error"]
        assert "as a callable" in r["tp_instance_error"]
        assert len(r["tp_callable"]) == STEPS
