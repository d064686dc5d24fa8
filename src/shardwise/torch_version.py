"""The torch this project is tested on, and what an older one is known to break (one owner).

The suite runs on torch 2.13 (``scripts/bootstrap`` pins it). The first GPU machine had torch 2.11:
the CUDA steps of ``benchmarks/gpu.sh`` ran there after three fixes, but the CPU suite under 2.11
fails pipeline parallel (torch's stride check of a stage's inputs) and Muon under fsdp+tp (DTensor's
``_StridedShard``), in the part of the suite run under it (checkpoints, optimizers, MoE, composed
layouts). An older torch is not refused (single-GPU and FSDP runs worked on 2.11); the commands say
so once, naming what is known to fail.
"""

from __future__ import annotations

TESTED = (2, 13)
KNOWN_BROKEN_BEFORE_TESTED = ("pipeline parallel (parallel.pp > 1)", "Muon under fsdp+tp")


def _release(version: str) -> tuple[int, int]:
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def older_torch_note(version: str) -> str | None:
    """A one-line note when ``version`` (``torch.__version__``) is older than the tested one."""
    try:
        release = _release(version)
    except ValueError:
        return None
    if release >= TESTED:
        return None
    return (f"torch {version} is older than the {TESTED[0]}.{TESTED[1]} shardwise is tested on; known to fail "
            f"there: {', '.join(KNOWN_BROKEN_BEFORE_TESTED)} (pip install 'torch>={TESTED[0]}.{TESTED[1]}').")
