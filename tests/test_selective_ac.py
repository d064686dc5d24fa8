"""Op-level selective activation checkpointing (``parallel.activation_checkpointing = "selective-op"``).

torchtitan's per-op policy: keep attention and every other matmul output, recompute the rest. It
must be exact recomputation (identical gradients), work under the strategies that take
checkpointing, and keep what the planner says (tests/test_plan_measure.py measures the bytes).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from shardwise.core.config import AC_MODES, load_config
from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.checkpointing import SAC_MATMUL_OPS, apply_activation_checkpointing, op_sac_policy
from shardwise.testing import run_command


def _grads(model: torch.nn.Module, idx: torch.Tensor) -> list[torch.Tensor]:
    out = model(idx)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


def _tiny_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    from shardwise.models.hf import HFCausalLM

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                   max_position_embeddings=128, attn_implementation="sdpa")
    return HFCausalLM(transformers.LlamaForCausalLM(cfg))


@pytest.mark.parametrize("kind", ["gpt-dropout", "hf-llama"])
def test_selective_op_is_exact_recomputation(kind):
    """Gradients with the per-op policy equal those without checkpointing, bit for bit (dropout
    included: the recomputation replays the same RNG state)."""
    torch.manual_seed(0)
    if kind == "hf-llama":
        model, vocab = _tiny_llama(), 101
    else:
        model, vocab = GPT(GPTConfig(block_size=32, n_layer=3, n_head=2, n_embd=32, dropout=0.1)), 65
    wrapped = apply_activation_checkpointing(copy.deepcopy(model), "selective-op")
    idx = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    ref = _grads(model, idx)
    torch.manual_seed(2)
    got = _grads(wrapped, idx)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


def test_policy_keeps_every_other_matmul_in_forward_and_recomputation():
    """torchtitan's rule: the 1st, 3rd, ... matmul of a block is saved, the others recomputed, with
    separate counts for the forward and the recomputation so both make the same decisions."""
    from torch.utils.checkpoint import CheckpointPolicy

    class Ctx:
        def __init__(self, is_recompute: bool) -> None:
            self.is_recompute = is_recompute

    policy = op_sac_policy()
    mm = next(iter(SAC_MATMUL_OPS))
    decisions = {flag: [policy(Ctx(flag), mm) for _ in range(4)] for flag in (False, True)}
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert decisions[False] == decisions[True] == [save, recompute, save, recompute]
    assert policy(Ctx(False), torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) == save
    assert policy(Ctx(False), torch.ops.aten.gelu.default) == recompute


def test_mode_in_config_and_wrapping():
    assert "selective-op" in AC_MODES
    cfg = load_config(None, ["parallel.activation_checkpointing=selective-op", "model.preset=nano"])
    assert cfg.parallel.activation_checkpointing == "selective-op"
    with pytest.raises(ConfigError, match="selective-op"):
        load_config(None, ["parallel.activation_checkpointing=selective_op"])
    model = apply_activation_checkpointing(GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32)), "selective-op")
    assert all(hasattr(b, "_checkpoint_wrapped_module") for b in model.blocks.values())  # every block


def test_verify_selective_op_under_fsdp_tp_with_sequence_parallel(tmp_path, cli_env):
    """`shardwise verify` (fp32): fsdp+tp with sequence parallelism and per-op checkpointing
    reproduces the single-process run without checkpointing."""
    proc = run_command([sys.executable, "-m", "shardwise", "verify", "gpt-shakespeare", "--strategy", "fsdp+tp",
                        "--nproc", "2", "--steps", "3", "--set", "parallel.tp=2",
                        "--set", "parallel.sequence_parallel=true",
                        "--set", "parallel.activation_checkpointing=selective-op", "--set", "model.preset=nano",
                        "--set", "train.micro_batch_size=4",
                        # The recipe's warmup (verify defaults to none): the 1e-5 bound below is
                        # float summation-order noise at the warmup's small steps, which AdamW
                        # scales up to O(lr) per step at the peak rate.
                        "--set", "train.warmup_steps=30", "--out", str(tmp_path / "out")],
                       env=cli_env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "PASS"
    diff = next(line for line in proc.stdout.splitlines() if line.startswith("max |param diff|"))
    assert float(diff.split()[3]) <= 1e-5, diff  # exact recomputation: float summation-order noise only
