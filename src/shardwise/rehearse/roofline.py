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
from torch.utils import flop_counter
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


def _cpu_flash_attention(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
                                  out_val: Any = None, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# The CPU's flash-attention kernels, which torch's FLOP registry lacks: a rehearsal played on fake
# CPU tensors runs them where the GPU runs its own SDPA kernels, so they get the same formulas
# (without this a CPU rehearsal counted no attention FLOPs at all).
_CPU_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward,
}


def _heads_broadcast(tree: Any) -> Any:
    """``tree`` with every 4-D tensor whose head dimension (1) divides the largest one's replaced by a
    meta tensor of the largest head count: grouped-query attention's key/value as the kernel
    broadcasts them. torch before 2.13 has no GQA in its SDPA FLOP formulas (they assert equal
    heads); the formulas read shapes only, so meta tensors cost nothing."""
    leaves = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.dim() == 4]
    heads = max((t.shape[1] for t in leaves), default=0)

    def widen(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() == 4 and 0 < t.shape[1] < heads and heads % t.shape[1] == 0:
            return torch.empty((t.shape[0], heads, *t.shape[2:]), dtype=t.dtype, device="meta")
        return t
    return pytree.tree_map(widen, tree)


def op_flops(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> int | None:
    """torch's FLOP count of one op (0 for ops without a formula), None where the formula refuses
    the op's shapes (the op is then counted by its bytes alone, and named in ``uncounted``)."""
    formula = flop_registry.get(func._overloadpacket) or _CPU_FORMULAS.get(func._overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except (AssertionError, RuntimeError, ValueError, TypeError):
        pass
    try:  # grouped-query attention on a torch whose formulas predate it
        args, kwargs, out = _heads_broadcast((args, kwargs, out))
        return int(formula(*args, **kwargs, out_val=out))
    except (AssertionError, RuntimeError, ValueError, TypeError):
        return None


class OpCounter(TorchDispatchMode):
    """Counts the FLOPs and bytes of the local ops run under it (enter it inside the fake mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, int, int]] = Counter()
        # Ops whose FLOP formula refused their shapes (counted by their bytes only), by name.
        self.uncounted: Counter[str] = Counter()

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
        flops = op_flops(func, args, kwargs, out)
        if flops is None:
            self.uncounted[str(packet)] += 1
            flops = 0
        nbytes = sum(get_num_bytes(t) for t in (*inputs, *outputs))
        if flops or nbytes:
            self.ops[(_kind(outputs), flops, int(nbytes))] += 1
        return out

    def result(self) -> dict[str, Any]:
        """Totals and the grouped ops, as JSON-ready data (``roofline_s`` prices them)."""
        return {"flops": sum(f * n for (_, f, _), n in self.ops.items()),
                "bytes": sum(b * n for (_, _, b), n in self.ops.items()),
                "ops": [[kind, f, b, n] for (kind, f, b), n in sorted(self.ops.items())],
                "uncounted": dict(self.uncounted)}
