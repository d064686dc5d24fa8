"""LR schedulers next to a prepared optimizer: re-pointing after ``prepare``, and JSON state for checkpoints.

``Session.prepare(model, optimizer, scheduler)`` may hand back a different optimizer than the one
the scheduler was built on (ZeRO-1 swaps in a ``ZeroRedundancyOptimizer``), so the scheduler is
re-pointed at the returned one. A scheduler given as a callable ``optimizer -> scheduler`` is simply
built on the returned optimizer, which is right under every strategy.

Checkpoints keep the scheduler's ``state_dict()`` as JSON inside the manifest, never as a pickle: a
checkpoint must not be able to run code when it is read (see ``runtime.checkpoint``).
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Callable
from typing import Any

import torch

from shardwise.errors import CheckpointError, ShardwiseError

# A scheduler: anything with torch's LRScheduler interface (ReduceLROnPlateau included).
Scheduler = Any


def is_scheduler(obj: Any) -> bool:
    """True for an object with the LR scheduler interface (optimizer, step, state_dict, load_state_dict)."""
    return all(hasattr(obj, name) for name in ("optimizer", "step", "state_dict", "load_state_dict"))


def prepare_scheduler(scheduler: Scheduler | Callable[[torch.optim.Optimizer], Scheduler],
                      given: torch.optim.Optimizer | Callable | None,
                      prepared: torch.optim.Optimizer | None, groups_before: int) -> tuple[Scheduler, str | None]:
    """Return (the scheduler driving ``prepared``, None) or (None, why it cannot).

    ``given`` is what the user passed to ``prepare`` as the optimizer; ``groups_before`` its number
    of param groups before the strategy touched it. The error is returned, not raised, so that the
    caller can raise it on every rank at once.
    """
    if prepared is None:
        return None, ("session.prepare() got a scheduler but no optimizer; pass the optimizer the "
                      "scheduler drives: session.prepare(model, optimizer, scheduler).")
    if not is_scheduler(scheduler):
        if not callable(scheduler):
            return None, (f"session.prepare(): the scheduler is a {type(scheduler).__name__}; pass a "
                          "torch.optim.lr_scheduler.LRScheduler or a callable optimizer -> scheduler.")
        built = scheduler(prepared)
        if not is_scheduler(built) or built.optimizer is not prepared:
            return None, ("the scheduler callable passed to session.prepare() must return an LR "
                          "scheduler built on the optimizer it receives.")
        return built, None
    if not isinstance(given, torch.optim.Optimizer) or scheduler.optimizer is not given:
        return None, ("the scheduler passed to session.prepare() was built on another optimizer than "
                      "the one passed with it; build it on that optimizer, or pass a callable "
                      "`lambda opt: Scheduler(opt, ...)` that prepare() calls with the prepared optimizer.")
    if len(prepared.param_groups) != groups_before:
        # The strategy regrouped the parameters (tensor parallel splits groups that mix DTensor and
        # plain tensors); the scheduler's per-group lists (base_lrs, lambdas) would no longer line up.
        return None, (f"the strategy split the optimizer's {groups_before} param group(s) into "
                      f"{len(prepared.param_groups)}, which the scheduler built before prepare() does not "
                      "know about. Pass the scheduler as a callable instead: "
                      "session.prepare(model, optimizer, lambda opt: Scheduler(opt, ...)).")
    if prepared is not given:
        _repoint(scheduler, prepared)
    return scheduler, None


def _repoint(scheduler: Scheduler, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scheduler`` (and the schedulers it chains) drive ``optimizer``."""
    scheduler.optimizer = optimizer
    for child in getattr(scheduler, "_schedulers", []) or []:  # SequentialLR, ChainedScheduler
        _repoint(child, optimizer)
    _track_step_calls(optimizer)


def _track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way LRScheduler's constructor does on the optimizer it is given.

    The scheduler warns that "optimizer.step() has been overridden" when its optimizer's step lacks
    the mark, and uses ``_opt_called`` to detect a scheduler step before the first optimizer step.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    func = optimizer.step.__func__  # type: ignore[attr-defined]
    opt_ref = weakref.ref(optimizer)  # no reference cycle through the instance attribute

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def scheduler_state(scheduler: Scheduler) -> dict[str, Any]:
    """The scheduler's ``state_dict()``, checked to be JSON data; ShardwiseError otherwise.

    Deterministic (the same on every rank), so every rank raises alike before a collective save.
    """
    state = scheduler.state_dict()
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise ShardwiseError(
            f"the LR scheduler's state ({type(scheduler).__name__}) is not JSON data ({e}); shardwise "
            "stores scheduler state as JSON so that loading a checkpoint can never run code. Keep "
            "learning rates as Python floats and lr lambdas as plain functions (or objects whose "
            "attributes are numbers, strings and lists)."
        ) from None
    return state


def restore_scheduler(scheduler: Scheduler, state: dict[str, Any] | None, where: str) -> str | None:
    """Load ``state`` into ``scheduler`` and put its current learning rates into its optimizer.

    Returns a note when the checkpoint holds no scheduler state (the scheduler then starts afresh).
    Writing ``get_last_lr()`` back matters under ZeRO-1: DCP restores the learning rates of the
    rank's inner optimizer, which the outer one overwrites at its next step.
    """
    if state is None:
        return (f"{where} holds no LR scheduler state (it was saved without one): the scheduler starts "
                "from its first step")
    try:
        apply_scheduler_state(scheduler, state)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(scheduler_load_error(scheduler, where, e)) from None
    return None


def apply_scheduler_state(scheduler: Scheduler, state: dict[str, Any]) -> None:
    """Load ``state`` into ``scheduler`` and write its current learning rates into its optimizer."""
    scheduler.load_state_dict(state)
    last = getattr(scheduler, "_last_lr", None)
    groups = scheduler.optimizer.param_groups
    if last is not None and len(last) == len(groups):
        for group, lr in zip(groups, last):
            group["lr"] = lr


def scheduler_load_error(scheduler: Scheduler, where: str, e: BaseException) -> str:
    """Why a saved scheduler state could not be loaded into ``scheduler``."""
    return (f"cannot restore the LR scheduler ({type(scheduler).__name__}) from {where}: "
            f"{type(e).__name__}: {e}. Was it saved with another scheduler?")
