"""The one owner of device meshes and process groups (torchtitan's ``ParallelDims.build_mesh``).

``build_meshes(layout, device_type)`` makes one 1-D world mesh with ``init_device_mesh`` and cuts it,
with ``DeviceMesh._unflatten``, into the named views the dimensions use. Nothing else in shardwise
calls ``init_device_mesh`` or ``new_group`` (``tests/test_mesh_owner.py`` fails if something does):
a dimension asks this object for its view.

    view      dims                                          built when      used by
    dense     the layout's mesh: ("dp",), ("replicate",     always          DDP, ZeRO-1, FSDP2, TP, PP
              "shard") for hsdp, ("pp", "dp", "tp")
    batch     ("pp", "batch", "cp", "tp")                   cp > 1          context parallel's groups
    sparse    ("pp", "dp_replicate", "efsdp", "ep", "tp")   ep > 1          expert parallel, expert FSDP

Every view lays the same ranks out row-major over the same order (pp outermost, tp innermost), so a
rank's dense ``dp`` index is its ``batch x cp`` index and its ``dp_replicate x efsdp x ep`` index:
cp and ep groups are consecutive data-parallel ranks, inside one (hsdp) shard group. FSDP shards
over the dense ``dp`` dim, i.e. dp_shard x cp (torchtitan's ``fsdp`` view); the experts over
``efsdp`` = dp_shard x cp / ep (torchtitan's expert-FSDP view).

Any backend works: the Session's (gloo, nccl), or a process group the caller started before the
Session, e.g. torch's ``fake`` backend for a full-scale rehearsal on one machine::

    dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=256)
    session = Session(strategy="fsdp+tp", parallel=...)   # reads rank and world from the group
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardwise.core.layout import Layout

__all__ = ["Meshes", "background_io_group", "build_meshes", "flat_group"]


@dataclass
class Meshes:
    """The world mesh and its named views for one run (see the module docstring)."""

    layout: Layout
    world: Any
    dense: Any
    batch: Any = None
    sparse: Any = None
    _pair_groups: dict[tuple[int, int], Any] = field(default_factory=dict, repr=False)

    # ---------------------------------------------------------------- context parallel
    def cp_group(self) -> tuple[Any, int]:
        """(this rank's context-parallel process group, its rank in it)."""
        if self.batch is None:
            raise ValueError("no context-parallel view: the layout has cp = 1")
        cp = self.batch["cp"]
        return cp.get_group(), cp.get_local_rank()

    # ---------------------------------------------------------------- expert parallel
    @property
    def ep(self) -> Any:
        """The 1-D mesh of this rank's expert-parallel group (the token all-to-alls)."""
        return self._sparse()["ep"]

    @property
    def expert_fsdp(self) -> Any:
        """The mesh FSDP2 shards each expert over: ``efsdp`` ranks holding the same experts, and
        (hsdp) the replicate groups as a 2-D (replicate, shard) mesh."""
        sparse = self._sparse()
        if self.layout.dp_replicate > 1:
            return sparse["dp_replicate", "efsdp"]
        return sparse["efsdp"]

    def _sparse(self) -> Any:
        if self.sparse is None:
            raise ValueError("no expert-parallel view: the layout has ep = 1")
        return self.sparse

    # ---------------------------------------------------------------- pipeline ties
    def stage_pair_group(self, first: int, last: int) -> tuple[Any, int]:
        """(the 2-rank group joining this rank's pipeline stage ``first`` and ``last`` ranks of its
        (dp, tp) coordinate, the global rank of its ``first`` end); (None, -1) for a rank in neither.

        A tied embedding/head cut by the stage split is kept equal over it (``pipeline/ties.py``). Every
        rank creates every pair once, in the same order (``new_group`` is collective)."""
        ranks = self.dense.mesh  # (pp, dp, tp)
        me = dist.get_rank()
        mine: tuple[Any, int] = (None, -1)
        for d in range(ranks.shape[1]):
            for t in range(ranks.shape[2]):
                pair = (int(ranks[first, d, t]), int(ranks[last, d, t]))
                group = self._pair_groups.get(pair)
                if group is None:
                    group = self._pair_groups[pair] = dist.new_group(list(pair))
                if me in pair:
                    mine = (group, pair[0])
        return mine


def build_meshes(layout: Layout, device_type: str) -> Meshes:
    """Return the meshes of ``layout`` on the started process group (any backend).

    Called once per run, on every rank in the same order (mesh construction is collective).
    """
    world = init_device_mesh(device_type, (layout.world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, layout.mesh_shape, layout.mesh_dim_names)
    batch = sparse = None
    if layout.cp > 1:
        batch = world._unflatten(0, (layout.pp, layout.dp // layout.cp, layout.cp, layout.tp),
                                 ("pp", "batch", "cp", "tp"))
    if layout.ep > 1:
        sparse = world._unflatten(
            0, (layout.pp, layout.dp_replicate, layout.dp_shard_mod_ep, layout.ep, layout.tp),
            ("pp", "dp_replicate", "efsdp", "ep", "tp"))
    return Meshes(layout, world, dense, batch, sparse)


def flat_group(mesh: Any, dims: tuple[str, ...], purpose: str) -> Any:
    """The process group over several named dims of a view (e.g. the dims a DTensor is sharded on:
    Muon gathers a matrix over them), flattened once: torch keeps a flattened mesh by its name."""
    return mesh[dims]._flatten("_".join((purpose, *dims))).get_group()


def background_io_group(timeout_s: float) -> Any:
    """A gloo group over every rank for work done beside training (the background checkpoint writer's
    planning and publish gathers): its collectives never interleave with training's on the default
    group, and on CUDA it is the CPU backend DCP's async_save needs. Collective: every rank calls it."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
