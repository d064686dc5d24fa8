"""[profile]: torch.profiler traces per rank, their compute/comm/data split, `shardwise profile`."""

import json
import sys

import pytest

from shardwise.cli import main
from shardwise.observe import intervals as iv
from shardwise.observe.trace import step_split, summarize, top_ops
from shardwise.testing import run_command

FAST = ["--set", "model.preset=nano", "--set", "train.eval_batches=2", "--set", "train.sample_tokens=0",
        "--set", "train.progress=false", "--set", "checkpoint.at_end=false"]


def test_interval_arithmetic():
    a = iv.union([(5, 9), (0, 2), (1, 3), (8, 10), (4, 4)])
    assert a == [(0, 3), (5, 10)]
    assert iv.subtract(a, [(1, 2), (6, 7), (9, 20)]) == [(0, 1), (2, 3), (5, 6), (7, 9)]
    assert iv.clip(a, 2, 6) == [(2, 3), (5, 6)] and iv.length(a) == 8


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat}


def test_step_split_counts_each_instant_once():
    # One 100 us step: an op 0-40; a data-loader span 40-50 whose nested collate op is data, not
    # compute; a gloo all-reduce in flight 30-80 on gloo's thread: 30-40 hides behind compute,
    # 50-80 is exposed; 80-100 nothing runs (other).
    trace = {"shardwise": {"first_step": 3}, "traceEvents": [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("aten::mm", 0, 40), _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 40, 10,
                                 cat="user_annotation"),
        _x("aten::stack", 42, 5), _x("gloo:all_reduce", 30, 50, tid=2, cat="user_annotation"),
        _x("ProfilerStep#2", 100, 50, cat="user_annotation"), _x("aten::add", 100, 50)]}
    first, second = step_split(trace)
    assert first["step"] == 4 and second["step"] == 5  # ProfilerStep#k is step first_step + k
    assert first["step_s"] == pytest.approx(100e-6)
    assert first["compute_s"] == pytest.approx(40e-6) and first["data_s"] == pytest.approx(10e-6)
    assert first["comm_s"] == pytest.approx(30e-6) and first["other_s"] == pytest.approx(20e-6)
    assert first["comm_total_s"] == pytest.approx(50e-6)
    assert second["compute_s"] == pytest.approx(50e-6) and second["comm_total_s"] == 0


def test_cuda_trace_counts_device_kernels_and_nccl():
    # On CUDA the host ops only launch; kernels are compute, NCCL kernels communication.
    trace = {"traceEvents": [
        _x("ProfilerStep#0", 0, 100, cat="user_annotation"), _x("aten::mm", 0, 90),
        _x("ProfilerStep#0", 10, 100, cat="gpu_user_annotation", tid=7),
        _x("sm80_xmma_gemm", 10, 30, tid=7, cat="kernel"),
        _x("ncclDevKernel_AllReduce_Sum_f32", 30, 50, tid=8, cat="kernel")]}
    (row,) = step_split(trace)
    assert row["compute_s"] == pytest.approx(30e-6) and row["comm_s"] == pytest.approx(40e-6)
    assert row["comm_total_s"] == pytest.approx(50e-6) and row["other_s"] == pytest.approx(30e-6)
    assert summarize(trace)["device"] == "cuda"


def test_top_ops_rank_by_self_time():
    trace = {"traceEvents": [_x("ProfilerStep#0", 0, 100, cat="user_annotation"),
                             _x("aten::linear", 0, 60), _x("aten::addmm", 5, 50), _x("aten::relu", 70, 20)]}
    ops = {o["name"]: o for o in top_ops(trace)}
    assert ops["aten::addmm"]["self_s"] == pytest.approx(50e-6)
    linear = ops["aten::linear"]
    assert linear["self_s"] == pytest.approx(10e-6) and linear["total_s"] == pytest.approx(60e-6)
    assert [o["name"] for o in top_ops(trace, 2)] == ["aten::addmm", "aten::relu"]


def test_profiled_two_rank_run_and_the_profile_command(cli_env, tmp_path):
    run = tmp_path / "run"
    proc = run_command([sys.executable, "-m", "shardwise", "train", "--nproc", "2", "--strategy", "fsdp",
                        "--out", str(run), *FAST, "--set", "train.steps=4", "--set", "profile.enabled=true",
                        "--set", "profile.start_step=2", "--set", "profile.end_step=3"],
                       env=cli_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # CPU run: the CUDA memory snapshot is skipped with a log line, and nothing is written for it.
    assert "no memory snapshot on this run" in proc.stderr
    assert not list((run / "profile").glob("*.pickle"))
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank{rank}.pt.trace.json").read_text())
        names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        # FSDP2 on gloo: parameter all-gathers, gradient reduce-scatters (gloo runs them as
        # all-reduces) and the grad-norm all-reduce, each as the backend's own event.
        assert {"gloo:all_gather", "gloo:all_reduce", "c10d::_reduce_scatter_base_",
                "c10d::_allgather_base_"} <= names
        assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and "ProfilerStep#3" not in names
        summary = json.loads((run / "profile" / f"rank{rank}.summary.json").read_text())
        assert [s["step"] for s in summary["steps"]] == [2, 3] and summary["rank"] == rank
        for s in summary["steps"]:
            parts = s["compute_s"] + s["data_s"] + s["comm_s"] + s["other_s"]
            assert parts == pytest.approx(s["step_s"], rel=1e-6) and s["comm_total_s"] > 0
    out = run_command([sys.executable, "-m", "shardwise", "profile", str(run), "--top", "5"],
                      env=cli_env, timeout=120)
    assert out.returncode == 0, out.stderr
    for expected in ("rank 0 of 2 (fsdp, gloo, cpu)", "rank 1 of 2", "comm(exposed)", "top ops by self time",
                     "gloo:all_gather"):
        assert expected in out.stdout
    step_rows = [line.split()[0] for line in out.stdout.splitlines() if line.rstrip().endswith("%")]
    assert step_rows == ["2", "3", "all"] * 2  # per rank: steps 2 and 3, then their sum


def test_profile_command_and_config_refuse_bad_input(capsys, tmp_path):
    assert main(["profile", str(tmp_path)]) == 2
    assert "no profiler traces" in capsys.readouterr().err
    assert main(["train", "--nproc", "2", "--set", "profile.enabled=true", "--set", "profile.ranks=[0, 2]",
                 "--out", str(tmp_path / "r")]) == 2
    assert "profile.ranks names rank(s) [2], but the job has 2 rank(s)" in capsys.readouterr().err
    assert main(["train", "--set", "train.steps=4", "--set", "profile.enabled=true"]) == 2
    assert "profile.end_step (5) is after the last step" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
