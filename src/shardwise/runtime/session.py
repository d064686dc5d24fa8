"""The per-rank Session: the one object a training script holds.

It reads the standard torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) or
runs as a single process when there is none; picks device and backend; seeds every rank; applies
the parallel strategy in ``prepare``; and offers ``backward``, gradient accumulation, rank-0
printing/logging/progress, and metric all-reduces. The built-in trainer uses only this API.

    session = Session(strategy="fsdp")
    model = session.build(make_model)          # on the meta device: no memory used yet
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer, scheduler = session.prepare(model, optimizer, scheduler)  # shards, then fills them
    loader = session.dataloader(dataset, batch_size=32)
    for x, y in loader:
        with session.accumulate(model):
            loss = loss_fn(model(x.to(session.device)), y.to(session.device))
            session.backward(loss)
        if session.sync_gradients:
            session.step(optimizer, max_norm=1.0)
            scheduler.step()
    session.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce
from torch.nn.parallel import DistributedDataParallel

from shardwise import logs
from shardwise.core.config import FIRST_STEP_TIMEOUT_S, INIT_MODES, ParallelConfig
from shardwise.core.layout import Layout, ranks_per_node, resolve_layout
from shardwise.device import select_device
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.logs import LOGGER_NAME
from shardwise.loss import AUTO_DENSE_LOGITS_BYTES, install_chunked_head, parse_loss_chunks, token_loss_context
from shardwise.models.gpt2_qkv import fused_sources
from shardwise.models.moe import discard_aux_losses, moe_layers
from shardwise.models.names import clean_name
from shardwise.observe.step_phases import StepPhases
from shardwise.parallel.base import ParallelContext, Strategy
from shardwise.parallel.blocks import find_blocks
from shardwise.parallel.compile import check_compile, compile_loss, compile_refusal
from shardwise.parallel.context.cp import CPState, chunk_aligned, chunk_batch, resolve_cp_impl
from shardwise.parallel.implementations import get_strategy
from shardwise.parallel.mesh import build_meshes
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.precision import check_precision, storage_dtype
from shardwise.parallel.ties import check_ties, tied_groups
from shardwise.runtime import lifeline
from shardwise.runtime.auto import resolve_compile, resolve_precision
from shardwise.runtime.checkpoint.background import BackgroundWriter, close_writer, resolve_mode, summarize
from shardwise.runtime.checkpoint.engines import engine_for
from shardwise.runtime.checkpoint.load import load_checkpoint
from shardwise.runtime.checkpoint.pieces import standard_pieces
from shardwise.runtime.checkpoint.save import prepare_save, save_checkpoint
from shardwise.runtime.collective import raise_on_every_rank
from shardwise.runtime.data import ShardedLoader
from shardwise.runtime.identity import launch_id as launch_id_from_env
from shardwise.runtime.ledger import grad_bytes
from shardwise.runtime.meta_init import MetaInitUnsupported, is_meta_module, record_build
from shardwise.runtime.progress import ProgressBar
from shardwise.runtime.scheduler import prepare_scheduler, scheduler_state
from shardwise.runtime.watchdog import Watchdog

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "mean": dist.ReduceOp.SUM}


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer.") from None


def seed_everything(seed: int) -> None:
    """Seed Python, torch (CPU and CUDA) and numpy, when present, with ``seed``."""
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np  # defers numpy

        np.random.seed(seed % 2**32)


class Session:
    """One rank's view of a (possibly distributed) training job."""

    def __init__(self, strategy: str = "auto", *, precision: str | None = None,
                 grad_accum_steps: int = 1, seed: int = 1337,
                 parallel: ParallelConfig | None = None,
                 collective_timeout_s: float = 1800.0, launch_id: str | None = None,
                 compile: bool | str = "auto", loss_chunks: int | str = "auto", steps: int | None = None) -> None:
        options = parallel or ParallelConfig()
        # The caller's config is never modified: the arguments make a new one.
        if parallel is None or strategy != "auto":
            options = dataclasses.replace(options, strategy=strategy)
        if precision is not None:
            # Fabric/Accelerate spellings ("bf16", "16-mixed", "32-true", ...) as in a config file.
            rule = next(f for f in dataclasses.fields(ParallelConfig) if f.name == "precision").metadata["rule"]
            options = dataclasses.replace(options, precision=rule.canonical(precision))
        if grad_accum_steps < 1:
            raise ConfigError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}.")
        self.options = options
        # torch.compile each transformer block in prepare() (and the loss, see compile_loss); "auto"
        # is resolved below, once the device and strategy are known (``steps``: the run's length,
        # for its estimate; shardwise.runtime.auto).
        self.compile = False
        self._collective_timeout_s = collective_timeout_s
        # Chunked output head + cross-entropy (shardwise.loss), installed on the model in prepare().
        self.loss_chunks = loss_chunks
        parse_loss_chunks(loss_chunks)
        self.loss_plan: Any = None
        # Names this job in heartbeats and checkpoint manifests (see runtime.identity): the
        # watchdog signals only ranks of this launch, and saves rotate only this job's checkpoints.
        self.launch_id = launch_id or launch_id_from_env()
        self.rank = _env_int("RANK", 0)
        if dist.is_initialized():  # the caller's process group (any backend, e.g. the "fake" one) wins
            self.rank = dist.get_rank()
        if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
            # A rank started by torchrun (or `shardwise launch`) dies with its agent and launcher.
            lifeline.start(f"rank {self.rank}")
        if not logs.is_configured():  # the application's (or the trainer's) own setup wins
            logs.configure(self.rank)
        self.world_size = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", 1)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        self.device = select_device(self.local_rank)
        # parallel.precision / train.compile = "auto": decided for this device (shardwise.runtime.auto).
        precision_choice = resolve_precision(options.precision, self.device)
        options = self.options = dataclasses.replace(options, precision=precision_choice.value)
        if precision_choice.auto:
            self.log(f"parallel.precision = 'auto' -> {precision_choice.value!r} ({precision_choice.reason})")
        # Ranks per node (torchrun's LOCAL_WORLD_SIZE; the layout owns the rule): HSDP's default
        # shard group, and the planner's intra-node links in the trainer's prediction.
        self.ranks_per_node = ranks_per_node(self.world_size, nproc=options.nproc,
                                             local_world_size=_env_int("LOCAL_WORLD_SIZE", 0))
        # Every degree of this run, resolved once; the strategy, the mesh and the data loader read it.
        self.layout: Layout = resolve_layout(options, self.world_size, ranks_per_node=self.ranks_per_node)
        self.strategy: Strategy = get_strategy(self.layout)
        check_precision(options.precision, self.device.type)
        self.compile_choice = resolve_compile(compile, self.device, steps=steps,
                                              unsupported=compile_refusal(self.strategy, options, self.device.type))
        self.compile = bool(self.compile_choice.value)
        if self.compile_choice.auto:
            self.log(f"train.compile = 'auto' -> {str(self.compile).lower()} ({self.compile_choice.reason})")
        self.backend = self.strategy.process_group_backend(self.device)
        self.strategy_name = self.strategy.name
        self.grad_accum_steps = grad_accum_steps
        self._micro_step = 0
        self._owns_group = False
        self._closed = False
        self._prepared = False
        self._scaler: torch.amp.GradScaler | None = None
        self.model: nn.Module | None = None
        self._routes: bool | None = None  # the prepared model has MoE routers (decided at its first cp batch)
        # The LR scheduler prepare() returned; save() and load() include it unless told otherwise.
        self.scheduler: Any = None
        # More pieces every save()/load() includes, by name (runtime.checkpoint.pieces): one entry
        # adds something to the checkpoint, e.g. ``session.checkpoint_pieces["ema"] = EmaPiece(ema)``.
        self.checkpoint_pieces: dict[str, Any] = {}
        # What save()/load() cover by default: the optimizer prepare() returned, the
        # training loader (the first dataloader() not made with shuffle=False) and the number of
        # step() calls (restored by load()).
        self.optimizer: torch.optim.Optimizer | None = None
        self.loader: ShardedLoader | None = None
        self.steps_taken = 0
        self._watchdog: Any = None  # a runtime.watchdog.Watchdog once watch() was called
        # Bytes held by gradients just before the last zero_grad (read by the memory ledger).
        self.last_grad_bytes = 0
        # What build() recorded: (the meta model, its init program); None for an eager build.
        self._built: tuple[nn.Module, Any] | None = None
        # Notes for the run's log (e.g. why a model could not be built on the meta device).
        self.notes: list[str] = []
        # Whether checkpoints leave out frozen parameters (LoRA on a pretrained model: the base
        # comes from model.pretrained every time and is never saved again).
        self.trainable_only = False
        # The last step's pre-clip gradient norm as a device tensor (reading it needs no host
        # sync until someone asks), and whether that step was skipped as non-finite.
        self.last_grad_norm: torch.Tensor | None = None
        self.last_step_skipped = False
        # What an engine strategy (DeepSpeed) fills its "auto" values from, set before prepare():
        # micro_batch_size, weight_decay (the built-in trainer sets them; see parallel/deepspeed/strategy.py).
        self.engine_hints: dict[str, Any] = {}
        # observe.step_phases.StepPhases once time_phases() was called: forward_backward, step and
        # save mark their phases in it.
        self.phases: Any = None
        # Set before prepare() by a caller that allocates a meta-built model's (shards of) tensors
        # itself, as ``allocate(module, device)``; the recorded initialisation is then not replayed.
        # The rehearsal (shardwise.rehearse) allocates fake tensors this way.
        self.allocate: Callable[[nn.Module, torch.device], None] | None = None
        # How save() writes by default ("sync" or "async"/"async-pinned": staged, then written in
        # the background; see set_checkpoint_mode), the background writer once used, and how
        # long the last save() blocked the caller (seconds: waiting for the previous save,
        # taking the state and staging it; the whole write when synchronous).
        self.checkpoint_mode = "sync"
        self._ckpt_writer: Any = None
        self._pinned_staging = False
        self.last_save_blocked_s = 0.0

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if (self.world_size > 1 or self.strategy.needs_process_group()) and not dist.is_initialized():
            group_args: dict[str, Any] = {}
            if self.world_size == 1 and "MASTER_ADDR" not in os.environ:
                # One rank started without torchrun (e.g. fsdp-offload on one GPU): an in-memory
                # store replaces the rendezvous.
                group_args = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
            dist.init_process_group(
                self.backend, timeout=datetime.timedelta(seconds=collective_timeout_s),
                device_id=self.device if self.device.type == "cuda" else None, **group_args,
            )
            self._owns_group = True
        # Every mesh and process group of the run, built once by the one owner (parallel/mesh.py).
        self.meshes = self._build_meshes()
        self.mesh = self.meshes.dense if self.meshes is not None else None
        self.dp_rank, self.dp_size = self.layout.dp_coords(self.rank)
        # Context parallel: which sequence chunk this rank holds (the layout's coordinate) and how.
        self.cp_state: Any = None  # parallel.context.cp.CPState: the whole-sequence mask of the batch being run
        self.cp_impl = "alltoall"  # parallel.cp_impl resolved (parallel.context.cp.resolve_cp_impl)
        self.cp_rank = self.layout.cp_rank(self.rank)
        if self.layout.cp > 1:
            self.cp_impl = resolve_cp_impl(options.cp_impl, self.device.type)
            self.cp_state = CPState(self.cp_impl)
        self.ctx = ParallelContext(self.world_size, self.rank, self.device, options, self.layout, self.mesh,
                                   compile=self.compile, meshes=self.meshes, cp_state=self.cp_state)
        # Same seed on every rank: models initialise identically, so replicas start in sync.
        self.seed = seed
        seed_everything(seed)

    # ------------------------------------------------------------------ identity
    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints, logs and writes run files."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def uses_loss_scaling(self) -> bool:
        """True under fp16-mixed: a loss scaler skips steps whose gradients overflow (by design)."""
        return self._scaler is not None

    def _build_meshes(self) -> Any:
        if self.world_size == 1 and not dist.is_initialized():
            return None
        return build_meshes(self.layout, self.device.type)

    # ------------------------------------------------------------------ build
    def build(self, factory: Callable[[], nn.Module], *, init: str = "meta") -> nn.Module:
        """Return the model ``factory()`` builds, on the meta device unless ``init="eager"``.

        With ``init="meta"`` nothing is allocated yet: the construction is recorded, and
        ``prepare`` applies the strategy to the meta model, then allocates only this rank's shards
        and fills them by replaying the recorded initialisation (the same random draws as an eager
        build, so the same weights for the same seed), or by reading a pretrained model's files
        (``build_hf_model(pretrained=...)``). Build the optimizer on the returned model's
        parameters as usual; ``prepare`` re-points it. A factory that cannot run on the meta
        device (it reads tensor values while building) is built eagerly instead; ``notes`` says why.
        """
        if init not in INIT_MODES:
            raise ConfigError(f"init must be one of {', '.join(INIT_MODES)}, got {init!r}.")
        if self._prepared:
            raise ShardwiseError("session.build() comes before session.prepare().")
        if init == "eager":
            return factory()
        try:
            model, program = record_build(factory)
        except ShardwiseError:
            raise  # a config mistake (bad pretrained folder, LoRA targets...): the same on any device
        except Exception as e:  # noqa: BLE001 - any factory that fails on meta is built eagerly instead
            reason = str(e) if isinstance(e, MetaInitUnsupported) else f"{type(e).__name__}: {e}"
            self.notes.append(f"the model cannot be built on the meta device ({reason}); every rank builds "
                              "it whole instead (as with model.init = 'eager')")
            return factory()
        self._built = (model, program)
        return model

    def _materializer(self, model: nn.Module) -> Callable[[nn.Module], None] | None:
        """The strategy's hook that allocates and fills a meta model's (shards of) tensors, or None."""
        if self._built is None or self._built[0] is not model:
            if is_meta_module(model):
                raise ShardwiseError(
                    "the model passed to prepare() is on the meta device but was not built by "
                    "session.build(factory): shardwise cannot know its initial values. Build it with "
                    "model = session.build(factory), or pass a model with real tensors.")
            return None
        program = self._built[1]
        if self.allocate is not None:
            allocate, target = self.allocate, torch.device("cpu") if self.layout.offload else self.device
            return lambda module: allocate(module, target)
        # Pretrained tensors are read from their files after the replay, which leaves them out.
        loaded = set(model.pretrained_tensors()) if hasattr(model, "pretrained_tensors") else set()
        # fsdp-offload keeps its shards in host memory.
        device = torch.device("cpu") if self.layout.offload else self.device

        def materialize(module: nn.Module) -> None:
            program.materialize(module, device, skip=loaded, name_of=clean_name)
            load = getattr(module, "load_pretrained", None)
            if loaded and load is not None:
                load()

        return materialize

    # ------------------------------------------------------------------ prepare
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | Callable | None = None,
                scheduler: Any = None) -> tuple[Any, ...]:
        """Apply the strategy to ``model``; return (model, optimizer), or (model, optimizer, scheduler).

        ``optimizer`` may be an optimizer built on the plain model's parameters (its param groups
        are re-pointed, by parameter name, at the parallelised parameters) or a callable that
        takes the parallelised model's parameters and returns an optimizer.

        ``scheduler`` (optional) is an LR scheduler built on that optimizer, re-pointed at the
        optimizer returned here (ZeRO-1 returns another one), or a callable ``optimizer ->
        scheduler`` called with the returned optimizer (right under every strategy, including those
        that regroup parameters). ``save``/``load`` then checkpoint its state as well.
        """
        if isinstance(model, nn.DataParallel):
            raise ConfigError(
                "the model is wrapped in torch.nn.DataParallel, which shardwise does not use: it "
                "runs one process that scatters each batch over GPUs and is slower than DDP. Pass the "
                "plain model (model.module) to session.prepare(); launch one process per GPU with "
                "`shardwise launch --nproc N script.py` and choose --strategy ddp (or a sharded one)."
            )
        if self._prepared:
            raise ShardwiseError("session.prepare() was already called; prepare one model per session.")
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer.state:
            raise ShardwiseError(
                "the optimizer already has state (a step was taken); create it fresh and call "
                "session.prepare() before training so its state matches the parallelised parameters."
            )
        given = optimizer
        groups_before = len(optimizer.param_groups) if isinstance(optimizer, torch.optim.Optimizer) else 0
        # Every name of each parameter: a pipeline's last stage holds a tied head without its
        # embedding, i.e. under the tie's second name (parallel/pipeline/ties.py).
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        # The same model, and so the same error, on every rank: a shape that does not fit the
        # degrees (heads vs tp, layers vs pipeline stages) fails here, before anything is moved.
        self.strategy.check_model(model)
        self.check_lora(model)
        if self.compile:
            check_compile(self.strategy, self.options, self.device.type)
        materialize = self._materializer(model)
        blocks = find_blocks(model)
        if blocks is not None:
            self.layout = self.layout.with_blocks(len(blocks), blocks.path)
        self.ctx = dataclasses.replace(self.ctx, layout=self.layout, materialize=materialize)
        # A pretrained model's frozen base is read from its folder at every start: checkpoints
        # hold only what trains (the adapters).
        self.trainable_only = (getattr(model, "pretrained", None) is not None
                               and any(not p.requires_grad for p in model.parameters()))
        if materialize is None and not self.strategy.partitions_parameters:
            # Pipeline stages move only their own layers, after the strategy drops the rest, so a
            # model larger than one device's memory never has to fit on it whole.
            model = model.to(self.device)
        if storage_dtype(self.options.precision) is not None:
            # bf16-true: parameters, gradients and optimizer state all live in bfloat16. ``to``
            # converts in place, so an optimizer built on these parameters still points at them.
            model = model.to(storage_dtype(self.options.precision))
        # The chunked loss head replaces the model's head on the whole, plain model (it changes no
        # parameter; a pipeline's last stage keeps it).
        self.loss_plan = install_chunked_head(model, self.loss_chunks, tp=self.layout.tp, pp=self.layout.pp)
        if self.loss_plan.enabled:
            self.notes.append(
                "loss: output head + cross-entropy in chunks (train.loss_chunks = "
                f"{self.loss_chunks}); the whole logits tensor is never built" if self.loss_plan.chunks else
                "loss: output head + cross-entropy in chunks for micro-batches whose fp32 logits would exceed "
                f"{AUTO_DENSE_LOGITS_BYTES / 2**30:g} GiB (train.loss_chunks = auto); smaller ones build the "
                "logits whole, which is faster")
        # The one parallelize order (parallel/parallelize.py): split -> TP -> CP -> EP -> AC -> compile -> DP.
        ties = tied_groups(model)
        prepared = parallelize(model, self.strategy, self.ctx)
        check_ties(prepared, ties, clean_name)  # a tied embedding/head is still one tensor, in one unit
        self.ctx = dataclasses.replace(self.ctx, materialize=None)
        self._built = None  # the program held CPU constants; the model is real now
        if isinstance(optimizer, torch.optim.Optimizer):
            self._repoint_optimizer(optimizer, names, prepared,
                                    allow_missing=self.strategy.partitions_parameters)
        elif callable(optimizer):
            optimizer = optimizer(prepared.parameters())
            groups_before = len(optimizer.param_groups)
        if optimizer is not None:
            optimizer = self.strategy.wrap_optimizer(optimizer, prepared, self.ctx)
        # An engine (DeepSpeed) takes over model and optimizer here; a no-op for the others.
        prepared, optimizer = self.strategy.initialize_engine(self, prepared, optimizer)
        if self.options.precision == "fp16-mixed":
            self._scaler = self.strategy.grad_scaler(self.device)
        self.model = prepared
        self.optimizer = optimizer
        self._prepared = True
        if scheduler is None:
            return prepared, optimizer
        scheduler, error = prepare_scheduler(scheduler, given, optimizer, groups_before)
        if self.is_distributed:
            # Pipeline stages regroup different parameters: a refusal on one rank is one on all.
            raise_on_every_rank(error, ShardwiseError)
        elif error:
            raise ShardwiseError(error)
        self.scheduler = scheduler
        return prepared, optimizer, scheduler

    def check_lora(self, model: nn.Module) -> None:
        """Raise ConfigError where LoRA adapters cannot run under this layout."""
        if getattr(model, "lora", None) and self.layout.sequence_parallel:
            raise ConfigError(
                "LoRA adapters do not run with parallel.sequence_parallel: the adapters' matmuls would "
                "need their own sequence-parallel layouts. Unset sequence_parallel (tensor parallel alone "
                "works with LoRA).")

    def compile_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Return ``loss_fn`` compiled when this session compiles (``compile=True``), else as is.

        Under tensor parallelism the loss stays eager: it runs on vocabulary-sharded DTensor logits
        inside ``loss_parallel``, whose tracing in torch 2.13 fails a stride check on the sharded
        logits' fake tensors (the blocks, where the time goes, are still compiled).
        """
        if not self.compile or self.layout.tp > 1:
            return loss_fn
        return compile_loss(loss_fn)

    @staticmethod
    def _repoint_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, list[str]],
                           prepared: nn.Module, allow_missing: bool = False) -> None:
        """Swap the optimizer's parameters for the parallelised ones with the same names."""
        new_params = {}
        for n, p in prepared.named_parameters():
            new_params[clean_name(n)] = p  # without DDP's "module." and checkpoint-wrapper prefixes
        # A parameter the strategy cut in slices (GPT-2's c_attn as q/k/v under TP, parallel/tensor/gpt2.py)
        # is optimized as its slices, in the same param group.
        by_name = dict(prepared.named_parameters())
        sliced: dict[str, list[torch.Tensor]] = {}
        for part, piece in fused_sources(prepared).items():
            if part in by_name:
                sliced.setdefault(clean_name(piece.source), []).append(by_name[part])
        for group in optimizer.param_groups:
            swapped = []
            for p in group["params"]:
                aliases = names.get(id(p), [])
                name = next((n for n in aliases if n in new_params), aliases[0] if aliases else None)
                if name is not None and name not in new_params and name in sliced:
                    swapped.extend(sliced[name])
                    continue
                if allow_missing and name is not None and name not in new_params:
                    continue  # another pipeline stage holds (and optimizes) this parameter
                if name is None or name not in new_params:
                    raise ShardwiseError(
                        "the optimizer holds a parameter that is not in the model passed to prepare(); "
                        "build the optimizer from model.parameters() of that same model."
                    )
                swapped.append(new_params[name])
            group["params"] = swapped

    # ------------------------------------------------------------------ step-time API
    @property
    def sync_gradients(self) -> bool:
        """True when the current micro-batch is the last of its accumulation window."""
        return self._micro_step % self.grad_accum_steps == 0

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module | None = None) -> Iterator[None]:
        """Wrap one micro-batch's forward+backward; gradient sync happens on the last one only.

        With ``parallel.grad_sync = "microbatch"`` every micro-batch synchronises: sharded
        strategies then reduce-scatter each micro-batch's gradients instead of accumulating whole
        unsharded fp32 gradients until the last one (for models whose full gradient does not fit).
        """
        self._micro_step += 1
        model = model or self.model
        if self.sync_gradients or model is None or self.options.grad_sync == "microbatch":
            yield
        else:
            with self.strategy.no_sync(model):
                yield

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision context for the forward pass (a no-op where the strategy casts itself)."""
        prec = self.options.precision
        if prec in ("bf16-mixed", "fp16-mixed") and self.strategy.uses_autocast():
            dtype = torch.bfloat16 if prec == "bf16-mixed" else torch.float16
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, the mean loss of one micro-batch.

        Dividing by ``grad_accum_steps`` makes the accumulated gradient the mean over all
        micro-batches; DDP/FSDP then average over data-parallel ranks. With equal-sized
        micro-batches that is exactly sum(loss over the global batch) / global token count, i.e.
        the gradient of one big batch: grad = (1/(R*A)) * sum_r sum_a grad(mean_loss[r, a]).
        """
        if self.strategy.owns_step:  # the engine divides by the accumulation steps itself
            self.strategy.backward(self, loss)
            return
        scaled = loss / self.grad_accum_steps
        if self._scaler is not None:
            scaled = self._scaler.scale(scaled)
        scaled.backward()

    def forward_backward(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Run forward, loss and backward for one micro-batch; return the detached mean loss.

        Equivalent to ``session.backward(loss_fn(model(inputs), targets))`` under autocast and
        ``accumulate``; strategies that cannot split forward from backward (pipeline parallel
        runs both inside its schedule) implement it themselves, so loops written on this call
        work under every strategy.
        """
        inputs, targets = self._cp_chunk(inputs, targets)
        discard_aux_losses()  # this micro-batch's loss takes its own forward's MoE aux losses only
        timed = self.phases.forward_backward() if self.phases is not None else contextlib.nullcontext()
        with self.accumulate(model), self._loss(model, loss_fn, targets) as loss_fn, timed:
            return self.strategy.forward_backward(self, model, inputs, targets, loss_fn)

    @torch.no_grad()
    def eval_loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Mean loss of one batch without gradients (this rank's part; reduce it yourself)."""
        if self._watchdog is not None:
            self._watchdog.beat(phase="eval")
        inputs, targets = self._cp_chunk(inputs, targets)
        discard_aux_losses()
        with self._loss(model, loss_fn, targets) as loss_fn:
            return self.strategy.eval_loss(self, model, inputs, targets, loss_fn)

    def _cp_chunk(self, inputs: Any, targets: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """This rank's sequence chunk of a batch under context parallel (the batch itself otherwise);
        a packed/padded batch's whole-sequence mask goes to the attention (parallel.context.cp.chunk_batch)."""
        if self.layout.cp == 1:
            return inputs, targets
        # The chunk's real tokens go to an MoE model's routers only (another model never sees the key),
        # and not through a pipeline, whose stages take their side inputs by name (parallel/pipeline/hf.py;
        # preflight refuses MoE + cp + pp on padded rows).
        if self._routes is None:
            self._routes = self.model is not None and bool(moe_layers(self.model))
        return chunk_batch(inputs, targets, self.cp_rank, self.layout.cp, self.cp_state,
                           positions=self.layout.pp > 1, real_tokens=self.layout.pp == 1 and self._routes)

    def sequence_chunk(self, t: torch.Tensor, fill: int) -> torch.Tensor:
        """This rank's part of a ``(B, T)`` tensor aligned with a batch's tokens, cut as
        ``forward_backward`` and ``eval_loss`` cut the batch's targets under context parallel (``t``
        itself without it); ``fill`` pads it where the batch is padded to a multiple of the cp chunks.

        A loss over whole sequences (a sequence's summed log-prob, as DPO's) needs what it groups
        tokens by cut the same way as the labels, then ``sequence_sum`` of its partial sums."""
        if self.layout.cp == 1:
            return t
        return chunk_aligned(t, self.cp_rank, self.layout.cp, self.cp_impl, fill)

    def sequence_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the context-parallel ranks of ``t``, each rank's partial per-sequence values
        (``t`` itself without cp); differentiable: every rank then computes the same whole-sequence
        loss, and the backward (a sum of the ranks' gradients, averaged over the data-parallel ranks
        that include the cp ranks) gives each parameter the gradient of that loss."""
        if self.layout.cp == 1:
            return t
        group, _ = self.meshes.cp_group()
        return all_reduce(t, group=group)

    def _loss(self, model: nn.Module, loss_fn: Callable, targets: torch.Tensor) -> Any:
        """The loss to call on ``model(inputs)``: per-token losses of the chunked head where it is on."""
        if self.loss_plan is None or not self.loss_plan.enabled:
            return contextlib.nullcontext(loss_fn)
        return token_loss_context(model, loss_fn, targets)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip gradients to ``max_norm`` (0: only measure) and return the total norm."""
        assert self.model is not None, "call session.prepare() first"
        # The strategy knows which ranks hold the other parts of the norm (TP shards, PP stages).
        return self.strategy.clip_grad_norm(self.model, max_norm, self.ctx)

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float = 0.0, *,
             skip_nonfinite: bool = False, loss: torch.Tensor | None = None,
             measure_grad_bytes: bool = True) -> torch.Tensor:
        """Unscale (fp16), clip, step and zero the gradients; return the pre-clip gradient norm as a
        0-dim tensor on the device.

        Nothing here waits for the device (except what the options below say): the norm stays a
        tensor, so a loop that does not log this step queues its work and moves on. Call
        ``float(norm)`` when you log it; that is a host-device sync. (Earlier versions returned
        a float, i.e. synchronised every step.)

        ``measure_grad_bytes``: record the gradients' bytes for the memory ledger
        (``last_grad_bytes``, read by ``ledger.collect``); a walk over the parameters in Python, so
        a loop that cares about per-step overhead passes True only on the steps it logs (the
        built-in trainer does), and always on its last step.

        ``skip_nonfinite=True``: when the gradient norm (or ``loss``, if given) is NaN/inf on any
        rank, the optimizer step is skipped on every rank (``last_step_skipped``) and the gradients
        are dropped. That decision costs one tiny all-reduce and a host sync per step. Under
        fp16-mixed the loss scaler already skips steps with non-finite gradients (and lowers its
        scale), so only ``loss`` decides there.
        """
        self.wait_staged()  # a background save may still be copying the weights this step changes
        if self.phases is not None:
            self.phases.start("optimizer")
        if self.strategy.owns_step:
            return self._phase_done("optimizer", self._engine_step(optimizer, max_norm, skip_nonfinite, loss))
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)
        norm_t = self.clip_grad_norm(max_norm)
        self.last_grad_norm = (norm_t.full_tensor() if hasattr(norm_t, "full_tensor") else norm_t).detach()
        self.last_step_skipped = False
        if skip_nonfinite:
            bad = torch.zeros((), device=self.device)
            if self._scaler is None:
                bad = bad + (~torch.isfinite(self.last_grad_norm.to(self.device))).float()
            if loss is not None:
                bad = bad + (~torch.isfinite(loss.detach().to(self.device))).float()
            # Every rank must take the same branch: ZeRO-1's step is a collective.
            self.last_step_skipped = bool(self.all_reduce(bad, op="max") > 0)
        if self.last_step_skipped:
            if self._scaler is not None:
                self._scaler.update()  # the unscale above is consumed; the next step unscales anew
        elif self._scaler is not None:
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            optimizer.step()
        if self.model is not None and measure_grad_bytes:
            self.last_grad_bytes = grad_bytes(self.model)
        optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        if self._watchdog is not None:
            self._watchdog.beat(phase="train")
        return self._phase_done("optimizer", self.last_grad_norm)

    def _phase_done(self, phase: str, result: Any) -> Any:
        """Close ``phase`` in the step-phase timer (if any); return ``result``."""
        if self.phases is not None:
            self.phases.stop(phase)
        return result

    def time_phases(self) -> Any:
        """Start timing this rank's step phases; return the ``observe.step_phases.StepPhases``.

        Collective (it learns every rank's host name). Call after ``prepare``; then mark each step
        with ``phases.begin_step()`` / ``phases.end_step(data_wait_s)``, and call ``phases.window()``
        on every rank at each logging step: rank 0 gets the slowest rank and spread per phase, and a
        line naming a consistently slow rank. The built-in trainer does all of this.
        """
        assert self.model is not None, "call session.prepare() first"
        if self.phases is None:
            self.phases = StepPhases(self.rank, self.world_size, self.device, is_distributed=self.is_distributed)
            self.phases.attach(self.model)
        return self.phases

    def _engine_step(self, optimizer: Any, max_norm: float, skip_nonfinite: bool,
                     loss: torch.Tensor | None) -> torch.Tensor:
        """``step`` under an engine strategy: the engine clips, steps and zeroes the gradients."""
        self.last_grad_norm = self.strategy.step(self, optimizer, max_norm)
        # The engine decides inside its step; a non-finite norm or loss is reported (and the
        # trainer stops on it) rather than skipped: see parallel/deepspeed/strategy.py.
        self.last_step_skipped = False
        if self._watchdog is not None:
            self._watchdog.beat(phase="train")
        return self.last_grad_norm

    # ------------------------------------------------------------------ data
    def dataloader(self, dataset: Any, batch_size: int, *, shuffle: bool | None = None,
                   seed: int | None = None, num_workers: int = 0,
                   collate_fn: Callable[[list[Any]], Any] | None = None) -> ShardedLoader:
        """Return a loader over this rank's disjoint share of ``dataset``; its epoch advances by itself.

        ``dataset`` is map-style (shuffled per epoch unless ``shuffle=False``) or an
        ``IterableDataset`` (read in stream order: each rank keeps its slice of every global batch
        window, see ``runtime.data.StreamShard``). ``collate_fn`` turns a list of items into a batch
        (default: stack tensors, and tuples/dicts of tensors field by field).
        """
        loader = ShardedLoader(dataset, batch_size, self.dp_size, self.dp_rank, shuffle=shuffle,
                               seed=self.seed if seed is None else seed, num_workers=num_workers,
                               pin_memory=self.device.type == "cuda", collate_fn=collate_fn)
        if self.loader is None and shuffle is not False:
            self.loader = loader  # the training loader: save()/load() record its position
        return loader

    def to_device(self, batch: Any) -> Any:
        """Return ``batch`` with every tensor moved to this rank's device (dicts, lists, tuples kept)."""
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, Mapping):  # a dict (or a BatchEncoding) comes back as a plain dict
            return {k: self.to_device(v) for k, v in batch.items()}
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*(self.to_device(v) for v in batch))
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(v) for v in batch)
        return batch

    # ------------------------------------------------------------------ collectives for metrics
    def all_reduce(self, value: float | torch.Tensor, op: str = "mean") -> Any:
        """Reduce a metric over all ranks (mean/sum/max/min); returns the same type it was given."""
        if op not in _REDUCE_OPS:
            raise ConfigError(f"unknown reduce op {op!r}; valid: {', '.join(_REDUCE_OPS)}.")
        is_tensor = isinstance(value, torch.Tensor)
        t = value.detach().clone() if is_tensor else torch.tensor(float(value), dtype=torch.float64)
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        if self.is_distributed:
            t = t.to(self.device)
            dist.all_reduce(t, op=_REDUCE_OPS[op])
            if op == "mean":
                t = t / self.world_size
        return t if is_tensor else float(t)

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    # ------------------------------------------------------------------ rank-0 helpers
    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def log(self, message: str, level: int = logging.INFO) -> None:
        """Log ``message`` on the ``shardwise`` logger (``shardwise.logs``): rank 0 only unless
        ``[log] all_ranks``; by default a ``[HH:MM:SS]`` line on stderr, so stdout stays for results."""
        logging.getLogger(LOGGER_NAME).log(level, message)

    def progress(self, total: int, desc: str = "", enabled: bool = True,
                 initial: int = 0) -> ProgressBar:
        """A progress bar drawn by rank 0 only (a silent one on the other ranks)."""
        return ProgressBar(total, desc=desc, enabled=enabled and self.is_main, initial=initial)

    def main_first(self) -> contextlib.AbstractContextManager:
        """Run the block on rank 0 first, then on the others (e.g. download or preprocess once)."""
        @contextlib.contextmanager
        def _cm() -> Iterator[None]:
            if not self.is_main:
                self.barrier()
            yield
            if self.is_main:
                self.barrier()
        return _cm()

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike, model: nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None,
             state: dict[str, Any] | None = None, loader: ShardedLoader | None = None,
             scheduler: Any = None, keep_last: int = 0,
             on_written: Callable[[Any], None] | None = None, async_: bool | None = None) -> Any:
        """Write a sharded checkpoint of ``step`` under the checkpoints root ``path``; return its dir.

        Collective (call on every rank). Saves model, optimizer, the loader's position, the LR
        scheduler (``scheduler``, default: the one prepare() returned; as JSON), every rank's RNG
        streams, the loss scaler and ``state`` (JSON data), and publishes atomically:
        ``path/latest`` names it only once it is complete. See ``runtime.checkpoint``.
        Defaults cover what the session prepared: the model and optimizer
        prepare() returned, the training loader (the first ``dataloader()`` not made with
        ``shuffle=False``) and, for ``step``, the number of ``step()`` calls so far.

        ``async_`` (default: ``checkpoint_mode``): stage the state into host memory, return at
        once with a ``SaveHandle`` (``wait()`` gives the path once published) and write in the
        background (runtime.checkpoint.background). A save first waits for one in flight and
        raises its CheckpointError if it failed.
        """
        t0 = time.perf_counter()
        self.wait_checkpoint()
        wait_s = time.perf_counter() - t0
        use_async = self.checkpoint_mode != "sync" if async_ is None else bool(async_)

        model = model or self.model
        assert model is not None, "call session.prepare() first, or pass the model"
        # Everything the session prepared is saved unless told otherwise; the step defaults to
        # the number of step() calls (restored by load()).
        scheduler = scheduler if scheduler is not None else self.scheduler
        optimizer = optimizer if optimizer is not None else self.optimizer
        loader = loader if loader is not None else self.loader
        step = self.steps_taken if step is None else step
        pieces = {**standard_pieces(model, optimizer, loader=loader, scheduler=scheduler, state=state,
                                    scaler=self._scaler, trainable_only=self.trainable_only),
                  **self.checkpoint_pieces}
        if self._watchdog is not None:
            self._watchdog.beat(phase="checkpoint save")
        if self.phases is not None:
            self.phases.start("checkpoint")
        engine_io = engine_for(self.strategy.checkpoint_engine)
        if engine_io is not None:  # an engine's own files inside shardwise's protocol (DeepSpeed)
            if async_:
                self.set_checkpoint_mode("async")  # refused by name
            sched_state = scheduler_state(scheduler) if scheduler is not None else None
            out = engine_io.save(self, path, model, optimizer, step=step, state=state, loader=loader,
                                 scheduler_state=sched_state, keep_last=keep_last, on_written=on_written)
            if self._watchdog is not None:
                self._watchdog.beat(phase="train")
            return self._phase_done("checkpoint", out)
        # Every piece's state is checked on every rank before any file is written (save_checkpoint).
        args = dict(step=step, strategy=self.strategy_name, world_size=self.world_size, keep_last=keep_last,
                    on_written=on_written, trainable_only=self.trainable_only, export=self._export_info(model),
                    job=self.launch_id, pieces=pieces)
        if use_async:
            self._guard_buffers(model)
            handle = self._background_writer().save(prepare_save(path, model, optimizer, **args),
                                                    blocked_since=t0, wait_s=wait_s)
            out: Any = handle
        else:
            out = save_checkpoint(path, model, optimizer, **args)
        self.last_save_blocked_s = time.perf_counter() - t0
        if self._watchdog is not None:
            self._watchdog.beat(phase="train")
        return self._phase_done("checkpoint", out)

    def set_checkpoint_mode(self, mode: str) -> str | None:
        """Set how save() writes by default: "sync", "async", "async-pinned" or "auto"; return a note.

        Raises ConfigError for an asynchronous mode under an engine that writes its own files
        (DeepSpeed). See ``runtime.checkpoint.background.resolve_mode``.
        """
        engine = self.strategy_name if engine_for(self.strategy.checkpoint_engine) is not None else None
        self.checkpoint_mode, note = resolve_mode(mode, self.device.type, engine)
        self._pinned_staging = mode == "async-pinned"
        if self._ckpt_writer is not None:
            self.wait_checkpoint()
            self._ckpt_writer.set_pinned(self._pinned_staging)
        return note

    def _background_writer(self) -> Any:
        if self._ckpt_writer is None:
            self._ckpt_writer = BackgroundWriter(pinned=self._pinned_staging,
                                                 timeout_s=self._collective_timeout_s, log=self.log)
        return self._ckpt_writer

    def _guard_buffers(self, model: nn.Module) -> None:
        """A model with saved buffers (BatchNorm's running statistics) changes them in its forward,
        and DDP's forward copies rank 0's buffers in place: the copy of a background save must end
        before the next forward there. A forward pre-hook (looked for once per model) waits for it."""
        if getattr(model, "_shardwise_staging_checked", False):
            return
        model._shardwise_staging_checked = True  # type: ignore[assignment]
        saved = any(buf is not None and name not in m._non_persistent_buffers_set
                    for m in model.modules() for name, buf in m._buffers.items())
        if saved:
            def wait(*_: Any) -> None:  # a pre-hook's return value would replace the forward's inputs
                self.wait_staged()

            model.register_forward_pre_hook(wait)

    def wait_staged(self) -> float:
        """Wait until a background save has copied the weights to host memory; return the seconds.

        ``step()`` and ``load()`` call it: the copy runs beside the next forward and backward, which
        only read the weights. A loop that changes parameters or optimizer state any other way
        while a save is in flight (editing ``p.data``, loading a state dict by hand) calls it first.
        The time is counted as time the save blocked training (``checkpoint_stats``).
        """
        if self._ckpt_writer is None or self._ckpt_writer.staging is None:
            return 0.0
        if self.phases is not None:
            self.phases.start("checkpoint")
        return self._phase_done("checkpoint", self._ckpt_writer.wait_staged())

    def wait_checkpoint(self) -> Path | None:
        """Wait for the checkpoint being written in the background, if any; return its path.

        Collective in effect (every rank's write finishes together). Raises that save's
        CheckpointError when it failed: nothing was published and ``latest`` still names the
        previous checkpoint.
        """
        if self._ckpt_writer is None:
            return None
        handle = self._ckpt_writer.wait_previous()
        return handle.path if handle is not None else None

    @property
    def background_saves(self) -> list[dict[str, Any]]:
        """Every finished background save: step, blocked_s, staging_s, write_s, bytes, mib_per_s."""
        return self._ckpt_writer.completed if self._ckpt_writer is not None else []

    @property
    def checkpoint_stats(self) -> dict[str, Any]:
        """Background saves so far: count, blocked/write seconds, bytes, waits, staging buffer bytes."""
        return summarize(self._ckpt_writer, self.checkpoint_mode)

    def load(self, path: str | os.PathLike, model: nn.Module | None = None,
             optimizer: torch.optim.Optimizer | None = None, *, loader: ShardedLoader | None = None,
             scheduler: Any = None, restore_rng: bool = True) -> Any:
        """Restore a checkpoint (a step dir, a checkpoints root or a run dir); return a LoadedCheckpoint.

        Collective. Works across strategies and world sizes (DCP reshards); verifies checksums
        and model shapes first and raises CheckpointError on every rank when they do not match.
        ``scheduler`` (default: the one prepare() returned) continues from its saved state.
        """
        model = model or self.model
        assert model is not None, "call session.prepare() first, or pass the model"
        scheduler = scheduler if scheduler is not None else self.scheduler
        optimizer = optimizer if optimizer is not None else self.optimizer
        loader = loader if loader is not None else self.loader
        self.wait_staged()  # the weights are about to be overwritten
        engine_io = engine_for(self.strategy.checkpoint_engine)
        if engine_io is not None:  # an engine's own files inside shardwise's protocol (DeepSpeed)
            loaded = engine_io.load(self, path, model, optimizer, loader=loader, scheduler=scheduler,
                                    restore_rng=restore_rng)
            self.steps_taken = loaded.step
            return loaded
        pieces = {**standard_pieces(model, optimizer, loader=loader, scheduler=scheduler, scaler=self._scaler,
                                    trainable_only=self.trainable_only, restore_rng=restore_rng),
                  **self.checkpoint_pieces}
        loaded = load_checkpoint(path, model, optimizer, world_size=self.world_size,
                                 trainable_only=self.trainable_only, pieces=pieces)
        self.steps_taken = loaded.step
        return loaded

    def _export_info(self, model: nn.Module) -> dict[str, Any] | None:
        """What ``ckpt export --format hf/peft`` needs from the model (Hugging Face models only)."""
        info = getattr(self.unwrap(model), "export_info", None)
        return info() if callable(info) else None

    # ------------------------------------------------------------------ hang detection
    def watch(self, run_dir: str | os.PathLike, timeout_s: float, attempt: int = 0,
              first_step_timeout_s: float = FIRST_STEP_TIMEOUT_S) -> Any:
        """Start this rank's hang watchdog (see runtime.watchdog) and return it.

        ``step()``, ``eval_loss()`` and ``save()`` count as progress; call ``heartbeat()`` in
        other long phases of your own loop. Before the first ``step()`` a rank may be silent for
        ``first_step_timeout_s`` (at least ``timeout_s``): that step compiles and warms up.
        """
        if self._watchdog is None:
            self._watchdog = Watchdog(run_dir, self.rank, timeout_s, attempt=attempt,
                                      launch_id=self.launch_id,
                                      first_step_timeout_s=first_step_timeout_s).start()
        return self._watchdog

    def heartbeat(self, step: int | None = None, phase: str | None = None) -> None:
        """Tell the watchdog this rank is making progress (no-op without ``watch()``)."""
        if self._watchdog is not None:
            self._watchdog.beat(step, phase)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Tear down the process group this session created (idempotent)."""
        if self._closed:
            return
        self._closed = True
        # Ordered shutdown: the background checkpoint writer finishes (its threads use the process
        # groups), then the groups are destroyed, then the interpreter may exit.
        if self._ckpt_writer is not None:
            close_writer(self._ckpt_writer, self.log)  # kept: checkpoint_stats still reads it
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._owns_group and dist.is_initialized():
            self._release_reducers()
            dist.destroy_process_group()

    def _release_reducers(self) -> None:
        # DDP's C++ Reducer holds the process group. If it is the last holder, the group's
        # destructor (which joins gloo's worker threads) runs when the user's DDP object is freed,
        # with the GIL held; a worker still releasing a finished all-reduce's tensors needs the GIL,
        # and the process deadlocks at exit (pytorch/pytorch#56297). Dropping the Reducer while the
        # group is still registered leaves destroy_process_group, which releases the GIL, as the
        # last holder. The DDP wrapper cannot synchronise gradients after close() in any case.
        if self.model is None:
            return
        for module in self.model.modules():
            if isinstance(module, DistributedDataParallel):
                # The C++ Logger holds the Reducer too.
                for attr in ("reducer", "logger"):
                    module.__dict__.pop(attr, None)
        gc.collect()  # reference cycles through the wrapper may still hold a Reducer

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        """Return the plain module inside DDP (or the model itself for in-place strategies)."""
        model = model or self.model
        assert model is not None
        return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
