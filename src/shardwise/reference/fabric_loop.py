"""A plain Lightning Fabric loop: ``torchrun ... -m shardwise.reference.fabric_loop CONFIG --out RUN``.

``Fabric(strategy="ddp")`` joins the process group torchrun set up (its environment is detected) and
wraps the model in DDP; the loop is Fabric's documented ``no_backward_sync`` / ``backward`` /
``clip_gradients`` pattern. As in the Accelerate loop, the data loader is the shared
DistributedSampler loader (``setup_dataloaders`` would re-shard it in its own order), so every
implementation reads the same batches.
"""

from __future__ import annotations

import math
import time

import torch

from shardwise.device import select_device
from shardwise.reference import common
from shardwise.workloads import build_workload


def main(argv: list[str] | None = None) -> int:
    cfg, out = common.parse_args("fabric", argv)
    t = cfg.train
    from lightning_fabric import Fabric  # defers lightning_fabric (optional)

    rank, world, local_rank = common.dist_env()
    on_cpu = select_device(local_rank).type == "cpu"
    fabric = Fabric(accelerator="cpu" if on_cpu else "cuda", devices=world if world > 1 else 1,
                    strategy="ddp" if world > 1 else "auto",
                    precision="bf16-mixed" if cfg.parallel.precision == "bf16-mixed" else "32-true")
    fabric.launch()  # under torchrun: joins the existing processes
    device = fabric.device
    torch.manual_seed(t.seed)
    workload = build_workload(cfg.model, cfg.data, cfg.lora)
    model = workload.build_model()
    model = common.compile_blocks(model, t)
    optimizer = common.adamw(model, t, device)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.lr_factor(t))
    batches, val = common.data(workload, cfg, rank, world)
    record = common.Record.for_run("fabric", cfg, workload, world, device)
    max_norm = t.grad_clip if t.grad_clip > 0 else math.inf

    # ------------------------------------------------------------------ the loop
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for k in range(t.grad_accum_steps):
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last = k == t.grad_accum_steps - 1
            with fabric.no_backward_sync(model, enabled=not last):
                loss = common.loss_fn(model(x), y)  # setup() wrapped forward in the precision's autocast
                fabric.backward(loss / t.grad_accum_steps)
            loss_sum += loss.detach()
        fabric.clip_gradients(model, optimizer, max_norm=max_norm)
        optimizer.step()
        scheduler.step()
        if step == t.steps:  # the ledger, grads alive; not timed
            paused = time.perf_counter()
            record.measure(model.module, optimizer.optimizer)
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
