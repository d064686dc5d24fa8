"""The one place that picks a device and a process-group backend (cuda+nccl, else cpu+gloo)."""

from __future__ import annotations

import os

import torch


def accelerator_count() -> int:
    """Number of CUDA devices visible to this process (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def select_device(local_rank: int) -> torch.device:
    """Return this rank's device: its own GPU when there are GPUs, else the CPU."""
    if accelerator_count():
        return torch.device("cuda", local_rank % accelerator_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """Return the process-group backend for ``device``: nccl on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def default_nproc() -> int:
    """What ``shardwise train`` launches by default: one rank per GPU, or 2 CPU processes."""
    return accelerator_count() or 2


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
