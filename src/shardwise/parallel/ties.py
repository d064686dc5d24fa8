"""Tied parameters (one tensor registered under two names, e.g. a token embedding and an output head
that share their ``(vocab, hidden)`` weight) through parallelisation: one owner for keeping them tied.

A tie must survive every step of the parallelize order as ONE tensor: training updates it once with
the sum of both uses' gradients. Two ways to lose it silently, both seen in practice:

* a step that gives each module a new parameter (TP's ``parallelize_module``) turns it into two
  equal tensors that then train apart (``retie`` undoes that right after such a step);
* FSDP2 puts a parameter in the unit of the first ``fully_shard`` call that reaches it. If the two
  names sit in different units (the embedding's and the head's own units), each unit gathers,
  reduce-scatters and steps its own copy of the storage, and one copy goes stale: wrong from the
  second step under dp > 1. ``outer_modules`` keeps a shared parameter in the root unit, which only
  works if the tie is still visible when FSDP wraps the model.

``check_ties`` runs after parallelize and refuses a model on which either happened, so a strategy
that breaks a tie fails at start-up instead of training a different model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardwise.errors import ConfigError

__all__ = ["check_ties", "retie", "tied_groups"]


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of every parameter ``model`` registers under two or more names, one list per
    shared tensor, in registration order."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _placements(param: torch.Tensor) -> tuple:
    return tuple(param.placements) if isinstance(param, DTensor) else ()


def _layout(param: torch.Tensor) -> str:
    placements = _placements(param)
    return f"shape {tuple(param.shape)}" + (f" as {placements}" if placements else "")


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make each group of names (``tied_groups`` taken before a step that re-created parameters)
    one Parameter again: every name gets the first name's parameter.

    The re-created tensors must be laid out alike (TP's vocabulary-parallel embedding and head are
    both ``Shard(0)`` of the one ``(vocab, hidden)`` weight, with equal values); a plan that splits
    tied weights two ways is refused.
    """
    for names in groups:
        first_name, first = names[0], model.get_parameter(names[0])
        for name in names[1:]:
            param = model.get_parameter(name)
            if param is first:
                continue
            if _placements(param) != _placements(first) or param.shape != first.shape:
                raise ConfigError(
                    f"tensor parallel splits the tied parameters {first_name} and {name} differently "
                    f"({_layout(first)} vs {_layout(param)}); tied weights are one tensor and need "
                    "one layout. Untie them in the model config (e.g. tie_word_embeddings = false) or use "
                    "a strategy without tensor parallel.")
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)


def _fsdp_unit(model: nn.Module, name: str) -> str:
    """The path of the innermost FSDP module holding parameter ``name`` ('' for the root or none)."""
    unit, path, node = "", "", model
    for part in name.split(".")[:-1]:
        node = getattr(node, part)
        path = f"{path}.{part}" if path else part
        if isinstance(node, FSDPModule):
            unit = path
    return unit


def check_ties(model: nn.Module, groups: list[list[str]], name_of: Callable[[str], str] = lambda n: n) -> None:
    """Raise ConfigError unless every group of tied names (``tied_groups`` of the built model) is
    still one tensor in the parallelised ``model`` and, under FSDP, held by one unit.

    ``name_of`` maps the parallelised model's names to the built model's (wrapper prefixes removed).
    Names a pipeline stage pruned away are not checked (``parallel/pipeline/ties.py`` keeps those copies equal).
    """
    if not groups:
        return
    present: dict[str, tuple[str, torch.Tensor]] = {
        name_of(n): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}
    for names in groups:
        here = [(n, *present[n]) for n in names if n in present]
        if len(here) < 2:
            continue
        first, first_full, first_param = here[0]
        for name, full, param in here[1:]:
            if param is not first_param:
                why = "became two separate tensors"
            elif _fsdp_unit(model, full) != _fsdp_unit(model, first_full):
                why = (f"sit in two FSDP units ({_fsdp_unit(model, first_full) or 'the root'} and "
                       f"{_fsdp_unit(model, full) or 'the root'}), each stepping its own copy")
            else:
                continue
            raise ConfigError(
                f"the strategy broke the tie between {first} and {name}: the parameters they share "
                f"{why}, so training would not match one process (a shardwise bug, please report it). "
                "Untie them in the model config (e.g. tie_word_embeddings = false) or choose another strategy.")
