"""Planner math for the offload engines (zero3-offload, zero3-nvme; fsdp-offload shares the host part).

Where the state lives per node, and what moving it costs per optimizer step. Torch-free, like the
rest of ``shardwise.plan``. The search asks ``offload_candidates`` for the rows to add when
nothing fits on the GPUs of one node (the decision table's last row).

Per parameter, fp32 AdamW (bytes): the fp32 weight 4, its gradient 4, two moments 8. Under
mixed precision DeepSpeed also keeps a 2-byte compute copy. With both offloads:

* ``zero3-offload``: all of it in host RAM (the node's share: ``params x bytes``, since the
  ranks of a node partition the model between them, each holding 1/N).
* ``zero3-nvme``: weights, moments and the parameter copy on NVMe (16 bytes per parameter,
  ``deepspeed.setup.NVME_BYTES_PER_PARAM``); host RAM holds the gradients' fp32 partitions plus
  pinned swap buffers (a few buffers of ``swap_buffer_bytes`` per rank).

Step time adds, to the GPU compute the cost model predicts, the traffic each step must move:
parameters host->GPU in forward and again in backward, gradients GPU->host (PCIe), the CPU
optimizer step (memory-bound: about 16 bytes read + 12 written per parameter per step), and
under NVMe the optimizer state and weights read and written once per step at the disk's rate.
Transfers overlap with compute only partly; the planner takes the larger of compute and
transfer, plus the optimizer step (which does not overlap: it runs between steps).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shardwise.errors import ConfigError
from shardwise.plan.advice import TRAIN_PRECISION, _grad_accum, predict_step_time
from shardwise.plan.finetune import shell_word
from shardwise.plan.memory import Layout

GIB = 2**30

# Sequential NVMe bandwidth per GPU (GB/s) by GPU kind: the local SSDs of servers carrying that
# GPU, shared by its GPUs (8 per node: e.g. 4 x PCIe Gen4 drives at ~6 GB/s for H100 nodes).
# ``--nvme-gbs`` overrides it; a slow single SATA/network disk is ~0.5.
NVME_GBS_PER_GPU: dict[str, float] = {
    "h100": 3.0, "h200": 3.0, "a100": 2.0, "l40s": 1.5, "rtx-4090": 1.5,
}
DEFAULT_NVME_GBS = 1.5
# Host<->GPU copy rate (GB/s, one direction) by link, and the CPU Adam's memory bandwidth per
# rank (GB/s) it is bound by.
PCIE_GBS = {"pcie5": 50.0, "pcie4": 25.0}
DEFAULT_PCIE_GBS = 25.0
CPU_OPTIMIZER_GBS = 10.0
OPTIMIZER_BYTES_PER_PARAM = 28  # read weight, grad, 2 moments (16) + write weight, 2 moments (12)
HOST_BYTES_PER_PARAM = 16  # fp32 weight + gradient + two AdamW moments
NVME_BYTES_PER_PARAM = 16
SWAP_BUFFERS_PER_RANK = 4
SWAP_BUFFER_BYTES = 256 * 2**20


@dataclass(frozen=True)
class OffloadEstimate:
    """One offload candidate on one node: where the bytes live and what a step costs."""

    strategy: str
    host_bytes_per_node: int
    nvme_bytes_per_node: int
    transfer_s: float  # host<->GPU (and NVMe) traffic of one step
    optimizer_s: float  # the CPU optimizer step
    step_s: float  # max(compute, transfer) + optimizer

    def fits(self, host_ram_gib: float, nvme_gib: float | None = None) -> bool:
        """Whether the node's host RAM (80% usable) and NVMe (if given) hold it."""
        ok = self.host_bytes_per_node <= 0.8 * host_ram_gib * GIB
        if nvme_gib is not None:
            ok = ok and self.nvme_bytes_per_node <= nvme_gib * GIB
        return ok


def nvme_gbs_for(gpu_kind: str, override: float | None = None) -> float:
    """NVMe GB/s per GPU: ``--nvme-gbs`` when given, else the default of the GPU kind."""
    if override is not None:
        if override <= 0:
            raise ConfigError(f"--nvme-gbs must be a positive rate in GB/s per GPU, got {override}.")
        return override
    key = gpu_kind.lower()
    return next((v for k, v in NVME_GBS_PER_GPU.items() if key.startswith(k)), DEFAULT_NVME_GBS)


def estimate(strategy: str, params: int, gpus_per_node: int, compute_s: float, *, gpu_kind: str = "h100",
             link: str = "pcie4", nvme_gbs: float | None = None, mixed: bool = False) -> OffloadEstimate:
    """Offload estimate for ``params`` parameters on one node of ``gpus_per_node`` GPUs.

    ``compute_s``: the step's GPU time without offload (from ``plan.cost``). ``mixed``: bf16/fp16
    compute (2-byte parameter copies moved to the GPU instead of 4-byte ones).
    """
    if strategy not in ("zero3-offload", "zero3-nvme", "fsdp-offload"):
        raise ValueError(f"no offload model for strategy {strategy!r}")
    per_rank = params / gpus_per_node
    copy_bytes = 2 if mixed else 4
    pcie = PCIE_GBS.get(link, DEFAULT_PCIE_GBS) * 1e9
    # Forward and backward each gather the parameters (2 x), gradients go back once.
    transfer = (2 * copy_bytes + 4) * per_rank / pcie
    optimizer = OPTIMIZER_BYTES_PER_PARAM * per_rank / (CPU_OPTIMIZER_GBS * 1e9)
    host = int(params * (HOST_BYTES_PER_PARAM + (2 if mixed else 0)))
    nvme = 0
    if strategy == "zero3-nvme":
        disk = nvme_gbs_for(gpu_kind, nvme_gbs) * 1e9
        # Read and write back weights and moments once per step; the parameter copy is read twice.
        transfer += (2 * 12 + 2 * copy_bytes) * per_rank / disk
        nvme = int(params * NVME_BYTES_PER_PARAM)
        host = int(params * 4 + gpus_per_node * SWAP_BUFFERS_PER_RANK * SWAP_BUFFER_BYTES)
    return OffloadEstimate(strategy, host, nvme, transfer, optimizer, max(compute_s, transfer) + optimizer)


def offload_candidates(params: int, gpus_per_node: int, compute_s: float, *, host_ram_gib: float,
                       gpu_kind: str = "h100", link: str = "pcie4", nvme_gbs: float | None = None,
                       mixed: bool = False) -> list[OffloadEstimate]:
    """The offload rows for the planner when nothing fits on the GPUs: CPU offload if host RAM holds
    the state, else NVMe; fastest first."""
    rows = [estimate(s, params, gpus_per_node, compute_s, gpu_kind=gpu_kind, link=link, nvme_gbs=nvme_gbs,
                     mixed=mixed) for s in ("zero3-offload", "zero3-nvme")]
    return sorted((r for r in rows if r.fits(host_ram_gib)), key=lambda r: r.step_s)


def to_dict(row: OffloadEstimate) -> dict[str, object]:
    """One offload row as the plan's JSON lists it."""
    return {"strategy": row.strategy, "host_gib_per_node": round(row.host_bytes_per_node / GIB, 1),
            "nvme_gib_per_node": round(row.nvme_bytes_per_node / GIB, 1), "transfer_s": round(row.transfer_s, 3),
            "optimizer_s": round(row.optimizer_s, 3), "step_s": round(row.step_s, 3)}


def offload_compute(spec: Any, cluster: Any, work: Any) -> tuple[float, int, int]:
    """(GPU compute seconds per step, micro-batch, micro-batches per step) of the offload engines'
    own layout: fully sharded data parallel over every GPU of the job, at the workload's
    micro-batch, accumulation and checkpointing (full where the search leaves it open: the state
    leaves the GPU precisely because memory is short). Positive for any model."""
    world = cluster.world
    if "checkpoint" in getattr(work, "search", ()):
        work = dataclasses.replace(work, checkpoint="full")
    accum, _ = _grad_accum(work, world, world)
    work = dataclasses.replace(work, grad_accum=accum, global_batch=None)
    step = predict_step_time(spec, cluster, work, Layout("fsdp", dp=world) if world > 1 else Layout("single"))
    return step.compute_s, work.micro_batch, accum


def offload_advice(spec: Any, cluster: Any, work: Any, cands: list[Any],
                   nvme_path: str = "/local_nvme/shardwise") -> tuple[list[OffloadEstimate], list[str], str]:
    """The planner's last row (``plan.search.make_plan`` calls it when no GPU layout fits).

    Returns (offload rows that fit the node's host RAM, fastest first; the commands of the fastest,
    as ``advice.launch_commands`` prints them; one line for the plan's warnings). The rows take the
    GPU compute of the layout the offload engines run -- data parallel over every GPU of the job
    (ZeRO-3 partitions the state over all ranks), at the workload's own micro-batch, accumulation
    and checkpointing -- from the cost model (``offload_compute``), never another candidate's.
    """
    del cands  # the rows never borrow a GPU candidate's compute or batch
    if work.precision == "bf16-true":  # the DeepSpeed strategy's own refusal (parallel/deepspeed/strategy.py)
        return [], [], ("no offload row: DeepSpeed's engines (zero3-offload, zero3-nvme) keep fp32 master weights "
                        "and refuse parallel.precision bf16-true; plan with --precision bf16 to see them.")
    compute_s, mb, accum = offload_compute(spec, cluster, work)
    host_gib = cluster.host_ram_gib or cluster.gpu.host_ram_gib
    nodes = cluster.nodes
    rows = offload_candidates(-(-spec.n_params // nodes), cluster.gpus_per_node, compute_s, host_ram_gib=host_gib,
                              gpu_kind=cluster.gpu.name, nvme_gbs=getattr(cluster, "nvme_gbs", None),
                              mixed=work.precision != "fp32")
    if not rows:
        return [], [], (f"no offload fits either: zero3-nvme still needs {spec.n_params * 4 / nodes / GIB:.0f} GiB "
                        f"of host RAM per node for the gradients (this node has {host_gib:.0f} GiB; --host-ram-gib).")
    best = rows[0]
    line = ("nothing fits on the GPUs; offloading does: " + "; ".join(
        f"{r.strategy} ~{r.step_s:.2f} s/step ({r.host_bytes_per_node / GIB:.0f} GiB host RAM"
        + (f", {r.nvme_bytes_per_node / GIB:.0f} GiB NVMe" if r.nvme_bytes_per_node else "") + " per node)"
        for r in rows) + f". Recommended: {best.strategy} (DeepSpeed: pip install 'shardwise[deepspeed]').")
    if not work.recipe:
        return rows, [], line
    sets = list(work.extra_sets) + [f"parallel.precision={TRAIN_PRECISION[work.precision]}"]
    sets += [f"train.micro_batch_size={mb}", f"train.grad_accum_steps={accum}"]
    if best.strategy == "zero3-nvme":
        sets.append(f"parallel.nvme_path={nvme_path}")
    args = f"{shell_word(work.recipe)} --strategy {best.strategy} " + " ".join(f"--set {shell_word(s)}" for s in sets)
    g, n = cluster.gpus_per_node, cluster.nodes
    if n == 1:
        return rows, [f"shardwise train {args} --nproc {g}"], line
    return rows, [f"shardwise train {args} --nproc {g} --nnodes {n} --rdzv-endpoint $MASTER_ADDR:29500"], line
