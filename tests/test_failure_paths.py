"""Every failure path ends with one clean paragraph, a documented exit code and no lost work.

Disk full during a save (fault-injected: ``runtime.faults``) on 1 and 2 ranks, a rank that crashes
with an unexpected error, SIGINT to the launcher alone: the console shows our message and never a
``Traceback``; the rank log keeps the traceback; the previous checkpoint stays intact and resumes
bit-exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.cli import main
from tests.helpers.ckpt import cli_args, fast_overrides, losses, run_cli, small_text

ONE = ["--nproc", "1", "--strategy", "single"]
TWO = ["--nproc", "2", "--strategy", "ddp"]


def _checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _assert_disk_full_refusal(err: str, step: int, previous: int) -> None:
    assert "Traceback" not in err and "sys.excepthook" not in err, err
    assert f"no space left on the device while saving checkpoint step-{step:08d}" in err, err
    assert f"the previous checkpoint step-{previous:08d} is intact" in err, err
    assert "--resume" in err


def test_disk_full_on_one_rank_keeps_the_previous_checkpoint_and_resumes_bit_exact(tmp_path, monkeypatch,
                                                                                    capsys):
    data = small_text(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "run"
    overrides = cli_args(fast_overrides(data, steps=5, every=2))
    assert main(["train", *ONE, "--out", str(ref), *overrides]) == 0
    for stage in ("shards", "manifest"):
        run = out / stage
        monkeypatch.setenv("SHARDWISE_DEBUG_DISK_FULL", f"step=4,stage={stage}")
        capsys.readouterr()
        code = main(["train", *ONE, "--out", str(run), *overrides])
        err = capsys.readouterr().err
        assert code == 2, err
        _assert_disk_full_refusal(err, 4, 2)
        # The partial save is gone at once; 'latest' untouched.
        assert _checkpoints(run) == ["latest", "step-00000002"]
        assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000002"
        monkeypatch.delenv("SHARDWISE_DEBUG_DISK_FULL")
        assert main(["train", *ONE, "--out", str(run), "--resume"]) == 0, capsys.readouterr().err
        want = losses(ref)
        got = losses(run)
        assert got == want, (stage, got, want)


@pytest.mark.slow
def test_disk_full_on_two_ranks_is_one_clean_paragraph_and_resumes_bit_exact(tmp_path, cli_env):
    data = small_text(tmp_path)
    run = tmp_path / "run"
    overrides = cli_args(fast_overrides(data, steps=5, every=2))
    # Rank 1's shard write runs out of space; DCP reports it on every rank.
    env = dict(cli_env, SHARDWISE_DEBUG_DISK_FULL="step=4,rank=1")
    proc = run_cli(["train", *TWO, "--out", str(run), *overrides], env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _assert_disk_full_refusal(proc.stderr, 4, 2)
    assert "rank 1: [Errno 28]" in proc.stderr
    assert _checkpoints(run) == ["latest", "step-00000002"]
    before = losses(run)  # steps 1-4 of the failed run
    proc = run_cli(["train", *TWO, "--out", str(run), "--resume"], cli_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = losses(run)
    assert {s: after[s] for s in (3, 4)} == {s: before[s] for s in (3, 4)}
    assert sorted(after) == [1, 2, 3, 4, 5]


def test_a_retried_resume_on_a_full_disk_is_refused_cleanly(tmp_path, monkeypatch, capsys):
    """The launcher's own writes (config.toml) on a full disk: a clear message, nothing started."""
    from shardwise.job import train as launcher

    data = small_text(tmp_path)
    run = tmp_path / "run"
    assert main(["train", *ONE, "--out", str(run), *cli_args(fast_overrides(data, steps=2, every=1))]) == 0
    capsys.readouterr()
    real = launcher.atomic_write_text

    def full(path, text, **kw):
        if Path(path).name == "config.toml":
            raise OSError(28, os.strerror(28), str(path))
        return real(path, text, **kw)

    monkeypatch.setattr(launcher, "atomic_write_text", full)  # the launcher writes config.toml (job/train.py)
    code = main(["train", *ONE, "--out", str(run), "--resume", "--set", "train.steps=3"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "config.toml" in err and "No space left" in err, err


def _start(out: Path, data: Path, cli_env: dict, *extra: str) -> subprocess.Popen:
    overrides = [*fast_overrides(data, steps=100000, every=0, micro_batch=8), "checkpoint.at_end=true"]
    return subprocess.Popen([sys.executable, "-m", "shardwise", "train", *TWO, "--out", str(out),
                             *cli_args(overrides), *extra], env=cli_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _heartbeats(out: Path, at_step: int, deadline_s: float, proc: subprocess.Popen) -> dict[int, dict]:
    """Both ranks' heartbeats once both are past ``at_step``."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        beats = {}
        for rank in (0, 1):
            try:
                beats[rank] = json.loads((out / "heartbeat" / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                break
        if len(beats) == 2 and all((b.get("step") or 0) >= at_step for b in beats.values()):
            return beats
        time.sleep(0.2)
    raise AssertionError("the ranks never got going")


STOP_TIMEOUT_S = 6


@pytest.mark.slow
@pytest.mark.serial  # reported within STOP_TIMEOUT_S + 10 s of wall clock
def test_a_stopped_rank_is_reported_within_the_timeout_and_named(tmp_path, cli_env):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    proc = _start(out, data, cli_env, "--set", f"watchdog.timeout_s={STOP_TIMEOUT_S}")
    victim = None
    try:
        victim = _heartbeats(out, 2, 240, proc)[1]["pid"]
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        # Timed to the moment the launcher prints its report (the interpreter's exit may lag).
        lines, elapsed = [], None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("error: training hung") and elapsed is None:
                elapsed = time.monotonic() - t0
        proc.wait(timeout=60)
        err = "".join(lines)
    finally:
        if victim is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(OSError):
                    os.kill(victim, sig)
        proc.kill()
    assert proc.returncode == 3, err[-3000:]
    assert elapsed is not None and elapsed < STOP_TIMEOUT_S + 10, (elapsed, err[-3000:])
    assert "Traceback" not in err, err
    assert "training hung" in err and f"rank 1 (pid {victim}" in err and "stopped" in err, err
    print(f"stopped rank reported {elapsed:.1f}s after SIGSTOP (timeout {STOP_TIMEOUT_S}s)")


@pytest.mark.slow
def test_sigint_to_the_launcher_alone_saves_and_exits_130(tmp_path, cli_env):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    proc = _start(out, data, cli_env)
    try:
        _heartbeats(out, 2, 240, proc)
        proc.send_signal(signal.SIGINT)  # the launcher alone, not its process group
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "interrupted: checkpoint saved at step" in err, err
    assert (out / "checkpoints" / "latest").is_file()


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named_with_its_log(tmp_path, cli_env):
    data = small_text(tmp_path)
    out = tmp_path / "run"
    proc = run_cli(["train", *TWO, "--out", str(out), *cli_args(fast_overrides(data, steps=6, every=0)),
                    "--set", "debug.kill_rank=1", "--set", "debug.kill_at_step=2"], cli_env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert f"rank 1 was killed by SIGKILL (its output: {out / 'logs' / 'rank-1.log'})" in err, err
    assert "--resume" in err


def test_debug_collectives_is_refused_before_launch_on_cpu(tmp_path, capsys):
    from shardwise.core.config import load_config
    from shardwise.errors import ConfigError
    from shardwise.preflight import check_debug_collectives

    cfg = load_config(None, ["watchdog.debug_collectives=true"])
    with pytest.raises(ConfigError, match="supported on GPUs \\(NCCL\\) only"):
        check_debug_collectives(cfg, 2, cuda=False)
    check_debug_collectives(cfg, 2, cuda=True)  # NCCL: allowed
    check_debug_collectives(cfg, 1, cuda=False)  # one process: nothing to check, nothing to crash
    code = main(["train", "--nproc", "2", "--dry-run", "--out", str(tmp_path / "run"),
                 "--set", "model.preset=nano", "--set", "watchdog.debug_collectives=true"])
    err = capsys.readouterr().err
    assert code == 2 and "SIGSEGV" in err and "Traceback" not in err, err


def test_model_and_data_mismatches_are_refused_before_launch(tmp_path, capsys):
    cases = {
        ("--set", "model.overrides.vocab_size=10"): "produces token id 64, but the model's vocabulary has 10",
        ("--set", "model.kind=cnn"): "model.kind = 'cnn' cannot train on data.kind = 'shakespeare'",
    }
    for extra, message in cases.items():
        code = main(["train", "--nproc", "1", "--dry-run", "--out", str(tmp_path / "run"),
                     "--set", "model.preset=nano", *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err


def test_launch_of_a_failing_user_script_says_which_rank_without_torchruns_traceback(tmp_path, cli_env):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(5)\n")
    proc = run_cli(["launch", "--nproc", "2", str(script)], cli_env, timeout=120)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: {script} failed: rank 1 exited with code 5" in proc.stderr, proc.stderr


def test_a_damaged_newest_checkpoint_is_named_with_the_newest_intact_one_to_resume(tmp_path, capsys):
    """``resume = "auto"`` over a newest checkpoint whose manifest.json is missing said
    "no 'latest' pointer"; a damaged one said ``--resume .../step-...``. Every refusal now says what
    is wrong with which checkpoint and names the newest intact earlier one, before any rank starts."""
    import shutil

    from shardwise.runtime.checkpoint.manifest import corruption_error

    data = small_text(tmp_path)
    base = tmp_path / "base"
    overrides = [*cli_args(fast_overrides(data, steps=3, every=1)), "--set", "checkpoint.keep_last=3"]
    assert main(["train", *ONE, "--out", str(base), *overrides]) == 0, capsys.readouterr().err
    more = [*overrides, "--set", "train.steps=5"]

    def refusal(name: str, damage, *resume: str) -> str:
        run = tmp_path / name
        shutil.copytree(base, run)
        damage(run / "checkpoints")
        capsys.readouterr()
        code = main(["train", *ONE, "--out", str(run), *more, *resume])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and "no 'latest' pointer" not in err, err
        assert "rank" not in err, err  # refused by the launcher, before any rank started
        return err

    intact = f"--resume {tmp_path}/{{}}/checkpoints/step-00000002 "
    for resume in (["--set", "checkpoint.resume=auto"], ["--resume"]):
        err = refusal(f"missing-{len(resume)}", lambda c: (c / "step-00000003" / "manifest.json").unlink(), *resume)
        assert "latest names step-00000003, but its manifest.json is missing" in err, err
        assert intact.format(f"missing-{len(resume)}") in err, err
    err = refusal("truncated", lambda c: (c / "step-00000003" / "manifest.json").write_text('{"trunc'),
                  "--set", "checkpoint.resume=auto")
    assert "step-00000003/manifest.json is not valid JSON" in err and intact.format("truncated") in err, err

    def two_bad(c: Path) -> None:  # the newest intact one is older than the newest that has a manifest
        (c / "step-00000003" / "manifest.json").unlink()
        (c / "step-00000002" / "manifest.json").write_text("{}")

    err = refusal("two", two_bad, "--resume")
    assert f"--resume {tmp_path}/two/checkpoints/step-00000001 " in err, err
    text = str(corruption_error(base / "checkpoints" / "step-00000001", ["x"]))
    assert "No earlier intact checkpoint" in text, text
