"""Reference implementations for ``shardwise bench``: the loops users would write without shardwise.

``torch-ddp`` (DistributedDataParallel), ``torch-fsdp2`` (per-block ``fully_shard``),
``accelerate`` (a plain Hugging Face Accelerate loop) and ``fabric`` (a plain Lightning Fabric
loop) train the same workload as shardwise's
strategies -- the same model, data order, seed, optimizer, schedule and clipping -- but nothing of
shardwise runs inside their step: each initialises its own process group, wraps the model itself
and writes its loop out. shardwise code is used only around the loop, to build the workload from
the same config and to measure memory with the same ledger. Each is a script run by torchrun:

    torchrun --nproc-per-node=2 -m shardwise.reference.torch_ddp RUN/config.toml --out RUN

and writes ``RUN/summary.json`` with the fields ``bench`` reads from a shardwise run.
"""

from __future__ import annotations

import importlib.util

from shardwise.core.config import RunConfig
from shardwise.errors import ConfigError

# name -> module run by torchrun
REFERENCES = {"torch-ddp": "shardwise.reference.torch_ddp",
              "torch-fsdp2": "shardwise.reference.torch_fsdp2",
              "accelerate": "shardwise.reference.accelerate_loop",
              "fabric": "shardwise.reference.fabric_loop"}
# shardwise strategy -> the plain loops it is compared with (overhead ratio in the bench table)
PAIRS = {"ddp": ("torch-ddp", "accelerate", "fabric"), "fsdp": ("torch-fsdp2",)}
PRECISIONS = ("fp32", "bf16-mixed")


def is_reference(name: str) -> bool:
    return name in REFERENCES


# reference -> (the library it needs, the shardwise extra that installs it)
LIBRARIES = {"accelerate": ("accelerate", "accelerate"), "fabric": ("lightning_fabric", "fabric")}


def installed(name: str) -> bool:
    """Whether the library reference ``name`` needs is importable (accelerate and fabric need one)."""
    return name not in LIBRARIES or importlib.util.find_spec(LIBRARIES[name][0]) is not None


def check_reference(name: str, cfg: RunConfig) -> None:
    """Raise ConfigError when reference ``name`` cannot run ``cfg`` as the shardwise runs would."""
    if name not in REFERENCES:
        raise ConfigError(f"unknown reference implementation {name!r}; valid: {', '.join(REFERENCES)}.")
    if not installed(name):
        library, extra = LIBRARIES[name]
        raise ConfigError(f"the {name!r} reference needs the {library} package: "
                          f"pip install 'shardwise[{extra}]' (or drop it from --strategies).")
    p = cfg.parallel
    unsupported = []
    if p.precision not in PRECISIONS:
        unsupported.append(f"parallel.precision={p.precision!r} (they run {' or '.join(PRECISIONS)})")
    if p.activation_checkpointing != "none":
        unsupported.append(f"parallel.activation_checkpointing={p.activation_checkpointing!r}")
    if p.tp > 1 or p.pp > 1:
        unsupported.append("tensor/pipeline parallel degrees (they are data parallel only)")
    if unsupported:
        raise ConfigError(f"the reference loop {name!r} does not implement {'; '.join(unsupported)}. "
                          "Compare those settings among shardwise strategies, or leave the references out.")
