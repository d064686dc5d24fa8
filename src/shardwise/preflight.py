"""Checks run once in the launching process, before any rank starts.

A bad strategy/world-size combination, a missing data file or a model whose shape does not fit
the tensor/pipeline degrees would otherwise surface as N copies of the same traceback, possibly
after minutes of start-up. ``train`` and ``verify`` (with or without ``--dry-run``) call
:func:`check_run`; it never modifies the config it is given and returns the resolved one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwise.core.config import replace_in
from shardwise.core.layout import Layout, resolve_layout
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.models.adapter import model_folders
from shardwise.models.hf_config import hf_family
from shardwise.observe.trackers import check_trackers

if TYPE_CHECKING:
    from torch import nn

    from shardwise.core.config import RunConfig
    from shardwise.parallel.base import Strategy
    from shardwise.workloads import Workload


@dataclass(frozen=True)
class Preflight:
    """What the checks resolved: the config (a new object), the layout, the strategy, the workload
    and a meta-device copy of the model (None when its factory cannot build on meta)."""

    config: RunConfig
    layout: Layout
    strategy: Strategy
    workload: Workload
    meta_model: nn.Module | None
    cp_impl: str = "alltoall"  # parallel.cp_impl as this machine resolves it (parallel.context.cp.resolve_cp_impl)


def resolve_config(cfg: RunConfig, world_size: int, *, ranks_per_node: int | None = None
                   ) -> tuple[RunConfig, Layout]:
    """Return (the config with its canonical strategy, the layout) for ``world_size`` ranks.

    Pure (no torch, nothing built): degrees, the pipeline's micro-batches against
    ``train.micro_batch_size``. ``cfg`` is left as it was.
    """
    layout = resolve_layout(cfg.parallel, world_size, ranks_per_node=ranks_per_node)
    layout.check_batch(cfg.train.micro_batch_size)
    return replace_in(cfg, **{"parallel.strategy": layout.strategy}), layout


def check_run(cfg: RunConfig, world_size: int, *, ranks_per_node: int | None = None,
              workload: Workload | None = None, meta: nn.Module | None = None) -> Preflight:
    """Validate ``cfg`` for ``world_size`` ranks; raise a ShardwiseError naming what is wrong.

    ``workload``/``meta``: an already built workload and meta model of ``cfg``'s ``[model]`` and
    ``[data]`` (callers that resolve many runs of one model, e.g. the planner's grid test, build
    them once); by default both are built here.
    """
    from shardwise.parallel.blocks import find_blocks  # defers torch
    from shardwise.parallel.implementations import get_strategy  # defers torch
    from shardwise.parallel.precision import check_precision  # defers torch
    from shardwise.workloads import build_workload  # defers torch

    # This machine's accelerator (bf16 on a GPU without bfloat16), before any rank starts; config
    # validation stays torch-free, so the hardware check lives here with the other pre-launch ones.
    check_precision(cfg.parallel.precision)
    resolved, layout = resolve_config(cfg, world_size, ranks_per_node=ranks_per_node)
    check_observability(resolved, world_size)
    check_debug_collectives(resolved, world_size)
    strategy = get_strategy(layout)
    if cfg.train.objective == "dpo":
        from shardwise.preference.step import check_layout  # defers numpy and torch

        check_layout(layout, strategy, cfg)
    cp_impl = "alltoall"
    if layout.cp > 1:
        import torch  # defers torch

        from shardwise.parallel.context.cp import resolve_cp_impl  # defers torch

        cp_impl = resolve_cp_impl(cfg.parallel.cp_impl, "cuda" if torch.cuda.is_available() else "cpu")
    if cfg.train.compile == "true":  # "auto" turns compile off where it cannot run (runtime.auto)
        import torch  # defers torch

        from shardwise.parallel.compile import check_compile  # defers torch

        check_compile(strategy, resolved.parallel, "cuda" if torch.cuda.is_available() else "cpu")
    if layout.cp > 1 and cfg.model.kind == "hf":
        # A rule that needs no data is checked before the data is read (and tokenised).
        from shardwise.parallel.context.cp import check_cp_family  # defers torch

        try:
            # The last of model.pretrained's folders holds config.json (the base of an adapter folder).
            source = model_folders(cfg.model.pretrained)[-1] if cfg.model.pretrained else cfg.model.hf_config
            family = hf_family(source) if source else ""
        except ConfigError:
            family = ""  # the workload's own checks word a bad config
        if family:
            check_cp_family(family, layout.cp)
    if workload is None:
        # Building the datasets reports a missing or malformed data file here, once.
        workload = build_workload(cfg.model, cfg.data, cfg.lora, cfg.preference)
        meta = meta_model(workload, builtin=cfg.model.kind != "custom")
    if meta is not None:
        pretrained_tensors = getattr(meta, "pretrained_tensors", None)
        if pretrained_tensors is not None:
            # Every weight the model needs is in the folder, with the shape its config builds.
            pretrained_tensors()
        # Heads divisible by tp, no more stages than layers...; without a meta model the same
        # check still runs on every rank in ``Session.prepare``.
        strategy.check_model(meta)
        # The chunked loss and context parallel refuse what they cannot run before launch.
        from shardwise.loss import plan_chunked_head  # defers torch

        plan_chunked_head(meta, cfg.train.loss_chunks, tp=layout.tp, pp=layout.pp, plain_ce=workload.plain_token_ce)
        # Mixture of experts: ep divides every layer's experts (parallel/experts/ep.py; degree rules: the layout).
        from shardwise.parallel.experts.ep import check_moe_model  # defers torch

        check_moe_model(meta, layout, cfg.parallel.activation_checkpointing)
        if layout.cp > 1 and layout.pp > 1 and workload.token_loss:
            from shardwise.models.moe import moe_layers  # defers torch

            if moe_layers(meta):
                # The routers' aux losses count real tokens only (models/moe.py). Without a pipeline
                # a cp rank's chunk carries its real tokens (parallel.context.cp.chunk_batch); a pipeline
                # stage takes its side inputs by name and has no place for them yet.
                raise ConfigError(
                    "a mixture-of-experts model on records or packed rows does not run with context parallel "
                    "and pipeline parallel together (parallel.cp > 1 and parallel.pp > 1) yet: each stage's "
                    "routers would count the rows' padding in the load-balancing loss, which one process "
                    "leaves out. Drop one of the two: cp with ep/tp/fsdp, or pp without cp, both run on this data.")
        if layout.cp > 1:
            from shardwise.parallel.context.cp import check_cp_model  # defers torch

            check_cp_model(meta, layout.cp, layout.tp, cp_impl)
        blocks = find_blocks(meta)
        if blocks is not None:
            layout = layout.with_blocks(len(blocks), blocks.path)
    # The strategy's own checks (DeepSpeed: installed, config fills, NVMe path usable).
    strategy.preflight(resolved, world_size, meta, ranks_per_node=ranks_per_node)
    return Preflight(resolved, layout, strategy, workload, meta, cp_impl)


def check_debug_collectives(cfg: RunConfig, world_size: int, cuda: bool | None = None) -> None:
    """Refuse ``watchdog.debug_collectives`` where torch's collective checker crashes.

    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps the process group in torch's
    ``ProcessGroupWrapper``; on CPU/gloo with several ranks it kills every rank with SIGSEGV (a
    plain DDP script does the same, torch 2.x), so a run that asks for it there would die at its
    first collective. It is meant for NCCL runs on GPUs; one process has no collectives to check.
    """
    if not cfg.watchdog.debug_collectives or world_size < 2:
        return
    if cuda is None:
        import torch  # defers torch

        cuda = torch.cuda.is_available()
    if not cuda:
        raise ConfigError(
            "watchdog.debug_collectives = true runs the ranks with TORCH_DISTRIBUTED_DEBUG=DETAIL, whose "
            "collective checker crashes every rank (SIGSEGV) on CPU/gloo in this torch version; it is "
            "supported on GPUs (NCCL) only. Remove the setting for CPU runs (a hang is still caught by "
            "the watchdog, which names the stuck and the silent ranks).")


def check_observability(cfg: RunConfig, world_size: int) -> None:
    """Tracker extras installed, profiled ranks inside the world; raises ConfigError otherwise."""
    check_trackers(cfg.log.trackers)
    outside = [r for r in cfg.profile.ranks if r >= world_size]
    if cfg.profile.enabled and outside:
        raise ConfigError(f"profile.ranks names rank(s) {outside}, but the job has {world_size} rank(s) "
                          f"(0..{world_size - 1}); list ranks inside it, or [] for all.")


def meta_model(workload: Workload, builtin: bool = False) -> nn.Module | None:
    """The workload's model on the meta device (allocates nothing), or None if it cannot be built there.

    A built-in model (gpt, cnn, hf) always builds on meta, so a failure there is a bad
    ``model.overrides`` value, reported as a ConfigError before any rank starts; so is a TypeError
    from a user factory (overrides it does not take). Otherwise a user factory may legitimately
    need real tensors (it fills weights from numpy), so it only returns None.
    """
    import torch  # defers torch

    try:
        with torch.device("meta"):
            return workload.build_model()
    except ShardwiseError:
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        # A TypeError is a call that does not fit (an override the factory's **kwargs pass on to
        # a constructor that does not take it), not a factory that needs real tensors.
        if builtin or isinstance(e, TypeError):
            raise ConfigError(f"cannot build the model with these model.overrides: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:300] if str(e) else ''}. Check the values.") from None
        return None
