"""The parallel layout: one frozen object that owns every degree of a run.

``resolve_layout`` builds it once from the ``[parallel]`` config and the world size (and, once the
model is known, the number of its transformer blocks): the canonical strategy, the data-parallel
degree split into replicate x shard, the tensor and pipeline degrees, the device mesh's shape and
dim names, the pipeline schedule, stages per rank, micro-batches and each stage's layer range.
Config checks, preflight, every strategy, the Session, the memory ledger and the planner read it;
nobody works a degree out again (torchtitan's ``ParallelDims`` in spirit). It imports no torch: the
planner builds one per candidate and answers in well under a second.

    layout = resolve_layout(ParallelConfig(strategy="fsdp+tp", tp=2), world_size=8)
    layout.dp, layout.tp, layout.mesh_shape     # 4, 2, (1, 4, 2)

Constructing ``Layout(...)`` directly (the planner's pure arithmetic does) validates the same
structural rules; ``resolve_layout`` adds the inference of unset degrees from the world size and
messages that name the config keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardwise.core.pp_schedules import check_schedule, checkpoint_refusal, ddp_refusal, ep_refusal, stage_ids_of
from shardwise.core.strategies import (
    COMPOSED_MESH,
    REGISTRY,
    StrategyInfo,
    canonical_strategy,
    composition_for,
    strategy_for_degrees,
)
from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.core.config import ParallelConfig

__all__ = ["EP_GROUPS", "Layout", "data_parallel_degree", "ep_group_ranks", "ranks_per_node", "resolve_layout",
           "stage_layer_ranges", "tp_indivisible"]

# How a training stack forms its expert-parallel groups: the one owner of the ep divisibility rule,
# asked by ``Layout._check_ep`` and (through ``Layout.ep_groups``, set from the planner's stack
# property ``Kernels.ep_groups``, plan/stacks.py) by the planner. ``ep_group_ranks`` says which ranks
# an expert group is carved from; ep must divide their count.
EP_GROUPS: dict[str, str] = {
    # shardwise's runtime and torchtitan with expert-tensor-parallel = tp: ep is borrowed from the
    # FSDP shard ranks, dp_shard x cp (parallel/mesh.py); expert groups are dp ranks tp apart.
    "dp-shard": "dp_shard x cp (the FSDP shard ranks)",
    # DeepSpeed-MoE: expert groups are carved out of the data-parallel ranks of any ZeRO stage
    # (deepspeed.utils.groups: the dp world size must divide by ep); dp ranks tp apart.
    "dp": "dp x cp (the data-parallel ranks, whatever they hold)",
    # Megatron-Core's MoE parallel folding with expert-tensor-parallel 1 (moe/README.md "MoE Parallel
    # Folding"; parallel_state.initialize_model_parallel: world % (etp x ep x pp) == 0, expert data
    # parallel = world / (etp x ep x pp)): the experts' tp-ep-dp-pp groups fold over the attention's
    # tp x cp x dp ranks of each pipeline stage, ep innermost with etp 1 (consecutive ranks).
    "tp-dp": "tp x dp x cp (every rank of a pipeline stage; Megatron's MoE parallel folding, ETP 1)",
}


def _runs_ep(info: StrategyInfo) -> bool:
    """Whether expert parallel runs under strategy ``info``: FSDP2 kinds only (the DeepSpeed engine has
    dp_kind "fsdp" too but never splits experts; offload is not wired)."""
    return info.dp_kind == "fsdp" and info.impl in ("fsdp", "model-parallel") and not info.offload


def _ranges(sizes: tuple[int, ...]) -> tuple[range, ...]:
    """Consecutive block ranges of the given sizes, from block 0."""
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return tuple(out)


def stage_layer_ranges(n_layer: int, n_stages: int, fewer: int = 0) -> list[range]:
    """Return the block indices of each stage: balanced, first and last ``fewer`` blocks lighter.

    The first stage also runs the embeddings and the last one the head and the loss, so
    ``fewer = k`` counts each of them as k blocks of work: ``n_layer + 2k`` virtual blocks are
    split evenly (the remainder goes to the middle stages) and k come off each end. An end stage
    may be left with no block at all: it still embeds (the first) or runs the head and the loss
    (the last), as Megatron's ``--account-for-embedding/loss-in-pipeline-split`` and the Llama 3
    paper's interleaved schedule do (126 layers in 16 x 8 stages, the end chunks one slot each).
    A middle stage needs a block: it would have nothing to run.
    """
    if n_stages > n_layer + (2 if fewer else 0):
        raise ConfigError(
            f"{n_stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank) exceed the "
            f"model's {n_layer} layers: each stage needs at least one layer"
            + (" (the first and the last may hold none when parallel.pp_first_stage_fewer >= 1: "
               "they still run the embedding and the head)." if not fewer else
               ", except the first and the last, which run the embedding and the head.")
        )
    if n_stages == 1:
        return [range(n_layer)]
    total = n_layer + 2 * fewer
    base, rem = divmod(total, n_stages)
    # The remainder goes to the stages nearest the middle, which carry no embedding or head.
    order = sorted(range(n_stages), key=lambda s: abs(s - (n_stages - 1) / 2))
    sizes = [base + (1 if s in order[:rem] else 0) for s in range(n_stages)]
    sizes[0] -= fewer
    sizes[-1] -= fewer
    ends, middle = min(sizes[0], sizes[-1]), min(sizes[1:-1], default=1)
    if ends < 0 or middle < 1:
        worst = ends if ends < 0 else middle
        raise ConfigError(
            f"cannot split {n_layer} layers into {n_stages} pipeline stages with "
            f"parallel.pp_first_stage_fewer={fewer}: a stage would get {worst} layers (the first and "
            "the last may hold none, every other stage needs one). Use fewer stages "
            "(pp x pp_stages_per_rank) or a smaller pp_first_stage_fewer."
        )
    return list(_ranges(tuple(sizes)))


@dataclass(frozen=True)
class Layout:
    """How the ranks of one run are arranged. Frozen; derive a variant with ``dataclasses.replace``.

    ``dp`` is the whole data dimension of the mesh (cp ranks included) and ``shard`` the size of the
    group that shards model state, cp ranks included (``dp_shard x cp``, torchtitan's ``fsdp``
    dim; ``dp_shard`` excludes cp): ``dp // shard`` groups replicate it. ddp and zero1 have
    shard 1 (zero1 shards only optimizer state, across all of ``dp``); zero2, fsdp, fsdp-offload
    and the fsdp compositions shard across all of ``dp``; hsdp across groups of ``shard`` ranks.
    ``shard=0`` and ``offload=None`` mean "what the strategy implies".
    """

    strategy: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    shard: int = 0
    offload: bool | None = None
    # Context parallel: cp ranks are a factor of ``dp`` (the mesh's data dim; ``dp_coords``,
    # ``cp_rank``). Expert parallel,
    # borrowed from the data-parallel shard ranks (no extra ranks): each group of ``ep`` consecutive
    # dp ranks splits every MoE layer's experts, and the ``dp_shard / ep`` groups FSDP-shard them.
    cp: int = 1
    ep: int = 1
    # Which ranks expert groups are carved from (EP_GROUPS): the runtime's "dp-shard"; another
    # stack's rule only where the planner describes that stack (plan --stack megatron).
    ep_groups: str = "dp-shard"
    # The routed experts tensor-parallel over tp (expert-tensor-parallel = tp: torchtitan, Megatron-Core
    # before its parallel folding), for the planner only (plan.memory.Kernels.experts_tp); the
    # runtime's TP plan keeps them whole on every TP rank and splits them by ep instead.
    experts_tp: bool = False
    # ZeRO-1's optimizer-state shard group, for the planner only (plan.memory.Kernels.zero1_group):
    # 0 shards over every data-parallel rank (the runtime, DeepSpeed, Megatron's distributed
    # optimizer); g: each group of g consecutive dp ranks shards it, the groups replicate it.
    zero1_group: int = 0
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    pp_microbatches: int = 0  # per step and per pipeline; 0: 2 x pp
    pp_first_stage_fewer: int = 0
    # Another stack's stage split, for the planner only: the blocks of each stage in order (empty:
    # the runtime's split, stage_layer_ranges). nanotron balances its stages by a per-block cost
    # (plan.pipeline.cost_balanced_stage_layers, plan.memory.Kernels.pp_split); the runtime never
    # runs such a split.
    stage_layers: tuple[int, ...] = ()
    sequence_parallel: bool = False
    # The model's transformer blocks, once known: how many, and where (a dotted module path).
    n_blocks: int | None = None
    block_path: str = ""
    # Derived from the fields above: the block indices of each pipeline stage.
    stage_ranges: tuple[range, ...] = field(init=False, default=(), compare=False)
    # Set only by ``Layout.external``: the layout of another training stack (Megatron's ddp+tp, ...)
    # that the planner models to calibrate itself on published runs. The runtime never runs it.
    external: StrategyInfo | None = field(default=None, compare=False, repr=False)

    @classmethod
    def external_stack(cls, label: str, dp_kind: str, *, dp: int = 1, tp: int = 1, pp: int = 1,
                       **kwargs: Any) -> Layout:
        """A layout of another stack, by what its data-parallel ranks hold (``dp_kind``: replicate,
        zero1, zero2 or fsdp) and its degrees; for the planner's arithmetic only."""
        degrees = tuple(d for d, n in (("pp", pp), ("dp", dp), ("tp", tp)) if n > 1 or d == "dp")
        info = StrategyInfo(label, "", f"{label} (another training stack)", COMPOSED_MESH, degrees,
                            dp_kind, "as published")
        return cls(label, dp=dp, tp=tp, pp=pp, external=info, **kwargs)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise derived fields in place, once, here
        if self.external is None:
            set_(self, "strategy", canonical_strategy(self.strategy))
        if self.strategy == "auto":
            raise ConfigError("a Layout needs a concrete strategy; resolve 'auto' with resolve_layout().")
        info = self.info
        for key in ("dp", "tp", "pp", "cp", "ep", "pp_stages_per_rank"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel degree {key} must be an integer >= 1, got {value!r}.")
        for dim in ("dp", "tp", "pp"):
            if getattr(self, dim) > 1 and dim not in info.degrees:
                raise ConfigError(
                    f"parallel.{dim}={getattr(self, dim)} is set, but strategy {self.strategy!r} has no {dim} "
                    f"dimension (its dimensions: {', '.join(info.degrees) or 'none'}). Pick a strategy that "
                    f"includes it, e.g. 'fsdp+tp+pp', or leave parallel.{dim} unset.")
        for dim in info.degrees:
            if dim != "dp" and getattr(self, dim) < 2:
                raise ConfigError(
                    f"strategy {self.strategy!r} needs parallel.{dim} >= 2 (got {getattr(self, dim)} on "
                    f"{self.world_size} ranks); launch more ranks or set parallel.{dim}.")
        if info.max_world is not None and self.world_size > info.max_world:
            raise ConfigError(f"strategy {self.strategy!r} runs at most {info.max_world} rank(s).")
        set_(self, "shard", self._checked_shard(info))
        if isinstance(self.zero1_group, bool) or not isinstance(self.zero1_group, int) or self.zero1_group < 0:
            raise ConfigError(f"zero1_group must be an integer >= 0 (0: every data-parallel rank), got "
                              f"{self.zero1_group!r}.")
        if self.zero1_group and (info.dp_kind != "zero1" or self.zero1_group >= self.dp):
            set_(self, "zero1_group", 0)  # nothing to group: not ZeRO-1, or the group is every dp rank
        elif self.zero1_group and self.dp % self.zero1_group:
            raise ConfigError(f"zero1_group={self.zero1_group} must divide the {self.dp} data-parallel ranks "
                              "(ZeRO-1 shards its optimizer state within groups of that many).")
        offload = bool(info.offload)
        if self.offload is not None and bool(self.offload) != offload:
            raise ConfigError(f"strategy {self.strategy!r} {'always' if offload else 'never'} offloads; "
                              f"offload={self.offload} contradicts it.")
        set_(self, "offload", offload)
        self._check_ep()
        if self.info.hybrid and self.cp > 1 and self.shard % self.cp:
            raise ConfigError(
                f"parallel.cp={self.cp} must divide hsdp's shard group of {self.shard} ranks "
                "(parallel.hsdp_shard_size, cp ranks included): context-parallel ranks are consecutive "
                "data-parallel ranks inside one shard group. Pick a shard group that is a multiple of cp.")
        if self.dp % self.cp:
            raise ConfigError(
                f"parallel.cp={self.cp} must divide the data-parallel ranks ({self.dp}): context-parallel ranks "
                "are taken out of the data-parallel dimension (cp ranks read the same sequences). Launch a "
                "multiple of cp ranks, or change parallel.dp / parallel.cp.")
        if self.sequence_parallel and self.tp < 2:
            raise ConfigError("parallel.sequence_parallel needs tensor parallel (tp >= 2); "
                              "pick a strategy with tp or unset it.")
        if self.pp > 1:
            set_(self, "pp_microbatches", self.pp_microbatches or 2 * self.pp)
            self._check_schedule()
        else:
            # One stage: nothing to schedule. Pipeline options of the config do not apply.
            for key, value in (("pp_schedule", "1f1b"), ("pp_stages_per_rank", 1), ("pp_microbatches", 1),
                               ("pp_first_stage_fewer", 0), ("stage_layers", ())):
                set_(self, key, value)
        if self.stage_layers:
            set_(self, "stage_layers", tuple(self.stage_layers))
            self._check_stage_layers()
        if self.n_blocks is not None:
            set_(self, "stage_ranges",
                 _ranges(self.stage_layers) if self.stage_layers
                 else tuple(stage_layer_ranges(self.n_blocks, self.n_stages, self.pp_first_stage_fewer)))

    def _check_stage_layers(self) -> None:
        """An explicit split (``stage_layers``): one count per stage, the end stages may hold no
        block (they embed / run the head), every other stage one at least, all the model's blocks."""
        sizes = self.stage_layers
        if self.pp_first_stage_fewer:
            raise ConfigError("an explicit stage split (stage_layers) and parallel.pp_first_stage_fewer "
                              "both set the stage sizes; give one.")
        if len(sizes) != self.n_stages or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                                              for n in sizes):
            raise ConfigError(f"stage_layers={list(sizes)}: give {self.n_stages} block counts >= 0, one per "
                              "pipeline stage (parallel.pp x parallel.pp_stages_per_rank).")
        if any(n < 1 for n in sizes[1:-1]):
            raise ConfigError(f"stage_layers={list(sizes)}: every stage but the first and the last needs a block.")
        if self.n_blocks is not None and sum(sizes) != self.n_blocks:
            raise ConfigError(f"stage_layers={list(sizes)} holds {sum(sizes)} blocks; the model has "
                              f"{self.n_blocks}.")

    def _check_ep(self) -> None:
        """Expert groups are carved out of the ranks ``ep_group_ranks`` names (the runtime's rule:
        the FSDP shard group, torchtitan's layout; another stack's only for the planner)."""
        ep = self.ep
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ConfigError(f"parallel.ep must be an integer >= 1, got {ep!r}.")
        if self.ep_groups not in EP_GROUPS:
            raise ConfigError(f"ep_groups={self.ep_groups!r}: allowed: {', '.join(EP_GROUPS)}.")
        if ep == 1:
            return
        # Another stack's expert groups are planned, never run: the runtime's own limits (FSDP2
        # strategies only, no zero-bubble schedule) are its, not that stack's.
        runtime_rule = self.ep_groups == "dp-shard"
        # Under hsdp the expert groups are carved out of each shard group (parallel/mesh.py).
        if runtime_rule and self.external is None and not _runs_ep(self.info):
            names = [n for n, i in REGISTRY.items() if _runs_ep(i)]
            raise ConfigError(
                f"parallel.ep={ep} (expert parallel) runs under the FSDP2 strategies {', '.join(names)}, not "
                f"{self.strategy!r}: its expert groups are carved out of the FSDP shard ranks. Use one of "
                "them, or set parallel.ep = 1.")
        if runtime_rule and self.pp > 1:  # fsdp+pp with ep: every schedule but the zero-bubble ones
            refusal = ep_refusal(self.pp_schedule)
            if refusal:
                raise ConfigError(refusal + ".")
        ranks = ep_group_ranks(self.ep_groups, shard=self.shard, dp=self.dp, tp=self.tp)
        if ranks % ep == 0:
            return
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        if not runtime_rule:
            raise ConfigError(
                f"parallel.ep={ep} must divide the ranks expert groups are carved from under ep_groups="
                f"{self.ep_groups!r}, {EP_GROUPS[self.ep_groups]} = {ranks}. Valid ep here: "
                f"{', '.join(map(str, divisors))}.")
        # Megatron spreads experts over tp (expert-tensor-parallel) or pp ranks too; not here.
        wider = [name for name, d in (("tensor-parallel ranks (Megatron's expert-tensor-parallel)", self.tp),
                                      ("pipeline ranks", self.pp)) if d > 1 and ep > self.shard]
        why = (f" Expert groups that span {' or '.join(wider)} are not implemented: ep is borrowed from "
               "dp_shard x cp only (torchtitan's layout)." if wider else "")
        raise ConfigError(
            f"parallel.ep={ep} must divide the ranks that FSDP shards over, dp_shard x cp = {self.shard} "
            f"(expert groups are made of those ranks). Valid ep here: {', '.join(map(str, divisors))}.{why}")

    @property
    def ep_stride(self) -> int:
        """Ranks between neighbours of an expert group (the mesh's order): tp under the dp-carved rules
        (dp ranks are tp apart), 1 under Megatron's folding (etp 1: ep is its innermost MoE dim)."""
        return 1 if self.ep_groups == "tp-dp" else self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks of one pipeline stage holding the same experts (Megatron's expert data parallel): the
        ranks the expert groups are carved from over ep; their expert gradients are reduced together."""
        return ep_group_ranks(self.ep_groups, shard=self.dp, dp=self.dp, tp=self.tp) // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """The ranks that FSDP-shard each expert (the dp shard ranks outside its EP group)."""
        return self.shard // self.ep

    def _checked_shard(self, info: StrategyInfo) -> int:
        """The shard-group size the strategy implies (checked against an explicit one)."""
        if info.hybrid:
            shard = self.shard or self.dp
            if shard < 1 or self.dp % shard:
                divisors = [d for d in range(1, self.dp + 1) if self.dp % d == 0]
                raise ConfigError(
                    f"strategy 'hsdp' shards within groups of parallel.hsdp_shard_size={shard} ranks, "
                    f"which must divide the world size {self.dp}. Valid shard sizes: "
                    f"{', '.join(map(str, divisors))} (0 = ranks per node).")
            return shard
        implied = self.dp if info.shards_over_dp else 1
        if self.shard not in (0, implied):
            raise ConfigError(f"strategy {self.strategy!r} shards model state across {implied} rank(s), "
                              f"not {self.shard}.")
        return implied

    def _check_schedule(self) -> None:
        # Every schedule's rules (stages per rank, micro-batch count) live in pp_schedules.
        check_schedule(self.pp_schedule, self.pp, self.pp_stages_per_rank, self.pp_microbatches)
        # Replicated stages are DDP-wrapped where there is more than one replica (parallel/composed.py).
        if self.external is None and self.info.dp_kind == "replicate" and self.dp > 1:
            refusal = ddp_refusal(self.pp_schedule)
            if refusal:
                raise ConfigError(refusal + ".")
        if self.pp_first_stage_fewer < 0:
            raise ConfigError(f"parallel.pp_first_stage_fewer must be >= 0, got {self.pp_first_stage_fewer}.")

    # ------------------------------------------------------------------ what the strategy is
    @property
    def info(self) -> StrategyInfo:
        """The registry entry of the strategy (another stack's description for external layouts)."""
        return self.external or REGISTRY[self.strategy]

    @property
    def zero1_shards(self) -> int:
        """Ranks a ZeRO-1 layout shards its optimizer state over: its group (zero1_group), else dp."""
        return self.zero1_group or self.dp

    @property
    def sharding(self) -> str:
        """How data-parallel ranks hold model state: 'replicate', 'zero1', 'zero2' or 'fsdp'."""
        return self.info.dp_kind

    @property
    def casts_with_autocast(self) -> bool:
        """Whether 16-bit mixed precision comes from ``torch.autocast`` (True: parameters stay fp32,
        each op casts its inputs, the residual stream stays fp32) or from the sharding wrapper's
        own cast (FSDP2's MixedPrecisionPolicy for zero2/fsdp kinds, DeepSpeed's engine: parameters
        gathered in 16 bits, 16-bit activations throughout). The runtime's strategies and the
        planner's byte counts both ask here."""
        return self.sharding not in ("zero2", "fsdp")

    # ------------------------------------------------------------------ degrees
    @property
    def world_size(self) -> int:
        # ``dp`` is the whole data dimension of the dense mesh, cp ranks included (torchtitan flattens
        # dp_shard x cp for FSDP the same way): dp_replicate x dp_shard x cp x tp x pp. ep is
        # borrowed from dp_shard x cp, not multiplied.
        return self.dp * self.tp * self.pp

    @property
    def world(self) -> int:
        """Alias of ``world_size`` (the planner's name)."""
        return self.world_size

    @property
    def dp_shard(self) -> int:
        """Ranks that shard model state, cp excluded (torchtitan's ``dp_shard``): FSDP2 shards over
        the ``shard = dp_shard x cp`` ranks of the dense mesh's data dim; 1 for ddp and zero1."""
        return self.shard // self.cp if self.shard > 1 else 1

    @property
    def dp_replicate(self) -> int:
        """Replicas of the model state: dp_replicate x dp_shard x cp = ``dp``."""
        return self.dp // (self.cp * self.dp_shard)

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    # ------------------------------------------------------------------ the device mesh
    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.info.mesh_dims

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Shape for ``init_device_mesh``; ranks fill it row-major (the last dim is innermost)."""
        if self.info.model_parallel:
            return self.pp, self.dp, self.tp
        if self.info.hybrid:
            # FSDP2 reads a 2-D mesh as (replicate, shard). Shard groups are consecutive ranks, i.e.
            # one node when shard = ranks per node: the heavy all-gather/reduce-scatter stays on
            # the fast intra-node links. The shard dim holds the cp ranks too (dp_shard x cp).
            return self.dp // self.shard, self.shard
        return (self.dp,)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on every mesh dim (``init_device_mesh``'s row-major layout)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside a world of {self.world_size} ranks.")
        out: dict[str, int] = {}
        rest = rank
        for name, size in reversed(list(zip(self.mesh_dim_names, self.mesh_shape))):
            out[name] = rest % size
            rest //= size
        return {name: out[name] for name in self.mesh_dim_names}

    def dp_coords(self, rank: int) -> tuple[int, int]:
        """Return (data-parallel rank, data-parallel size): which slice of each batch ``rank`` reads.

        Every TP rank and every pipeline stage of one replica reads the same slice (the first stage
        feeds its inputs, the last one its targets).
        """
        c = self.coords(rank)
        # Context-parallel ranks (consecutive in the dp dimension) share one data index.
        if self.info.model_parallel:
            return c["dp"] // self.cp, self.dp // self.cp
        return rank // self.cp, self.dp // self.cp  # pure data parallel (hsdp: replicate * shard + shard = rank)

    def cp_rank(self, rank: int) -> int:
        """Which chunk of each sequence ``rank`` holds under context parallel (0 without it)."""
        return (self.coords(rank)["dp"] if self.info.model_parallel else rank) % self.cp

    # ------------------------------------------------------------------ the pipeline
    @property
    def n_stages(self) -> int:
        return self.pp * self.pp_stages_per_rank

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The pipeline stages ``pp_rank`` runs."""
        return stage_ids_of(self.pp_schedule, pp_rank, self.pp, self.pp_stages_per_rank)

    def rank_layers(self, pp_rank: int) -> list[int]:
        """The block indices that pipeline rank ``pp_rank`` holds (needs ``n_blocks``)."""
        if self.n_blocks is None:
            raise ConfigError("the layout does not know the model's blocks yet (Layout.with_blocks).")
        return sorted(i for s in self.stage_ids(pp_rank) for i in self.stage_ranges[s])

    def holds_first_stage(self, pp_rank: int) -> bool:
        """Whether ``pp_rank`` runs the first stage (embeddings)."""
        return 0 in self.stage_ids(pp_rank)

    def holds_last_stage(self, pp_rank: int) -> bool:
        """Whether ``pp_rank`` runs the last stage (final norm, head and loss)."""
        return self.n_stages - 1 in self.stage_ids(pp_rank)

    def with_blocks(self, n_blocks: int, block_path: str = "") -> Layout:
        """Return this layout for a model with ``n_blocks`` transformer blocks at ``block_path``.

        Raises ConfigError when the blocks cannot be split into the layout's pipeline stages.
        """
        return dataclasses.replace(self, n_blocks=n_blocks, block_path=block_path)

    def check_batch(self, micro_batch_size: int) -> None:
        """Raise ConfigError unless one rank's batch splits into the pipeline's micro-batches."""
        if self.pp > 1 and micro_batch_size % self.pp_microbatches:
            raise ConfigError(
                f"the per-rank batch of {micro_batch_size} samples (train.micro_batch_size) does not "
                f"split into {self.pp_microbatches} equal pipeline microbatches "
                f"(parallel.pp_microbatches; 0 means 2 x pp = {2 * self.pp}): make "
                f"train.micro_batch_size a multiple of {self.pp_microbatches}, or set "
                "parallel.pp_microbatches to a divisor of it (at least the pipeline degree).")

    # ------------------------------------------------------------------ reporting
    def describe(self, cp_impl: str = "alltoall") -> str:
        """A few lines for people: strategy, mesh, degrees, pipeline and blocks; ``cp_impl``: the
        context-parallel attention the run resolved (``parallel.context.cp.resolve_cp_impl``)."""
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        lines = [
            f"layout: {self.strategy} on {self.world_size} rank(s) - {self.info.description}",
            f"  mesh {mesh}; dp {self.dp} (replicate {self.dp_replicate} x shard {self.dp_shard}"
            f"{f' x cp {self.cp}' if self.cp > 1 else ''}), "
            f"tp {self.tp}{' + sequence parallel' if self.sequence_parallel else ''}, pp {self.pp}"
            f"{f', cp {self.cp} ({cp_impl}: each rank holds 1/{self.cp} of every sequence)' if self.cp > 1 else ''}"
            f"{f', ep {self.ep} (groups of {self.ep} dp ranks split the experts)' if self.ep > 1 else ''}"
            f"{'; state offloaded to host memory' if self.offload else ''}",
            f"  each rank holds a part of: {self.info.shards}",
        ]
        if self.n_blocks is not None:
            where = f" at {self.block_path}" if self.block_path else ""
            lines.append(f"  blocks: {self.n_blocks}{where}")
        if self.pp > 1:
            lines.append(f"  pipeline: {self.pp_schedule}, {self.n_stages} stages ({self.pp_stages_per_rank} per "
                         f"rank), {self.pp_microbatches} microbatches per step")
            if self.stage_ranges:
                # An end stage with no layer runs only the embedding (first) or the head and loss (last).
                spans = [f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) if r else
                         ("embedding" if i == 0 else "head") for i, r in enumerate(self.stage_ranges)]
                if len(spans) > 16:  # a long pipeline: its ends and the sizes between
                    sizes = [len(r) for r in self.stage_ranges[2:-2]]
                    each = f"{min(sizes)}-{max(sizes)}" if min(sizes) < max(sizes) else str(min(sizes))
                    spans = [*spans[:2], f"... {len(sizes)} stages of {each} layer(s) ...", *spans[-2:]]
                lines.append(f"  stage layers: {' | '.join(spans)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, derived ones included (for summary.json and ``plan --json``)."""
        return {
            "strategy": self.strategy, "world_size": self.world_size, "dp": self.dp,
            "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp, "pp": self.pp,
            "ep": self.ep,
            "sequence_parallel": self.sequence_parallel, "offload": self.offload,
            "mesh_dim_names": list(self.mesh_dim_names), "mesh_shape": list(self.mesh_shape),
            "pp_schedule": self.pp_schedule, "pp_stages_per_rank": self.pp_stages_per_rank,
            "pp_microbatches": self.pp_microbatches, "pp_first_stage_fewer": self.pp_first_stage_fewer,
            "n_blocks": self.n_blocks, "block_path": self.block_path,
            "stage_ranges": [[r.start, r.stop] for r in self.stage_ranges],
        }


# --------------------------------------------------------------------------- from the config


def _resolve_strategy(options: ParallelConfig, world_size: int) -> str:
    name = canonical_strategy(options.strategy)  # raises with the list of valid names
    if name != "auto":
        return name
    if options.tp > 1 or options.pp > 1:
        return composition_for(options.tp, options.pp)
    return "ddp" if world_size > 1 else "single"


def _model_parallel_degrees(world_size: int, options: ParallelConfig, info: StrategyInfo) -> dict[str, int]:
    """{"pp", "dp", "tp"} for ``world_size`` ranks: the set degrees as given, at most one inferred."""
    active = info.degrees
    given = {"pp": options.pp if options.pp > 1 else 0, "tp": options.tp if options.tp > 1 else 0,
             "dp": options.dp}
    dims = ("pp", "dp", "tp")
    lacking = {dim: given[dim] for dim in dims if dim not in active and given[dim] > 1}
    if lacking:  # a degree the strategy does not have: Layout refuses it (the one owner of that rule)
        return {**dict.fromkeys(dims, 1), **lacking}
    degrees = {dim: given[dim] if dim in active else 1 for dim in dims}
    open_dims = [d for d in dims if degrees[d] == 0]
    known = 1
    for d in dims:
        known *= degrees[d] or 1
    if len(open_dims) > 1:
        raise ConfigError(
            f"cannot infer {' and '.join(open_dims)} degrees from {world_size} ranks: set all but one "
            f"of {', '.join(f'parallel.{d}' for d in open_dims)} (e.g. --set parallel.{open_dims[-1]}=2).")
    if open_dims:
        if world_size % known:
            raise ConfigError(
                f"{world_size} ranks do not divide by the fixed degrees "
                f"({' x '.join(f'{d}={degrees[d]}' for d in dims if degrees[d])} = {known}).")
        degrees[open_dims[0]] = world_size // known
    if degrees["pp"] * degrees["dp"] * degrees["tp"] != world_size:
        # cp ranks are data-parallel ranks: a strategy without a dp dimension ('tp', 'pp') has none.
        hint = (f" parallel.cp={options.cp} takes its ranks from the data-parallel dimension, which this "
                "strategy does not have: pick one with dp (e.g. 'fsdp+pp', 'ddp+pp', 'fsdp+tp')."
                if options.cp > 1 and "dp" not in active else "")
        raise ConfigError(
            f"dp x tp x pp must equal the world size: {degrees['dp']} x {degrees['tp']} x "
            f"{degrees['pp']} = {degrees['pp'] * degrees['dp'] * degrees['tp']}, but {world_size} ranks "
            f"were launched. Change --nproc or the parallel.dp/tp/pp degrees.{hint}"
            f"{_DP_SHARD_CHANGE if options.cp > 1 and options.dp_shard else ''}")
    # An active degree below 2 is Layout's to refuse (one owner for that rule).
    return degrees


def ranks_per_node(world_size: int, *, nproc: int = 0, local_world_size: int = 0) -> int:
    """Ranks on one node, the one rule for it: torchrun's ``LOCAL_WORLD_SIZE`` when launched by it,
    else ``parallel.nproc`` (``--nproc``), else every rank (one node). HSDP's default shard group
    and the planner's intra-node links read it."""
    return local_world_size or nproc or world_size


def data_parallel_degree(world_size: int, *, tp: int = 1, pp: int = 1) -> int:
    """The data-parallel degree (cp ranks included, as ``Layout.dp``) that ``tp`` and ``pp`` leave of
    ``world_size`` ranks: the rule world = dp x tp x pp, for callers (the planner's candidates) that
    need it before a strategy is picked. ConfigError when tp x pp does not divide the world."""
    if world_size % (tp * pp):
        raise ConfigError(f"tp {tp} x pp {pp} = {tp * pp} does not divide the {world_size} ranks: "
                          "world size = dp x tp x pp.")
    return world_size // (tp * pp)


def tp_indivisible(tp: int, sizes: Mapping[str, int | None]) -> dict[str, int]:
    """The sizes that tensor parallel of degree ``tp`` cannot split evenly (empty when all can):
    the one TP divisibility rule. The runtime passes a model's real split sizes (attention heads,
    key/value heads, matrix rows), the planner a spec's heads; each words its own message."""
    if tp <= 1:
        return {}
    return {name: size for name, size in sizes.items() if size and size % tp}


def ep_degrees(n_experts: int) -> list[int]:
    """EP degrees an MoE layer of ``n_experts`` admits: the divisors of the count (each rank of an
    expert group holds ``n_experts / ep`` whole experts). The one owner of that rule: the planner's
    ``--ep`` check and search and the runtime's ``parallel.experts.ep.check_moe_model`` ask it."""
    if n_experts <= 0:
        return [1]
    return [d for d in range(1, n_experts + 1) if n_experts % d == 0]


def ep_group_ranks(rule: str, *, shard: int, dp: int, tp: int) -> int:
    """The ranks of one pipeline stage that expert groups are carved from under ``rule`` (EP_GROUPS):
    ep must divide this count. ``shard`` is ``Layout.shard`` and ``dp`` ``Layout.dp`` (both count
    cp ranks)."""
    if rule == "dp-shard":
        return shard
    if rule == "dp":
        return dp
    if rule == "tp-dp":
        return tp * dp
    raise ConfigError(f"ep_groups={rule!r}: allowed: {', '.join(EP_GROUPS)}.")


def ep_candidates(shard: int, n_experts: int) -> list[int]:
    """EP degrees that fit: divisors of the FSDP shard group (``Layout.shard`` = dp_shard x cp, the
    ranks ep is borrowed from) that also divide the expert count."""
    return [d for d in ep_degrees(n_experts) if shard % d == 0]


def _from_degrees(options: ParallelConfig) -> ParallelConfig:
    """``options`` with ``parallel.dp_replicate`` / ``parallel.dp_shard`` turned into the strategy
    and the dp sizes they stand for (unchanged when neither is given)."""
    r, s = options.dp_replicate, options.dp_shard
    if not (r or s):
        return options
    if options.dp:
        raise ConfigError(
            f"parallel.dp={options.dp} and parallel.dp_replicate/dp_shard ({r}/{s}) are both set: give "
            "the data-parallel degree one way (dp_replicate x dp_shard, or dp for the tp/pp compositions).")
    name = canonical_strategy(options.strategy)
    if name == "auto":
        # FSDP shards over dp_shard x cp (torchtitan): dp_shard=1 cp=2 on 2 ranks is fsdp, not ddp.
        name = strategy_for_degrees(r or 1, (s or 1) * options.cp, options.tp, options.pp)
    changes: dict[str, Any] = {"strategy": name}
    info = REGISTRY[name]
    # dp_shard excludes cp (torchtitan's arithmetic): the mesh's data dim is replicate x shard x cp.
    if info.model_parallel:
        changes["dp"] = (r or 1) * (s or 1) * options.cp
    if info.hybrid and s:
        group = s * options.cp  # hsdp_shard_size counts ranks, cp ranks included
        if options.hsdp_shard_size not in (0, group):
            raise ConfigError(f"parallel.hsdp_shard_size={options.hsdp_shard_size} and parallel.dp_shard={s} "
                              f"x cp={options.cp} = {group} disagree: both size hsdp's shard groups; set one.")
        changes["hsdp_shard_size"] = group
    return dataclasses.replace(options, **changes)


# Said wherever a config's dp_shard and cp do not fit: the meaning changed once, and a config.toml
# written before (shardwise.core.config_version) may still use the old one.
_DP_SHARD_CHANGE = (
    " Note: parallel.dp_shard excludes cp (torchtitan's meaning: dp_replicate x dp_shard x cp x tp x pp = "
    "world size). A config.toml written before config_version 2 counted cp inside dp_shard: divide its "
    "dp_shard by cp.")


def _check_given_degrees(layout: Layout, options: ParallelConfig) -> None:
    """The layout must have exactly the dp_replicate / dp_shard the config gave."""
    for key in ("dp_replicate", "dp_shard"):
        given = getattr(options, key)
        if given and getattr(layout, key) != given:
            raise ConfigError(
                f"parallel.{key}={given}, but strategy {layout.strategy!r} on {layout.world_size} rank(s) has "
                f"dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard} x cp={layout.cp} x "
                f"tp={layout.tp} x pp={layout.pp}. The degrees must multiply to the world size, and a "
                f"strategy name stands for one split ({layout.strategy!r}: {layout.info.description}); "
                "leave parallel.strategy at 'auto' to let the degrees pick it, or change them."
                f"{_DP_SHARD_CHANGE if layout.cp > 1 and options.dp_shard else ''}")


def resolve_layout(options: ParallelConfig, world_size: int, *, ranks_per_node: int | None = None,
                   n_blocks: int | None = None, block_path: str = "", ep_groups: str = "dp-shard",
                   experts_tp: bool = False, zero1_group: int = 0) -> Layout:
    """Return the layout of ``options`` on ``world_size`` ranks; ConfigError names what cannot work.

    ``ranks_per_node``: the default HSDP shard group (``parallel.hsdp_shard_size = 0``); the
    world size when None. ``n_blocks``: the model's transformer blocks, when known (pipeline
    stage ranges are computed and checked). ``ep_groups``: another stack's expert-group rule
    (EP_GROUPS), for the planner only; the runtime always resolves with its own. ``experts_tp``:
    the routed experts tensor-parallel over tp (``Layout.experts_tp``), for the planner only.
    ``zero1_group``: another stack's ZeRO-1 shard group (``Layout.zero1_group``), for the planner only.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"the world size must be at least 1 rank, got {world_size!r}.")
    given = options
    options = _from_degrees(options)
    name = _resolve_strategy(options, world_size)
    info = REGISTRY[name]
    if info.max_world is not None and world_size > info.max_world:
        raise ConfigError(
            f"strategy {name!r} runs one process, but {world_size} were launched. "
            "Use --nproc 1, or a parallel strategy such as 'ddp'.")
    shard = 0
    if info.model_parallel:
        degrees = _model_parallel_degrees(world_size, options, info)
        dp, tp, pp = degrees["dp"], degrees["tp"], degrees["pp"]
    else:
        if options.tp > 1 or options.pp > 1:
            raise ConfigError(
                f"strategy {name!r} is pure data parallel, but parallel.tp={options.tp} and "
                f"parallel.pp={options.pp}; use a composed strategy (e.g. 'fsdp+tp') or set them to 1.")
        if options.dp not in (0, world_size):
            raise ConfigError(
                f"parallel.dp={options.dp}, but strategy {name!r} uses all {world_size} ranks for data "
                "parallel; leave parallel.dp at 0 (it sizes the dp dimension of the tp/pp compositions).")
        dp, tp, pp = world_size, 1, 1
        if info.hybrid:
            shard = options.hsdp_shard_size or ranks_per_node or world_size
            if shard > world_size:  # Layout's own check words the divisibility case
                raise ConfigError(
                    f"strategy 'hsdp' shards within groups of parallel.hsdp_shard_size={shard} ranks, which "
                    f"must divide the world size {world_size} (0 = ranks per node).")
    if pp > 1 and options.precision == "fp16-mixed":
        raise ConfigError(
            "precision 'fp16-mixed' is not supported with pipeline parallel: the schedule runs "
            "backward itself, so the fp16 loss scaler cannot scale the loss. Use 'bf16-mixed'.")
    if pp > 1 and (refusal := checkpoint_refusal(options.pp_schedule, options.activation_checkpointing)):
        raise ConfigError(refusal + ".")
    layout = Layout(
        name, dp=dp, tp=tp, pp=pp, shard=shard, cp=options.cp, ep=options.ep, pp_schedule=options.pp_schedule,
        pp_stages_per_rank=options.pp_stages_per_rank, pp_microbatches=options.pp_microbatches,
        pp_first_stage_fewer=options.pp_first_stage_fewer, sequence_parallel=options.sequence_parallel,
        n_blocks=n_blocks, block_path=block_path, ep_groups=ep_groups, experts_tp=experts_tp,
        zero1_group=zero1_group,
    )
    _check_given_degrees(layout, given)
    return layout
