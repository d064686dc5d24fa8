"""Every rank's step explained: where each rank's step time goes, and which rank is slow and why.

Each rank times its step's phases:

* ``data``: waiting for the data loader (host time; the trainer measures it);
* ``forward``: the model's forward and the loss (from the model's input hook to its output hook; a
  wrapper's own work before it, DDP's buffer and bucket syncs with the other ranks, is ``collective``);
* ``backward``: from there to the last parameter gradient computed (a post-accumulate-grad hook);
* ``collective``: from the last gradient to the end of backward: the part of the gradient
  all-reduce/reduce-scatter the backward did not hide (DDP's reducer waits there for its buckets;
  a rank waiting for a slower one waits here). FSDP2 computes gradients on its unsharded
  parameters (made at a unit's first all-gather, kept for the run) and calls its sharded ones'
  hooks only after their reduce-scatter: the unsharded ones are hooked instead, after the first
  forward, so the reduce-scatter the backward did not hide is ``collective`` too;
* ``optimizer``: ``session.step`` (unscale, clip, step, zero);
* ``checkpoint``: ``session.save`` inside the step loop (the blocked part of staging and writing).

On the CPU the marks are ``time.perf_counter``; on CUDA they are CUDA events on the current stream,
read only once the device has passed them (``Event.query``, at the next logging step, which
synchronises anyway): no phase mark adds a host sync. Data and checkpoint stay host time.

Every logging step the ranks' sums over the window are gathered (one ``all_gather`` of a few
floats). Rank 0 records the slowest rank and the spread per phase in ``metrics.jsonl`` (and the
trackers), and names a rank that is slower than the others in one phase (not ``collective``: that is
where the others wait for it) by more than ``SLOW_FRACTION`` of the median step (and
``SLOW_MIN_EXCESS_S``), and at least
``SLOW_RATIO`` times the others' median, in ``SLOW_WINDOWS`` logging windows in a row, in one line:
"rank 3 on node-b spends 41% of its step waiting for data; the others 4%". ``summary()`` is the
per-rank table of the whole run (summary.json ``step_phases``; ``shardwise profile RUN`` prints it).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from shardwise.observe.phase_table import PHASES, format_table  # noqa: F401 - re-exported

# The phases a rank can be slow in; "collective" is where the other ranks then wait.
OWN_PHASES = ("data", "forward", "backward", "optimizer", "checkpoint")
SLOW_FRACTION = 0.2  # excess over the others' median, as a fraction of the median step time
SLOW_RATIO = 1.5  # and the slow rank's phase at least this many times the others' median
# and at least this many seconds per step: on steps of a few milliseconds the operating system's
# scheduling alone moves a phase by that much (a rank 5 ms slower on a 25 ms step is not a finding).
SLOW_MIN_EXCESS_S = 0.05
SLOW_WINDOWS = 2  # logging windows in a row before the rank is named
DOING = {"data": "waiting for data", "forward": "in the forward pass", "backward": "in the backward pass",
         "optimizer": "in the optimizer step", "checkpoint": "saving checkpoints"}


class _HostClock:
    """Marks are ``perf_counter`` floats."""

    def mark(self) -> float:
        return time.perf_counter()

    @staticmethod
    def seconds(start: Any, end: Any) -> float | None:
        return end - start


class _CudaClock:
    """Marks are CUDA events on the current stream; an interval is known once its end has run."""

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def seconds(start: Any, end: Any) -> float | None:
        if not end.query():  # not reached by the device yet: read at a later step
            return None
        return start.elapsed_time(end) / 1e3


@dataclass
class _Step:
    """One step's marks on this rank, until they can be read."""

    intervals: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)
    host_s: dict[str, float] = field(default_factory=dict)  # data and checkpoint: host seconds
    carried_s: float = 0.0  # a save after the previous step closed: outside this step's span, counted in it
    start: Any = None
    end: Any = None


class StepPhases:
    """Times this rank's step phases; ``window()`` gathers every rank's and (on rank 0) explains them."""

    def __init__(self, rank: int, world_size: int, device: torch.device, *,
                 is_distributed: bool | None = None) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.distributed = dist.is_initialized() and world_size > 1 if is_distributed is None else is_distributed
        self.clock: Any = _CudaClock() if device.type == "cuda" else _HostClock()
        self.hosts = self._gather_hosts()
        self._pending: list[_Step] = []
        self._step: _Step | None = None
        self._open: dict[str, Any] = {}
        self._fwd_start: Any = None
        self._fwd_end: Any = None
        self._fwd_inner: Any = None
        self._last_grad: Any = None
        self._grad_order: list[int] | None = []  # learnt on the first backward (CUDA marks only the last)
        self._last_param: int | None = None
        self._window = torch.zeros(len(PHASES) + 2, dtype=torch.float64)  # phases, step, steps
        self.host_step_s: list[float] = []  # every step's host time, for runtime.auto's compile record
        self._host_start = 0.0
        self._carry = 0.0
        # rank 0: the run's per-rank totals and the slow-rank streak
        self._totals = torch.zeros(world_size, len(PHASES) + 2, dtype=torch.float64)
        self._streak: tuple[int, str, int] | None = None
        self.named: list[dict[str, Any]] = []
        self._handles: list[Any] = []
        self._fsdp_model: nn.Module | None = None

    def _gather_hosts(self) -> list[str]:
        host = socket.gethostname()
        if not self.distributed:
            return [host]
        hosts: list[Any] = [None] * self.world_size
        dist.all_gather_object(hosts, host)
        return [str(h) for h in hosts]

    # ------------------------------------------------------------------ hooks
    def attach(self, model: nn.Module) -> None:
        """Hook ``model``: its output ends the forward phase, its last parameter gradient the backward.

        Inside a DDP wrapper the plain module's input hook starts the forward: what DDP does before
        it (syncing buffers, rebuilding buckets on the second step) waits for the other ranks.
        """
        if isinstance(model, DistributedDataParallel):
            self._handles.append(model.module.register_forward_pre_hook(self._forward_begins))
        self._handles.append(model.register_forward_hook(self._forward_done))
        units = _fsdp_units(model)
        sharded = {id(p) for unit in units for p in unit.parameters()}
        for p in model.parameters():
            if p.requires_grad and id(p) not in sharded:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done))
        self._fsdp_model = model if units else None

    def _hook_fsdp_gradients(self) -> None:
        """Hook FSDP2's unsharded parameters, where backward computes the gradients that its
        reduce-scatter then moves into the sharded ones (whose hooks never fire)."""
        model, self._fsdp_model = self._fsdp_model, None
        for fsdp_param in _unsharded_params(model):
            if fsdp_param.requires_grad:
                self._handles.append(fsdp_param.register_post_accumulate_grad_hook(self._grad_done))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward_begins(self, module: nn.Module, args: Any) -> None:
        if self._fwd_start is not None and self._fwd_inner is None:
            self._fwd_inner = self.clock.mark()

    def _forward_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._fwd_start is not None and self._fwd_end is None:
            self._fwd_end = self.clock.mark()
        if self._fsdp_model is not None:  # its unsharded parameters exist from the first forward on
            self._hook_fsdp_gradients()

    def _grad_done(self, param: torch.Tensor) -> None:
        if self._fwd_end is None:
            return
        if isinstance(self.clock, _HostClock):
            self._last_grad = time.perf_counter()
        elif self._grad_order is not None:
            self._grad_order.append(id(param))  # first backward: learn which gradient comes last
        elif id(param) == self._last_param:
            self._last_grad = self.clock.mark()

    # ------------------------------------------------------------------ marks
    def begin_step(self) -> None:
        """Open a step (its data wait, forward, backward, ... follow)."""
        self._step = _Step(start=self.clock.mark(), carried_s=self._carry)
        if self._carry:
            self._step.host_s["checkpoint"] = self._carry
        self._carry = 0.0
        self._host_start = time.perf_counter()

    def _add(self, phase: str, start: Any, end: Any) -> None:
        if self._step is not None and start is not None and end is not None:
            self._step.intervals.setdefault(phase, []).append((start, end))

    @contextlib.contextmanager
    def forward_backward(self) -> Iterator[None]:
        """Around one micro-batch's forward and backward (``Session.forward_backward``)."""
        self._fwd_start, self._fwd_inner, self._fwd_end, self._last_grad = self.clock.mark(), None, None, None
        try:
            yield
        finally:
            end = self.clock.mark()
            fwd_end = self._fwd_end or end
            if self._fwd_inner is not None:
                self._add("collective", self._fwd_start, self._fwd_inner)
            self._add("forward", self._fwd_inner or self._fwd_start, fwd_end)
            if self._last_grad is not None:
                self._add("backward", fwd_end, self._last_grad)
                self._add("collective", self._last_grad, end)
            else:
                self._add("backward", fwd_end, end)
            if self._grad_order:
                self._last_param, self._grad_order = self._grad_order[-1], None
            self._fwd_start = None

    def start(self, phase: str) -> None:
        """Open ``phase`` ("optimizer", "checkpoint"); ``stop`` closes it."""
        self._open[phase] = (self.clock.mark(), time.perf_counter())

    def stop(self, phase: str) -> None:
        opened = self._open.pop(phase, None)
        if opened is None:
            return
        if self._step is None:
            if phase == "checkpoint":  # the trainer saves after closing its step: count it in the next
                self._carry += time.perf_counter() - opened[1]
            return
        if phase == "checkpoint":  # host time: a save waits for its writes on the host
            self._step.host_s[phase] = self._step.host_s.get(phase, 0.0) + time.perf_counter() - opened[1]
        else:
            self._add(phase, opened[0], self.clock.mark())

    def end_step(self, data_wait_s: float = 0.0) -> None:
        """Close the step (``data_wait_s``: the host time it waited for the data loader)."""
        if self._step is None:
            return
        self._step.end = self.clock.mark()
        self._step.host_s["data"] = self._step.host_s.get("data", 0.0) + data_wait_s
        self.host_step_s.append(time.perf_counter() - self._host_start)
        self._pending.append(self._step)
        self._step = None

    def _drain(self) -> None:
        """Fold every step whose marks the device has passed into the window (no waiting)."""
        kept = []
        for st in self._pending:
            total = self.clock.seconds(st.start, st.end)
            if total is None:
                kept.append(st)
                continue
            row = torch.zeros(len(PHASES) + 2, dtype=torch.float64)
            for i, phase in enumerate(PHASES):
                row[i] = st.host_s.get(phase, 0.0) + sum(self.clock.seconds(a, b) or 0.0
                                                          for a, b in st.intervals.get(phase, ()))
            # Host-timed phases lie outside a CUDA step's device span (data, checkpoint: add them);
            # on the host clock only a save carried over from before the step does.
            host_extra = sum(st.host_s.values()) if isinstance(self.clock, _CudaClock) else st.carried_s
            row[-2], row[-1] = total + host_extra, 1.0
            self._window += row
        self._pending = kept

    # ------------------------------------------------------------------ every logging step
    def window(self) -> dict[str, Any]:
        """Gather every rank's window (a collective: call on every rank at a logging step); return the
        record for metrics.jsonl on rank 0 ({} elsewhere) and start a new window."""
        self._drain()
        mine = self._window.clone()
        self._window.zero_()
        if self.distributed:
            device = self.device if self.device.type == "cuda" else torch.device("cpu")
            out = torch.zeros(self.world_size * mine.numel(), dtype=torch.float64, device=device)
            dist.all_gather_into_tensor(out, mine.to(device))  # all_gather_single is torch 2.13+
            table = out.view(self.world_size, -1).cpu()
        else:
            table = mine.view(1, -1)
        if self.rank != 0:
            return {}
        self._totals += table
        return self._explain(table)

    def _explain(self, table: torch.Tensor) -> dict[str, Any]:
        steps = table[:, -1].clamp(min=1)
        per_step = table[:, :-1] / steps[:, None]  # seconds per step: phases..., step
        if float(table[:, -1].min()) == 0:
            return {}
        record: dict[str, Any] = {}
        for i, phase in enumerate(PHASES):
            col = per_step[:, i].tolist()
            slowest = max(range(len(col)), key=col.__getitem__)
            record[f"phase/{phase}_max_s"] = col[slowest]
            record[f"phase/{phase}_slowest_rank"] = slowest
            record[f"phase/{phase}_spread_s"] = col[slowest] - min(col)
        found = self._slow_rank(per_step)
        if found is None:
            self._streak = None
            return record
        rank, phase, share, others = found
        count = self._streak[2] + 1 if self._streak and self._streak[:2] == (rank, phase) else 1
        self._streak = (rank, phase, count)
        if count >= SLOW_WINDOWS:
            record.update({"slow_rank": rank, "slow_phase": phase})
            if count == SLOW_WINDOWS:  # named once per episode
                host = self.hosts[rank] if rank < len(self.hosts) else "?"
                line = (f"rank {rank} on {host} spends {share:.0%} of its step {DOING[phase]}; "
                        f"the others {others:.0%}")
                self.named.append({"rank": rank, "host": host, "phase": phase, "share": share,
                                   "others_share": others, "message": line})
                record["slow_rank_message"] = line
        return record

    @staticmethod
    def _slow_rank(per_step: torch.Tensor) -> tuple[int, str, float, float] | None:
        """(rank, phase, its share of its step, the others' median share) of the slowest outlier, or None."""
        n = per_step.shape[0]
        if n < 2:
            return None
        step = per_step[:, -1].tolist()
        median_step = statistics.median(step)
        best = None
        for phase in OWN_PHASES:
            i = PHASES.index(phase)
            col = per_step[:, i].tolist()
            for r in range(n):
                others = [col[k] for k in range(n) if k != r]
                typical = statistics.median(others)
                excess = col[r] - typical
                slow = (excess >= max(SLOW_FRACTION * median_step, SLOW_MIN_EXCESS_S)
                        and col[r] >= SLOW_RATIO * typical)
                if slow and (best is None or excess > best[0]):
                    share_others = statistics.median(col[k] / max(step[k], 1e-12) for k in range(n) if k != r)
                    best = (excess, r, phase, col[r] / max(step[r], 1e-12), share_others)
        return None if best is None else best[1:]

    # ------------------------------------------------------------------ the run's table
    def summary(self) -> dict[str, Any]:
        """Rank 0: the per-rank table of the whole run (seconds per step per phase), for summary.json."""
        rows = []
        for r in range(self._totals.shape[0]):
            steps = float(self._totals[r, -1])
            if steps == 0:
                continue
            per = (self._totals[r, :-1] / steps).tolist()
            row: dict[str, Any] = {"rank": r, "host": self.hosts[r] if r < len(self.hosts) else "?",
                                   "steps": int(steps), "step_s": per[-1]}
            row.update({f"{p}_s": per[i] for i, p in enumerate(PHASES)})
            row["other_s"] = per[-1] - sum(per[:len(PHASES)])  # time in no phase (loop overhead)
            rows.append(row)
        return {"phases": list(PHASES), "ranks": rows, "slow_ranks": self.named}


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _unsharded_params(model: nn.Module) -> list[torch.Tensor]:
    """FSDP2's unsharded parameters of every unit of ``model`` (those made so far; torch internals,
    read defensively: a torch without them leaves FSDP's wait in backward, as before)."""
    out = []
    for unit in _fsdp_units(model):
        state = unit._get_fsdp_state()  # type: ignore[operator]
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()) if group is not None else ():
                param = getattr(fsdp_param, "_unsharded_param", None)
                if isinstance(param, torch.Tensor):
                    out.append(param)
    return list({id(p): p for p in out}.values())
