"""DeepSpeed as a data-parallel kind: ZeRO-3 with CPU or NVMe offload, or the user's own config.

Strategies (``parallel.strategy``):

* ``zero3-offload``: ZeRO-3, parameters and optimizer state offloaded to host memory.
* ``zero3-nvme``: ZeRO-Infinity, both swapped to files under ``parallel.nvme_path`` (a fast local
  disk): for models whose state exceeds the host memory of one node. PyTorch has no NVMe offload.
* ``deepspeed``: any stage, from the user's ``parallel.deepspeed_config`` (a ``ds_config.json``;
  ``"auto"`` values filled from shardwise's config, see ``deepspeed_config``).

ZeRO-1/2/3 without offload are not offered as built-in names: ``zero1``, ``zero2`` and ``fsdp`` do
the same with PyTorch alone (and compose with TP/PP); a user who wants DeepSpeed's versions names
them in their own file under ``deepspeed``.

The Session API is unchanged; how each call maps onto the engine (as Accelerate does):

* ``prepare`` -> ``deepspeed.initialize(model, optimizer, config)``. The model stays the engine
  (calling it runs forward; ``session.unwrap`` gives the plain module). The returned optimizer is
  the caller's own optimizer: DeepSpeed steps it on the flat fp32 partitions it owns, so setting
  ``group["lr"]`` and a torch LR scheduler built on it work as usual. With an ``optimizer``
  section in the user's file DeepSpeed builds its own and that one is returned.
* ``backward`` -> ``engine.backward(loss)``, with the accumulation boundary set from
  ``session.sync_gradients``; the engine divides by the accumulation steps (as Session.backward does).
* ``step(optimizer, max_norm)`` -> ``engine.step()``: DeepSpeed clips to ``max_norm`` inside its
  step and zeroes the gradients; the pre-clip norm is returned as a tensor.

Differences from FSDP, by design of DeepSpeed: ``bf16-mixed`` keeps bf16 parameters in forward and
backward with fp32 master weights in the optimizer (FSDP2 casts per unit and keeps fp32
parameters); ``fp16-mixed`` uses DeepSpeed's dynamic loss scaler instead of torch's GradScaler;
``bf16-true`` is refused. ``skip_nonfinite`` decides on the reported norm after the step (DeepSpeed
offers no hook between norm and update), so a NaN step is detected and stops training, not skipped.
Each rank builds the whole model in host memory once before DeepSpeed partitions it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.base import ParallelContext, Strategy
from shardwise.parallel.deepspeed.config import (
    RunValues,
    builtin_config,
    fill,
    nvme_paths,
    offload_devices,
    read_user_config,
)
from shardwise.parallel.deepspeed.setup import (
    build_ops,
    check_deepspeed_installed,
    check_libaio,
    check_nvme_path,
    import_deepspeed,
)


class DeepSpeedStrategy(Strategy):
    """The user's own DeepSpeed config (``parallel.deepspeed_config``)."""

    impl = "deepspeed"
    owns_step = True
    checkpoint_engine = "deepspeed"  # ZeRO partitions in DeepSpeed's own files (runtime/checkpoint/deepspeed_engine.py)

    def __init__(self, layout: Any) -> None:
        super().__init__(layout)
        self.engine: Any = None
        self.ds_config: dict[str, Any] | None = None

    # ------------------------------------------------------------------ config
    def raw_config(self, options: Any) -> tuple[dict[str, Any], str]:
        """The config before filling: the user's file, and how to name it in errors."""
        if not options.deepspeed_config:
            raise ConfigError("strategy 'deepspeed' runs your own DeepSpeed config: set parallel.deepspeed_config "
                              "to your ds_config.json, or choose zero3-offload / zero3-nvme.")
        return read_user_config(options.deepspeed_config), f"parallel.deepspeed_config {options.deepspeed_config!r}"

    def build_config(self, options: Any, values: RunValues) -> dict[str, Any]:
        raw, source = self.raw_config(options)
        return fill(raw, values, source=source)

    def preflight(self, cfg: Any, world_size: int, meta: nn.Module | None = None, *,
                  ranks_per_node: int | None = None) -> None:
        """Before any rank starts: deepspeed installed, the config fills, NVMe usable."""
        check_deepspeed_installed()
        if cfg.parallel.precision == "bf16-true":
            raise ConfigError("DeepSpeed keeps fp32 master weights; parallel.precision 'bf16-true' has no "
                              "DeepSpeed equivalent. Use bf16-mixed (bf16 compute, fp32 master weights) or fp32.")
        t = cfg.train
        values = RunValues(grad_accum_steps=t.grad_accum_steps, dp_size=self.layout.dp,
                           precision=cfg.parallel.precision, micro_batch_size=t.micro_batch_size,
                           lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                           nvme_path=cfg.parallel.nvme_path)
        ds = self.build_config(cfg.parallel, values)
        if "nvme" in offload_devices(ds):
            check_libaio()
            params = sum(p.numel() for p in meta.parameters()) if meta is not None else None
            if params:
                # ZeRO-3 partitions over every rank: this node's disk holds its ranks' share.
                nodes = max(1, world_size // (ranks_per_node or cfg.parallel.nproc or world_size))
                params = -(-params // nodes)
            for path in nvme_paths(ds):
                check_nvme_path(path, params, create=False)

    def run_values(self, session: Any, optimizer: Any) -> RunValues:
        group = optimizer.param_groups[0] if isinstance(optimizer, torch.optim.Optimizer) else {}
        betas = group.get("betas")
        return RunValues(grad_accum_steps=session.grad_accum_steps, dp_size=session.dp_size,
                         precision=session.options.precision,
                         micro_batch_size=session.engine_hints.get("micro_batch_size"),
                         lr=group.get("lr"), betas=tuple(betas) if betas is not None else None,
                         eps=group.get("eps"), weight_decay=session.engine_hints.get("weight_decay"),
                         nvme_path=session.options.nvme_path)

    # ------------------------------------------------------------------ prepare
    def needs_process_group(self) -> bool:
        return True  # deepspeed.comm runs on torch.distributed, even for one rank

    def uses_autocast(self) -> bool:
        return False  # DeepSpeed casts parameters itself (fp16/bf16 sections)

    def grad_scaler(self, device: torch.device) -> Any:
        return None  # DeepSpeed's own dynamic loss scaler runs under fp16

    def compile_unsupported(self, options: Any) -> str | None:
        return "DeepSpeed wraps the model in its engine; train.compile is not wired through it in shardwise"

    def generation_unsupported(self) -> str | None:
        return "ZeRO-3 partitions every parameter; generation would need a gather per layer"

    # ``wrap`` (the base class's) materialises the whole model (host memory under offload); the
    # engine partitions it in initialize_engine, once the optimizer is known.

    def initialize_engine(self, session: Any, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        """``deepspeed.initialize``; return (engine, the optimizer the caller keeps stepping)."""
        deepspeed = import_deepspeed()
        with _quiet_deepspeed():
            build_ops()  # one rank compiles at a time, and a killed build's lock cannot hang this one
        ds = self.build_config(session.options, self.run_values(session, optimizer))
        if "nvme" in offload_devices(ds):
            check_libaio()
            for path in nvme_paths(ds):
                check_nvme_path(path)
        self.ds_config = ds
        own_optimizer = "optimizer" in ds
        kwargs: dict[str, Any] = {"model": model, "config": ds, "dist_init_required": False}
        # One rank started without a launcher (--nproc 1): DeepSpeed insists on the launcher's
        # LOCAL_RANK, which a launcher sets on every rank of a larger run.
        if session.world_size == 1:
            os.environ.setdefault("LOCAL_RANK", "0")
        if own_optimizer:
            groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else None
            kwargs["model_parameters"] = groups or [p for p in model.parameters() if p.requires_grad]
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
        with _quiet_deepspeed():
            engine, ds_optimizer, _, _ = deepspeed.initialize(**kwargs)
        self.engine = engine
        return engine, (engine.optimizer if own_optimizer else optimizer)

    # ------------------------------------------------------------------ step-time
    def backward(self, session: Any, loss: torch.Tensor) -> None:
        engine = self.engine
        engine.set_gradient_accumulation_boundary(session.sync_gradients)
        engine.backward(loss)

    def step(self, session: Any, optimizer: Any, max_norm: float) -> torch.Tensor:
        """One optimizer step through the engine; return the pre-clip global gradient norm."""
        engine = self.engine
        explicit = session.options.deepspeed_config and self.ds_config.get("gradient_clipping") not in (0, 0.0)
        if explicit and max_norm != self.ds_config["gradient_clipping"]:
            raise ConfigError(f"the DeepSpeed config sets gradient_clipping = {self.ds_config['gradient_clipping']}, "
                              f"but the step asks for max_norm = {max_norm} (train.grad_clip). Set it to \"auto\", "
                              "or make them equal.")
        # ZeRO optimizers read clip_grad at step time; max_norm 0 only measures, as with FSDP.
        zero_opt = engine.optimizer
        if hasattr(zero_opt, "clip_grad"):
            zero_opt.clip_grad = float(max_norm)
        engine._config.gradient_clipping = float(max_norm)
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        norm = engine.get_global_grad_norm()
        if norm is None:
            norm = float("nan")
        return torch.as_tensor(norm, dtype=torch.float32).detach().reshape(())

    def clip_grad_norm(self, model: nn.Module, max_norm: float, ctx: ParallelContext) -> torch.Tensor:
        raise ConfigError("under DeepSpeed, gradients are clipped inside session.step(optimizer, max_norm=...) "
                          "(the engine's own step); call that instead of clip_grad_norm.")

    # ------------------------------------------------------------------ state
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, gathered whole, on the CPU (collective)."""
        deepspeed = import_deepspeed()
        module = model.module if hasattr(model, "module") else model
        params = list(module.parameters())
        out: dict[str, torch.Tensor] = {}
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for name, p in module.named_parameters():
                out[name] = p.detach().to("cpu", copy=True)
        for name, b in module.named_buffers():
            out[name] = b.detach().to("cpu", copy=True)
        return out

    def describe_config(self) -> str:
        return json.dumps(self.ds_config, indent=1, sort_keys=True) if self.ds_config else "{}"


class ZeRO3OffloadStrategy(DeepSpeedStrategy):
    """ZeRO-3 with parameters and optimizer state in host memory."""

    impl = "zero3-offload"

    def raw_config(self, options: Any) -> tuple[dict[str, Any], str]:
        if options.deepspeed_config:
            raise ConfigError(f"strategy {self.name!r} builds its own DeepSpeed config; parallel.deepspeed_config "
                              f"= {options.deepspeed_config!r} is used only by strategy 'deepspeed'. Choose one.")
        return {}, f"strategy {self.name}"

    def build_config(self, options: Any, values: RunValues) -> dict[str, Any]:
        self.raw_config(options)
        return builtin_config(self.name, values)


class ZeRO3NVMeStrategy(ZeRO3OffloadStrategy):
    """ZeRO-Infinity: parameters and optimizer state swapped to ``parallel.nvme_path``."""

    impl = "zero3-nvme"

    def build_config(self, options: Any, values: RunValues) -> dict[str, Any]:
        if not options.nvme_path:
            check_nvme_path("")  # raises the "set parallel.nvme_path" message
        return super().build_config(options, values)


@contextlib.contextmanager
def _quiet_deepspeed() -> Any:
    """DeepSpeed logs its whole config and every op load at INFO; shardwise logs the run itself."""
    log = logging.getLogger("DeepSpeed")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)
