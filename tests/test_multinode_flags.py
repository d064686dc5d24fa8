"""Multi-node flags without a second node: rendezvous ids, Slurm detection and script, `launch`'s
torchrun passthrough, precision aliases, the shared run lock, and every bad combination."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.core.config import load_config
from shardwise.errors import ConfigError
from shardwise.job.multinode import expand_first_host, rendezvous_id, slurm_environment
from shardwise.job.runlock import LOCK_FILE, RunLock, read_lock
from shardwise.job.train import apply_scheduler_defaults
from shardwise.launch import LaunchSpec, nccl_flight_recorder_env, split_launch_argv, torchrun_args
from tests.helpers.ckpt import cli_args, fast_overrides, small_text

SLURM_2_NODES = {"SLURM_JOB_ID": "777", "SLURM_JOB_NAME": "train", "SLURM_JOB_NODELIST": "gpu[003-004]",
                 "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------ rendezvous id and Slurm
def test_rendezvous_id_comes_from_the_flag_the_scheduler_or_what_every_node_shares():
    assert rendezvous_id("my-job", "h:1", "2", "cfg", env={"SLURM_JOB_ID": "9"}) == ("my-job", "--rdzv-id")
    assert rendezvous_id("", "h:1", "2", "cfg", env={"SLURM_JOB_ID": "9"}) == ("9", "Slurm job id")
    assert rendezvous_id("", "h:1", "2", "cfg", env={"PBS_JOBID": "12.pbs01"})[0] == "12.pbs01"
    assert rendezvous_id("", "h:1", "2", "cfg", env={"LSB_JOBID": "55"})[0] == "55"
    derived = rendezvous_id("", "h:1", "2", "cfg", env={})[0]
    # The same on every node (no clock, no host, no directory in it); another job gets another.
    assert derived == rendezvous_id("", "h:1", "2", "cfg", env={})[0] and derived.startswith("sw-")
    assert derived not in {rendezvous_id("", "h:2", "2", "cfg", env={})[0],
                           rendezvous_id("", "h:1", "3", "cfg", env={})[0],
                           rendezvous_id("", "h:1", "2", "cfg2", env={})[0]}
    with pytest.raises(ConfigError, match="--rdzv-id must be"):
        rendezvous_id("a b", "h:1", "2", "cfg", env={})


def test_slurm_environment_is_detected_like_lightning_and_flags_win():
    assert expand_first_host("gpu[003-005,9],cpu1") == "gpu003"
    assert expand_first_host("node7,node8") == "node7"
    assert expand_first_host("a[10,12]") == "a10"
    found = slurm_environment(SLURM_2_NODES)
    assert (found.job_id, found.nnodes, found.node_rank, found.master_addr) == ("777", 2, 1, "gpu003")
    assert slurm_environment({**SLURM_2_NODES, "SLURM_JOB_NAME": "bash"}) is None  # interactive srun --pty
    assert slurm_environment({}) is None

    args = argparse.Namespace(nnodes=None, node_rank=None, rdzv_endpoint="")
    apply_scheduler_defaults(args, {**SLURM_2_NODES, "MASTER_PORT": "29611"})
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("2", 1, "gpu003:29611")
    args = argparse.Namespace(nnodes="4", node_rank=None, rdzv_endpoint="")  # given flags win
    apply_scheduler_defaults(args, SLURM_2_NODES)
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("4", 0, "")
    args = argparse.Namespace(nnodes=None, node_rank=None, rdzv_endpoint="")  # outside Slurm: one node
    apply_scheduler_defaults(args, {})
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("1", 0, "")


def test_slurm_script_content_and_its_errors(tmp_path, capsys, monkeypatch):
    script = tmp_path / "job.sbatch"
    code, out, err = _run(capsys, ["slurm", "--nodes", "4", "--gpus-per-node", "8", "--strategy", "fsdp",
                                   "--partition", "gpu", "--time", "04:00:00", "--account", "proj1",
                                   "--set", "model.preset=nano", "--script", str(script)])
    assert code == 0, err
    text = script.read_text()
    assert out.strip() == text.strip() and f"sbatch {script}" in err
    lines = text.splitlines()
    assert lines[:12] == ["#!/bin/bash", "#SBATCH --job-name=gpt-shakespeare-fsdp", "#SBATCH --nodes=4",
                          "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                          "#SBATCH --time=04:00:00", "#SBATCH --account=proj1", "#SBATCH --requeue",
                          "#SBATCH --open-mode=append", "#SBATCH --output=gpt-shakespeare-fsdp-%j.out", ""]
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)' in lines
    assert "export MASTER_PORT=29500" in lines
    assert 'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \\' in lines
    train = lines[-1].strip()
    assert train.startswith(f"{sys.executable} -m shardwise train --strategy fsdp --set model.preset=nano ")
    assert train.endswith("--set 'checkpoint.resume=\"auto\"' --nproc 8 --nnodes \"$SLURM_NNODES\" "
                          "--rdzv-endpoint \"$head_node:$MASTER_PORT\" --rdzv-id \"$SLURM_JOB_ID\" "
                          "--out \"runs/gpt-shakespeare-fsdp-$SLURM_JOB_ID\"")
    subprocess.run(["bash", "-n", str(script)], check=True)  # valid shell

    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    for argv, message in (
        (["--submit"], "--submit needs Slurm's `sbatch`"),
        (["--time", "tomorrow"], "--time must be a Slurm time limit"),
        (["--nproc", "2"], "--nproc 2 and --gpus-per-node 8 disagree"),
        (["--partition", "gpu;rm -rf"], "--partition must be letters"),
        (["--port", "0"], "--port must be between 1 and 65535"),
        (["--set", "parallel.precision=fp8"], "unknown precision 'fp8'"),
    ):
        code, _, err = _run(capsys, ["slurm", "--nodes", "2", "--gpus-per-node", "8",
                                     "--script", str(tmp_path / "x.sbatch"), *argv])
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


# ------------------------------------------------------------------ launch and torchrun options
def test_launch_splits_torchrun_options_in_both_forms():
    assert split_launch_argv(["--master-port", "29501", "x.py", "--lr", "3"]) == (
        [], ["--master-port", "29501"], ["x.py", "--lr", "3"])
    assert split_launch_argv(["--nproc-per-node", "2", "--master_port=29501", "--tee", "3", "--no-python",
                              "--", "x.py"]) == (
        ["--nproc-per-node", "2"], ["--master_port=29501", "--tee", "3", "--no-python"], ["x.py"])
    with pytest.raises(ConfigError, match="--frobnicate is neither"):
        split_launch_argv(["--frobnicate", "x.py"])
    with pytest.raises(ConfigError, match="--log-dir needs a value"):
        split_launch_argv(["--log-dir"])


def test_torchrun_arguments_for_several_nodes():
    spec = LaunchSpec(nproc=2, nnodes="2:4", node_rank=1, rdzv_endpoint="n0:29500", run_id="777")
    args = torchrun_args(spec)
    assert args == ["--nproc-per-node=2", "--nnodes=2:4", "--rdzv-backend=c10d", "--rdzv-endpoint=n0:29500",
                    "--rdzv-id=777"]  # no --node-rank: c10d ignores it (and torchrun warns)
    assert torchrun_args(LaunchSpec(nproc=1)) == ["--nproc-per-node=1", "--standalone"]


def test_launch_runs_a_script_with_torchrun_options_in_both_forms(tmp_path, cli_env):
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('hello from rank', os.environ['RANK'], sys.argv[1:])\n")
    for form, options in (("space", ["--master-port", "29501", "--log-dir", str(tmp_path / "space"),
                                     "--redirects", "3"]),
                          ("equals", [f"--log-dir={tmp_path / 'equals'}", "--redirects=3", "--master_port=29502"])):
        done = subprocess.run([sys.executable, "-m", "shardwise", "launch", "--nproc-per-node", "1", *options,
                               str(script), "--lr", "3"], env=cli_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, form + done.stdout + done.stderr
        logs = list((tmp_path / form).rglob("stdout.log"))  # torchrun's own per-rank logs
        assert len(logs) == 1 and "hello from rank 0 ['--lr', '3']" in logs[0].read_text(), form


# ------------------------------------------------------------------ precision names
@pytest.mark.parametrize("name, canonical", [
    ("bf16", "bf16-mixed"), ("BF16", "bf16-mixed"), ("16-mixed", "fp16-mixed"), ("fp16", "fp16-mixed"),
    ("32-true", "fp32"), ("32", "fp32"), ("no", "fp32"), ("bf16-true", "bf16-true"), ("bf16-mixed", "bf16-mixed"),
])
def test_precision_aliases_become_the_canonical_name(name, canonical):
    assert load_config(None, [f'parallel.precision="{name}"']).parallel.precision == canonical


def test_precision_alias_in_a_toml_and_did_you_mean(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('[parallel]\nprecision = "16-mixed"\n')
    assert load_config(str(toml)).parallel.precision == "fp16-mixed"
    with pytest.raises(ConfigError, match="Did you mean 'bf16-mixed'") as e:
        load_config(None, ['parallel.precision="bf61"'])
    assert "also accepted: bf16" in str(e.value)


# ------------------------------------------------------------------ lock shared by the nodes
def test_nodes_share_the_lock_and_the_last_to_leave_unlocks(tmp_path):
    run = tmp_path / "run"
    node0 = RunLock(run, job_id="777").acquire()
    node1 = RunLock(run, job_id="777").acquire()
    assert not node0.joined and node1.joined and len(read_lock(run)["members"]) == 2
    with pytest.raises(ConfigError, match="in use by a running job"):
        RunLock(run, job_id="another-job").acquire()
    node0.release()  # the first node finishes (or is lost) first: the job still holds the directory
    assert (run / LOCK_FILE).exists() and len(read_lock(run)["members"]) == 1
    with pytest.raises(ConfigError, match="in use by a running job"):
        RunLock(run, job_id="another-job").acquire()
    node1.release()
    assert not (run / LOCK_FILE).exists()


# ------------------------------------------------------------------ NCCL flight recorder
def test_nccl_flight_recorder_defaults_and_user_values_kept(tmp_path):
    env = nccl_flight_recorder_env(tmp_path, {})
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "nccl-trace" / "rank_")}
    kept = nccl_flight_recorder_env(tmp_path, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50",
                                               "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert kept == {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "nccl-trace" / "rank_")}


# ------------------------------------------------------------------ bad combinations
BAD = [
    (["--nnodes", "0"], "--nnodes must be at least 1"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "localhost:29500"], "MIN (3) is larger than MAX (2)"),
    (["--nnodes", "two"], "--nnodes must be a node count N or an elastic range MIN:MAX"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
    (["--nnodes", "1:2"], "--nnodes 1:2 needs --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0.invalid:29500"], "does not resolve"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "localhost:29500"], "--node-rank must be between 0"),
    (["--nnodes", "2", "--rdzv-endpoint", "localhost:70000"], "--rdzv-endpoint must be HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "localhost:29500", "--rdzv-id", "a b"], "--rdzv-id must be"),
]


def test_every_bad_multi_node_combination_is_one_paragraph_and_nothing_starts(tmp_path, capsys):
    data = small_text(tmp_path)
    for extra, message in BAD:
        out = tmp_path / "run"
        code, _, err = _run(capsys, ["train", "--nproc", "1", *cli_args(fast_overrides(data, steps=2)),
                                     "--out", str(out), *extra])
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (extra, err)
        assert message in err and "Traceback" not in err, (extra, err)
        assert not out.exists()
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    for argv, message in ((["--frobnicate", str(script)], "--frobnicate is neither"),
                          (["--nnodes", "2", "--rdzv-endpoint", "node0.invalid:1", str(script)], "does not resolve")):
        code, _, err = _run(capsys, ["launch", *argv])
        assert code == 2 and err.count("\n") == 1 and message in err, err


def test_dry_run_shows_the_elastic_range_and_the_alias(tmp_path, capsys):
    data = small_text(tmp_path)
    code, out, err = _run(capsys, ["train", "--nproc", "1", *cli_args(fast_overrides(data, steps=2)),
                                   "--nnodes", "1:2", "--rdzv-endpoint", "localhost:29500",
                                   "--set", "parallel.precision=32-true", "--out", str(tmp_path / "r"), "--dry-run"])
    assert code == 0, err
    assert "(1:2 nodes x 1)" in out and "fp32" in out and not Path(tmp_path / "r").exists()
