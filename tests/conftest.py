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
