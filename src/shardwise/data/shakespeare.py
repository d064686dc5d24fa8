"""Tiny Shakespeare as character-level next-token windows."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import Dataset

from shardwise.errors import ConfigError
from shardwise.fsutil import what_is


def bundled_text_path() -> Path:
    """Path of the copy of Tiny Shakespeare shipped inside the package."""
    return Path(str(resources.files("shardwise") / "data" / "tinyshakespeare.txt"))


class CharTokenizer:
    """Maps each distinct character of a corpus to an id (65 for Tiny Shakespeare)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class CharWindows(Dataset):
    """Windows of ``block_size`` tokens every ``stride`` tokens; item = (x, y shifted by one)."""

    def __init__(self, ids: torch.Tensor, block_size: int, stride: int) -> None:
        if len(ids) <= block_size:
            raise ConfigError(f"text of {len(ids)} characters is shorter than one window of {block_size}.")
        self.ids = ids
        self.block_size = block_size
        self.stride = stride
        self.n = (len(ids) - block_size - 1) // stride + 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def load_shakespeare(path: str, block_size: int, val_fraction: float
                     ) -> tuple[CharWindows, CharWindows, CharTokenizer]:
    """Return (train, val, tokenizer); the last ``val_fraction`` of the text is validation."""
    file = Path(path) if path else bundled_text_path()
    if not file.is_file():
        raise ConfigError(
            f"data file {str(file)!r} {what_is(file)}. Set data.path to a text file, or leave it "
            "empty to use the Tiny Shakespeare copy bundled with shardwise."
        )
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data file {str(file)!r} is not UTF-8 text (byte at position {e.start}); "
                          "data.kind = 'shakespeare' trains on a plain text file.") from None
    except OSError as e:
        raise ConfigError(f"cannot read data file {str(file)!r}: {e.strerror or e}.") from None
    tok = CharTokenizer(text)
    ids = torch.tensor(tok.encode(text), dtype=torch.long)
    cut = int(len(ids) * (1 - val_fraction))
    for part, size in (("training", cut), ("validation", len(ids) - cut)):
        if size <= block_size:
            raise ConfigError(
                f"{str(file)!r} has {len(ids)} characters; data.val_fraction = {val_fraction} leaves {size} for "
                f"{part}, fewer than one window of {block_size + 1} (block_size {block_size} + 1). Change "
                "data.val_fraction, use a longer text (data.path), or a smaller block_size.")
    # Half-overlapping training windows give twice the distinct samples at no cost; validation
    # windows do not overlap, so each character is scored once.
    train = CharWindows(ids[:cut], block_size, max(1, block_size // 2))
    val = CharWindows(ids[cut:], block_size, block_size)
    return train, val, tok
