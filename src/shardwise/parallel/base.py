"""What every strategy provides: a mesh layout, up-front checks, ``apply`` and step-time hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.core.config import ParallelConfig
from shardwise.core.layout import Layout
from shardwise.core.strategies import StrategyInfo
from shardwise.device import backend_for


@dataclass(frozen=True)
class ParallelContext:
    """What a strategy needs to apply itself on one rank.

    ``layout`` is the Session's layout, including the model's blocks once ``prepare`` found them;
    ``options`` the ``[parallel]`` section for what is not a degree (precision, wrap, AC mode).
    ``materialize`` is set when the model was built on the meta device (``Session.build``): it
    allocates a module's (local shards of) tensors and initialises or loads them.
    """

    world_size: int
    rank: int
    device: torch.device
    options: ParallelConfig
    layout: Layout
    mesh: object | None = None  # the dense view of ``meshes``: torch DeviceMesh of ``layout.mesh_shape``
    materialize: Callable[[nn.Module], None] | None = None
    # torch.compile each transformer block after activation checkpointing, before DDP/FSDP
    # (``parallel/compile.py``), in ``parallelize``'s order.
    compile: bool = False
    # The mesh owner (``parallel/mesh.py``): every view and group a dimension uses; None on one process.
    meshes: Any = None
    # Context parallel: where ``chunk_batch`` leaves each batch's whole-sequence mask (parallel.context.cp.CPState).
    cp_state: Any = None

    @property
    def expert_mesh(self) -> Any:
        """The expert-FSDP view when experts are split (``parallel.ep > 1``), else None."""
        return self.meshes.expert_fsdp if self.layout.ep > 1 and self.meshes is not None else None


class Strategy:
    """Base strategy: plain single-process training. Subclasses override what differs.

    One class per data-parallel kind (``impl``), not per name: an instance is bound to one run's
    layout (``get_strategy(layout)``), whose table row (``layout.info``) says what the name adds
    (offload, reshard-after-forward, hybrid mesh) and whose degrees it uses; none is worked out here.
    """

    impl = "single"

    def __init__(self, layout: Layout) -> None:
        if layout.info.impl != self.impl:
            raise ValueError(f"{type(self).__name__} runs the {self.impl!r} strategies, not {layout.strategy!r} "
                             f"(implemented by {layout.info.impl!r})")
        self.layout = layout
        self.name = layout.strategy

    @property
    def info(self) -> StrategyInfo:
        """The table row: mesh dims, what it shards, which models it supports."""
        return self.layout.info

    @property
    def description(self) -> str:
        return self.info.description

    # The steps ``parallelize`` runs, in its order; a strategy overrides the ones it has.
    def split(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        """Pipeline parallel: return the part of ``model`` this rank runs (the whole model here)."""
        return model

    def apply_tp(self, model: nn.Module, ctx: ParallelContext) -> None:
        """Tensor (and sequence) parallel, in place (nothing here)."""

    def wrap(self, model: nn.Module, ctx: ParallelContext) -> nn.Module:
        """Data parallel and meta-device materialisation: the last step (nothing to wrap here)."""
        self.materialize(model, ctx)
        return model

    def materialize(self, module: nn.Module, ctx: ParallelContext) -> None:
        """Allocate and initialise (or load) a meta-device model's tensors; a no-op for a real model.

        Every strategy calls it at its point of the meta-device flow (torchtitan's): after sharding
        for FSDP and TP, so that each rank allocates and fills only its own shards; before wrapping
        for DDP, which needs real tensors to start from. See ``runtime.meta_init``.
        """
        if ctx.materialize is not None:
            ctx.materialize(module)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                       ctx: ParallelContext) -> torch.optim.Optimizer:
        """Return the optimizer to step (ZeRO-1 swaps in a sharded one)."""
        return optimizer

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Context in which backward accumulates local gradients without communicating."""
        yield

    def forward_backward(self, session: Any, model: nn.Module, inputs: torch.Tensor,
                         targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """One micro-batch's forward, loss and backward (inside ``session.accumulate``)."""
        with session.autocast():
            loss = loss_fn(model(inputs), targets)
        session.backward(loss)
        return loss.detach()

    def eval_loss(self, session: Any, model: nn.Module, inputs: torch.Tensor,
                  targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Mean loss of one batch without gradients."""
        with session.autocast():
            return loss_fn(model(inputs), targets).detach()

    def uses_autocast(self) -> bool:
        """Whether mixed precision comes from torch.autocast (True) or from the wrapper itself
        (the layout's rule, ``Layout.casts_with_autocast``)."""
        return self.layout.casts_with_autocast

    def needs_process_group(self) -> bool:
        """Whether this strategy needs a process group and mesh even on a single rank."""
        return False

    def process_group_backend(self, device: torch.device) -> str:
        """Return the torch.distributed backend string for ranks on ``device``."""
        return backend_for(device)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """Return the fp16 loss scaler (sharded strategies all-reduce its found-inf flag)."""
        return torch.amp.GradScaler(device.type)

    def compile_unsupported(self, options: ParallelConfig) -> str | None:
        """Why ``train.compile`` cannot run under this layout with ``options``, or None when it can."""
        return None

    def check_model(self, model: nn.Module) -> None:
        """Raise ConfigError when ``model``'s shape does not fit the layout (a meta model works).

        Called from ``apply`` (the same error on every rank) and by preflight before launch.
        """

    # True where each rank keeps only part of the parameters (pipeline stages): the optimizer
    # passed to Session.prepare drops the parameters this rank does not hold.
    partitions_parameters = False

    def clip_grad_norm(self, model: nn.Module, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
        """Clip gradients to ``max_norm`` (0: only measure) and return the global pre-clip norm."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # a DTensor norm under sharding: materialise it
            norm = norm.full_tensor()
        return norm

    @property
    def replicates_with_ddp(self) -> bool:
        """Whether ``wrap`` puts the model (or each pipeline stage) in torch's DDP."""
        return False

    # ---- hooks for strategies that run an engine of their own (DeepSpeed, parallel/deepspeed/strategy.py)
    # True when backward and the optimizer step go through the strategy (``backward``/``step``).
    owns_step = False

    def preflight(self, cfg: Any, world_size: int, meta: nn.Module | None = None, *,
                  ranks_per_node: int | None = None) -> None:
        """Checks before any rank starts beyond the layout's (packages, disks); raise ConfigError."""

    def initialize_engine(self, session: Any, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """Last step of ``Session.prepare``: return the (model, optimizer) the caller trains with."""
        return model, optimizer

    def backward(self, session: Any, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss (only where ``owns_step``)."""
        raise NotImplementedError

    def step(self, session: Any, optimizer: Any, max_norm: float) -> torch.Tensor:
        """Clip, step and zero the gradients; return the pre-clip norm (only where ``owns_step``)."""
        raise NotImplementedError

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Whole parameters on the CPU where DCP cannot gather them (None: use DCP)."""
        return None

    # Who writes this strategy's checkpoint tensors (runtime/checkpoint/engines.py): PyTorch DCP,
    # or an engine that owns its files ("deepspeed").
    checkpoint_engine = "dcp"

    def generation_unsupported(self) -> str | None:
        """Why ``model.generate`` cannot run under this strategy, or None when it can."""
        return None
