"""Rank functions for the mixture-of-experts / expert-parallel tests (importable by spawned ranks)."""

from __future__ import annotations

import dataclasses

import torch

from shardwise.core.config import ParallelConfig
from shardwise.models.gpt import GPT, GPT_PRESETS
from shardwise.models.moe import take_moe_stats, with_aux_loss
from shardwise.runtime import ledger
from shardwise.runtime.session import Session
from shardwise.testing import default_dtype, fixed_batches, lm_loss, train_fixed_batches
from tests.helpers.mp import full_params


def moe_train(rank: int, world_size: int, strategy: str = "single", steps: int = 5, global_batch: int = 8,
              accum: int = 1, overrides: dict | None = None, clip: float = 1.0, ckpt_dir: str = "",
              load_dir: str = "", start: int = 0, local_aux: bool = False, dtype: torch.dtype = torch.float64,
              **options: object) -> dict:
    """Train moe-nano on fixed batches (aux losses in the loss) in ``dtype`` (float64 for parity:
    see ``shardwise.testing.default_dtype``); report losses, params, MoE stats."""
    with default_dtype(dtype):
        return _moe_train(rank, world_size, strategy, steps, global_batch, accum, overrides, clip, ckpt_dir,
                          load_dir, start, local_aux, **options)


def _moe_train(rank: int, world_size: int, strategy: str, steps: int, global_batch: int, accum: int,
               overrides: dict | None, clip: float, ckpt_dir: str, load_dir: str, start: int, local_aux: bool,
               **options: object) -> dict:
    cfg = dataclasses.replace(GPT_PRESETS["moe-nano"], **(overrides or {}))
    session = Session(parallel=ParallelConfig(strategy=strategy, **options), grad_accum_steps=accum,  # type: ignore[arg-type]
                      seed=0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    model, opt = session.prepare(model, opt)
    if local_aux:  # the mistake the global counts avoid: each rank balances its own tokens only
        for m in model.modules():
            if hasattr(m, "stats_group"):
                m.stats_group = None
    if load_dir:
        from shardwise.runtime.checkpoint.load import load_checkpoint

        load_checkpoint(load_dir, model, opt, world_size=world_size)
    data = fixed_batches(steps, global_batch, cfg.block_size, cfg.vocab_size)
    # Global micro-batch a must hold the same rows as one process's micro-batch a (the routers'
    # balance loss is a per-micro-batch quantity): replica r's micro-batch a reads rows
    # [a*dp*m + r*m, a*dp*m + (r+1)*m) of the global batch, as the trainer's sampler arranges it.
    # Under pipeline parallel each of the layout's m pipeline micro-batches is a micro-batch too
    # (its aux loss is over its own tokens): one process accumulating accum x m micro-batches.
    split = accum * (session.layout.pp_microbatches if session.layout.pp > 1 else 1)
    dp, micro = session.dp_size, global_batch // session.dp_size // split
    perm = [a * dp * micro + r * micro + i for r in range(dp) for a in range(split) for i in range(micro)]
    data = data[:, perm]
    stats: list[dict] = []
    run = train_fixed_batches(session, model, opt, data, max_norm=clip, loss_fn=with_aux_loss(lm_loss),
                              steps=range(start, steps), after_step=lambda s: stats.append(take_moe_stats(model)))
    if ckpt_dir:
        from shardwise.runtime.checkpoint.save import save_checkpoint

        save_checkpoint(ckpt_dir, model, opt, step=steps, strategy=session.strategy_name, world_size=world_size)
    result = {"losses": run["losses"], "norms": run["norms"], "params": full_params(model), "stats": stats,
              "param_bytes": ledger.param_bytes(model), "optim_bytes": ledger.optimizer_bytes(opt),
              "dp_rank": session.dp_rank}
    session.close()
    return result


def moe_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Several ``moe_train`` configurations in one spawn."""
    return [moe_train(rank, world_size, **case) for case in cases]


def routing_check(rank: int, world_size: int, ep: int, tokens: int = 37, n_experts: int = 8, top_k: int = 2) -> dict:
    """Send tagged tokens through the EP dispatcher to tagging experts; return what came back.

    Each token's payload is its global id; each expert writes its global expert id into column 1
    and records the ids it saw. Lost, duplicated or misrouted tokens break the returned checks.
    """
    import torch.distributed as dist
    from torch import nn

    from shardwise.parallel.experts.ep import ExpertDispatcher

    group_ranks = [r for r in range(world_size) if r // ep == rank // ep]
    groups = [dist.new_group([g * ep + i for i in range(ep)]) for g in range(world_size // ep)]
    group = groups[rank // ep]
    local = n_experts // ep
    first = (rank % ep) * local
    seen: list[list[int]] = [[] for _ in range(local)]

    class TagExperts(nn.Module):
        def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            outs = []
            for e, chunk in enumerate(x.split(counts.tolist())):
                seen[e].extend(chunk[:, 0].long().tolist())
                outs.append(torch.stack([chunk[:, 0], torch.full_like(chunk[:, 0], first + e)], 1))
            return torch.cat(outs)

    experts = TagExperts()
    d = ExpertDispatcher(n_experts, ep, group)
    experts.register_forward_pre_hook(d.dispatch)
    experts.register_forward_hook(d.combine)
    g = torch.Generator().manual_seed(rank)
    n = tokens + rank  # uneven token counts per rank
    ids = torch.arange(n, dtype=torch.float32) + 1000 * rank
    if rank == 0:  # every token picks expert 0 (a hot expert: imbalance must not drop anything)
        chosen = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),
                                         1 + torch.randperm(n_experts - 1, generator=g)[:top_k - 1]])
                              for _ in range(n)])
    else:
        chosen = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(n)])
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    x = torch.stack([ids, torch.zeros(n)], 1)[order // top_k].requires_grad_(True)
    counts = torch.bincount(flat, minlength=n_experts)
    out = experts(x, counts)
    out.sum().backward()  # the reverse all-to-all must bring every gradient home
    return {"ids_ok": torch.equal(out[:, 0].detach(), x[:, 0].detach()),
            "experts_ok": torch.equal(out[:, 1].detach().long(), flat[order]),
            # d out[:, 0] / d x[:, 0] = 1 for every slot; column 1 (the tag) carries no gradient.
            "grad_ok": torch.equal(x.grad, torch.stack([torch.ones(len(x)), torch.zeros(len(x))], 1)),
            "seen": {first + e: sorted(v) for e, v in enumerate(seen)},
            "sent": {int(e): sorted(int(i) + 1000 * rank for i in (chosen == e).any(1).nonzero().flatten())
                     for e in range(n_experts)},
            "group": group_ranks}


def ep_suite(rank: int, world_size: int, routing_ep: list[int], cases: list[dict]) -> dict:
    """The routing checks, then the training cases, in one spawn."""
    return {"routing": [routing_check(rank, world_size, ep) for ep in routing_ep],
            "cases": moe_cases(rank, world_size, cases)}
