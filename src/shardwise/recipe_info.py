"""The built-in recipes in one line each, with their defaults (``shardwise train --help``)."""

from __future__ import annotations

import textwrap

from shardwise.core.config import TrainConfig, builtin_recipes, load_raw


def recipe_summary(name: str) -> str:
    """The first sentence of the recipe's opening comment (what it trains)."""
    lines = []
    for line in builtin_recipes()[name].splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text.startswith(("shardwise ", "Needs ", "Use ")) or not text:
            break
        lines.append(text)
    summary = " ".join(lines)
    return summary.split(". ")[0].rstrip(".") if summary else name


def recipe_defaults(name: str) -> str:
    """'steps 200, lr 2e-05, micro-batch 4, block 512, data chat' from the recipe (TrainConfig's defaults
    where it says nothing)."""
    raw = load_raw(name)
    train, model, data = raw.get("train", {}), raw.get("model", {}), raw.get("data", {})
    base = TrainConfig()
    parts = [f"steps {train.get('steps', base.steps)}", f"lr {train.get('lr', base.lr):g}",
             f"warm-up {train.get('warmup_steps', base.warmup_steps)}",
             f"micro-batch {train.get('micro_batch_size', base.micro_batch_size)}"]
    block = model.get("overrides", {}).get("block_size")
    if block:
        parts.append(f"block {block}")
    parts.append(f"data {data.get('kind', 'shakespeare')}")
    return ", ".join(parts)


def recipes_help() -> str:
    """The recipe list ``train --help`` ends with."""
    names = sorted(builtin_recipes())
    width = max(map(len, names))
    lines = ["recipes (shardwise train RECIPE --show prints one resolved; --set KEY=VALUE changes it):"]
    for name in names:
        body = f"{recipe_summary(name)} ({recipe_defaults(name)})"
        wrapped = textwrap.wrap(body, 100 - width - 4)
        lines.append(f"  {name.ljust(width)}  {wrapped[0]}")
        lines += [f"  {' ' * width}  {w}" for w in wrapped[1:]]
    return "\n".join(lines)
