"""Every random-number stream a rank uses, captured as plain JSON and restored exactly.

Checkpoints store these per rank as JSON rather than pickles, so loading them can never run
code. A resumed rank continues the very same streams (dropout masks, sampling) it would have
drawn without the interruption.
"""

from __future__ import annotations

import base64
import contextlib
import random
from typing import Any

import torch


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def _accelerator() -> Any:
    """The torch module of the active accelerator (torch.cuda, torch.xpu, ...), or None."""
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is None:
        return None
    module = getattr(torch, acc.type, None)
    return module if module is not None and hasattr(module, "get_rng_state_all") else None


def capture_rng_state() -> dict[str, Any]:
    """Return this process's Python, NumPy, torch CPU and accelerator RNG states as JSON data."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch_cpu": _encode(torch.get_rng_state()),
    }
    with contextlib.suppress(ImportError):
        import numpy as np  # defers numpy

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": keys.tolist(), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached": float(cached)}
    acc = _accelerator()
    if acc is not None:
        state["accelerator"] = {"type": acc.__name__.rsplit(".", 1)[-1],
                                "states": [_encode(s) for s in acc.get_rng_state_all()]}
    return state


def check_rng_state(state: Any) -> None:
    """Raise ValueError unless ``state`` (read from a checkpoint) is what ``capture_rng_state`` writes.

    Each stream is set on a throwaway generator, so a damaged or forged file is refused before any
    of this process's streams change.
    """
    try:
        py = state["python"]
        random.Random().setstate((py["version"], tuple(py["state"]), py["gauss"]))
        torch.Generator().set_state(_decode(state["torch_cpu"]))
        if "numpy" in state:
            with contextlib.suppress(ImportError):
                import numpy as np  # defers numpy

                n = state["numpy"]
                np.random.RandomState().set_state((n["kind"], np.array(n["keys"], dtype=np.uint32),
                                                   n["pos"], n["has_gauss"], n["cached"]))
        saved = state.get("accelerator")
        if saved is not None:
            for s in saved["states"]:
                _decode(s)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError, AttributeError) as e:
        raise ValueError(f"not a saved RNG state ({type(e).__name__}: {e})") from None


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every RNG stream captured by ``capture_rng_state`` back to the saved point."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    torch.set_rng_state(_decode(state["torch_cpu"]))
    if "numpy" in state:
        with contextlib.suppress(ImportError):
            import numpy as np  # defers numpy

            n = state["numpy"]
            np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"],
                                 n["has_gauss"], n["cached"]))
    acc = _accelerator()
    saved = state.get("accelerator")
    # Restore only onto the same kind and count of devices: a stream cannot be mapped elsewhere.
    if acc is not None and saved and len(saved["states"]) == acc.device_count():
        acc.set_rng_state_all([_decode(s) for s in saved["states"]])
