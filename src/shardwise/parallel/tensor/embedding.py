"""A vocabulary-parallel embedding whose weight gradient stays this rank's rows.

torch's ``RowwiseParallel`` on an ``nn.Embedding`` shards the table's rows (``Shard(0)``) and looks
up the ids each rank owns (DTensor's masked lookup), which is what we want in the forward. Its
backward is not: DTensor has no row-sharded strategy for ``embedding_dense_backward``, so every TP
rank computes the gradient of the *whole* table (``Replicate`` or ``Partial``) and only then
redistributes it to its rows. Found by rehearsing llama-3-405b on 64x8 (``shardwise rehearse``,
tp 8, pp 8, 2026-11-28): the first pipeline stage held a 4,008 MiB bf16 gradient of the full
128,256 x 16,384 table at each backward and, under the pipeline's (or ``no_sync``'s) unsharded
accumulation, an 8,016 MiB fp32 copy of it for the whole schedule -- 12 GiB where its rows need
1.5 GiB -- and reduce-scattered 4 GiB over the TP group per micro-batch.

``VocabParallelEmbedding`` is ``RowwiseParallel`` with the lookup done on the local shard, as
Megatron's ``VocabParallelEmbedding`` does it: ids outside this rank's rows are masked, the local
table is read through ``DTensor.to_local`` (whose backward hands the gradient back as ``Shard(0)``),
and the masked rows come out as a ``Partial`` DTensor that the style's output layout reduces (or
reduce-scatters along the sequence under SP) exactly as before. Only ``F.embedding`` inside the
module's own forward is redirected (a function mode scoped to that call), so subclasses that scale
or otherwise post-process the lookup (Gemma's scaled embedding) keep their forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.overrides import TorchFunctionMode

__all__ = ["VocabParallelEmbedding", "vocab_parallel_lookup"]


def vocab_parallel_lookup(ids: torch.Tensor, weight: DTensor, padding_idx: int | None = None) -> DTensor | None:
    """``F.embedding(ids, weight)`` for a table whose rows are sharded over one mesh dimension, computed
    on this rank's rows: a ``Partial`` DTensor over that dimension (``Replicate`` over any other).
    None when the table is not laid out that way (the caller keeps DTensor's own path)."""
    placements = weight.placements
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    if len(shard_dims) != 1 or any(not p.is_replicate() for i, p in enumerate(placements) if i != shard_dims[0]):
        return None
    dim = shard_dims[0]
    mesh = weight.device_mesh
    vocab = weight.shape[0]
    # Shard(0) splits rows as torch.chunk does: ceil(vocab / n) a rank, the last ranks fewer (or none).
    rows_per_rank = math.ceil(vocab / mesh.size(dim))
    start = mesh.get_local_rank(dim) * rows_per_rank
    rows = weight._local_tensor.shape[0]
    if rows == 0:  # a rank past the table's end (a vocabulary smaller than tp rows a rank): DTensor's path
        return None
    local_weight = weight.to_local()
    local_ids = ids.to_local() if isinstance(ids, DTensor) else ids
    outside = (local_ids < start) | (local_ids >= start + rows)
    local_pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + rows else None
    out = F.embedding((local_ids - start).masked_fill(outside, 0), local_weight, padding_idx=local_pad)
    out = out.masked_fill(outside.unsqueeze(-1), 0)
    placed = [Partial() if i == dim else Replicate() for i in range(mesh.ndim)]
    return DTensor.from_local(out, mesh, placed, run_check=False)


class _LocalLookup(TorchFunctionMode):
    """Inside one embedding module's forward: its ``F.embedding`` call goes to the local lookup."""

    def __init__(self, module: nn.Embedding) -> None:
        super().__init__()
        self.module = module

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding and len(args) >= 2 and args[1] is self.module.weight and isinstance(args[1], DTensor):
            options = dict(zip(("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"), args[2:]))
            options.update(kwargs)
            # max_norm renormalises rows in place and sparse gradients are another layout: DTensor's path.
            if options.get("max_norm") is None and not options.get("sparse") and not options.get("scale_grad_by_freq"):
                out = vocab_parallel_lookup(args[0], args[1], options.get("padding_idx"))
                if out is not None:
                    return out
        return func(*args, **kwargs)


class VocabParallelEmbedding(RowwiseParallel):
    """``RowwiseParallel`` for an ``nn.Embedding`` whose backward keeps the gradient row-sharded (see
    the module docstring); other modules are planned exactly as ``RowwiseParallel`` plans them."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if isinstance(module, nn.Embedding):
            forward = module.forward

            def local_forward(*args: Any, **kwargs: Any) -> Any:
                with _LocalLookup(module):
                    return forward(*args, **kwargs)

            # An instance attribute: the module's class (and FSDP's subclass of it) stays as it is.
            module.forward = local_forward
        return module
