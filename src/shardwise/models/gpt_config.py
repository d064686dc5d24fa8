"""GPTConfig and the named GPT sizes, without importing torch (the planner reads them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 256  # context length in tokens
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes. "lab" is the seed lab's model (6 layers, 6 heads, 384 wide, context 256);
# "tiny" is the default demo, sized so 2 CPU processes reach val loss < 2.0 in a few minutes.
GPT_PRESETS: dict[str, GPTConfig] = {
    "nano": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    "tiny": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256),
    "lab": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
}
