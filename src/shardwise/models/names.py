"""A parameter's name as the plain model spells it, whatever wrappers parallelism added.

Torch-free and below every layer that wraps a model: the models (MoE statistics), the parallel
wrappers, checkpoints and verify all name parameters this way.
"""

from __future__ import annotations

# The attribute each wrapper keeps the wrapped module under (torch's own names).
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper
COMPILED_PREFIX = "_orig_mod."  # torch.compile's OptimizedModule


def clean_name(name: str) -> str:
    """Return a parameter name without wrapper prefixes (DDP ``module.``, checkpoint wrappers,
    ``torch.compile``'s ``_orig_mod.``)."""
    name = name.replace(CHECKPOINT_PREFIX, "").replace(COMPILED_PREFIX, "")
    return name[len("module."):] if name.startswith("module.") else name
