"""Hypothesis fuzzer for run-time faults: a full disk at any save and SIGTERM/SIGINT after any step.

Each case runs a 1-rank nano job in this process (``shardwise.cli.main``: no spawn) with a random
``SHARDWISE_DEBUG_DISK_FULL`` (a save step, shards or manifest stage, how much of a shard was
written when the disk filled up) and/or a random
``SHARDWISE_DEBUG_SIGNAL`` (the process signals itself after a step, as a scheduler or Ctrl-C
would; ``runtime.faults``). Invariants:

* the exit code is the documented one (docs/checkpoints.md "Exit codes"): 2 when a save met the
  full disk, else 130 when the signal stopped the run, else 0 -- predicted by ``expected`` from
  the save schedule, so a wrong code or a save at the wrong step fails;
* the console never shows a ``Traceback``;
* the last complete checkpoint is the one predicted, it loads and ``--resume`` finishes the run
  bit-exactly: every step's loss and the final weights equal an uninterrupted run's.

``SHARDWISE_FUZZ_EXAMPLES`` sets the number of random cases (default 4; each is two short runs),
on top of the explicit ``@example`` cases.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardwise.cli import main
from shardwise.runtime.checkpoint.locate import complete_checkpoints
from shardwise.runtime.faults import DISK_FULL_ENV, SIGNAL_ENV
from tests.helpers.ckpt import cli_args, fast_overrides, final_weights, losses, small_text

STEPS, EVERY = 6, 2
ONE = ["--nproc", "1", "--strategy", "single"]
EXAMPLES = int(os.environ.get("SHARDWISE_FUZZ_EXAMPLES", "4"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# (save step, stage, bytes of the shard written before the disk filled up)
disk_faults = st.none() | st.tuples(st.integers(1, STEPS), st.sampled_from(["shards", "manifest"]),
                                    st.integers(0, 1 << 16))
signal_faults = st.none() | st.tuples(st.integers(1, STEPS), st.sampled_from(["TERM", "INT"]))


def expected(disk: tuple[int, str, int] | None, sig: tuple[int, str] | None) -> tuple[int, int | None]:
    """(exit code, step of the last complete checkpoint) the documented behaviour gives.

    Saves: every EVERY steps and at the end; a signal after step k stops the run at step k + 1
    (one process: the current step), which it saves first. A save that meets the full disk ends
    the run with 2 and leaves the previous checkpoint.
    """
    last = None
    for step in range(1, STEPS + 1):
        stop = sig is not None and sig[0] == step - 1
        if (step % EVERY == 0 or stop or step == STEPS) and disk is not None and disk[0] == step:
            return 2, last
        if step % EVERY == 0 or stop or step == STEPS:
            last = step
        if stop:
            return 130, last
    return 0, last


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-faults")
    data = small_text(root)
    argv = cli_args(fast_overrides(data, steps=STEPS, every=EVERY))
    ref = root / "ref"
    assert main(["train", *ONE, "--out", str(ref), *argv]) == 0
    return root, argv, losses(ref), final_weights(ref)


@FUZZ
@given(disk=disk_faults, sig=signal_faults)
@example(disk=(4, "shards", 4096), sig=None)
@example(disk=None, sig=(3, "TERM"))
@example(disk=(4, "manifest", 0), sig=(3, "INT"))  # the interrupt's own save meets the full disk
def test_faults_at_random_points_end_documented_and_resume_bit_exact(reference, tmp_path_factory, capsys,
                                                                      monkeypatch, disk, sig):
    root, argv, want_losses, want_weights = reference
    run = tmp_path_factory.mktemp("case", numbered=True) / "run"
    code_want, last_want = expected(disk, sig)
    if disk is not None:
        monkeypatch.setenv(DISK_FULL_ENV, f"step={disk[0]},stage={disk[1]},bytes={disk[2]}")
    if sig is not None:
        monkeypatch.setenv(SIGNAL_ENV, f"step={sig[0]},signal={sig[1]}")
    capsys.readouterr()
    code = main(["train", *ONE, "--out", str(run), *argv])
    console = capsys.readouterr()
    monkeypatch.delenv(DISK_FULL_ENV, raising=False)
    monkeypatch.delenv(SIGNAL_ENV, raising=False)
    case = f"disk={disk} sig={sig}"
    assert code == code_want, (case, console.err[-2000:])
    assert "Traceback" not in console.err + console.out, (case, console.err)
    if code == 2:
        assert f"no space left on the device while saving checkpoint step-{disk[0]:08d}" in console.err, console.err
    if code == 130:
        assert "interrupted" in console.err and "--resume" in console.err, console.err
    saved = complete_checkpoints(run / "checkpoints")
    assert (saved[-1].name if saved else None) == (f"step-{last_want:08d}" if last_want else None), (case, saved)
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".partial")], case

    if code != 0 and last_want is None:
        # Nothing was saved: a resume is refused with one paragraph (a fresh run is the way on).
        assert main(["train", *ONE, "--out", str(run), "--resume"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "no checkpoint" in err.lower(), (case, err)
        return
    if code != 0:
        assert main(["train", *ONE, "--out", str(run), "--resume"]) == 0, (case, capsys.readouterr().err[-2000:])
        assert "Traceback" not in capsys.readouterr().err, case
    assert losses(run) == want_losses, case
    got = final_weights(run)
    assert got.keys() == want_weights.keys(), case
    assert all(torch.equal(got[k], want_weights[k]) for k in got), case
