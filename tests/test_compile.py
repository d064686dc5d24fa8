"""``train.compile``: per-block torch.compile (CPU inductor) under the session path, the composed
path and pipeline stages matches eager single-process training; ``shardwise verify`` passes with
compile on; a machine without a C compiler is refused before launch.

Tolerance (float32, 2 AdamW steps at lr=1e-3, nano GPT): losses within 1e-5, parameters within
5e-5 absolute. Inductor fuses element-wise ops and may reorder reductions, so compiled and eager
runs differ by rounding only (measured: losses <= 5e-7, parameters <= 7e-6). A real defect (a
gradient not synchronised, a block left out of its FSDP unit, a stage not compiled consistently)
moves a weight by O(lr) = 1e-3 in two steps, 20x above the bound.
"""

import sys

import pytest
import torch

from shardwise.core.config import ParallelConfig
from shardwise.core.layout import resolve_layout
from shardwise.errors import ConfigError
from shardwise.parallel.compile import check_compile
from shardwise.parallel.implementations import get_strategy
from shardwise.testing import run_command, run_distributed
from tests.helpers.mp import merged_params, mp_cases, mp_train

LOSS_ATOL, PARAM_ATOL = 1e-5, 5e-5
# fsdp: the Session compiles each checkpointed block before fully_shard; fsdp+tp: the composed
# apply compiles after TP; pp: each stage's blocks are compiled before the pipeline wraps them.
CASES = [dict(strategy="fsdp", activation_checkpointing="full"), dict(strategy="fsdp+tp", tp=2),
         dict(strategy="pp", pp=2)]


def test_compiled_blocks_match_eager_single_process_under_fsdp_tp_and_pp():
    ref = mp_train(0, 1, "single", steps=2)
    cases = [dict(case, steps=2, compile=True) for case in CASES]
    ranks = run_distributed(mp_cases, 2, timeout_s=900, cases=cases)
    for i, case in enumerate(CASES):
        results = [r[i] for r in ranks]
        # Every block of every rank really was compiled (pp: one block per stage).
        n_layer = 2
        assert sum(r["compiled_blocks"] for r in results) == (n_layer if case["strategy"] == "pp"
                                                               else 2 * n_layer), case
        for r in results:
            for step, (a, b) in enumerate(zip(ref["losses"], r["losses"], strict=True)):
                assert abs(a - b) < LOSS_ATOL, f"{case}: step {step}: eager {a} vs compiled {b}"
        got = merged_params(results)
        # Checkpoint and verify names stay the plain model's (no "_orig_mod." segment).
        assert set(got) == set(ref["params"]), case
        for name, p in ref["params"].items():
            diff = (p - got[name]).abs().max().item()
            assert diff < PARAM_ATOL, f"{case}: {name}: max abs diff {diff}"


def test_verify_passes_with_compile_on(tmp_path, cli_env):
    # The strategy run compiles; verify's single-process reference runs eager.
    proc = run_command([sys.executable, "-m", "shardwise", "verify", "--strategy", "ddp", "--nproc", "2",
                        "--steps", "2", "--set", "model.preset=nano", "--set", "train.compile=true",
                        "--set", "train.micro_batch_size=4", "--set", "train.eval_batches=1",
                        "--out", str(tmp_path / "v")], env=cli_env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "PASS"


def test_compile_without_a_c_compiler_is_refused(monkeypatch):
    options = ParallelConfig(strategy="ddp")
    strategy = get_strategy(resolve_layout(options, 2))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="needs a C/C..? compiler.*train.compile = false"):
        check_compile(strategy, options, "cpu")
    check_compile(strategy, options, "cuda")  # CUDA kernels come from Triton, not a host C compiler


def test_tensor_parallel_with_activation_checkpointing_is_refused_before_launch(cli_env):
    # torch 2.13 cannot compile a checkpointed TP block (AOT autograd asserts on the saved
    # DeviceMesh); the refusal comes from the launcher, before any rank starts.
    proc = run_command([sys.executable, "-m", "shardwise", "train", "--strategy", "fsdp+tp", "--nproc", "2",
                        "--set", "parallel.tp=2", "--set", "parallel.activation_checkpointing=full",
                        "--set", "train.compile=true", "--set", "model.preset=nano", "--dry-run"],
                       env=cli_env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "train.compile = true cannot run under strategy 'fsdp+tp'" in proc.stderr
    assert "Traceback" not in proc.stderr
    ok = run_command([sys.executable, "-m", "shardwise", "train", "--strategy", "fsdp+tp", "--nproc", "2",
                      "--set", "parallel.tp=2", "--set", "train.compile=true", "--set", "model.preset=nano",
                      "--dry-run"], env=cli_env, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_apply_compile_wraps_each_block_and_keeps_names():
    from shardwise.models.gpt import GPT, GPT_PRESETS
    from shardwise.models.names import clean_name
    from shardwise.parallel.checkpointing import apply_activation_checkpointing
    from shardwise.parallel.compile import apply_compile

    model = GPT(GPT_PRESETS["nano"])
    names = [n for n, _ in model.named_parameters()]
    model = apply_compile(apply_activation_checkpointing(model, "full"))
    blocks = list(model.blocks.values())
    assert len(blocks) == 2 and all(hasattr(b, "_orig_mod") for b in blocks)
    assert [clean_name(n) for n, _ in model.named_parameters()] == names
    apply_compile(model)  # idempotent: already compiled blocks are left alone
    assert list(model.blocks.values()) == blocks
    # Compiled after activation checkpointing: the compiled module holds the checkpoint wrapper.
    assert all(isinstance(b._orig_mod._checkpoint_wrapped_module, torch.nn.Module) for b in blocks)


def test_the_compiled_losss_backward_writes_a_new_gradient_of_the_logits():
    """The planner's "compiled" loss (plan.memory.Kernels, plan.predict.loss_kernels) rests on what
    inductor makes of the runtime's loss: its forward keeps the 16-bit logits and per-token
    statistics (no fp32 copy of the logits), and its backward returns a new 16-bit buffer of the
    logits' shape rather than writing in place (so the loss's backward holds both). Read from the
    generated code; a torch that changes it changes the plan's "logits gradient" term."""
    from torch._inductor.utils import run_and_get_code

    from shardwise.workloads import cross_entropy_loss

    tokens, vocab = 64, 256
    logits = torch.randn(2, tokens // 2, vocab, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (2, tokens // 2))
    loss_fn = torch.compile(cross_entropy_loss)

    def step() -> None:
        loss_fn(logits, target).backward()

    torch._dynamo.reset()
    _, (forward, backward) = run_and_get_code(step)
    buffers = [line for line in forward.splitlines() if "empty_strided" in line and "= empty_strided" in line]
    assert buffers and not any(f"({tokens}, {vocab})" in b for b in buffers), buffers  # no logits-sized copy kept
    assert any(f"({tokens}, {vocab})" in line and "torch.bfloat16" in line and "= empty_strided" in line
               for line in backward.splitlines()), backward
