import pytest
import torch

from shardwise.data.shakespeare import load_shakespeare
from shardwise.errors import ConfigError
from shardwise.runtime.data import ShardedLoader, ShardedSampler


class Range(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def _epoch(loader):
    return [int(i) for batch in loader for i in batch]


def test_ranks_see_disjoint_equal_slices_covering_global_batches():
    loaders = [ShardedLoader(Range(103), 4, num_replicas=3, rank=r, seed=1) for r in range(3)]
    epochs = [_epoch(loader) for loader in loaders]
    assert len({len(e) for e in epochs}) == 1  # same number of batches on every rank
    assert len(epochs[0]) == 103 // 12 * 4  # tail dropped so every batch is full
    seen = [i for e in epochs for i in e]
    assert len(seen) == len(set(seen))  # disjoint


def test_epoch_advances_by_itself_and_reshuffles():
    loader = ShardedLoader(Range(64), 8, num_replicas=2, rank=0, seed=3)
    first, second = _epoch(loader), _epoch(loader)
    assert loader.epoch == 2
    assert first != second and sorted(first) != sorted(range(64))
    # Deterministic: a fresh loader replays the same epochs.
    again = ShardedLoader(Range(64), 8, num_replicas=2, rank=0, seed=3)
    assert _epoch(again) == first and _epoch(again) == second


def test_global_batch_is_the_same_for_any_rank_count():
    """2 ranks x 4 see exactly the samples 1 rank x 8 sees, batch for batch."""
    one = ShardedLoader(Range(80), 8, num_replicas=1, rank=0, seed=5)
    two = [ShardedLoader(Range(80), 4, num_replicas=2, rank=r, seed=5) for r in range(2)]
    for big, a, b in zip(one, *two):
        assert sorted(big.tolist()) == sorted(a.tolist() + b.tolist())


def test_mid_epoch_position_resumes_without_replay_or_skip():
    full = ShardedLoader(Range(96), 4, num_replicas=2, rank=1, seed=9)
    it = iter(full)
    consumed = [next(it).tolist() for _ in range(5)]
    state = full.state_dict()
    rest = [b.tolist() for b in it]
    resumed = ShardedLoader(Range(96), 4, num_replicas=2, rank=1, seed=9)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest
    assert len(consumed) + len(rest) == len(full)


def test_resume_on_other_rank_count_keeps_global_order():
    saved = ShardedLoader(Range(96), 4, num_replicas=2, rank=0, seed=2)
    it = iter(saved)
    for _ in range(3):
        next(it)
    one = ShardedLoader(Range(96), 8, num_replicas=1, rank=0, seed=2)
    one.load_state_dict(saved.state_dict())
    reference = ShardedLoader(Range(96), 8, num_replicas=1, rank=0, seed=2)
    assert [b.tolist() for b in one] == [b.tolist() for b in reference][3:]


def test_resume_with_other_global_batch_is_refused():
    saved = ShardedLoader(Range(96), 4, num_replicas=2, rank=0, seed=2)
    it = iter(saved)
    next(it)
    other = ShardedLoader(Range(96), 3, num_replicas=1, rank=0, seed=2)
    with pytest.raises(ValueError, match="global batch"):
        other.load_state_dict(saved.state_dict())


def test_sampler_rejects_bad_rank():
    with pytest.raises(ValueError):
        ShardedSampler(10, 2, 2, 1)


def test_shakespeare_bundled_and_missing(tmp_path):
    train, val, tok = load_shakespeare("", 32, 0.1)
    assert tok.vocab_size == 65 and len(train) > len(val) > 0
    x, y = train[3]
    assert torch.equal(x[1:], y[:-1])
    with pytest.raises(ConfigError, match="does not exist"):
        load_shakespeare(str(tmp_path / "missing.txt"), 32, 0.1)


def test_dataset_smaller_than_one_batch_per_rank_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"fewer than one batch per data-parallel rank \(2 ranks x micro-batch 4\)"):
        ShardedLoader(Range(7), 4, num_replicas=2, rank=0)
