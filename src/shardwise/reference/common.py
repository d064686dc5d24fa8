"""What the reference loops share: config, data order, optimizer, schedule, evaluation, summary.

Everything here is plain PyTorch that a user would write around a training loop; the loops
themselves live in ``torch_ddp``, ``torch_fsdp2`` and ``accelerate_loop``. The pieces mirror the
built-in trainer exactly, so the final losses agree and only the step's cost differs:

* data: ``DistributedSampler(shuffle=True, seed=train.seed, drop_last=True)`` + ``set_epoch`` draws
  ``randperm(n)`` seeded with seed + epoch and gives rank r every R-th sample -- the same batches,
  in the same order, as shardwise's ShardedSampler;
* model: ``torch.manual_seed(train.seed)`` and then the workload's builder, as Session does;
* AdamW with weight decay on matrices only, warmup + cosine learning rate, clipping at
  ``train.grad_clip`` (the norm is computed every step, as the trainer logs it);
* loss: token-mean cross-entropy in float32.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardwise.core.config import RunConfig, TrainConfig, load_config
from shardwise.fsutil import atomic_write_text
from shardwise.parallel.data.fsdp import transformer_blocks
from shardwise.runtime import ledger
from shardwise.runtime.auto import compile_flag, peer_defaults
from shardwise.runtime.optim import adamw_implementation


def parse_args(impl: str, argv: list[str] | None = None) -> tuple[RunConfig, Path]:
    """(config, run directory) from ``CONFIG.toml --out RUN``."""
    p = argparse.ArgumentParser(prog=f"shardwise.reference ({impl})",
                                description=f"The plain {impl} reference loop (started by torchrun).")
    p.add_argument("config", help="a resolved shardwise config.toml")
    p.add_argument("--out", required=True, help="run directory (summary.json is written there)")
    args = p.parse_args(argv)
    # "auto" settings run as a plain loop runs by default (fp32, eager): peers' defaults.
    return peer_defaults(load_config(args.config)), Path(args.out)


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def finish(model: nn.Module, *, destroy: bool = True) -> None:
    """End a reference loop's distributed part: drop every DDP Reducer, then the process group.

    DDP's C++ Reducer (and its Logger) hold the process group. Left to interpreter exit, the group's
    destructor joins gloo's worker threads with the GIL held and the process deadlocks or aborts
    ("terminate called without an active exception"; pytorch/pytorch#56297): the same release as
    ``Session._release_reducers``. ``destroy=False`` where the framework destroys the group itself
    (Accelerate's ``end_training``).
    """
    # Framework wrappers (Fabric's module, Accelerate's) are not always nn.Module parents of the
    # DDP object: look through their usual attributes too.
    seen: list[Any] = [model, getattr(model, "module", None), getattr(model, "_forward_module", None)]
    for top in [m for m in seen if isinstance(m, nn.Module)]:
        for module in top.modules():
            if isinstance(module, DistributedDataParallel):
                for attr in ("reducer", "logger"):
                    module.__dict__.pop(attr, None)
    gc.collect()
    if destroy and dist.is_initialized():
        dist.destroy_process_group()


def compile_blocks(model: nn.Module, t: Any) -> nn.Module:
    """With ``train.compile = true``, ``torch.compile`` each transformer block, as torchtitan does
    (before DDP/FSDP wrap them), so compiled shardwise runs meet compiled plain loops."""
    if compile_flag(getattr(t, "compile", "false")) != "true":
        return model
    container = transformer_blocks(model)
    for name, block in list(container.named_children()) if container is not None else []:
        container.register_module(name, torch.compile(block))
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def adamw(model: nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW on ``param_groups`` with the kernel shardwise's trainer picks for ``device`` (fused on
    CUDA and the CPU), so the comparison measures the loop, not two AdamW implementations."""
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas,
                             **adamw_implementation(device))


def lr_factor(t: TrainConfig) -> Any:
    """LambdaLR factor after ``step`` optimizer steps: linear warmup, then cosine to min_lr."""
    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return (t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)) / t.lr
    return factor


def loader(dataset: Dataset, batch_size: int, rank: int, world: int, *, shuffle: bool, seed: int = 0,
           num_workers: int = 0) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True,
                      num_workers=num_workers)


def data(workload: Any, cfg: RunConfig, rank: int, world: int) -> tuple[Iterator[Any], DataLoader]:
    """(endless training batches, validation loader) of this rank, in the built-in trainer's order."""
    t = cfg.train
    train = loader(workload.train_set, t.micro_batch_size, rank, world, shuffle=True, seed=t.seed,
                   num_workers=cfg.data.num_workers)
    return forever(train), loader(workload.val_set, t.micro_batch_size, rank, world, shuffle=False)


def forever(data: DataLoader) -> Iterator[Any]:
    epoch = 0
    while True:
        data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        yield from data
        epoch += 1


def mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


@torch.no_grad()
def evaluate(model: nn.Module, data: DataLoader, batches: int, device: torch.device) -> float:
    """Validation loss: this rank's mean over ``batches`` batches, averaged over ranks."""
    model.eval()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(data):
        if i >= batches:
            break
        total += float(loss_fn(model(x.to(device)), y.to(device)))
        count += 1
    model.train()
    return mean_over_ranks(total / max(count, 1), device)


class Record:
    """Step times, the last logged loss, and the summary.json the bench table reads."""

    @classmethod
    def for_run(cls, impl: str, cfg: RunConfig, workload: Any, world: int, device: torch.device) -> Record:
        """The record of ``impl`` running ``workload`` on ``world`` ranks (tokens per optimizer step)."""
        t = cfg.train
        return cls(impl, cfg, t.micro_batch_size * t.grad_accum_steps * world * workload.tokens_per_sample,
                   device)

    def __init__(self, impl: str, cfg: RunConfig, tokens_per_step: int, device: torch.device) -> None:
        self.impl, self.cfg, self.tokens_per_step, self.device = impl, cfg, tokens_per_step, device
        self.step_times: list[float] = []
        self.train_loss = float("nan")
        self.val_loss = float("nan")
        self.bytes: dict[str, int] = {}
        self.t0 = time.perf_counter()

    def measure(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Bytes in parameters, gradients and optimizer state after the last optimizer step, before
        zero_grad and evaluation: the moment the trainer's ledger measures (same counting rules)."""
        self.bytes = {"param_bytes": ledger.param_bytes(model), "grad_bytes": ledger.grad_bytes(model),
                      "optim_bytes": ledger.optimizer_bytes(optimizer)}

    def summary(self) -> dict[str, Any]:
        """Every rank's memory (a collective: all ranks call it) plus the run's figures."""
        peak, source = ledger.peak_bytes(self.device)
        mine = {"rank": dist.get_rank(), **self.bytes, "peak_bytes": peak, "peak_source": source}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        step_s = statistics.median(self.step_times) if self.step_times else 0.0
        return {"strategy": self.impl, "impl": "reference", "world_size": dist.get_world_size(),
                "precision": self.cfg.parallel.precision, "steps": len(self.step_times),
                "final_train_loss": self.train_loss, "final_val_loss": self.val_loss,
                "tokens_per_s": statistics.median(self.tokens_per_step / s for s in self.step_times)
                if self.step_times else 0.0,
                "step_time_s": step_s, "wall_s": time.perf_counter() - self.t0, "device": str(self.device),
                "memory": {"ranks": ranks, "peak_source": source}}

    def write(self, out: Path, summary: dict[str, Any]) -> None:
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
            atomic_write_text(out / "summary.json", json.dumps(clean, indent=2) + "\n")
            print(f"{self.impl}: final train loss {summary['final_train_loss']:.4f} | final val loss "
                  f"{summary['final_val_loss']:.4f} | {summary['tokens_per_s']:.0f} tokens/s", flush=True)
