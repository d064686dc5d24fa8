"""What DeepSpeed needs from the machine, checked before any rank starts.

DeepSpeed is an optional engine (``pip install shardwise[deepspeed]``). On a machine without a
CUDA device it runs on its CPU accelerator (``DS_ACCELERATOR=cpu``, set here before the first
import). Its ops (CPU Adam, async I/O for NVMe) are compiled just in time on first use, which
takes minutes: the build directory (``TORCH_EXTENSIONS_DIR``) defaults to a per-user cache keyed by
what a build depends on (``extensions_key``: DeepSpeed's version and install path, torch's version and path,
Python's, the compiler and its flags), so every later run of the same environment reuses its own
builds, and two environments (two virtual environments on one machine) never rebuild each other's.
NVMe offload (ZeRO-Infinity) needs Linux AIO (Debian: ``libaio-dev``)
to build its async I/O op and a writable ``parallel.nvme_path`` with room for the swapped state.
Each missing piece is one ConfigError paragraph here, never a JIT-build traceback on every rank.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from shardwise.errors import ConfigError
from shardwise.fsutil import atomic_write_json

# Swapped per parameter under ZeRO-Infinity with both offloads on NVMe: the fp32 master weight
# and AdamW's two moments (optimizer swapper), plus the parameter itself (parameter swapper),
# 4 bytes each; DeepSpeed aligns swap buffers, so 10% more room is asked for.
NVME_BYTES_PER_PARAM = 16
NVME_HEADROOM = 1.1
LIBAIO_HEADER = "/usr/include/libaio.h"


def deepspeed_identity() -> tuple[str, str]:
    """(version, install path) of the deepspeed package this interpreter imports, without importing it.

    The path is kept as the interpreter spells it, symlinks not followed: a JIT build writes that
    spelling into its compile command (``-I.../deepspeed/ops/csrc/includes``), and ninja rebuilds
    whenever the command changes, so two environments reaching one install through different
    paths (a worktree's ``.venv`` linked to another's) need their own folders.
    """
    spec = importlib.util.find_spec("deepspeed")
    path = os.path.abspath(Path(spec.origin).parent) if spec is not None and spec.origin else ""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = ""
    return version, path


# What a JIT build's result depends on beyond DeepSpeed and torch: the compiler and its flags.
BUILD_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS", "TORCH_CUDA_ARCH_LIST", "DS_ACCELERATOR", "CUDA_HOME")


def extensions_key() -> str:
    """The build cache's key: DeepSpeed's version and install path, torch's and Python's versions, the
    compiler flags. Two environments with any of them different build (and keep) their own ops."""
    import torch  # defers torch

    # torch's install path as spelled: its headers and libraries are in the compile and link commands.
    parts = [*deepspeed_identity(), torch.__version__, os.path.dirname(torch.__file__), sys.version.split()[0],
             sys.platform, *(f"{k}={os.environ.get(k, '')}" for k in BUILD_ENV)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def extensions_root() -> Path:
    """Where every environment's builds live: ``~/.cache/shardwise/torch_extensions`` (XDG_CACHE_HOME)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "shardwise" / "torch_extensions"


def prepare_environment() -> None:
    """Set the environment DeepSpeed reads at import time (callers' own values win)."""
    import torch  # defers torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_root() / extensions_key()))


def import_deepspeed() -> ModuleType:
    """Return the ``deepspeed`` module, or raise ConfigError saying how to install it."""
    prepare_environment()
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(
            f"the DeepSpeed strategies (zero3-offload, zero3-nvme, deepspeed) need the deepspeed package, "
            f"which is not importable here ({e}). Install it with `pip install 'shardwise[deepspeed]'` "
            "(NVMe offload also needs Linux AIO: `apt-get install libaio-dev` on Debian/Ubuntu), or "
            "choose a PyTorch strategy such as fsdp or fsdp-offload.") from None
    return deepspeed


# The ops the strategies load (CPU Adam for offload, async I/O for NVMe, shared-memory collectives
# and pinned buffers on the CPU accelerator); a name the accelerator does not offer is skipped.
JIT_OPS = ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder", "PinMemoryBuilder")
BUILD_LOCK = ".shardwise-build.lock"


@contextlib.contextmanager
def _build_guard(ops: list[str]) -> Iterator[None]:
    """Hold the cache's build lock; clear torch's build locks that a killed build left behind.

    torch marks a build in progress with a ``lock`` file in the op's folder and waits, forever,
    for it to go away; a build killed midway (a rank or a test run stopped) leaves it, and every
    later run hangs at its first DeepSpeed step. Every shardwise build runs under this flock,
    which the kernel drops when its holder dies, so a ``lock`` of these ops found while holding
    it belongs to no living build.
    """
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    with open(root / BUILD_LOCK, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            for name in ops:
                (root / name / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_ops() -> list[str]:
    """Compile (or load, once compiled) DeepSpeed's just-in-time ops, one process at a time.

    Each rank calls it before ``deepspeed.initialize``: the first compiles into the shared cache
    while the others wait, then they load the built library (DeepSpeed keeps the loaded module,
    so its own later load is free). ``scripts/test`` calls it once before the suite so that no
    test's timeout includes minutes of compiling. Returns the ops now loaded; the async I/O op is
    skipped where Linux AIO is missing (NVMe offload is then refused by ``check_libaio``).
    """
    prepare_environment()
    builders = _compatible_builders()
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    with _build_guard([b.NAME for b in builders]):
        for builder in builders:
            built = _built(root, builder.NAME)
            if not built:
                print(f"shardwise: building DeepSpeed's {builder.NAME} op for this environment into {root} "
                      f"({_last_build(builder.NAME)}); later runs reuse it", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            builder.load(verbose=False)
            if not built:
                _record_build(builder.NAME, time.perf_counter() - t0)
    return [b.NAME for b in builders]


def _compatible_builders() -> list:
    """DeepSpeed's builders of ``JIT_OPS`` that this machine can build (async I/O only with Linux AIO)."""
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator  # defers deepspeed (optional)

    builders = []
    for kind in JIT_OPS:
        builder = get_accelerator().create_op_builder(kind)
        if builder is None or (kind == "AsyncIOBuilder" and ctypes.util.find_library("aio") is None):
            continue
        if builder.is_compatible(verbose=False):
            builders.append(builder)
    return builders


BUILD_TIMES = "build_times.json"  # op -> seconds its last build took (any environment), in extensions_root()


def _built(root: Path, name: str) -> bool:
    """Whether torch's JIT cache in ``root`` already holds op ``name``'s library."""
    return any((root / name).glob(f"{name}*.so"))


def _last_build(name: str) -> str:
    try:
        seconds = json.loads((extensions_root() / BUILD_TIMES).read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        seconds = None
    if isinstance(seconds, (int, float)):
        return f"its last build took {seconds:.0f} s"
    return "a first build takes minutes"


def _record_build(name: str, seconds: float) -> None:
    path = extensions_root() / BUILD_TIMES
    try:
        times = json.loads(path.read_text())
        times = times if isinstance(times, dict) else {}
    except (OSError, ValueError):
        times = {}
    times[name] = round(seconds, 1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, times)
    except OSError:
        pass  # the next build says "a first build takes minutes" instead: nothing else depends on it


def check_deepspeed_installed() -> None:
    """Raise ConfigError when deepspeed is not installed, without importing it (fast)."""
    if importlib.util.find_spec("deepspeed") is None:
        import_deepspeed()  # raises the install message


def check_libaio() -> None:
    """Raise ConfigError when Linux AIO (needed to build DeepSpeed's async I/O op) is missing."""
    if ctypes.util.find_library("aio") is None or not os.path.exists(LIBAIO_HEADER):
        raise ConfigError(
            "NVMe offload (strategy zero3-nvme, or offload device \"nvme\" in a DeepSpeed config) needs "
            f"Linux AIO to build DeepSpeed's async I/O op, and libaio or its header ({LIBAIO_HEADER}) is "
            "missing. Install it with `apt-get install libaio-dev` (Debian/Ubuntu; `dnf install "
            "libaio-devel` on Fedora/RHEL), or use CPU offload (strategy zero3-offload or fsdp-offload).")


def check_nvme_path(path: str, params: int | None = None, *, create: bool = True) -> Path:
    """Check that ``path`` is a writable directory with room for ``params`` parameters' swap files.

    ``params``: the parameters whose swap files land on this node's disk (the model's count
    divided by the nodes, since ZeRO-3 partitions over every rank of the job). ``create``: make
    the directory when missing (each rank's engine does); the launcher's preflight passes False,
    so that a dry run writes nothing, and checks the nearest existing parent instead. Returns the
    absolute path.
    """
    if not path:
        raise ConfigError("strategy zero3-nvme swaps parameters and optimizer state to a fast local disk: "
                          "set parallel.nvme_path to a directory on it (e.g. --set parallel.nvme_path=/nvme/swap).")
    target = Path(path).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"parallel.nvme_path = {path!r} is a file, not a directory; name a directory on a "
                          "fast local disk (it is created when missing).")
    unwritable = ("NVMe offload writes its swap files there. Name a writable directory on a local disk with "
                  "room for the model's state.")
    if create:
        try:
            target.mkdir(parents=True, exist_ok=True)
            probe = target / f".shardwise-probe-{uuid.uuid4().hex[:8]}"
            probe.write_bytes(b"x" * 4096)
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"parallel.nvme_path = {path!r} is not writable ({e.strerror or e}); "
                              + unwritable) from None
        where = target
    else:
        where = next(p for p in (target, *target.parents) if p.exists())
        if not where.is_dir() or not os.access(where, os.W_OK | os.X_OK):
            raise ConfigError(f"parallel.nvme_path = {path!r} is not writable ({where} does not let this user "
                              "create files); " + unwritable)
    if params:
        need = int(params * NVME_BYTES_PER_PARAM * NVME_HEADROOM)
        free = shutil.disk_usage(where).free
        if free < need:
            raise ConfigError(
                f"parallel.nvme_path = {path!r} has {free / 2**30:.2f} GiB free, but NVMe offload of "
                f"{params:,} parameters on this node swaps about {need / 2**30:.2f} GiB there "
                f"({NVME_BYTES_PER_PARAM} bytes per parameter: fp32 weights, AdamW's two moments and the "
                "parameter itself). Free space, or choose a larger disk.")
    return target
