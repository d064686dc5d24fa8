"""Context parallel (``parallel.cp``): each rank holds a chunk of every sequence, all-to-all attention.

DeepSpeed-Ulysses' scheme, built on ``all_to_all_single`` so it runs on gloo (CPU) and NCCL alike:
the ``cp`` ranks of a group read the same sequences (they share the data-parallel index) and
each keeps one contiguous chunk of ``seq / cp`` tokens. Everything outside attention is per token,
so it runs on the chunk unchanged. Around each attention call, an all-to-all turns "my chunk, all
heads" into "the whole sequence, heads/cp of them"; attention runs locally with the model's own
kernel (causal over the whole sequence, exactly as in one process); a second all-to-all turns the
result back. Activations per rank shrink by ``cp``; the price is 4 all-to-alls of the q/k/v/out
activations per layer (forward) and as many in backward.

How it reaches a model that never knows it is distributed: ``apply_cp`` makes each attention
module's forward run under a ``TorchFunctionMode`` that routes ``F.scaled_dot_product_attention``
(the built-in GPT's call, and transformers' ``sdpa`` attention) through the all-to-alls. The mode is
entered inside the attention module's forward, so activation checkpointing's recomputation goes
through it too. Positions are made global: a pre-hook on the GPT's learned position table and on a
Hugging Face model's ``position_ids`` adds ``cp_rank * chunk``.

Packed documents and padded records (inputs with ``doc_ids`` / ``attention_mask``, see
``models.masking``): the cp ranks read the same batch, so ``chunk_batch`` sees every token's document
id and position before the sequence is cut. It builds the WHOLE sequence's ``[B, 1, S, S]`` mask
(causal within documents, padding keys hidden: ``attention_mask_4d``, the one owner of that rule)
into the group's ``CPState``, and gives the model only its chunk of ``input_ids`` and of the whole
sequence's ``position_ids`` (restarting per document). The model then runs plain causal attention
on its chunk, and the all-to-all attention swaps in the whole-sequence mask, which is what each
rank's heads see after the all-to-all. A batch whose length is not a multiple of cp (dynamic
padding) is padded on the right first (padding is masked and its labels are -100: no number
changes). The mask costs ``S^2`` bytes per row on every rank, as in one process.

Under pipeline parallel each cp rank's chunk flows through the stages (the cp group of a stage
holds the same stage on every member): ``chunk_batch(..., positions=True)`` gives every stage the
chunk's global positions, and ``parallel.pipeline.pp.Pipeline`` points ``CPState`` at each microbatch's
slice of the whole-sequence mask while a stage runs that microbatch.

A token-sum loss (``runtime.token_loss``, what records and packed text train on) divides by the
trained tokens of the whole global batch and is multiplied by the ranks gradients are averaged
over, cp ranks included (``step_scale``), so cp ranks may hold any share of the trained tokens.
For plain token batches the loss is each rank's token mean over its chunk; equal chunks make the mean of those means the
token mean of the whole sequence, and the data-parallel gradient average (DDP/FSDP over dp x cp,
torchtitan's layout: FSDP shards over dp_shard x cp) is then the gradient of that global mean.

GQA: kv-heads divisible by cp are split like the query heads (each rank's query heads keep their
own kv group); when kv-heads < cp (or do not divide) the kv heads are repeated to the query-head
count before the all-to-all: correct, at the cost of moving ``n_head / n_kv_head`` times more kv
bytes. Query heads (per tensor-parallel rank) must be divisible by cp. transformers repeats the kv
heads to the query heads itself when it builds a mask, and it builds one when a chunk's
``position_ids`` look like packed documents, which differs between the chunks of one sequence:
the all-to-all takes the original kv heads back from such a repeat (the module's
``num_key_value_groups``), so every rank of a cp group exchanges the same shapes.

``parallel.cp_impl``: ``alltoall`` is the scheme above. ``ring`` (``context/ring.py``) drives torch's own
ring attention (``_templated_ring_attention`` and its backward, with torch's load-balanced head-tail
causal sharding) with the device's attention kernel: the CPU flash kernel on gloo, the CUDA flash /
memory-efficient kernels on NCCL; torch's public ``context_parallel`` cannot be used on CPU (no
sharding rule for the CPU kernel). Under ring each rank holds chunks ``r`` and ``2cp-1-r`` of ``2 cp``
(``chunk_batch`` / ``split_sequence`` cut them, the position hooks give their global positions), every
rank keeps all heads (no head-divisibility rule, grouped kv heads travel as they are) and K/V blocks
travel around the cp group; document masks are cut per ring step. ``auto`` picks ``alltoall`` on every
device: the ring's CUDA kernels are wired from the same code but have not run on a GPU yet.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from shardwise.core.families import CP_FAMILIES, MOE_FAMILIES
from shardwise.errors import ConfigError
from shardwise.models.gpt import CausalSelfAttention
from shardwise.models.masking import attention_mask_4d, layer_kind, real_token_mask, split_inputs
from shardwise.parallel.blocks import model_family
from shardwise.parallel.context.ring import ring_attention, ring_index, ring_split, ring_unavailable
from shardwise.parallel.tensor.tp import tp_shape_sizes

__all__ = ["CP_IMPLS", "CPState", "apply_cp", "check_cp_model", "chunk_aligned", "chunk_batch", "cp_multiple",
           "gather_heads",
           "pad_to_multiple", "resolve_cp_impl", "scatter_heads", "split_sequence"]

CP_IMPLS = ("auto", "alltoall", "ring")


def resolve_cp_impl(impl: str, device_type: str) -> str:
    """The implementation ``parallel.cp_impl`` stands for on ``device_type``; ConfigError where none runs.

    ``auto`` is ``alltoall`` on every device: the ring (``parallel.cp_impl = ring``, context/ring.py) runs on
    CPU/gloo and has been verified there; its CUDA kernels are wired from the same code but have not run on
    a GPU yet, so it is not picked without being asked for."""
    if impl not in CP_IMPLS:
        raise ConfigError(f"parallel.cp_impl must be one of {', '.join(CP_IMPLS)}, got {impl!r}.")
    if impl == "ring" and device_type not in ("cpu", "cuda"):
        raise ConfigError(f"parallel.cp_impl = 'ring' cannot run on this {device_type} run: the ring calls the "
                          "CPU and CUDA attention kernels directly. Use parallel.cp_impl = 'alltoall' (or 'auto'), "
                          "which runs on every device.")
    if impl == "ring":
        why = ring_unavailable()
        if why:
            raise ConfigError(f"parallel.cp_impl = 'ring' cannot run here: {why}. Use parallel.cp_impl = 'alltoall'.")
        return "ring"
    return "alltoall"


def cp_multiple(cp: int, impl: str) -> int:
    """What the sequence length must be a multiple of: ``cp`` equal chunks, or ``2 cp`` under ring
    (each rank holds chunks ``r`` and ``2cp-1-r``: load-balanced causal work)."""
    return 2 * cp if impl == "ring" else cp


# --------------------------------------------------------------------------- the all-to-alls


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Exchange dim-0 slices: slice j goes to rank j of ``group``, slice j of the result came from j."""
    x = x.contiguous()  # (before empty_like, which would copy a permuted layout's strides)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _ScatterHeads(torch.autograd.Function):
    """[B, H, S/cp, D] (my chunk, all heads) -> [B, H/cp, S, D] (whole sequence, my heads)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        return _scatter(x, group, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.cp), None, None


class _GatherHeads(torch.autograd.Function):
    """[B, H/cp, S, D] -> [B, H, S/cp, D]: the inverse of ``_ScatterHeads``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
        ctx.group, ctx.cp = group, cp
        return _gather(x, group, cp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _scatter(grad, ctx.group, ctx.cp), None, None


def _scatter(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    b, h, s, d = x.shape
    # Head group j goes to rank j; what comes back from rank j is its sequence chunk of my heads.
    send = x.reshape(b, cp, h // cp, s, d).permute(1, 0, 2, 3, 4)
    recv = _all_to_all(send, group)  # [cp (source rank = chunk), B, H/cp, S/cp, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _gather(x: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    b, h, s, d = x.shape
    send = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # chunk j goes back to rank j
    recv = _all_to_all(send, group)  # [cp (source rank = head group), B, H/cp, S/cp, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * h, s // cp, d)


def scatter_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, H, S/cp, D]`` -> ``[B, H/cp, S, D]`` over ``group`` (autograd: the inverse in backward)."""
    return _ScatterHeads.apply(x, group, dist.get_world_size(group))


def gather_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[B, H/cp, S, D]`` -> ``[B, H, S/cp, D]`` over ``group``."""
    return _GatherHeads.apply(x, group, dist.get_world_size(group))


# --------------------------------------------------------------------------- attention


class CPState:
    """What a cp group's attention needs beyond its chunk: the whole-sequence mask of the batch being
    run (``[B, 1, S, S]`` bool, True = may attend; None = plain causal attention). ``chunk_batch``
    sets it for every batch, so activation checkpointing's recomputation in that batch's backward
    reads the same mask. ``impl``: ``alltoall`` or ``ring`` (``resolve_cp_impl``), which decides how
    batches are cut and how attention runs."""

    def __init__(self, impl: str = "alltoall") -> None:
        self.impl = impl
        self._mask: torch.Tensor | None = None
        self._biases: dict[tuple, torch.Tensor] = {}

    @property
    def mask(self) -> torch.Tensor | None:
        return self._mask

    @mask.setter
    def mask(self, mask: torch.Tensor | None) -> None:
        self._mask, self._biases = mask, {}

    def bias(self, dtype: torch.dtype, window: int | None = None, seq: int = 0,
             device: Any = None) -> torch.Tensor | None:
        """The mask as SDPA's additive float mask in the queries' dtype (0 / -inf), made once per batch.

        SDPA turns a bool mask into such a float copy on every call and saves it for backward: one
        ``4 S^2`` bytes per layer and row. Handing every layer the same tensor keeps one copy; the
        numbers are the same (it is the conversion SDPA does itself).

        ``window``: a sliding-window layer's window over the whole sequence of ``seq`` tokens (the
        window the model would have put in a mask of its own chunk, which cp does not use). None
        where the window changes nothing: no window, or one as long as the sequence with no mask.
        """
        if window and window >= seq:
            window = None
        if self._mask is None and not window:
            return None
        key = (dtype, window)
        if key not in self._biases:
            allowed = self._mask
            if window:
                where = allowed.device if allowed is not None else device
                at = torch.arange(seq, device=where)
                band = (at[:, None] >= at[None, :]) & (at[:, None] - at[None, :] < window)
                allowed = band[None, None] if allowed is None else allowed & band
            self._biases[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._biases[key]


class _CPMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` inside one attention module to the scheme's ``_attention``."""

    def __init__(self, group: Any, cp: int, state: CPState, kv_groups: int = 1, window: int | None = None) -> None:
        super().__init__()
        self.group, self.cp, self.state = group, cp, state
        # Query heads per kv head of the attention module this mode runs inside (GQA; 1 otherwise).
        self.kv_groups = kv_groups
        # The module's sliding window (transformers' sliding-window layers), applied over the whole sequence.
        self.window = window

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attention(*args, **kwargs)  # type: ignore[attr-defined]  # each scheme's own, below


class _UlyssesMode(_CPMode):
    """Sequence chunks through the all-to-alls."""

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
        full = self.state.mask
        if full is not None:
            # The whole sequence's document/padding mask (causal included), built by chunk_batch from
            # every token's doc ids; whatever the model built on its chunk is not what these heads see.
            if full.shape[-1] != q.shape[2] * self.cp:
                raise RuntimeError(f"context parallel: the batch's mask covers {full.shape[-1]} tokens but the "
                                   f"attention runs on {q.shape[2]} x cp {self.cp}; a forward ran on a batch "
                                   "that did not go through session.forward_backward / eval_loss")
            attn_mask, is_causal = self.state.bias(q.dtype, self.window, full.shape[-1]), False
        elif self.window:
            # The model built its windowed mask on its chunk (or none, where the chunk fits the window):
            # the window applies over the whole sequence instead. None: the window covers it all.
            attn_mask = self.state.bias(q.dtype, self.window, q.shape[2] * self.cp, q.device)
            is_causal = attn_mask is None
        elif attn_mask is not None:
            # A mask built on this rank's chunk covers [S/cp, S/cp], not the whole sequence.
            raise ConfigError(
                "context parallel (parallel.cp > 1) runs attention over the whole sequence, but the model was "
                "called with an attention mask built for one chunk. Pass packed/padded batches (doc_ids, "
                "attention_mask) whole to session.forward_backward / eval_loss, which build the whole sequence's "
                "mask from every token's document ids (shardwise.parallel.context.cp.chunk_batch).")
        if dropout_p:
            raise ConfigError("context parallel does not support attention dropout (each rank would draw its own "
                              "mask); set the model's attention dropout to 0.")
        if self.kv_groups > 1 and k.shape[1] == q.shape[1]:
            # transformers repeated the kv heads to one per query head, which it does only when it
            # built a mask, and whether it builds one depends on the chunk's positions (packed
            # documents guessed from restarting position_ids): ranks of one cp group could then
            # disagree on the kv head count and exchange differently sized all-to-alls. Take the
            # original kv heads back (each is kv_groups consecutive copies), so every rank agrees.
            k, v = k[:, ::self.kv_groups], v[:, ::self.kv_groups]
        cp, heads, kv = self.cp, q.shape[1], k.shape[1]
        if heads % cp:
            raise ConfigError(f"context parallel splits attention heads over parallel.cp={cp} ranks, but this rank "
                              f"has {heads} query heads; cp must divide the heads (per tensor-parallel rank).")
        if kv != heads and kv % cp:
            # GQA with fewer kv heads than ranks: repeat them to one per query head (see module doc).
            k = k.repeat_interleave(heads // kv, dim=1)
            v = v.repeat_interleave(heads // kv, dim=1)
        q, k, v = (scatter_heads(t, self.group) for t in (q, k, v))
        if k.shape[1] != q.shape[1]:
            kwargs["enable_gqa"] = True
        elif "enable_gqa" in kwargs:
            kwargs["enable_gqa"] = False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal,
                                           **kwargs)
        return gather_heads(y, self.group)


class _RingMode(_CPMode):
    """This rank's ``ring_index`` tokens through the ring."""

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        if dropout_p:
            raise ConfigError("context parallel does not support attention dropout (each rank would draw its own "
                              "mask); set the model's attention dropout to 0.")
        full = self.state.mask
        if full is not None and full.shape[-1] != q.shape[2] * self.cp:
            raise RuntimeError(f"context parallel: the batch's mask covers {full.shape[-1]} tokens but the "
                               f"attention runs on {q.shape[2]} x cp {self.cp}; a forward ran on a batch "
                               "that did not go through session.forward_backward / eval_loss")
        if attn_mask is None and not is_causal:
            raise ConfigError("parallel.cp_impl = 'ring' runs causal attention (the built-in GPT and Llama-family "
                              "decoders); this model called attention without a causal mask.")
        if full is None and not self.window and attn_mask is not None and not _two_chunk_mask(attn_mask, q.shape[2]):
            raise ConfigError(
                "context parallel (parallel.cp_impl = 'ring') runs attention over the whole sequence, but the model "
                "was called with an attention mask built for this rank's tokens. Pass packed/padded batches "
                "(doc_ids, attention_mask) whole to session.forward_backward / eval_loss, which build the whole "
                "sequence's mask from every token's document ids (shardwise.parallel.context.cp.chunk_batch).")
        # Otherwise a mask the model built on its tokens is not used: this rank's tokens are two distant
        # chunks, whose positions jump, which transformers reads as two packed documents (the mask
        # _two_chunk_mask recognises). The batch's real mask is the whole sequence's (state.mask).
        if self.kv_groups > 1 and k.shape[1] == q.shape[1]:
            # transformers repeated the kv heads when it built that mask: pass the originals around the ring.
            k, v = k[:, ::self.kv_groups], v[:, ::self.kv_groups]
        # A sliding-window layer's window covers the whole sequence (a mask the model built on its
        # tokens is not used, as above).
        return ring_attention(q, k, v, self.group, scale=scale,
                              bias=self.state.bias(q.dtype, self.window, q.shape[2] * self.cp, q.device))


def _two_chunk_mask(mask: torch.Tensor, n: int) -> bool:
    """Whether ``mask`` is what transformers builds from a ring rank's positions (two chunks, whose jump
    reads as a document start): causal within each half of the ``n`` tokens, nothing across."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if tuple(allowed.shape[-2:]) != (n, n):
        return False
    at = torch.arange(n, device=mask.device)
    expected = (at[:, None] >= at[None, :]) & ((at[:, None] < n // 2) == (at[None, :] < n // 2))
    return bool((allowed == expected).all())


# --------------------------------------------------------------------------- the model


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not found and hasattr(model, "hf"):
        found = [m for name, m in model.hf.named_modules() if name.endswith("self_attn")]
    return found


def check_cp_family(family: str, cp: int) -> None:
    """ConfigError unless context parallel runs on ``family`` (``shardwise.core.families``); needs no model,
    so a run is refused before its data is read."""
    if cp == 1 or family in CP_FAMILIES:
        return
    other = (" Its experts split with expert parallel (parallel.ep), and tp, pp and fsdp run on it."
             if family in MOE_FAMILIES else "")
    raise ConfigError(
        f"context parallel (parallel.cp={cp}) runs the model families {', '.join(CP_FAMILIES)} (sdpa "
        f"attention); {family} is not one of them. Set parallel.cp = 1.{other}")


def check_cp_model(model: nn.Module, cp: int, tp: int = 1, impl: str = "alltoall") -> None:
    """ConfigError unless ``model`` is one context parallel can run (known attention; under alltoall,
    heads divisible by cp: the ring keeps every head on every rank and has no such rule)."""
    if cp == 1:
        return
    family = model_family(model)
    check_cp_family(family or type(model).__name__, cp)
    if not _attention_modules(model):
        check_cp_family(type(model).__name__, cp)
    sizes = tp_shape_sizes(model)
    heads = sizes.get("n_head") or sizes["num_attention_heads"]
    if impl != "ring" and (heads // tp) % cp:
        raise ConfigError(
            f"parallel.cp={cp} must divide the attention heads each tensor-parallel rank holds ({heads} heads / "
            f"tp {tp} = {heads // tp}): the all-to-all gives each cp rank whole heads of the full sequence. "
            "parallel.cp_impl = 'ring' has no such rule.")
    if hasattr(model, "hf") and getattr(model.hf.config, "_attn_implementation", "sdpa") != "sdpa":
        raise ConfigError("context parallel needs the model's attention to be 'sdpa' "
                          f"(it is {model.hf.config._attn_implementation!r}); with parallel.cp > 1 leave "
                          "model.attention = 'mask' (packed documents reach the cp attention as the whole "
                          "sequence's mask).")


def _sliding_window(model: nn.Module, attn: nn.Module) -> int | None:
    """The window of a Hugging Face sliding-window attention layer (Mistral, Qwen2/3 with sliding layers),
    as the model decides it (``models.masking.layer_kind``); None for full attention."""
    hf = getattr(model, "hf", None)
    index = getattr(attn, "layer_idx", None)
    if hf is None or index is None:
        return None
    if layer_kind(hf.config, index) != "sliding_attention":
        return None
    return int(hf.config.sliding_window)


def apply_cp(model: nn.Module, group: Any, cp_rank: int, cp: int, state: CPState | None = None) -> nn.Module:
    """Make ``model`` run on sequence chunks of a ``cp``-rank group (in place; see module docstring).

    ``state``: where ``chunk_batch`` leaves each batch's whole-sequence mask (the session's own); its
    ``impl`` picks the all-to-all or the ring.
    """
    if cp == 1:
        return model
    state = state if state is not None else CPState()
    mode_args = (group, cp, state)
    mode = _RingMode if state.impl == "ring" else _UlyssesMode
    for attn in _attention_modules(model):
        dense = attn.forward
        groups = int(getattr(attn, "num_key_value_groups", 1) or 1)  # HF attention modules (GQA)
        window = _sliding_window(model, attn)

        def forward(*args: Any, _dense: Any = dense, _groups: int = groups, _window: int | None = window,
                    **kwargs: Any) -> Any:
            with mode(*mode_args, kv_groups=_groups, window=_window):
                return _dense(*args, **kwargs)

        attn.forward = forward  # type: ignore[method-assign]
    def global_positions(n: int, device: Any) -> torch.Tensor:
        """The global positions of this rank's ``n`` tokens (a chunk, or the ring's two chunks)."""
        if state.impl == "ring":
            return ring_index(n * cp, cp_rank, cp, device)
        return torch.arange(n, device=device) + cp_rank * n

    pos_emb = getattr(model, "pos_emb", None)
    if isinstance(pos_emb, nn.Embedding):
        # The GPT indexes its table with arange(chunk) (1-D); this rank's tokens sit elsewhere in the
        # sequence. Explicit (B, chunk) position_ids are already this chunk's slice of the whole
        # sequence's positions (chunk_batch) and pass unchanged.
        # prepend: ahead of tensor parallel's input hook (it turns the positions into a DTensor).
        pos_emb.register_forward_pre_hook(
            lambda m, args: (global_positions(args[0].numel(), args[0].device),) if args[0].dim() == 1 else None,
            prepend=True)
    if hasattr(model, "hf"):
        def positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if kwargs.get("position_ids") is None:
                ids = kwargs.get("input_ids", args[0] if args else None)
                kwargs["position_ids"] = global_positions(ids.shape[1], ids.device).unsqueeze(0)
            return args, kwargs

        model.hf.register_forward_pre_hook(positions, with_kwargs=True, prepend=True)
    return model


def split_sequence(x: torch.Tensor, cp_rank: int, cp: int, impl: str = "alltoall") -> torch.Tensor:
    """This rank's tokens of dim 1 (the sequence) of ``x``: a contiguous chunk, or under ``ring`` chunks
    ``cp_rank`` and ``2cp-1-cp_rank`` of ``2 cp`` (``context.ring.ring_index``)."""
    seq, multiple = x.shape[1], cp_multiple(cp, impl)
    if seq % multiple:
        how = (f"2 x parallel.cp = {multiple}: under cp_impl = 'ring' each rank takes two of {multiple} equal "
               "chunks (load-balanced causal attention)" if impl == "ring" else
               f"parallel.cp={cp}: each context-parallel rank takes an equal chunk")
        raise ConfigError(f"the sequence length {seq} must be divisible by {how}. Change the sequence length "
                          "(model block_size / seq_len).")
    if impl == "ring":
        return ring_split(x, cp_rank, cp)
    chunk = seq // cp
    return x[:, cp_rank * chunk:(cp_rank + 1) * chunk]


def chunk_aligned(t: torch.Tensor, cp_rank: int, cp: int, impl: str, fill: int) -> torch.Tensor:
    """This rank's part of a ``(B, T)`` tensor aligned with a batch's tokens, cut as ``chunk_batch`` cuts
    the batch's targets: right-padded with ``fill`` to the multiple, then this rank's tokens. For what a
    loss needs beside the labels (which answer each token belongs to, per-token weights)."""
    extra = (-t.shape[1]) % cp_multiple(cp, impl)
    if extra:
        t = torch.cat([t, t.new_full((t.shape[0], extra), fill)], dim=1)
    return split_sequence(t, cp_rank, cp, impl)


def pad_to_multiple(inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                    cp: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A masked batch (``doc_ids`` or ``attention_mask``) right-padded to a multiple of ``cp`` tokens:
    padding keys are hidden by the mask and padding labels are -100, so no loss changes."""
    seq = targets.shape[1]
    extra = (-seq) % cp
    if not extra:
        return inputs, targets
    fill = {"doc_ids": -1, "attention_mask": 0, "position_ids": 0, "input_ids": 0}
    pad = lambda t, v: torch.cat([t, t.new_full((t.shape[0], extra), v)], dim=1)  # noqa: E731
    return {k: pad(v, fill[k]) for k, v in inputs.items()}, pad(targets, -100)


def chunk_batch(inputs: Any, targets: torch.Tensor, cp_rank: int, cp: int,
                state: CPState, *, positions: bool = False, real_tokens: bool = False) -> tuple[Any, torch.Tensor]:
    """This rank's chunk of one batch, and the whole-sequence mask into ``state`` (see module docstring).

    ``inputs``: a ``(B, T)`` tensor of token ids, or a mapping with the keys of ``models.masking``
    (packed rows, padded records). The mapping's chunk holds ``input_ids`` and ``position_ids`` (the
    whole sequence's positions, cut): the document/padding mask goes to the attention through
    ``state``, built from all ``T`` tokens' ``doc_ids`` / ``attention_mask``.

    ``positions=True``: a tensor of token ids also comes back as such a mapping, with the chunk's
    global positions. A pipeline's later stages need them (they see hidden states, not where the
    chunk sits in the sequence, and the rotary positions of a Hugging Face stage are its inputs).

    ``real_tokens=True``: the chunk of a batch with padding also holds ``real_tokens``, which of its
    tokens are real (``models.masking``): a mixture-of-experts model's routers leave the padding out
    of their load balancing, as one process does with the whole batch's ``doc_ids``/``attention_mask``.
    """
    cut = lambda t: split_sequence(t, cp_rank, cp, state.impl)  # noqa: E731
    if isinstance(inputs, torch.Tensor):
        state.mask = None
        if not positions:
            return cut(inputs), cut(targets)
        inputs = {"input_ids": inputs}
    ids, extra = split_inputs(inputs)
    if "doc_ids" in extra or "attention_mask" in extra:
        inputs, targets = pad_to_multiple({"input_ids": ids, **extra}, targets, cp_multiple(cp, state.impl))
        ids, extra = split_inputs(inputs)
    seq = ids.shape[1]
    positions = extra.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=ids.device).expand(ids.shape[0], seq)
    state.mask = attention_mask_4d(extra)
    chunk = {"input_ids": cut(ids), "position_ids": cut(positions)}
    real = real_token_mask(extra) if real_tokens else None
    if real is not None:
        chunk["real_tokens"] = cut(real)
    return chunk, cut(targets)
