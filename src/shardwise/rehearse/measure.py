"""What a played rank measures: memory by kind (torch's MemTracker), collectives (CommDebugMode's
registry of collective ops), and its host's peak RSS.

The memory kinds are read at three moments, because the planner's columns are not all at their
largest at the same instant: the peak (the total's largest value, with its breakdown), after each
optimizer step (parameters, gradients and optimizer state are all alive there: the zeroing comes
after the step's hooks), and after each forward of the whole model and when its backward starts
(every saved activation of the micro-batch, the loss's included, is alive there).
"""

from __future__ import annotations

import contextlib
import functools
import resource
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops
from torch.utils._python_dispatch import TorchDispatchMode

# MemTracker's kinds (``_MemRefType`` values) -> the planner's ledger columns.
KIND_TO_COLUMN = {
    "Parameter": "param_bytes",
    "Buffer": "param_bytes",
    "Gradient": "grad_bytes",
    "Optstate": "optim_bytes",
    "Activation": "activation_bytes",
    "Temp": "transient_bytes",
    "Other": "transient_bytes",
}
TOTAL_KEY = "Total"


def _columns(snapshot: dict[Any, dict[str, int]]) -> dict[str, int]:
    """One device snapshot of MemTracker (bytes by kind) as the ledger's columns, plus the total."""
    out: dict[str, int] = defaultdict(int)
    for device_snap in snapshot.values():
        for kind, nbytes in device_snap.items():
            if kind == TOTAL_KEY:
                out["peak_bytes"] += nbytes
            elif kind in KIND_TO_COLUMN:
                out[KIND_TO_COLUMN[kind]] += nbytes
    return dict(out)


# DTensor's sharding propagation builds each op's arguments at their GLOBAL shape on fake tensors to
# learn the output's shape (ShardingPropagator._propagate_tensor_meta_non_cached); those never hold
# device memory. MemTracker counts them when the propagation's fake mode is the one it was entered
# under (a rehearsal on fake tensors, torch 2.13) or always (torch 2.11, found on the first CUDA
# rehearsal: 173.5 GiB "measured" against 49.9 GiB max_memory_allocated). A fused AdamW step over
# FSDP-sharded parameters then counted four global copies of every parameter (params, grads and
# both moments). So the probe's tracker ignores what is created while a propagation runs.
_PROPAGATING = threading.local()


def _mark_sharding_propagation() -> None:
    """Wrap DTensor's shape propagation (once per process) so the tracker knows when it runs."""
    inner = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if inner is None or getattr(inner, "_shardwise_marked", False):
        return  # a torch without it (nothing to wrap) or already wrapped

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        _PROPAGATING.depth = getattr(_PROPAGATING, "depth", 0) + 1
        try:
            return inner(self, *args, **kwargs)
        finally:
            _PROPAGATING.depth -= 1

    propagate._shardwise_marked = True  # type: ignore[attr-defined]
    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]


class _LocalMemTracker(MemTracker):
    """MemTracker that leaves out DTensor's global-shape propagation tensors (see above), calls
    ``on_backward_start`` at the first op of each backward pass (an autograd graph task), and
    updates the per-module peaks of the running modules only (``_update_peak_stats``)."""

    on_backward_start: Callable[[], None] | None = None
    _backward_task = -1

    def __init__(self) -> None:
        super().__init__()
        # fqn -> {id(module): its statistics in ``memory_tracking``}, for ``_update_peak_stats``; kept
        # in step with ``memory_tracking``, which changes only in ``_pre_fw_hook`` and
        # ``reset_mod_stats``. Plain dicts: looking modules up in torch's weak-id dictionary on every
        # op cost a 4-layer 70B rank 9 s of 90. A module that dies leaves its row until the next reset
        # (nothing reads it: its fqn is no longer entered, or a live module's row replaces it).
        self._stats_by_fqn: dict[str, dict[int, Any]] = {}
        self._fqn_of: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(_PROPAGATING, "depth", 0):
            return func(*args, **(kwargs or {}))
        task = torch._C._current_graph_task_id()  # -1 outside the autograd engine
        if task != -1 and task != self._backward_task and self.on_backward_start is not None:
            self._backward_task = task
            self.on_backward_start()  # before this op's outputs exist
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        # A pipeline schedule runs each stage (a root module: the union's own forward never runs)
        # once per micro-batch before their backwards; MemTracker takes a root's second forward for
        # the next iteration and raises. It is the same step's next micro-batch: its statistics
        # start again (the module's parameters and gradient hooks stay tracked, once).
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
            if parents == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)
        stats = self.memory_tracking[module]  # every module enters ``memory_tracking`` here
        key = id(module)
        old = self._fqn_of.get(key)
        if old is not None and old != stats.mod_fqn:  # entered again under another name
            self._stats_by_fqn[old].pop(key, None)
        self._fqn_of[key] = stats.mod_fqn
        self._stats_by_fqn.setdefault(stats.mod_fqn, {})[key] = stats

    def reset_mod_stats(self) -> None:
        super().reset_mod_stats()
        self._stats_by_fqn.clear()
        self._fqn_of.clear()

    def _update_peak_stats(self, peak_state: _ModState) -> None:
        """MemTracker's, on every dispatched op, visits every module it ever tracked to ask whether
        it is running (``mod_fqn in parents``): O(modules) a op, with thousands of modules in an 80-layer
        model (a played llama-3-70b rank spent most of its first step there). The running modules are
        the few fqns in ``parents``; visiting those alone gives the same peaks and snapshots."""
        curr_snap = self._curr_mem_snap
        for fqn in self._mod_tracker.parents:
            for stats in self._stats_by_fqn.get(fqn, {}).values():
                if peak_state not in stats.snapshots:
                    continue
                for dev, dev_snap in curr_snap.items():
                    if stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                        stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                        # A snapshot is {kind: int}: a dict copy is torch's deepcopy, ~10x cheaper.
                        stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)


_MODULE_FIELDS = (("param_bytes", "parameter_mem"), ("buffer_bytes", "buffer_mem"), ("input_bytes", "input_mem"),
                  ("output_bytes", "output_mem"))


class MemoryProbe:
    """MemTracker over the model and optimizer, with the step and forward moments recorded.

    ``stages``: a pipeline rank's stage modules (the schedule runs them, not ``model``). The planner
    counts one micro-batch's activations on a pipeline rank (its stages' share) and the other
    micro-batches in flight as transients, so there the activations are read per micro-batch:
    what each stage's forward of one micro-batch leaves saved (the largest over micro-batches; the
    last stage's with its loss, read when its backward starts: ``loss_stage``), summed over the
    rank's stages; and the transients are the peak less the state and those.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 stages: list[nn.Module] | None = None, loss_stage: int | None = None) -> None:
        _mark_sharding_propagation()
        self.tracker = _LocalMemTracker()
        self.tracker.track_external(model, optimizer)
        self.after_step: dict[str, int] = {}
        self.after_forward: dict[str, int] = {}
        self.modules: dict[str, dict[str, int]] = {}
        self.per_micro_batch = stages is not None
        self._stage_saved: dict[int, int] = {}  # stage -> largest activation bytes one forward saved
        self._stage_start: dict[int, int] = {}
        self._loss_stage = loss_stage
        self._steps_seen = 0  # optimizer steps while tracking
        self._loss_pending: int | None = None  # the loss stage's start reading, until its backward
        self._handles = [optimizer.register_step_post_hook(self._on_step)]
        if stages is None:
            # Read again when the backward starts: the planner's activations include what the loss
            # saves (its fp32 log-softmax), which the model's forward hook, before the loss, does
            # not see (130 KiB of hf-llama-tiny's 3.1 MiB; 4 GiB at 8k tokens of a 128k vocabulary),
            # while the logits alive at that hook are freed once the loss is computed.
            self._handles.append(model.register_forward_hook(self._on_forward))
            self.tracker.on_backward_start = self._on_forward
            return
        self._hide_grad_inputs()
        # The last stage's loss runs after its forward hook: what it saves (the fp32 log-softmax) is
        # read when that stage's backward starts, as on a rank without a pipeline (see above). Until
        # 2026-11-28 it was read at the hook: llama-3-405b's last stage read 1,055 MiB of 2,005 planned.
        self.tracker.on_backward_start = self._on_loss_backward
        for i, stage in enumerate(stages):
            self._handles += [stage.register_forward_pre_hook(functools.partial(self._on_stage_start, i)),
                              stage.register_forward_hook(functools.partial(self._on_stage_end, i))]

    def _largest(self, held: dict[str, int], now: dict[str, int]) -> None:
        for key, value in now.items():
            held[key] = max(held.get(key, 0), value)

    def _hide_grad_inputs(self) -> None:
        """Keep MemTracker's module tracker off the inputs a module is called with that require
        grad. It puts an "all"-mode multi-grad hook on them, to see the module's backward end,
        and torch's hook keeps the inputs' grad_fn nodes and the gradients it has seen until every
        expected one arrives in one backward call. On a pipeline rank they never all arrive: the
        schedule's metadata inference runs a first stage's forward and never its backward (its
        inputs are token ids), and the zero-bubble schedules split a backward into an
        input-gradient call and a later weight-gradient call. The hook and the nodes then hold
        each other, with every tensor the graph saved: on hf-llama-tiny (2026-11-27) 162 KiB (2/3 of
        a micro-batch of activations) on the first 1F1B stage, for the whole run, and 4.5 MiB on a
        ZBV rank (its transients read 20 times the plan's). Without the tracker nothing of the
        steps is left alive after them (checked with weak references), so this was the rehearsal's,
        never the runtime's. torch 2.13 also refuses such a hook on a leaf input (a later stage's
        received activation) inside ``autograd.grad``. A module's backward is then closed at the
        end of the backward pass, as for a module called on token ids: its per-module row is read
        over a longer span; the tensors, their kinds and the totals are tracked as before."""
        modules = self.tracker._mod_tracker
        pre_hook = modules._fw_pre_hook

        def fw_pre_hook(module: nn.Module, inputs: Any) -> None:
            pre_hook(module, tuple(x for x in inputs if not (isinstance(x, torch.Tensor) and x.requires_grad)))

        modules._fw_pre_hook = fw_pre_hook  # an instance attribute: registered when the tracker is entered

    def _on_step(self, *_: Any) -> None:
        if self.tracker._depth:  # only while tracking (the collective-counting step is not)
            self._steps_seen += 1
            self._largest(self.after_step, _columns(self.tracker.get_tracker_snapshot("current")))

    def _on_forward(self, *_: Any) -> None:
        if self.tracker._depth:
            self._largest(self.after_forward, _columns(self.tracker.get_tracker_snapshot("current")))

    def _activations_now(self) -> int:
        return _columns(self.tracker.get_tracker_snapshot("current")).get("activation_bytes", 0)

    def _on_stage_start(self, stage: int, *_: Any) -> None:
        if self.tracker._depth:
            self._stage_start[stage] = self._activations_now()
            self._loss_pending = None  # another forward in between: the stage-end reading stands

    def _on_stage_end(self, stage: int, *_: Any) -> None:
        if self.tracker._depth and stage in self._stage_start:
            start = self._stage_start.pop(stage)
            self._record_stage(stage, self._activations_now() - start)
            if stage == self._loss_stage:
                self._loss_pending = start

    def _on_loss_backward(self) -> None:
        # Not in the first tracked step: torch allocates the stage's receive buffers (kept for the run,
        # the plan's transients) between its first forward and its first loss.
        if (self.tracker._depth and self._loss_pending is not None and self._loss_stage is not None
                and self._steps_seen):
            self._record_stage(self._loss_stage, self._activations_now() - self._loss_pending)
        self._loss_pending = None

    def _record_stage(self, stage: int, saved: int) -> None:
        self._stage_saved[stage] = max(self._stage_saved.get(stage, 0), saved)
        self.after_forward["activation_bytes"] = sum(self._stage_saved.values())

    def end_micro_batch(self) -> None:
        """Keep each module's statistics of this forward/backward (the largest over micro-batches),
        then clear them: MemTracker follows one forward/backward per module at a time."""
        if not self.tracker._depth:
            return
        for stats in self.tracker.memory_tracking.values():
            # The fields are set by MemTracker's module hooks: torch 2.11 left output_mem unset on a
            # module in the first CUDA rehearsal (llama-3-8b, full checkpointing); such a field reads 0.
            row = {"peak_bytes": int(sum(stats.local_peak.values())),
                   **{key: int(getattr(stats, field, 0)) for key, field in _MODULE_FIELDS}}
            held = self.modules.setdefault(stats.mod_fqn, row)
            for key, value in row.items():
                held[key] = max(held[key], value)
        self.tracker.reset_mod_stats()

    def result(self, top: int = 12) -> dict[str, Any]:
        """Bytes by ledger column at the peak, after the optimizer step and after the forward; and
        the ``top`` modules by their peak while they ran."""
        for handle in self._handles:
            handle.remove()
        modules = sorted(({"module": name, **row} for name, row in self.modules.items()),
                         key=lambda r: -r["peak_bytes"])[:top]
        return {"peak": _columns(self.tracker.get_tracker_snapshot("peak")),
                "after_step": self.after_step, "after_forward": self.after_forward, "modules": modules,
                "activations_per": "micro_batch" if self.per_micro_batch else "forward"}


def _buffer_bytes(x: Any) -> int:
    """The largest tensor among a collective's arguments: its whole buffer (the gathered output of an
    all-gather, the input of a reduce-scatter, the tensor of an all-reduce)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return max((_buffer_bytes(v) for v in x), default=0)
    return 0


# A pipeline's point-to-point messages: CommDebugMode's registry has none, and the c10d ops a process
# group's send and recv dispatch carry the tensor, so they are counted here beside the collectives.
P2P_OPS = {torch.ops.c10d.send, torch.ops.c10d.recv_}


class CollectiveLog(TorchDispatchMode):
    """Every collective and point-to-point message dispatched while active: its op, its group and
    its buffer's bytes.

    The collectives' registry is CommDebugMode's (legacy and native functional collectives and the
    c10d ops), the sends and receives ``P2P_OPS``; CommDebugMode's module tracker is left out: on a
    Hugging Face model under FSDP2 it raised an IndexError in its forward hook (torch 2.13), which
    ended the run.
    """

    def __init__(self, group_names: dict[str, str]) -> None:
        super().__init__()
        registry = CommDebugMode()
        self._ops = set(registry.comm_registry) | set(c10d_collective_ops) | P2P_OPS
        self.group_names = group_names  # process-group name -> mesh dimension name
        self.counts: dict[tuple[str, str], list[int]] = {}

    def _group_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        for value in (*args, *kwargs.values()):
            if isinstance(value, str) and value in self.group_names:
                return self.group_names[value]
            if isinstance(value, torch.ScriptObject):  # a c10d op's ProcessGroup argument
                with contextlib.suppress(Exception):
                    value = dist.ProcessGroup.unbox(value)
            name = getattr(value, "group_name", None)
            if isinstance(name, str):
                return self.group_names.get(name, name)
        return "?"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor desugars into the collectives counted below
        kwargs = kwargs or {}
        packet = getattr(func, "_overloadpacket", None)
        if packet in self._ops:
            key = (packet.__name__, self._group_of(args, kwargs))
            entry = self.counts.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += _buffer_bytes(list(args))
        return func(*args, **kwargs)

    def result(self) -> list[dict[str, Any]]:
        return [{"op": op, "dim": dim, "count": c, "bytes": b} for (op, dim), (c, b) in sorted(self.counts.items())]


def group_names(mesh: Any) -> dict[str, str]:
    """Process-group name -> mesh dimension name (1-d views of every dimension of ``mesh``)."""
    out: dict[str, str] = {}
    if mesh is None:
        return out
    for dim in mesh.mesh_dim_names or ():
        try:
            out[mesh.get_group(dim).group_name] = dim
        except (RuntimeError, ValueError, KeyError):  # a dimension with no group of its own
            continue
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
