"""The shared harness for distributed tests: real gloo processes, short timeouts, no hangs.

``run_distributed(fn, world_size, **kwargs)`` starts ``world_size`` fresh processes, initialises a
gloo process group in each with a short collective timeout, calls ``fn(rank, world_size, **kwargs)``
and returns the list of per-rank return values. On the first failure every other rank is killed and
the failing rank's traceback is raised; when the job runs past ``timeout_s`` every rank's Python
stack is dumped (faulthandler) into the error before the processes are killed.
Nothing is left running after it returns or raises.

The ranks fork from a server process that has imported torch and shardwise once
(``shardwise.forkserver``): a spawned rank spends seconds of CPU importing them, which across a suite
of hundreds of ranks on a small machine was minutes. Each rank still starts clean and gets the
caller's environment of the moment, as a spawned one would.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import queue
import signal
import socket
import subprocess
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.forkserver import adopt_environment, preloaded_context


class DistributedTestError(AssertionError):
    """A rank failed, or the job hung; the message holds the traceback or every rank's stack.

    ``native_crash``: a rank died from a signal of native code (a segmentation fault in gloo's
    transport thread, seen once in a loaded full run), whatever the other ranks then reported."""

    native_crash: bool = False


# Signals a process dies of when native code crashes (not a kill by the harness or the OS's OOM killer).
NATIVE_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT})


def _native_crash(procs: list[Any]) -> str:
    """'rank R crashed in native code (SIGSEGV)' for the first rank a native crash killed, or ''.

    Waits a moment for the ranks' exit codes: the crashed rank's peers usually report their broken
    connection before the harness sees the crashed one gone."""
    end = time.monotonic() + 1.0
    while True:
        for r, p in enumerate(procs):
            code = p.exitcode
            if code is not None and code < 0 and -code in NATIVE_CRASH_SIGNALS:
                return f"rank {r} crashed in native code ({signal.Signals(-code).name})"
        if time.monotonic() > end:
            return ""
        time.sleep(0.1)


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, stack_dir: str,
           collective_timeout_s: float, results: Any, caller_env: dict[str, str], env: dict[str, str],
           kwargs: dict) -> None:
    adopt_environment(caller_env)  # a forked rank has the server's environment, frozen when it started
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **env})
    stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")  # noqa: SIM115 - lives until exit
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        import torch  # defers torch
        import torch.distributed as dist  # defers torch

        # One thread per rank unless the test asks for more (env={"OMP_NUM_THREADS": "2"}: another
        # blocking of the matmuls, so another reduction order, for the parity-under-noise check).
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        try:
            value = fn(rank, world_size, **kwargs)
        except BaseException:
            # Report before tearing down the group: destroying it resets the peers' connections,
            # and their follow-on errors must not be mistaken for the cause.
            results.put((rank, "error", traceback.format_exc(), time.monotonic()))
            raise SystemExit(1) from None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        try:
            results.put((rank, "ok", pickle.dumps(value), time.monotonic()))
        except Exception:  # an unpicklable return value is reported, not swallowed
            results.put((rank, "error", "return value is not picklable:\n" + traceback.format_exc(),
                         time.monotonic()))
    except SystemExit:
        raise
    except BaseException:
        results.put((rank, "error", traceback.format_exc(), time.monotonic()))
        raise SystemExit(1) from None


def _first_failure(results: Any, rank: int, payload: str, at: float) -> tuple[int, str]:
    """Among the errors arriving within a moment of the first one, the one that happened first.

    When one rank fails, its peers fail too (connection reset, timeout) and may report first;
    the earliest failure (CLOCK_MONOTONIC is shared by processes on one host) is the cause.
    """
    failures = [(at, rank, payload)]
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            r, status, p, t = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            failures.append((t, r, p))
    _, rank, payload = min(failures)
    others = sorted(r for _, r, _ in failures if r != rank)
    if others:
        payload += f"\n(rank(s) {', '.join(map(str, others))} failed after it, as a consequence)"
    return rank, payload


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *, timeout_s: float = 120.0,
                    collective_timeout_s: float = 30.0, env: dict[str, str] | None = None,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks; return their results.

    ``fn`` must be importable by the child (a module-level function). Raises DistributedTestError
    naming the first failing rank, or, after ``timeout_s``, with every rank's stack.
    """
    port_retries, crashed = 0, False
    while True:
        try:
            return _run_once(fn, world_size, timeout_s, collective_timeout_s, env, kwargs)
        except DistributedTestError as e:
            # free_port's port can be taken by another process before rank 0's store binds it (many
            # test runs on one machine): that is the harness's race, not the test's failure; retry
            # on a new port (twice at most) before any test code ran.
            if "EADDRINUSE" in str(e) and port_retries < 2:
                port_retries += 1
                continue
            # A rank killed by a native crash (gloo's transport thread segfaulted once in a loaded
            # full run; the test passed when run again): run the test once more, and say so. A crash
            # that comes back fails the test (the first one's cause is in the warning).
            if e.native_crash and not crashed:
                crashed = True
                cause = str(e).splitlines()[0].rstrip(":")
                warnings.warn(f"run_distributed({getattr(fn, '__name__', fn)}, {world_size} ranks): {cause}; "
                              "running it once more", RuntimeWarning, stacklevel=2)
                continue
            raise


def _run_once(fn: Callable[..., Any], world_size: int, timeout_s: float, collective_timeout_s: float,
              env: dict[str, str] | None, kwargs: dict) -> list[Any]:
    ctx = preloaded_context()
    results = ctx.Queue()
    stack_dir = tempfile.mkdtemp(prefix="shardwise-stacks-")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, stack_dir, collective_timeout_s,
                                              results, dict(os.environ), dict(env or {}), kwargs), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            try:
                rank, status, payload, at = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    time.sleep(0.5)  # give its queued traceback a moment to arrive
                    try:
                        rank, status, payload, at = results.get_nowait()
                    except queue.Empty:
                        err = DistributedTestError(
                            f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                            "before reporting (killed, or crashed in native code)")
                        err.native_crash = bool(_native_crash(procs))
                        raise err from None
                elif time.monotonic() > deadline:
                    raise DistributedTestError(_hang_report(procs, stack_dir, timeout_s)) from None
                else:
                    continue
            if status == "error":
                rank, payload = _first_failure(results, rank, payload, at)
                crash = _native_crash(procs)  # the root cause when a peer's connection broke under it
                err = DistributedTestError(f"{crash}; then " * bool(crash) + f"rank {rank} failed:\n{payload}")
                err.native_crash = bool(crash)
                raise err
            values[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [values[r] for r in range(world_size)]
    finally:
        _kill_all(procs)


def run_command(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (e.g. ``shardwise train --nproc 2``) and return it finished, output captured.

    Unlike ``subprocess.run(timeout=...)``, a timeout kills the whole process tree: the command
    runs in its own session, so torchrun and every rank die with it and no grandchild keeps the
    output pipes open (which would block the caller forever). Raises DistributedTestError with the
    output's tail on timeout.
    """
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise DistributedTestError(f"command timed out after {timeout:.0f}s: {' '.join(cmd)}\n"
                                   f"--- stdout (tail) ---\n{out[-3000:]}\n--- stderr (tail) ---\n"
                                   f"{err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _hang_report(procs: list[Any], stack_dir: str, timeout_s: float) -> str:
    stack_files = [Path(stack_dir) / f"rank{r}.txt" for r in range(len(procs))]
    for p, f in zip(procs, stack_files):
        # A rank without its stack file is still starting (importing the test's module) and has no
        # SIGUSR1 handler yet: the signal would only kill it, so it is left alone.
        if p.is_alive() and f.exists():
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(1.0)
    parts = [f"distributed test hung: no result after {timeout_s:.0f}s; stacks of every rank:"]
    for r, f in enumerate(stack_files):
        if not f.exists():
            text = "(no stack: the process had not started running the test yet)"
        else:
            text = f.read_text() or "(no stack: process already exited)"
        parts.append(f"--- rank {r} ---\n{text}")
    return "\n".join(parts)


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


# ------------------------------------------------------------------------------------------------
# The fixed-batch training loop every parity test runs (reference and strategy alike).


def fixed_batches(steps: int, global_batch: int, seq: int, vocab: int, seed: int = 0) -> Any:
    """Fixed token batches ``(steps, global_batch, seq + 1)`` shared by reference and strategy runs."""
    import torch  # defers torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, global_batch, seq + 1), generator=g)


def lm_loss(logits: Any, targets: Any) -> Any:
    """Next-token cross-entropy in float32 at least (logits ``(..., vocab)``, targets ``(...)``);
    float64 logits stay float64."""
    import torch  # defers torch
    import torch.nn.functional as F  # defers torch

    logits = logits.flatten(0, -2)
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets.flatten())


@contextlib.contextmanager
def default_dtype(dtype: Any) -> Any:
    """Build (and train) models in ``dtype`` inside the block; the previous default comes back after.

    Parity tests run in float64: a strategy reorders reductions, and AdamW turns that rounding
    noise on a gradient element near zero into a move of up to ``lr`` (its update is g / (|g| + eps)
    per element, with eps = 1e-8). In float32 the noise (~1e-7 relative, ~1e-9..1e-8 absolute here)
    is the size of eps, so such a move is O(lr) and a bound set above one CPU's measurement fails on
    the next CPU; in float64 the noise is ~1e-16 relative, so the move is at most
    ``lr * noise / eps`` ~ 1e-10 per step, and a bound of 1e-9 on parameters after a few steps holds on
    any machine while a real defect (an O(lr) move, lr >= 1e-3) stays 10^6 times above it.
    """
    import torch  # defers torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def train_fixed_batches(session: Any, model: Any, optimizer: Any, batches: Any, *,
                        steps: range | int | None = None, loss_fn: Callable[..., Any] = lm_loss,
                        max_norm: float = 0.0, explicit_loop: bool = False,
                        after_step: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Train ``model`` on ``batches[step]`` (whole global batches of token rows) for ``steps``.

    Each data-parallel replica reads its contiguous slice of every global batch (the slice of
    replica ``session.dp_rank``; TP ranks and pipeline stages of one replica share it), split into
    ``session.grad_accum_steps`` micro-batches. One process reading the whole global batch is the
    reference the strategies must match. ``explicit_loop=True`` writes the micro-batch step out as a
    user loop would (``accumulate`` + ``autocast`` + ``backward``) instead of
    ``session.forward_backward``. ``after_step(step)`` runs after each optimizer step.

    Returns ``{"losses": [global mean loss per step], "norms": [pre-clip grad norm per step]}``.
    """
    import torch  # defers torch

    accum = session.grad_accum_steps
    per_replica = batches.shape[1] // session.dp_size
    micro = per_replica // accum
    losses: list[float] = []
    norms: list[float] = []
    for step in (range(steps) if isinstance(steps, int) else steps or range(batches.shape[0])):
        mine = batches[step, session.dp_rank * per_replica:(session.dp_rank + 1) * per_replica]
        total = 0.0
        for a in range(accum):
            chunk = mine[a * micro:(a + 1) * micro]
            x, y = chunk[:, :-1].to(session.device), chunk[:, 1:].to(session.device)
            if explicit_loop:
                with session.accumulate(model):
                    with session.autocast():
                        logits = model(x)
                    loss = loss_fn(logits, y)
                    session.backward(loss)
                loss = loss.detach()
            else:
                loss = session.forward_backward(model, x, y, loss_fn)
            total += float(loss) / accum
        norms.append(float(torch.as_tensor(session.step(optimizer, max_norm=max_norm))))
        losses.append(session.all_reduce(total, op="mean"))
        if after_step is not None:
            after_step(step)
    return {"losses": losses, "norms": norms}
