"""Muon for hidden matrices with AdamW for the rest, in one optimizer that runs under any sharding.

``MuonAdamW`` is ``torch.optim.AdamW`` whose param groups marked ``muon = True`` are stepped by
``torch.optim.Muon``'s rule instead: Nesterov momentum, then torch's own Newton-Schulz
orthogonalisation (``torch.optim._muon._zeropower_via_newtonschulz``) and torch's learning-rate
adjustment (``_adjust_lr``), then decoupled weight decay. The AdamW groups go through torch's AdamW
``step`` untouched. One optimizer (not two) so that the Session re-points it, ZeRO-1 partitions it
and DCP checkpoints its state by parameter name like any torch optimizer.

Newton-Schulz needs the whole matrix; FSDP2/TP/EP hold DTensor shards of it. Following "Muon is
Scalable" (Moonlight) and torchtitan/Megatron's distributed Muon, each matrix's update is gathered
to ONE owner rank of the group that shards it, the owners are dealt round-robin so the
orthogonalisation work is spread over the group, the owner orthogonalises, and each rank gets back
its own shard (gather + scatter, never an all-gather of every matrix on every rank). Only the
matrix dims count: a 3-D expert tensor ``(E, a, b)`` sharded on the expert dim alone (expert
parallel) holds whole matrices and is orthogonalised per expert where it lies, without any traffic.

Exactness: the momentum, Nesterov blend, weight decay and update are elementwise, so on a shard they
give the same bits as on the whole tensor; the gather moves the update already cast to bfloat16
(torch's Newton-Schulz casts its input to bfloat16 as its first step, so casting before the move
changes no bit and halves the traffic), and the owner runs torch's function on exactly the matrix
one process would. Given the same gradients the result equals ``torch.optim.Muon`` bit for bit
(tests/test_optim.py); in training, the only difference left is the gradients' reduction order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import Shard, _StridedShard
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _adjust_lr, _zeropower_via_newtonschulz

from shardwise.errors import ShardwiseError
from shardwise.parallel.mesh import flat_group

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
# torch.optim.Muon's own defaults (its ``eps`` is the Newton-Schulz normaliser's floor).
MUON_DEFAULTS: dict[str, Any] = {"momentum": 0.95, "nesterov": True, "ns_coefficients": NS_COEFFICIENTS,
                                 "ns_eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": "match_rms_adamw"}


class MuonAdamW(torch.optim.AdamW):
    """AdamW on the groups without ``muon``, torch's Muon rule (sharding-aware) on those with it.

    Each muon group may set ``momentum``, ``nesterov``, ``ns_coefficients``, ``ns_eps``,
    ``ns_steps`` and ``adjust_lr_fn`` (torch.optim.Muon's meanings; defaults ``MUON_DEFAULTS``).
    ``adjust_lr_fn = "match_rms_adamw"`` (Moonlight's) lets Muon reuse AdamW's learning rate and
    weight decay. Muon groups hold 2-D matrices or 3-D stacks of them (experts, one matrix each).
    """

    def __init__(self, params: Iterable[Any], **adamw_kwargs: Any) -> None:
        super().__init__(params, **adamw_kwargs)
        self.muon_seconds = 0.0  # time in the last step's orthogonalisation (incl. its gathers)
        self._plans: dict[Any, Any] = {}  # each sharded parameter's gather plan, made at its first step
        for group in self.param_groups:
            group.setdefault("muon", False)
            if group["muon"]:
                for key, value in MUON_DEFAULTS.items():
                    group.setdefault(key, value)
                for p in group["params"]:
                    if p.dim() not in (2, 3):
                        raise ShardwiseError(
                            f"Muon orthogonalises matrices (2-D, or 3-D stacks of expert matrices); a "
                            f"parameter of shape {tuple(p.shape)} is in a muon group. Put vectors, "
                            "embeddings and the output head in an AdamW group (muon = False).")

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Adam's __setstate__ reads every non-empty state's "step"; Muon's states hold only their
        # momentum buffer: set those aside, then put them back.
        states = state.get("state", {})
        muon = {k: v for k, v in states.items() if v and "momentum_buffer" in v}
        for k in muon:
            del states[k]
        super().__setstate__(state)
        for k, v in muon.items():
            self.state[k] = v

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group.setdefault("muon", False)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        muon_groups = [g for g in groups if g["muon"]]
        # torch's AdamW step over the other groups only (its fused/foreach kernels as configured).
        self.param_groups = [g for g in groups if not g["muon"]]
        try:
            if self.param_groups:
                super().step()
        finally:
            self.param_groups = groups
        if muon_groups:
            t0 = time.perf_counter()
            self._muon_step(muon_groups)
            self.muon_seconds = time.perf_counter() - t0
        return loss

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        jobs: list[_Job] = []
        for group in groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                grad, buf = _local(p.grad), _local(state["momentum_buffer"])
                buf.lerp_(grad, 1 - momentum)  # torch.optim.Muon's update, on this rank's elements
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                jobs.append(_Job(p, group, update))
        orthogonalise(jobs, self._plans)
        for job in jobs:
            group, lr = job.group, job.group["lr"]
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], job.param.shape[-2:])
            local = _local(job.param)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(job.result, alpha=-adjusted_lr)


@dataclass
class _Job:
    param: torch.Tensor
    group: dict[str, Any]
    update: torch.Tensor  # this rank's elements of the Nesterov update
    result: Any = None  # this rank's elements of the orthogonalised update (bfloat16)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if _is_dtensor(t) else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def newton_schulz(matrices: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """torch's Newton-Schulz of a matrix, or of each matrix of a 3-D stack (experts), in bfloat16."""
    run = lambda m: _zeropower_via_newtonschulz(m, group["ns_coefficients"], group["ns_steps"],  # noqa: E731
                                                group["ns_eps"])
    if matrices.dim() == 2:
        return run(matrices)
    return torch.stack([run(m) for m in matrices])


# --------------------------------------------------------------------------- sharded orthogonalisation
@dataclass
class _Gather:
    """How one sharded parameter's matrix is put together on its owner and split again."""

    group: Any  # the process group of the ranks holding its shards (same replica)
    me: int  # this rank's index in it
    shapes: list[tuple[int, ...]]  # each member's local shape ...
    offsets: list[tuple[int, ...]]  # ... and offset in the whole tensor
    pad: int  # the largest local numel: gather/scatter move equal-size buffers


def orthogonalise(jobs: list[_Job], plans: dict[Any, Any]) -> None:
    """Set each job's ``result``: its update orthogonalised on the whole matrix, this rank's elements.

    Plain tensors (single, ddp, zero1's own parameters) and DTensors whose shards hold whole
    matrices are done where they lie. For the others every rank sends its bfloat16 shard to the
    matrix's owner (round-robin over the members, in parameter order: the same on every rank), the
    owners run Newton-Schulz, and each rank gets its shard back. All gathers are in flight together,
    then all scatters. ``plans`` caches each parameter's gather plan (and the flattened groups)
    across steps; the caller keeps it as long as the parameters live.
    """
    sharded: list[tuple[_Job, _Gather, int]] = []
    counters: dict[int, int] = {}
    for job in jobs:
        plan = _gather_plan(job.param, plans)
        if plan is None:
            job.result = newton_schulz(job.update, job.group)
            continue
        size = dist.get_world_size(plan.group)
        owner = counters.get(id(plan.group), 0) % size
        counters[id(plan.group)] = counters.get(id(plan.group), 0) + 1
        sharded.append((job, plan, owner))
    if not sharded:
        return
    received: list[list[torch.Tensor] | None] = []
    works = []
    for job, plan, owner in sharded:
        send = _padded(job.update.to(torch.bfloat16), plan.pad)
        bufs = [torch.empty_like(send) for _ in plan.shapes] if plan.me == owner else None
        works.append(dist.gather(send, bufs, group=plan.group, group_dst=owner, async_op=True))
        received.append(bufs)
    for w in works:
        w.wait()
    works, outs = [], []
    for (job, plan, owner), bufs in zip(sharded, received):
        pieces = None
        if bufs is not None:
            whole = torch.empty(job.param.shape, dtype=torch.bfloat16, device=job.update.device)
            for buf, shape, offset in zip(bufs, plan.shapes, plan.offsets):
                whole[_slices(shape, offset)] = buf[:math.prod(shape)].view(shape)
            ortho = newton_schulz(whole, job.group)
            pieces = [_padded(ortho[_slices(shape, offset)], plan.pad) for shape, offset in
                      zip(plan.shapes, plan.offsets)]
        out = torch.empty(plan.pad, dtype=torch.bfloat16, device=job.update.device)
        works.append(dist.scatter(out, pieces, group=plan.group, group_src=owner, async_op=True))
        outs.append(out)
    for w in works:
        w.wait()
    for (job, plan, _), out in zip(sharded, outs):
        shape = plan.shapes[plan.me]
        job.result = out[:math.prod(shape)].view(shape)


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.numel() == size:
        return flat.contiguous()
    out = torch.zeros(size, dtype=t.dtype, device=t.device)
    out[:flat.numel()] = flat
    return out


def _slices(shape: tuple[int, ...], offset: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for s, o in zip(shape, offset))


def _gather_plan(param: torch.Tensor, plans: dict[Any, Any]) -> _Gather | None:
    """None where this rank's elements of ``param`` are whole matrices; else how to gather them."""
    if not _is_dtensor(param):
        return None
    mesh, placements = param.device_mesh, tuple(param.placements)
    if any(pl.is_partial() for pl in placements):
        raise ShardwiseError(f"Muon got a parameter with placements {placements}: a Partial (unreduced) "
                             "parameter cannot be orthogonalised; this is a strategy bug.")
    ndim = param.dim()
    # FSDP over a column-wise TP shard is a _StridedShard, not a Shard (torch 2.13): both cut a dim.
    shard_dims = [d for d, pl in enumerate(placements) if isinstance(pl, (Shard, _StridedShard))]
    if not any(placements[d].dim % ndim >= ndim - 2 for d in shard_dims):
        return None  # only the expert dim (or nothing) is cut: whole matrices here
    if id(param) not in plans:
        # Shapes and mesh coordinates only: torch's offset arithmetic reads small tensors on the host,
        # which a rehearsal's fake mode would refuse (they hold no data of the run).
        with unset_fake_temporarily():
            plans[id(param)] = _make_plan(mesh, placements, tuple(param.shape), shard_dims, plans)
    return plans[id(param)]


def _make_plan(mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...], shard_dims: list[int],
               groups: dict[Any, Any]) -> _Gather:
    group = _shard_group(mesh, shard_dims, groups)
    sizes = [mesh.size(d) for d in shard_dims]
    mine = list(mesh.get_coordinate())
    shapes, offsets = [], []
    for index in range(math.prod(sizes)):
        coord, rest = list(mine), index
        for d, size in reversed(list(zip(shard_dims, sizes))):  # row-major, as the flattened group
            coord[d], rest = rest % size, rest // size
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh.shape, coord, placements)
        shapes.append(tuple(local_shape))
        offsets.append(tuple(offset))
    me = dist.get_rank(group)
    if (shapes[me], offsets[me]) != _local_shape_here(mesh, placements, shape):
        raise ShardwiseError("Muon's gather plan does not match this rank's shard (the mesh group's rank "
                             "order differs from the mesh's); this is a bug.")
    return _Gather(group, me, shapes, offsets, max(math.prod(s) for s in shapes))


def _local_shape_here(mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(local), tuple(offset)


def _shard_group(mesh: Any, shard_dims: list[int], groups: dict[Any, Any]) -> Any:
    """The process group over the mesh dims that shard the tensor (flattened if more than one)."""
    if len(shard_dims) == 1:
        return mesh.get_group(shard_dims[0])
    key = ("group", id(mesh), tuple(shard_dims))
    if key not in groups:
        names = mesh.mesh_dim_names
        if not names:
            raise ShardwiseError("Muon needs named mesh dims to gather a matrix sharded on several of them.")
        groups[key] = flat_group(mesh, tuple(names[d] for d in shard_dims), "muon")
    return groups[key]
