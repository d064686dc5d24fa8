"""The ``shardwise`` command line: train, launch, env (plus plan, verify, ckpt, bench).

This module parses; what ``train`` does with the flags lives in ``shardwise.job.train``.

Every user mistake surfaces as a ShardwiseError and is printed as one paragraph with exit code 2;
a traceback means a bug in shardwise.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import platform
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from shardwise.core.config import check_text
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.habits import add_launch_habits
from shardwise.job.multinode import rendezvous_id
from shardwise.job.outcome import report_script_ranks
from shardwise.job.train import apply_scheduler_defaults, run_train
from shardwise.launch import LaunchSpec, check_launch_flags, run_torchrun, split_launch_argv
from shardwise.recipe_info import recipes_help
from shardwise.torch_version import older_torch_note


# ------------------------------------------------------------------------------ train
def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", default=None, metavar="RECIPE_OR_TOML",
                   help="built-in recipe name (default: gpt-shakespeare) or a TOML file")
    p.add_argument("--strategy", default=None,
                   help="parallel strategy (default: ddp on several ranks, single on one)")
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=None,
                   help="ranks per node (default: one per GPU, or 2 CPU processes without GPUs)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=100 (repeatable)")


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a recipe or TOML config on one or many ranks",
                       description="Train a built-in recipe or a TOML config. Without arguments:\n"
                       "the character GPT on Tiny Shakespeare, 2 CPU processes or one per GPU.",
                       epilog=recipes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_options(p)
    p.add_argument("--out", default=None, help="run directory (default: runs/<name>-<strategy>-<time>; "
                   "on several nodes the first node to start chooses it and the others adopt it)")
    _add_node_options(p)
    add_launch_habits(p)  # Accelerate's / torchrun's flags: aliases, or the shardwise spelling
    p.add_argument("--show", action="store_true",
                   help="print the resolved config (the recipe or TOML with every --set applied) as TOML and exit")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from a checkpoint: alone, the latest one of the run in --out; or a "
                   "checkpoint, checkpoints/ folder or run directory. The run's own config.toml is kept "
                   "(a recipe named too does not replace it); change a setting with --set (changes are "
                   "listed). Works across strategies and rank counts")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart all ranks up to K times when one fails or hangs; each restart "
                   "resumes from the latest checkpoint (set checkpoint.every to lose little work)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a fresh run in an --out that already holds one: the old run is moved "
                   "aside to OUT.old-<time> (never deleted)")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve the run and run every check (config, flags, data, a meta-device model, "
                   "checkpoint, run directory), print the layout and the planner's per-rank memory "
                   "prediction, and exit without starting ranks or writing anything")
    p.set_defaults(func=cmd_train)


def _add_node_options(p: argparse.ArgumentParser) -> None:
    """Multi-node flags (torchrun's names); inside a Slurm allocation they default to the allocation's."""
    p.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="number of nodes, or an elastic range MIN:MAX (default 1; in a Slurm job: its nodes)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None,
                   help="this node's rank, 0 .. nnodes-1 (optional: the c10d rendezvous numbers nodes "
                   "in the order they join; checked against --nnodes)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="", metavar="HOST:PORT",
                   help="address of the first node, the same on every node (multi-node runs; in a Slurm "
                   "job: the first node of the allocation, port $MASTER_PORT or 29500)")
    p.add_argument("--local-addr", "--local_addr", dest="local_addr", default="", metavar="ADDR",
                   help="this node's address as the other nodes reach it (torchrun's --local-addr; for "
                   "hosts whose name resolves to a loopback or an unreachable address)")
    p.add_argument("--rdzv-id", "--rdzv_id", "--job-id", dest="rdzv_id", default="", metavar="ID",
                   help="the job's rendezvous id, the same on every node (default: the scheduler's job id, "
                   "e.g. $SLURM_JOB_ID, else derived from the endpoint, node count and config)")


def cmd_train(args: argparse.Namespace) -> int:
    return run_train(args)


# ------------------------------------------------------------------------------ launch
def _add_launch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run your own script on N ranks through torchrun",
        description="Run a user script written against shardwise.Session on N ranks via "
        "torch.distributed.run. Any other torchrun option goes before the script, as --opt value or "
        "--opt=value (e.g. --master-port 29501, --log-dir logs --tee 3); the script's own after it.",
    )
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=None,
                   help="ranks per node (default as for train)")
    p.add_argument("--nnodes", default=None, metavar="N|MIN:MAX")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=None)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="", metavar="HOST:PORT")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0)
    p.add_argument("script", help="the Python script to run on every rank")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_launch, rdzv_id="", torchrun_extra=[])


def cmd_launch(args: argparse.Namespace) -> int:
    from shardwise.device import default_nproc  # defers torch

    apply_scheduler_defaults(args)
    check_launch_flags(args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint, args.max_restarts)
    check_text("the script", args.script, kind="path")
    script = Path(args.script)
    if not script.is_file():
        raise ConfigError(f"script {args.script!r} does not exist.")
    spec = LaunchSpec(nproc=args.nproc or default_nproc(), nnodes=args.nnodes,
                      node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                      max_restarts=args.max_restarts)
    extra = list(args.torchrun_extra)
    if spec.multi_node and not any(o.split("=")[0] in ("--rdzv-id", "--rdzv_id") for o in extra):
        # torchrun's default id is "none" for every job: use the scheduler's job id, else derive
        # one all nodes share from their common command.
        spec.run_id = rendezvous_id("", spec.rdzv_endpoint, str(spec.nnodes),
                                    " ".join([str(script), *args.script_args]))[0]
    # Through shardwise's agent (torchrun itself): the ranks die with this launcher, and a failed
    # rank is one line here (its own output is above) instead of torchrun's traceback.
    with tempfile.TemporaryDirectory(prefix="shardwise-launch-") as tmp:
        report = Path(tmp) / "agent.json"
        rc = run_torchrun(spec, [*extra, str(script), *args.script_args], agent_report=report)
        return report_script_ranks(rc, report, str(script))


# ------------------------------------------------------------------------------ env
def _add_env_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="show torch, backends, devices and what train would choose")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_env)


def env_report() -> dict[str, object]:
    """Facts about this machine that decide how shardwise runs here."""
    import torch  # defers torch
    import torch.distributed as dist  # defers torch

    from shardwise.device import accelerator_count, backend_for, cpu_count, default_nproc  # defers torch

    n_gpu = accelerator_count()
    default_device = "cuda" if n_gpu else "cpu"
    nproc = default_nproc()
    return {
        "shardwise": __import__("shardwise").__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(n_gpu)],
        "backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                     "mpi": dist.is_mpi_available()},
        "cpu_count": cpu_count(),
        "default_train": {"nproc": nproc, "device": default_device,
                          "backend": backend_for(torch.device(default_device)),
                          "strategy": "ddp" if nproc > 1 else "single"},
    }


def cmd_env(args: argparse.Namespace) -> int:
    report = env_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    backends = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in report["backends"].items())
    d = report["default_train"]
    print(f"shardwise   {report['shardwise']}  (python {report['python']})")
    print(f"torch       {report['torch']}  (cuda available: {report['cuda_available']}, "
          f"cuda {report['cuda_version']})")
    print(f"backends    {backends}")
    gpus = report["gpus"]
    print(f"devices     {len(gpus)} GPU(s){': ' + ', '.join(gpus) if gpus else ''}; "
          f"{report['cpu_count']} CPU cores")
    print(f"train uses  {d['nproc']} x {d['device']} ranks, backend {d['backend']}, "
          f"strategy {d['strategy']} (override with --nproc / --strategy)")
    return 0


# ------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Take a PyTorch training job from one process to many: plan, train, verify, "
        "resume, compare.",
    )
    parser.add_argument("--version", action="version",
                        version=f"shardwise {__import__('shardwise').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train_parser(sub)
    _add_launch_parser(sub)
    _add_env_parser(sub)
    # Commands that live in their own modules; each exposes register(subparsers).
    for module in ("shardwise.plan.cli", "shardwise.verify", "shardwise.ckpt_cli", "shardwise.bench",
                   "shardwise.observe.cli", "shardwise.slurm", "shardwise.rehearse.cli"):
        _register_optional(module, sub)
    return parser


def _register_optional(module: str, sub: argparse._SubParsersAction) -> None:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return
    mod.register(sub)


def _note_older_torch() -> None:
    """Say once, on stderr, when the installed torch is older than the tested one (no import of torch
    itself when it is not loaded yet: its version is read from the package metadata)."""
    try:
        note = older_torch_note(version("torch"))
    except PackageNotFoundError:
        return
    if note:
        print(f"shardwise: {note}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["launch"]:
            # torchrun's options may take their value as the next word: split them off first, or
            # argparse would take `29501` in `--master-port 29501 train.py` for the script.
            own, passthrough, rest = split_launch_argv(argv[1:])
            args = parser.parse_args(["launch", *own, *(["--"] if rest[:1] and rest[0].startswith("-") else []),
                                      *rest])
            args.torchrun_extra = passthrough
        else:
            args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        _note_older_torch()
        return int(args.func(args) or 0)
    except ShardwiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: no space left on the device holding {e.filename or 'the run directory'} "
              f"({e.strerror}); free space and retry (a run continues with --resume).", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
