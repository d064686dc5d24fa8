"""The recommended commands for ten published configurations resolve as ``train --dry-run`` does.

The configurations are ``benchmarks/published_configs.py``'s (dense 8B/70B/405B, MoE Mixtral and
Qwen3-30B-A3B with expert parallel, long context at 32k and 128k with context parallel). Each is
planned with the CLI's arguments as a user gives them, and its recommended ``shardwise train``
command goes through the real CLI parser and ``job.train.resolve_run`` (config, layout, preflight on
the meta model) in-process; the resolved layout is the one the plan recommended, and the bytes per
rank ``--dry-run`` predicts from the meta model are the plan's, column for column. The rehearsal
half of the benchmark is not run here (minutes per configuration): docs/planner.md has its figures.
"""

from __future__ import annotations

import pytest

from tests.helpers.benchmarks import benchmark_module
from tests.test_plan_grid import plan_args

BENCH = benchmark_module("published_configs")
CONFIGS = BENCH.CONFIGS


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
    run, prediction = BENCH.dry_run(plan.commands[0])  # the real CLI parser and job.train.resolve_run
    degrees = ("strategy", "world_size", "tp", "pp", "cp", "ep", "dp_shard", "dp_replicate")
    assert [getattr(run.layout, d) for d in degrees] == [getattr(best, d) for d in degrees]
    # --dry-run's bytes per rank (from the meta model) are the plan's (from its spec), every column.
    planned = plan_cli.run_prediction(plan)
    columns = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "transient_bytes", "peak_bytes")
    assert [[getattr(r, k) for k in columns] for r in prediction.ranks] == \
        [[getattr(r, k) for k in columns] for r in planned.ranks]
