"""``shardwise slurm``: an sbatch script that runs ``shardwise train`` on N nodes of a Slurm cluster.

One ``srun`` task per node runs ``shardwise train`` (which runs torchrun with G ranks): the c10d
rendezvous on the allocation's first node, ``$SLURM_JOB_ID`` as the rendezvous id, and a run
directory named after the job id with ``checkpoint.resume = "auto"``, so a requeued job (same job
id) continues from its latest checkpoint instead of starting over.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from shardwise.cli import _add_run_options
from shardwise.errors import ConfigError
from shardwise.fsutil import atomic_write_text
from shardwise.job.train import resolve_run
from shardwise.launch import MAX_NODES, MAX_NPROC, MAX_RESTARTS

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # Slurm's [D-]HH[:MM[:SS]] / minutes
_WORD = re.compile(r"^[A-Za-z0-9._-]+$")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``slurm`` to the ``shardwise`` command line."""
    p = sub.add_parser(
        "slurm", help="write (and submit) an sbatch script that trains on N nodes",
        description="Write an sbatch script that runs `shardwise train` on every node of a Slurm "
        "allocation (one srun task per node, c10d rendezvous on the first node, $SLURM_JOB_ID as the "
        "rendezvous id, requeue-friendly resume), print it, and submit it with --submit.")
    _add_run_options(p)
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (= ranks) per node")
    p.add_argument("--partition", default="", help="Slurm partition (-p)")
    p.add_argument("--time", default="", help="time limit, e.g. 04:00:00 or 2-00:00:00")
    p.add_argument("--account", default="", help="account to charge (-A)")
    p.add_argument("--job-name", default="", help="job name (default: the run's name)")
    p.add_argument("--cpus-per-task", type=int, default=0, help="CPU cores per node's task (default: Slurm's)")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port on the first node (default 29500)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart all ranks up to K times within the job when one fails (see train)")
    p.add_argument("--script", default="", metavar="PATH",
                   help="where to write the script (default: <job name>.sbatch in this directory)")
    p.add_argument("--submit", action="store_true", help="run sbatch on the written script")
    p.set_defaults(func=cmd_slurm)


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.nodes <= MAX_NODES:
        raise ConfigError(f"--nodes must be between 1 and {MAX_NODES}, got {args.nodes}.")
    if not 1 <= args.gpus_per_node <= MAX_NPROC:
        raise ConfigError(f"--gpus-per-node must be between 1 and {MAX_NPROC}, got {args.gpus_per_node}.")
    if not 1 <= args.port <= 65535:
        raise ConfigError(f"--port must be between 1 and 65535, got {args.port}.")
    if not 0 <= args.max_restarts <= MAX_RESTARTS:
        raise ConfigError(f"--max-restarts must be between 0 and {MAX_RESTARTS}, got {args.max_restarts}.")
    if args.cpus_per_task < 0:
        raise ConfigError(f"--cpus-per-task must be at least 1 (or 0 for Slurm's default), got {args.cpus_per_task}.")
    if args.time and not _TIME.match(args.time):
        raise ConfigError(f"--time must be a Slurm time limit such as 30, 04:00:00 or 2-00:00:00, got {args.time!r}.")
    for flag in ("partition", "account", "job_name"):
        value = getattr(args, flag)
        if value and not _WORD.match(value):
            raise ConfigError(f"--{flag.replace('_', '-')} must be letters, digits, '.', '_' or '-', got {value!r}.")


def sbatch_script(args: argparse.Namespace, name: str, python: str = sys.executable) -> str:
    """The sbatch script for ``args`` (see the module doc); ``name`` names the job and its run directory."""
    sbatch = [f"--job-name={name}", f"--nodes={args.nodes}", "--ntasks-per-node=1",
              f"--gpus-per-node={args.gpus_per_node}"]
    if args.cpus_per_task:
        sbatch.append(f"--cpus-per-task={args.cpus_per_task}")
    for flag, value in (("partition", args.partition), ("time", args.time), ("account", args.account)):
        if value:
            sbatch.append(f"--{flag}={value}")
    # Requeue (preemption, node failure) keeps the job id: the same run directory and rendezvous id.
    sbatch += ["--requeue", "--open-mode=append", f"--output={name}-%j.out"]
    train = [shlex.quote(python), "-m", "shardwise", "train"]
    if args.recipe:
        train.append(shlex.quote(args.recipe))
    if args.strategy:
        train += ["--strategy", shlex.quote(args.strategy)]
    for item in args.overrides:
        train += ["--set", shlex.quote(item)]
    train += ["--set", shlex.quote('checkpoint.resume="auto"'),
              "--nproc", str(args.gpus_per_node), "--nnodes", '"$SLURM_NNODES"',
              "--rdzv-endpoint", '"$head_node:$MASTER_PORT"', "--rdzv-id", '"$SLURM_JOB_ID"',
              "--out", f'"runs/{name}-$SLURM_JOB_ID"']
    if args.max_restarts:
        train += ["--max-restarts", str(args.max_restarts)]
    lines = ["#!/bin/bash", *(f"#SBATCH {s}" for s in sbatch), "",
             f"# Written by `shardwise slurm` ({args.nodes} nodes x {args.gpus_per_node} GPUs). Each node runs",
             "# `shardwise train`, which starts torchrun; the nodes meet at the first node of the allocation.",
             "set -euo pipefail",
             # sed reads every line: `head -n 1` could end the pipe early (SIGPIPE fails under pipefail).
             'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
             f"export MASTER_PORT={args.port}",
             "srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
             "    " + " ".join(train), ""]
    return "\n".join(lines)


def cmd_slurm(args: argparse.Namespace) -> int:
    _check(args)
    if args.nproc is not None and args.nproc != args.gpus_per_node:
        raise ConfigError(f"--nproc {args.nproc} and --gpus-per-node {args.gpus_per_node} disagree: on Slurm "
                          "every node runs one rank per GPU; give --gpus-per-node only.")
    # Every check `train` makes before starting ranks, for this world size (N nodes x G ranks).
    check = argparse.Namespace(**vars(args))
    check.nproc, check.nnodes, check.node_rank = args.gpus_per_node, str(args.nodes), 0
    check.rdzv_endpoint, check.out = ("localhost:29500" if args.nodes > 1 else ""), None
    run = resolve_run(check)
    name = args.job_name or f"{run.config.name}-{run.layout.strategy.replace('+', '_')}"
    script = Path(args.script or f"{name}.sbatch")
    text = sbatch_script(args, name)
    try:
        atomic_write_text(script, text)
    except OSError as e:
        raise ConfigError(f"cannot write the sbatch script {script}: {e.strerror or e}.") from None
    print(text)
    if not args.submit:
        print(f"wrote {script}; submit it with: sbatch {script}", file=sys.stderr)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError(f"--submit needs Slurm's `sbatch`, which is not on PATH here; the script is in "
                          f"{script}: copy it to a Slurm login node and run `sbatch {script}` there.")
    print(f"wrote {script}; submitting it", file=sys.stderr, flush=True)
    return subprocess.call([sbatch, str(script)])
