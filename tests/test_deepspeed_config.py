"""DeepSpeed kinds without starting ranks: "auto" filling, contradictions, set-up refusals."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.core.config import load_config
from shardwise.core.strategies import strategy_info
from shardwise.errors import ConfigError
from shardwise.parallel.deepspeed.config import RunValues, builtin_config, fill, offload_devices
from shardwise.parallel.deepspeed.setup import check_nvme_path

VALUES = RunValues(grad_accum_steps=2, dp_size=2, precision="bf16-mixed", micro_batch_size=4, lr=3e-4,
                   betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, nvme_path="/fast/swap")


def test_auto_values_are_filled_from_shardwise_like_accelerate():
    user = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "auto"}}}
    out = fill(user, VALUES, source="ds_config.json")
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 4 * 2 * 2
    assert out["bf16"] == {"enabled": True} and out["fp16"] == {"enabled": False}
    assert out["optimizer"]["params"] == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    assert "reduce_bucket_size" not in out["zero_optimization"]  # DeepSpeed's own default
    assert out["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/fast/swap"
    assert user["train_batch_size"] == "auto"  # the caller's dict is left alone


@pytest.mark.parametrize("key, value, names", [
    ("gradient_accumulation_steps", 4, ["gradient_accumulation_steps = 4", "train.grad_accum_steps is 2"]),
    ("train_micro_batch_size_per_gpu", 16, ["= 16", "train.micro_batch_size is 4"]),
    ("train_batch_size", 64, ["= 64", "global batch"]),
])
def test_a_contradicting_value_names_both(key, value, names):
    with pytest.raises(ConfigError) as e:
        fill({key: value}, VALUES, source="ds_config.json")
    assert all(n in str(e.value) for n in ["ds_config.json", *names])


def test_precision_lr_and_scheduler_contradictions():
    with pytest.raises(ConfigError, match=r"fp16.enabled = True.*parallel.precision is 'bf16-mixed'"):
        fill({"fp16": {"enabled": True}}, VALUES, source="f")
    with pytest.raises(ConfigError, match=r"lr = 0.1.*train.lr is 0.0003"):
        fill({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, VALUES, source="f")
    with pytest.raises(ConfigError, match="scheduler"):
        fill({"scheduler": {"type": "WarmupLR"}}, VALUES, source="f")
    with pytest.raises(ConfigError, match="stage"):
        fill({"zero_optimization": {"stage": 4}}, VALUES, source="f")
    same = fill({"gradient_accumulation_steps": 2, "optimizer": {"params": {"lr": 3e-4}}}, VALUES, source="f")
    assert same["gradient_accumulation_steps"] == 2


def test_builtin_kinds():
    cpu = builtin_config("zero3-offload", VALUES)
    nvme = builtin_config("zero3-nvme", VALUES)
    assert offload_devices(cpu) == {"cpu"} and offload_devices(nvme) == {"nvme"}
    assert nvme["zero_optimization"]["offload_param"]["nvme_path"] == "/fast/swap"
    assert cpu["zero_optimization"]["stage"] == 3 and cpu["zero_force_ds_cpu_optimizer"] is False
    for name in ("zero3-offload", "zero3-nvme"):
        assert strategy_info(name).offload and strategy_info(name).dp_kind == "fsdp"


def test_nvme_path_checks(tmp_path):
    # The launcher's preflight (create=False) writes nothing, a dry run included; a rank creates it.
    assert not check_nvme_path(str(tmp_path / "new" / "swap"), params=1000, create=False).exists()
    assert check_nvme_path(str(tmp_path / "new" / "swap")).is_dir()  # created
    with pytest.raises(ConfigError, match="set parallel.nvme_path"):
        check_nvme_path("")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_nvme_path(str(f))
    for create in (True, False):
        with pytest.raises(ConfigError, match=r"GiB free.*on this node.*16 bytes per parameter"):
            check_nvme_path(str(tmp_path / "later"), params=10**15, create=create)  # a petabyte: "full"
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        for create in (True, False):
            with pytest.raises(ConfigError, match="not writable"):
                check_nvme_path(str(ro / "swap"), create=create)


def test_preflight_refuses_before_any_rank(tmp_path):
    """Bad DeepSpeed settings fail in check_run (what train/verify call before launching)."""
    pytest.importorskip("deepspeed")
    from shardwise.preflight import check_run

    base = ["model.preset=nano", "train.micro_batch_size=4", "train.grad_accum_steps=2"]
    with pytest.raises(ConfigError, match="set parallel.nvme_path"):
        check_run(load_config(None, [*base, "parallel.strategy=zero3-nvme"]), 2)
    with pytest.raises(ConfigError, match="is not a file"):
        check_run(load_config(None, [*base, "parallel.strategy=deepspeed",
                                     f"parallel.deepspeed_config={tmp_path / 'missing.json'}"]), 2)
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps = 8.*train.grad_accum_steps is 2"):
        check_run(load_config(None, [*base, "parallel.strategy=deepspeed", f"parallel.deepspeed_config={ds}"]), 2)
    with pytest.raises(ConfigError, match="bf16-true"):
        check_run(load_config(None, [*base, "parallel.strategy=zero3-offload", "parallel.precision=bf16-true"]), 2)
    nvme = load_config(None, [*base, "parallel.strategy=zero3-nvme", f"parallel.nvme_path={tmp_path / 'swap'}"])
    ok = check_run(nvme, 2)
    # The launcher checks the disk without writing to it (a dry run writes nothing); a rank creates it.
    assert ok.layout.strategy == "zero3-nvme" and not (tmp_path / "swap").exists()


def test_nvme_preflight_sizes_the_swap_per_node(tmp_path, monkeypatch):
    """ZeRO-3 partitions over every rank of the job: each node's disk holds 1/nodes of the state."""
    pytest.importorskip("deepspeed")
    from shardwise.parallel.deepspeed import strategy as ds_strategy
    from shardwise.preflight import check_run, meta_model
    from shardwise.workloads import build_workload

    cfg = load_config(None, ["model.preset=nano", "train.micro_batch_size=4", "parallel.strategy=zero3-nvme",
                             f"parallel.nvme_path={tmp_path / 'swap'}"])
    workload = build_workload(cfg.model, cfg.data)
    meta = meta_model(workload, builtin=True)
    total = sum(p.numel() for p in meta.parameters())
    seen: list = []
    monkeypatch.setattr(ds_strategy, "check_nvme_path", lambda path, params=None, **kw: seen.append((params, kw)))
    check_run(cfg, 4, ranks_per_node=4, workload=workload, meta=meta)  # one node of 4
    check_run(cfg, 4, ranks_per_node=2, workload=workload, meta=meta)  # two nodes of 2
    assert seen == [(total, {"create": False}), (-(-total // 2), {"create": False})]


def test_planner_offload_math():
    from shardwise.plan.offload import estimate, nvme_gbs_for, offload_candidates

    n = 13_000_000_000  # 13B on one node of 8 GPUs
    cpu = estimate("zero3-offload", n, 8, 1.0, gpu_kind="h100")
    nvme = estimate("zero3-nvme", n, 8, 1.0, gpu_kind="h100")
    assert cpu.host_bytes_per_node == 16 * n and nvme.nvme_bytes_per_node == 16 * n
    assert nvme.host_bytes_per_node < cpu.host_bytes_per_node and nvme.step_s > cpu.step_s > 1.0
    slow = estimate("zero3-nvme", n, 8, 1.0, nvme_gbs=0.5)
    assert slow.step_s > nvme.step_s  # a slower disk, a slower step
    assert nvme_gbs_for("h100-sxm") == 3.0 and nvme_gbs_for("x", 7.0) == 7.0
    # 128 GiB of host RAM cannot hold 13B x 16 bytes: only NVMe is proposed.
    rows = offload_candidates(n, 8, 1.0, host_ram_gib=128)
    assert [r.strategy for r in rows] == ["zero3-nvme"]
    assert [r.strategy for r in offload_candidates(n, 8, 1.0, host_ram_gib=2048)][0] == "zero3-offload"


def test_nvme_state_is_recognised_for_the_resume_refusal():
    from shardwise.runtime.checkpoint.deepspeed_engine import swaps_to_nvme

    assert swaps_to_nvme(builtin_config("zero3-nvme", VALUES))
    assert not swaps_to_nvme(builtin_config("zero3-offload", VALUES)) and not swaps_to_nvme({})


def test_plan_recommends_offload_when_nothing_fits_and_its_command_passes_dry_run(tmp_path, capsys):
    """GPT-2 XL (1.6B) on two 2.5 GiB GPUs of a node with 16 GiB of host RAM: no GPU layout fits, nor
    fsdp-offload (23 GiB of host state); ZeRO-Infinity does, and its printed command dry-runs."""
    import shlex

    from shardwise.cli import main

    plan = ["plan", "--model", "gpt2-xl", "--gpu", "h100", "--gpu-memory-gib", "2.5", "--gpus-per-node", "2",
            "--seq", "256", "--host-ram-gib", "16", "--json"]
    capsys.readouterr()
    assert main(plan) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] is None and [r["strategy"] for r in out["offload"]] == ["zero3-nvme"]
    assert out["offload"][0]["nvme_gib_per_node"] > 20 and out["offload"][0]["host_gib_per_node"] < 16
    assert any("offloading does: zero3-nvme" in w for w in out["warnings"])
    cmd = out["commands"][0]
    assert "--strategy zero3-nvme" in cmd and "parallel.nvme_path=" in cmd
    # --nvme-gbs: a slower disk, a slower step; a rate <= 0 is refused.
    assert main([*plan, "--nvme-gbs", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["offload"][0]["step_s"] > out["offload"][0]["step_s"]
    assert main([*plan, "--nvme-gbs", "0"]) != 0
    assert "--nvme-gbs must be a positive rate" in capsys.readouterr().err
    # The command as printed (the NVMe folder pointed at this test's), through train's dry run.
    argv = shlex.split(cmd.replace("/local_nvme/shardwise", str(tmp_path / "nvme")))
    assert argv[:2] == ["shardwise", "train"]
    assert main([*argv[1:], "--dry-run", "--out", str(tmp_path / "run")]) == 0
    assert "every check passed" in capsys.readouterr().out


@pytest.mark.deepspeed_ops  # needs the ops scripts/test builds before the suite
def test_a_killed_build_leaves_no_lock_that_hangs_the_next_run(tmp_path):
    """torch waits forever on the ``lock`` a killed JIT build leaves in the op's folder; the next
    run's build_ops (under shardwise's flock, which dies with its holder) clears it and loads.

    The lock is planted in a private copy of the built ops, never in the per-user cache every other
    DeepSpeed test loads from: planted there, a DeepSpeed test of the other shard that reached its
    load in the meantime waited on it while holding the flock, this test's build_ops waited on that
    flock, timed out, and left the lock behind -- every later DeepSpeed run on the machine hung
    (2026-11-29, a fresh-clone ``scripts/test``)."""
    pytest.importorskip("deepspeed")
    from shardwise.parallel.deepspeed.setup import prepare_environment

    prepare_environment()
    root, shared = tmp_path / "torch_extensions", Path(os.environ["TORCH_EXTENSIONS_DIR"])
    # The built ops, timestamps kept (ninja then has nothing to rebuild), no lock of another run;
    # where scripts/test has not built them (a test run alone), this run builds them here.
    if shared.is_dir():
        shutil.copytree(shared, root, ignore=shutil.ignore_patterns("lock"))
    (root / "cpu_adam").mkdir(parents=True, exist_ok=True)
    (root / "cpu_adam" / "lock").touch()  # what a build killed midway leaves
    code = "from shardwise.parallel.deepspeed.setup import build_ops; print(*build_ops())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(root)})
    assert done.returncode == 0 and "cpu_adam" in done.stdout.split(), done.stdout + done.stderr
    assert not (root / "cpu_adam" / "lock").exists()
