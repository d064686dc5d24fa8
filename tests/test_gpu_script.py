"""benchmarks/gpu.sh: says clearly that it measured nothing without a GPU; runs end to end on the CPU
with GPU_SH_FORCE_CPU=1 (the CI smoke check of the script), each step inside its time box."""

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


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script measures for real")
def test_gpu_script_runs_end_to_end_on_the_cpu(tmp_path):
    """GPU_SH_FORCE_CPU=1: every step of the list runs (tiny shapes) inside its time box, and the one
    summary file holds a line per step and the total. About 3 minutes here (7 short processes)."""
    import json

    env = dict(os.environ, PYTHON=sys.executable, GPU_SH_FORCE_CPU="1")
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "out" / "summary.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines]
    listed = [line.split()[0].strip('"') for line in SCRIPT.read_text().split("STEP_LIST=(")[1].split(")")[0]
              .strip().splitlines()]
    assert set(steps) == {*listed, "total"}, steps
    assert lines[-1]["step"] == "total" and lines[-1]["failed"] == 0
    for x in lines:
        if "tokens_per_s" in x:  # a training step: figures and the planner's peak next to the measured one
            assert x["tokens_per_s"] > 0 and x["peak_gib_predicted_measured"], x
    assert "took" in proc.stderr and "box" in proc.stderr


def test_a_step_past_its_box_is_stopped_and_named(tmp_path):
    """The box is enforced: a step that overruns is killed, named, and the script goes on to the next."""
    text = SCRIPT.read_text()
    listed = text.split("STEP_LIST=(")[1].split(")")[0]
    text = text.replace(listed, '\n    "stall 1"\n    "ring-kernel 60"\n', 1)
    text = text.replace("step_env() {", "step_stall() {\n    sleep 30\n}\n\nstep_env() {", 1)
    script = tmp_path / "benchmarks" / "gpu.sh"
    script.parent.mkdir()
    script.write_text(text)
    (script.parent / "ring_kernel.py").write_text((SCRIPT.parent / "ring_kernel.py").read_text())
    env = dict(os.environ, PYTHON=sys.executable, GPU_SH_FORCE_CPU="1", GPU_SH_BOX_SCALE="1")
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "TIMED OUT: stall after its 1s box" in proc.stderr and "FAILED: stall (timed out)" in proc.stderr
    lines = (tmp_path / "out" / "summary.jsonl").read_text()
    assert '"timed_out_after_s": 1' in lines and '"step": "ring-kernel", "rc": 0' in lines  # the next step ran
