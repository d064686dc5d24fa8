"""Every sharding strategy trains the same model as one process (fp32, accumulation, AC, bf16).

One spawn per world size runs all cases back to back (spawning ranks dominates the cost on CPU).
Each case: GPT "nano", AdamW lr=1e-3 (see COMMON: zero-gradient parameters amplify rounding noise
to ~lr per step), 5 optimizer steps, global batch 8, every rank reads its slice.

Tolerances (absolute) against the single-process reference:
* fp32 (the model in float64): per-step losses and final parameters within 1e-9. Only summation
  order differs (reduce-scatter vs all-reduce vs local sum, sharded gradient norms); float64 keeps
  what AdamW makes of that noise ~1e-10 per step on any machine (``shardwise.testing.default_dtype``),
  while a defect moves a parameter by O(lr) = 1e-3.
* bf16-mixed / fp16-mixed: losses within 1e-3, parameters within 2e-2, against the reference in the
  same precision. FSDP2's MixedPrecisionPolicy runs every op of a unit in low precision while
  torch.autocast keeps some (layer norms, softmax) in fp32, so the two round differently; observed
  ~8e-5 on losses and ~5e-3 on parameters (attention key biases, the zero-gradient ones).
"""

import pytest

from shardwise.testing import run_distributed
from tests.helpers.sharding import train, train_cases

FP32_LOSS_ATOL = FP32_PARAM_ATOL = 1e-9
MIXED_LOSS_ATOL, MIXED_PARAM_ATOL = 1e-3, 2e-2
SHARDED = ["zero1", "zero2", "fsdp", "fsdp-offload"]
# FSDP units of the 2-block nano GPT with wrap="block" that hold parameters: the embeddings, two
# blocks, the final norm + head (torchtitan's units; the root keeps none, so reduces nothing).
NANO_UNITS = 4

CASES_2 = {
    **{f"{s}": dict(strategy=s, count_comms=True) for s in SHARDED},
    **{f"{s}-accum": dict(strategy=s, accum=2, count_comms=True) for s in SHARDED},
    **{f"{s}-ac": dict(strategy=s, ac="full") for s in SHARDED},
    "ddp-accum": dict(strategy="ddp", accum=2, count_comms=True),
    # parallel.grad_sync="microbatch": gradients reduced (kept sharded) after every micro-batch.
    "fsdp-accum-sync-microbatch": dict(strategy="fsdp", accum=2, count_comms=True, grad_sync="microbatch"),
    "fsdp-ac-selective": dict(strategy="fsdp", ac="selective", ac_every=2),
    "fsdp-wrap-model": dict(strategy="fsdp", wrap="model", count_comms=True),
    "fsdp-wrap-2": dict(strategy="fsdp", wrap="2", count_comms=True),
    "fsdp-bf16": dict(strategy="fsdp", precision="bf16-mixed"),
    "zero2-bf16-accum": dict(strategy="zero2", precision="bf16-mixed", accum=2),
    "fsdp-fp16": dict(strategy="fsdp", precision="fp16-mixed"),
}
# The full-precision cases run the model in float64 (the mixed ones keep their float32 master weights).
FP64 = {"dtype": "float64"}
CASES_2 = {name: case if "precision" in case else {**case, **FP64} for name, case in CASES_2.items()}
CASES_4 = {
    "hsdp": dict(strategy="hsdp", hsdp_shard_size=2, count_comms=True),
    "hsdp-accum": dict(strategy="hsdp", hsdp_shard_size=2, accum=2, count_comms=True),
    "hsdp-ac": dict(strategy="hsdp", hsdp_shard_size=2, ac="full"),
    "hsdp-bf16": dict(strategy="hsdp", hsdp_shard_size=2, precision="bf16-mixed"),
}


CASES_4 = {name: case if "precision" in case else {**case, **FP64} for name, case in CASES_4.items()}


@pytest.fixture(scope="module")
def references():
    return {p: train(0, 1, strategy="single", precision=p, **(FP64 if p == "fp32" else {}))
            for p in ("fp32", "bf16-mixed", "fp16-mixed")}


@pytest.fixture(scope="module")
def results_2():
    ranks = run_distributed(train_cases, 2, cases=list(CASES_2.values()), timeout_s=400)
    return {name: [r[i] for r in ranks] for i, name in enumerate(CASES_2)}


@pytest.fixture(scope="module")
def results_4():
    ranks = run_distributed(train_cases, 4, cases=list(CASES_4.values()), timeout_s=400)
    return {name: [r[i] for r in ranks] for i, name in enumerate(CASES_4)}


def _assert_parity(ref: dict, got: dict, loss_atol: float, param_atol: float) -> None:
    assert len(ref["losses"]) == len(got["losses"]) == 5
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"])):
        assert abs(a - b) <= loss_atol, f"step {step}: reference {a} vs strategy {b}"
    assert set(ref["params"]) == set(got["params"])
    for name, p in ref["params"].items():
        diff = (p.double() - got["params"][name].double()).abs().max().item()
        assert diff <= param_atol, f"{name}: max abs diff {diff}"


def _check(name: str, results: dict, references: dict) -> None:
    case = {**CASES_2, **CASES_4}[name]
    precision = case.get("precision", "fp32")
    tol = (FP32_LOSS_ATOL, FP32_PARAM_ATOL) if precision == "fp32" else (MIXED_LOSS_ATOL, MIXED_PARAM_ATOL)
    ranks = results[name]
    for got in ranks:  # every rank ends with the same full parameters
        _assert_parity(references[precision], got, *tol)


@pytest.mark.parametrize("name", list(CASES_2))
def test_parity_2_ranks(name, results_2, references):
    _check(name, results_2, references)


@pytest.mark.parametrize("name", list(CASES_4))
def test_hsdp_parity_4_ranks(name, results_4, references):
    _check(name, results_4, references)


def test_gradient_sync_once_per_optimizer_step(results_2, results_4):
    # DDP/zero1 (nano fits one bucket): one all-reduce per step, none on the no_sync micro-batch.
    assert results_2["ddp-accum"][0]["comms_per_step"] == [1] * 5
    assert results_2["zero1-accum"][0]["comms_per_step"] == [1] * 5
    # FSDP2: one reduce-scatter per unit per optimizer step, with or without accumulation, i.e. the
    # first of two micro-batches issues none.
    for s in ("zero2", "fsdp", "fsdp-offload"):
        assert results_2[s][0]["comms_per_step"] == [NANO_UNITS] * 5
        assert results_2[f"{s}-accum"][0]["comms_per_step"] == [NANO_UNITS] * 5
    assert results_4["hsdp-accum"][0]["comms_per_step"] == [NANO_UNITS] * 5
    # Unless asked to reduce every micro-batch (big models: no whole unsharded gradient is held).
    assert results_2["fsdp-accum-sync-microbatch"][0]["comms_per_step"] == [2 * NANO_UNITS] * 5


def test_wrap_unit_sets_the_number_of_fsdp_units(results_2):
    assert results_2["fsdp-wrap-model"][0]["comms_per_step"] == [1] * 5  # the root only
    # Both blocks together, the embeddings and the head (the root holds no parameters).
    assert results_2["fsdp-wrap-2"][0]["comms_per_step"] == [3] * 5
