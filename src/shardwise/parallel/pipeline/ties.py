"""Tied weights across pipeline stages: the one owner of how a tie survives the stage split.

A model that ties its output head to its input embedding (``tie_word_embeddings``: Qwen2-0.5B/1.5B,
Llama-3.2-1B/3B, GPT-2) registers one ``(vocab, hidden)`` tensor under two names, but the first
pipeline stage owns the embedding and the last the head. Megatron-LM's answer, taken here
(``LanguageModule.setup_embeddings_and_output_layer``: a second copy on the last stage, zeroed and
all-reduced over the ``embedding_group`` of first and last pipeline ranks so it starts equal, marked
``shared`` so the gradient norm skips it; ``finalize_model_grads._allreduce_word_embedding_grads``:
the copies' gradients all-reduced over that group after backward, before clipping and the step):

* each of the two stages keeps its own copy, under its own single-device name; both start equal
  (``sync_weights`` copies the first stage's values onto the last after materialisation, so meta
  init, eager init and pretrained loading all end the same way);
* after backward, and before anything reads the gradients (norm, clipping, the optimizer), the two
  copies' gradients are summed over a 2-rank group: the first- and last-stage ranks of one
  ``(dp, tp)`` coordinate (``sync_grads``). Both copies then get the gradient one process's single
  tensor gets, take the same optimizer step, and stay identical, bit for bit;
* the global gradient norm counts the tensor once (``counted``: the last stage's copy is left out);
* checkpoints name the copy's optimizer state after the original (``rename_copy_keys``), as one
  process saves it, so a pipeline checkpoint resumes without a pipeline and back; the model state
  holds both names in either layout already (``get_model_state_dict`` keeps tied aliases).

Why the sum and not a broadcast of the first copy's gradient: each stage computes only its own
use's gradient (the embedding's from the lookup, the head's from the logits); the tensor's gradient
is their sum.

FSDP: both copies are ``Shard(0)`` over the same-sized dp mesh, so the two ranks of a pair hold the
same rows, and summing local shards is the sum of the full gradients. TP: the vocabulary-parallel
embedding and the column-parallel head both split the vocabulary rows (``Shard(0)``), likewise.
``sync_weights`` checks that the two local shards agree in shape and refuses otherwise.

When the first and the last stage run on the same rank (the V-shaped schedules put both on rank 0)
the tie stays one tensor there. That is exact with no data-parallel wrapper; DDP and FSDP wrap each
stage separately and would each reduce (FSDP: shard) their own view of it, so ``check_stage_ties``
refuses those layouts (the rule is ``pp_schedules.tied_weights_refusal``, which the planner asks too).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.core.layout import Layout
from shardwise.core.pp_schedules import stage_rank, tied_weights_refusal
from shardwise.errors import ConfigError
from shardwise.parallel.ties import tied_groups

__all__ = ["StageTies", "check_stage_ties", "rename_copy_keys"]

# union model -> {name of a last-stage copy: name of the tensor one process registers it under}.
# Read by the checkpoint's state dicts (runtime/checkpoint/state.py) through rename_copy_keys.
_COPIES: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def _first_last_ranks(layout: Layout) -> tuple[int, int]:
    """The pipeline ranks running the first and the last stage."""
    def rank_of(stage: int) -> int:
        return stage_rank(layout.pp_schedule, stage, layout.pp, layout.pp_stages_per_rank)

    return rank_of(0), rank_of(layout.n_stages - 1)


def check_stage_ties(model: nn.Module, layout: Layout) -> None:
    """Raise ConfigError when ``model`` ties parameters and the pipeline layout cannot keep them exact
    (the rule: ``pp_schedules.tied_weights_refusal``, which the planner asks too). Works on meta models."""
    if layout.pp > 1 and tied_groups(model) and (why := tied_weights_refusal(layout)):
        raise ConfigError(why + ".")


class StageTies:
    """This rank's share of the tied weights cut apart by the stage split (none when nothing is cut).

    Built by the strategy right after the split (``plan``), used after wrapping (``sync_weights``) and
    at every optimizer step (``sync_grads``, ``counted``).
    """

    def __init__(self, union: nn.Module, names: list[str], copies: dict[str, str], group: Any, src: int) -> None:
        self._union = weakref.ref(union)
        self.names = names  # this rank's names of cut tied tensors (first- or last-stage side)
        self.copies = copies  # the last-stage ones: {copy name: original name}
        self.group = group  # the first/last pair of this rank's (dp, tp) coordinate, or None
        self.src = src  # global rank of the pair's first-stage side
        self._pending = False

    @classmethod
    def plan(cls, union: nn.Module, groups: list[list[str]], layout: Layout, stage_ids: list[int],
             meshes: Any) -> StageTies:
        """After ``prune_to_stages``: find the tied names this rank kept only some of, and make the
        2-rank groups (collective: every rank calls this, with the same ``groups``)."""
        empty = cls(union, [], {}, None, -1)
        first, last = _first_last_ranks(layout)
        if layout.pp <= 1 or not groups or first == last:
            return empty
        present = {n for n, _ in union.named_parameters(remove_duplicate=False)}
        names: list[str] = []
        copies: dict[str, str] = {}
        for group in groups:
            kept = [n for n in group if n in present]
            if not kept or len(kept) == len(group):
                continue
            if (0 in stage_ids) == (layout.n_stages - 1 in stage_ids):
                # A middle stage kept part of a tie (weights shared between layers of different stages).
                raise ConfigError(
                    f"the pipeline split cuts the tied parameters {', '.join(group)} between stages other than "
                    "the first and the last; only an embedding tied to the output head can be shared across "
                    "stages. Use a strategy without pipeline parallel for this model.")
            names += kept
            if 0 not in stage_ids:
                copies.update(dict.fromkeys(kept, group[0]))
        # One 2-rank group per (dp, tp) coordinate, from the mesh owner (collective: every rank asks).
        group, src = meshes.stage_pair_group(first, last)
        if copies:
            _COPIES[union] = copies
        return cls(union, names, copies, group, src) if names else empty

    def _params(self) -> list[torch.Tensor]:
        union = self._union()
        assert union is not None
        return [union.get_parameter(n) for n in self.names]

    def sync_weights(self) -> None:
        """Copy the first stage's values onto the last stage's copy (after materialisation or loading)."""
        if not self.names:
            return
        locals_ = [_local(p) for p in self._params()]
        shapes = torch.tensor([s for t in locals_ for s in (t.numel(), *t.shape)], dtype=torch.float64)
        theirs = shapes.clone()
        dist.broadcast(theirs, src=self.src, group=self.group)
        bad = torch.tensor([float(not torch.equal(theirs, shapes))])
        dist.all_reduce(bad, group=self.group)  # both sides raise, or neither
        if bad.item():
            raise ConfigError(
                f"the tied parameters {', '.join(self.names)} are split differently on the first and the last "
                "pipeline stage (local shards of different shapes), so their copies cannot be kept equal. "
                "Untie them in the model config (tie_word_embeddings = false) or drop tensor parallel.")
        with torch.no_grad():
            for t in locals_:
                dist.broadcast(t, src=self.src, group=self.group)

    def mark_backward(self) -> None:
        """A backward has added to the gradients since the last sync."""
        self._pending = bool(self.names)

    def sync_grads(self) -> None:
        """Sum the two copies' gradients over the pair, once per step however often it is asked."""
        if not self._pending:
            return
        self._pending = False
        with torch.no_grad():
            for p in self._params():
                if p.grad is not None:  # a frozen tied weight (LoRA's base) has none
                    dist.all_reduce(_local(p.grad), group=self.group)

    def counted(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` without the last stage's copies: the global norm counts a tied tensor once."""
        if not self.copies:
            return list(params)
        union = self._union()
        assert union is not None
        skip = {id(union.get_parameter(n)) for n in self.copies}
        return [p for p in params if id(p) not in skip]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t`` (a DTensor's local shard, sharing its storage)."""
    return t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001 - in-place collectives need the storage


def rename_copy_keys(model: nn.Module, state: dict[str, Any], to_original: bool) -> dict[str, Any]:
    """Optimizer state keys (flattened, ``state.<name>.<key>`` / ``param_groups.<name>.<key>``) of the
    last stage's tied copies under the original's name (``to_original``) or back."""
    copies = _COPIES.get(model)
    if not copies:
        return state
    pairs = copies.items() if to_original else ((orig, copy) for copy, orig in copies.items())
    out = dict(state)
    for old, new in pairs:
        for key in [k for k in out if isinstance(k, str)]:
            for head in ("state.", "param_groups."):
                if key.startswith(f"{head}{old}."):
                    out[f"{head}{new}.{key[len(head) + len(old) + 1:]}"] = out.pop(key)
    return out
