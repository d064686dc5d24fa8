"""A small CNN for CIFAR-10. Plain single-device code: it never knows it is distributed.

Normalisation is GroupNorm, never BatchNorm: BatchNorm's statistics come from the local batch, so
under data parallel each rank would normalise with statistics of its own slice, and N ranks x B/N
samples would not train like 1 process x B samples. GroupNorm normalises each sample on its own,
which keeps the data-parallel parity test exact.

The three stages live in an ``nn.ModuleList`` so that sharded strategies (and the planner) find
the repeated blocks the same way they find a transformer's layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError, did_you_mean

N_STAGES = 3  # each stage halves the resolution: 32 -> 16 -> 8 -> 4


@dataclass(frozen=True)
class CNNConfig:
    channels: int = 32  # width of the first stage; stage i has channels * 2**i
    hidden: int = 128  # width of the hidden layer of the classifier head
    num_classes: int = 10
    groups: int = 8  # GroupNorm groups; must divide every stage width
    in_channels: int = 3
    image_size: int = 32  # square input images; must be divisible by 2**n_stages

    @property
    def widths(self) -> list[int]:
        return [self.channels * 2**i for i in range(N_STAGES)]


def cnn_config(**overrides: Any) -> CNNConfig:
    """Return the default CNNConfig with ``overrides`` applied; unknown or bad values raise ConfigError."""
    valid = [f.name for f in dataclasses.fields(CNNConfig)]
    for key, value in overrides.items():
        if key not in valid:
            raise ConfigError(f"unknown model.overrides key {key!r} for the CNN.{did_you_mean(key, valid)} "
                              f"Valid: {', '.join(valid)}.")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 2**16:
            raise ConfigError(f"model.overrides.{key} must be a positive integer (at most 65536), got {value!r}.")
    cfg = CNNConfig(**overrides)
    if cfg.channels % cfg.groups:
        raise ConfigError(f"model.overrides: groups={cfg.groups} must divide channels={cfg.channels} "
                          "(GroupNorm splits each stage's channels into equal groups).")
    if cfg.image_size % 2**N_STAGES:
        raise ConfigError(f"model.overrides.image_size={cfg.image_size} must be divisible by {2**N_STAGES}: "
                          f"each of the {N_STAGES} stages halves the resolution.")
    return cfg


class ConvStage(nn.Module):
    """Two 3x3 conv + GroupNorm + ReLU layers, then a 2x2 max-pool (halves height and width)."""

    def __init__(self, c_in: int, c_out: int, groups: int) -> None:
        super().__init__()
        # No conv bias: the GroupNorm shift that follows makes it redundant.
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.norm1(self.conv1(x)))
        x = self.act(self.norm2(self.conv2(x)))
        return self.pool(x)


class CNN(nn.Module):
    """Images (B, 3, 32, 32) float -> class logits (B, num_classes)."""

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.config = cfg
        c_in = [cfg.in_channels, *cfg.widths[:-1]]
        self.stages = nn.ModuleList(ConvStage(a, b, cfg.groups) for a, b in zip(c_in, cfg.widths))
        # Global average pooling keeps the head independent of image size and small.
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(cfg.widths[-1], cfg.hidden), nn.ReLU(),
            nn.Linear(cfg.hidden, cfg.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def build_cnn(**overrides: Any) -> CNN:
    """Return a freshly initialised CNN (PyTorch default init, drawn from torch's global RNG)."""
    return CNN(cnn_config(**overrides))


def cnn_param_count(cfg: CNNConfig) -> int:
    """Exact number of parameters of ``CNN(cfg)`` (checked against the module in tests)."""
    c_in = [cfg.in_channels, *cfg.widths[:-1]]
    convs = sum(9 * a * b + 9 * b * b + 4 * b for a, b in zip(c_in, cfg.widths))  # + 2 GroupNorms
    head = cfg.widths[-1] * cfg.hidden + cfg.hidden + cfg.hidden * cfg.num_classes + cfg.num_classes
    return convs + head


def cnn_flops_per_sample(cfg: CNNConfig) -> float:
    """Training FLOPs per image: 3 x forward, a multiply-add counted as 2 FLOPs.

    Same convention as ``gpt_flops_per_token`` (backward = 2 x forward). Only convolutions and
    linear layers are counted; norms, activations and pooling are a rounding error next to them.
    """
    side, macs = cfg.image_size, 0
    c_in = [cfg.in_channels, *cfg.widths[:-1]]
    for a, b in zip(c_in, cfg.widths):
        macs += 9 * (a * b + b * b) * side * side  # both convs run at the stage's input resolution
        side //= 2
    macs += cfg.widths[-1] * cfg.hidden + cfg.hidden * cfg.num_classes
    return 3.0 * 2.0 * macs
