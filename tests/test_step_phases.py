"""Every rank's step explained (observe/step_phases.py): a planted slow rank is named with the right
phase within two logging windows, a run without one names nobody, and each rank's phases add up to
its step time.

The slowness is planted with the fault injection ``SHARDWISE_DEBUG_SLOW`` (runtime/faults.py): one rank
sleeps before each batch it reads (data) or at the start of its forward. The delay (0.25 s) is
several times a nano model's step here, so the slow rank's phase is far beyond the naming threshold
(``SLOW_FRACTION`` of the step) while the others' phases stay as they were.
"""

import os

import pytest
import torch

from shardwise.core.config import load_config
from shardwise.observe.step_phases import PHASES, StepPhases, format_table
from shardwise.runtime.faults import SLOW_ENV
from shardwise.runtime.trainer import Trainer
from shardwise.testing import run_distributed

# A planted 0.25 s delay against the others' step, and a run that must name nobody: measured alone,
# not beside another shard's ranks (scripts/test runs ``serial`` tests after the shards).
pytestmark = pytest.mark.serial

STEPS, LOG_EVERY = 6, 2  # logging windows end at steps 1, 2, 4, 6
DELAY_S = 0.25


def _run(rank: int, out: str, slow: str, strategy: str = "ddp") -> dict:
    if slow:
        os.environ[SLOW_ENV] = slow
    else:
        os.environ.pop(SLOW_ENV, None)
    cfg = load_config(None, [
        "model.preset=nano", f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}", "train.eval_every=0",
        "train.eval_batches=1", "train.micro_batch_size=8", "train.sample_tokens=0", "train.progress=false",
        f"parallel.strategy={strategy}", "checkpoint.at_end=false", "checkpoint.every=3", "log.level=warning"])
    trainer = Trainer(cfg, out)
    records: list[dict] = []
    trainer.run_dir.sinks.append(records.append)
    summary = trainer.run()
    return {"summary": summary.get("step_phases"), "records": records}


def cases(rank: int, world_size: int, out: str, plans: list[tuple[str, str]]) -> list[dict]:
    return [_run(rank, f"{out}/{i}", slow) for i, (_, slow) in enumerate(plans)]


REDUCE_S = 0.2


def _fsdp_with_slow_reduce(rank: int, world_size: int, out: str) -> dict:
    """A 2-rank fsdp run whose every gradient reduce-scatter takes REDUCE_S longer (torch internals:
    FSDP2's post-backward calls ``foreach_reduce`` by this module-level name)."""
    import time

    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    real = group.foreach_reduce

    def slow(*args, **kwargs):
        time.sleep(REDUCE_S)
        return real(*args, **kwargs)

    group.foreach_reduce = slow
    try:
        return _run(rank, out, "", "fsdp")
    finally:
        group.foreach_reduce = real


def test_fsdp_reduce_scatter_wait_is_collective_not_backward(tmp_path):
    """FSDP2 computes gradients on its unsharded parameters and calls the sharded ones' hooks only
    after their reduce-scatter: the step's last reduce-scatter (the root unit's, after the last
    gradient) lands in ``collective`` (per step, at least the planted delay), not in ``backward``."""
    table = run_distributed(_fsdp_with_slow_reduce, 2, timeout_s=300, out=str(tmp_path))[0]["summary"]
    assert all(row["collective_s"] >= REDUCE_S * 0.9 for row in table["ranks"]), format_table(table)


def _named(result: dict) -> list[tuple[int, int, str]]:
    """(step, rank, phase) of every logging step that named a slow rank."""
    return [(r["step"], r["slow_rank"], r["slow_phase"]) for r in result["records"] if "slow_rank" in r]


def _check_sums(table: dict) -> None:
    for row in table["ranks"]:
        phases = sum(row[f"{p}_s"] for p in PHASES)
        assert abs(row["step_s"] - phases) <= 0.05 * row["step_s"], (row, format_table(table))


@pytest.mark.parametrize("world_size,slow_rank", [(2, 1), (4, 2)])
def test_a_planted_slow_rank_is_named_with_its_phase(tmp_path, world_size, slow_rank):
    plans = [("data", f"rank={slow_rank},phase=data,seconds={DELAY_S}"),
             ("forward", f"rank={slow_rank},phase=forward,seconds={DELAY_S}")]
    if world_size == 2:
        plans.append(("none", ""))
    ranks = run_distributed(cases, world_size, timeout_s=600, out=str(tmp_path), plans=plans)
    main = ranks[0]
    for (phase, slow), result in zip(plans, main, strict=True):
        table = result["summary"]
        assert [row["rank"] for row in table["ranks"]] == list(range(world_size))
        named = _named(result)
        if not slow:
            assert named == [] and table["slow_ranks"] == [], format_table(table)
            continue
        # The 5 % sum check runs where every rank's step is at least DELAY_S long (the planted runs,
        # on any machine): the loop's ~1 ms of Python outside any phase is 5 % of a 20 ms step, and
        # how short the unplanted step is depends only on how fast the machine is.
        _check_sums(table)
        # Named on the second logging window (step 2: windows [1], [2]) and never anyone else.
        assert named and named[0][0] <= 2 * LOG_EVERY, (phase, named, format_table(table))
        assert {(r, p) for _, r, p in named} == {(slow_rank, phase)}, (phase, named)
        (line,) = table["slow_ranks"]
        assert line["rank"] == slow_rank and line["phase"] == phase
        assert line["message"].startswith(f"rank {slow_rank} on ") and "the others" in line["message"]
        assert line["share"] > 0.5 > line["others_share"], line
        # Every logging record carries the slowest rank and the spread per phase.
        rec = next(r for r in result["records"] if r.get("step") == STEPS and "loss" in r)
        assert rec[f"phase/{phase}_slowest_rank"] == slow_rank
        assert rec[f"phase/{phase}_spread_s"] >= DELAY_S * 0.8
    for other in ranks[1:]:  # only rank 0 explains
        assert all(r["summary"] is None for r in other)


def test_one_outlier_window_names_nobody_and_a_streak_names_once():
    phases = StepPhases(0, 3, torch.device("cpu"), is_distributed=False)
    phases.hosts = ["a", "b", "c"]

    def window(slow_data_s: float) -> dict:
        table = torch.zeros(3, len(PHASES) + 2, dtype=torch.float64)
        table[:, PHASES.index("forward")] = 0.1
        table[:, -2], table[:, -1] = 0.1, 1
        table[2, PHASES.index("data")] = slow_data_s
        table[2, -2] += slow_data_s
        return phases._explain(table)

    assert "slow_rank" not in window(0.5)  # one window is not "consistently"
    assert "slow_rank" not in window(0.0)
    assert "slow_rank" not in window(0.5)
    second = window(0.5)
    assert second["slow_rank"] == 2 and second["slow_phase"] == "data"
    assert second["slow_rank_message"] == "rank 2 on c spends 83% of its step waiting for data; the others 0%"
    assert "slow_rank_message" not in window(0.5)  # named once per episode
    assert len(phases.named) == 1
    # Below the threshold (a fifth of the step): nobody.
    phases._streak = None
    assert "slow_rank" not in window(0.01) and "slow_rank" not in window(0.01)


def test_profile_shows_the_per_rank_table(tmp_path, capsys):
    import json

    from shardwise.cli import main

    table = {"phases": list(PHASES), "slow_ranks": [{"rank": 1, "host": "node-b", "phase": "data", "share": 0.41,
                                                     "others_share": 0.04, "message": "rank 1 on node-b spends 41% "
                                                     "of its step waiting for data; the others 4%"}],
             "ranks": [{"rank": r, "host": h, "steps": 10, "step_s": 0.1, "other_s": 0.0,
                        **{f"{p}_s": 0.1 / len(PHASES) for p in PHASES}} for r, h in ((0, "node-a"), (1, "node-b"))]}
    (tmp_path / "summary.json").write_text(json.dumps({"step_phases": table}))
    assert main(["profile", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step phases per rank" in out and "node-b" in out
    assert "slow: rank 1 on node-b spends 41% of its step waiting for data; the others 4%" in out


class _FakeEvent:
    """A CUDA event the device has not passed yet: reading its time must not wait for it."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_FakeEvent") -> float:
        assert end.done, "elapsed_time on an unfinished event would block the host"
        return 5.0


def test_cuda_marks_are_read_only_once_the_device_passed_them():
    from shardwise.observe.step_phases import _CudaClock, _Step

    phases = StepPhases(0, 1, torch.device("cpu"), is_distributed=False)
    phases.clock = _CudaClock()
    pending = _Step(start=_FakeEvent(True), end=_FakeEvent(False))
    pending.intervals["forward"] = [(_FakeEvent(True), _FakeEvent(False))]
    phases._pending = [pending]
    phases._drain()  # nothing is ready: the step stays pending, nothing waited
    assert phases._pending == [pending] and float(phases._window[-1]) == 0
    pending.end.done = pending.intervals["forward"][0][1].done = True
    phases._drain()
    assert phases._pending == [] and float(phases._window[-1]) == 1
    assert float(phases._window[PHASES.index("forward")]) == pytest.approx(0.005)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
def test_no_host_sync_on_a_cuda_step_that_does_not_log(tmp_path):
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronising call; only logging steps may."""
    cfg = load_config(None, [
        "model.preset=nano", "train.steps=6", "train.log_every=3", "train.eval_every=0", "train.eval_batches=1",
        "train.micro_batch_size=4", "train.sample_tokens=0", "train.progress=false", "parallel.strategy=single",
        "checkpoint.at_end=false", "train.compile=false"])
    trainer = Trainer(cfg, tmp_path / "run")
    phases = trainer.session.time_phases()
    batches = trainer.train_loader.forever()
    trainer.train_step(batches)  # the first step allocates and warms up
    torch.cuda.synchronize()
    for _ in range(3):
        phases.begin_step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            trainer.train_step(batches, measure=False)
            phases.end_step(0.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # a logging step: now every mark can be read
    phases._drain()
    assert float(phases._window[-1]) == 3
    trainer.session.close()
