"""Two "nodes" on this machine: two `shardwise train --nnodes 2` launchers, 1 rank each, on two
addresses (a veth pair into a network namespace) where the test may create one, else on loopback.

They start seconds apart from different working directories without --out, so they only meet
through the rendezvous endpoint: one run directory, parameters equal to the same job on one node;
mid-run the second node is lost (SIGKILL of its launcher, torchrun agent and rank) and started again.
A fake Slurm allocation (sbatch/srun/scontrol stubs) runs the script `shardwise slurm` writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers.ckpt import cli_args, fast_overrides, final_weights, losses, small_text

# serial: these pick a free port and then launch jobs that bind it; beside scripts/test's other shard
# another test's process can take the port in between (the rendezvous then talks to a stranger).
pytestmark = [pytest.mark.slow, pytest.mark.serial]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(argv: list[str], env: dict, cwd: Path, log: Path, prefix: list[str] = ()) -> subprocess.Popen:
    with open(log, "w") as f:  # noqa: PTH123 - the child keeps its own descriptor
        return subprocess.Popen([*prefix, sys.executable, "-m", "shardwise", *argv], env=env, cwd=cwd, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a node: its launcher, torchrun agent and ranks at once, as a machine failure would."""
    for pid in _descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _wait(procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill_tree(q)
            raise


@dataclass
class Nodes:
    """Where the two nodes run: two addresses (a veth pair into a network namespace) or loopback."""

    addresses: tuple[str, str]
    prefixes: tuple[list[str], list[str]]  # command prefix per node (``ip netns exec NS`` or nothing)
    envs: tuple[dict, dict]  # per-node environment (gloo's interface)
    network: str


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    """Two addresses on a veth pair (node 1 in a network namespace) when this user may create them,
    else loopback. Only the namespace and addresses created here are touched, and removed after."""
    loopback = Nodes(("127.0.0.1", "127.0.0.1"), ([], []), ({}, {}), "loopback")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        yield loopback
        return
    tag = os.getpid() % 100000
    ns, a, b, net = f"swtest{tag}", f"swa{tag}", f"swb{tag}", f"10.213.{tag % 250}"
    steps = [["ip", "netns", "add", ns], ["ip", "link", "add", a, "type", "veth", "peer", "name", b],
             ["ip", "link", "set", b, "netns", ns], ["ip", "addr", "add", f"{net}.1/24", "dev", a],
             ["ip", "link", "set", a, "up"], ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{net}.2/24", "dev", b],
             ["ip", "netns", "exec", ns, "ip", "link", "set", b, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    made = all(subprocess.run(cmd, capture_output=True).returncode == 0 for cmd in steps)
    try:
        if made:
            yield Nodes((f"{net}.1", f"{net}.2"), ([], ["ip", "netns", "exec", ns]),
                        ({"GLOO_SOCKET_IFNAME": a}, {"GLOO_SOCKET_IFNAME": b}), f"veth pair {net}.1 <-> {net}.2")
        else:
            yield loopback
    finally:
        subprocess.run(["ip", "link", "del", a], capture_output=True)  # gone with the namespace anyway
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _common(data: Path, steps: int, every: int) -> list[str]:
    return ["--nproc", "1", "--strategy", "ddp", *cli_args(fast_overrides(data, steps=steps, every=every))]


SBATCH_STUB = """#!/bin/bash
# sbatch of a 2-node allocation on this machine: runs the script at once.
export SLURM_JOB_ID=4242 SLURM_JOB_NAME=fake SLURM_JOB_NODELIST=localhost SLURM_NNODES=2 SLURM_JOB_NUM_NODES=2
exec bash "$1"
"""
SRUN_STUB = """#!/bin/bash
# srun: one task per node, each with its node's SLURM_NODEID, a second apart.
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" > "task-$i.log" 2>&1 &
  pids+=($!)
  sleep 1
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL_STUB = """#!/bin/bash
printf 'localhost\\nlocalhost\\n'
"""


def test_fake_slurm_allocation_trains_end_to_end(tmp_path, cli_env):
    data = small_text(tmp_path)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("sbatch", SBATCH_STUB), ("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {**cli_env, "PATH": f"{stubs}{os.pathsep}{cli_env['PATH']}"}
    for key in [k for k in env if k.startswith("SLURM_")]:
        del env[key]
    port = free_port()
    argv = [sys.executable, "-m", "shardwise", "slurm", "--nodes", "2", "--gpus-per-node", "1", "--strategy",
            "ddp", "--port", str(port), "--job-name", "tiny", "--submit",
            *cli_args(fast_overrides(data, steps=4, every=2))]
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    tasks = "".join((tmp_path / f"task-{i}.log").read_text() for i in range(2)
                    if (tmp_path / f"task-{i}.log").exists())
    assert done.returncode == 0, done.stdout + done.stderr + tasks
    script = (tmp_path / "tiny.sbatch").read_text()
    assert script.strip() == done.stdout.strip()  # printed as written
    run = tmp_path / "runs" / "tiny-4242"  # named after the job id: a requeued job continues it
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["tiny-4242"]
    assert "multi-node job 4242 (--rdzv-id)" in tasks and "joined the run directory" in tasks
    assert '"step": 4,' in (run / "metrics.jsonl").read_text()
    assert (run / "checkpoints" / "latest").exists() and (run / "summary.json").exists()
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank-0.log", "rank-1.log"]


def test_a_lost_node_rejoins_and_the_job_resumes_to_the_same_result(tmp_path, cli_env, nodes):
    data = small_text(tmp_path)
    common = _common(data, steps=24, every=4)
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for d in node_dirs:
        d.mkdir()
    endpoint = f"{nodes.addresses[0]}:{free_port()}"
    multi = ["train", *common, "--nnodes", "2", "--rdzv-endpoint", endpoint, "--max-restarts", "1"]
    # Each node tells the others its own address (torchrun's --local-addr): its host name resolves
    # to loopback here.
    argv = [[*multi, "--local-addr", address] for address in nodes.addresses]
    envs = [{**cli_env, **extra} for extra in nodes.envs]

    def start_node(i: int, log: Path) -> subprocess.Popen:
        return _start(argv[i], envs[i], node_dirs[i], log, nodes.prefixes[i])

    logs = [tmp_path / "n0.log", tmp_path / "n1.log", tmp_path / "n1-again.log", tmp_path / "ref.log"]
    ref = _start(["train", *common, "--nproc", "2", "--out", str(tmp_path / "ref")], cli_env, tmp_path, logs[3])
    n0 = start_node(0, logs[0])
    time.sleep(2.0)
    n1 = start_node(1, logs[1])
    try:
        deadline = time.monotonic() + 240
        metrics = None
        while time.monotonic() < deadline:
            found = list((node_dirs[0] / "runs").glob("*/metrics.jsonl"))
            if found and '"step": 9,' in found[0].read_text():
                metrics = found[0]
                break
            assert n0.poll() is None and n1.poll() is None, logs[0].read_text() + logs[1].read_text()
            time.sleep(0.1)
        assert metrics is not None, "the two nodes never reached step 9"
        run = metrics.parent
        _kill_tree(n1)
        lost_at = time.monotonic()
        time.sleep(1.0)
        n1 = start_node(1, logs[2])
        restarted = time.monotonic()
        resumed_at = None
        while resumed_at is None and time.monotonic() < deadline:
            if any("resumed from" in log.read_text() for log in (logs[0], logs[2])):
                resumed_at = time.monotonic()
            elif n0.poll() is not None and n1.poll() is not None:
                break
            time.sleep(0.05)
        _wait([n0, n1, ref])
    except BaseException:
        _wait([n0, n1, ref], timeout=1)
        raise
    out0, out1 = logs[0].read_text(), logs[2].read_text()
    assert (n0.returncode, n1.returncode, ref.returncode) == (0, 0, 0), out0 + out1 + logs[3].read_text()
    assert resumed_at is not None, out0 + out1
    print(f"\ntwo-node restart: node lost -> resumed {resumed_at - lost_at:.1f}s, "
          f"node restarted -> resumed {resumed_at - restarted:.1f}s ({nodes.network})")
    first = logs[1].read_text()
    assert f"chose the run directory {run}" in out0 and f"joined the run directory {run}" in first + out1
    assert "node_rank is only used for static" not in out0 + first + out1  # no --node-rank given to c10d
    assert sorted(p.name for p in run.glob("metrics.jsonl*")) == ["metrics.jsonl"]
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank-0.log", "rank-1.log"]
    resumed = [line for line in (out0 + out1).splitlines() if "resumed from" in line]
    assert any("checkpoints/step-000000" in line for line in resumed), resumed  # step 8 or later
    assert not (node_dirs[1] / "runs").exists()
    assert losses(run) == losses(tmp_path / "ref")
    ref_w, run_w = final_weights(tmp_path / "ref"), final_weights(run)
    assert all(torch.equal(ref_w[k], run_w[k]) for k in ref_w)
    assert not (run / ".shardwise.lock").exists()
