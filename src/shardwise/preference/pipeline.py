"""DPO batches through a pipeline schedule (``parallel.pp > 1``).

A schedule cuts a batch's rows into microbatches and calls the loss on each microbatch's rows on the
last stage, with that microbatch's share of ONE target tensor. A DPO loss needs, beside the labels,
which answer each token belongs to and the reference's log-probs of those answers, and it needs a
pair's chosen and rejected answers in the same microbatch. So, before the schedule:

* the rows are reordered so each pair's rows are adjacent (concatenated batches hold the chosen rows
  and then the rejected ones; packed rows already hold a pair each): answer ``2p`` of a microbatch is
  its pair ``p``'s chosen answer, ``2p + 1`` its rejected one, whatever rows the microbatch got;
* the target becomes ``(rows, 3, T)`` int64: the labels, each token's slot in its row (``-1``: not an
  answer token; ``0``, and ``1`` for the second document of a packed row), and the reference's
  log-probs of the row's answers (float64 bits in the first ``answers per row`` positions).

``decode`` turns a microbatch's target back into labels, answer ids and reference log-probs. The
pairs must divide evenly into the microbatches, so the mean of the microbatches'
mean losses is the batch's mean, as without a pipeline (``plan.preference.dpo_layout_refusal``
refuses the rest: the frozen-copy reference, cp beside pp).
"""

from __future__ import annotations

import torch

from shardwise.data.instruct import IGNORE_INDEX

__all__ = ["decode", "halves", "pipeline_batch", "row_width"]


def pipeline_batch(inputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
                   ref: tuple[torch.Tensor, torch.Tensor] | None, width: int) -> tuple[dict[str, torch.Tensor],
                                                                                       torch.Tensor, int]:
    """(inputs, target, answers per row) of a collated pair batch for the schedule (module docstring);
    rows right-padded to ``width`` tokens, so every batch has one shape (the stages size their
    buffers once). ``ref``: the reference's (chosen, rejected) log-probs, None while scoring it."""
    labels, segments = targets["labels"], targets["segments"]
    rows, seq = labels.shape
    packed = "doc_ids" in inputs
    pairs = rows if packed else rows // 2
    per_row = 2 if packed else 1
    if packed:
        order = torch.arange(rows, device=labels.device)
        slot = torch.where(segments >= pairs, 1, 0)
    else:  # chosen rows 0..B-1, rejected rows B..2B-1 -> c0, r0, c1, r1, ...
        order = torch.stack([torch.arange(pairs), torch.arange(pairs) + pairs], dim=1).flatten().to(labels.device)
        slot = torch.zeros_like(segments)
    slot = torch.where(segments >= 0, slot, -1)
    if width < seq:
        raise ValueError(f"a pair batch of {seq} tokens is wider than the pipeline's fixed width {width}")
    pad = width - seq

    def widen(t: torch.Tensor, fill: int) -> torch.Tensor:
        t = t[order]
        return torch.cat([t, t.new_full((rows, pad), fill)], dim=1) if pad else t

    fills = {"input_ids": 0, "attention_mask": 0, "doc_ids": -1, "position_ids": 0}
    out = {k: widen(v, fills[k]) for k, v in inputs.items()}
    target = torch.full((rows, 3, width), 0, dtype=torch.int64, device=labels.device)
    target[:, 0] = widen(labels, IGNORE_INDEX)
    target[:, 1] = widen(slot, -1)
    if ref is not None:
        # Answer order: pair-major (c0, r0, c1, r1, ...), the rows' order after the reordering.
        values = torch.stack([ref[0].double(), ref[1].double()], dim=1).reshape(rows, per_row)
        target[:, 2, :per_row] = values.view(torch.int64)
    return out, target, per_row


def decode(target: torch.Tensor, per_row: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(labels, answer id of each token (-1: none), answers, the reference's log-probs per answer) of
    one microbatch's share of ``pipeline_batch``'s target (a placeholder while torch infers shapes)."""
    labels, slot = target[:, 0], target[:, 1]
    rows = labels.shape[0]
    first = (torch.arange(rows, device=target.device) * per_row).unsqueeze(1)
    answers = torch.where(slot >= 0, first + slot, -1)
    ref = target[:, 2, :per_row].contiguous().view(torch.float64).reshape(-1)
    return labels, answers, rows * per_row, ref


def halves(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) of per-answer values in the pipeline's pair-major order."""
    return values[0::2], values[1::2]


def row_width(block_size: int, packed: bool) -> int:
    """The widest row a pair batch can have: a sequence of ``block_size`` tokens fills ``block_size -
    1`` positions; a packed row holds two."""
    return 2 * (block_size - 1) if packed else block_size - 1
