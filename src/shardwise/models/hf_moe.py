"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) as transformers 5 builds them.

transformers >= 5 stores every MoE block as ``<layer>.mlp`` with a top-k router ``mlp.gate`` (its
forward returns ``(router_logits, top_k_weights, top_k_index)``) and the experts fused into two 3-D
tensors ``mlp.experts.gate_up_proj (E, 2I, D)`` and ``mlp.experts.down_proj (E, D, I)``. This
module adds, from outside and without touching the HF code:

* **Load balancing over the global batch.** transformers adds ``router_aux_loss_coef *
  load_balancing_loss_func(router_logits)`` to the loss when ``config.output_router_logits`` is
  true (off in most released configs, as in transformers' own training). Its loss is over ALL
  layers' routing at once (the logits of every layer concatenated, L layers, N tokens, k experts
  per token)::

      aux = E * sum_e (C_e / (N L)) * (S_e / (N L))

  with C_e the top-k slots expert e received over all layers and S_e the sum of its router
  probabilities over all layers and tokens. A forward hook on each router records its logits and
  top-k indices; a forward hook on the HF model then forms C from the counts **summed over the
  data-parallel group** (one all-reduce of L x E integers, no gradient) and uses this rank's own
  S scaled by R / N (R data-parallel ranks, N the real tokens of the global batch, also summed in
  that all-reduce), so the ranks' mean aux loss equals one process's loss over the global batch
  whatever each rank's token count (the argument of ``models/moe.py``). Padding is left out, as
  transformers does when its loss gets the ``attention_mask``: a forward pre-hook on the wrapping
  ``HFCausalLM`` reads the batch's real tokens (``doc_ids >= 0`` of packed rows, a record's 2-D
  ``attention_mask``: ``models.masking.real_token_mask``), and N, C and S count those only. That
  aux loss, times ``router_aux_loss_coef``, joins the training loss through
  ``models.moe.with_aux_loss`` exactly when transformers would add it (``output_router_logits``
  true; set it with ``model.overrides.output_router_logits = true``); with records it keeps scale 1
  beside the token-sum cross-entropy (``models/moe.py``).
* **Metrics.** Each MoE block gets an ``HFMoELayer`` record with the window statistics
  ``models.moe.take_moe_stats`` reads (tokens per expert per layer, the aux loss per micro-batch).
* **Pretrained folders in the original per-expert layout.** ``save_pretrained`` (and the released
  checkpoints) write ``experts.<e>.{gate,up,down}_proj.weight`` (Mixtral: ``block_sparse_moe.
  experts.<e>.{w1,w3,w2}.weight``); ``expert_sources`` maps each fused tensor to those keys and
  ``load_fused_experts`` builds each rank's shard of the fused tensors from them, reading only the
  experts that rank holds. Folders with the fused names load directly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardwise.models.masking import real_token_mask, split_inputs
from shardwise.models.moe import _in_backward, queue_aux_loss

__all__ = ["HFMoELayer", "attach_hf_moe", "expert_sources", "is_fused_experts", "legacy_key", "load_fused_experts",
           "watch_real_tokens"]


def is_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts module (3-D ``gate_up_proj`` and ``down_proj`` parameters)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3


def _moe_blocks(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, m in hf.named_modules():
        experts, gate = getattr(m, "experts", None), getattr(m, "gate", None)
        if isinstance(experts, nn.Module) and is_fused_experts(experts) and hasattr(gate, "top_k"):
            out.append((name, m))
    return out


class HFMoELayer:
    """One HF MoE block, as ``models.moe`` sees MoE layers (statistics window, ``stats_group``).

    A plain object kept on the block (never a module: nothing is added to the state dict).
    """

    def __init__(self, block: nn.Module, recorder: _Recorder) -> None:
        self.experts = block.experts
        self.n_experts = int(block.gate.num_experts)
        self.top_k = int(block.gate.top_k)
        self.recorder = recorder
        self.reset_stats()

    # Set by parallel.experts.ep.route_moe. One group for every block of a model, kept by the recorder:
    # pipeline stages read it there (parallel/pipeline/hf_moe.py), whichever blocks they hold.
    @property
    def stats_group(self) -> Any:
        return self.recorder.stats_group

    @stats_group.setter
    def stats_group(self, group: Any) -> None:
        self.recorder.stats_group = group

    def reset_stats(self) -> None:
        self.window_counts: torch.Tensor | None = None
        self.window_aux: torch.Tensor | float = 0.0
        self.window_z: torch.Tensor | float = 0.0
        self.window_calls = 0

    def on_router(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()) or _in_backward():
            return
        logits, _, index = output
        self.recorder.seen.append((self, logits, index))


def all_layers_aux(config: Any, n_experts: int, counts: torch.Tensor, prob_sum: torch.Tensor,
                   global_rows: torch.Tensor, n_layers: int, ranks: int) -> torch.Tensor:
    """transformers' load-balancing loss over all layers (module docstring), from this rank's sums:
    ``counts`` the top-k slots per expert over all layers and the global batch (all-reduced),
    ``prob_sum`` this rank's router-probability sums over all layers, ``global_rows`` N, ``ranks`` R.
    Times ``router_aux_loss_coef``. The pipeline's last stage forms it too (``parallel/pipeline/hf_moe.py``)."""
    f = counts.double() / (global_rows * n_layers)
    # This rank's probability sums times R / (N L): their mean over the R ranks is one process's S / (N L).
    weight = (ranks / (global_rows * n_layers)).to(prob_sum.dtype)
    aux = n_experts * (f.to(prob_sum.dtype) * prob_sum * weight).sum()
    return float(getattr(config, "router_aux_loss_coef", 0.0)) * aux


class _Recorder:
    """Collects the routers' outputs of one forward; the model's forward hook turns them into the aux loss."""

    def __init__(self, config: Any, n_layers: int, n_experts: int) -> None:
        self.config = config
        self.n_layers, self.n_experts = n_layers, n_experts  # of the whole model (pipeline stages hold a share)
        self.stats_group: Any = None
        self.pp_aux: Any = None  # under a pipeline: parallel/pipeline.moe.attach_pp_aux (pipeline/hf_moe.py uses it)
        self.seen: list[tuple[HFMoELayer, torch.Tensor, torch.Tensor]] = []
        self.real: torch.Tensor | None = None  # the forward's real-token mask (None: every token)

    def on_inputs(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook on the wrapping ``HFCausalLM``: which tokens of this batch are real."""
        self.real = real_token_mask(split_inputs(args[0])[1]) if args else None

    def finish(self, module: nn.Module, inputs: Any, output: Any) -> None:
        seen, self.seen = self.seen, []
        if not seen:
            return
        layers = [layer for layer, _, _ in seen]
        n_experts = layers[0].n_experts
        rows = seen[0][1].shape[0]
        keep = None if self.real is None else self.real.reshape(-1).to(seen[0][1].device)
        if keep is not None and keep.numel() != rows:
            raise ValueError(f"the MoE routers saw {rows} tokens but the batch's real-token mask has {keep.numel()}")
        # Top-k slots per expert of the real tokens (index (N, k); no boolean indexing: no host sync;
        # index_add_, not bincount, whose output shape depends on the values: a rehearsal's fake
        # tensors have none).
        k = seen[0][2].shape[-1]
        if keep is None:
            slots = torch.ones(rows * k, dtype=torch.long, device=seen[0][2].device)
            real = torch.tensor([rows], dtype=torch.long, device=seen[0][2].device)
        else:
            slots = keep.long().unsqueeze(-1).expand(-1, k).reshape(-1)
            real = keep.long().sum().reshape(1)
        counts = torch.stack([torch.zeros(n_experts, dtype=torch.long, device=idx.device).index_add_(
            0, idx.reshape(-1), slots) for _, _, idx in seen])
        # One all-reduce: every layer's counts and the real-token count (the global N).
        packed = torch.cat([counts.reshape(-1), real])
        group = layers[0].stats_group
        ranks = 1
        if group is not None:
            dist.all_reduce(packed, group=group)
            ranks = dist.get_world_size(group)
        n_layers = len(seen)
        global_counts = packed[:-1].view(n_layers, n_experts)
        global_rows = packed[-1].double().clamp(min=1)

        def probs(logits: torch.Tensor) -> torch.Tensor:
            p = logits.float().softmax(dim=-1)
            return p if keep is None else p * keep.to(p.dtype).unsqueeze(-1)

        prob_sum = sum(probs(logits).sum(dim=0) for _, logits, _ in seen)
        aux = all_layers_aux(self.config, n_experts, global_counts.sum(0), prob_sum, global_rows, n_layers, ranks)
        if getattr(self.config, "output_router_logits", False):
            queue_aux_loss(aux)
        for i, layer in enumerate(layers):
            c = global_counts[i]
            layer.window_counts = c if layer.window_counts is None else layer.window_counts + c
        # The aux loss is one number per forward (all layers at once): kept on the first layer.
        layers[0].window_aux = layers[0].window_aux + aux.detach()
        layers[0].window_calls += 1


def attach_hf_moe(hf: nn.Module) -> list[HFMoELayer]:
    """Hook the routers of every MoE block of ``hf`` (a transformers model); [] for a dense model."""
    blocks = _moe_blocks(hf)
    if not blocks:
        return []
    recorder = _Recorder(hf.config, len(blocks), int(blocks[0][1].gate.num_experts))
    layers = []
    for _, block in blocks:
        layer = HFMoELayer(block, recorder)
        block.gate.register_forward_hook(layer.on_router)
        block.shardwise_moe = layer  # found by models.moe.moe_layers
        layers.append(layer)
    hf.register_forward_hook(recorder.finish)
    # Pipeline stages find it here, after the cut (parallel/pipeline/hf_moe.py); a plain attribute.
    hf.shardwise_moe_recorder = recorder
    return layers


def watch_real_tokens(wrapper: nn.Module, layers: list[HFMoELayer]) -> None:
    """Let the routers' aux loss skip padding: ``wrapper`` (the ``HFCausalLM``) tells the recorder
    which tokens of each batch are real (a forward pre-hook; its input is the batch's mapping)."""
    if layers:
        wrapper.register_forward_pre_hook(layers[0].recorder.on_inputs)


# ---------------------------------------------------------------------------------------------
# Per-expert pretrained layouts.

# (gate, up, down) names of one expert in the original checkpoints.
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def legacy_key(name: str) -> str | None:
    """Mixtral's original name of a tensor transformers 5 keeps under ``.mlp.`` (``block_sparse_moe``)."""
    return name.replace(".mlp.", ".block_sparse_moe.") if ".mlp." in name else None


def expert_sources(name: str, shape: tuple[int, ...], tensors: dict[str, Any]) -> list[list[str]] | None:
    """Per expert, the file keys a fused expert tensor ``name`` is made of; None when the files lack them.

    ``gate_up_proj`` (E, 2I, D): expert e is ``[gate_e; up_e]`` stacked on dim 0; ``down_proj``
    (E, D, I): expert e is ``down_e``.
    """
    prefix, _, last = name.rpartition(".")
    if last not in ("gate_up_proj", "down_proj"):
        return None
    prefixes = [prefix] + ([legacy_key(prefix + ".")[:-1]] if legacy_key(prefix + ".") else [])
    for base in prefixes:
        for gate, up, down in _EXPERT_NAMES:
            parts = (gate, up) if last == "gate_up_proj" else (down,)
            keys = [[f"{base}.{e}.{p}.weight" for p in parts] for e in range(shape[0])]
            if all(k in tensors for ks in keys for k in ks):
                return keys
    return None


def load_fused_experts(param: torch.Tensor, sources: list[list[str]], folder: Any) -> None:
    """Fill ``param`` (plain or a sharded DTensor) from per-expert keys, reading only its own experts."""
    local = param.to_local() if hasattr(param, "to_local") else param
    if hasattr(param, "device_mesh"):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        shape, offset = tuple(param.shape), (0,) * param.dim()
    if local.numel() == 0:
        return
    rows = []
    handles: dict[str, Any] = {}
    try:
        for e in range(offset[0], offset[0] + shape[0]):
            parts = []
            for key in sources[e]:
                file = str(folder.path / folder.tensors[key].file)
                if file not in handles:
                    handles[file] = safe_open(file, "pt")
                parts.append(handles[file].get_tensor(key))
            rows.append(torch.cat(parts, dim=0))
    finally:
        handles.clear()
    full = torch.stack(rows)
    for dim in range(1, param.dim()):
        full = full.narrow(dim, offset[dim], shape[dim])
    with torch.no_grad():
        local.copy_(full.to(local.dtype))
