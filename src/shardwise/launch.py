"""Turn a resolved run into a torchrun (``torch.distributed.run``) invocation, or run in-process.

We never spawn ranks ourselves for real runs: torchrun owns rendezvous, per-rank environment,
elastic restarts and multi-node. This module only builds its command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class LaunchSpec:
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # "host:port" for multi-node; empty means --standalone
    max_restarts: int = 0
    run_id: str = ""


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
    return subprocess.call(torchrun_command(spec, target), env=full_env)
