"""A data loader for data-parallel ranks whose epoch and position are handled for the user.

The classic bug is forgetting ``sampler.set_epoch(epoch)``: every epoch then replays the same
order. ``ShardedLoader`` owns its epoch counter and sets it on every ``iter()``, so that bug cannot
happen. It also knows how many batches of the current epoch were consumed, which is what a
mid-epoch checkpoint needs to resume without replaying or skipping samples.

Map-style datasets (``len`` + ``getitem``) are split by ``ShardedSampler``. An ``IterableDataset``
(a stream) has no indices to split, so ``StreamShard`` cuts the stream into global-batch windows
of ``batch_size x ranks`` items and each rank keeps its own slice of every window (the scheme of
Accelerate's ``IterableDatasetShard(drop_last=True)``): no item goes to two ranks, and every rank
gets the same number of batches, so no rank leaves a collective waiting for a batch that never comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info

from shardwise.errors import ConfigError


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


class StreamShard(IterableDataset):
    """This rank's share of a stream: its ``batch_size`` items of every window of ``batch_size x ranks``.

    Item ``k`` of the stream is in window ``k // (batch_size * num_replicas)``; rank ``r`` keeps the
    window's items ``r * batch_size`` to ``(r + 1) * batch_size - 1``. A last window that is not full
    is dropped on every rank (drop_last), so all ranks yield the same number of batches. Windows
    before ``start_window`` (consumed before a checkpoint) are read and skipped.

    Under DataLoader workers, worker ``w`` of ``W`` keeps windows ``start_window + w``,
    ``start_window + w + W``, ...: the DataLoader takes one batch from each worker in turn, so the
    batches still arrive in stream order. Every rank and every worker therefore reads the whole
    stream, which must yield the same items in the same order each time it is iterated.
    """

    def __init__(self, dataset: IterableDataset, batch_size: int, num_replicas: int, rank: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.start_window = 0

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        window = self.batch_size * self.num_replicas
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        mine: list[Any] = []
        for count, item in enumerate(self.dataset):
            index, pos = divmod(count, window)
            keep = index >= self.start_window and (index - self.start_window) % workers == worker
            if keep and lo <= pos < hi:
                mine.append(item)
            if pos == window - 1:
                # Only a complete window is handed out: a short last one is dropped on every rank.
                yield from mine
                mine = []


class ShardedLoader:
    """Iterable over this rank's batches; each ``iter()`` is the next epoch.

    ``dataset`` is map-style (a disjoint slice of a per-epoch permutation) or an ``IterableDataset``
    (a disjoint slice of every global-batch window of the stream, see ``StreamShard``; its
    ``set_epoch(epoch)`` is called before each epoch when it has one). ``state_dict()`` /
    ``load_state_dict()`` record the epoch and the number of batches consumed in it, so a resumed run
    continues with exactly the next unseen batch (a stream is re-read up to that point).
    ``collate_fn`` builds a batch from a list of items (default: ``default_collate``, which stacks
    tensors, tuples and dicts of tensors alike).
    """

    def __init__(self, dataset: Dataset, batch_size: int, num_replicas: int, rank: int,
                 shuffle: bool | None = None, seed: int = 0, num_workers: int = 0,
                 pin_memory: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.seed = seed
        self.is_stream = isinstance(dataset, IterableDataset)
        self.sampler: ShardedSampler | None = None
        self.stream: StreamShard | None = None
        if self.is_stream:
            if shuffle:
                raise ConfigError(
                    "shuffle=True was asked for an IterableDataset: a stream has no indices to "
                    "permute, so shardwise reads it in its own order. Shuffle inside the dataset "
                    "(seeded from the epoch its set_epoch(epoch) method receives) and leave shuffle unset."
                )
            _refuse_self_splitting_stream(dataset, num_workers)
            self.stream = StreamShard(dataset, batch_size, num_replicas, rank)  # type: ignore[arg-type]
            source: Dataset = self.stream
            loader_args: dict[str, Any] = {}
        else:
            if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
                raise ConfigError(
                    f"session.dataloader() got a {type(dataset).__name__}, which is neither a map-style "
                    "dataset (with __len__ and __getitem__) nor a torch.utils.data.IterableDataset; "
                    "wrap a generator in an IterableDataset subclass whose __iter__ yields the items."
                )
            n = len(dataset)  # type: ignore[arg-type]
            if n < num_replicas * batch_size:
                raise ConfigError(
                    f"the dataset has {n} samples, fewer than one batch per data-parallel rank "
                    f"({num_replicas} ranks x micro-batch {batch_size}); use a smaller "
                    "train.micro_batch_size, fewer ranks, or more data."
                )
            self.sampler = ShardedSampler(n, num_replicas, rank, batch_size,
                                          True if shuffle is None else shuffle, seed)
            source, loader_args = dataset, {"sampler": self.sampler}
        self.loader = DataLoader(source, batch_size=batch_size, drop_last=True, num_workers=num_workers,
                                 pin_memory=pin_memory, collate_fn=collate_fn, **loader_args)
        self.epoch = 0
        self.batch_in_epoch = 0
        self._resume_batch = 0

    def __len__(self) -> int:
        if self.sampler is None:
            raise TypeError("a loader over an IterableDataset has no length: the stream's end is "
                            "only known when it is reached")
        return self.sampler.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        start = self._resume_batch
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch, start)
        else:
            assert self.stream is not None
            self.stream.start_window = start
            set_epoch = getattr(self.dataset, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)  # before the DataLoader copies the dataset into its workers
        self.batch_in_epoch = start
        self._resume_batch = 0
        for batch in self.loader:
            self.batch_in_epoch += 1
            yield batch
        if self.stream is not None and start == 0 and self.batch_in_epoch == 0:
            # Without this, forever() would spin on an empty epoch.
            raise ConfigError(
                f"the IterableDataset yielded fewer items than one global batch ({self.num_replicas} "
                f"ranks x batch {self.batch_size} = {self.num_replicas * self.batch_size}) in epoch "
                f"{self.epoch}; use a smaller batch size, fewer ranks, or a longer stream."
            )
        self.epoch += 1
        self.batch_in_epoch = 0

    def forever(self) -> Iterator[Any]:
        """Yield batches across epoch boundaries without end (step-based training)."""
        while True:
            yield from self

    def state_dict(self) -> dict[str, int]:
        """Position of the next batch: its epoch, its index inside that epoch, and the samples consumed.

        For a stream the end of an epoch is only seen when the next batch is asked for, so a
        position at the very end of an epoch resumes by re-reading the stream and finding it spent.
        """
        epoch, batch = self.epoch, self.batch_in_epoch
        if self.sampler is not None and batch >= len(self):
            epoch, batch = epoch + 1, 0
        return {"epoch": epoch, "batch_in_epoch": batch, "batch_size": self.batch_size,
                "num_replicas": self.num_replicas, "seed": self.seed,
                # Items of this epoch's order (or stream) consumed by all ranks together.
                "samples_consumed": batch * self.batch_size * self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; on a different rank count, map the global position."""
        saved_global_batch = state["batch_size"] * state["num_replicas"]
        my_global_batch = self.batch_size * self.num_replicas
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


def _refuse_self_splitting_stream(dataset: Any, num_workers: int) -> None:
    """Refuse a stream that splits itself across DataLoader workers, where StreamShard splits too.

    Hugging Face ``datasets.IterableDataset`` gives each worker only some of its shards; StreamShard
    assumes every worker reads the whole stream, so the two together would silently drop data.
    """
    if num_workers > 0 and type(dataset).__module__.split(".")[0] == "datasets":
        raise ConfigError(
            f"a Hugging Face datasets {type(dataset).__name__} splits itself across DataLoader "
            "workers, and shardwise also splits the stream across workers: together they would drop "
            "data. Use num_workers=0 with it (its own reading is already parallel), or wrap it in a "
            "torch IterableDataset that yields the full stream in every worker."
        )
