"""DDP on 2 ranks with per-rank batch B equals one process with batch 2B.

Tolerance (float32): per-step losses within 1e-5 absolute, final parameters within 1e-5 absolute.
The only difference is summation order in the gradient all-reduce (ulp-level), which AdamW's
normalised update keeps at that scale over 5 steps.
"""

import torch

from shardwise.testing import run_distributed
from tests.helpers.dist import train_losses

LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-5


def _assert_parity(ref: dict, got: dict) -> None:
    assert len(ref["losses"]) == len(got["losses"]) >= 5
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) < LOSS_ATOL, f"step {step}: reference {a} vs strategy {b}"
    for name, p in ref["params"].items():
        diff = (p - got["params"][name]).abs().max().item()
        assert diff < PARAM_ATOL, f"{name}: max abs diff {diff}"


def test_ddp_matches_single_process():
    ref = train_losses(0, 1, strategy="single", global_batch=8)
    ranks = run_distributed(train_losses, 2, strategy="ddp", global_batch=8)
    _assert_parity(ref, ranks[0])
    # Replicas stay identical.
    for name, p in ranks[0]["params"].items():
        assert torch.equal(p, ranks[1]["params"][name])


def test_ddp_accumulation_matches_and_syncs_once_per_step():
    ref = train_losses(0, 1, strategy="single", global_batch=8)
    ranks = run_distributed(train_losses, 2, strategy="ddp", global_batch=8, accum=2,
                            count_allreduce=True)
    _assert_parity(ref, ranks[0])
    # The model fits one DDP bucket: exactly one gradient all-reduce per optimizer step,
    # none on the first (no_sync) micro-batch.
    assert ranks[0]["allreduce_per_step"] == [1] * 5
