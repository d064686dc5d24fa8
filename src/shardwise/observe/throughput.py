"""Throughput, achieved FLOP/s and MFU of a run, and the share of step time spent waiting on data.

Model FLOPs per token come from the planner's own counting (``plan.cost.flops_per_token`` on a
``ModelSpec`` of the model: 6 x matmul parameters plus the attention term; recomputation under
activation checkpointing is not counted, as in the usual MFU definition). The peak is the planner's
GPU catalog entry matching ``torch.cuda.get_device_name()`` (dense bf16 tensor peak for 16-bit
precisions, TF32 = half of it for fp32, the planner's convention), and on the CPU a measured
matmul peak of this machine with the rank's thread count, cached per machine.

    MFU = tokens/s x FLOPs/token / (peak FLOP/s per device x devices)

Times come from windows between logging steps: the step loop has no host-device sync on other
steps, so a single step's host time on CUDA is only its launch time; the logging step's sync
closes the window, and the window's wall time is the device's.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.fsutil import atomic_write_json
from shardwise.plan.presets import gpu

# torch.cuda.get_device_name() substrings -> the planner's GPU catalog keys (plan.presets.GPUS).
# Checked in order: the more specific names first.
_CUDA_NAMES: tuple[tuple[str, str], ...] = (
    ("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
    ("a100-sxm4-40gb", "a100-40gb"), ("a100-pcie-40gb", "a100-40gb"), ("a100", "a100-80gb"),
    ("l40s", "l40s"), ("rtx 4090", "rtx-4090"), ("mi300x", "mi300x"),
)
_CACHE_NAME = "cpu_peak.json"


@dataclass(frozen=True)
class Peak:
    """A device's peak dense matmul rate, and where the number came from."""

    tflops: float | None  # None: unknown device (no MFU)
    source: str  # "catalog:h100-sxm", "measured:cpu", or why there is none


def catalog_gpu(device_name: str) -> str | None:
    """The planner's GPU catalog key for a CUDA device name (``torch.cuda.get_device_name()``), or None."""
    lowered = device_name.lower()
    return next((key for pattern, key in _CUDA_NAMES if pattern in lowered), None)


def _compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision in ("bf16-mixed", "bf16-true") else (
        torch.float16 if precision == "fp16-mixed" else torch.float32)


def device_peak(device: torch.device, precision: str, *, cache_dir: str | Path | None = None) -> Peak:
    """Return this device's peak for ``precision`` (catalog on CUDA, a measured matmul on the CPU)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        key = catalog_gpu(name)
        if key is None:
            return Peak(None, f"no catalog entry for {name!r} (see shardwise.plan.presets.GPUS)")
        g = gpu(key)
        return Peak(g.peak_tflops(precision), f"catalog:{key}")
    if device.type == "cpu":
        return Peak(cpu_matmul_peak(_compute_dtype(precision), cache_dir=cache_dir), "measured:cpu")
    return Peak(None, f"no peak known for device type {device.type!r}")


def _cache_path(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir) / _CACHE_NAME
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "shardwise" / _CACHE_NAME


def _machine_key(dtype: torch.dtype) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
        cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass  # not Linux: platform's name is what there is
    return f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}"


def measure_matmul_tflops(dtype: torch.dtype = torch.float32, n: int = 512, seconds: float = 0.3) -> float:
    """Return the best achieved TFLOP/s of ``n x n`` matmuls on the CPU over about ``seconds``."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm up (allocations, the BLAS thread pool)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best / 1e12


def cpu_matmul_peak(dtype: torch.dtype = torch.float32, *, cache_dir: str | Path | None = None) -> float:
    """This machine's CPU matmul peak in TFLOP/s, measured once and cached per CPU, threads and dtype."""
    path, key = _cache_path(cache_dir), _machine_key(dtype)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}  # none yet, or unreadable: measure and rewrite it
    if not isinstance(cached, dict):
        cached = {}
    value = cached.get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    value = measure_matmul_tflops(dtype)
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, cached)
    except OSError:
        pass  # a read-only home: the next run measures again, which costs a fraction of a second
    return value


class ThroughputMeter:
    """Tokens/s, achieved TFLOP/s per device, MFU and data-wait fraction over logging windows.

    ``add_step(seconds, data_seconds)`` after each optimizer step (host times; on the logging step
    taken after its sync), ``window()`` at a logging step returns the window's figures and opens
    the next window. ``summary()`` gives the medians over windows.
    """

    def __init__(self, *, tokens_per_step: int, flops_per_token: float, devices: int, peak: Peak) -> None:
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.devices = devices
        self.peak = peak
        self._steps = 0
        self._seconds = 0.0
        self._data_seconds = 0.0
        self._tokens: Any = 0
        self.windows: list[dict[str, float]] = []

    def add_step(self, seconds: float, data_seconds: float, tokens: Any = None) -> None:
        """``tokens``: the step's real (non-padding) tokens, all ranks, when they vary (padded or packed
        records; a number or a device tensor, read only at ``window()``); default ``tokens_per_step``."""
        self._steps += 1
        self._seconds += seconds
        self._data_seconds += data_seconds
        self._tokens = self._tokens + (self.tokens_per_step if tokens is None else tokens)

    def figures(self, tokens_per_s: float) -> dict[str, float | None]:
        """tflops per device and MFU for a rate of ``tokens_per_s`` (global, all devices)."""
        tflops = tokens_per_s * self.flops_per_token / self.devices / 1e12
        mfu = tflops / self.peak.tflops if self.peak.tflops else None
        return {"tflops_per_device": tflops, "mfu": mfu}

    def window(self) -> dict[str, Any]:
        """The figures of the steps since the last window (empty dict when there were none)."""
        if not self._steps or self._seconds <= 0:
            return {}
        step_time = self._seconds / self._steps
        tokens_per_s = float(self._tokens) / self._seconds
        out: dict[str, Any] = {"step_time_s": step_time, "tokens_per_s": tokens_per_s,
                               **self.figures(tokens_per_s),
                               "data_fraction": self._data_seconds / self._seconds}
        self.windows.append({**out, "steps": self._steps})
        self._steps, self._seconds, self._data_seconds, self._tokens = 0, 0.0, 0.0, 0
        return out

    def summary(self) -> dict[str, Any]:
        """Medians over the windows (each window weighs its steps), with the counting inputs."""
        def median(key: str) -> float:
            values = [w[key] for w in self.windows for _ in range(int(w["steps"]))]
            return statistics.median(values) if values else 0.0

        tokens_per_s = median("tokens_per_s")
        return {"tokens_per_s": tokens_per_s, "step_time_s": median("step_time_s"),
                **self.figures(tokens_per_s), "data_fraction": median("data_fraction"),
                "flops_per_token": self.flops_per_token, "peak_tflops_per_device": self.peak.tflops,
                "peak_source": self.peak.source, "devices": self.devices}
