"""A user's own model and data, as ``model.factory`` / ``data.factory`` targets of the tests.

Referenced from TOML as ``"tests.helpers.models:build_mlp"`` (the repo root is on PYTHONPATH in
``cli_env``), and imported directly by in-process tests.
"""

from __future__ import annotations

import torch


class MLPBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class ResidualMLP(torch.nn.Module):
    """A classifier that is not a GPT: input projection, repeated blocks, output head."""

    def __init__(self, n_in: int = 12, width: int = 32, depth: int = 3, n_classes: int = 5) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(n_in, width)
        self.layers = torch.nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build_mlp(**kwargs) -> torch.nn.Module:
    """model.factory for the custom-model verify test."""
    return ResidualMLP(**kwargs)


def build_blobs() -> tuple:
    """data.factory for the custom-model verify test: (train, val) random classification sets."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 12, generator=g)
    y = (x[:, :5].argmax(dim=1) + (x[:, 5] > 0).long()) % 5
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.Subset(ds, range(448)), torch.utils.data.Subset(ds, range(448, 512))


def build_mlp_not_on_meta(**kwargs) -> torch.nn.Module:
    """A model.factory that, like one filling weights from numpy, cannot run on the meta device."""
    if torch.empty(0).device.type == "meta":
        raise RuntimeError("this factory needs real tensors")
    return ResidualMLP(**kwargs)


def build_mlp_refusing_at_scale(**kwargs) -> torch.nn.Module:
    """A model.factory with a planted scale-only defect: a rule only a run above 8 ranks meets (the
    preflight's meta build, which has no process group, and every small test run pass it)."""
    import torch.distributed as dist

    from shardwise.errors import ConfigError

    if dist.is_initialized() and dist.get_world_size() > 8:
        raise ConfigError(f"planted defect: this model refuses world size {dist.get_world_size()} (> 8).")
    return ResidualMLP(**kwargs)


class ForgetfulDataset(torch.utils.data.Dataset):
    """A planted defect for ``verify --resume``: what item i holds depends on how many items this
    process has read, so a resumed process (which starts counting at 0) reads other data than the
    uninterrupted run from the first step after the resume on."""

    def __init__(self, base: torch.utils.data.Dataset) -> None:
        self.base = base
        self.reads = 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):  # noqa: ANN204
        self.reads += 1
        return self.base[(i + self.reads) % len(self.base)]


def build_forgetful_blobs() -> tuple:
    """data.factory whose training set does not resume where it stopped (see ForgetfulDataset)."""
    train, val = build_blobs()
    return ForgetfulDataset(train), val
