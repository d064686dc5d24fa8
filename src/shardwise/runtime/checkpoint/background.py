"""Checkpoints written behind the training: DCP ``async_save`` with a reused staging buffer.

A save in mode ``async`` (or ``async-pinned``) blocks the step only while its state is taken; the
copy into host memory (page-locked on CUDA with ``async-pinned``) runs in DCP's ``DefaultStager``
on a thread of its own (``use_async_staging``; on CUDA on a stream of its own), while the next
micro-batches' forward and backward run: they read the parameters and write only gradients. The
optimizer step is what changes the saved tensors, so ``Session.step`` first waits for the copy to
finish (``wait_staged``; the wait is counted as time the save blocked training). The stager's
buffers are kept and reused by every later save. DCP then writes the staged copy from a
background thread, and a second background thread (``_finish``) checksums this
rank's files, gathers every rank's outcome and lets rank 0 write the manifest, publish and rotate
— the same ``save.finish_save`` a synchronous save runs, so nothing is published before every
rank's files are on disk and checksummed.

Why the ranks agree without stopping training: the background write and its gathers run on a
process group of their own (gloo, over all ranks; torchtitan does the same), so they never
interleave with training's collectives on the default group. Every rank's finishing thread
reaches the same gather, and rank 0 publishes only when all report success. A rank that dies or
runs out of space fails that gather (or DCP's own), and ``latest`` stays on the previous
checkpoint. The outcome is read at the next save (or at the end, or before an interrupt
checkpoint) — a collective point of the training loop — so every rank raises the same
``CheckpointError`` at the same step.

At most one save is in flight: the next one first waits for it; the wait is counted and timed.
Rotation runs inside the finishing thread after the new checkpoint is published, so it never
removes the last published checkpoint while a newer one is being written.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from shardwise.core.config import CHECKPOINT_MODES
from shardwise.errors import CheckpointError, ConfigError
from shardwise.parallel.mesh import background_io_group
from shardwise.runtime import faults
from shardwise.runtime.checkpoint.save import PreparedSave, describe_io_failure, finish_save
from shardwise.runtime.checkpoint.state import single_process_ok
from shardwise.runtime.collective import distributed
from shardwise.runtime.collective import rank as global_rank


def resolve_mode(mode: str, device_type: str, engine: str | None = None) -> tuple[str, str | None]:
    """(the checkpoint mode to use, a note for the log or None) for ``checkpoint.mode``.

    ``auto`` is ``async`` except under an engine that writes its own checkpoint files
    (DeepSpeed), which is ``sync``. An explicit ``async``/``async-pinned`` under such an engine is
    refused by name. ``async-pinned`` on a device without pinned memory (the CPU) stages into
    ordinary host memory, i.e. it is ``async``, with a note saying so.
    """
    if mode not in CHECKPOINT_MODES:
        raise ConfigError(f"checkpoint.mode {mode!r} is not one of {', '.join(CHECKPOINT_MODES)}.")
    if engine is not None:
        if mode in ("async", "async-pinned"):
            raise ConfigError(
                f"checkpoint.mode = {mode!r} does not run under {engine}: its engine writes its own "
                "checkpoint files (save_checkpoint) synchronously, and shardwise cannot stage or "
                "publish them behind the training. Use checkpoint.mode = \"sync\" (or \"auto\").")
        return "sync", None
    if mode == "auto":
        return "async", None
    if mode == "async-pinned" and device_type != "cuda":
        return "async", (f"checkpoint.mode async-pinned on a {device_type} device: there is no device "
                         "memory to copy from, so staging uses ordinary host memory (as async does).")
    return mode, None


def _reusable(stager: Any) -> bool:
    """Whether ``stager`` can stage again. torch 2.11's ``DefaultStager`` closes its copier after
    every stage (its dispatch table emptied: the next save fails with ``KeyError: <class 'type'>``);
    torch 2.13's keeps it, with its host buffers, for the next save."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is None or bool(getattr(inner, "_deepcopy_dispatch", True))


def staged_bytes(state: Any) -> int:
    """Bytes of the distinct tensor storages in a (staged) state dict."""
    seen: dict[int, int] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return sum(seen.values())


class SaveHandle:
    """A checkpoint being written in the background; ``wait()`` returns its path once published."""

    def __init__(self, prep: PreparedSave, stats: dict[str, Any]) -> None:
        self.path = prep.final
        self.step = prep.step
        self.stats = stats  # blocked_s, wait_s, staging_s, bytes, write_s, mib_per_s (see BackgroundWriter)
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.reported = False  # its error was raised to someone already (raised once, not at every wait)

    def done(self) -> bool:
        """Whether the background write has finished (published or failed)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> Path:
        """Block until the checkpoint is published; return its path.

        Raises the save's CheckpointError when it failed (every rank raises the same), and
        TimeoutError when ``timeout_s`` passed first.
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"checkpoint {self.path.name} is still being written after {timeout_s:.0f}s")
        if self._error is not None:
            self.reported = True
            raise self._error
        return self.path

    def _finished(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


class BackgroundWriter:
    """One rank's asynchronous checkpoint writer: a reused stager, its own group, one save in flight."""

    def __init__(self, *, pinned: bool = False, timeout_s: float = 1800.0,
                 log: Callable[[str], None] | None = None) -> None:
        self.pinned = pinned and torch.cuda.is_available()
        self.timeout_s = timeout_s
        self._log = log or (lambda _msg: None)
        self._group: Any = None
        self._stager: Any = None
        self.inflight: SaveHandle | None = None
        self.waits = 0  # saves that had to wait for the previous one
        self.wait_s = 0.0
        self.staging_bytes = 0  # the staging buffer's size (host memory), kept across saves
        self.staging: Any = None  # the in-flight save's staging (a Future) until wait_staged()
        self.staging_wait_s = 0.0  # time steps waited for a copy to finish (wait_staged)
        self.completed: list[dict[str, Any]] = []  # stats of every save that finished

    def _ensure_group(self) -> Any:
        # Collective (every rank calls save() at the same point): a gloo group over all ranks for
        # DCP's planning and the publish gathers, so they never interleave with training's
        # collectives on the default group. On CUDA it is also the CPU backend async_save needs.
        # A one-rank job on CUDA has a process group too (nccl only): async_save refuses a group
        # without a CPU backend ("A CPU backend must be enabled for async save"), so it gets the
        # gloo group as well (found on the first GPU run, docs/performance.md).
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = background_io_group(self.timeout_s)
        if not distributed():
            # One process: DCP warns from its writer thread that it "assumes" one process, outside
            # any catch_warnings of this thread (single_process_ok), so the filter is process-wide.
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        return self._group

    def _ensure_stager(self) -> Any:
        if self._stager is not None and not _reusable(self._stager):
            self._stager = None  # torch 2.11 closed it after its last stage: make one anew
        if self._stager is None:
            # The copy runs on the stager's own thread (wait_staged() before the weights change);
            # pinned, non-blocking copies only where there is a CUDA device to copy from.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=self.pinned, use_shared_memory=False,
                                                        use_async_staging=True,
                                                        use_non_blocking_copy=self.pinned))
        return self._stager

    def set_pinned(self, pinned: bool) -> None:
        """Stage into pinned memory (CUDA only) from the next save on; the buffers are made anew."""
        pinned = pinned and torch.cuda.is_available()
        if pinned != self.pinned and self._stager is not None:
            assert self.inflight is None, "wait_previous() first: the stager's buffers are in use"
            self._stager.close()
            self._stager = None
        self.pinned = pinned

    def wait_staged(self) -> float:
        """Wait until the save in flight has copied its tensors (the weights may then change);
        return the seconds waited. Its failure, if any, is reported by the save's ``wait``."""
        staging, self.staging = self.staging, None
        if staging is None or staging.done():
            return 0.0
        t0 = time.perf_counter()
        with torch.profiler.record_function("shardwise: checkpoint staging wait"):
            try:
                staging.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                # The copy is still reading the weights: letting the step change them would
                # publish a mixed checkpoint. Stop here; the published ones are untouched.
                raise CheckpointError(
                    f"the copy of checkpoint step {self.inflight.step if self.inflight else '?'} into host memory "
                    f"did not finish within {self.timeout_s:.0f}s (watchdog.collective_timeout_s); training "
                    "stops rather than change the weights under it, and the last published checkpoint is "
                    "untouched.") from None
            except Exception:  # noqa: BLE001 - a failed copy is reported by the save's own wait
                pass
        waited = time.perf_counter() - t0
        self.staging_wait_s += waited
        if self.inflight is not None:  # the time the step stood still for this save
            stats = self.inflight.stats
            stats["staging_wait_s"] = stats.get("staging_wait_s", 0.0) + waited
            stats["blocked_s"] = stats.get("blocked_s", 0.0) + waited
        return waited

    def wait_previous(self) -> SaveHandle | None:
        """Wait for the save in flight, if any, and return it (its error is raised by ``wait``)."""
        self.wait_staged()
        handle = self.inflight
        if handle is None:
            return None
        self.inflight = None
        if not handle.done():
            t0 = time.perf_counter()
            self._log(f"checkpoint {handle.path.name} is still being written: waiting for it before going on")
            try:
                handle.wait(self.timeout_s)
            finally:
                waited = time.perf_counter() - t0
                self.waits += 1
                self.wait_s += waited
                handle.stats["waited_for_s"] = waited
        if not handle.reported:
            handle.wait(0)
        return handle

    def save(self, prep: PreparedSave, *, blocked_since: float, wait_s: float = 0.0) -> SaveHandle:
        """Stage ``prep``'s state and write it in the background; return its handle.

        Collective. The previous save must have been waited for (``wait_previous``).
        ``blocked_since``: when the caller's step started blocking for this save (perf_counter).
        """
        assert self.inflight is None, "wait_previous() first: one save in flight at a time"
        group = self._ensure_group()
        stager = self._ensure_stager()
        rank = global_rank()
        # The stager copies each tensor's storage into a host buffer of the same size (kept for
        # the next save): the buffer is the payload's local storage bytes.
        self.staging_bytes = max(self.staging_bytes, staged_bytes(prep.payload))
        t0 = time.perf_counter()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # The stager copies on a stream of its own, which does not wait for the compute stream:
            # the step's queued kernels (the optimizer's updates) must end before the copy reads.
            torch.cuda.current_stream().synchronize()
        stats: dict[str, Any] = {"step": prep.step, "wait_s": wait_s}
        handle = SaveHandle(prep, stats)
        try:
            # Named in profiler traces: the part of a save the training step waits for.
            with single_process_ok(), torch.profiler.record_function("shardwise: checkpoint staging"):
                writer = faults.storage_writer(prep.partial, prep.step, rank)
                upload = dcp.async_save(prep.payload, storage_writer=writer, process_group=group,
                                        async_stager=stager, no_dist=not distributed())
        except (OSError, CheckpointException) as e:
            upload, failure = None, describe_io_failure(e, rank, prep.partial)
        else:
            failure = None
        now = time.perf_counter()
        stats.update(staging_s=now - t0, blocked_s=now - blocked_since, staging_bytes=self.staging_bytes)
        if isinstance(upload, AsyncSaveResponse):
            # The copy goes on in the stager's thread: the weights must not change before it ends
            # (wait_staged). finish_save reads only the payload's shapes.
            staging, upload = upload.staging_completion, upload.upload_completion
            self.staging = staging

            def staged(_: Any) -> None:
                stats["staging_s"] = time.perf_counter() - t0

            staging.add_done_callback(staged)
        started = now

        def finish() -> None:
            nonlocal failure
            error: BaseException | None = None
            try:
                if upload is not None:
                    try:
                        upload.result()
                    except (OSError, CheckpointException) as e:
                        failure = describe_io_failure(e, rank, prep.partial)
                path = finish_save(prep, failure, group=group)
                written = sum(p.stat().st_size for p in path.glob(f"__{rank}_*.distcp"))
                write_s = time.perf_counter() - started
                stats.update(write_s=write_s, bytes=written,
                             mib_per_s=written / 2**20 / write_s if write_s > 0 else 0.0)
                self.completed.append(stats)
            except BaseException as e:  # reported at the next collective point, never lost
                error = e if isinstance(e, CheckpointError) else CheckpointError(
                    f"the background write of checkpoint {prep.final.name} failed ({describe_io_failure(e, rank)}); "
                    f"nothing was published, and {prep.root / 'latest'} still names the previous checkpoint.")
            handle._finished(error)

        # A non-daemon thread: the interpreter never exits under a half-written checkpoint (the
        # session's close() waits for it first, then destroys the process groups).
        threading.Thread(target=finish, name=f"shardwise-ckpt-{prep.step}").start()
        self.inflight = handle
        return handle

    def close(self, timeout_s: float | None = None) -> SaveHandle | None:
        """Wait for the save in flight (up to ``timeout_s``), release the stager; return that save."""
        handle = self.inflight
        if handle is not None:
            handle._done.wait(self.timeout_s if timeout_s is None else timeout_s)
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        return handle



def summarize(writer: BackgroundWriter | None, mode: str) -> dict[str, Any]:
    """The summary's ``checkpoint`` entry: mode, saves, blocked and write seconds, bytes, waits."""
    done = writer.completed if writer is not None else []
    blocked = [s["blocked_s"] for s in done]
    written = sum(s.get("bytes", 0) for s in done)
    write_s = sum(s.get("write_s", 0.0) for s in done)
    return {
        "mode": mode, "background_saves": len(done),
        "blocked_s_total": sum(blocked), "blocked_s_max": max(blocked, default=0.0),
        "write_s_total": write_s, "bytes_written": written,
        "mib_per_s": written / 2**20 / write_s if write_s > 0 else 0.0,
        "waits": writer.waits if writer is not None else 0,
        "wait_s_total": writer.wait_s if writer is not None else 0.0,
        "staging_bytes": writer.staging_bytes if writer is not None else 0,
        # steps that waited for a save's copy to host memory before changing the weights
        "staging_wait_s_total": writer.staging_wait_s if writer is not None else 0.0,
    }


def close_writer(writer: BackgroundWriter, log: Callable[[str], None]) -> None:
    """Let the save in flight finish (the first step of an ordered shutdown); report its failure.

    Never raises: it runs while the session closes, possibly on the way out of another error.
    A write that fails here is reported in one paragraph; the previous checkpoint stays latest.
    """
    handle = writer.close()
    if handle is None:
        return
    if not handle.done():
        log(f"checkpoint {handle.path.name} was still being written after {writer.timeout_s:.0f}s at "
            "shutdown; it was not published, and 'latest' names the previous checkpoint.")
        return
    try:
        handle.wait(0)
    except CheckpointError as e:
        log(str(e))
