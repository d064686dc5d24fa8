"""The memory ledger: exact bytes each rank holds in parameters, gradients and optimizer state.

Counting rules, so that numbers from different strategies compare honestly:

* a tensor counts as the storage behind it (``untyped_storage().nbytes()``), each storage once:
  FSDP2's padded shards count with their padding, and gradients that are views into one shared
  buffer (FSDP2's reduce-scatter output, DDP's ``gradient_as_bucket_view``) count that buffer once;
* a DTensor counts as its local tensor, i.e. what this rank really stores;
* gradients are measured at the end of the last optimizer step, just before ``zero_grad``
  (``Session.last_grad_bytes``), the moment they are all alive; DDP's communication buckets and
  FSDP2's unsharded gradients during backward are transient and show in the peak instead;
* optimizer state is every tensor in ``optimizer.state`` (for ZeroRedundancyOptimizer, the state
  of this rank's local optimizer), AdamW's ``step`` counters included.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` (bytes of live tensors at the high-water
mark); on the CPU the process's maximum resident set size from ``getrusage`` — it includes the
Python interpreter and the torch libraries (a few hundred MiB), so compare CPU peaks between
strategies, not against the byte counts above.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FIELDS = ("param_bytes", "grad_bytes", "optim_bytes")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Total bytes of the distinct storages behind ``tensors`` (DTensors by their local shard)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            continue  # freed (FSDP resizes unsharded storage to 0) or an empty shard
        key = (str(t.device), storage.data_ptr())
        seen[key] = max(seen.get(key, 0), nbytes)
    return sum(seen.values())


def param_bytes(model: nn.Module) -> int:
    """Bytes this rank stores for ``model``'s parameters."""
    return storage_bytes(model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """Bytes this rank stores for ``model``'s gradients right now."""
    return storage_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's optimizer state (ZeroRedundancyOptimizer: its local shard's)."""
    if optimizer is None:
        return 0
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner  # ZeroRedundancyOptimizer keeps this rank's state in its local optimizer
    tensors = [v for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor)]
    return storage_bytes(tensors)


def peak_bytes(device: torch.device) -> tuple[int, str]:
    """Return (peak bytes, how it was measured) for this process on ``device``."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(rss if sys.platform == "darwin" else rss * 1024), "process max RSS (getrusage)"


def rank_ledger(session: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's ledger entry: its mesh coordinates (which pipeline stage, data-parallel shard and
    tensor-parallel slice it holds, from the session's layout), parameter/gradient/optimizer bytes
    and peak memory."""
    peak, source = peak_bytes(session.device)
    return {"rank": session.rank, "coords": session.layout.coords(session.rank), "param_bytes": param_bytes(model),
            "grad_bytes": int(session.last_grad_bytes), "optim_bytes": optimizer_bytes(optimizer),
            "peak_bytes": peak, "peak_source": source,
            # Host memory kept by asynchronous checkpoint staging (runtime.checkpoint.background).
            "staging_bytes": int(session.checkpoint_stats["staging_bytes"])}


def collect(session: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Every rank's ledger entry, gathered onto every rank: ``{"ranks": [...], "peak_source": ...}``.

    A collective: call it on all ranks.
    """
    mine = rank_ledger(session, model, optimizer)
    if dist.is_initialized() and dist.get_world_size() > 1:
        entries: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(entries, mine)
    else:
        entries = [mine]
    return {"ranks": entries, "peak_source": mine["peak_source"],
            "grad_bytes_measured": "end of the last optimizer step, before zero_grad"}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def format_table(memory: dict[str, Any]) -> str:
    """A short per-rank table (MiB) of the ledger ``collect`` returned."""
    rows = ["rank  params_MiB  grads_MiB  optim_MiB  total_MiB  peak_MiB"]
    for r in memory["ranks"]:
        total = sum(r[k] for k in FIELDS)
        rows.append(f"{r['rank']:>4}  {_mib(r['param_bytes']):>10}  {_mib(r['grad_bytes']):>9}  "
                    f"{_mib(r['optim_bytes']):>9}  {_mib(total):>9}  {_mib(r['peak_bytes']):>8}")
    rows.append(f"(peak: {memory['peak_source']})")
    return "\n".join(rows)
