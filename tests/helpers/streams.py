"""Streams and dict datasets for the IterableDataset / dict-batch tests (spawned ranks import these)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset


class Counting(IterableDataset):
    """Yields ``epoch * n``, ..., ``epoch * n + n - 1`` as 0-d tensors; ``set_epoch`` moves the range.

    Deterministic, like every stream shardwise shards: each rank and worker reads the same items.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        base = self.epoch * self.n
        for i in range(self.n):
            yield torch.tensor(base + i)


class DictRange(Dataset):
    """Item ``i``: ``{"input_ids", "labels", "attention_mask"}`` of length ``seq``, ids starting at ``i*seq``."""

    def __init__(self, n: int, seq: int) -> None:
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i * self.seq, (i + 1) * self.seq)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(self.seq, dtype=torch.long)}


def dict_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A user collate_fn as for a causal LM: stack, then mask the last label of each row with -100."""
    batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    batch["labels"] = batch["labels"].clone()
    batch["labels"][:, -1] = -100
    return batch


def stream_rank(rank: int, world_size: int, items: int, batch: int) -> dict[str, Any]:
    """One rank: a stream through session.dataloader, a resume, and dict batches.

    (The harness's ranks are daemon processes, which cannot start DataLoader workers; the worker
    split is tested in one process, see test_stream_workers_keep_the_order_of_no_workers.)
    """
    from shardwise import Session

    with Session(seed=0) as session:
        loader = session.dataloader(Counting(items), batch_size=batch)
        stream = []
        for i, b in enumerate(loader):
            stream.append(b.tolist())
            if i == 4:
                state = loader.state_dict()
        resumed_loader = session.dataloader(Counting(items), batch_size=batch)
        resumed_loader.load_state_dict(state)
        resumed = [b.tolist() for b in resumed_loader]

        dict_loader = session.dataloader(DictRange(40, 4), batch_size=batch, collate_fn=dict_collate)
        dict_rows, keys, on_device = [], [], True
        for b in dict_loader:
            b = session.to_device(b)
            keys = sorted(b)
            on_device &= all(t.device.type == session.device.type for t in b.values())
            dict_rows += [int(row[0]) // 4 for row in b["input_ids"]]
    return {"stream": stream, "resumed": resumed, "dict_rows": dict_rows, "dict_keys": keys,
            "on_device": on_device}


class CharStream(IterableDataset):
    """(x, y) windows of a character corpus as a stream: a ``data.factory`` train set for the trainer."""

    def __init__(self, windows: Dataset) -> None:
        self.windows = windows

    def __iter__(self):
        for i in range(len(self.windows)):  # type: ignore[arg-type]
            yield self.windows[i]


def char_stream_datasets() -> tuple[Dataset, Dataset]:
    """data.factory: a streamed training set and a map-style validation set of Shakespeare windows."""
    from shardwise.data.shakespeare import load_shakespeare

    train, val, _ = load_shakespeare("", 32, 0.5)
    small_train = torch.utils.data.Subset(train, range(200))
    return CharStream(small_train), val
