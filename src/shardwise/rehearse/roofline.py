"""What a played rank computes: every op's FLOPs and bytes, and their roofline time on a target GPU.

torch's ``RuntimeEstimator`` gives a roofline time per op, but only on a CUDA machine (it reads the
device's own peak figures). The same model is counted here on any machine: while one step runs,
``OpCounter`` sees every local op (DTensor's desugared ops, as the memory tracker does) and records
its FLOPs (torch's own formulas, ``torch.utils.flop_counter``) and the bytes it reads and writes
(inputs and outputs, broadcast dimensions once: ``torch.utils._runtime_estimation.get_num_bytes``),
grouped by identical (kind, FLOPs, bytes) so an 80-layer model's result stays small. The report
prices them on the target GPU (``report.roofline_s``, torch-free): each op takes the longer of its FLOPs at the
GPU's peak and its bytes at the GPU's memory bandwidth, and the step the sum of its ops. That is
a floor: no kernel reaches peak, and launch gaps, communication waits and the CPU are not in it.
Collectives and pipeline messages are not compute and are left out (they are the report's
collective columns).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._runtime_estimation import _IGNORE_OPS, get_num_bytes
from torch.utils.flop_counter import flop_registry

# Ops of these namespaces move data between ranks: the collective log counts them, not this.
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
_HALF = (torch.float16, torch.bfloat16)


def _kind(outputs: list[Any]) -> str:
    """The peak an op runs at: "16-bit" when it writes a float16/bfloat16 tensor (tensor cores),
    "fp32" for a float32 one, "other" for integer or boolean outputs (bytes only)."""
    dtypes = {t.dtype for t in outputs if isinstance(t, torch.Tensor)}
    if dtypes & set(_HALF):
        return "16-bit"
    return "fp32" if dtypes & {torch.float32, torch.float64} else "other"


class OpCounter(TorchDispatchMode):
    """Counts the FLOPs and bytes of the local ops run under it (enter it inside the fake mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, int, int]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # DTensor first desugars into the local ops this rank runs; those come back here.
        if any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _IGNORE_OPS or func.namespace in _COMM_NAMESPACES:
            return out
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0
        nbytes = sum(get_num_bytes(t) for t in (*inputs, *outputs))
        if flops or nbytes:
            self.ops[(_kind(outputs), flops, int(nbytes))] += 1
        return out

    def result(self) -> dict[str, Any]:
        """Totals and the grouped ops, as JSON-ready data (``roofline_s`` prices them)."""
        return {"flops": sum(f * n for (_, f, _), n in self.ops.items()),
                "bytes": sum(b * n for (_, _, b), n in self.ops.items()),
                "ops": [[kind, f, b, n] for (kind, f, b), n in sorted(self.ops.items())]}
