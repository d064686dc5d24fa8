"""Rows of training sequences built from separate documents: packed (``data.pack = true``) or padded.

Every item is ``(inputs, targets)``: ``targets`` ``(T,)`` are the next-token labels (``-100`` where
nothing is trained: prompt tokens, padding, and nothing ever across a document boundary), and
``inputs`` is a dict of ``(T,)`` tensors (layout documented in ``shardwise.models.masking``):

* packed: ``input_ids``, ``position_ids`` (restarting at 0 at each document) and ``doc_ids``
  (0, 1, ... per document of the row, ``-1`` for the padding that fills the row's end);
* padded (one record per row): ``input_ids`` and ``attention_mask`` (1 real, 0 padding).

A record of ``L`` tokens gives ``L - 1`` (input, target) positions: its inputs are tokens
``0..L-2`` and its targets tokens ``1..L-1``, so no position predicts a token of another record.
Packing is best-fit decreasing (deterministic; the sampler shuffles rows each epoch).

``DocumentSequences`` does the same for a flat token stream (``data.kind = "text"`` with
``pack = true``): each EOS token starts a document (it is the "start of text" a sample begins
from), so a row's documents attend only to themselves and positions restart at every EOS.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch.utils.data import Dataset

from shardwise.data.instruct import IGNORE_INDEX


class RowSequences(Dataset):
    """Fixed-length rows of separate records (packed or padded); item = (inputs dict, targets)."""

    def __init__(self, ids: list[np.ndarray], labels: list[np.ndarray], block_size: int, pack: bool,
                 pad_id: int) -> None:
        self.block_size, self.pack = block_size, pack
        rows = best_fit([len(rec) - 1 for rec in ids], block_size) if pack else [[i] for i in range(len(ids))]
        self.rows = rows  # the record indices of each row, in their order in it (doc id = position here)
        shape = (len(rows), block_size)
        self.input_ids = np.full(shape, pad_id, dtype=np.int64)
        self.targets = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        self.position_ids = np.zeros(shape, dtype=np.int64)
        self.doc_ids = np.full(shape, -1, dtype=np.int64)
        for r, members in enumerate(rows):
            at = 0
            for d, i in enumerate(members):
                n = len(ids[i]) - 1
                self.input_ids[r, at:at + n] = ids[i][:-1]
                self.targets[r, at:at + n] = labels[i][1:]
                self.position_ids[r, at:at + n] = np.arange(n)
                self.doc_ids[r, at:at + n] = d
                at += n
            # Padding continues the positions (a valid index for position embeddings).
            self.position_ids[r, at:] = np.arange(at, block_size) - at
        self.records = len(ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        x = {"input_ids": torch.from_numpy(self.input_ids[i])}
        if self.pack:
            x["position_ids"] = torch.from_numpy(self.position_ids[i])
            x["doc_ids"] = torch.from_numpy(self.doc_ids[i])
        else:
            x["attention_mask"] = torch.from_numpy((self.doc_ids[i] >= 0).astype(np.int64))
        return x, torch.from_numpy(self.targets[i])

    def padding_fraction(self) -> float:
        return float((self.doc_ids < 0).mean()) if self.doc_ids.size else 0.0

    def describe(self, part: str) -> str:
        how = "packed" if self.pack else "one record per row, padded"
        return (f"data: {part}: {self.records:,} records in {len(self):,} rows of {self.block_size} tokens ({how}; "
                f"{self.padding_fraction():.1%} padding)")


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of record indices whose lengths add up to at most ``capacity``: best-fit decreasing
    (longest record first, into the fullest row it still fits), deterministic. Each row lists its
    records in their original order."""
    rows: list[list[int]] = []
    frees: list[int] = []  # the distinct free spaces of open rows, sorted
    by_free: dict[int, list[int]] = {}  # free space -> rows with it
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        at = bisect.bisect_left(frees, n)
        if at < len(frees):
            free = frees[at]
            row = by_free[free].pop()
            if not by_free[free]:
                del by_free[free]
                frees.pop(at)
        else:
            row, free = len(rows), capacity
            rows.append([])
        rows[row].append(i)
        left = free - n
        if left > 0:
            if left not in by_free:
                bisect.insort(frees, left)
                by_free[left] = []
            by_free[left].append(row)
    return [sorted(r) for r in rows]


class DocumentSequences(Dataset):
    """A token stream's sequences with document ids and positions from its EOS tokens."""

    def __init__(self, base: Dataset, eos_id: int) -> None:
        self.base, self.eos_id = base, eos_id

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        x, y = self.base[i]
        doc_ids, position_ids = documents_of(x, self.eos_id)
        return {"input_ids": x, "position_ids": position_ids, "doc_ids": doc_ids}, y


def documents_of(x: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(doc_ids, position_ids) of a 1-D token row in which every EOS token starts a new document."""
    starts = x == eos_id
    doc_ids = torch.cumsum(starts.long(), 0)
    idx = torch.arange(len(x))
    first = torch.zeros(len(x), dtype=torch.long)
    first[starts] = idx[starts]
    first = torch.cummax(first, 0).values  # where each token's document started
    return doc_ids, idx - first
