import time

import pytest

from shardwise.testing import DistributedTestError, run_distributed
from tests.helpers.dist import boom, echo, sleepy


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
        # Long enough for both ranks to start (spawn imports torch) on a loaded 2-core machine.
        run_distributed(sleepy, 2, timeout_s=20, collective_timeout_s=60)
    text = str(info.value)
    assert "--- rank 0 ---" in text and "--- rank 1 ---" in text
    assert "sleepy" in text  # the stuck frame is named
