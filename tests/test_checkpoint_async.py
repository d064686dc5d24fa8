"""Asynchronous checkpoints (runtime.checkpoint.background): staged, written behind the training,
published only when whole; and the path/message edges of the fault probe.

In-process (one rank) except where a test says otherwise. The resume tests of every strategy
(test_resume*.py, test_sharding_parity.py, test_lora.py, ...) run with the default
checkpoint.mode ("auto", i.e. async), so they check async saves under their strategies.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from shardwise.errors import CheckpointError, ConfigError, count_of
from shardwise.fsutil import real_path, what_is
from shardwise.runtime.checkpoint.background import resolve_mode
from shardwise.runtime.checkpoint.locate import latest_checkpoint
from shardwise.runtime.checkpoint.manifest import LATEST
from shardwise.runtime.checkpoint.save import describe_io_failure
from tests.test_session_save_defaults import _session_run


def test_mode_resolution_names_deepspeed_and_cpu_pinning():
    assert resolve_mode("auto", "cpu") == ("async", None)
    assert resolve_mode("sync", "cuda") == ("sync", None)
    assert resolve_mode("async-pinned", "cuda") == ("async-pinned", None)
    mode, note = resolve_mode("async-pinned", "cpu")
    assert mode == "async" and "ordinary host memory" in note
    assert resolve_mode("auto", "cpu", engine="deepspeed-zero3") == ("sync", None)
    with pytest.raises(ConfigError, match="does not run under deepspeed-zero3: its engine writes its own"):
        resolve_mode("async", "cpu", engine="deepspeed-zero3")


def _latest(root: Path) -> str:
    return (root / LATEST).read_text().strip()


def _loaded(tmp_path: Path, path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh session's model and optimizer (``_session_run``'s, no steps) loaded from ``path``."""
    t, model, opt, _ = _session_run(tmp_path, 0)
    try:
        t.load(path)
    finally:
        t.close()
    return model, opt


def test_background_save_publishes_only_when_whole_and_rotation_keeps_the_published_one(tmp_path):
    """While a save is in flight: the step goes on, 'latest' and the last published checkpoint stay
    (keep_last=1); weights changed after staging do not reach the file; one save in flight."""
    s, model, opt, _ = _session_run(tmp_path, 2)
    root = tmp_path / "ckpt"
    try:
        first = s.save(root, async_=True, keep_last=1).wait()
        assert _latest(root) == first.name == "step-00000002"
        release, written = threading.Event(), threading.Event()

        def hold(partial: Path) -> None:  # runs on the writing thread once this rank's files are on disk
            written.set()
            assert release.wait(60)

        staged = {k: v.clone() for k, v in model.state_dict().items()}
        handle = s.save(root, step=3, async_=True, keep_last=1, on_written=hold)
        s.wait_staged()  # weights changed outside session.step: wait for the copy first (documented)
        with torch.no_grad():  # training goes on while the write is held
            for p in model.parameters():
                p.add_(1.0)
        assert written.wait(60) and not handle.done()
        assert _latest(root) == "step-00000002" and (root / "step-00000002").is_dir()
        assert not (root / "step-00000003").exists()
        assert s.last_save_blocked_s > 0
        release.set()
        assert handle.wait(60) == root / "step-00000003"
        assert _latest(root) == "step-00000003" and not (root / "step-00000002").exists()
        # A third save waits for nothing; a fourth, issued at once, waits for the third.
        s.save(root, step=4, async_=True)
        s.save(root, step=5, async_=True)
        assert s.wait_checkpoint() == root / "step-00000005"
        stats = s.checkpoint_stats
        assert stats["background_saves"] == 4 and stats["staging_bytes"] > 0 and stats["bytes_written"] > 0
    finally:
        s.close()
    model2, _ = _loaded(tmp_path, root / "step-00000003")
    assert all(torch.equal(staged[k], v) for k, v in model2.state_dict().items())


def test_full_disk_during_a_background_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    s, *_ = _session_run(tmp_path, 2)
    root = tmp_path / "ckpt"
    try:
        s.save(root, async_=True).wait()
        monkeypatch.setenv("SHARDWISE_DEBUG_DISK_FULL", "step=3")
        handle = s.save(root, step=3, async_=True)
        monkeypatch.delenv("SHARDWISE_DEBUG_DISK_FULL")
        with pytest.raises(CheckpointError) as info:
            handle.wait(60)
        text = str(info.value)
        assert "no space left on the device while saving checkpoint step-00000003" in text
        assert "the previous checkpoint step-00000002 is intact" in text and "\n" not in text
        assert _latest(root) == "step-00000002" and not list(root.glob(".partial-*"))
        assert latest_checkpoint(root).name == "step-00000002"
        # The error is the save's, read once; the next save goes ahead.
        assert s.save(root, step=4, async_=True).wait() == root / "step-00000004"
    finally:
        s.close()


def test_short_write_on_a_full_disk_is_called_a_full_disk(tmp_path, monkeypatch):
    # torch.save's zip writer reports a short write as an enforce failure, not an OSError.
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 58")
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=0))
    full = f"rank 0: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} ({tmp_path})"
    assert describe_io_failure(error, 0, tmp_path) == full
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10 << 30))
    assert describe_io_failure(error, 1, tmp_path).startswith("rank 1: RuntimeError: [enforce fail")


# ------------------------------------------------------------------------- path and message edges
def test_path_kinds_are_named(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert "leads back to itself" in what_is(loop)
    assert real_path(loop) == loop  # no RuntimeError("Symlink loop")
    assert what_is(fifo) == "is a FIFO (named pipe), not a file"
    assert what_is("/dev/zero") == "is a character device, not a file"
    assert "which does not exist" in what_is(tmp_path / "dangling")
    assert what_is(tmp_path / "none") == "does not exist" and what_is(tmp_path) == "is a folder"
    assert count_of(1, "rank") == "1 rank" and count_of(2, "rank") == "2 ranks"


def test_user_paths_that_loop_or_are_not_files_are_refused_in_one_paragraph(tmp_path, capsys):
    from shardwise.cli import main

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    data = tmp_path / "notes.txt"
    data.write_text("some text to train on\n" * 50)
    pre = tmp_path / "pre"
    pre.mkdir()
    (pre / "model.safetensors").symlink_to("model.safetensors")
    (pre / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8,
                                                 "vocab_size": 64, "n_positions": 16}))
    base = ["train", "--nproc", "1", "--strategy", "single", "--set", "model.preset=nano", "--set",
            "train.steps=1", "--set", "train.sample_tokens=0", "--set", "train.progress=false"]
    cases = [
        (["--set", f'data.path="{loop}"'], "leads back to itself"),
        (["--set", f'data.path="{fifo}"'], "is a FIFO (named pipe), not a file"),
        (["--set", 'data.kind="text"', "--set", 'data.path="/dev/zero"'], "is a character device, not a file"),
        (["--set", 'data.kind="text"', "--set", f'data.path="{data}"', "--set", f'data.tokenizer="{loop}"'],
         "leads back to itself"),
        (["--resume", str(loop)], "leads back to itself"),
        (["--set", 'model.kind="hf"', "--set", f'model.pretrained="{pre}"'], "leads back to itself"),
    ]
    for i, (extra, want) in enumerate(cases):
        capsys.readouterr()
        code = main([*base, "--out", str(tmp_path / f"o{i}"), *extra])
        err = capsys.readouterr().err
        assert code != 0 and want in err and "Traceback" not in err, (extra, err)
        assert "folder '/dev/zero'" not in err
    code = main([*base, "--out", str(loop)])
    err = capsys.readouterr().err
    assert code != 0 and "leads back to itself" in err and "Traceback" not in err, err


def test_damaged_metadata_is_reported_once(tmp_path):
    from shardwise.runtime.checkpoint.preflight import preflight

    s, *_ = _session_run(tmp_path, 1)
    try:
        path = s.save(tmp_path / "ckpt", async_=False)
    finally:
        s.close()
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:-3])
    with pytest.raises(CheckpointError) as info:
        preflight(path, None)
    assert str(info.value).count(".metadata has") == 1, info.value
    meta.unlink()
    with pytest.raises(CheckpointError) as info:
        preflight(path, None)
    assert str(info.value).count(".metadata is missing") == 1, info.value


def test_hang_message_gives_each_ranks_age(tmp_path):
    from shardwise.runtime.watchdog import describe_hang

    (tmp_path / "hang-rank1.json").write_text(json.dumps({
        "rank": 1, "attempt": 0, "step": 3, "phase": "train", "seconds_since_progress": 21.4,
        "timeout_s": 20, "where": "x.py:1 in f", "silent_ranks": []}))
    assert "rank 1 at step 3 (train, last progress 21s before) in x.py:1" in describe_hang(tmp_path)


# ------------------------------------------------------------------------- 2 ranks, one spawn
def test_async_checkpoints_resume_bit_exactly_under_several_strategies(tmp_path):
    """ddp, fsdp, pipeline stages, expert parallel (MoE under fsdp, ep=2) and context parallel (cp=2) on
    2 gloo ranks: a run resumed from a checkpoint that was written in the background equals the
    uninterrupted run."""
    from shardwise.testing import run_distributed
    from tests.helpers.ckpt import async_resume_cases, small_text

    cases = [("ddp", ["parallel.strategy=ddp"]), ("fsdp", ["parallel.strategy=fsdp"]),
             ("pp", ["parallel.strategy=pp", "parallel.pp=2", "parallel.pp_microbatches=2"]),
             ("ep", ["parallel.strategy=fsdp", "parallel.ep=2", "model.preset=moe-nano"]),
             ("cp", ["parallel.strategy=fsdp", "parallel.cp=2"])]
    result = run_distributed(async_resume_cases, 2, timeout_s=900, cases=cases, data=str(small_text(tmp_path)),
                             root=str(tmp_path))[0]
    for name, _ in cases:
        want, got = result[name]["losses"]
        assert sorted(want) == list(range(1, 7)) and sorted(got) == [5, 6], name
        assert {s: got[s] for s in (5, 6)} == {s: want[s] for s in (5, 6)}, name  # bit for bit
        assert result[name]["same_weights"], name
        assert result[name]["summary"]["background_saves"] == 1, (name, result[name]["summary"])  # step 6


@pytest.mark.skipif(__import__("os").environ.get("SHARDWISE_EIGHT_RANKS") != "1",
                    reason="8 gloo processes: too slow for CI on 2 cores; SHARDWISE_EIGHT_RANKS=1 runs it")
def test_async_checkpoints_resume_bit_exactly_under_fsdp_tp_pp_on_eight_ranks(tmp_path):
    """fsdp+tp+pp (dp 2 x tp 2 x pp 2): a run resumed from a checkpoint written in the background
    (its copy beside the next steps) equals the uninterrupted run, bit for bit."""
    from shardwise.testing import run_distributed
    from tests.helpers.ckpt import async_resume_cases, small_text

    cases = [("fsdp+tp+pp", ["parallel.strategy=fsdp+tp+pp", "parallel.tp=2", "parallel.pp=2",
                             "parallel.pp_microbatches=2"])]
    result = run_distributed(async_resume_cases, 8, timeout_s=1500, cases=cases, data=str(small_text(tmp_path)),
                             root=str(tmp_path))[0]
    want, got = result["fsdp+tp+pp"]["losses"]
    assert sorted(want) == list(range(1, 7)) and sorted(got) == [5, 6]
    assert {s: got[s] for s in (5, 6)} == {s: want[s] for s in (5, 6)}  # bit for bit
    assert result["fsdp+tp+pp"]["same_weights"]


def test_a_stager_that_closed_itself_is_made_anew():
    """torch 2.11's DefaultStager empties its copier after every stage (the next save would fail with
    KeyError: <class 'type'>); the writer then makes a new one, and keeps a reusable one (torch 2.13)."""
    import types

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from shardwise.runtime.checkpoint.background import _reusable

    closed = types.SimpleNamespace(_state_dict_stager=types.SimpleNamespace(_deepcopy_dispatch={}))
    assert not _reusable(closed)
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    assert _reusable(stager)
    stager.close()
    assert not _reusable(stager)  # what torch 2.11's stage() leaves behind


@pytest.fixture
def slow_copy(monkeypatch):
    """Every background save's copy to host memory starts 0.5 s late (DCP's stager, planted)."""
    import time

    from torch.distributed.checkpoint.staging import DefaultStager

    copy = DefaultStager._stage

    def late(self, state_dict, **kwargs):  # noqa: ANN001, ANN003, ANN202
        time.sleep(0.5)
        return copy(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", late)


def test_the_step_waits_for_a_save_still_copying_the_weights(tmp_path, slow_copy):
    """The copy to host memory runs beside the next forward and backward; the optimizer step that
    changes the weights waits for it, so the checkpoint holds the weights of the step it names, and
    the wait is counted as time the save blocked training. The copy is slowed to 0.5 s here: a step
    that did not wait would change the weights before they were copied."""
    s, model, opt, _ = _session_run(tmp_path, 2)
    root = tmp_path / "ckpt"
    try:
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        moments = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
        handle = s.save(root, async_=True)
        assert s.last_save_blocked_s < 0.4  # the save returned before its copy was made
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        s.backward(torch.nn.functional.mse_loss(model(x), y))  # reads the weights: runs beside the copy
        s.step(opt)  # changes them: waits for the copy
        assert not all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
        assert handle.wait(60) == root / "step-00000002"
        stats = s.checkpoint_stats
        assert stats["staging_wait_s_total"] > 0.1 and s.background_saves[-1]["blocked_s"] > 0.1, stats
    finally:
        s.close()
    model2, opt2 = _loaded(tmp_path, root / "step-00000002")
    assert all(torch.equal(saved[k], v) for k, v in model2.state_dict().items())
    state = opt2.state[next(iter(model2.parameters()))]
    assert all(torch.equal(moments[k], state[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_a_forward_that_changes_saved_buffers_waits_for_the_copy(tmp_path, slow_copy):
    """BatchNorm's running statistics change in the forward (and DDP copies buffers in place there):
    for a model with saved buffers the next forward waits for a background save's copy."""
    from shardwise.runtime.session import Session

    s = Session()
    torch.manual_seed(0)
    model, opt = s.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)),
                           lambda ps: torch.optim.SGD(ps, lr=0.1))
    try:
        model(torch.randn(8, 4))
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        handle = s.save(tmp_path / "ckpt", model, opt, step=1, async_=True)
        model(torch.randn(8, 4) + 3.0)  # moves the running mean: must wait for the copy first
        assert not torch.equal(saved["1.running_mean"], model.state_dict()["1.running_mean"])
        handle.wait(60)
        assert s.checkpoint_stats["staging_wait_s_total"] > 0.1
    finally:
        s.close()
    t = Session()
    fresh, opt2 = t.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)),
                            lambda ps: torch.optim.SGD(ps, lr=0.1))
    try:
        t.load(tmp_path / "ckpt" / "step-00000001", fresh, opt2)
        assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    finally:
        t.close()


def test_a_copy_past_the_timeout_stops_the_step_in_one_paragraph(tmp_path, slow_copy):
    """A copy into host memory that outlasts the collective timeout: the step that would change the
    weights under it raises one CheckpointError instead of going on."""
    s, model, opt, _ = _session_run(tmp_path, 1)
    root = tmp_path / "ckpt"
    try:
        s.save(root, async_=True)
        s._ckpt_writer.timeout_s = 0.1  # the planted copy takes 0.5 s
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        s.backward(torch.nn.functional.mse_loss(model(x), y))
        with pytest.raises(CheckpointError, match="did not finish within 0s .* last published checkpoint is untouched"):
            s.step(opt)
    finally:
        s._ckpt_writer.timeout_s = 60
        s.close()
