"""The recommended commands for ten published configurations resolve as ``train --dry-run`` does.

The configurations are ``benchmarks/published_configs.py``'s (dense 8B/70B/405B, MoE Mixtral and
Qwen3-30B-A3B with expert parallel, long context at 32k and 128k with context parallel). Each is
planned with the CLI's arguments as a user gives them, and its recommended ``shardwise train``
command goes through the real CLI parser and ``job.train.resolve_run`` (config, layout, preflight on
the meta model) in-process; the resolved layout is the one the plan recommended. The rehearsal
half of the benchmark is not run here (minutes per configuration): docs/planner.md has its figures.
"""

from __future__ import annotations

import pytest

from tests.helpers.benchmarks import benchmark_module
from tests.test_plan_grid import dry_run_train, plan_args

CONFIGS = benchmark_module("published_configs").CONFIGS


def test_ten_configurations_dense_moe_and_long_context():
    assert len(CONFIGS) == 10 and len({c.name for c in CONFIGS}) == 10
    models = {c.model for c in CONFIGS}
    assert {"mixtral-8x7b", "qwen3-30b-a3b"} <= models and {"llama-3-8b", "llama-3-70b", "llama-3-405b"} <= models
    assert sum(c.seq >= 32768 for c in CONFIGS) >= 3


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name.replace(" ", "-"))
def test_the_recommended_command_resolves_as_train_dry_run_does(config):
    from shardwise.plan import cli as plan_cli

    plan = plan_cli.build_plan(plan_args(*config.plan))
    assert plan.recommended is not None and plan.commands, (config.name, plan.warnings, plan.skipped[:3])
    best = plan.recommended.layout
    assert dry_run_train(plan.commands[0]) == (best.strategy, best.world_size)
