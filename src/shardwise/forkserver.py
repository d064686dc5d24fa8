"""Child processes forked from a server that imported the heavy modules once.

A fresh interpreter per child (multiprocessing's "spawn") spends seconds of CPU importing torch,
FSDP, DTensor and shardwise before it does anything: most of a short child's life (a test's rank,
a rehearsal's played rank). multiprocessing's "forkserver" starts one server per process, which
imports the given modules and then forks each child from itself. The server runs no torch op,
touches no device and holds no thread or process group, so a forked child starts as clean as a
spawned one, except for its environment, which is the server's, frozen when it started: a child
takes the one it should have with ``adopt_environment``.

The test harness (``shardwise.testing``) and the rehearsal (``rehearse/launch.py``) fork their
children here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["PRELOAD", "adopt_environment", "preloaded_context"]

# What the server imports before it forks: one list for every caller, because a process has one
# server and the first call starts it (with two lists, which one a test's ranks were forked from
# depended on the order the tests ran in). None of these starts a thread on import (checked: one
# task in /proc/self/task after importing them all), which a fork would not carry over.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "shardwise.runtime.session",
           "shardwise.rehearse.worker", "transformers"]


def preloaded_context() -> Any:
    """multiprocessing's "forkserver" context whose server imports ``PRELOAD`` before it forks (one
    that fails to import is skipped: an optional extra), or "spawn" where the platform has no
    forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def adopt_environment(env: Mapping[str, str]) -> None:
    """In a forked child: ``env`` instead of the server's environment (before any CUDA or OpenMP
    initialisation reads it)."""
    os.environ.clear()
    os.environ.update(env)
