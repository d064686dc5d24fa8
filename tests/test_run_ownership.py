"""Run-directory ownership: no run ever writes into, rotates or deletes another run's work.

The data-loss cases, each through the CLI the way a user runs it: a fresh run into an
existing run's directory, ``--overwrite``, ``checkpoint.resume = "auto"`` and elastic restarts when
``latest`` is missing, two runs on one ``--out``, a resume racing a rotation, and checkpoint
rotation / partial-directory cleanup that must only touch what this job wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardwise.cli import main
from shardwise.errors import CheckpointError, ConfigError
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.runtime.checkpoint.locate import complete_checkpoints, latest_checkpoint
from shardwise.runtime.checkpoint.manifest import MANIFEST, PARTIAL_OWNER, read_manifest
from shardwise.runtime.checkpoint.preflight import preflight
from shardwise.runtime.checkpoint.save import save_checkpoint
from tests.helpers.ckpt import cli_args, fast_overrides, small_text

LOCK_FILE = ".shardwise.lock"  # job.runlock.LOCK_FILE (imported lazily: the tests run on old code too)


def process_start_time(pid: int) -> int | None:
    from shardwise.runtime.identity import process_start_time as start_time

    return start_time(pid)


# One process, nano GPT, a few steps: each in-process run takes a second or two.
ONE = ["--nproc", "1", "--strategy", "single"]


def _train(capsys, out: Path, data: Path, *extra: str, steps: int = 2, every: int = 1, keep: int = 5):
    overrides = [*fast_overrides(data, steps=steps, every=every, micro_batch=16), f"checkpoint.keep_last={keep}"]
    code = main(["train", *ONE, "--out", str(out), *cli_args(overrides), *extra])
    captured = capsys.readouterr()
    return code, captured.err


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run directory (relative path -> bytes), lock files left out."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and not p.name.startswith(LOCK_FILE)}


@pytest.fixture
def data(tmp_path):
    return small_text(tmp_path)


@pytest.fixture
def finished_run(tmp_path, data, capsys):
    out = tmp_path / "run"
    code, err = _train(capsys, out, data)
    assert code == 0, err
    return out


# ------------------------------------------------------------------ a fresh run into an existing one
def test_fresh_run_into_an_existing_run_is_refused(finished_run, data, capsys):
    before = _snapshot(finished_run)
    code, err = _train(capsys, finished_run, data, "--set", "train.lr=5e-4", steps=3)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "already holds a run" in err
    for choice in ("--resume", "--out", "--overwrite"):  # the three ways forward, spelled out
        assert choice in err
    assert _snapshot(finished_run) == before  # config.toml, metrics, checkpoints, latest untouched


def test_overwrite_moves_the_old_run_aside(finished_run, data, capsys):
    before = _snapshot(finished_run)
    code, err = _train(capsys, finished_run, data, "--overwrite", "--resume", str(finished_run / "checkpoints"))
    assert code == 2 and "would move the checkpoint you resume from" in err
    assert _snapshot(finished_run) == before
    code, err = _train(capsys, finished_run, data, "--overwrite", steps=3)
    assert code == 0, err
    aside = [p for p in finished_run.parent.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and "moved the run already in" in err and aside[0].name in err
    assert _snapshot(aside[0]) == before  # nothing deleted: the old run is whole, beside the new one
    records = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]  # the new run's only, nothing appended
    assert latest_checkpoint(aside[0] / "checkpoints").name == "step-00000002"


def test_resume_into_the_same_run_is_allowed(finished_run, capsys):
    code = main(["train", *ONE, "--out", str(finished_run), "--resume", "--set", "train.steps=3"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "resumed from" in err


def test_resume_from_another_run_into_an_existing_run_is_refused(finished_run, tmp_path, data, capsys):
    other = tmp_path / "other"
    assert _train(capsys, other, data)[0] == 0
    before = _snapshot(other)
    code, err = _train(capsys, other, data, "--resume", str(finished_run))
    assert code == 2 and "already holds a run" in err
    assert _snapshot(other) == before


# ------------------------------------------------------------------ auto resume / elastic restarts
def test_auto_resume_refuses_to_start_fresh_when_latest_is_missing(finished_run, data, capsys):
    (finished_run / "checkpoints" / "latest").unlink()
    before = _snapshot(finished_run)
    code, err = _train(capsys, finished_run, data, "--set", "checkpoint.resume=auto")
    assert code == 2, err
    assert "step-00000002" in err and "latest" in err  # points at the complete checkpoints
    assert _snapshot(finished_run) == before  # config.toml not overwritten, no checkpoint deleted


def test_auto_resume_continues_when_latest_exists(finished_run, data, capsys):
    code, err = _train(capsys, finished_run, data, "--set", "checkpoint.resume=auto", steps=3)
    assert code == 0, err
    assert "resumed from" in err and "at step 2" in err


def test_auto_restart_of_the_same_job_without_checkpoints_starts_fresh(tmp_path, data, capsys):
    # A job that was preempted before its first checkpoint is simply started again.
    out = tmp_path / "run"
    overrides = ["--set", "checkpoint.resume=auto", "--set", "checkpoint.at_end=false"]
    assert _train(capsys, out, data, *overrides, every=0)[0] == 0
    code, err = _train(capsys, out, data, *overrides, every=0)
    assert code == 0, err
    # ... but a different job is not written over that run.
    code, err = _train(capsys, out, data, *overrides, "--set", "train.lr=5e-4", every=0)
    assert code == 2 and "already holds a run" in err


def test_elastic_restart_refuses_to_start_fresh_when_latest_is_missing(finished_run):
    from shardwise.core.config import load_config
    from shardwise.runtime.trainer import Trainer

    (finished_run / "checkpoints" / "latest").unlink()
    cfg = load_config(str(finished_run / "config.toml"), ["train.steps=3"])
    trainer = Trainer(cfg, finished_run, attempt=1)
    try:
        with pytest.raises(CheckpointError, match=r"step-00000002.*latest|latest.*step-00000002"):
            trainer.run()
    finally:
        trainer.session.close()
    assert complete_checkpoints(finished_run / "checkpoints")[-1].name == "step-00000002"


# ------------------------------------------------------------------ the lock
def _live_helper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _plant_lock(run: Path, **info) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lock = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": process_start_time(os.getpid()),
            "job_id": "someone-else", "time": time.time(), "command": "shardwise train"}
    lock.update(info)
    (run / LOCK_FILE).write_text(json.dumps(lock))


def test_a_live_lock_refuses_every_kind_of_run(tmp_path, data, capsys):
    out = tmp_path / "run"
    helper = _live_helper()
    try:
        _plant_lock(out, pid=helper.pid, start_time=process_start_time(helper.pid))
        lock = (out / LOCK_FILE).read_text()
        for extra in ([], ["--resume"], ["--overwrite"], ["--dry-run"]):
            code, err = _train(capsys, out, data, *extra)
            assert code == 2 and "in use by a running job" in err and f"pid {helper.pid}" in err, err
        # Nothing written, nothing moved, the holder's lock as it was.
        assert [p.name for p in out.iterdir() if not p.name.startswith(LOCK_FILE)] == []
        assert (out / LOCK_FILE).read_text() == lock
    finally:
        helper.kill()
        helper.wait()


def test_a_stale_lock_is_taken_over(tmp_path, data, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    _plant_lock(out, pid=dead.pid, start_time=12345)
    code, err = _train(capsys, out, data)
    assert code == 0, err
    assert "stale lock" in err and f"pid {dead.pid}" in err
    assert not (out / LOCK_FILE).exists()  # released at the end

    # A live PID whose start time differs is a reused PID: the lock is stale as well.
    _plant_lock(tmp_path / "run2", start_time=(process_start_time(os.getpid()) or 0) + 1)
    code, err = _train(capsys, tmp_path / "run2", data)
    assert code == 0 and "stale lock" in err


def test_a_lock_held_on_another_host_is_refused_with_how_to_clear_it(tmp_path, data, capsys):
    out = tmp_path / "run"
    _plant_lock(out, host="gpu-node-17.example", pid=4242)
    code, err = _train(capsys, out, data)
    assert code == 2 and "gpu-node-17.example" in err and "pid 4242" in err
    assert str(out / LOCK_FILE) in err and "delete" in err


def test_a_launcher_of_the_same_job_joins_the_lock(tmp_path):
    from shardwise.job import runlock
    from shardwise.job.runlock import RunLock

    assert runlock.LOCK_FILE == LOCK_FILE
    run = tmp_path / "run"
    _plant_lock(run, job_id="rdzv-job-1")
    joined = RunLock(run, job_id="rdzv-job-1").acquire()
    assert joined.joined
    joined.release()
    assert (run / LOCK_FILE).exists()  # a joiner never removes the owner's lock
    with pytest.raises(ConfigError, match="in use by a running job"):
        RunLock(run, job_id="another-job").acquire()
    own = RunLock(tmp_path / "fresh", job_id="j").acquire()
    assert not own.joined and json.loads((tmp_path / "fresh" / LOCK_FILE).read_text())["job_id"] == "j"
    own.release()
    assert not (tmp_path / "fresh" / LOCK_FILE).exists()


@pytest.mark.slow
def test_two_runs_on_one_out_at_once(tmp_path, data, cli_env, capsys):
    """A second run (fresh, --resume or --overwrite) on a live run's --out is refused; the live one is unharmed."""
    out = tmp_path / "run"
    overrides = [*fast_overrides(data, steps=100000, every=1, micro_batch=16), "checkpoint.keep_last=1",
                 "train.warmup_steps=0", "train.min_lr=1e-3"]
    first = subprocess.Popen([sys.executable, "-m", "shardwise", "train", *ONE, "--out", str(out),
                              *cli_args(overrides)], env=cli_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (out / "checkpoints" / "latest").exists():
            time.sleep(0.2)
        assert (out / "checkpoints" / "latest").exists(), "the first run never saved"
        for extra in ([], ["--resume"], ["--overwrite"]):
            code = main(["train", *ONE, "--out", str(out), *cli_args(overrides), *extra])
            err = capsys.readouterr().err
            assert code == 2 and "in use by a running job" in err and f"pid {first.pid}" in err, err
            assert "Traceback" not in err and "damaged" not in err
    finally:
        first.send_signal(signal.SIGTERM)
        _, first_err = first.communicate(timeout=120)
    assert first.returncode == 130, first_err[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))  # one run's metrics, nothing mixed in
    assert not (out / LOCK_FILE).exists()


# ------------------------------------------------------------------ only this job's checkpoints
def _model():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["nano"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _save(root: Path, step: int, job: str, keep_last: int = 0) -> Path:
    model, opt = _model()
    return save_checkpoint(root, model, opt, step=step, strategy="single", world_size=1,
                                keep_last=keep_last, job=job)


def test_rotation_never_deletes_another_jobs_checkpoints(tmp_path):
    for step in (1, 2):
        _save(tmp_path, step, job="earlier-job")
    for step in (3, 4, 5):
        _save(tmp_path, step, job="this-job", keep_last=1)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-00000001", "step-00000002", "step-00000005"]
    assert read_manifest(tmp_path / "step-00000005")["job"] == "this-job"


def test_resaving_a_step_keeps_the_other_jobs_checkpoint(tmp_path):
    first = _save(tmp_path, 2, job="earlier-job")
    manifest = read_manifest(first)
    _save(tmp_path, 2, job="this-job", keep_last=1)
    assert read_manifest(tmp_path / "step-00000002")["job"] == "this-job"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000002.replaced-")]
    assert len(kept) == 1 and json.loads((kept[0] / MANIFEST).read_text()) == manifest
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000002"]


def test_partial_directory_of_a_live_job_is_never_removed(tmp_path):
    helper = _live_helper()
    try:
        live = tmp_path / ".partial-step-00000004.livejob"
        live.mkdir(parents=True)
        (live / "__0_0.distcp").write_bytes(b"shards being written")
        (live / PARTIAL_OWNER).write_text(json.dumps({
            "job": "live-job", "host": socket.gethostname(), "pid": helper.pid,
            "start_time": process_start_time(helper.pid)}))
        dead = tmp_path / ".partial-step-00000003.deadjob"
        dead.mkdir()
        (dead / PARTIAL_OWNER).write_text(json.dumps({
            "job": "dead-job", "host": socket.gethostname(), "pid": helper.pid, "start_time": 1}))
        _save(tmp_path, 5, job="this-job", keep_last=1)
        assert live.is_dir() and (live / "__0_0.distcp").read_bytes() == b"shards being written"
        assert not dead.exists()  # its writer is gone (the PID now belongs to another process)
    finally:
        helper.kill()
        helper.wait()


def test_partial_directory_is_named_per_job(tmp_path):
    model, opt = _model()
    seen = []
    save_checkpoint(tmp_path, model, opt, step=1, strategy="single", world_size=1, job="job-a",
                         on_written=lambda partial: seen.append(partial.name))
    assert seen[0].startswith(".partial-step-00000001.") and seen[0] != ".partial-step-00000001"


def test_resume_racing_a_rotation_is_not_reported_as_damage(tmp_path, monkeypatch):
    """Resolving ``latest`` and then finding the checkpoint rotated away retries, never says "damaged"."""
    import importlib

    preflight_module = importlib.import_module("shardwise.runtime.checkpoint.preflight")

    root = tmp_path / "checkpoints"
    _save(root, 1, job="writer")
    real_verify = preflight_module.verify_files
    calls = []

    def rotate_meanwhile(path, manifest, names=None):
        if not calls:  # the live run saves step 2 and rotates step 1 away, right now
            _save(root, 2, job="writer", keep_last=1)
        calls.append(path)
        return real_verify(path, manifest, names)

    monkeypatch.setattr(preflight_module, "verify_files", rotate_meanwhile)
    assert preflight(root).name == "step-00000002"

    monkeypatch.setattr(preflight_module, "verify_files", lambda path, manifest, names=None:
                        shutil.rmtree(path) or real_verify(path, manifest, names))
    with pytest.raises(CheckpointError, match="removed while") as info:
        preflight(root / "step-00000002")
    assert "damaged" not in str(info.value)


# ------------------------------------------------------------------ verify and bench hold their folders too
def test_bench_and_verify_do_not_write_over_runs(finished_run, tmp_path, data, capsys):
    bench_out = tmp_path / "bench"
    bench_out.mkdir()
    (bench_out / "bench.json").write_text("[]")
    code = main(["bench", "--strategies", "single", "--out", str(bench_out), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "already holds runs or results of an earlier bench" in err and "--overwrite" in err
    assert (bench_out / "bench.json").read_text() == "[]"

    code = main(["verify", "--strategy", "ddp", "--nproc", "2", "--out", str(finished_run),
                 *cli_args(fast_overrides(data, steps=2, micro_batch=8))])
    err = capsys.readouterr().err
    assert code == 2 and "is a training run's directory" in err

    helper = _live_helper()
    try:
        _plant_lock(bench_out, pid=helper.pid, start_time=process_start_time(helper.pid))
        code = main(["bench", "--strategies", "single", "--out", str(bench_out), "--overwrite"])
        assert code == 2 and "in use by a running job" in capsys.readouterr().err
        assert (bench_out / "bench.json").exists()  # a live bench's folder is never moved aside
    finally:
        helper.kill()
        helper.wait()
