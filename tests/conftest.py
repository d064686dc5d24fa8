import os
from pathlib import Path

import pytest
from hypothesis import settings

# Hypothesis: reproducible in CI (fixed derandomized search, no example database); explore locally
# with HYPOTHESIS_PROFILE=explore (random, remembers failures in .hypothesis/) and --hypothesis-seed.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# ``tests`` is a package: pytest puts the repo root on sys.path, spawned ranks inherit it, and
# helpers import as ``tests.helpers.*``.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cli_env():
    """Environment for running the `shardwise` CLI as a subprocess."""
    env = dict(os.environ)
    # src first (this checkout, not an installed copy); the repo root for ``tests.helpers.*``
    # factories named in TOML files.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


# ``scripts/test`` runs the suite as two concurrent shards (most tests wait on process start-up and
# rendezvous, leaving cores idle), then the ``serial`` tests alone:
# SHARDWISE_TEST_SHARD="i/n" keeps shard i's test files. Files go whole (their module fixtures are
# built once) to the lightest shard, heaviest first, by the seconds each file took in a sharded run
# (tests/shard_weights.json, rewritten by scripts/shard-weights; a file it does not list counts as
# the median). The weights only balance the shards: every test runs.
SHARD_WEIGHTS = Path(__file__).with_name("shard_weights.json")


def _shard_of_files(files: list[str], count: int) -> dict[str, int]:
    import json
    import statistics

    weights = json.loads(SHARD_WEIGHTS.read_text()) if SHARD_WEIGHTS.exists() else {}
    typical = statistics.median(weights.values()) if weights else 1.0
    loads = [0.0] * count
    out: dict[str, int] = {}
    for name in sorted(files, key=lambda f: (-weights.get(f, typical), f)):
        shard = loads.index(min(loads))
        out[name] = shard
        loads[shard] += weights.get(name, typical)
    return out


@pytest.hookimpl(trylast=True)  # after -m has deselected: only files with tests left count
def pytest_collection_modifyitems(config, items):
    spec = os.environ.get("SHARDWISE_TEST_SHARD", "")
    if not spec:
        return
    try:
        index, count = (int(x) for x in spec.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"SHARDWISE_TEST_SHARD must be 'i/n' with 0 <= i < n, got {spec!r}") from None
    shard = _shard_of_files(sorted({item.path.name for item in items}), count)
    keep = [item for item in items if shard[item.path.name] == index]
    dropped = [item for item in items if shard[item.path.name] != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    # DeepSpeed's engine tests last: by then the ops scripts/test builds beside the shards are ready.
    items[:] = sorted(keep, key=lambda item: item.get_closest_marker("deepspeed_ops") is not None)


@pytest.fixture(autouse=True)
def _deepspeed_ops_built(request):
    """A ``deepspeed_ops`` test waits for the build scripts/test runs beside the shards (it writes
    its exit code into $SHARDWISE_DS_BUILD_DONE); without that variable the ops were built first."""
    done = os.environ.get("SHARDWISE_DS_BUILD_DONE")
    if not done or request.node.get_closest_marker("deepspeed_ops") is None:
        return
    import time

    deadline = time.monotonic() + 3600
    while not os.path.exists(done):
        if time.monotonic() > deadline:
            pytest.fail(f"DeepSpeed's ops were not built within an hour ({done} never appeared)")
        time.sleep(2)
    code = Path(done).read_text().strip()
    if code != "0":
        pytest.fail(f"building DeepSpeed's ops failed (exit {code}; .venv/test-logs/deepspeed-build.log)")
