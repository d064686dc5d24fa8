"""Rank functions for the model-parallel tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from shardwise.core.config import ParallelConfig
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.models.names import clean_name
from shardwise.runtime import ledger
from shardwise.runtime.session import Session
from shardwise.testing import default_dtype, fixed_batches, lm_loss, train_fixed_batches


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by single-device name, DTensors gathered to full tensors."""
    out = {}
    for name, p in model.named_parameters():
        name = clean_name(name)
        out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def mp_train(rank: int, world_size: int, strategy: str = "single", steps: int = 5,
             global_batch: int = 8, accum: int = 1, preset: str = "nano", clip: float = 1.0,
             evaluate: bool = False, overrides: dict | None = None, ckpt_dir: str = "",
             compile: bool = False, mid_eval: bool = False, dtype: str = "float64", **options: object) -> dict:
    """Train the GPT preset on fixed batches through session.forward_backward, the model in ``dtype``
    (float64 for parity: see ``shardwise.testing.default_dtype``); report results.

    Every rank of one data-parallel replica reads the same slice of each global batch (TP ranks
    and pipeline stages share a batch); the slice is the replica's ``dp_rank``.
    """
    with default_dtype(getattr(torch, dtype)):
        cfg = GPT_PRESETS[preset]
        if overrides:
            import dataclasses

            cfg = dataclasses.replace(cfg, **overrides)
        parallel = ParallelConfig(strategy=strategy, **options)  # type: ignore[arg-type]
        if compile:
            # A fresh dynamo cache per case: one process running several cases would otherwise pile
            # guards of every strategy onto the same Block.forward code object.
            torch._dynamo.reset()
        session = Session(parallel=parallel, grad_accum_steps=accum, seed=0, compile=compile)
        model = GPT(cfg)
        # foreach=True: the multi-tensor kernels CUDA uses by default, which refuse mixed tensor kinds.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        model, opt = session.prepare(model, opt)
        data = fixed_batches(steps, global_batch, cfg.block_size, cfg.vocab_size)
        per_replica = global_batch // session.dp_size
        params5: dict = {}

        def snapshot(step: int) -> None:
            if step == 4:  # the state after 5 steps, for runs that go on past it
                params5.update(full_params(model))
            if mid_eval:  # an evaluation between steps must not change what training does next
                x = data[0, :per_replica]
                session.eval_loss(model, x[:, :-1], x[:, 1:], lm_loss)

        run = train_fixed_batches(session, model, opt, data, max_norm=clip, after_step=snapshot,
                                  loss_fn=session.compile_loss(lm_loss))
        losses, norms = run["losses"], run["norms"]
        if ckpt_dir:
            from shardwise.runtime.checkpoint.save import save_checkpoint

            save_checkpoint(ckpt_dir, model, opt, step=steps, strategy=session.strategy_name,
                            world_size=world_size)
        pipeline = getattr(session.strategy, "pipeline", None)
        result = {"losses": losses, "norms": norms, "params": full_params(model), "params5": params5,
                  "param_bytes": ledger.param_bytes(model), "grad_bytes": session.last_grad_bytes,
                  "dp_rank": session.dp_rank, "layout_microbatches": session.layout.pp_microbatches,
                  "run_microbatches": pipeline.n_microbatches if pipeline is not None else None,
                  "compiled_blocks": sum(hasattr(m, "_orig_mod") for m in model.modules())}
        if evaluate:
            x = data[0, :per_replica]
            model.eval()
            result["eval_loss"] = float(session.eval_loss(model, x[:, :-1], x[:, 1:], lm_loss))
            # Evaluation must not leave FSDP units holding unsharded parameters.
            result["param_bytes_after_eval"] = ledger.param_bytes(model)
        session.close()
        return result


def mp_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Run several ``mp_train`` configurations one after another in the same ranks (one spawn); a
    case naming a pretrained ``folder`` runs ``tests.helpers.hf.hf_case`` on it instead."""
    from tests.helpers.hf import hf_case

    return [hf_case(rank, world_size, **case) if "folder" in case else mp_train(rank, world_size, **case)
            for case in cases]


def merged_params(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Union of every rank's parameters (pipeline stages hold disjoint parts of the model)."""
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        out.update(r["params"])
    return out


def hf_train(rank: int, world_size: int, strategy: str = "single", steps: int = 5,
             global_batch: int = 4, seq: int = 16, dtype: str = "float64", **options: object) -> dict:
    """Train the bundled llama-tiny HF model (in ``dtype``, as ``mp_train``) on fixed batches; return
    losses and full parameters."""
    from shardwise.models.hf import build_hf_model

    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    with default_dtype(getattr(torch, dtype)):
        model = build_hf_model("llama-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = session.prepare(model, opt)
    data = fixed_batches(steps, global_batch, seq, 65)
    losses = train_fixed_batches(session, model, opt, data, max_norm=1.0)["losses"]
    result = {"losses": losses, "params": full_params(model), "param_bytes": ledger.param_bytes(model)}
    session.close()
    return result


def ckpt_phase(rank: int, world_size: int, strategy: str, start: int, stop: int, ckpt_dir: str,
               global_batch: int = 8, dtype: str = "float64", **options: object) -> dict:
    """Train steps [start, stop) of the fixed batches, resuming from / saving to ``ckpt_dir``, the
    model in ``dtype`` (as ``mp_train``'s)."""
    from shardwise.runtime.checkpoint.load import load_checkpoint
    from shardwise.runtime.checkpoint.save import save_checkpoint

    cfg = GPT_PRESETS["nano"]
    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    with default_dtype(getattr(torch, dtype)):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = session.prepare(model, opt)
    if start:
        load_checkpoint(ckpt_dir, model, opt, world_size=world_size)
    data = fixed_batches(stop, global_batch, cfg.block_size, cfg.vocab_size)
    losses = train_fixed_batches(session, model, opt, data, steps=range(start, stop), max_norm=1.0)["losses"]
    save_checkpoint(ckpt_dir, model, opt, step=stop, strategy=session.strategy_name,
                    world_size=world_size)
    result = {"losses": losses, "params": full_params(model)}
    session.close()
    return result


def bench_mp(rank: int, world_size: int, strategy: str = "single", steps: int = 4,
             batch_per_replica: int = 4, preset: str = "lab", **options: object) -> dict:
    """Time training steps of a GPT preset; per rank: step time, ledger bytes, pipeline busy time.

    The pipeline's busy time is the time spent inside stage forward/backward chunks (receives
    are waited for outside them); bubble = 1 - busy / (forward+backward schedule time).
    """
    import statistics
    import time

    cfg = GPT_PRESETS[preset]
    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    model, opt = session.prepare(model, opt)
    busy = [0.0]
    pipeline = getattr(session.strategy, "pipeline", None)
    if pipeline is not None:
        for stage in pipeline.stages:
            for name in ("forward_one_chunk", "backward_one_chunk"):
                fn = getattr(stage, name)

                def timed(*a: object, _fn=fn, **k: object) -> object:
                    t0 = time.perf_counter()
                    try:
                        return _fn(*a, **k)
                    finally:
                        busy[0] += time.perf_counter() - t0

                setattr(stage, name, timed)
    data = fixed_batches(steps, batch_per_replica * session.dp_size, cfg.block_size, cfg.vocab_size)
    times, busy_fraction = [], []
    for step in range(steps):
        mine = data[step, session.dp_rank * batch_per_replica:(session.dp_rank + 1) * batch_per_replica]
        session.barrier()
        busy[0] = 0.0
        t0 = time.perf_counter()
        session.forward_backward(model, mine[:, :-1], mine[:, 1:], lm_loss)
        schedule_s = time.perf_counter() - t0  # the pipeline schedule (forward + backward)
        session.step(opt, max_norm=1.0)
        times.append(time.perf_counter() - t0)
        busy_fraction.append(busy[0] / schedule_s)
    mem = ledger.rank_ledger(session, model, opt)
    session.close()
    return {"step_s": statistics.median(times[1:]), "busy": statistics.median(busy_fraction[1:]),
            **{k: mem[k] for k in ("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes")}}
