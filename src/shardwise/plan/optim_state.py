"""Optimizer-state bytes per tensor for each optimizer the trainer builds, and Muon's extra work.

The runtime's rule (optim/build.py): Muon takes the hidden matrices (2-D, and 3-D expert stacks);
embeddings, the output head and every vector stay with AdamW. The planner reads it off the spec:
a matrix inside a block is hidden, the root unit holds the embeddings, final norm and head.
Per tensor (fp32 state, torch.optim's):

* adamw: exp_avg + exp_avg_sq (8 B/element) + a 0-dim fp32 ``step`` (4 B)
* muon: a momentum buffer (4 B/element), no ``step``; its AdamW tensors as adamw
* adafactor: factored second moment (row + column sums) + ``step``; vectors a full one
* sgd: one momentum buffer (4 B/element)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwise.errors import unknown_choice
from shardwise.optim.names import OPTIMIZER_NAMES
from shardwise.plan.spec import ROOT_UNIT, ParamInfo

if TYPE_CHECKING:
    from shardwise.core.layout import Layout
    from shardwise.plan.spec import ModelSpec

STEP_BYTES = 4  # torch.optim's per-tensor 0-dim fp32 ``step`` (AdamW, Adafactor)
NS_STEPS = 5  # torch.optim.Muon's default Newton-Schulz iterations
BF16_BYTES = 2  # Muon moves the update in bfloat16 (torch's Newton-Schulz input precision)


def muon_takes(p: ParamInfo) -> bool:
    """True for a tensor Muon orthogonalises (a trainable matrix, or expert stack, inside a block)."""
    return p.trainable and p.unit != ROOT_UNIT and len(p.shape) in (2, 3)


def state_elements_bytes(shape: tuple[int, ...], optimizer: str) -> int:
    """fp32 state bytes of one local tensor, ``step`` excluded ("muon": its momentum)."""
    numel = math.prod(shape)
    if numel == 0:
        return 0
    if optimizer == "adamw":
        return 8 * numel
    if optimizer in ("sgd", "muon"):
        return 4 * numel
    if optimizer == "adafactor":
        if len(shape) >= 2:
            return 4 * (numel // shape[-1] + numel // shape[-2])
        return 4 * numel
    raise unknown_choice("optimizer", optimizer, OPTIMIZER_NAMES)


def tensor_state_bytes(p: ParamInfo, local_shape: tuple[int, ...], optimizer: str) -> int:
    """All optimizer-state bytes one rank keeps for its ``local_shape`` piece of ``p``, ``step`` included."""
    if optimizer == "muon":
        if muon_takes(p):
            return state_elements_bytes(local_shape, "muon")
        optimizer = "adamw"
    step = 0 if optimizer == "sgd" else STEP_BYTES
    return state_elements_bytes(local_shape, optimizer) + step


@dataclass(frozen=True)
class MuonCost:
    """Muon's extra work per optimizer step on the busiest rank of a sharding group."""

    comm_bytes: int  # bytes this rank sends + receives for the owners' gathers and scatters
    flops: float  # Newton-Schulz FLOPs of the matrices this rank owns
    matrices: int  # matrices (experts count one each) orthogonalised per step, whole model


def muon_cost(spec: ModelSpec, layout: Layout) -> MuonCost:
    """Gather-to-owner + scatter traffic and Newton-Schulz FLOPs per rank (optim/muon.py's scheme).

    The matrices of a shard group of G ranks (FSDP shard x TP; expert stacks cut only on the expert
    dim need no traffic) are dealt round-robin to owners. An owner receives and later sends the
    (G-1)/G of each of its matrices it does not hold; every rank sends and receives its 1/G shard
    of each of the others' matrices: 2 x 2 B x numel x (G-1)/G / G on average per matrix per rank,
    doubled for the two directions of both halves: 4 x 2 B x numel x (G-1)/G^2 per rank in all.
    Newton-Schulz on an m x n matrix (m <= n): 5 iterations of X X^T (2 m^2 n), a m x m polynomial
    (2 m^3) and the product with X (2 m^2 n).
    """
    g = max(1, layout.shard) * max(1, layout.tp)
    pp = max(1, layout.pp)
    comm, flops, count = 0.0, 0.0, 0
    for p in spec.params:
        if not muon_takes(p):
            continue
        *stack, a, b = p.shape
        n_mat = math.prod(stack) if stack else 1
        m, n = min(a, b), max(a, b)
        count += n_mat
        flops += n_mat * NS_STEPS * (4 * m * m * n + 2 * m ** 3)
        if g > 1 and not (stack and layout.ep > 1 and layout.tp == 1 and layout.shard <= layout.ep):
            comm += 4 * BF16_BYTES * a * b * n_mat * (g - 1) / g ** 2
    return MuonCost(int(comm / pp), flops / (g * pp), count)


def muon_line(spec: ModelSpec, layout: Layout) -> str:
    """The plan's line on Muon's extra work per step for ``layout``."""
    c = muon_cost(spec, layout)
    return (f"(muon: {c.matrices} matrices orthogonalised per step, each on one owner rank; per rank "
            f"{c.comm_bytes / 2**20:.1f} MiB gathered + scattered in bfloat16 and "
            f"{c.flops / 1e9:.2f} GFLOP of Newton-Schulz; state 4 B per hidden-matrix element vs AdamW's 8)")
