"""The plain PyTorch DDP loop: ``torchrun --nproc-per-node=N -m shardwise.reference.torch_ddp CONFIG --out RUN``."""

from __future__ import annotations

import contextlib
import datetime
import math
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardwise.device import backend_for, select_device
from shardwise.reference import common
from shardwise.workloads import build_workload


def main(argv: list[str] | None = None) -> int:
    cfg, out = common.parse_args("torch-ddp", argv)
    t = cfg.train
    rank, world, local_rank = common.dist_env()
    device = select_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=cfg.watchdog.collective_timeout_s))
    torch.manual_seed(t.seed)
    workload = build_workload(cfg.model, cfg.data, cfg.lora)
    model = workload.build_model().to(device)
    model = common.compile_blocks(model, t)
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = common.adamw(model, t, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.lr_factor(t))
    batches, val = common.data(workload, cfg, rank, world)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.parallel.precision == "bf16-mixed"
                else contextlib.nullcontext())
    record = common.Record.for_run("torch-ddp", cfg, workload, world, device)
    max_norm = t.grad_clip if t.grad_clip > 0 else math.inf

    # ------------------------------------------------------------------ the loop
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro in range(t.grad_accum_steps):
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = micro == t.grad_accum_steps - 1
            with contextlib.nullcontext() if last_micro else model.no_sync():
                with autocast:
                    logits = model(x)
                loss = common.loss_fn(logits, y)
                (loss / t.grad_accum_steps).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        if step == t.steps:  # the memory ledger, while the gradients are alive; not timed
            paused = time.perf_counter()
            record.measure(model.module, optimizer)
            t0 += time.perf_counter() - paused
        optimizer.zero_grad(set_to_none=True)
        record.step_times.append(time.perf_counter() - t0)
        if step % t.log_every == 0 or step == t.steps or step == 1:
            record.train_loss = common.mean_over_ranks(float(loss_sum) / t.grad_accum_steps, device)
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            record.val_loss = common.evaluate(model, val, t.eval_batches, device)

    record.write(out, record.summary())
    common.finish(model)
    return 0


if __name__ == "__main__":
    from shardwise.job.exit import exit_rank

    exit_rank(main())  # no interpreter teardown after the work is done (job/exit.py)
