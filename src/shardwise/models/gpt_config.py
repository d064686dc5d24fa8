"""The built-in GPT's configuration, named sizes and arithmetic (parameters, FLOPs), without torch.

``shardwise.models.gpt`` builds the module; the planner reads this module to size the same model
without importing torch. ``gpt_param_shapes`` lists the parameters in the module's registration
order (checked against the module in the tests).
"""

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


def gpt_param_count(cfg: GPTConfig) -> int:
    """Exact number of parameters of ``GPT(cfg)`` (checked against the module in tests)."""
    c, v, t, layers = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    b = 1 if cfg.bias else 0
    per_block = (
        2 * (c + b * c)  # two LayerNorms
        + 4 * (c * c + b * c)  # q, k, v, o projections
        + (c * 4 * c + b * 4 * c) + (4 * c * c + b * c)  # MLP up and down
    )
    return v * c + t * c + layers * per_block + (c + b * c) + c * v


def gpt_param_shapes(cfg: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of ``GPT(cfg)``, in ``named_parameters()`` order."""
    c, v = cfg.n_embd, cfg.vocab_size

    def linear(name: str, n_out: int, n_in: int, bias: bool = cfg.bias) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (n_out, n_in))] + ([(f"{name}.bias", (n_out,))] if bias else [])

    def norm(name: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{name}.weight", (c,))] + ([(f"{name}.bias", (c,))] if cfg.bias else [])

    out: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (v, c)), ("pos_emb.weight", (cfg.block_size, c))]
    for i in range(cfg.n_layer):
        pre = f"blocks.{i}."
        block = [*norm("ln_1"), *linear("attn.q_proj", c, c), *linear("attn.k_proj", c, c),
                 *linear("attn.v_proj", c, c), *linear("attn.o_proj", c, c), *norm("ln_2"),
                 *linear("mlp.fc", 4 * c, c), *linear("mlp.proj", c, 4 * c)]
        out += [(pre + name, shape) for name, shape in block]
    return out + [*norm("ln_f"), *linear("lm_head", v, c, bias=False)]


def gpt_flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 * N (matmul params) plus the attention term 12 * L * C * T.

    Convention (PaLM appendix B / nanoGPT ``estimate_mfu``): forward + backward = 3 x forward,
    a multiply-add is 2 FLOPs, embedding look-ups are free, and the attention score and value
    products are counted in full (no halving for the causal mask).
    """
    t = seq_len or cfg.block_size
    n_matmul = gpt_param_count(cfg) - cfg.vocab_size * cfg.n_embd - cfg.block_size * cfg.n_embd
    return 6.0 * n_matmul + 12.0 * cfg.n_layer * cfg.n_embd * t
