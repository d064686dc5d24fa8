"""The single list of strategies, with what each one needs and does (Lightning-registry style).

Each entry is metadata only and imports nothing heavy: config validation, the layout and the
planner (``shardwise plan`` answers without importing torch) read it; ``get_strategy`` imports the
implementation named by ``impl`` only when a rank needs it. The planner enumerates candidates from
this table, so it proposes exactly the strategies the runtime can run, on the models they support.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwise.errors import ConfigError, unknown_choice

if TYPE_CHECKING:
    from shardwise.layout import Layout
    from shardwise.parallel.base import Strategy

# Model families (``ModelSpec.family``, ``Workload.family``): "gpt" is shardwise's built-in GPT,
# the others are Hugging Face ``model_type`` values. Hugging Face families whose layers follow the
# Llama layout (q/k/v/o_proj, gate/up/down_proj) share one tensor-parallel plan.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
# Families with a tensor-parallel plan (``parallel/tp_plans.py``).
TP_FAMILIES = ("gpt", *LLAMA_LIKE)
# Families the pipeline can cut into stages: the built-in GPT, whose parts may be None
# (``parallel/pp.py``).
PP_FAMILIES = ("gpt",)
# Mesh of the model-parallel compositions, torchtitan's order: tp innermost (consecutive ranks,
# the fastest link), then dp, then pp outermost.
COMPOSED_MESH = ("pp", "dp", "tp")


@dataclass(frozen=True)
class StrategyInfo:
    """What a strategy is, without importing it.

    ``mesh_dims``: dim names of its device mesh. ``degrees``: the parallel degrees it uses (a subset
    of dp, tp, pp; the others are 1). ``dp_kind``: how the data-parallel dimension holds model state
    (replicate, zero1, zero2 or fsdp). ``families``: the model families it can run (None: any
    ``nn.Module``).
    """

    name: str
    impl: str  # "module:Class", imported by get_strategy
    description: str
    mesh_dims: tuple[str, ...]
    degrees: tuple[str, ...]
    dp_kind: str
    shards: str  # what each rank holds only a part of, in words
    families: tuple[str, ...] | None = None
    offload: bool = False
    hybrid: bool = False  # a (replicate, shard) data-parallel mesh (HSDP)
    max_world: int | None = None
    # False: the planner's grid leaves it out (the DeepSpeed kinds: their offload math is in
    # plan/offload.py, for the planner's search to add when nothing fits on the GPUs).
    planned: bool = True

    @property
    def model_parallel(self) -> bool:
        """True for the compositions on the ("pp", "dp", "tp") mesh."""
        return self.mesh_dims == COMPOSED_MESH

    def supports(self, family: str) -> bool:
        """Whether a model of ``family`` ("" when unknown) can run under this strategy."""
        return self.families is None or family in self.families

    def unsupported_reason(self, family: str) -> str:
        """Why a model of ``family`` cannot run under this strategy ('' when it can)."""
        if self.supports(family):
            return ""
        what = family or "this (custom) model"
        if "pp" in self.degrees:
            return (f"pipeline parallel cuts only the built-in GPT (model.kind = 'gpt') into stages; "
                    f"{what} has no stage split")
        return (f"tensor parallel has plans for the built-in GPT and the Hugging Face families "
                f"{', '.join(LLAMA_LIKE)}; {what} has none")


_MP = "shardwise.parallel.composed"
_DS = "shardwise.parallel.deepspeed"
_STRATEGIES = (
    StrategyInfo("single", "shardwise.parallel.single:SingleStrategy", "one process, no parallelism",
                 ("dp",), (), "replicate", "nothing", max_world=1),
    StrategyInfo("ddp", "shardwise.parallel.ddp:DDPStrategy",
                 "replicate the model, all-reduce gradients (DistributedDataParallel)",
                 ("dp",), ("dp",), "replicate", "nothing (gradients are all-reduced)"),
    StrategyInfo("zero1", "shardwise.parallel.zero1:ZeRO1Strategy",
                 "ZeRO-1: replicate parameters and gradients (DDP), shard optimizer state",
                 ("dp",), ("dp",), "zero1", "optimizer state"),
    StrategyInfo("zero2", "shardwise.parallel.fsdp:ZeRO2Strategy",
                 "ZeRO-2: shard gradients and optimizer state; whole parameters through fwd+bwd",
                 ("dp",), ("dp",), "zero2", "gradients, optimizer state (parameters between steps)"),
    StrategyInfo("fsdp", "shardwise.parallel.fsdp:FSDPStrategy",
                 "ZeRO-3: shard parameters, gradients and optimizer state (FSDP2 fully_shard)",
                 ("dp",), ("dp",), "fsdp", "parameters, gradients, optimizer state"),
    StrategyInfo("hsdp", "shardwise.parallel.fsdp:HSDPStrategy",
                 "hybrid: shard within groups of hsdp_shard_size ranks, replicate across groups",
                 ("replicate", "shard"), ("dp",), "fsdp",
                 "parameters, gradients, optimizer state (within a shard group)", hybrid=True),
    StrategyInfo("fsdp-offload", "shardwise.parallel.fsdp:FSDPOffloadStrategy",
                 "ZeRO-3 with parameters, gradients and optimizer state kept on the CPU",
                 ("dp",), ("dp",), "fsdp", "parameters, gradients, optimizer state (in host memory)",
                 offload=True),
    # DeepSpeed engine (issue 23): ZeRO-3 with CPU/NVMe offload, or the user's ds_config.json.
    StrategyInfo("zero3-offload", f"{_DS}:ZeRO3OffloadStrategy",
                 "DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to host memory",
                 ("dp",), ("dp",), "fsdp", "parameters, gradients, optimizer state (in host memory)",
                 offload=True, planned=False),
    StrategyInfo("zero3-nvme", f"{_DS}:ZeRO3NVMeStrategy",
                 "DeepSpeed ZeRO-Infinity: parameters and optimizer state swapped to parallel.nvme_path",
                 ("dp",), ("dp",), "fsdp", "parameters, gradients, optimizer state (on NVMe)",
                 offload=True, planned=False),
    StrategyInfo("deepspeed", f"{_DS}:DeepSpeedStrategy",
                 "DeepSpeed with the user's parallel.deepspeed_config (any ZeRO stage and offload)",
                 ("dp",), ("dp",), "fsdp", "what the DeepSpeed config's ZeRO stage shards", planned=False),
    StrategyInfo("tp", f"{_MP}:TPStrategy",
                 "tensor parallel: split every layer's matrices across ranks (parallelize_module)",
                 COMPOSED_MESH, ("tp",), "replicate", "every layer's matrices", TP_FAMILIES),
    StrategyInfo("pp", f"{_MP}:PPStrategy",
                 "pipeline parallel: split the layers into stages (torch.distributed.pipelining)",
                 COMPOSED_MESH, ("pp",), "replicate", "the layers (pipeline stages)", PP_FAMILIES),
    StrategyInfo("ddp+pp", f"{_MP}:DDPPPStrategy",
                 "pipeline stages, each replicated with DDP across the dp dimension",
                 COMPOSED_MESH, ("pp", "dp"), "replicate", "the layers (pipeline stages)", PP_FAMILIES),
    StrategyInfo("fsdp+pp", f"{_MP}:FSDPPPStrategy",
                 "pipeline stages, each sharded with FSDP2 across the dp dimension",
                 COMPOSED_MESH, ("pp", "dp"), "fsdp", "the layers; parameters, gradients, optimizer state",
                 PP_FAMILIES),
    StrategyInfo("fsdp+tp", f"{_MP}:FSDPTPStrategy",
                 "2-D: tensor parallel inside a node, FSDP2 across the dp dimension",
                 COMPOSED_MESH, ("dp", "tp"), "fsdp", "matrices; parameters, gradients, optimizer state",
                 TP_FAMILIES),
    StrategyInfo("fsdp+tp+pp", f"{_MP}:FSDPTPPPStrategy",
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
    """Return the registry entry of ``name`` (an alias works; 'auto' does not: resolve it first)."""
    canonical = canonical_strategy(name)
    if canonical == "auto":
        raise ConfigError("strategy 'auto' is resolved by shardwise.layout.resolve_layout from the world "
                          "size and parallel.tp/pp; it has no registry entry of its own.")
    return REGISTRY[canonical]


def composition_for(tp: int, pp: int) -> str:
    """The strategy that degrees alone select ('auto' with parallel.tp/pp set).

    The data-parallel dimension shards with FSDP2 when TP is on (DDP over DTensor parameters is not
    supported) and replicates with DDP otherwise.
    """
    return {(True, False): "fsdp+tp", (False, True): "ddp+pp", (True, True): "fsdp+tp+pp"}[(tp > 1, pp > 1)]


def get_strategy(layout: Layout) -> Strategy:
    """Return an instance of the layout's strategy, bound to that layout."""
    module_name, _, cls_name = REGISTRY[layout.strategy].impl.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(layout)
