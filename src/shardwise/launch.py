"""Turn a resolved run into a torchrun (``torch.distributed.run``) invocation, or run in-process.

We never spawn ranks ourselves for real runs: torchrun owns rendezvous, per-rank environment,
elastic restarts and multi-node. This module only builds its command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.errors import ConfigError

MAX_NODES = 4096
MAX_NPROC = 4096
MAX_RESTARTS = 1000


@dataclass
class LaunchSpec:
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # "host:port" for multi-node; empty means --standalone
    max_restarts: int = 0
    run_id: str = ""


def check_launch_flags(nproc: int | None, nnodes: int, node_rank: int, rdzv_endpoint: str,
                       max_restarts: int) -> None:
    """Raise ConfigError for launch flags that cannot work (before anything starts, never a hang).

    ``--nnodes > 1`` needs ``--rdzv-endpoint HOST:PORT`` (without one every node would wait for
    the others on its own localhost forever), and ``--node-rank`` must lie in ``[0, nnodes)``.
    """
    if nproc is not None and not 1 <= nproc <= MAX_NPROC:
        raise ConfigError(f"--nproc must be at least 1 (and at most {MAX_NPROC}), got {nproc}.")
    if not 1 <= nnodes <= MAX_NODES:
        raise ConfigError(f"--nnodes must be at least 1 (and at most {MAX_NODES}), got {nnodes}.")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank must be between 0 and --nnodes - 1 = {nnodes - 1}, got {node_rank}. "
                          "Give each node its own rank: 0 on the first, 1 on the second, ...")
    if not 0 <= max_restarts <= MAX_RESTARTS:
        raise ConfigError(f"--max-restarts must be between 0 and {MAX_RESTARTS}, got {max_restarts}.")
    if rdzv_endpoint:
        host, sep, port = rdzv_endpoint.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535 \
                or not host.isprintable() or " " in host:
            raise ConfigError(f"--rdzv-endpoint must be HOST:PORT (e.g. node0:29500, port 1-65535), "
                              f"got {rdzv_endpoint!r}.")
    elif nnodes > 1:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the address of the first "
                          "node (the same on every node), e.g. --rdzv-endpoint node0:29500; without it "
                          "each node would wait for the others on its own localhost.")


def torchrun_args(spec: LaunchSpec) -> list[str]:
    """torchrun options for ``spec`` (what follows ``python -m torch.distributed.run``)."""
    args = [f"--nproc-per-node={spec.nproc}"]
    if spec.nnodes > 1 or spec.rdzv_endpoint:
        args += [f"--nnodes={spec.nnodes}", f"--node-rank={spec.node_rank}",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rdzv_endpoint or 'localhost:29500'}"]
        if spec.run_id:
            args.append(f"--rdzv-id={spec.run_id}")
    else:
        # A free port on localhost, chosen by torchrun: two jobs on one machine never collide.
        args.append("--standalone")
    if spec.max_restarts:
        args.append(f"--max-restarts={spec.max_restarts}")
    return args


def torchrun_command(spec: LaunchSpec, target: Sequence[str]) -> list[str]:
    """Full argv: ``python -m torch.distributed.run <options> <target...>``."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(spec), *target]


def run_torchrun(spec: LaunchSpec, target: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run torchrun in the foreground and return its exit code (Ctrl-C is forwarded by the OS)."""
    full_env = dict(os.environ, **(env or {}))
    # One thread per CPU rank unless the user chose otherwise; torchrun does the same but warns.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(torchrun_command(spec, target), env=full_env)
    # While torchrun runs, this process must not die on a signal: subprocess.call would SIGKILL
    # torchrun on KeyboardInterrupt, orphaning ranks that are saving their interrupt checkpoint.
    # Ctrl-C already reaches torchrun and every rank (same process group), so SIGINT is only
    # absorbed here; SIGTERM (sent to this process alone, e.g. by a scheduler) is forwarded.
    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            proc.send_signal(signum)

    in_main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        return proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
