import time

import pytest

from shardwise.testing import DistributedTestError, run_distributed
from tests.helpers.dist import boom, echo, env_of, segfault_always, segfault_once, sleepy


def test_results_come_back_in_rank_order():
    assert run_distributed(echo, 2, value=10) == [(0, 21), (1, 21)]


def test_first_failure_kills_all_ranks_and_shows_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 1 failed") as info:
        run_distributed(boom, 2, timeout_s=60)
    assert "rank one exploded" in str(info.value)
    assert time.monotonic() - t0 < 30  # rank 0 sat in a barrier: it was killed, not waited for


def test_hang_dumps_every_rank_stack():
    with pytest.raises(DistributedTestError, match="hung") as info:
        # Long enough for both ranks to start on a loaded 2-core machine.
        run_distributed(sleepy, 2, timeout_s=20, collective_timeout_s=60)
    text = str(info.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert "sleepy" in text  # the stuck frame is named


def test_each_rank_takes_the_callers_environment_of_the_moment(monkeypatch):
    # The ranks fork from a server started by an earlier call (shardwise.forkserver), whose
    # environment is frozen: a variable the caller sets or drops afterwards must still reach them
    # as a spawned rank would see it, and the test's own env= on top.
    run_distributed(echo, 2, value=1)  # the server is running now
    monkeypatch.setenv("SHARDWISE_HARNESS_PROBE", "set after the server started")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    names = ("SHARDWISE_HARNESS_PROBE", "SHARDWISE_HARNESS_EXTRA", "OMP_NUM_THREADS", "RANK")
    got = run_distributed(env_of, 2, env={"SHARDWISE_HARNESS_EXTRA": "x"}, names=names)
    assert got == [{"SHARDWISE_HARNESS_PROBE": "set after the server started", "SHARDWISE_HARNESS_EXTRA": "x",
                    "OMP_NUM_THREADS": "1", "RANK": str(r)} for r in range(2)]


def test_a_native_crash_is_named_and_run_once_more(tmp_path):
    """A rank killed by a native crash (gloo's transport thread segfaulted once in a loaded full run:
    its peer reported only "Connection closed by peer") is named as the cause, and the test runs once
    more, with a warning; a crash that comes back fails, naming the crashed rank."""
    with pytest.warns(RuntimeWarning, match="rank 1 crashed in native code \\(SIGSEGV\\).*running it once more"):
        assert run_distributed(segfault_once, 2, timeout_s=120, marker=str(tmp_path / "crashed")) == [0, 1]
    with (pytest.warns(RuntimeWarning, match="running it once more"),
          pytest.raises(DistributedTestError, match="rank 1 crashed in native code \\(SIGSEGV\\)|rank 1 died")):
        run_distributed(segfault_always, 2, timeout_s=120)
