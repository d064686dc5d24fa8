"""The strategy table: every strategy name as an alias for a data-parallel kind plus degrees.

Torch-free and below ``config``, ``layout`` and ``parallel/`` (it imports only ``errors`` and
``families``): config validation, the layout, the planner and the runtime all read it, and none
of them reaches it through a lazy import or an import string.

A run's shape is a data-parallel kind (how data-parallel ranks hold model state) plus degrees
(torchtitan's ``ParallelDims``, Accelerate's ``ParallelismConfig``):

    dp_replicate x dp_shard x cp x tp x pp = world size      (ep is borrowed from dp_shard x cp)

``Layout.dp`` is the mesh's whole data dimension, dp_replicate x dp_shard x cp: cp ranks share a
data index and FSDP shards over dp_shard x cp, as torchtitan flattens them.

``shardwise.core.layout.Layout`` owns the degrees of one run; this module owns the names. Each row
carries what the one implementation of its data-parallel kind needs (``parallel/``): the dp kind,
offload, reshard-after-forward, the degrees it uses, the mesh dims and the model families it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.core.families import PP_FAMILIES, TP_FAMILIES, no_stage_split, no_tp_plan
from shardwise.core.pp_schedules import PP_SCHEDULES  # the schedules and their rules have their own owner
from shardwise.errors import ConfigError, unknown_choice

__all__ = ["AC_MODES", "ALIASES", "COMPOSED_MESH", "DEGREES", "DP_KINDS", "GRAD_SYNC_MODES", "MESH_ORDER",
           "PP_SCHEDULES", "REGISTRY", "StrategyInfo", "canonical_strategy",
           "composition_for", "degree_set", "strategy_for_degrees", "strategy_info", "strategy_names"]

# ----------------------------------------------------------------- modes (defined once, here)
# "selective": every ac_every-th block; "selective-op": torchtitan's per-op policy on every block;
# "moe": every mixture-of-experts layer alone (Megatron-Core's --recompute-modules moe).
AC_MODES = ("none", "full", "selective", "selective-op", "moe")
# When gradients are reduced under accumulation: "step" skips the sync on all but the last
# micro-batch (no_sync); "microbatch" reduces every micro-batch (sharded strategies then never
# hold a whole unsharded gradient: less memory, one reduce-scatter per micro-batch).
GRAD_SYNC_MODES = ("step", "microbatch")

# ----------------------------------------------------------------- degrees
# Every degree a run has, in mesh order: pp outermost (the slowest link: one activation per
# micro-batch), then data parallel (replicate, then shard: shard groups are consecutive ranks,
# i.e. one node), then cp, then tp innermost (two collectives per layer: the fastest link). ep is
# not a mesh dim of its own: it is borrowed from dp_shard x cp, as in torchtitan.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DEGREES = (*MESH_ORDER, "ep")
# How data-parallel ranks hold model state.
DP_KINDS = ("replicate", "zero1", "zero2", "fsdp")
# Mesh of the model-parallel compositions: the MESH_ORDER with the data-parallel degrees as one
# "dp" dim (its replicate/shard split is the row's dp kind). Dims of size 1 are kept.
COMPOSED_MESH = ("pp", "dp", "tp")


@dataclass(frozen=True)
class StrategyInfo:
    """One row of the table: what a strategy name stands for.

    ``impl``: which of the implementations in ``parallel/`` runs it (one per data-parallel kind:
    single, ddp, zero1, fsdp, model-parallel). ``mesh_dims``: dim names of its device mesh.
    ``degrees``: the parallel degrees it uses (a subset of dp, tp, pp; the others are 1).
    ``dp_kind``: how the data-parallel dimension holds model state (``DP_KINDS``). ``families``:
    the model families it runs (None: any ``nn.Module``). ``offload``: state in host memory;
    ``reshard_after_forward``: False keeps whole parameters from forward to backward (ZeRO-2);
    ``hybrid``: a (replicate, shard) data-parallel mesh (HSDP).
    """

    name: str
    impl: str
    description: str
    mesh_dims: tuple[str, ...]
    degrees: tuple[str, ...]
    dp_kind: str
    shards: str  # what each rank holds only a part of, in words
    families: tuple[str, ...] | None = None
    offload: bool = False
    hybrid: bool = False
    max_world: int | None = None
    reshard_after_forward: bool = True
    # False: the planner's grid leaves it out (the DeepSpeed kinds: their offload math is in
    # plan/offload.py, for the planner's search to add when nothing fits on the GPUs).
    planned: bool = True

    @property
    def model_parallel(self) -> bool:
        """True for the compositions on the ("pp", "dp", "tp") mesh."""
        return self.mesh_dims == COMPOSED_MESH

    @property
    def shards_over_dp(self) -> bool:
        """Whether the data-parallel ranks hold FSDP2 shards of the parameters (zero2 and the fsdp kinds)."""
        return self.dp_kind in ("zero2", "fsdp")

    def supports(self, family: str) -> bool:
        """Whether a model of ``family`` ("" when unknown) can run under this strategy."""
        return self.families is None or family in self.families

    def unsupported_reason(self, family: str) -> str:
        """Why a model of ``family`` cannot run under this strategy ('' when it can)."""
        if self.supports(family):
            return ""
        what = family or "this (custom) model"
        return no_stage_split(what) if "pp" in self.degrees else no_tp_plan(what)


_STRATEGIES = (
    StrategyInfo("single", "single", "one process, no parallelism",
                 ("dp",), (), "replicate", "nothing", max_world=1),
    StrategyInfo("ddp", "ddp", "replicate the model, all-reduce gradients (DistributedDataParallel)",
                 ("dp",), ("dp",), "replicate", "nothing (gradients are all-reduced)"),
    StrategyInfo("zero1", "zero1", "ZeRO-1: replicate parameters and gradients (DDP), shard optimizer state",
                 ("dp",), ("dp",), "zero1", "optimizer state"),
    StrategyInfo("zero2", "fsdp", "ZeRO-2: shard gradients and optimizer state; whole parameters through fwd+bwd",
                 ("dp",), ("dp",), "zero2", "gradients, optimizer state (parameters between steps)",
                 reshard_after_forward=False),
    StrategyInfo("fsdp", "fsdp", "ZeRO-3: shard parameters, gradients and optimizer state (FSDP2 fully_shard)",
                 ("dp",), ("dp",), "fsdp", "parameters, gradients, optimizer state"),
    StrategyInfo("hsdp", "fsdp", "hybrid: shard within groups of hsdp_shard_size ranks, replicate across groups",
                 ("replicate", "shard"), ("dp",), "fsdp",
                 "parameters, gradients, optimizer state (within a shard group)", hybrid=True),
    StrategyInfo("fsdp-offload", "fsdp", "ZeRO-3 with parameters, gradients and optimizer state kept on the CPU",
                 ("dp",), ("dp",), "fsdp", "parameters, gradients, optimizer state (in host memory)",
                 offload=True),
    # The DeepSpeed engine (parallel/deepspeed/strategy.py): ZeRO-3 with CPU/NVMe offload, or the user's
    # ds_config.json. One implementation each: they differ in where their DeepSpeed config comes from.
    StrategyInfo("zero3-offload", "zero3-offload",
                 "DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to host memory",
                 ("dp",), ("dp",), "fsdp", "parameters, gradients, optimizer state (in host memory)",
                 offload=True, planned=False),
    StrategyInfo("zero3-nvme", "zero3-nvme",
                 "DeepSpeed ZeRO-Infinity: parameters and optimizer state swapped to parallel.nvme_path",
                 ("dp",), ("dp",), "fsdp", "parameters, gradients, optimizer state (on NVMe)",
                 offload=True, planned=False),
    StrategyInfo("deepspeed", "deepspeed",
                 "DeepSpeed with the user's parallel.deepspeed_config (any ZeRO stage and offload)",
                 ("dp",), ("dp",), "fsdp", "what the DeepSpeed config's ZeRO stage shards", planned=False),
    StrategyInfo("tp", "model-parallel",
                 "tensor parallel: split every layer's matrices across ranks (parallelize_module)",
                 COMPOSED_MESH, ("tp",), "replicate", "every layer's matrices", TP_FAMILIES),
    StrategyInfo("pp", "model-parallel",
                 "pipeline parallel: split the layers into stages (torch.distributed.pipelining)",
                 COMPOSED_MESH, ("pp",), "replicate", "the layers (pipeline stages)", PP_FAMILIES),
    StrategyInfo("ddp+pp", "model-parallel", "pipeline stages, each replicated with DDP across the dp dimension",
                 COMPOSED_MESH, ("pp", "dp"), "replicate", "the layers (pipeline stages)", PP_FAMILIES),
    StrategyInfo("fsdp+pp", "model-parallel", "pipeline stages, each sharded with FSDP2 across the dp dimension",
                 COMPOSED_MESH, ("pp", "dp"), "fsdp", "the layers; parameters, gradients, optimizer state",
                 PP_FAMILIES),
    StrategyInfo("fsdp+tp", "model-parallel", "2-D: tensor parallel inside a node, FSDP2 across the dp dimension",
                 COMPOSED_MESH, ("dp", "tp"), "fsdp", "matrices; parameters, gradients, optimizer state",
                 TP_FAMILIES),
    StrategyInfo("fsdp+tp+pp", "model-parallel",
                 "3-D: pipeline stages x FSDP2 replicas x tensor parallel (torchtitan layout)",
                 COMPOSED_MESH, ("pp", "dp", "tp"), "fsdp",
                 "the layers; matrices; parameters, gradients, optimizer state",
                 tuple(f for f in TP_FAMILIES if f in PP_FAMILIES)),
)
REGISTRY: dict[str, StrategyInfo] = {s.name: s for s in _STRATEGIES}

ALIASES: dict[str, str] = {"zero3": "fsdp", "none": "single", "3d": "fsdp+tp+pp", "tp+pp": "fsdp+tp+pp"}


def strategy_names() -> list[str]:
    """Every accepted strategy name, aliases and 'auto' included."""
    return sorted([*REGISTRY, *ALIASES, "auto"])


def canonical_strategy(name: str) -> str:
    """Return the canonical name for ``name`` ('auto' stays 'auto'); ConfigError lists valid ones."""
    name = ALIASES.get(name, name)
    if name == "auto" or name in REGISTRY:
        return name
    raise unknown_choice("strategy", name, strategy_names())


def strategy_info(name: str) -> StrategyInfo:
    """Return the table row of ``name`` (an alias works; 'auto' does not: resolve it first)."""
    canonical = canonical_strategy(name)
    if canonical == "auto":
        raise ConfigError("strategy 'auto' is resolved by shardwise.core.layout.resolve_layout from the world "
                          "size and the parallel degrees; it has no table row of its own.")
    return REGISTRY[canonical]


def composition_for(tp: int, pp: int) -> str:
    """The strategy that tp/pp degrees alone select ('auto' with parallel.tp/pp set).

    The data-parallel dimension shards with FSDP2 when TP is on (DDP over DTensor parameters is not
    supported) and replicates with DDP otherwise.
    """
    return {(True, False): "fsdp+tp", (False, True): "ddp+pp", (True, True): "fsdp+tp+pp"}[(tp > 1, pp > 1)]


def degree_set(name: str, dp: int, *, tp: int = 1, pp: int = 1, shard: int = 0) -> dict[str, int]:
    """The degrees a strategy name stands for, given its data-parallel size ``dp`` (and, for hsdp,
    its shard group ``shard``): ``{"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"}``.

    The inverse of ``strategy_for_degrees`` for every row (up to its dp kind: ddp, zero1 and the
    replicating compositions all have dp_shard 1, and zero2, fsdp-offload and fsdp differ in kind).
    """
    info = strategy_info(name)
    if info.hybrid:
        dp_shard = shard or dp
    elif info.shards_over_dp:
        dp_shard = dp
    else:
        dp_shard = 1
    return {"dp_replicate": dp // dp_shard, "dp_shard": dp_shard, "cp": 1,
            "tp": tp if "tp" in info.degrees else 1, "pp": pp if "pp" in info.degrees else 1, "ep": 1}


def strategy_for_degrees(dp_replicate: int, dp_shard: int, tp: int = 1, pp: int = 1, *,
                         dp_kind: str = "") -> str:
    """The strategy a degree set (with ``parallel.strategy = 'auto'``) selects.

    ``dp_kind`` picks among the rows of one degree set ("" takes the default: fsdp when dp_shard > 1,
    replicate otherwise; "zero1"/"zero2" name those rows). ConfigError when no strategy runs it.
    """
    for key, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("tp", tp), ("pp", pp)):
        if value < 1:
            raise ConfigError(f"parallel.{key} must be >= 1 here, got {value}.")
    if tp > 1 or pp > 1:
        if dp_replicate > 1 and dp_shard > 1:
            raise ConfigError(
                f"parallel.dp_replicate={dp_replicate} and parallel.dp_shard={dp_shard} with "
                f"tp={tp}/pp={pp}: hybrid sharding inside a tp/pp composition is not implemented; set one "
                "of dp_replicate or dp_shard to 1.")
        if tp > 1 and dp_replicate > 1:
            raise ConfigError(
                f"parallel.dp_replicate={dp_replicate} with parallel.tp={tp}: DDP over tensor-parallel "
                f"(DTensor) parameters is not supported; use parallel.dp_shard={dp_replicate} (FSDP2 "
                "across the data-parallel dimension) instead.")
        if tp > 1 and pp > 1:
            return "fsdp+tp+pp"
        if tp > 1:
            return "fsdp+tp" if dp_shard > 1 else "tp"
        if dp_shard > 1:
            return "fsdp+pp"
        return "ddp+pp" if dp_replicate > 1 else "pp"
    if dp_replicate > 1 and dp_shard > 1:
        return "hsdp"
    if dp_shard > 1:
        return dp_kind if dp_kind in ("zero2",) else "fsdp"
    if dp_replicate > 1:
        return "zero1" if dp_kind == "zero1" else "ddp"
    return "single"
