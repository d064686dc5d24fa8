"""This rank's checkpoint save plan: what DCP would write for it, from metadata only.

The state is the runtime's own (``runtime.checkpoint.state``: the model's and the optimizer's
name-keyed state through ``torch.distributed.checkpoint.state_dict``), and the plan is DCP's
``DefaultSavePlanner.create_local_plan``: one write item per tensor chunk this rank holds. Nothing
is written. The global step (the coordinator merging every rank's plan) needs the other ranks'
plans, which the fake process group cannot gather, so only this rank's part is rehearsed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from shardwise.runtime.checkpoint.state import model_state, optimizer_state


def local_save_plan(model: nn.Module, optimizer: torch.optim.Optimizer, *, rank: int,
                    trainable_only: bool = False) -> dict[str, Any]:
    """Write items and bytes of this rank's part of a checkpoint (model and optimizer)."""
    state = {"model": model_state(model, trainable_only), "optim": optimizer_state(model, optimizer, trainable_only)}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=rank == 0)
    plan = planner.create_local_plan()
    tensor_bytes, tensors, other = 0, 0, 0
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            other += 1
            continue
        tensors += 1
        elem = torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
        tensor_bytes += int(torch.Size(item.tensor_data.chunk.sizes).numel()) * elem
    return {"write_items": len(plan.items), "tensor_items": tensors, "other_items": other,
            "tensor_bytes": tensor_bytes}
