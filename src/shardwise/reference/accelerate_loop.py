"""A plain Hugging Face Accelerate loop: ``torchrun ... -m shardwise.reference.accelerate_loop CONFIG --out RUN``.

``Accelerator`` creates the process group and wraps the model (DDP with more than one process);
the loop is the documented ``accumulate`` / ``backward`` / ``clip_grad_norm_`` pattern. Two
deliberate choices keep it on the same data and schedule as the other runs: the data loader is the
same DistributedSampler loader (``accelerator.prepare(loader)`` would re-shard batches in its own
order), and the learning-rate scheduler is not prepared (a prepared scheduler steps once per
process per optimizer step unless the batches are split).
"""

from __future__ import annotations

import math
import time

import torch

from shardwise.device import select_device
from shardwise.reference import common
from shardwise.workloads import build_workload


def main(argv: list[str] | None = None) -> int:
    cfg, out = common.parse_args("accelerate", argv)
    t = cfg.train
    from accelerate import Accelerator  # defers accelerate (optional)

    rank, world, local_rank = common.dist_env()
    on_cpu = select_device(local_rank).type == "cpu"
    accelerator = Accelerator(cpu=on_cpu, gradient_accumulation_steps=t.grad_accum_steps,
                              mixed_precision="bf16" if cfg.parallel.precision == "bf16-mixed" else "no")
    device = accelerator.device
    torch.manual_seed(t.seed)
    workload = build_workload(cfg.model, cfg.data, cfg.lora)
    model = workload.build_model()
    model = common.compile_blocks(model, t)
    optimizer = common.adamw(model, t, device)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, common.lr_factor(t))
    batches, val = common.data(workload, cfg, rank, world)
    record = common.Record.for_run("accelerate", cfg, workload, world, device)
    max_norm = t.grad_clip if t.grad_clip > 0 else math.inf

    # ------------------------------------------------------------------ the loop
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for _ in range(t.grad_accum_steps):
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with accelerator.accumulate(model):
                loss = common.loss_fn(model(x), y)  # prepare() wrapped forward in autocast
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()  # a no-op until the last micro-batch
                if accelerator.sync_gradients:
                    scheduler.step()
                if step == t.steps and accelerator.sync_gradients:  # the ledger, grads alive; not timed
                    paused = time.perf_counter()
                    record.measure(accelerator.unwrap_model(model), optimizer.optimizer)
                    t0 += time.perf_counter() - paused
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        record.step_times.append(time.perf_counter() - t0)
        if step % t.log_every == 0 or step == t.steps or step == 1:
            record.train_loss = common.mean_over_ranks(float(loss_sum) / t.grad_accum_steps, device)
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            record.val_loss = common.evaluate(model, val, t.eval_batches, device)

    record.write(out, record.summary())
    common.finish(model, destroy=False)  # end_training destroys the group
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    from shardwise.job.exit import exit_rank

    exit_rank(main())  # no interpreter teardown after the work is done (job/exit.py)
