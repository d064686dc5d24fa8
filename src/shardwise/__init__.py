"""shardwise: take a PyTorch training job from one process to many.

The public API for your own training loop is :class:`Session`; ``shardwise train`` is the same
loop packaged as a command.
"""

from shardwise.errors import CheckpointError, ConfigError, ShardwiseError

__version__ = "0.1.0"


def __getattr__(name: str):  # Lazy: `import shardwise` must not import torch.distributed eagerly.
    if name == "Session":
        from shardwise.runtime.session import Session  # defers torch

        return Session
    raise AttributeError(name)


__all__ = ["CheckpointError", "ConfigError", "Session", "ShardwiseError", "__version__"]
