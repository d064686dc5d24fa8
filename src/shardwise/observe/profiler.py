"""``[profile]``: a torch.profiler trace of a window of optimizer steps, per rank, in the run dir.

Per profiled rank, in ``<run>/profile/``:

* ``rank<R>.pt.trace.json``: the Chrome/Perfetto trace (open it in ui.perfetto.dev or
  chrome://tracing; ``tensorboard --logdir <run>/profile`` reads it with the PyTorch profiler
  plugin, whose loader looks for ``<worker>.pt.trace.json`` files);
* ``rank<R>.summary.json``: the per-step compute / data / communication split and top ops read
  back from that trace (``shardwise.observe.trace``), which ``shardwise profile RUN`` prints;
* on CUDA, ``rank<R>.memory_snapshot.pickle``: the caching allocator's history over the window
  (``torch.cuda.memory._record_memory_history`` + ``_dump_snapshot``), the file
  pytorch.org/memory_viz opens. On the CPU there is no allocator history to record; the run says
  so in one log line and goes on.

The window is driven by ``torch.profiler.schedule``: the step before ``start_step`` is the warm-up
(the profiler starts collecting, results discarded, so start-up cost does not land in the first
recorded step), ``start_step..end_step`` are recorded, and the trace is written as soon as
``end_step`` finishes. No collective is involved, so any subset of ranks can profile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, schedule

from shardwise.core.config import ProfileConfig
from shardwise.fsutil import atomic_write_json
from shardwise.observe.trace import format_summary, load_trace, summarize


def trace_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank``'s trace of run ``run_dir`` is written."""
    return Path(run_dir) / "profile" / f"rank{rank}.pt.trace.json"


class StepProfiler:
    """Profiles optimizer steps ``start_step..end_step`` of this rank (a no-op when not asked to).

    Call ``start(first_step)`` before the loop, ``step(step)`` after each optimizer step and
    ``stop()`` once the loop is over (also after a failure: a partial window is still written).
    """

    def __init__(self, cfg: ProfileConfig, run_dir: str | Path, *, rank: int, world_size: int,
                 device: torch.device, strategy: str = "", log: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rank, self.world_size, self.device, self.strategy = rank, world_size, device, strategy
        self.log = log
        self.wanted = cfg.enabled and (not cfg.ranks or rank in cfg.ranks)
        self._prof: Any = None
        self._snapshot = False  # recording the CUDA allocator history right now
        self._first_step = 1
        self._start = cfg.start_step
        self._metadata_added = False
        self.written: list[Path] = []

    @property
    def out_dir(self) -> Path:
        return self.run_dir / "profile"

    def start(self, first_step: int) -> None:
        """Arm the profiler; ``first_step`` is the optimizer step this process runs first."""
        if not self.wanted:
            return
        cfg = self.cfg
        if cfg.end_step < first_step:
            self.log(f"profile: steps {cfg.start_step}..{cfg.end_step} were already trained before "
                     f"this run resumed at step {first_step}; nothing to profile.")
            self.wanted = False
            return
        self._first_step = first_step
        self._start = max(cfg.start_step, first_step)
        warmup = 1 if self._start > first_step else 0
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=self._start - first_step - warmup, warmup=warmup,
                              active=cfg.end_step - self._start + 1, repeat=1),
            on_trace_ready=self._export, record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory, with_stack=cfg.with_stack,
        )
        self._prof.start()
        self._add_metadata()
        if cfg.memory_snapshot and self.device.type != "cuda":
            self.log("profile: no memory snapshot on this run: torch.cuda.memory._record_memory_history "
                     f"records the CUDA caching allocator, and this run is on {self.device.type} "
                     "(profile.memory_snapshot = false silences this line).")
        if self._start == first_step:
            self._begin_snapshot()

    def step(self, step: int) -> None:
        """Advance the schedule after optimizer step ``step`` (writes the trace after end_step)."""
        if self._prof is None:
            return
        if step == self._start - 1:
            self._begin_snapshot()  # the next step is the first recorded one
        self._prof.step()
        self._add_metadata()
        if step >= self.cfg.end_step:
            self._end_snapshot()
            self._prof.stop()  # the schedule has written the trace; detach the profiler
            self._prof = None

    def stop(self) -> None:
        """End profiling early (the loop ended or failed inside the window); writes what it has."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        self._end_snapshot()
        prof.stop()

    def _add_metadata(self) -> None:
        # Read back by shardwise.observe.trace: ProfilerStep#k is trainer step first_step + k.
        # Kineto keeps metadata only while it collects, i.e. from the warm-up step on.
        if self._metadata_added or self._prof.current_action == ProfilerAction.NONE:
            return
        self._metadata_added = True
        self._prof.add_metadata_json("shardwise", json.dumps({
            "first_step": self._first_step, "rank": self.rank, "world_size": self.world_size,
            "strategy": self.strategy, "start_step": self._start, "end_step": self.cfg.end_step}))

    # ------------------------------------------------------------------ CUDA memory snapshot
    def _begin_snapshot(self) -> None:
        if self.cfg.memory_snapshot and self.device.type == "cuda" and not self._snapshot:
            torch.cuda.memory._record_memory_history(max_entries=self.cfg.snapshot_max_entries)
            self._snapshot = True

    def _end_snapshot(self) -> None:
        if not self._snapshot:
            return
        self._snapshot = False
        path = self.out_dir / f"rank{self.rank}.memory_snapshot.pickle"
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        torch.cuda.memory._dump_snapshot(str(tmp))
        torch.cuda.memory._record_memory_history(enabled=None)
        os.replace(tmp, path)
        self.written.append(path)
        self.log(f"profile: CUDA memory snapshot {path} (open it in pytorch.org/memory_viz)")

    # ------------------------------------------------------------------ trace export
    def _export(self, prof: Any) -> None:
        path = trace_path(self.run_dir, self.rank)
        # export_chrome_trace writes in place; a reader must never see half a trace.
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
        summary = summarize(load_trace(path))
        atomic_write_json(path.with_name(f"rank{self.rank}.summary.json"), summary, indent=2)
        self.written.append(path)
        self.log(f"profile: trace {path}\n{format_summary({**summary, 'top_ops': summary['top_ops'][:5]})}\n"
                 f"(all ranks: shardwise profile {self.run_dir})")
