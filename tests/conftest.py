import os
import sys
from pathlib import Path

import pytest

# Spawned ranks import test modules by name: make this folder importable for them.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cli_env():
    """Environment for running the `shardwise` CLI as a subprocess."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(Path(__file__).parent),
                                         env.get("PYTHONPATH", "")])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env
