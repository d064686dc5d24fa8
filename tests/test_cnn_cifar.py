import os
import pickle

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardwise.core.config import DataConfig, ModelConfig, load_config
from shardwise.data.cifar import CIFAR_MEAN, CIFAR_STD, load_cifar10, write_fake_cifar10
from shardwise.errors import ConfigError
from shardwise.models.cnn import build_cnn, cnn_config, cnn_flops_per_sample, cnn_param_count
from shardwise.workloads import build_workload

np = pytest.importorskip("numpy")

SMALL = {"channels": 8, "hidden": 16}


def test_cnn_shapes_and_param_count():
    model = build_cnn(**SMALL, num_classes=7)
    assert model(torch.randn(5, 3, 32, 32)).shape == (5, 7)
    for overrides in ({}, SMALL):
        assert sum(p.numel() for p in build_cnn(**overrides).parameters()) == cnn_param_count(cnn_config(**overrides))
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in build_cnn().modules())


def test_cnn_flops_match_torch_flop_counter():
    cfg = cnn_config(**SMALL)
    with FlopCounterMode(display=False) as counter:
        build_cnn(**SMALL)(torch.randn(1, 3, 32, 32))
    # Our estimate is for training (3 x forward); the counter saw one forward of one image.
    assert cnn_flops_per_sample(cfg) == pytest.approx(3 * counter.get_total_flops())


def test_cnn_init_is_deterministic_from_torch_rng():
    torch.manual_seed(3)
    a = build_cnn(**SMALL)
    torch.manual_seed(3)
    b = build_cnn(**SMALL)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_cnn_override_validation():
    with pytest.raises(ConfigError, match="'chanels'.*Did you mean 'channels'.*Valid: channels, hidden"):
        build_cnn(chanels=16)
    with pytest.raises(ConfigError, match="positive integer"):
        build_cnn(hidden=0)
    with pytest.raises(ConfigError, match="groups=8 must divide channels=12"):
        build_cnn(channels=12)


def _raw_batch(path):
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")  # our own test file: trusted


def test_fake_cifar_round_trip(tmp_path):
    folder = write_fake_cifar10(tmp_path / "c", n_per_batch=20, n_test=10, n_batches=2, seed=1)
    assert sorted(p.name for p in folder.iterdir()) == ["data_batch_1", "data_batch_2", "test_batch"]
    train, val = load_cifar10(str(folder))
    assert (len(train), len(val)) == (40, 10)
    x, y = train[25]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.long and y.shape == ()
    raw = _raw_batch(folder / "data_batch_2")
    assert set(raw) >= {b"data", b"labels"} and raw[b"data"].dtype == np.uint8
    assert int(y) == raw[b"labels"][5]
    # Undo the normalisation: the pixel values of the file come back (planes R, G, B, row-major).
    mean, std = torch.tensor(CIFAR_MEAN).view(3, 1, 1), torch.tensor(CIFAR_STD).view(3, 1, 1)
    pixels = (x * std + mean) * 255
    expected = torch.from_numpy(raw[b"data"][5].reshape(3, 32, 32).astype("float32"))
    assert torch.allclose(pixels, expected, atol=1e-3)
    assert val.labels.tolist() == _raw_batch(folder / "test_batch")[b"labels"]


def test_accepts_parent_folder_and_other_pickle_layouts(tmp_path):
    folder = write_fake_cifar10(tmp_path / "cifar-10-batches-py", n_per_batch=4, n_test=4, n_batches=1)
    # The official files were written by numpy 1 (module numpy.core); ours name numpy._core.
    data = (folder / "data_batch_1").read_bytes()
    assert b"numpy._core.multiarray" in data
    (folder / "data_batch_1").write_bytes(data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    # A re-pickled file with str keys and protocol 5 (numpy's out-of-band _frombuffer path) also loads.
    raw = {k.decode(): v for k, v in _raw_batch(folder / "test_batch").items()}
    (folder / "test_batch").write_bytes(pickle.dumps(raw, protocol=5))
    train, val = load_cifar10(str(tmp_path))
    assert (len(train), len(val)) == (4, 4)
    assert val.labels.tolist() == raw["labels"]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_pickle_is_refused_and_not_run(tmp_path):
    folder = write_fake_cifar10(tmp_path, n_per_batch=4, n_test=4, n_batches=1)
    marker = tmp_path / "pwned"
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": _Evil(marker), b"labels": []}, protocol=2))
    with pytest.raises(ConfigError, match=r"system.*refused"):
        load_cifar10(str(folder))
    assert not marker.exists()


def test_only_latin1_codec_is_allowed(tmp_path):
    folder = write_fake_cifar10(tmp_path, n_per_batch=4, n_test=4, n_batches=1)
    # A hand-made pickle calling _codecs.encode with another codec: GLOBAL, args tuple, REDUCE.
    payload = b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x04\x00\x00\x00zlib\x86R."
    (folder / "data_batch_1").write_bytes(payload)
    with pytest.raises(ConfigError, match="zlib.*refused"):
        load_cifar10(str(folder))


def test_truncated_file(tmp_path):
    folder = write_fake_cifar10(tmp_path, n_per_batch=8, n_test=4, n_batches=1)
    data = (folder / "data_batch_1").read_bytes()
    (folder / "data_batch_1").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="data_batch_1.*truncated or corrupt"):
        load_cifar10(str(folder))


def test_missing_folder_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_cifar10(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no data_batch.*data_batch_1, data_batch_2.*test_batch"):
        load_cifar10(str(tmp_path))
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(b"")
    with pytest.raises(ConfigError, match="extract it first"):
        load_cifar10(str(archive))


@pytest.mark.parametrize("content, match", [
    ({b"images": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, "has keys images, labels"),
    ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, r"uint8 array of shape \(2, 100\)"),
    ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "float32"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "not 2 ints in 0..9"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "not 2 ints in 0..9"),
    ([1, 2, 3], "holds a list, not a dict"),
])
def test_wrong_keys_and_shapes(tmp_path, content, match):
    folder = write_fake_cifar10(tmp_path, n_per_batch=2, n_test=2, n_batches=1)
    (folder / "test_batch").write_bytes(pickle.dumps(content, protocol=2))
    with pytest.raises(ConfigError, match=match):
        load_cifar10(str(folder))


def test_cnn_cifar_workload_trains(tmp_path):
    folder = write_fake_cifar10(tmp_path, n_per_batch=32, n_test=16, n_batches=1)
    work = build_workload(ModelConfig(kind="cnn", overrides=SMALL), DataConfig(kind="cifar10", path=str(folder)))
    assert (work.family, work.tokens_per_sample, len(work.train_set), len(work.val_set)) == ("cnn", 1, 32, 16)
    torch.manual_seed(0)
    model = work.build_model()
    x, y = next(iter(torch.utils.data.DataLoader(work.train_set, batch_size=16)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(8):
        loss = work.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_cifar_workload_needs_a_path():
    with pytest.raises(ConfigError, match="needs data.path"):
        build_workload(ModelConfig(kind="cnn"), DataConfig(kind="cifar10"))


def test_recipe_loads():
    cfg = load_config("cnn-cifar10", ["data.path=/data/cifar"])
    assert (cfg.model.kind, cfg.data.kind, cfg.data.path, cfg.train.micro_batch_size) == ("cnn", "cifar10",
                                                                                          "/data/cifar", 64)
    cnn_config(**cfg.model.overrides)  # the recipe's overrides are valid
