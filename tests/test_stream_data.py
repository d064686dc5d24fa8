"""IterableDataset streams and dict batches through ShardedLoader / session.dataloader.

drop_last semantics: a stream of N items read by R ranks with batch B is cut into windows of R*B
items; each rank keeps its B items of every full window, and the items after the last full window
(N mod R*B of them) are dropped on every rank. So one epoch covers exactly the first
(N // (R*B)) * R*B items of the stream, each on exactly one rank, and every rank gets N // (R*B)
batches.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset

from shardwise.errors import ConfigError
from shardwise.runtime import data as data_module
from shardwise.runtime.data import ShardedLoader, StreamShard
from shardwise.testing import run_distributed
from tests.helpers.streams import Counting, DictRange, dict_collate, stream_rank


def _ids(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_stream_ranks_get_disjoint_equal_shares_of_every_window():
    loaders = [ShardedLoader(Counting(103), 4, num_replicas=3, rank=r) for r in range(3)]
    epochs = [_ids(loader) for loader in loaders]
    assert [len(e) for e in epochs] == [8, 8, 8]  # 103 // 12 full windows on every rank
    seen = sorted(i for e in epochs for batch in e for i in batch)
    assert seen == list(range(96))  # disjoint and complete; the last 103 - 96 items are dropped
    # Window k holds items 12k..12k+11; rank r takes its 4 of them.
    assert epochs[1][2] == [28, 29, 30, 31]


class _Items(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        yield from range(self.n)


def _rank_batches(n: int, replicas: int, rank: int, batch: int, workers: int, start: int) -> list[list[int]]:
    """What the DataLoader hands rank ``rank``: one batch from each worker in turn, as it does."""
    shard = StreamShard(_Items(n), batch, replicas, rank)
    shard.start_window = start
    per_worker = []
    for w in range(workers):
        info = SimpleNamespace(num_workers=workers, id=w)
        original = data_module.get_worker_info
        data_module.get_worker_info = lambda info=info: info
        try:
            items = list(shard)
        finally:
            data_module.get_worker_info = original
        per_worker.append([items[i:i + batch] for i in range(0, len(items), batch)])
    merged, k = [], 0
    while any(k < len(b) for b in per_worker):
        merged += [b[k] for b in per_worker if k < len(b)]
        k += 1
    return merged


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 120), replicas=st.integers(1, 4), batch=st.integers(1, 5),
       workers=st.integers(1, 3), start=st.integers(0, 4))
def test_stream_shard_property_disjoint_complete_equal_and_ordered(n, replicas, batch, workers, start):
    """For any stream length, rank count, batch, worker count and resume point: every full window
    from ``start`` on is split over the ranks without overlap or loss, in stream order, and all
    ranks get the same number of batches."""
    window = batch * replicas
    full = n // window
    per_rank = [_rank_batches(n, replicas, r, batch, workers, start) for r in range(replicas)]
    assert {len(b) for b in per_rank} == {max(0, full - start)}
    for r, batches in enumerate(per_rank):
        for k, b in enumerate(batches):  # batch k of rank r is its slice of window start + k
            first = (start + k) * window + r * batch
            assert b == list(range(first, first + batch))
    seen = sorted(i for b in per_rank for batch_ in b for i in batch_)
    assert seen == list(range(min(start, full) * window, full * window))


def test_stream_workers_keep_the_order_of_no_workers():
    plain = _ids(ShardedLoader(Counting(70), 3, num_replicas=2, rank=1))
    with_workers = _ids(ShardedLoader(Counting(70), 3, num_replicas=2, rank=1, num_workers=2))
    assert with_workers == plain and len(plain) == 70 // 6


def test_stream_resume_mid_epoch_skips_consumed_items_and_keeps_epochs():
    full = ShardedLoader(Counting(64), 4, num_replicas=2, rank=0)
    it = iter(full)
    head = [next(it).tolist() for _ in range(3)]
    state = full.state_dict()
    assert state["samples_consumed"] == 3 * 4 * 2 and state["batch_in_epoch"] == 3
    tail = [b.tolist() for b in it]
    resumed = ShardedLoader(Counting(64), 4, num_replicas=2, rank=0)
    resumed.load_state_dict(state)
    assert _ids(resumed) == tail and len(head) + len(tail) == 8
    # The dataset's set_epoch sees each epoch, so a stream can reshuffle itself per epoch.
    assert resumed.epoch == 1 and _ids(resumed)[0] == [64 * 1 + 0, 65, 66, 67]


def test_stream_resume_on_another_rank_count_continues_the_global_order():
    two = [ShardedLoader(Counting(48), 4, num_replicas=2, rank=r) for r in range(2)]
    its = [iter(loader) for loader in two]
    for it in its:
        next(it)
        next(it)
    one = ShardedLoader(Counting(48), 8, num_replicas=1, rank=0)
    one.load_state_dict(two[0].state_dict())
    assert sorted(i for b in _ids(one) for i in b) == list(range(16, 48))


def test_stream_misuse_is_refused_clearly():
    with pytest.raises(ConfigError, match="shuffle=True was asked for an IterableDataset"):
        ShardedLoader(Counting(10), 2, num_replicas=1, rank=0, shuffle=True)
    short = ShardedLoader(Counting(5), 4, num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match=r"fewer items than one global batch \(2 ranks x batch 4 = 8\)"):
        next(short.forever())
    with pytest.raises(TypeError, match="no length"):
        len(short)

    def generator():
        yield from range(3)

    with pytest.raises(ConfigError, match="neither a map-style dataset.*nor a torch.utils.data.IterableDataset"):
        ShardedLoader(generator(), 2, num_replicas=1, rank=0)


def test_hf_datasets_stream_with_workers_is_refused():
    class FakeHFStream(IterableDataset):
        def __iter__(self):
            yield from range(8)

    FakeHFStream.__module__ = "datasets.iterable_dataset"
    with pytest.raises(ConfigError, match="splits itself across DataLoader workers"):
        ShardedLoader(FakeHFStream(), 2, num_replicas=1, rank=0, num_workers=2)
    assert len(_ids(ShardedLoader(FakeHFStream(), 2, num_replicas=1, rank=0))) == 4


def test_dict_items_are_stacked_by_default_and_collate_fn_is_used():
    default = next(iter(ShardedLoader(DictRange(16, 5), 4, num_replicas=1, rank=0, shuffle=False)))
    assert set(default) == {"input_ids", "labels", "attention_mask"}
    assert default["input_ids"].shape == (4, 5) and default["attention_mask"].dtype == torch.long
    custom = next(iter(ShardedLoader(DictRange(16, 5), 4, num_replicas=1, rank=0, shuffle=False,
                                     collate_fn=dict_collate)))
    assert custom["labels"][:, -1].eq(-100).all()  # the collate_fn's own padding marker
    assert torch.equal(custom["input_ids"], default["input_ids"])


def test_two_ranks_stream_and_dict_batches_through_session_dataloader():
    """On 2 real ranks: a stream and a map-style dict dataset with a user collate_fn."""
    r0, r1 = run_distributed(stream_rank, 2, timeout_s=240, items=53, batch=3)
    # Stream: 53 items, windows of 6 -> 8 batches per rank, items 0..47 exactly once.
    assert len(r0["stream"]) == len(r1["stream"]) == 8
    seen = [i for r in (r0, r1) for batch in r["stream"] for i in batch]
    assert sorted(seen) == list(range(48))
    # Resumed after 5 batches (another session, as after a restart): exactly the rest.
    assert r0["resumed"] == r0["stream"][5:] and r1["resumed"] == r1["stream"][5:]
    # Dict batches: disjoint rank shares covering every full global batch of the epoch.
    dict_rows = [row for r in (r0, r1) for row in r["dict_rows"]]
    assert len(dict_rows) == len(set(dict_rows)) == 40 // 6 * 6
    assert r0["dict_keys"] == ["attention_mask", "input_ids", "labels"] and r0["on_device"]


def test_builtin_trainer_takes_a_stream_from_a_data_factory(tmp_path, capsys):
    """`shardwise train` with data.factory returning an IterableDataset: it trains, crosses an
    epoch, and its checkpoint records the stream position."""
    from shardwise.cli import main
    from shardwise.runtime.checkpoint.manifest import read_manifest
    from tests.helpers.ckpt import cli_args, losses

    out = tmp_path / "run"
    overrides = ["model.preset=nano", "data.kind=custom", 'data.factory="tests.helpers.streams:char_stream_datasets"',
                 "train.steps=14", "train.micro_batch_size=16", "train.eval_every=0", "train.eval_batches=2",
                 "train.sample_tokens=0", "train.progress=false", "train.log_every=1"]
    assert main(["train", "--nproc", "1", "--strategy", "single", "--out", str(out), *cli_args(overrides)]) == 0
    assert sorted(losses(out)) == list(range(1, 15))
    # 200 windows in batches of 16: 12 per epoch, so step 14 is the 2nd batch of epoch 1.
    data = read_manifest(out / "checkpoints" / "step-00000014")["data"]
    assert (data["epoch"], data["batch_in_epoch"], data["samples_consumed"]) == (1, 2, 32)
