"""Batches of separate records for the built-in trainer and a user's own loop (Session API).

Two collators, both returning ``(inputs, targets)`` with the input keys of
``shardwise.models.masking`` (what the built-in GPT and the Hugging Face models take) and
``targets`` ``(B, T)`` next-token labels (``-100`` where nothing is trained):

* ``collate_rows``: items of ``shardwise.data.packing.RowSequences`` (what ``data.kind = "chat" |
  "instruct"`` build). Stacks them and cuts the columns after the batch's last real token, so a
  padded batch is as long as its longest record, not the whole block (dynamic padding). The
  trainer uses it for these kinds; pass it to ``session.dataloader(..., collate_fn=collate_rows)``.
* ``RecordCollator``: your own tokenised records, each ``{"input_ids": [...], "labels": [...]}``
  (same length; ``labels`` -100 on prompt tokens; e.g. a ``datasets.map`` output). Padded: one
  record per row, right-padded to the batch's longest, with ``attention_mask``. Packed: the batch's
  records are packed into as few rows of ``block_size`` tokens as fit (one row when ``block_size``
  is not given), with ``position_ids`` restarting per record and ``doc_ids`` (-1 = padding).

Cutting trailing padding changes no loss: padding keys are masked out and padding labels are -100.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from shardwise.data.instruct import IGNORE_INDEX
from shardwise.data.packing import RowSequences


def real_length(inputs: Mapping[str, torch.Tensor]) -> int:
    """The number of leading columns of a ``(B, T)`` batch that hold any real (non-padding) token."""
    if "doc_ids" in inputs:
        real = inputs["doc_ids"] >= 0
    elif "attention_mask" in inputs:
        real = inputs["attention_mask"].bool()
    else:
        return inputs["input_ids"].shape[-1]
    cols = real.any(dim=0).nonzero()
    return int(cols[-1]) + 1 if len(cols) else 1


def trim_padding(batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(inputs, targets)`` with the all-padding columns at the right end cut off."""
    inputs, targets = batch
    n = real_length(inputs)
    return {k: v[:, :n] for k, v in inputs.items()}, targets[:, :n]


def collate_rows(items: list[tuple[dict[str, torch.Tensor], torch.Tensor]], *,
                 trim: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Stack ``RowSequences`` items and cut the trailing padding (dynamic padding); ``trim=False``
    keeps every row's full length (fixed-shape batches, what a pipeline schedule needs)."""
    batch = default_collate(items)
    return trim_padding(batch) if trim else batch


class RecordCollator:
    """Collate tokenised records into a padded or packed batch (see the module docstring).

    ``pad_id``: the token id of padding (the tokenizer's pad token, else its EOS). ``pack``: pack
    several records per row. ``block_size``: the longest row allowed (a record longer than it is a
    ValueError naming its length); packed rows are filled up to it; None = no limit.
    """

    def __init__(self, pad_id: int, *, pack: bool = False, block_size: int | None = None) -> None:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens or None, got {block_size}")
        self.pad_id, self.pack, self.block_size = int(pad_id), pack, block_size

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids, labels = [], []
        for k, item in enumerate(items):
            if not isinstance(item, Mapping) or "input_ids" not in item:
                raise ValueError(f"record {k} of the batch must be a mapping with 'input_ids' (and 'labels'), got "
                                 f"{type(item).__name__}")
            x = np.asarray(item["input_ids"], dtype=np.int64).reshape(-1)
            y = np.asarray(item["labels"] if item.get("labels") is not None else x, dtype=np.int64).reshape(-1)
            if len(x) != len(y) or len(x) < 2:
                raise ValueError(f"record {k} of the batch has {len(x)} input_ids and {len(y)} labels; they must be "
                                 "the same length, at least 2 tokens (labels -100 where nothing is trained)")
            # A record of L tokens fills L - 1 positions (inputs 0..L-2, targets 1..L-1).
            if self.block_size is not None and len(x) - 1 > self.block_size:
                raise ValueError(f"record {k} of the batch has {len(x)} tokens; rows hold block_size + 1 = "
                                 f"{self.block_size + 1} at most: truncate records before collating")
            ids.append(x)
            labels.append(y)
        if not ids:
            raise ValueError("an empty batch: no records to collate")
        longest = max(len(x) - 1 for x in ids)
        if self.pack:
            block = self.block_size if self.block_size is not None else sum(len(x) - 1 for x in ids)
        else:
            block = longest
        rows = RowSequences(ids, labels, block, self.pack, self.pad_id)
        return collate_rows([rows[i] for i in range(len(rows))])


__all__ = ["IGNORE_INDEX", "RecordCollator", "collate_rows", "real_length", "trim_padding"]
