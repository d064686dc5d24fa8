"""Rank functions for the optimizer tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from shardwise.core.config import OptimizerConfig, ParallelConfig, TrainConfig
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.optim.build import build_optimizer
from shardwise.runtime.session import Session
from shardwise.testing import fixed_batches, train_fixed_batches
from shardwise.verify import full_state_dict

LR = 1e-2


def f64_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy kept in float64 (the parity runs' precision)."""
    return F.cross_entropy(logits.flatten(0, -2).double(), targets.flatten())


def _model(preset: str, overrides: dict | None, hf: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if hf:  # a transformers family's tiny model, e.g. "llama-tiny"
        from shardwise.models.hf import build_hf_model

        return build_hf_model(hf, vocab_size=GPT_PRESETS[preset].vocab_size).double()
    return GPT(dataclasses.replace(GPT_PRESETS[preset], **(overrides or {}))).double()


def full_grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Deterministic float64 gradients, by parameter name, the same in every process."""
    out = {}
    for i, (name, p) in enumerate(sorted(model.named_parameters())):
        g = torch.Generator().manual_seed(1000 * step + i)
        out[name] = torch.randn(p.shape, generator=g, dtype=torch.float64)
    return out


def muon_run(rank: int, world_size: int, strategy: str = "single", steps: int = 3, preset: str = "nano",
             overrides: dict | None = None, hf: str = "", mode: str = "grads", optimizer: str = "muon",
             reference: bool = False, global_batch: int = 8, **options: object) -> dict:
    """Step ``optimizer`` under ``strategy``; return the full parameters (and losses).

    ``mode = "grads"``: every step's gradients are set to ``full_grads`` (each rank's shard of them),
    so the optimizer alone is compared. ``mode = "train"``: real forward/backward on fixed batches in
    float64. ``reference``: torch.optim.Muon (hidden matrices) + AdamW (the rest) in one process.
    """
    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    plain = _model(preset, overrides, hf)
    t = TrainConfig(lr=LR, weight_decay=0.1)
    if reference:
        from shardwise.optim.build import param_groups

        groups = param_groups(plain, t, OptimizerConfig(name="muon"))
        if any(p.dim() == 3 for p in groups[0]["params"]):
            raise ValueError("torch.optim.Muon refuses 3-D tensors; use strategy='single' with MuonAdamW")
        refs = [torch.optim.Muon(groups[0]["params"], lr=LR, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(groups[1:], lr=LR, betas=t.betas, eps=1e-8, fused=True)]
        opt = _Both(refs)
    else:
        opt = build_optimizer(plain, t, OptimizerConfig(name=optimizer), "cpu")
    grads = {s: full_grads(plain, s) for s in range(steps)} if mode == "grads" else {}
    model, opt = session.prepare(plain, opt) if not reference else (plain, opt)
    losses: list[float] = []
    if mode == "grads":
        from shardwise.models.names import clean_name

        for s in range(steps):
            for n, p in model.named_parameters():
                full = grads[s][clean_name(n)]
                p.grad = _shard_like(full, p)
            opt.step()
    else:
        cfg = GPT_PRESETS[preset]
        data = fixed_batches(steps, global_batch, cfg.block_size, cfg.vocab_size)
        losses = train_fixed_batches(session, model, opt, data, loss_fn=f64_loss)["losses"]
    params = full_state_dict(model)
    session.close()
    return {"params": params, "losses": losses}


def _shard_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``full`` laid out as ``p`` is (a DTensor's shard through torch's own redistribute)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if not isinstance(p, DTensor):
        return full.to(p.device)
    whole = distribute_tensor(full.to(p.device), p.device_mesh, [Replicate()] * p.device_mesh.ndim)
    return whole.redistribute(p.device_mesh, p.placements)


class _Both:
    """Two torch optimizers stepped together (the one-process reference)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def muon_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Several ``muon_run`` configurations in one spawn."""
    return [muon_run(rank, world_size, **case) for case in cases]


def optimizer_bytes_vs_plan(rank: int, world_size: int, cases: list[dict]) -> list[tuple[int, int]]:
    """(ledger's optimizer bytes, planner's) on this rank after one step, per case (strategy, optimizer)."""
    from shardwise.plan.predict import predict_run
    from shardwise.plan.spec import from_module
    from shardwise.runtime import ledger

    out = []
    for case in cases:
        case = dict(case)
        name, preset = case.pop("optimizer"), case.pop("preset", "nano")
        session = Session(parallel=ParallelConfig(**case), seed=0)  # type: ignore[arg-type]
        cfg = GPT_PRESETS[preset]
        torch.manual_seed(0)
        plain = GPT(cfg)
        spec = from_module(plain, name=preset)
        opt = build_optimizer(plain, TrainConfig(), OptimizerConfig(name=name), "cpu")
        model, opt = session.prepare(plain, opt)
        data = fixed_batches(1, 4 * world_size, cfg.block_size, cfg.vocab_size)
        train_fixed_batches(session, model, opt, data)
        measured = ledger.optimizer_bytes(opt)
        predicted = predict_run(spec, session.layout, precision="fp32", seq=cfg.block_size, micro_batch_size=4,
                                optimizer=name).ranks[rank].optim_bytes
        out.append((measured, predicted))
        session.close()
    return out


def momentum_by_name(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Muon's whole momentum buffers by parameter name (DTensors gathered: a collective)."""
    from shardwise.models.names import clean_name

    out = {}
    for n, p in model.named_parameters():
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            out[clean_name(n)] = (buf.full_tensor() if hasattr(buf, "full_tensor") else buf).clone()
    return out


def muon_save_or_load(rank: int, world_size: int, strategy: str, ckpt_dir: str, load: bool = False,
                      **options: object) -> dict[str, torch.Tensor]:
    """Train 2 float64 steps with Muon and save (or only load ``ckpt_dir``); return the momentum by name."""
    session = Session(parallel=ParallelConfig(strategy=strategy, **options), seed=0)  # type: ignore[arg-type]
    plain = _model("nano", None, "")
    opt = build_optimizer(plain, TrainConfig(lr=LR), OptimizerConfig(name="muon"), "cpu")
    model, opt = session.prepare(plain, opt)
    if load:
        session.load(ckpt_dir, model, opt)
    else:
        cfg = GPT_PRESETS["nano"]
        train_fixed_batches(session, model, opt, fixed_batches(2, 8, cfg.block_size, cfg.vocab_size),
                            loss_fn=f64_loss)
        session.save(ckpt_dir, model, opt, step=2)
    out = momentum_by_name(model, opt)
    session.close()
    return out
