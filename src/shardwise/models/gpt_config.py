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
    # Mixture of experts (``shardwise.models.moe``). n_experts = 0: every block dense.
    n_experts: int = 0
    moe_top_k: int = 2  # experts per token (softmax top-k router)
    moe_every: int = 1  # every k-th block is MoE (blocks k-1, 2k-1, ...); 1: all of them
    moe_shared_experts: int = 0  # always-on experts beside the routed ones (DeepSeek/Qwen2-MoE style)
    moe_hidden: int = 0  # hidden width of one expert; 0: 4 x n_embd (the dense MLP's)
    moe_norm_topk: bool = True  # renormalise the k routing weights to sum to 1 (Mixtral)
    moe_aux_coef: float = 0.01  # load-balancing loss coefficient (Switch/Mixtral), 0: off
    moe_z_coef: float = 0.001  # router z-loss coefficient (ST-MoE), 0: off

    @property
    def expert_hidden(self) -> int:
        return self.moe_hidden or 4 * self.n_embd

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` holds a mixture of experts instead of the dense MLP."""
        return self.n_experts > 0 and i % self.moe_every == self.moe_every - 1

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes. "lab" is the seed lab's model (6 layers, 6 heads, 384 wide, context 256);
# "tiny" is the default demo, sized so 2 CPU processes reach val loss < 2.0 in a few minutes.
GPT_PRESETS: dict[str, GPTConfig] = {
    "nano": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    "tiny": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256),
    "lab": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    # Mixture of experts: "moe-nano" for tests, "moe-lab" the lab size with 8 experts, top-2 (its
    # experts are as wide as lab's MLP, so it has ~8x lab's MLP parameters at ~2x its MLP FLOPs).
    "moe-nano": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, n_experts=4, moe_top_k=2,
                          moe_hidden=64),
    "moe-lab": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384, n_experts=8, moe_top_k=2),
}


def gpt_param_count(cfg: GPTConfig) -> int:
    """Exact number of parameters of ``GPT(cfg)`` (checked against the module in tests)."""
    c, v, t, layers = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    b = 1 if cfg.bias else 0
    attn = (
        2 * (c + b * c)  # two LayerNorms
        + 4 * (c * c + b * c)  # q, k, v, o projections
    )
    total = v * c + t * c + (c + b * c) + c * v
    for i in range(layers):
        total += attn + (moe_block_params(cfg)[0] if cfg.is_moe_block(i) else
                         (c * 4 * c + b * 4 * c) + (4 * c * c + b * c))  # MLP up and down
    return total


def moe_block_params(cfg: GPTConfig) -> tuple[int, int]:
    """(total, active per token) parameters of one MoE feed-forward: router, experts, shared."""
    c, h, e = cfg.n_embd, cfg.expert_hidden, cfg.n_experts
    b = 1 if cfg.bias else 0
    expert = 2 * c * h
    # The shared experts are one MLP of width s * h (models/moe.py SharedExperts): one output bias.
    hs = cfg.moe_shared_experts * h
    shared = (c * hs + b * hs) + (hs * c + b * c) if hs else 0
    return c * e + e * expert + shared, c * e + cfg.moe_top_k * expert + shared


def gpt_active_param_count(cfg: GPTConfig) -> int:
    """Parameters one token passes through (all of them for a dense GPT; top-k experts for MoE)."""
    total, active = moe_block_params(cfg) if cfg.n_experts else (0, 0)
    n_moe = sum(cfg.is_moe_block(i) for i in range(cfg.n_layer))
    return gpt_param_count(cfg) - n_moe * (total - active)


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
                 *linear("attn.v_proj", c, c), *linear("attn.o_proj", c, c), *norm("ln_2")]
        if cfg.is_moe_block(i):
            h, hs = cfg.expert_hidden, cfg.expert_hidden * cfg.moe_shared_experts
            block += [("mlp.router.weight", (cfg.n_experts, c)), ("mlp.experts.w_in", (cfg.n_experts, c, h)),
                      ("mlp.experts.w_out", (cfg.n_experts, h, c))]
            if hs:
                block += [*linear("mlp.shared.fc", hs, c), *linear("mlp.shared.proj", c, hs)]
        else:
            block += [*linear("mlp.fc", 4 * c, c), *linear("mlp.proj", c, 4 * c)]
        out += [(pre + name, shape) for name, shape in block]
    return out + [*norm("ln_f"), *linear("lm_head", v, c, bias=False)]


def gpt_flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 * N (matmul params) plus the attention term 12 * L * C * T.

    Convention (PaLM appendix B / nanoGPT ``estimate_mfu``): forward + backward = 3 x forward,
    a multiply-add is 2 FLOPs, embedding look-ups are free, and the attention score and value
    products are counted in full (no halving for the causal mask).
    """
    t = seq_len or cfg.block_size
    # MoE: only the experts a token is routed to do work, so FLOPs follow the active parameters.
    n_matmul = gpt_active_param_count(cfg) - cfg.vocab_size * cfg.n_embd - cfg.block_size * cfg.n_embd
    return 6.0 * n_matmul + 12.0 * cfg.n_layer * cfg.n_embd * t
