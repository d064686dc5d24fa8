"""MFU and throughput in every run: the fields in metrics.jsonl and summary.json, the FLOP count
being the planner's own, the peak from the planner's GPU catalog (CUDA) or a measured, cached CPU
matmul peak, and the data-wait fraction."""

import json
import sys

import pytest
import torch

from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.observe import throughput
from shardwise.observe.throughput import Peak, ThroughputMeter, catalog_gpu, device_peak
from shardwise.plan.cost import flops_per_token
from shardwise.plan.presets import gpu
from shardwise.plan.spec import from_module
from shardwise.testing import run_command

WINDOW_KEYS = {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "data_fraction"}


def test_every_run_reports_mfu_from_the_planners_flop_count(tmp_path, cli_env):
    env = {**cli_env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = tmp_path / "run"
    proc = run_command([sys.executable, "-m", "shardwise", "train", "--strategy", "single", "--nproc", "1",
                        "--set", "model.preset=nano", "--set", "train.steps=4", "--set", "train.log_every=2",
                        "--set", "train.sample_tokens=0", "--set", "train.eval_batches=1",
                        "--set", "train.progress=false", "--out", str(out)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 4]
    for r in train:
        assert set(r) >= WINDOW_KEYS and r["mfu"] > 0 and 0 <= r["data_fraction"] < 1
    summary = json.loads((out / "summary.json").read_text())
    cfg = GPT_PRESETS["nano"]
    with torch.device("meta"):
        spec = from_module(GPT(cfg))
    expected = flops_per_token(spec, cfg.block_size)
    assert summary["flops_per_token"] == pytest.approx(expected, rel=1e-9)
    # The CPU peak was measured once and cached per machine.
    cache = json.loads((tmp_path / "cache" / "shardwise" / "cpu_peak.json").read_text())
    assert summary["peak_source"] == "measured:cpu" and list(cache.values()) == [summary["peak_tflops_per_device"]]
    tflops = summary["tokens_per_s"] * expected / summary["devices"] / 1e12
    assert summary["tflops_per_device"] == pytest.approx(tflops, rel=1e-9)
    assert summary["mfu"] == pytest.approx(tflops / summary["peak_tflops_per_device"], rel=1e-9)
    assert "model FLOPs/token (planner's count)" in proc.stderr


def test_cuda_peak_comes_from_the_planners_catalog(monkeypatch):
    names = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H200": "h200",
             "NVIDIA A100-SXM4-40GB": "a100-40gb", "NVIDIA A100-SXM4-80GB": "a100-80gb",
             "NVIDIA A100-PCIE-40GB": "a100-40gb", "NVIDIA L40S": "l40s", "NVIDIA GeForce RTX 4090": "rtx-4090",
             "AMD Instinct MI300X": "mi300x", "Tesla T4": None}
    assert {n: catalog_gpu(n) for n in names} == names
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert device_peak(cuda, "bf16-mixed") == Peak(gpu("h100-sxm").bf16_tflops, "catalog:h100-sxm")
    assert device_peak(cuda, "fp32").tflops == gpu("h100-sxm").bf16_tflops / 2  # TF32, the planner's rule
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert device_peak(cuda, "fp32").tflops is None  # no MFU rather than a made-up one


def test_cpu_peak_is_measured_once_per_machine(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(throughput, "measure_matmul_tflops", lambda dtype: calls.append(dtype) or 0.5)
    assert throughput.cpu_matmul_peak(torch.float32, cache_dir=tmp_path) == 0.5
    assert throughput.cpu_matmul_peak(torch.float32, cache_dir=tmp_path) == 0.5
    assert throughput.cpu_matmul_peak(torch.bfloat16, cache_dir=tmp_path) == 0.5
    assert calls == [torch.float32, torch.bfloat16]  # per dtype, then from the cache
    (tmp_path / "cpu_peak.json").write_text("not json")  # a damaged cache is measured again
    assert throughput.cpu_matmul_peak(torch.float32, cache_dir=tmp_path) == 0.5 and len(calls) == 3


def test_meter_windows_and_data_fraction():
    meter = ThroughputMeter(tokens_per_step=1000, flops_per_token=6e6, devices=2, peak=Peak(3.0, "test"))
    meter.add_step(0.5, 0.25)
    meter.add_step(1.5, 0.25)
    w = meter.window()
    assert w["step_time_s"] == 1.0 and w["tokens_per_s"] == 1000.0 and w["data_fraction"] == 0.25
    assert w["tflops_per_device"] == pytest.approx(1000 * 6e6 / 2 / 1e12) and w["mfu"] == pytest.approx(1e-3)
    assert meter.window() == {}  # nothing since the last window
    meter.add_step(0.5, 0.0)
    assert meter.summary()["tokens_per_s"] == 1000.0  # the 2-step window outweighs the 1-step one
