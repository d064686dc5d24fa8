"""The built-in trainer's hot loop: no host-device sync and no collective of its own on steps that
do not log; Session.step returns the gradient norm as a device tensor; AdamW is fused where the
device has a fused kernel.

How syncs are counted: every host read of a tensor's value (``.item()``, ``float()``, ``int()``,
``bool()`` on a tensor) dispatches ``aten._local_scalar_dense``; a ``TorchDispatchMode`` active over
the whole ``Trainer.run()`` records each one against the step in progress. The trainer's own
collectives are counted by wrapping ``Session.all_reduce``. Logging steps must show both (the
counter sees the loop's real syncs), other steps neither. Adding a ``float(loss)`` or a per-step
stop-signal all-reduce back into the loop fails this test.
"""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.core.config import load_config
from shardwise.runtime.optim import adamw_implementation
from shardwise.runtime.trainer import Trainer
from shardwise.testing import run_distributed

STEPS, LOG_EVERY = 7, 3
LOGGING_STEPS = {1, 3, 6, 7}  # step 1, every LOG_EVERY-th, the last


class SyncCounter(TorchDispatchMode):
    """Counts host reads of tensor values (``aten._local_scalar_dense``) per step in progress."""

    def __init__(self, step_of: list[int]) -> None:
        super().__init__()
        self.step_of = step_of
        self.syncs: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs[self.step_of[0]] += 1
        return func(*args, **(kwargs or {}))


def count_syncs(rank: int, world_size: int, out: str) -> dict:
    cfg = load_config(None, [
        "model.preset=nano", f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.eval_every=0",
        "train.eval_batches=1", "train.micro_batch_size=4", "train.sample_tokens=0", "train.progress=false",
        "train.warmup_steps=1", "parallel.strategy=ddp", "checkpoint.at_end=false"])
    trainer = Trainer(cfg, out)
    step_of = [0]  # the step in progress: everything until the next step starts counts for it
    collectives: Counter = Counter()
    train_step, all_reduce = trainer.train_step, trainer.session.all_reduce

    def counted_step(*args, **kwargs):
        step_of[0] = trainer.state.step + 1
        return train_step(*args, **kwargs)

    def counted_all_reduce(*args, **kwargs):
        collectives[step_of[0]] += 1
        return all_reduce(*args, **kwargs)

    trainer.train_step = counted_step
    trainer.session.all_reduce = counted_all_reduce
    counter = SyncCounter(step_of)
    try:
        with counter:
            summary = trainer.run()
    finally:
        trainer.session.close()
    return {"syncs": dict(counter.syncs), "collectives": dict(collectives), "steps": summary["steps"],
            "fused": [g.get("fused") for g in trainer.optimizer.param_groups]}


def test_only_logging_steps_sync_or_reduce(tmp_path):
    ranks = run_distributed(count_syncs, 2, timeout_s=300, out=str(tmp_path / "run"))
    for r in ranks:
        assert r["steps"] == STEPS
        for step in range(1, STEPS + 1):
            syncs, reduces = r["syncs"].get(step, 0), r["collectives"].get(step, 0)
            if step in LOGGING_STEPS:
                # The counters see the loop's real syncs: the logging step's agreement.
                assert syncs >= 1 and reduces >= 1, (step, r)
            else:
                assert syncs == 0 and reduces == 0, f"step {step} synchronised: {r}"
        assert r["fused"] == [True, True]  # AdamW's fused CPU kernel


def test_session_step_returns_the_norm_as_a_device_tensor():
    from shardwise.runtime.session import Session

    with Session(strategy="single") as session:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = session.prepare(model, opt)
        model(torch.ones(3, 4)).square().sum().backward()
        norm = session.step(opt, max_norm=1.0, measure_grad_bytes=False)
        assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and norm.device == session.device
        assert session.last_grad_bytes == 0  # the ledger's walk was skipped on request
        model(torch.ones(3, 4)).square().sum().backward()
        assert float(session.step(opt)) > 0 and session.last_grad_bytes == 4 * (4 * 2 + 2)


def test_adamw_is_fused_where_torch_has_the_kernel():
    assert adamw_implementation("cpu") == {"fused": True}
    assert adamw_implementation("cuda") == {"fused": True}
    assert adamw_implementation("meta") == {"foreach": True}
