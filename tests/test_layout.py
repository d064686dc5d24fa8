"""The layout owns every degree; the registry lists each strategy once; configs are never modified.

Pure tests, no process group. The 4-rank regression run (``pp`` with ``parallel.pp`` unset was
checked against 8 micro-batches but ran 2) shares a spawn in tests/test_composed.py.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from shardwise.core.config import ParallelConfig, load_config, replace_in
from shardwise.core.families import LLAMA_LIKE, MOE_FAMILIES
from shardwise.core.layout import Layout, resolve_layout, stage_layer_ranges
from shardwise.core.strategies import ALIASES, REGISTRY, strategy_info, strategy_names
from shardwise.errors import ConfigError
from shardwise.parallel.implementations import get_strategy


def test_layout_and_registry_import_without_torch(cli_env):
    code = ("import sys, shardwise.core.layout, shardwise.parallel, shardwise.core.strategies, shardwise.plan.advice, "
            "shardwise.core.config; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_registry_is_the_single_list_of_strategies():
    assert set(strategy_names()) == {*REGISTRY, *ALIASES, "auto"}
    from shardwise.parallel.implementations import IMPLEMENTATIONS

    for info in REGISTRY.values():
        impl = IMPLEMENTATIONS[info.impl]  # one implementation per data-parallel kind, no class per name
        assert impl.impl == info.impl, info.impl  # the class and its registry entry agree
        assert set(info.degrees) <= {"dp", "tp", "pp"} and info.dp_kind in ("replicate", "zero1", "zero2", "fsdp")
    # Which models each strategy runs: TP needs a plan, PP a stage split (GPT, Llama family, GPT-2).
    assert REGISTRY["fsdp+tp"].supports("llama") and REGISTRY["fsdp+tp"].supports("gpt2")
    # Mixture-of-experts families: TP for attention and dense parts (experts whole on each TP rank).
    assert REGISTRY["fsdp+tp"].supports("mixtral") and REGISTRY["fsdp+tp+pp"].supports("gpt2")
    assert REGISTRY["pp"].supports("gpt") and REGISTRY["ddp+pp"].supports("qwen3")
    assert REGISTRY["pp"].supports("gpt2") and REGISTRY["pp"].supports("mixtral")  # MoE: parallel/pipeline/hf_moe.py
    assert not REGISTRY["pp"].supports("")
    assert REGISTRY["fsdp"].supports("") and REGISTRY["fsdp+tp+pp"].families == ("gpt", *LLAMA_LIKE, "gpt2",
                                                                                  *MOE_FAMILIES)
    assert strategy_info("zero3").name == "fsdp"
    with pytest.raises(ConfigError, match="unknown strategy 'ddp\\+tp\\+pp'"):
        strategy_info("ddp+tp+pp")


@pytest.mark.parametrize("strategy, world, options, expected", [
    ("auto", 1, {}, dict(strategy="single", dp=1, shard=1, mesh_shape=(1,))),
    ("auto", 4, {}, dict(strategy="ddp", dp=4, dp_replicate=4, dp_shard=1, mesh_shape=(4,))),
    ("zero3", 4, {}, dict(strategy="fsdp", dp=4, dp_shard=4, dp_replicate=1)),
    ("zero1", 4, {}, dict(sharding="zero1", dp_replicate=4, dp_shard=1)),
    ("hsdp", 8, dict(hsdp_shard_size=4), dict(dp=8, dp_replicate=2, dp_shard=4, mesh_shape=(2, 4),
                                             mesh_dim_names=("replicate", "shard"))),
    ("fsdp-offload", 2, {}, dict(offload=True, dp_shard=2)),
    ("auto", 8, dict(tp=2), dict(strategy="fsdp+tp", dp=4, tp=2, mesh_shape=(1, 4, 2), dp_shard=4)),
    ("auto", 8, dict(pp=2), dict(strategy="ddp+pp", dp=4, pp=2, dp_replicate=4, pp_microbatches=4)),
    ("3d", 8, dict(tp=2, pp=2), dict(strategy="fsdp+tp+pp", dp=2, tp=2, pp=2, mesh_shape=(2, 2, 2))),
    ("pp", 4, dict(pp_schedule="interleaved-1f1b", pp_stages_per_rank=2, pp_microbatches=8),
     dict(pp=4, n_stages=8, pp_microbatches=8)),
])
def test_resolve_layout(strategy, world, options, expected):
    layout = resolve_layout(ParallelConfig(strategy=strategy, **options), world)
    for key, value in expected.items():
        assert getattr(layout, key) == value, key
    assert layout.world_size == world == layout.dp * layout.tp * layout.pp
    assert layout.dp_enabled == (layout.dp > 1) and layout.tp_enabled == (layout.tp > 1)


def test_hsdp_defaults_to_ranks_per_node():
    layout = resolve_layout(ParallelConfig(strategy="hsdp"), 8, ranks_per_node=4)
    assert (layout.dp_replicate, layout.dp_shard) == (2, 4)


@pytest.mark.parametrize("strategy, world, options, message", [
    ("single", 2, {}, "strategy 'single' runs one process"),
    ("ddp", 2, dict(tp=2), "is pure data parallel"),  # silently ignored before the layout owned it
    ("ddp", 4, dict(dp=2), "parallel.dp=2"),
    ("ddp", 2, dict(sequence_parallel=True), "sequence_parallel needs tensor parallel"),
    ("hsdp", 4, dict(hsdp_shard_size=3), "must divide the world size 4"),
    ("hsdp", 4, dict(hsdp_shard_size=8), "must divide the world size 4"),
    ("tp", 2, dict(pp=2), "parallel.pp=2 is set"),
    ("fsdp+tp", 6, dict(tp=4), "do not divide"),
    ("pp", 2, dict(pp_microbatches=1), "must be >= the pipeline degree 2"),
    ("pp", 2, dict(precision="fp16-mixed"), "fp16-mixed"),
])
def test_impossible_layouts_name_the_key(strategy, world, options, message):
    with pytest.raises(ConfigError, match=message):
        resolve_layout(ParallelConfig(strategy=strategy, **options), world)


def test_coords_follow_init_device_mesh_row_major_order():
    for layout in (resolve_layout(ParallelConfig(strategy="fsdp+tp+pp", tp=2, pp=2), 8),
                   resolve_layout(ParallelConfig(strategy="hsdp", hsdp_shard_size=2), 6)):
        # init_device_mesh lays ranks out as arange(world).view(mesh_shape).
        grid = torch.arange(layout.world_size).view(layout.mesh_shape)
        for rank in range(layout.world_size):
            where = (grid == rank).nonzero()[0].tolist()
            assert list(layout.coords(rank).values()) == where
    composed = resolve_layout(ParallelConfig(strategy="fsdp+tp", tp=2), 4)
    assert [composed.dp_coords(r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_stage_ranges_and_blocks_come_from_the_layout():
    layout = resolve_layout(ParallelConfig(strategy="pp", pp_schedule="interleaved-1f1b", pp_stages_per_rank=2,
                                           pp_microbatches=4), 2, n_blocks=8, block_path="blocks")
    assert [list(r) for r in layout.stage_ranges] == [list(r) for r in stage_layer_ranges(8, 4)]
    assert layout.stage_ids(1) == [1, 3] and layout.rank_layers(1) == [2, 3, 6, 7]
    assert layout.holds_first_stage(0) and layout.holds_last_stage(1) and not layout.holds_last_stage(0)
    with pytest.raises(ConfigError, match="exceed the model's 3 layers"):
        layout.with_blocks(3)
    assert "stage layers: 0-1 | 2-3 | 4-5 | 6-7" in layout.describe()


def test_end_stages_may_hold_no_layer_when_they_count_the_embedding_and_head():
    """``pp_first_stage_fewer = k`` gives the embedding and the head + loss k blocks' place each; an end
    stage may then hold no layer (the Llama 3 paper's 126 layers in 16 x 8 stages, Megatron's
    --account-for-embedding/loss-in-pipeline-split), a middle one never."""
    ranges = stage_layer_ranges(126, 128, 1)
    assert len(ranges[0]) == len(ranges[-1]) == 0 and all(len(r) == 1 for r in ranges[1:-1])
    assert [len(r) for r in stage_layer_ranges(94, 96, 1)] == [0] + [1] * 94 + [0]
    assert [list(r) for r in stage_layer_ranges(2, 4, 1)] == [[], [0], [1], []]
    assert [len(r) for r in stage_layer_ranges(10, 4, 1)] == [2, 3, 3, 2]  # unchanged where no end is empty
    with pytest.raises(ConfigError, match="the first and the last may hold none when parallel.pp_first_stage_fewer"):
        stage_layer_ranges(2, 4)  # without the setting every stage needs a layer
    with pytest.raises(ConfigError, match="exceed the model's 93 layers: each stage needs at least one layer, except"):
        stage_layer_ranges(93, 96, 1)  # a middle stage would be empty
    with pytest.raises(ConfigError, match="a stage would get -1 layers"):
        stage_layer_ranges(3, 4, 2)
    layout = resolve_layout(ParallelConfig(strategy="pp", pp_schedule="interleaved-1f1b", pp_stages_per_rank=2,
                                           pp_microbatches=4, pp_first_stage_fewer=1), 2, n_blocks=2,
                            block_path="blocks")
    assert layout.rank_layers(0) == [1] and layout.rank_layers(1) == [0]
    assert "stage layers: embedding | 0 | 1 | head" in layout.describe()


def test_layout_is_frozen_and_checked_when_built_directly():
    layout = Layout("fsdp", dp=8)
    assert layout.shard == 8 and layout.sharding == "fsdp"  # the strategy implies the shard group
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.dp = 2  # type: ignore[misc]
    with pytest.raises(ConfigError, match="unknown strategy"):
        Layout("ddp+tp+pp", dp=2, tp=2, pp=2)
    with pytest.raises(ConfigError, match="has no tp dimension"):
        Layout("ddp", dp=2, tp=2)
    with pytest.raises(ConfigError, match="shards model state across 1"):
        Layout("zero1", dp=4, shard=4)
    assert Layout("ddp+pp", dp=2, pp=4).pp_microbatches == 8  # unset: 2 x pp, as the runtime


def test_pipeline_batch_check_runs_before_launch():
    layout = resolve_layout(ParallelConfig(strategy="pp"), 4)
    layout.check_batch(16)
    with pytest.raises(ConfigError, match="per-rank batch of 6 samples .* 8 equal pipeline microbatches"):
        layout.check_batch(6)


# ------------------------------------------------------------------ configs are never modified
def test_config_objects_are_frozen_and_resolution_returns_new_ones():
    from shardwise.preflight import check_run

    cfg = load_config(None, ["model.preset=nano", "parallel.tp=2"])
    assert cfg.parallel.strategy == "auto"  # validate no longer rewrites it
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.strategy = "fsdp+tp"  # type: ignore[misc]
    checked = check_run(cfg, 4, ranks_per_node=4)
    assert checked.config.parallel.strategy == "fsdp+tp" and cfg.parallel.strategy == "auto"
    assert checked.layout.n_blocks == 2 and checked.layout.block_path == "blocks"
    changed = replace_in(cfg, **{"parallel.nproc": 4, "out_dir": "x"})
    assert (changed.parallel.nproc, changed.out_dir, cfg.parallel.nproc, cfg.out_dir) == (4, "x", 0, "")


def test_session_leaves_the_callers_config_alone():
    from shardwise import Session

    options = ParallelConfig(strategy="auto", precision="fp32")
    with Session("single", precision="bf16-mixed", parallel=options) as s:
        assert s.options.strategy == "single" and s.options.precision == "bf16-mixed"
        assert s.layout.strategy == "single" and get_strategy(s.layout).name == "single"
    assert options == ParallelConfig(strategy="auto", precision="fp32")


# ----------------------------------------------------------------- degrees, not names
@pytest.mark.parametrize("name, world, options", [
    ("single", 1, {}), ("ddp", 4, {}), ("zero1", 4, {}), ("zero2", 4, {}), ("fsdp", 4, {}),
    ("hsdp", 8, dict(hsdp_shard_size=4)), ("fsdp-offload", 2, {}), ("tp", 2, dict(tp=2)), ("pp", 2, dict(pp=2)),
    ("ddp+pp", 4, dict(pp=2)), ("fsdp+pp", 4, dict(pp=2)), ("fsdp+tp", 8, dict(tp=2)),
    ("fsdp+tp+pp", 8, dict(tp=2, pp=2)),
])
def test_every_alias_expands_to_its_degree_set_and_back(name, world, options):
    from shardwise.core.strategies import degree_set, strategy_for_degrees

    layout = resolve_layout(ParallelConfig(strategy=name, **options), world)
    degrees = degree_set(name, layout.dp, tp=layout.tp, pp=layout.pp, shard=layout.dp_shard)
    # The table's expansion is the layout's: one owner, the same numbers.
    assert degrees == {"dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "cp": layout.cp,
                       "tp": layout.tp, "pp": layout.pp, "ep": layout.ep}
    prod = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["cp"] * degrees["tp"] * degrees["pp"]
    assert prod == world == layout.world_size
    # Back: the degree set (plus the row's dp kind where several rows share one) names the alias.
    kind = {"zero1": "zero1", "zero2": "zero2"}.get(name, "")
    back = strategy_for_degrees(degrees["dp_replicate"], degrees["dp_shard"], degrees["tp"], degrees["pp"],
                                dp_kind=kind)
    assert back == ("fsdp" if name == "fsdp-offload" else name)  # offload is a flag on fsdp's degrees
    # And given directly as degrees, they resolve to the same layout (offload stays the alias' flag).
    if name not in ("fsdp-offload", "zero1", "zero2"):
        direct = resolve_layout(ParallelConfig(dp_replicate=degrees["dp_replicate"], dp_shard=degrees["dp_shard"],
                                               tp=degrees["tp"], pp=degrees["pp"]), world)
        assert direct == layout


def test_degrees_given_directly_pick_the_strategy_and_must_agree_with_a_named_one():
    layout = resolve_layout(ParallelConfig(dp_shard=2, tp=2), 4)
    assert (layout.strategy, layout.dp, layout.dp_shard, layout.tp) == ("fsdp+tp", 2, 2, 2)
    assert resolve_layout(ParallelConfig(dp_replicate=2, dp_shard=2), 4).strategy == "hsdp"
    assert resolve_layout(ParallelConfig(strategy="ddp", dp_replicate=4), 4).strategy == "ddp"
    with pytest.raises(ConfigError, match="must multiply to the world size"):
        resolve_layout(ParallelConfig(dp_shard=2), 4)
    with pytest.raises(ConfigError, match="parallel.dp_shard=4, but strategy 'ddp'"):
        resolve_layout(ParallelConfig(strategy="ddp", dp_shard=4), 4)
    with pytest.raises(ConfigError, match="DDP over tensor-parallel"):
        resolve_layout(ParallelConfig(dp_replicate=2, tp=2), 4)
    with pytest.raises(ConfigError, match="both set"):
        resolve_layout(ParallelConfig(strategy="fsdp+tp", dp=2, dp_shard=2, tp=2), 4)


def test_cp_is_a_factor_of_the_data_parallel_ranks():
    assert resolve_layout(ParallelConfig(), 2).cp == 1
    layout = resolve_layout(ParallelConfig(strategy="fsdp", cp=2), 4)
    assert (layout.cp, layout.dp) == (2, 4)
    assert [layout.dp_coords(r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    with pytest.raises(ConfigError, match="parallel.cp=3 must divide the data-parallel ranks"):
        resolve_layout(ParallelConfig(strategy="fsdp", cp=3), 4)
    # With pipeline parallel: the cp pairs are taken out of each stage's dp ranks (same pp coordinate).
    layout = resolve_layout(ParallelConfig(strategy="fsdp+pp", cp=2, pp=2), 8)
    assert (layout.cp, layout.dp, layout.pp) == (2, 4, 2)
    assert [layout.cp_rank(r) for r in range(8)] == [0, 1] * 4
    assert [layout.dp_coords(r) for r in range(8)] == [(0, 2), (0, 2), (1, 2), (1, 2)] * 2
    with pytest.raises(ConfigError, match="takes its ranks from the data-parallel dimension.*'fsdp\\+pp'"):
        resolve_layout(ParallelConfig(strategy="pp", cp=2, pp=2), 4)
    with pytest.raises(ConfigError, match="parallel.cp must be > 0"):
        load_config(overrides=["parallel.cp=0"])


def test_ep_is_borrowed_from_the_fsdp_shard_ranks():
    layout = resolve_layout(ParallelConfig(strategy="fsdp", ep=2), 4)
    assert (layout.ep, layout.dp, layout.dp_shard_mod_ep) == (2, 4, 2)
    with pytest.raises(ConfigError, match="runs under the FSDP2 strategies .*, not 'ddp'"):
        resolve_layout(ParallelConfig(strategy="ddp", ep=2), 4)
    with pytest.raises(ConfigError, match="must divide the ranks that FSDP shards over, dp_shard x cp = 4"):
        resolve_layout(ParallelConfig(strategy="fsdp", ep=3), 4)
    with pytest.raises(ConfigError, match="parallel.ep must be > 0"):
        load_config(overrides=["parallel.ep=0"])


def test_the_core_imports_no_torch_and_its_modules_reach_each_other_directly(cli_env):
    """The torch-free core (``shardwise.core``: the run's shape) imports no torch, and its modules
    import their neighbours at module level only: no function-local shardwise import and no
    "module:attr" import string."""
    import ast
    import re
    from pathlib import Path

    import shardwise.core

    root = Path(shardwise.core.__file__).parent
    names = sorted(p.name for p in root.glob("*.py"))
    assert {"config.py", "layout.py", "strategies.py", "families.py"} <= set(names)
    modules = ", ".join(f"shardwise.core.{n[:-3]}" for n in names if n != "__init__.py")
    code = (f"import sys, {modules}; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    for name in names:
        tree = ast.parse((root / name).read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardwise"):
                    raise AssertionError(f"{name}:{node.lineno} imports {node.module} inside {fn.name}()")
                if isinstance(node, ast.Import) and any(a.name.startswith("shardwise") for a in node.names):
                    raise AssertionError(f"{name}:{node.lineno} imports shardwise inside {fn.name}()")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not re.fullmatch(r"shardwise(\.\w+)+:\w+", node.value), f"{name}: import string {node.value!r}"
        assert "import_module" not in (root / name).read_text(), f"{name} imports modules by name"


def test_resolve_layout_leaves_the_degree_rules_to_layout():
    # One owner: the config route and a Layout built directly refuse alike, naming the config key.
    with pytest.raises(ConfigError, match="parallel.tp=2 is set, but strategy 'ddp\\+pp' has no tp dimension"):
        resolve_layout(ParallelConfig(strategy="ddp+pp", tp=2), 4)
    with pytest.raises(ConfigError, match="parallel.tp=2 is set, but strategy 'ddp\\+pp' has no tp dimension"):
        Layout("ddp+pp", dp=1, tp=2, pp=2)
    with pytest.raises(ConfigError, match="'fsdp\\+tp' needs parallel.tp >= 2 \\(got 1 on 2 ranks\\)"):
        resolve_layout(ParallelConfig(strategy="fsdp+tp", dp=2), 2)
    with pytest.raises(ConfigError, match="'fsdp\\+tp' needs parallel.tp >= 2 \\(got 1 on 2 ranks\\)"):
        Layout("fsdp+tp", dp=2)
