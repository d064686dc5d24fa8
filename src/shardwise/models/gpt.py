"""A nanoGPT-style character GPT. Plain single-device code: it never knows it is distributed.

Parallelism is applied from outside (see ``shardwise.parallel``). Two choices here exist so that
outside code can do that without touching the model:

* attention uses separate ``q_proj``/``k_proj``/``v_proj`` and reshapes with ``-1`` heads, so a
  tensor-parallel plan can shard the projections column-wise and each rank simply sees fewer heads;
* blocks live in an ``nn.ModuleDict`` keyed "0".."n-1" and every top-level part may be ``None``,
  so a pipeline stage is this same class with the parts it does not own deleted, and parameter
  names (checkpoint keys) stay the same on every stage.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.gpt_config import (
    GPT_PRESETS,
    GPTConfig,
    gpt_flops_per_token,
    gpt_param_count,
    gpt_param_shapes,
)

# The configuration, presets and FLOP/parameter arithmetic live in a torch-free module, so the
# planner can size these models without importing torch.
from shardwise.models.masking import attention_mask_4d, real_token_mask, split_inputs
from shardwise.models.moe import MoE

__all__ = ["GPT", "GPT_PRESETS", "Block", "CausalSelfAttention", "GPTConfig", "MLP", "gpt_flops_per_token",
           "gpt_param_count", "gpt_param_shapes"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        # mask: (B, 1, T, T) document/padding mask (models.masking), causal already in it.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(bsz, seq, -1)
        return self.resid_drop(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: bool = False) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        # A mixture of experts in place of the MLP (cfg.n_experts > 0; see models/moe.py).
        self.mlp: nn.Module = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                real: torch.Tensor | None = None) -> torch.Tensor:
        # The mask goes by keyword: a sequence-parallel plan (PrepareModuleInput) gathers attn's one
        # positional input, the hidden states, and the whole-sequence mask passes through as it is.
        x = x + (self.attn(self.ln_1(x)) if mask is None else self.attn(self.ln_1(x), mask=mask))
        if real is not None and isinstance(self.mlp, MoE):
            # ``real``: the (B, T) real tokens, whose routing the MoE aux losses count (models/moe.py).
            # An argument, not state: activation checkpointing recomputes with the same inputs.
            return x + self.mlp(self.ln_2(x), real=real)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, cfg.is_moe_block(i)) for i in range(cfg.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation; residual projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "mlp.proj.weight", "experts.w_out", "shared.proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits of token ids ``(B, T)``, or of a mapping with ``input_ids`` and optionally
        ``position_ids``/``doc_ids``/``attention_mask`` (packed or padded rows, see models.masking)."""
        idx, extra = split_inputs(idx)
        mask = attention_mask_4d(extra) if extra else None
        # Padding to leave out of the routers' balance: with a mask, or (a cp chunk) ``real_tokens``.
        real = real_token_mask(extra) if self.config.n_experts else None
        # A pipeline stage without the embeddings receives hidden states instead of token ids.
        if self.tok_emb is not None:
            seq = idx.shape[1]
            if seq > self.config.block_size:
                raise ValueError(f"sequence of {seq} tokens exceeds block_size {self.config.block_size}")
            pos = extra.get("position_ids")
            if pos is None:
                pos = torch.arange(seq, device=idx.device)
            h = self.tok_emb(idx)
            if self.pos_emb is not None:
                h = h + self.pos_emb(pos)
            h = self.drop(h)
        else:
            h = idx
        for block in self.blocks.values():
            h = block(h) if mask is None and real is None else block(h, mask) if real is None else block(h, mask, real)
        if self.ln_f is not None:
            h = self.ln_f(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Return ``idx`` extended by ``max_new_tokens`` sampled tokens (single-device model)."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size:]
            logits = self(ctx)[:, -1, :] / max(temperature, 1e-5)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
