"""A played rank's DDP: torch's own ``DistributedDataParallel`` with its C++ reducer replaced by a
Python stand-in that holds the same buffers and issues the same collectives, in the rehearsal only.

Why (found by trying, torch 2.13 CPU build, the ``fake`` process group, FakeTensorMode):

* **The bucket buffers are real.** The C++ ``Reducer`` allocates each bucket with ``at::empty`` at
  construction, outside any Python mode: on fake parameters it allocates *real* host memory the
  size of every gradient (6 GiB for a 1.5B fp32 model), and torch's MemTracker never sees it.
* **The all-reduce's result is missing.** Its default hook returns the process group's future,
  whose value on the fake group is None: the first backward ends in ``comm.cpp:114 expected the
  hook result is either a Tensor or a TensorList found None``.
* **The bucket rebuild reads storage.** With a comm hook that hands the bucket back, the first step
  runs, and the second forward's ``_rebuild_buckets`` (plain ``ddp``: the reducer rebuilds its
  buckets once, in gradient-ready order) reads the fake parameters' data: "The tensor has a
  non-zero number of elements, but its data is not allocated yet". ``gradient_as_bucket_view``
  fails the same way (and makes the gradients real tensors).
* **``find_unused_parameters`` reads values.** The composed strategies' DDP (``ddp+tp``, ``ddp+pp``)
  reads the all-reduced map of used parameters with ``.item()``: ``DataDependentOutputException``.
* Built inside the fake mode instead, DDP fails in its constructor (``_verify_params_across_processes``
  reads the shapes it packed into a fake tensor).

So everything of DDP that is Python stays torch's own (the wrapper, ``no_sync``, the forward's
``prepare_for_backward``, ``_DDPSink``'s output clone under ``find_unused_parameters``, the buffer
broadcast, the initial bucket assignment ``dist._compute_bucket_assignment_by_size`` with the run's
own caps), and ``StandInReducer`` replaces only the C++ ``dist.Reducer`` (and its ``dist.Logger``),
reproducing what it holds and sends:

* one flat buffer per bucket, in the parameters' dtype and device, allocated at construction from
  the buckets DDP computed (plain ``ddp``: one bucket of everything until the rebuild; under
  ``find_unused_parameters``: a 1 MiB first bucket then 25 MiB ones, reversed), and rebuilt once
  after the first synchronised backward, as the C++ reducer does when it may (``find_unused_parameters``
  off): in the order the gradients became ready, with the 1 MiB first bucket
  (``dist._DEFAULT_FIRST_BUCKET_BYTES``) and 25 MiB after it, the new layout broadcast from rank 0;
* a hook after each parameter's gradient is accumulated (``register_post_accumulate_grad_hook``,
  the C++ reducer's grad-accumulator post-hook) that, when the reducer is armed (a forward outside
  ``no_sync``, or torch's pipeline calling ``prepare_for_backward`` itself), writes the gradient
  divided by the world size into its bucket view (``mul`` with ``out=``: no temporary), and one
  ``all_reduce`` per bucket once it is full, buckets launched in order; under
  ``find_unused_parameters`` also the all-reduce of the used-parameter map;
* at the end of the backward (a callback queued on the autograd engine, as the C++ reducer's
  ``finalize_backward``) the reduced bucket copied back into each ``.grad``
  (``gradient_as_bucket_view=False``, what shardwise builds: the gradients and the buckets are two
  buffers), or the gradient left pointing at its bucket view (``True``).

What it cannot know: which parameters other ranks used (the fake group carries no values): under
``find_unused_parameters`` a parameter this rank did not use is taken as unused everywhere (every
rank runs the same graph here). Comm hooks, ``static_graph`` and the join context are refused by
name (shardwise uses none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import _disable_current_modes

NOTE = ("DDP's C++ reducer is replaced by the rehearsal's stand-in (rehearse/fake_ddp.py): on fake tensors "
        "and the fake process group it allocates real host buffers, gets no all-reduce result and reads "
        "storage when it rebuilds its buckets. The stand-in holds the same flat buckets (the parameters' "
        "dtype, DDP's own bucket assignment and its rebuild) and issues one all-reduce per bucket; "
        "torch's DDP wrapper, no_sync and ZeroRedundancyOptimizer are the real ones.")


def _empty(like: torch.Tensor, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised flat buffer of ``like``'s dtype and device, created as ``at::empty`` in the
    C++ reducer is: outside every Python mode (a running MemTracker would file it as an activation
    or a temporary; the caller registers it as the reducer's own), a fake tensor of ``like``'s fake
    mode when the parameters are fake."""
    with _disable_current_modes():
        mode = like.fake_mode if is_fake(like) else contextlib.nullcontext()
        with mode:
            return torch.empty(numel, dtype=dtype or like.dtype, device=like.device)


class _Bucket:
    """One flat gradient buffer and the views of its parameters (the C++ reducer's ``Bucket``)."""

    def __init__(self, params: list[nn.Parameter], indices: list[int]) -> None:
        self.indices = indices
        self.buffer = _empty(params[0], sum(p.numel() for p in params))
        self.views: list[torch.Tensor] = []
        offset = 0
        with _disable_current_modes():
            mode = params[0].fake_mode if is_fake(params[0]) else contextlib.nullcontext()
            with mode:
                for p in params:
                    self.views.append(self.buffer.narrow(0, offset, p.numel()).view(p.shape))
                    offset += p.numel()
        self.pending = len(indices)
        self.work: Any = None


class _SilentLogger:
    """``dist.Logger``'s stand-in: DDP's usage logging, which has no memory or collective of its own."""

    def __init__(self, reducer: Any) -> None:
        self.reducer = reducer

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        return {}

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class StandInReducer:
    """The C++ ``dist.Reducer``'s memory and collectives on fake tensors (module docstring).

    Constructed by torch's ``DistributedDataParallel.__init__`` with the C++ reducer's arguments."""

    def __init__(self, params: list[nn.Parameter], bucket_indices: list[list[int]],
                 per_bucket_size_limits: list[int], process_group: Any, expect_sparse_gradient: list[bool],
                 bucket_bytes_cap: int, find_unused_parameters: bool, gradient_as_bucket_view: bool,
                 param_to_name_mapping: dict[int, str], first_bucket_bytes_cap: int, *args: Any) -> None:
        if any(expect_sparse_gradient):
            raise NotImplementedError("the rehearsal's DDP stand-in (rehearse/fake_ddp.py) has no sparse gradients")
        self.params = list(params)
        self.group = process_group
        self.world = process_group.size()
        self.cap, self.first_cap = int(bucket_bytes_cap), int(first_bucket_bytes_cap)
        # The C++ reducer's rebuild limits: the constructor's list when DDP passes one, else its default.
        rebuild_limits = [int(x) for x in args[3]] if len(args) > 3 and args[3] else []
        self.rebuild_limits = rebuild_limits or [self.first_cap, self.cap]
        self.find_unused = bool(find_unused_parameters)
        self.as_view = bool(gradient_as_bucket_view)
        self.static_graph = False
        self.has_rebuilt = False
        self.armed = False  # the C++ reducer's expect_autograd_hooks_
        self.finalize_pending = False  # a synchronised backward whose reduction has not been finished
        self.ready_order: list[int] = []  # the C++ reducer's rebuilt_param_indices_
        self.unused: list[int] = []
        self.marked_unused = False
        self.used: set[int] = set()
        self.trackers: list[Any] = []
        self.next_bucket = 0
        self.buckets: list[_Bucket] = []
        self._make_buckets(bucket_indices)
        # Under find_unused_parameters, the per-parameter used map all-reduced every synchronised step
        # (int32, one entry a parameter, on the parameters' device).
        self.used_map = _empty(self.params[0], len(self.params), torch.int32) if self.params else None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)
                         if p.requires_grad]

    # ---- buckets
    def _make_buckets(self, bucket_indices: list[list[int]]) -> None:
        self.buckets = [_Bucket([self.params[i] for i in indices], list(indices)) for indices in bucket_indices]
        self.where = {i: (b, j) for b, bucket in enumerate(self.buckets) for j, i in enumerate(bucket.indices)}
        if self.as_view:  # gradients that exist live in their bucket from now on (initialize_bucket_views)
            for bucket in self.buckets:
                for i, view in zip(bucket.indices, bucket.views, strict=True):
                    grad = self.params[i].grad
                    if grad is not None:
                        view.copy_(grad)
                        self.params[i].grad = view
        for tracker in self.trackers:
            tracker.track_external(*self.buffers())

    def buffers(self) -> list[torch.Tensor]:
        """The reducer's own tensors: the bucket buffers (and the used-parameter map)."""
        used = [self.used_map] if self.find_unused and self.used_map is not None else []
        return [b.buffer for b in self.buckets] + used

    def track_with(self, tracker: Any) -> None:
        """Have a MemTracker count the buffers, now and after a rebuild, as its kind ``Other`` (the
        rehearsal's transients column, where the planner puts "ddp buckets")."""
        self.trackers.append(tracker)
        tracker.track_external(*self.buffers())

    def _ensure_prior_reduction_finished(self) -> None:
        if self.finalize_pending:
            raise RuntimeError("Expected to have finished reduction in the prior iteration before starting a new "
                               "one: a parameter got no gradient (torch's DDP needs find_unused_parameters=True "
                               "for it; the rehearsal's DDP stand-in, rehearse/fake_ddp.py, as torch's reducer)")

    def _rebuild_buckets(self) -> bool:
        """The C++ ``rebuild_buckets`` (DDP calls it before every forward with grad enabled): first
        the check that the previous synchronised backward reduced everything, then once, after the
        first synchronised backward, a new layout unless ``find_unused_parameters`` (and not
        ``static_graph``) forbids it."""
        self._ensure_prior_reduction_finished()
        if not (self.static_graph or not self.find_unused) or self.has_rebuilt or not self.ready_order:
            return False
        order = self.ready_order
        indices, _ = dist._compute_bucket_assignment_by_size([self.params[i] for i in order], self.rebuild_limits,
                                                              [], order)
        # sync_bucket_indices: rank 0's layout, broadcast (the bucket indices, then the bucket sizes),
        # host tensors as the C++ reducer's; the broadcasts themselves in the current modes (counted).
        with _disable_current_modes():
            flat = torch.tensor([len(indices), *(i for b in indices for i in b)], dtype=torch.int32)
            sizes = torch.tensor([len(b) for b in indices], dtype=torch.int32)
        for message in (flat, sizes):
            dist.broadcast(message, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.has_rebuilt = True
        self.ready_order = []
        self._make_buckets(indices)
        return True

    # ---- the step
    def prepare_for_forward(self) -> None:
        pass

    def prepare_for_backward(self, outputs: Iterable[torch.Tensor]) -> None:
        self._ensure_prior_reduction_finished()
        self.armed = True
        self.next_bucket = 0
        self.used = set()
        self.marked_unused = False
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.indices), None
        self.unused = self._search_unused(list(outputs)) if self.find_unused and not self.static_graph else []

    def _search_unused(self, outputs: list[torch.Tensor]) -> list[int]:
        """The parameters whose gradient accumulator the outputs' graph does not reach."""
        seen: set[int] = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        visited: set[Any] = set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in visited:
                continue
            visited.add(fn)
            variable = getattr(fn, "variable", None)
            if variable is not None:
                seen.add(id(variable))
            stack.extend(f for f, _ in fn.next_functions)
        return [i for i, p in enumerate(self.params) if id(p) not in seen]

    def _hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self._autograd_hook(index)
        return hook

    def _autograd_hook(self, index: int) -> None:
        if not self.armed:
            return  # no_sync: gradients accumulate in .grad, nothing is copied or sent
        if self.find_unused:
            self.used.add(index)
        if not self.has_rebuilt and (self.static_graph or not self.find_unused):
            self.ready_order.append(index)
        self.finalize_pending = True  # require_finalize_: checked before the next forward
        if not self.marked_unused:
            self.marked_unused = True
            for unused in self.unused:
                self._mark_ready(unused)
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        b, j = self.where[index]
        bucket = self.buckets[b]
        view, param = bucket.views[j], self.params[index]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif not (self.as_view and grad.is_set_to(view)):
            # mark_variable_ready_dense: divided while copied into the bucket (at::mul_out).
            torch.mul(grad, 1.0 / self.world, out=view)
            if self.as_view:
                param.grad = view
        else:
            view.div_(self.world)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """All-reduce every full bucket in order (a bucket waits for the ones before it)."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            bucket = self.buckets[self.next_bucket]
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            self.next_bucket += 1
        if self.next_bucket == len(self.buckets):
            if self.find_unused and self.used_map is not None:
                self.used_map_work = dist.all_reduce(self.used_map, group=self.group, async_op=True)
            # finalize_backward runs when the autograd engine finishes this backward.
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _finalize(self) -> None:
        """finalize_backward: wait for every bucket and copy it back into the gradients."""
        self.armed = False
        self.finalize_pending = False
        for bucket in self.buckets:
            bucket.work.wait()
            for i, view in zip(bucket.indices, bucket.views, strict=True):
                if self.find_unused and i not in self.used:
                    continue  # globally unused (every rank runs this graph): .grad left untouched
                param = self.params[i]
                if self.as_view:
                    if param.grad is None:
                        param.grad = view
                elif param.grad is None:
                    param.grad = view.clone()
                else:
                    param.grad.copy_(view)

    # ---- DDP's other calls into its reducer
    def set_logger(self, logger: Any) -> None:
        pass

    def _set_ddp_runtime_logging_sample_rate(self, rate: int) -> None:
        pass

    def _remove_autograd_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and hasattr probes: "no such attribute", as usual
            raise AttributeError(name)
        raise NotImplementedError(f"DDP called its reducer's {name}, which the rehearsal's stand-in "
                                  "(rehearse/fake_ddp.py) does not play: comm hooks, static_graph, the join "
                                  "context and sparse gradients are not rehearsed")


@contextlib.contextmanager
def standing_in() -> Iterator[None]:
    """While it is open, every ``DistributedDataParallel`` built gets a ``StandInReducer``: torch's
    DDP looks ``dist.Reducer`` and ``dist.Logger`` up when it is constructed (one played rank's
    process; nothing is changed for training)."""
    saved = dist.Reducer, dist.Logger
    dist.Reducer, dist.Logger = StandInReducer, _SilentLogger  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        dist.Reducer, dist.Logger = saved  # type: ignore[misc]


def reducers(modules: Iterable[nn.Module]) -> list[StandInReducer]:
    """The stand-in reducers of the DDP wrappers in ``modules`` (a model, a pipeline's stages)."""
    found: dict[int, StandInReducer] = {}
    for root in modules:
        for module in root.modules():
            if isinstance(module, DistributedDataParallel):
                reducer = module.__dict__.get("reducer")
                if isinstance(reducer, StandInReducer):
                    found[id(reducer)] = reducer
    return list(found.values())
