"""Resuming under another optimizer: refused by default, or allowed with its state reset.

A checkpoint records the optimizer that wrote it (``state["optimizer"]``, the ``[optimizer]`` name).
AdamW's moments, Muon's momentum and Adafactor's factored statistics are different tensors under
the same parameter names: loading one as the other would be wrong, so a change is either refused
with a message or, with ``optimizer.on_switch = "reset"``, the model and data position load and
the new optimizer starts from fresh state (a warning says so).
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import CheckpointError, ConfigError

# Checkpoints written before the optimizer was recorded were all AdamW's (the only one then).
BEFORE_RECORDING = "adamw"
CANNOT_READ = ""  # a checkpoint whose manifest does not read: no check here, the load reports it


def resets_state(saved_state: dict[str, Any], current: str, on_switch: str, where: str) -> bool:
    """True when the saved optimizer state must not be loaded (a switch, allowed); raise if refused."""
    saved = saved_state.get("optimizer", BEFORE_RECORDING)
    if saved in (current, CANNOT_READ):
        return False
    if on_switch == "reset":
        return True
    raise ConfigError(
        f"checkpoint {where} was trained with optimizer {saved!r}, this run uses {current!r}: their states "
        f"are different tensors, so it is not resumed. Keep optimizer.name = {saved!r} to continue it, or set "
        f"optimizer.on_switch = \"reset\" to load the model and data position and start {current!r} from "
        "fresh state.")


def saved_state(source: str) -> tuple[dict[str, Any], str]:
    """The trainer state a checkpoint source holds, and the checkpoint's directory.

    A checkpoint that cannot be read yields no state (and so no optimizer check): loading it then
    raises the checkpoint's own error, on every rank alike (``load_checkpoint``).
    """
    from shardwise.runtime.checkpoint.locate import resolve_checkpoint  # defers torch
    from shardwise.runtime.checkpoint.manifest import read_manifest  # defers torch

    try:
        path = resolve_checkpoint(source)
        state = read_manifest(path).get("state", {})
    except CheckpointError:
        return {"optimizer": CANNOT_READ}, str(source)
    return state, str(path)
