"""Preference pairs -> one forward's rows: chosen and rejected together, scored by the same rules.

Each item is one pair. A batch of ``B`` pairs becomes ``(inputs, targets)``:

* concatenated (``data.pack`` false, the default): ``2B`` rows, the chosen sequences (prompt +
  chosen answer) first, then the rejected ones in the same order, right-padded to the longest row,
  with ``attention_mask``;
* packed (``data.pack = true``): ``B`` rows, each ``[prompt + chosen | prompt + rejected]`` as two
  documents (``doc_ids`` 0 and 1, ``-1`` padding; ``position_ids`` restarting), so no token attends
  across (``shardwise.models.masking``).

``targets`` is a dict: ``labels`` (next-token ids, ``-100`` on every prompt position and padding:
a sequence of ``L`` tokens fills ``L - 1`` positions, position ``j`` predicting token ``j + 1``, which is
scored when it belongs to the answer), ``segments`` (which answer each position's token belongs to:
``i`` for pair ``i``'s chosen answer, ``B + i`` for its rejected one, ``-1`` elsewhere) and, once the
reference was scored before training, ``ref`` (``(B, 2)`` float64: the reference's chosen and
rejected log-probs). Both layouts give every answer token the same context, so the same log-probs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from shardwise.data.instruct import IGNORE_INDEX
from shardwise.data.preference import Pairs, load_pairs


class PairSet(Dataset):
    """The pairs as a map-style dataset; ``ref`` (N, 2) holds precomputed reference log-probs."""

    def __init__(self, pairs: Pairs) -> None:
        self.pairs = pairs
        self.ref: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        p = self.pairs
        item = {"prompt": p.prompts[i], "chosen": p.chosen[i], "rejected": p.rejected[i]}
        if self.ref is not None:
            item["ref"] = self.ref[i]
        return item

    def sequence_tokens(self) -> int:
        """Tokens of both sequences of every pair (prompt counted twice: it is run twice)."""
        p = self.pairs
        return sum(2 * len(a) + len(b) + len(c) for a, b, c in zip(p.prompts, p.chosen, p.rejected))


def _sequence(prompt: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) of prompt + answer: the L - 1 positions, labels -100 on the prompt's."""
    seq = np.concatenate([prompt, answer])
    labels = seq[1:].copy()
    labels[:max(len(prompt) - 1, 0)] = IGNORE_INDEX
    return seq[:-1], labels


class PairCollator:
    """Collate pair items into one forward's rows (see the module docstring)."""

    def __init__(self, pad_id: int, *, pack: bool = False) -> None:
        self.pad_id, self.pack = int(pad_id), pack

    def __call__(self, items: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        b = len(items)
        chosen = [_sequence(it["prompt"], it["chosen"]) for it in items]
        rejected = [_sequence(it["prompt"], it["rejected"]) for it in items]
        if self.pack:
            rows = [[(c, 0, i), (r, 1, b + i)] for i, (c, r) in enumerate(zip(chosen, rejected))]
        else:
            rows = [[(s, 0, k)] for k, s in enumerate(chosen + rejected)]
        width = max(sum(len(s[0]) for s, _, _ in row) for row in rows)
        shape = (len(rows), width)
        ids = np.full(shape, self.pad_id, np.int64)
        labels = np.full(shape, IGNORE_INDEX, np.int64)
        segments = np.full(shape, -1, np.int64)
        positions = np.zeros(shape, np.int64)
        docs = np.full(shape, -1, np.int64)
        for r, row in enumerate(rows):
            at = 0
            for (x, y), doc, answer in row:
                n = len(x)
                ids[r, at:at + n], labels[r, at:at + n] = x, y
                segments[r, at:at + n] = np.where(y != IGNORE_INDEX, answer, -1)
                positions[r, at:at + n] = np.arange(n)
                docs[r, at:at + n] = doc
                at += n
            positions[r, at:] = np.arange(width - at)  # padding: any valid position
        inputs = {"input_ids": torch.from_numpy(ids)}
        if self.pack:
            inputs["position_ids"] = torch.from_numpy(positions)
            inputs["doc_ids"] = torch.from_numpy(docs)
        else:
            inputs["attention_mask"] = torch.from_numpy((docs >= 0).astype(np.int64))
        targets = {"labels": torch.from_numpy(labels), "segments": torch.from_numpy(segments)}
        if "ref" in items[0]:
            targets["ref"] = torch.from_numpy(np.stack([np.asarray(it["ref"], np.float64) for it in items]))
        return inputs, targets


def load_preference(dc: Any, pc: Any, block_size: int) -> tuple[PairSet, PairSet, PairCollator, dict[str, Any]]:
    """(train pairs, validation pairs, their collator, facts: notes, vocab_size, max_token_id) of ``dc``."""
    train, val, tok = load_pairs(dc, pc, block_size)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    sets = PairSet(train), PairSet(val)
    layout = ("packed: [prompt + chosen | prompt + rejected] per row, attention kept within each" if dc.packed
              else "concatenated: the chosen rows, then the rejected rows, of one forward")
    notes = [train.describe("train"), val.describe("val"), f"data: preference pairs {layout}"]
    max_id = max(int(a.max()) for p in (train, val) for arrays in (p.prompts, p.chosen, p.rejected)
                 for a in arrays if len(a))
    return (*sets, PairCollator(pad_id, pack=dc.packed),
            {"notes": notes, "vocab_size": len(tok), "max_token_id": max(max_id, pad_id)})
