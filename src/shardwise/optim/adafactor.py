"""Adafactor that runs on sharded parameters: torch's rule, op for op, on DTensor shards.

``torch.optim.Adafactor`` (torch 2.13) cannot step a DTensor parameter: it squares the row and
column norms in place (``torch.norm(grad, dim=-1).square_()``), and a norm over a sharded dim is an
unreduced ``_NormPartial`` DTensor that an in-place op may not redistribute. Its statistics are
nonetheless small reductions of the whole matrix, which DTensor computes exactly where the matrix is
sharded: the row norms of a row-sharded matrix are local, the column norms are summed over the shard
group (one all-reduce of a row of C numbers), the parameter's and the update's RMS are one scalar
all-reduce each. So this optimizer is torch's ``_single_tensor_adafactor`` written with out-of-place
ops where torch squares in place, every scalar read through ``full_tensor()``. On plain tensors
(one process, ddp, zero1) the ops are torch's in torch's order: the same bits as
``torch.optim.Adafactor`` (tests/test_optim.py). On shards the reductions add the same numbers in
another order: float rounding only.

The state keeps torch's names and shapes (``step``, ``row_var`` (..., R, 1), ``col_var``
(..., 1, C), ``variance`` for vectors), so checkpoints hold it by parameter name as for any torch
optimizer. Under sharding the factors are DTensors placed as the reductions leave them (a
row-sharded matrix's ``row_var`` sharded with its rows, its ``col_var`` replicated): their bytes per
rank are what ``plan.memory`` counts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.optim.optimizer import _get_scalar_dtype

from shardwise.optim.muon import _is_dtensor  # one DTensor test for both sharding-aware optimizers


def _item(t: torch.Tensor) -> float:
    """A 0-d tensor's value; a DTensor's (Partial or replicated) reduced first. A rehearsal's fake
    tensors have no value: any number plays the same step (shapes, bytes, collectives)."""
    t = t.full_tensor() if _is_dtensor(t) else t
    return 1.0 if is_fake(t) else t.item()


class Adafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` (same arguments, defaults and state) that also steps DTensor shards
    (FSDP2, zero2, tensor and expert parallel); ``foreach`` is ignored: one tensor at a time, as
    torch's single-tensor path."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("maximize") is None:
                group["maximize"] = False
            for p in group["params"]:
                if p.grad is None:
                    continue
                if torch.is_complex(p):
                    raise RuntimeError("Adafactor does not support complex parameters")
                if p.grad.is_sparse:
                    raise RuntimeError("Adafactor does not support sparse gradients")
                self._step_one(p, group)
        return loss

    def _step_one(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        # torch.optim._adafactor._single_tensor_adafactor, line for line; only the marked lines differ.
        grad = param.grad if not group["maximize"] else -param.grad
        state = self.state[param]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        lr = group["lr"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        (eps1, eps2), d = group["eps"], group["d"]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        step_t = state["step"]
        step_t += 1
        step_float = step_t.item()
        one_minus_beta2_t = step_float ** group["beta2_decay"]
        rho_t = min(lr, 1 / (step_float ** 0.5))
        alpha = max(eps2, _item(param.norm(2)) / (param.numel() ** 0.5)) * rho_t  # differs: reduced norm
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        if grad.dim() > 1:
            # differs: square() and div() out of place (a sharded dim's norm is an unreduced DTensor).
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square().div(grad.size(-1))
            col_mean = torch.norm(grad, dim=-2, keepdim=True).square().div(grad.size(-2))
            if "row_var" not in state:  # differs: placed as the statistics are (zeros, as torch's)
                state["row_var"] = torch.zeros_like(row_mean)
                state["col_var"] = torch.zeros_like(col_mean)
            row_var, col_var = state["row_var"], state["col_var"]
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            # differs: clamp out of place (the mean over sharded rows is unreduced).
            var_estimate = var_estimate.div(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))
        else:
            if "variance" not in state:
                state["variance"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            variance = state["variance"]
            grad_squared = grad * grad
            variance.lerp_(grad_squared, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = max(1.0, _item(update.norm(2)) / ((update.numel() ** 0.5) * d))  # differs: reduced norm
        param.add_(update, alpha=-alpha / denom)
