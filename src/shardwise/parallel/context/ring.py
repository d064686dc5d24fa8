"""Ring attention for context parallel (``parallel.cp_impl = ring``), on gloo (CPU) and NCCL alike.

Built on torch's own ring: ``_templated_ring_attention`` / ``_templated_ring_attention_backward``
from ``torch.distributed.tensor.experimental._context_parallel`` (torch 2.13). They are generic over
an attention op that returns the output and its log-sum-exp: each rank keeps its queries, the K/V
blocks travel around the cp ring (``set_rotate_method("alltoall")``: one block in flight, passed to
the next rank; torch's default all-gathers every rank's K/V once, which holds the whole sequence's
K/V on every rank), every step's partial output is merged with the running one by their
log-sum-exps (online softmax), and the backward sends dK/dV around the ring the same way.

What torch's public entry (``context_parallel``, a DTensor dispatcher) lacks on CPU is a sharding rule
for ``aten._scaled_dot_product_flash_attention_for_cpu``: it has rules only for the CUDA flash /
efficient / cuDNN kernels. So this module calls the templated ring directly, inside an autograd
Function, with the kernel of the device the tensors live on:

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (they take a float mask
  and grouped kv heads);
- CUDA: the flash kernel for fp16/bf16 without a mask, the memory-efficient kernel otherwise
  (fp32, or a document mask as its ``attn_bias``); kv heads repeated to the query heads first.

Load balancing (torch's head-tail sharding, the ring's ``enable_load_balance``): the sequence is cut
into ``2 cp`` chunks and cp rank ``r`` holds chunks ``r`` and ``2cp-1-r`` (``ring_index``), so every
rank has the same causal work at every ring step. ``parallel.context.cp.chunk_batch`` cuts batches that way
under ring and the position hooks give each token its global position.

Packed documents / padded records: the whole sequence's mask (``CPState.mask``, built by
``chunk_batch`` from every token's document ids) is cut per ring step into the block "my queries x
the K/V block visiting me" and passed to the kernel as a float mask (no ``is_causal``: the
document mask has causality in it). A query row with no visible key in a block gets log-sum-exp
``-inf`` (the CPU kernel returns 0 there), so the merge ignores that block for it; every query sees
itself in the first, local block, so the merged log-sum-exp is finite and the backward's
probabilities (recomputed from it) are exact.

No head-divisibility rule: each rank keeps all heads of its tokens (that is the ring's advantage
over the all-to-all with grouped-query attention, where kv heads < cp must be repeated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # torch's private ring (2.13); a torch without it gets a ConfigError from ring_unavailable()
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
except ImportError:  # pragma: no cover - depends on the installed torch
    torch_cp = None

__all__ = ["ring_attention", "ring_index", "ring_split", "ring_unavailable"]

_TORCH_PIECES = ("_templated_ring_attention", "_templated_ring_attention_backward", "set_rotate_method", "_cp_options")


def ring_unavailable() -> str | None:
    """Why this torch cannot run the ring (it lacks the private pieces this module calls), or None."""
    missing = [name for name in _TORCH_PIECES if not hasattr(torch_cp, name)]
    if torch_cp is None or missing:
        return (f"torch {torch.__version__} lacks torch.distributed.tensor.experimental._context_parallel's "
                f"{', '.join(missing or _TORCH_PIECES)} (shardwise's ring was built on torch 2.13's)")
    return None

aten = torch.ops.aten


def ring_index(seq: int, cp_rank: int, cp: int, device: Any = None) -> torch.Tensor:
    """The positions (in a sequence of ``seq`` tokens) cp rank ``cp_rank`` holds under ring: chunks
    ``cp_rank`` and ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks (torch's head-tail load balancing)."""
    chunk = seq // (2 * cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    return torch.cat([head, head + (2 * cp - 1 - 2 * cp_rank) * chunk])


def ring_split(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of dim 1 (the sequence) of ``x`` under ring (``ring_index``)."""
    return x.index_select(1, ring_index(x.shape[1], cp_rank, cp, x.device))


# --------------------------------------------------------------------------- kernels


def _cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                 mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask,
                                                                 scale=scale)
    return out, lse, ()


def _cpu_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, is_causal: bool, scale: float | None, mask: torch.Tensor | None,
                  rest: tuple) -> tuple[torch.Tensor, ...]:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, is_causal,
                                                                     attn_mask=mask, scale=scale)


def _cuda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                  mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    if mask is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale)
        return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)
    bias = _aligned_bias(mask, q, k)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, is_causal,
                                                                          scale=scale)
    # The efficient kernel pads the log-sum-exp's sequence dim to a multiple of 32; the merge needs
    # one entry per query (the backward gets the padded layout back).
    return out, lse[..., :q.shape[2]], ("efficient", seed, offset, lse.shape[-1], bias)


def _cuda_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, is_causal: bool, scale: float | None, mask: torch.Tensor | None,
                   rest: tuple) -> tuple[torch.Tensor, ...]:
    if rest[0] == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = rest
        return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                                 0.0, is_causal, seed, offset, scale=scale)
    _, seed, offset, padded, bias = rest
    lse = F.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], is_causal, scale=scale)
    return dq, dk, dv


def _aligned_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The bias as SDPA hands it to the memory-efficient CUDA kernel: its last dim's storage padded to a
    multiple of 16, expanded to ``[B, H, q, k]``."""
    if mask is None:
        return None
    if mask.shape[-1] % 16:
        mask = F.pad(mask, (0, 16 - mask.shape[-1] % 16))[..., :k.shape[2]]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


# --------------------------------------------------------------------------- one ring step's op


class _BlockOp:
    """The op torch's templated ring calls once per ring step (in order, forward and backward alike):
    it works out which K/V block is visiting (step ``i`` brings rank ``rank - i``'s tokens) and cuts
    the document mask to that block; it keeps each forward step's kernel extras for the backward."""

    def __init__(self, kernel: Callable, rank: int, cp: int, bias: torch.Tensor | None,
                 rests: list | None = None) -> None:
        self.kernel, self.rank, self.cp, self.bias = kernel, rank, cp, bias
        self.step = 0
        self.rests: list = [] if rests is None else rests

    def _mask(self, q_len: int, k_len: int, local: int) -> torch.Tensor | None:
        if self.bias is None:
            return None
        seq = self.bias.shape[-1]
        rows = ring_index(seq, self.rank, self.cp, self.bias.device)
        cols = ring_index(seq, (self.rank - self.step) % self.cp, self.cp, self.bias.device)
        # The templated ring hands the kernel the tail half of the queries, or the head half of the
        # visiting keys, where the other half has nothing to attend to (load-balanced causal).
        rows = rows[local - q_len:] if q_len < local else rows
        cols = cols[:k_len] if k_len < local else cols
        return self.bias.index_select(2, rows).index_select(3, cols)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: Any = False,
                *, local: int, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        mask = self._mask(q.shape[2], k.shape[2], local)
        causal = bool(is_causal) and mask is None
        out, lse, rest = self.kernel(q, k, v, causal, scale, mask)
        if mask is not None:
            # A query with no visible key in this block: no probability mass here (-inf), whatever
            # the kernel wrote, so the merge leaves the running output alone.
            empty = torch.isinf(mask).all(-1)  # [B, 1, q]
            lse = lse.masked_fill(empty.expand_as(lse), float("-inf"))
        self.rests.append(rest)
        self.step += 1
        return out, lse

    def backward(self, *, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, logsumexp: torch.Tensor, is_causal: Any = False, local: int,
                 scale: float | None) -> tuple[torch.Tensor, ...]:
        mask = self._mask(query.shape[2], key.shape[2], local)
        causal = bool(is_causal) and mask is None
        grads = self.kernel(grad_out, query, key, value, out, logsumexp, causal, scale, mask, self.rests[self.step])
        self.step += 1
        return tuple(grads[:3])


_KERNELS = {"cpu": (_cpu_forward, _cpu_backward), "cuda": (_cuda_forward, _cuda_backward)}


def _ring_ready() -> None:
    # One K/V block passed to the next rank per step (torch's default all-gathers them all).
    torch_cp.set_rotate_method("alltoall")
    # The head-tail layout (ring_index) is what torch's load-balanced causal ring expects.
    torch_cp._cp_options.enable_load_balance = True


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, scale: float | None,
                bias: torch.Tensor | None) -> torch.Tensor:
        _ring_ready()
        fwd, bwd = _KERNELS[q.device.type]
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        op = _BlockOp(fwd, rank, cp, bias)
        call = lambda *a, **kw: op.forward(*a, local=q.shape[2], scale=scale, **kw)  # noqa: E731
        out, lse, *_ = torch_cp._templated_ring_attention(group, 2, call, q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.bias, ctx.rests, ctx.bwd = group, scale, bias, op.rests, bwd
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        _ring_ready()
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        op = _BlockOp(ctx.bwd, dist.get_rank(group), dist.get_world_size(group), ctx.bias, ctx.rests)
        call = lambda **kw: op.backward(local=q.shape[2], scale=ctx.scale, **kw)  # noqa: E731
        dq, dk, dv, *_ = torch_cp._templated_ring_attention_backward(
            group, 2, call, dout.contiguous(), "grad_out", q, k, v, out, lse, is_causal=True)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, *, scale: float | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries ``[B, H, S/cp, D]`` (its ``ring_index`` tokens) over the
    whole sequence held by ``group``; ``bias``: the whole sequence's additive float mask
    ``[B, 1, S, S]`` (0 / -inf; causality included) or None for plain causal attention.
    ``k``/``v`` may have fewer heads (grouped-query attention)."""
    if q.device.type not in _KERNELS:
        raise RuntimeError(f"ring attention has kernels for {', '.join(_KERNELS)} tensors, not {q.device.type}")
    if q.device.type == "cuda" and k.shape[1] != q.shape[1]:
        # The CUDA kernels called directly take one kv head per query head.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if bias is not None:
        bias = bias.to(q.dtype)
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), group, scale, bias)
