"""CIFAR-10 from the standard *python* files (``cifar-10-batches-py``), read without trusting pickle.

The official files are pickles of ``{b"data": uint8 array (N, 3072), b"labels": [int], ...}``.
Unpickling can call any importable function, so a tampered file could run code on every rank.
``_ArrayOnlyUnpickler`` resolves only the few globals a numpy array needs and refuses the rest.
"""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from shardwise.errors import ConfigError

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
SUBFOLDER = "cifar-10-batches-py"  # what the official cifar-10-python.tar.gz extracts to
NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
# Per-channel statistics of the CIFAR-10 training set (the values torchvision examples use).
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class CIFAR10(Dataset):
    """Images kept as uint8 (150 MB for the full train set, 4x less than float); item = (x, label).

    ``x`` is a float tensor (3, 32, 32) normalised with ``CIFAR_MEAN``/``CIFAR_STD``; ``label`` a
    0-d long tensor.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images = images
        self.labels = labels
        self.mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = (self.images[i].float() / 255.0 - self.mean) / self.std
        return x, self.labels[i]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise ConfigError("reading the CIFAR-10 python files needs numpy (they contain numpy arrays). "
                          "Install it with `pip install numpy`.") from None
    return numpy


def _allowed_globals() -> dict[tuple[str, str], Any]:
    np = _numpy()
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core to numpy._core
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    # The official files (and numpy 1) name numpy.core; numpy 2 writes numpy._core. Both resolve
    # to the installed numpy's function, so neither needs the deprecated numpy.core shim.
    for mod in ("numpy.core", "numpy._core"):
        allowed[(f"{mod}.multiarray", "_reconstruct")] = core.multiarray._reconstruct
        allowed[(f"{mod}.numeric", "_frombuffer")] = core.numeric._frombuffer  # pickle protocol 5
    return allowed


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """An Unpickler that can rebuild numpy arrays, lists, dicts, str/bytes and numbers, and nothing else."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file, encoding="bytes")  # the official files were written by Python 2
        self.path = path
        self.allowed = _allowed_globals()
        self.allowed[("_codecs", "encode")] = self.allowed[("codecs", "encode")] = self._latin1_encode

    def _latin1_encode(self, text: str, encoding: str = "utf-8") -> bytes:
        # Protocol-2 pickles written by Python 3 store bytes as codecs.encode(text, "latin1"). Only
        # that use is allowed: other codecs (zlib, bz2, ...) have no business in an array pickle.
        if encoding.lower().replace("_", "-") not in ("latin1", "latin-1"):
            raise ConfigError(f"{str(self.path)!r} asks for codecs.encode(..., {encoding!r}) while unpickling; "
                              "only latin1 appears in CIFAR-10 batches, so shardwise refused it.")
        return codecs.encode(text, "latin1")

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise ConfigError(
                f"{str(self.path)!r} asks to load {module}.{name} while unpickling; a CIFAR-10 batch only "
                "contains numpy arrays, lists and strings, so shardwise refused it (a pickle can run "
                "arbitrary code). Re-download the official CIFAR-10 python version from "
                "https://www.cs.toronto.edu/~kriz/cifar.html."
            ) from None


def _read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (images uint8 (N, 3, 32, 32), labels long (N,)) of one batch file."""
    np = _numpy()
    try:
        with path.open("rb") as f:
            obj = _ArrayOnlyUnpickler(f, path).load()
    except ConfigError:
        raise
    except Exception as e:  # damaged bytes can raise almost any exception inside the pickle machine
        raise ConfigError(
            f"cannot read CIFAR-10 batch {str(path)!r}: it is truncated or corrupt ({type(e).__name__}: {e}). "
            "Expected a pickle from the official CIFAR-10 python version; re-download and extract it."
        ) from None
    expected = ("Expected a dict with b'data' (uint8 array of shape (N, 3072)) and b'labels' "
                "(N ints in 0..9), as in the official CIFAR-10 python version.")
    if not isinstance(obj, dict):
        raise ConfigError(f"CIFAR-10 batch {str(path)!r} holds a {type(obj).__name__}, not a dict. {expected}")
    # Python-2 pickles give bytes keys, Python-3 ones str keys: accept both.
    entries = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}
    if "data" not in entries or "labels" not in entries:
        found = ", ".join(sorted(map(str, entries))) or "none"
        hint = " (fine_labels: this looks like CIFAR-100)" if "fine_labels" in entries else ""
        raise ConfigError(f"CIFAR-10 batch {str(path)!r} has keys {found}{hint}. {expected}")
    data, labels = entries["data"], entries["labels"]
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[1] == 3 * 32 * 32):
        got = f"{data.dtype} array of shape {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ConfigError(f"CIFAR-10 batch {str(path)!r}: 'data' is a {got}. {expected}")
    try:
        label_t = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    except (TypeError, ValueError):
        label_t = None
    if label_t is None or label_t.shape != (data.shape[0],) or not bool(
            ((label_t >= 0) & (label_t < NUM_CLASSES)).all()):
        raise ConfigError(f"CIFAR-10 batch {str(path)!r}: 'labels' is not {data.shape[0]} ints in 0..9. {expected}")
    # Rows are three 32x32 planes (all R, then G, then B), row-major: a reshape gives (N, C, H, W).
    images = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, *IMAGE_SHAPE).copy())
    return images, label_t


def _batch_folder(path: str) -> Path:
    root = Path(path).expanduser()
    if root.is_file() and root.name.endswith((".tar.gz", ".tgz")):
        raise ConfigError(f"data.path {str(root)!r} is the CIFAR-10 archive; extract it first "
                          f"(tar xzf {root.name}) and point data.path at the folder it creates ({SUBFOLDER}).")
    if not root.is_dir():
        raise ConfigError(f"CIFAR-10 folder {str(root)!r} does not exist. Set data.path to the folder holding "
                          f"the python batches ({SUBFOLDER}, or its parent).")
    nested = root / SUBFOLDER
    return nested if nested.is_dir() and not (root / TEST_FILE).exists() else root


def load_cifar10(path: str) -> tuple[CIFAR10, CIFAR10]:
    """Return (train, val) from the CIFAR-10 python batches in ``path`` (or ``path/cifar-10-batches-py``).

    Train is every ``data_batch_<i>`` present (all five in the official release), val is ``test_batch``.
    """
    folder = _batch_folder(path)
    train_files = [folder / name for name in TRAIN_FILES if (folder / name).is_file()]
    test_file = folder / TEST_FILE
    if not train_files or not test_file.is_file():
        missing = "no data_batch_<i> file" if not train_files else f"no {TEST_FILE}"
        raise ConfigError(
            f"CIFAR-10 folder {str(folder)!r} has {missing}. Expected the python version's files "
            f"{', '.join(TRAIN_FILES)} and {TEST_FILE} there (download cifar-10-python.tar.gz from "
            "https://www.cs.toronto.edu/~kriz/cifar.html and extract it)."
        )
    parts = [_read_batch(f) for f in train_files]
    train = CIFAR10(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    val = CIFAR10(*_read_batch(test_file))
    return train, val


def write_fake_cifar10(folder: str | Path, n_per_batch: int = 256, n_test: int = 256, n_batches: int = 5,
                       seed: int = 0) -> Path:
    """Write random CIFAR-10-format batches (same pickle layout as the official files); return the folder.

    Each class has its own colour tint on top of noise, so a model can learn the fake data: demos
    and tests then see a falling loss, not just a running loop.
    """
    np = _numpy()
    if not 1 <= n_batches <= len(TRAIN_FILES):
        raise ValueError(f"n_batches must be in 1..{len(TRAIN_FILES)}, got {n_batches}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tints = rng.integers(0, 256, size=(NUM_CLASSES, 3), dtype=np.int64)

    def batch(n: int, label: bytes) -> dict[bytes, Any]:
        labels = rng.integers(0, NUM_CLASSES, size=n)
        noise = rng.integers(-64, 64, size=(n, 3, 32 * 32))
        data = np.clip(tints[labels][:, :, None] + noise, 0, 255).astype(np.uint8).reshape(n, 3 * 32 * 32)
        return {b"batch_label": label, b"labels": [int(v) for v in labels], b"data": data,
                b"filenames": [f"fake_{i:05d}.png".encode() for i in range(n)]}

    files = {name: batch(n_per_batch, f"training batch {i + 1} of 5".encode())
             for i, name in enumerate(TRAIN_FILES[:n_batches])}
    files[TEST_FILE] = batch(n_test, b"testing batch 1 of 1")
    for name, content in files.items():
        with (out / name).open("wb") as f:
            pickle.dump(content, f, protocol=2)  # what the official Python-2 files use
    return out
