"""``plan --gpu cpu``: this machine's CPU ranks as the planner's device, so a user can plan the job
``train`` runs here by default (CPU processes over gloo).

The device's numbers are measured here, not looked up: the fp32 matmul rate of this process
(torch's own threads), shared by the ranks; the memory the machine has, shared by the ranks. The
links are gloo over the loopback device, whose rate is an estimate (stated in the output).
"""

from __future__ import annotations

import functools
import os
import time

from shardwise.plan.presets import GPU

# gloo all-reduce over loopback on a few cores, GB/s per rank per direction: an estimate of the
# order one measures with torch's gloo on a laptop or CI runner, not a measurement of this machine.
GLOO_LOOPBACK_GBS = 2.0


@functools.cache
def measured_matmul_tflops(n: int = 1024, repeats: int = 3) -> float:
    """The best fp32 matmul rate of this process over ``repeats`` n x n products, TFLOPS."""
    import torch  # defers torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up: thread pool and allocation
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def host_memory_gib() -> float:
    """Physical memory of this machine, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def cpu_target(ranks: int) -> GPU:
    """This machine as ``ranks`` CPU ranks: each gets 1/ranks of the measured matmul rate and memory.

    The planner rates fp32 at half ``bf16_tflops`` (tensor cores' TF32); a CPU runs fp32 at its
    measured rate, so ``bf16_tflops`` is twice it (plan fp32 on the CPU: the default there).
    """
    ranks = max(1, ranks)
    fp32 = measured_matmul_tflops() / ranks
    return GPU(f"cpu (this machine, {ranks} rank(s))", memory_gib=host_memory_gib() / ranks,
               bf16_tflops=2 * fp32, mem_bw_tbs=0.02, intra_link="pcie4", inter_link="ethernet-25g",
               host_ram_gib=host_memory_gib(), intra_gbs=GLOO_LOOPBACK_GBS, inter_gbs=GLOO_LOOPBACK_GBS)
