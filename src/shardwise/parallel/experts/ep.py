"""Expert parallelism (``parallel.ep``) for mixture-of-experts models, composed torchtitan's way.

EP ranks are borrowed from the data-parallel shard ranks (dp_shard x cp): the mesh owner's
``sparse`` view (``parallel/mesh.py``) lays them out as an ``(efsdp, ep)`` grid with ``ep``
innermost (consecutive ranks, the fastest link, carry the token all-to-alls). Inside one EP group
each rank holds ``n_experts / ep`` experts of every MoE layer (a ``Shard(0)`` DTensor on the ``ep``
mesh dim, so checkpoints keep the global expert tensors and DCP reshards them to any other EP
degree); FSDP2 then shards those experts over the ``efsdp`` ranks that hold the same experts.
Dense parameters are sharded as before. Under hsdp the EP groups are carved out of each
shard group and the experts, like the dense
parameters, are replicated across the ``dp_replicate`` groups (a 2-D HSDP mesh for the experts).

Dispatch (per MoE layer, forward): every rank sorts its tokens by expert (``models/moe.py``), the
per-expert counts are exchanged (one ``all_to_all_single`` of E integers), then the tokens travel
to the rank owning their expert with ``all_to_all_single_autograd`` (torch's autograd-aware
functional collective: its backward is the reverse all-to-all), are regrouped expert-major, run
through the local experts, regrouped back and returned by a second all-to-all. Both happen in
forward hooks on the experts module (``distribute_module``'s input/output functions, as torchtitan's
``ExpertParallel``), so the model code is unchanged.

Gradients: an expert's gradient is the sum over the tokens of its whole EP group (the all-to-all's
backward brings each rank's share home), then FSDP reduce-scatters over the ``efsdp`` ranks.
(hsdp: and all-reduces over the ``dp_replicate`` groups). FSDP would divide by those ``dp / ep``
ranks; dividing by the full ``dp`` instead (``set_gradient_divide_factor``) gives (1/dp) sum over
every rank's loss, the same mean as the dense parameters.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from shardwise.core.layout import Layout, ep_candidates, ep_degrees
from shardwise.errors import ConfigError
from shardwise.models.moe import expert_counts, moe_layers

__all__ = ["ExpertDispatcher", "apply_ep", "check_moe_model", "route_moe", "shard_experts"]


def _moe_layers(model: nn.Module) -> list[tuple[str, Any]]:
    return moe_layers(model)


def check_moe_model(model: nn.Module, layout: Layout, activation_checkpointing: str = "none") -> None:
    """Raise ConfigError when ``model``'s mixture-of-experts layers do not fit ``layout``.

    The one owner of the MoE/EP rules that need only the model's shape (a meta model works):
    preflight calls it before any rank starts, ``parallelize`` on every rank (for models that cannot
    be built on meta). The degree rules that need no model (ep divides the dp shard ranks, FSDP
    kinds only) are the layout's (``Layout._check_ep``).
    """
    layers = _moe_layers(model)
    if not layers:
        if activation_checkpointing == "moe":
            raise ConfigError(
                f"parallel.activation_checkpointing = 'moe' recomputes the mixture-of-experts layers, but "
                f"{type(model).__name__} has no MoE layer. For a dense model use 'full', 'selective' or "
                "'selective-op' (or 'none').")
        if layout.ep > 1:
            raise ConfigError(
                f"parallel.ep={layout.ep} (expert parallel) needs a mixture-of-experts model, but "
                f"{type(model).__name__} has no MoE layer. Use an MoE model (e.g. model.preset = "
                "'moe-nano', or model.overrides.n_experts) or set parallel.ep = 1.")
        return
    # The rule's owner is torch-free (core/layout.py): the planner's search asks the same functions.
    if layout.ep > 1:
        counts = {name: int(layer.n_experts) for name, layer in layers}
        bad = next(((name, n) for name, n in counts.items() if layout.ep not in ep_degrees(n)), None)
        if bad is not None:
            valid = sorted(set.intersection(*(set(ep_candidates(layout.shard, n)) for n in counts.values())))
            raise ConfigError(
                f"parallel.ep={layout.ep} does not divide the number of experts of MoE layer {bad[0]!r} "
                f"({bad[1]}): each rank of an expert group holds n_experts / ep whole experts. Valid ep "
                f"for this model on {layout.shard} data-parallel shard rank(s): {', '.join(map(str, valid))} "
                "(1: no expert parallel).")


def route_moe(model: nn.Module, layout: Layout, meshes: Any) -> None:
    """The expert-parallel step of the one order (``parallel/parallelize.py``), in place.

    Points every MoE layer's load-balancing statistics at the data-parallel group: the routers'
    token counts are summed over all ranks that hold different tokens of the global batch (the dp
    ranks; TP ranks share theirs), so the aux loss is the one-process loss over the global batch
    (see models/moe.py). With ``layout.ep > 1`` it then splits the experts (``apply_ep``); the data
    parallel step shards them over the expert-FSDP view (``shard_experts``).
    """
    layers = _moe_layers(model)
    if not layers:
        return
    group = None
    if layout.dp > 1 and meshes is not None:
        dense = meshes.dense
        names = dense.mesh_dim_names or ()
        group = dense["dp"].get_group() if "dp" in names and len(names) > 1 else dist.group.WORLD
    for _, layer in layers:
        layer.stats_group = group
    if layout.ep > 1:
        apply_ep(model, layout, meshes.ep)


class ExpertDispatcher:
    """Token dispatch and combine around one experts module (its forward pre-hook and hook)."""

    def __init__(self, n_experts: int, ep: int, group: Any) -> None:
        self.n_experts, self.ep, self.group = n_experts, ep, group
        self.local = n_experts // ep
        self._state: list[tuple[torch.Tensor, list[int], list[int]]] = []
        self.local_sizes: list[int] = []  # the last dispatch's tokens per local expert

    def _splits(self, tokens: torch.Tensor, counts: torch.Tensor) -> tuple[list[int], list[list[int]], torch.Tensor]:
        """(tokens I send to each rank, grid[s][e]: tokens rank s sends to my local expert e, those
        counts per local expert as a tensor)."""
        ep, local = self.ep, self.local
        if is_fake(counts):
            # A rehearsal's fake tensors carry no routing: every rank routes its tokens evenly over
            # the experts (the planner's assumption too), so sizes come from the shapes alone.
            n = tokens.shape[0]
            even = [n // self.n_experts + (e < n % self.n_experts) for e in range(self.n_experts)]
            me = dist.get_rank(self.group)
            grid = [even[me * local:(me + 1) * local] for _ in range(ep)]
            send = [sum(even[r * local:(r + 1) * local]) for r in range(ep)]
            return send, grid, torch.tensor([sum(c) for c in zip(*grid)], device=counts.device)
        # recv[s, e]: how many tokens rank s of the group sends to my local expert e.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        return counts.view(ep, local).sum(1).tolist(), recv.view(ep, local).tolist(), recv.view(ep, local).sum(0)

    def dispatch(self, module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        tokens, counts = inputs
        ep, local = self.ep, self.local
        send_splits, grid, local_counts = self._splits(tokens, counts)
        recv_splits = [sum(row) for row in grid]
        self.local_sizes = [sum(grid[s][e] for s in range(ep)) for e in range(local)]
        got = all_to_all_single_autograd(tokens, recv_splits, send_splits, self.group)
        # Arrived source-major (rank s: its tokens for my experts 0..L-1); the experts want them
        # expert-major. ``perm`` lists the arrived rows in expert-major order.
        offsets, start = [], 0
        for row in grid:
            offsets.append([])
            for n in row:
                offsets[-1].append(start)
                start += n
        perm = [i for e in range(local) for s in range(ep) for i in range(offsets[s][e], offsets[s][e] + grid[s][e])]
        perm_t = torch.tensor(perm, dtype=torch.long, device=tokens.device)
        # A checkpointed recomputation runs forward again: a stack keeps dispatch/combine paired.
        self._state.append((perm_t, send_splits, recv_splits))
        return got[perm_t], local_counts

    def combine(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        perm, send_splits, recv_splits = self._state.pop()
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return all_to_all_single_autograd(output[back], send_splits, recv_splits, self.group)


def apply_ep(model: nn.Module, layout: Layout, ep_mesh: Any) -> None:
    """Split every MoE layer's experts over the ``ep_mesh`` ranks (a ``Shard(0)`` DTensor) and install
    the token dispatch around them; ``shard_experts`` then FSDP-shards them over the rest."""
    group = ep_mesh.get_group()
    for _, layer in _moe_layers(model):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            dt = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        dispatcher = ExpertDispatcher(layer.n_experts, layout.ep, group)
        if isinstance(layer, nn.Module):
            experts.register_forward_pre_hook(dispatcher.dispatch)
            experts.register_forward_hook(dispatcher.combine)
        else:
            _hf_expert_parallel(experts, layer.top_k, dispatcher)
        experts.ep_dispatcher = dispatcher


def expert_shard_placement(param: torch.Tensor, *, shard_ranks: int) -> Shard | None:
    """Where FSDP2 shards one expert tensor over its ``shard_ranks``: its rows (experts, FSDP's default,
    None) when this rank's experts split evenly over them, else dim 1 (torchtitan does the same).

    Expert parallel leaves n_experts / ep experts on a rank, often fewer than the ranks that shard
    them (Mixtral's 8 experts at ep 8 over 16 data-parallel ranks: 1 expert over 2). Split by rows,
    FSDP pads the one row to two: the first rank holds the whole expert with its optimizer state,
    the second none, and every gather moves (and holds) two experts' bytes. A rehearsed Mixtral
    rank (fsdp+tp+pp tp 2, pp 2, ep 8, 64 ranks, 2026-11-28) held 11,394 MiB of gathered parameters
    at its peak where one expert a layer is 6,018, and 10,848 MiB of parameter shards where an even
    split (this rule's) is 5,472.
    """
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.ndim >= 2 and local.shape[0] % shard_ranks:
        return Shard(1)
    return None


def shard_experts(model: nn.Module, expert_mesh: Any, dp: int, fsdp_kwargs: dict[str, Any]) -> None:
    """FSDP2-shard every expert-parallel experts module of ``model`` over ``expert_mesh`` (its own
    units, before the dense ones, which then skip them); ``dp``: the data-parallel ranks whose mean
    the gradients are; ``fsdp_kwargs``: the dense units' mixed-precision and offload policies."""
    for _, layer in _moe_layers(model):
        experts = layer.experts
        if getattr(experts, "ep_dispatcher", None) is None:
            continue
        fully_shard(experts, **{**fsdp_kwargs, "mesh": expert_mesh},
                    shard_placement_fn=functools.partial(expert_shard_placement, shard_ranks=expert_mesh.size(
                        expert_mesh.ndim - 1)))
        # Each expert's gradient already sums its EP group's tokens: average over all dp ranks.
        # FSDP2 divides by its own group (the expert mesh's ranks); the hook, which runs on the
        # reduced gradient, divides by the rest (dp / that = ep). Not set_gradient_divide_factor:
        # torch 2.13 divides twice with it on a one-rank shard group whenever the reduce dtype is
        # neither float32 nor bfloat16 (a float64 or float16 model: its pre/post factor and the
        # one-rank copy's division both apply), and a custom divisor is a PREMUL_SUM that gloo lacks.
        rest = float(dp) / expert_mesh.size()
        experts.set_all_reduce_hook(lambda grad, d=rest: grad.div_(d))


def _hf_expert_parallel(experts: nn.Module, top_k: int, dispatcher: ExpertDispatcher) -> None:
    """Expert parallel for transformers' fused experts module (``models/hf_moe.py``).

    transformers' own forward picks ``gate_up_proj[e]`` for global expert ids, which a ``Shard(0)``
    DTensor cannot serve, so the module's forward is replaced (on this instance, from outside) by
    the same computation in dispatch order: tokens sorted by expert, sent to the rank holding their
    expert (``ExpertDispatcher``), run through the local experts with transformers' formula
    ``down_e(act(gate_e x) * up_e x)`` (gate and up concatenated in ``gate_up_proj[e]``), returned,
    weighted by the router's top-k weights and summed per token, as transformers does.
    """
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        flat = top_k_index.reshape(-1)
        counts = expert_counts(flat, dispatcher.n_experts)
        order = flat.argsort(stable=True)
        token = order // top_k
        got, _ = dispatcher.dispatch(experts, (hidden_states[token], counts))
        # One unbind, not an index per expert: ``w[e]``'s backward (select_backward) makes a zero
        # gradient of the whole 3-D weight for each expert and autograd sums them, three whole
        # copies alive at once (a played Mixtral ep 2 rank: 2.6 GiB in its experts' backward) and
        # a memset and an add of the whole weight per expert; unbind's backward stacks the
        # experts' own gradients once.
        down = _local(experts.down_proj)
        gate_ups, downs = _local(experts.gate_up_proj).unbind(0), down.unbind(0)
        outs = []
        for e, chunk in enumerate(got.split(dispatcher.local_sizes)):  # known on the host: no sync
            if chunk.shape[0]:
                gate, up = F.linear(chunk, gate_ups[e]).chunk(2, dim=-1)
                outs.append(F.linear(experts.act_fn(gate) * up, downs[e]))
        out = torch.cat(outs) if outs else got.new_zeros(0, down.shape[1])
        routed = dispatcher.combine(experts, None, out)
        scale = top_k_weights.reshape(-1)[order].to(routed.dtype).unsqueeze(-1)
        return torch.zeros_like(hidden_states).index_add_(0, token, (routed * scale).to(hidden_states.dtype))

    experts.forward = forward


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t
