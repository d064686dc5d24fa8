"""A data loader for data-parallel ranks whose epoch and position are handled for the user.

The classic bug is forgetting ``sampler.set_epoch(epoch)``: every epoch then replays the same
order. ``ShardedLoader`` owns its epoch counter and sets it on every ``iter()``, so that bug cannot
happen. It also knows how many batches of the current epoch were consumed, which is what a
mid-epoch checkpoint needs to resume without replaying or skipping samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ShardedSampler(Sampler[int]):
    """Deterministic per-epoch shuffle of the whole dataset, split into disjoint rank slices.

    Every rank draws the same permutation (seeded by ``seed + epoch``), drops the tail so the
    length divides ``num_replicas * batch_size`` (every rank then sees the same number of full
    batches, so no rank waits in a collective for a batch that never comes), and takes every
    ``num_replicas``-th index starting at ``rank``. ``start_batch`` skips batches already consumed.
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int, batch_size: int,
                 shuffle: bool = True, seed: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start_batch = 0
        self.batches_per_epoch = dataset_len // (num_replicas * batch_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch = epoch
        self.start_batch = start_batch

    def global_order(self) -> list[int]:
        """This epoch's order of every sample in the dataset (before splitting across ranks)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_len, generator=g).tolist()
        return list(range(self.dataset_len))

    def __iter__(self) -> Iterator[int]:
        used = self.batches_per_epoch * self.num_replicas * self.batch_size
        mine = self.global_order()[:used][self.rank :: self.num_replicas]
        return iter(mine[self.start_batch * self.batch_size :])

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


class ShardedLoader:
    """Iterable over this rank's batches; each ``iter()`` is the next epoch.

    ``state_dict()``/``load_state_dict()`` record the epoch and the number of batches consumed
    in it, so a resumed run continues with exactly the next unseen batch.
    """

    def __init__(self, dataset: Dataset, batch_size: int, num_replicas: int, rank: int,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        if n < num_replicas * batch_size:
            from shardwise.errors import ConfigError

            raise ConfigError(
                f"the dataset has {n} samples, fewer than one batch per data-parallel rank "
                f"({num_replicas} ranks x micro-batch {batch_size}); use a smaller "
                "train.micro_batch_size, fewer ranks, or more data."
            )
        self.sampler = ShardedSampler(n, num_replicas, rank, batch_size, shuffle, seed)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler,
                                 drop_last=True, num_workers=num_workers, pin_memory=pin_memory)
        self.epoch = 0
        self.batch_in_epoch = 0
        self._resume_batch = 0

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch, self._resume_batch)
        self.batch_in_epoch = self._resume_batch
        self._resume_batch = 0
        for batch in self.loader:
            self.batch_in_epoch += 1
            yield batch
        self.epoch += 1
        self.batch_in_epoch = 0

    def forever(self) -> Iterator[Any]:
        """Yield batches across epoch boundaries without end (step-based training)."""
        while True:
            yield from self

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch: its epoch and its index inside that epoch."""
        epoch, batch = self.epoch, self.batch_in_epoch
        if batch >= len(self):
            epoch, batch = epoch + 1, 0
        return {"epoch": epoch, "batch_in_epoch": batch, "batch_size": self.sampler.batch_size,
                "num_replicas": self.sampler.num_replicas, "seed": self.sampler.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; on a different rank count, map the global position."""
        saved_global_batch = state["batch_size"] * state["num_replicas"]
        my_global_batch = self.sampler.batch_size * self.sampler.num_replicas
        consumed = state["batch_in_epoch"] * saved_global_batch
        if consumed % my_global_batch:
            raise ValueError(
                f"cannot resume mid-epoch: {consumed} samples were consumed, which is not a whole "
                f"number of global batches of {my_global_batch}; keep the global batch size "
                "(ranks x micro-batch) equal to the saved run's"
            )
        self.epoch = state["epoch"]
        self._resume_batch = consumed // my_global_batch
        self.batch_in_epoch = self._resume_batch


def split_sizes(total: int, val_fraction: float) -> tuple[int, int]:
    val = max(1, math.floor(total * val_fraction))
    return total - val, val
