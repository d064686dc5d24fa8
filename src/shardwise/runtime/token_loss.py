"""The loss of a step as a mean over the trained tokens of the whole global batch.

With labels of ``-100`` (prompt tokens, padding, packed rows) micro-batches hold different numbers
of trained tokens, so the mean of per-micro-batch means weighs tokens unequally, and differently on
1 and N ranks. Instead every micro-batch's loss is its SUM of token losses, scaled so that what
backward sees adds up to the global token mean:

    loss_step = sum_{ranks r, micro-batches a} sum_{trained tokens t of (r, a)} CE_t  /  N,
    N = number of trained tokens (label != -100) in the global batch (all ranks, all micro-batches).

``Session.backward`` divides each micro-batch's loss by A (accumulation steps) and data-parallel
gradient reduction averages over the dp ranks, so each micro-batch's loss is
``sum CE * (dp * A) / N`` (``step_scale``). N is known before the step's first forward: the
trainer reads the step's A micro-batches first, counts their labels on the host and all-reduces the
count (one small all-reduce, no host sync). One process and N ranks therefore compute the same loss
and the same gradient, whatever the split. Ranks that are not data-parallel replicas (tensor or
pipeline parallel peers) hold the same batch, so the all-reduced count is divided by their number.
Context-parallel ranks also hold the same batch (counted before it is cut), but each computes the
loss of its own sequence chunk and gradients are averaged over them too (they are part of the
data-parallel dimension): the scale is ``dp * cp * A / N``.

Under pipeline parallel the schedule cuts each micro-batch again into its own micro-batches and
runs the loss on each piece. A token SUM adds up over the pieces, whereas a mean loss is averaged
over them, so the schedule must know which it has: ``token_sum`` marks a loss function as a sum
(``token_sum_loss`` is one; the trainer marks its scaled wrapper) and ``is_token_sum`` is what the
pipeline asks (``parallel.pipeline.pp.Pipeline.run``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.models.masking import real_token_count

IGNORE_INDEX = -100
_SUM_MARK = "_shardwise_token_sum"

LossFn = TypeVar("LossFn", bound=Callable[..., Any])


def token_sum(fn: LossFn) -> LossFn:
    """Mark ``fn`` as a loss that sums over tokens (it adds up over a micro-batch's pieces); returns ``fn``."""
    setattr(fn, _SUM_MARK, True)
    return fn


def is_token_sum(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was marked by ``token_sum`` (otherwise a loss is taken as a mean)."""
    return bool(getattr(fn, _SUM_MARK, False))


@token_sum
def token_sum_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy over the tokens whose label is not -100."""
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def step_scale(session: Any, micro_batches: list[tuple[Any, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss scale ``dp * A / N``, real tokens of the global batch) for one step's micro-batches, as
    device tensors; every rank of the job must call it (an all-reduce when distributed)."""
    trained = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
    real = sum(real_token_count(x) for x, _ in micro_batches)
    counts = torch.tensor([trained, real], dtype=torch.float64, device=session.device)
    if session.is_distributed:
        dist.all_reduce(counts)
        counts = counts / (session.world_size // session.dp_size)  # non-dp peers hold the same batch
    # Gradients are averaged over every data-parallel rank, the cp ranks of a sequence included.
    replicas = session.dp_size * session.layout.cp
    scale = (replicas * len(micro_batches)) / counts[0].clamp(min=1.0)
    return scale.float(), counts[1]
