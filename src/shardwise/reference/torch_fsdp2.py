"""The plain FSDP2 loop, torchtitan-style: ``torchrun ... -m shardwise.reference.torch_fsdp2 CONFIG --out RUN``.

Each transformer block is one ``fully_shard`` unit, then the root; every block but the last
reshards after forward (the last one runs first in backward, so resharding it would only force an
immediate re-gather), as torchtitan's ``apply_fsdp`` does.
"""

from __future__ import annotations

import datetime
import gc
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardwise.device import backend_for, select_device
from shardwise.parallel.data.fsdp import transformer_blocks
from shardwise.reference import common
from shardwise.workloads import build_workload


def main(argv: list[str] | None = None) -> int:
    cfg, out = common.parse_args("torch-fsdp2", argv)
    t = cfg.train
    rank, world, local_rank = common.dist_env()
    device = select_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=cfg.watchdog.collective_timeout_s))
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(t.seed)
    workload = build_workload(cfg.model, cfg.data, cfg.lora)
    model = workload.build_model().to(device)
    model = common.compile_blocks(model, t)
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.parallel.precision == "bf16-mixed" else MixedPrecisionPolicy())
    container = transformer_blocks(model)  # which modules are the blocks (GPT, Llama, GPT-2 layouts)
    blocks = list(container.children()) if container is not None else []
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = common.adamw(model, t, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.lr_factor(t))
    batches, val = common.data(workload, cfg, rank, world)
    record = common.Record.for_run("torch-fsdp2", cfg, workload, world, device)
    max_norm = t.grad_clip if t.grad_clip > 0 else math.inf

    # ------------------------------------------------------------------ the loop
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for micro in range(t.grad_accum_steps):
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # Reduce-scatter only after the last micro-batch; earlier ones accumulate locally.
            model.set_requires_gradient_sync(micro == t.grad_accum_steps - 1)
            loss = common.loss_fn(model(x), y)
            (loss / t.grad_accum_steps).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        scheduler.step()
        if step == t.steps:  # the memory ledger, while the gradients are alive; not timed
            paused = time.perf_counter()
            record.measure(model, optimizer)
            t0 += time.perf_counter() - paused
        optimizer.zero_grad(set_to_none=True)
        record.step_times.append(time.perf_counter() - t0)
        if step % t.log_every == 0 or step == t.steps or step == 1:
            record.train_loss = common.mean_over_ranks(float(loss_sum) / t.grad_accum_steps, device)
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            record.val_loss = common.evaluate(model, val, t.eval_batches, device)

    record.write(out, record.summary())
    # Free what holds the group (the FSDP modules' mesh, the optimizer's sharded state) before the
    # group itself, as torch_ddp.py does: freed at interpreter exit instead, a rank aborted once in
    # CI with "terminate called without an active exception" (gloo's threads joined at exit).
    del model, optimizer, scheduler
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from shardwise.job.exit import exit_rank

    exit_rank(main())  # no interpreter teardown after the work is done (job/exit.py)
