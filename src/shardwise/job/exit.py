"""How a rank process ends: flush what it wrote, then leave without the interpreter's teardown.

A rank has finished its work (its process groups destroyed, its checkpoints published, its output
written) when its entry point returns. What remains is the interpreter's own teardown: freeing
module globals and C++ static objects in no particular order. There, a gloo/c10d object that a
Python reference (a device mesh cache, a framework singleton, a DTensor) kept alive past
``destroy_process_group`` is destroyed while its worker thread is still joinable, and the C++ runtime
aborts the finished process ("terminate called without an active exception", SIGABRT; seen at
exit of finished ranks under the trainer and under Accelerate's loop, a few times in a thousand
runs). The launcher then reports a crash for a run that completed. So every rank entry point ends
with ``exit_rank``: Python's buffers and log handlers are flushed, then ``os._exit`` ends the process
with the entry point's exit code, as torchrun's own agent and the watchdog do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys


def exit_rank(code: int | None) -> None:
    """Flush stdout, stderr and the logging handlers, then end this process with ``code`` (never returns)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    with contextlib.suppress(Exception):
        logging.shutdown()
    os._exit(int(code or 0))
