"""Another stack's pipeline stage split (issue 32): nanotron balances its stages by an estimated cost
per block, so the stage holding the head gets fewer blocks (``plan --stack-set pp_split=cost``).
The split against a hand computation, the layout's checks, and the planner using it. Pure
arithmetic, one process.
"""

from __future__ import annotations

import pytest

from shardwise.core.layout import Layout
from shardwise.errors import ConfigError
from shardwise.plan import cli as plan_cli
from shardwise.plan.cost import hardware_flops_per_token, stage_imbalance
from shardwise.plan.memory import Kernels
from shardwise.plan.pipeline import cost_balanced_stage_layers
from shardwise.plan.search import searched
from shardwise.plan.spec import ModelSpec, from_hf_config_dict
from tests.test_plan_grid import plan_args

# nanotron's 1.34B of the Ultrascale Playbook: a block costs 4 x 2048^2 + 3 x 8192 x 2048 = 2^26,
# the head 131072 x 2048 = 2^28, four blocks: 20 blocks' worth in all.
SMALL = from_hf_config_dict({"model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048,
                             "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192,
                             "vocab_size": 131072, "max_position_embeddings": 4096,
                             "tie_word_embeddings": True}, "nanotron-1.34b")


def test_cost_split_by_hand():
    # pp 2: shares of 10 and 20 blocks; the 11th block takes the running total past 10 and stays on
    # stage 0; stage 1 gets the other 5 and the head (9 blocks' worth).
    assert cost_balanced_stage_layers(SMALL, 2) == (11, 5)
    # pp 4: shares 5, 10, 15, 20: blocks 1-6, 7-11, 12-16, and the last stage only the head.
    assert cost_balanced_stage_layers(SMALL, 4) == (6, 5, 5, 0)
    # 16 stages of 16 blocks cannot all work: the cost split leaves one empty, and says so.
    with pytest.raises(ConfigError, match="leaves a stage without work"):
        cost_balanced_stage_layers(SMALL, 16)
    with pytest.raises(ConfigError, match="needs .*shape"):
        cost_balanced_stage_layers(ModelSpec(name="bare", n_params=10**9, n_layers=16), 2)


def test_layout_takes_an_explicit_split_and_checks_it():
    lay = Layout.external_stack("zero1+pp", "zero1", dp=2, pp=2, stage_layers=(11, 5)).with_blocks(16)
    assert lay.rank_layers(0) == list(range(11)) and lay.rank_layers(1) == list(range(11, 16))
    for sizes, words in (((10, 5), "holds 15 blocks; the model has 16"), ((16,), "give 2 block counts"),
                         ((8, 0, 8), "give 2 block counts")):
        with pytest.raises(ConfigError, match=words):
            Layout.external_stack("zero1+pp", "zero1", dp=2, pp=2, stage_layers=sizes).with_blocks(16)
    with pytest.raises(ConfigError, match="needs a block"):
        Layout.external_stack("zero1+pp", "zero1", dp=1, pp=3, stage_layers=(8, 0, 8)).with_blocks(16)
    with pytest.raises(ConfigError, match="both set the stage sizes"):
        Layout.external_stack("zero1+pp", "zero1", dp=2, pp=2, stage_layers=(11, 5), pp_first_stage_fewer=1)
    # Without a pipeline there is nothing to split.
    assert Layout("fsdp", dp=2, stage_layers=(16,)).stage_layers == ()


def test_kernels_name_the_allowed_splits():
    with pytest.raises(ConfigError, match="pipeline stage split"):
        Kernels(pp_split="even")


def test_planner_uses_the_stack_split_and_prints_no_command():
    args = ("--model", "llama-3-8b", "--gpu", "h100", "--gpus-per-node", "8", "--nodes", "2", "--tp", "1",
            "--pp", "2", "--seq", "8192", "--global-batch", "64", "--micro-batch", "1", "--checkpoint", "full")
    plan = plan_cli.build_plan(plan_args(*args, "--stack-set", "pp_split=cost"))
    best = plan.recommended
    assert best is not None
    spec = plan.spec
    # llama-3-8b: a block 4 x 4096^2 + 3 x 14336 x 4096, the head 128256 x 4096 (2.16 blocks):
    # shares of 17.08 and 34.16 blocks, so stage 0 keeps 18.
    assert best.layout.stage_layers == cost_balanced_stage_layers(spec, 2) == (18, 14)
    # The step follows the busier rank: 18 blocks, or 14 blocks and the head (6 h V FLOPs a token).
    total = hardware_flops_per_token(spec, 8192, "full")
    head = 6.0 * 4096 * 128256
    block = (total - head) / 32
    assert "pp_first_stage_fewer" not in searched(plan.workload)  # the stack's split, not searched
    busiest = max(18 * block, 14 * block + head)
    assert stage_imbalance(spec, best.layout, 8192, "full") == pytest.approx(2 * busiest / total)
    # shardwise's train splits by block count: no command for this split, and the warning says why.
    assert not plan.commands and any("pp_split=cost" in w for w in plan.warnings), plan.warnings
    assert plan_cli.run_prediction(plan) is None
    # The runtime's split (the default) and an explicit end-stage lightening stay as they were.
    plain = plan_cli.build_plan(plan_args(*args))
    assert plain.recommended is not None and plain.recommended.layout.stage_layers == () and plain.commands
    with pytest.raises(ConfigError, match="both set the pipeline stage sizes"):
        plan_cli.build_plan(plan_args(*args, "--pp-first-stage-fewer", "1", "--stack-set", "pp_split=cost"))
