"""benchmarks/gpu.sh says clearly that it measured nothing where there is no GPU (CI's case)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script really runs")
def test_gpu_script_without_a_gpu_exits_77_and_says_so(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("GPU_SH_FORCE_CPU", None)
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 77
    assert "NO GPU on this machine" in proc.stderr and "nothing was measured" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_script_fails_loudly_without_torch(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=dict(os.environ, PYTHON="/bin/false"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "cannot import torch" in proc.stderr
