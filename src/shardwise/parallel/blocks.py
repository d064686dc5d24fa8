"""Where a model keeps its transformer blocks, and which family it belongs to: one rule for all.

FSDP wraps each block as a unit, activation checkpointing wraps blocks, the pipeline splits the
blocks into stages, and the planner counts parameters per block; every one of them asks
``find_blocks`` (the planner's ``spec.from_module`` included), so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from shardwise.core.families import FAMILIES, LLAMA_LIKE
from shardwise.models.gpt import GPT

# Where known model families keep their repeated blocks (checked in this order); anything else is
# found by the generic search for a container of same-class children.
BLOCK_PATHS = ("blocks", "layers", "model.layers", "hf.model.layers", "transformer.h", "hf.transformer.h")


@dataclass(frozen=True)
class Blocks:
    """The container of a model's repeated blocks and its dotted path ('' for the model itself)."""

    path: str
    container: nn.Module

    @property
    def names(self) -> list[str]:
        """The children's names in order ("0", "1", ...)."""
        return [name for name, _ in self.container.named_children()]

    def __len__(self) -> int:
        return len(self.container)


def _unwrapped_type(module: nn.Module) -> type:
    # A compiled (torch.compile's OptimizedModule) or checkpoint-wrapped block counts as the
    # block it wraps.
    module = getattr(module, "_orig_mod", module)
    return type(getattr(module, "_checkpoint_wrapped_module", module))


def _is_block_container(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    kinds = {_unwrapped_type(m) for m in module.children()}
    return len(module) >= 1 and len(kinds) == 1


def find_blocks(model: nn.Module) -> Blocks | None:
    """Return where ``model``'s repeated blocks live, or None if it has none.

    Known paths first (GPT ``blocks``, HF Llama ``model.layers`` / ``hf.model.layers``, GPT-2
    ``transformer.h``), then the first container in ``named_modules()`` order whose two or more
    children all share one class. Wrappers that keep the block container's names (checkpoint
    wrappers, FSDP's in-place class swap) do not change the answer.
    """
    for path in BLOCK_PATHS:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            continue
        if _is_block_container(found):
            return Blocks(path, found)
    for path, module in model.named_modules():
        if _is_block_container(module) and len(module) >= 2:
            return Blocks(path, module)
    return None


@dataclass(frozen=True)
class OuterModules:
    """The modules holding parameters outside the blocks: those used before them (input and
    position embeddings) and after them (final norm, output head), each in registration order."""

    before: tuple[nn.Module, ...] = ()
    after: tuple[nn.Module, ...] = ()


def outer_modules(model: nn.Module) -> OuterModules:
    """The embeddings and the final norm + head of ``model``, as separate FSDP units take them.

    The rule (torchtitan's units, found without naming a family): parameters registered before
    the block container belong to the input side, those after it to the output side. Empty when
    there are no blocks, when a parameter sits on the model itself, or when a parameter is shared
    (tied input/output embeddings): a tied head must stay with the embedding in the root unit, or
    the head would run on a resharded weight.
    """
    blocks = find_blocks(model)
    if blocks is None or not blocks.path:
        return OuterModules()
    every = list(model.named_parameters(remove_duplicate=False))
    if len({id(p) for _, p in every}) != len(every):
        return OuterModules()
    prefix = f"{blocks.path}."
    before: list[nn.Module] = []
    after: list[nn.Module] = []
    inside = False
    for name, _ in every:
        if name.startswith(prefix):
            inside = True
            continue
        if "." not in name:
            return OuterModules()
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        side = after if inside else before
        if not any(owner is m for m in side):
            side.append(owner)
    return OuterModules(tuple(before), tuple(after))


def transformer_blocks(model: nn.Module) -> nn.Module | None:
    """Return the ModuleList/ModuleDict holding ``model``'s repeated blocks, or None (``find_blocks``)."""
    found = find_blocks(model)
    return None if found is None else found.container


def model_family(model: nn.Module) -> str:
    """The model's family as the registry names it: "gpt" (built-in GPT), a Hugging Face
    ``model_type`` for ``HFCausalLM`` models ("llama", "gpt2", ...), or "" when unknown."""
    if isinstance(model, GPT):
        return "gpt"
    hf = getattr(model, "hf", None)
    return str(getattr(getattr(hf, "config", None), "model_type", "") or "")


def tp_plan_family(model: nn.Module) -> str:
    """The tensor-parallel plan family of ``model`` ("gpt", "gpt2", "llama") or "" when no plan exists."""
    family = model_family(model)
    if family in ("gpt", "gpt2"):
        return family
    if family in LLAMA_LIKE:
        return "llama"
    # Mixture-of-experts families share Llama's attention and dense-MLP names (models/hf_moe.py).
    f = FAMILIES.get(family)
    return "llama" if f is not None and f.moe and f.tp_plan else ""


def submodule(model: nn.Module, path: str) -> nn.Module | None:
    """``model``'s module at the dotted ``path`` ("mlp.gate_proj"), or None where a part is missing
    or ``None`` (a pipeline stage that does not own it)."""
    node: Any = model
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node
