"""The optimizer ``[optimizer]`` names, over the parameter groups each optimizer's authors prescribe.

Every optimizer is torch's (``torch.optim.AdamW``, ``Adafactor``, ``SGD``; Muon is ``MuonAdamW``:
torch's Muon rule made sharding-aware, optim/muon.py). Weight decay goes to matrices only, never to
biases, norms' scales or other vectors (the trainer's rule since its first version). Muon takes the
hidden matrices (and MoE experts' stacks of them); the embeddings, the output head and every vector
stay with AdamW, as Keller Jordan's Muon and Moonlight prescribe.

A user's own loop gets the same optimizer with ``build_optimizer(model, cfg.train, cfg.optimizer)``
on the plain model, before ``session.prepare`` (which re-points it at the parallelised parameters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.core.config import OptimizerConfig, TrainConfig
from shardwise.optim.adafactor import Adafactor
from shardwise.optim.muon import MuonAdamW
from shardwise.optim.rules import check_optimizer  # noqa: F401 - re-exported (the trainer asks here)
from shardwise.runtime.optim import adamw_implementation


def outer_params(model: nn.Module) -> set[int]:
    """ids of the embeddings' and the output head's parameters (AdamW's under Muon)."""
    ids: set[int] = set()
    vocab: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            ids.update(id(p) for p in module.parameters())
            vocab.add(module.num_embeddings)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        # A model without transformers' accessor: its last Linear that maps onto a vocabulary.
        linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features in vocab]
        head = linears[-1] if linears else None
    if head is not None:
        ids.update(id(p) for p in head.parameters())
    return ids


def param_groups(model: nn.Module, t: TrainConfig, o: OptimizerConfig) -> list[dict[str, Any]]:
    """The trainable parameters in groups: decayed matrices, undecayed vectors; under Muon its matrices."""
    params = [p for p in model.parameters() if p.requires_grad]
    if o.name != "muon":
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    outer = outer_params(model)
    hidden = [p for p in params if p.dim() in (2, 3) and id(p) not in outer]
    chosen = {id(p) for p in hidden}
    rest = [p for p in params if id(p) not in chosen]
    muon = {"params": hidden, "weight_decay": t.weight_decay, "muon": True, "momentum": o.muon_momentum,
            "nesterov": o.muon_nesterov, "ns_steps": o.muon_ns_steps, "adjust_lr_fn": o.muon_adjust_lr}
    if o.muon_lr:
        muon["lr_ratio"] = o.muon_lr / t.lr
    return [muon,
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": t.weight_decay, "muon": False},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "muon": False}]


def build_optimizer(model: nn.Module, t: TrainConfig, o: OptimizerConfig | None = None,
                    device: torch.device | str = "cpu") -> torch.optim.Optimizer:
    """The optimizer ``o`` names (default AdamW) over ``model``'s trainable parameters.

    AdamW (and Muon's AdamW groups) use torch's fused kernel where ``device`` has one. The rate
    written here is train.lr; the trainer sets each step's rate (``optim.schedule.set_lr``).
    """
    o = o or OptimizerConfig()
    groups = param_groups(model, t, o)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=o.eps, **adamw_implementation(device))
    if o.name == "muon":
        return MuonAdamW(groups, lr=t.lr, betas=t.betas, eps=o.eps, **adamw_implementation(device))
    if o.name == "adafactor":
        return Adafactor(groups, lr=t.lr, beta2_decay=o.adafactor_beta2_decay)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=o.momentum, nesterov=o.nesterov, foreach=True)
    raise ValueError(f"unknown optimizer {o.name!r}")  # config validation names the choices first


def optimizer_name(optimizer: Any) -> str:
    """The ``[optimizer]`` name of a built optimizer (its class for one shardwise did not build)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local optimizer
    kind = type(inner)
    if kind.__name__ == "MuonAdamW":
        return "muon"
    if issubclass(kind, torch.optim.Adafactor):  # torch's, or shardwise's sharding-aware one
        return "adafactor"
    for name, cls in (("adamw", torch.optim.AdamW), ("adafactor", torch.optim.Adafactor),
                      ("sgd", torch.optim.SGD)):
        if kind is cls:
            return name
    return kind.__name__
