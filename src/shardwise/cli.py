"""The ``shardwise`` command line: train, launch, env (plus plan, verify, ckpt, bench).

Every user mistake surfaces as a ShardwiseError and is printed as one paragraph with exit code 2;
a traceback means a bug in shardwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.errors import ConfigError, ShardwiseError

if TYPE_CHECKING:
    from shardwise.config import RunConfig
    from shardwise.layout import Layout
    from shardwise.preflight import Preflight


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
                       description="Train a built-in recipe or a TOML config. Without arguments: "
                       "the character GPT on Tiny Shakespeare, 2 CPU processes or one per GPU.")
    _add_run_options(p)
    p.add_argument("--out", default=None, help="run directory (default: runs/<name>-<strategy>-<time>; "
                   "on several nodes the first node to start chooses it and the others adopt it)")
    _add_node_options(p)
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from a checkpoint: alone, the latest one of the run in --out (whose "
                   "config.toml is reused unless a recipe is given); or a checkpoint, checkpoints/ "
                   "folder or run directory. Works across strategies and rank counts")
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


def apply_scheduler_defaults(args: argparse.Namespace, env: dict[str, str] | None = None) -> None:
    """Fill --nnodes/--node-rank/--rdzv-endpoint from a Slurm allocation of several nodes; flags win.

    Outside such an allocation: one node, node rank 0.
    """
    import os

    from shardwise.runtime.multinode import slurm_environment

    env = dict(os.environ) if env is None else env
    slurm = slurm_environment(env) if args.nnodes is None else None
    if slurm is not None and slurm.nnodes > 1:
        args.nnodes = str(slurm.nnodes)
        if args.node_rank is None:
            args.node_rank = slurm.node_rank
        if not args.rdzv_endpoint:
            args.rdzv_endpoint = f"{slurm.master_addr}:{env.get('MASTER_PORT') or 29500}"
        print(f"shardwise: Slurm job {slurm.job_id}: node {args.node_rank} of {args.nnodes}, rendezvous at "
              f"{args.rdzv_endpoint}", file=sys.stderr, flush=True)
    if args.nnodes is None:
        args.nnodes = "1"
    if args.node_rank is None:
        args.node_rank = 0


@dataclass(frozen=True)
class ResolvedRun:
    """Everything a run needs before any process starts (``train`` and ``train --dry-run``)."""

    config: RunConfig  # resolved: canonical strategy, ranks per node, run directory (a new object)
    checked: Preflight  # the layout (with the model's blocks), strategy, workload, meta model
    nproc: int
    nnodes: int  # the minimum node count (the count itself unless an elastic range MIN:MAX was given)
    out: Path
    nnodes_range: str = ""  # "MIN:MAX" for an elastic run

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1 or bool(self.nnodes_range)

    @property
    def layout(self) -> Layout:
        return self.checked.layout


def resolve_run(args: argparse.Namespace, *, workload: Any = None, meta: Any = None) -> ResolvedRun:
    """Load and check everything a run needs before any process starts; the config is never modified.

    ``workload``/``meta``: see ``preflight.check_run`` (the planner's grid test reuses them).
    """
    from shardwise.config import check_text, load_config, replace_in
    from shardwise.device import default_nproc
    from shardwise.launch import check_launch_flags
    from shardwise.preflight import check_run
    from shardwise.runtime.rundir import default_run_dir

    overrides = list(args.overrides)
    if args.strategy:
        check_text("--strategy", args.strategy)
        overrides.append(f"parallel.strategy={json.dumps(args.strategy)}")
    cfg = load_config(args.recipe, overrides)
    nnodes_text = str(getattr(args, "nnodes", None) or 1)
    nnodes, most = check_launch_flags(args.nproc, nnodes_text, getattr(args, "node_rank", None) or 0,
                                      getattr(args, "rdzv_endpoint", ""), getattr(args, "max_restarts", 0))
    nproc = args.nproc or cfg.parallel.nproc or default_nproc()
    checked = check_run(cfg, nproc * nnodes, ranks_per_node=nproc, workload=workload, meta=meta)
    out = Path(getattr(args, "out", None) or cfg.out_dir or default_run_dir(cfg.name, checked.layout.strategy))
    cfg = replace_in(checked.config, **{"parallel.nproc": nproc, "out_dir": str(out)})
    # A multi-node run without --out proposes this default; the first node's proposal wins
    # (runtime.multinode.agree), so the nodes' clocks never need to agree.
    return ResolvedRun(cfg, checked, nproc, nnodes, out, nnodes_text if most != nnodes else "")


def _use_run_config_for_resume(args: argparse.Namespace) -> None:
    # `train --out RUN --resume` continues RUN as it was configured (plus any --set changes).
    if args.resume is not None and args.recipe is None and args.out:
        saved = Path(args.out) / "config.toml"
        if saved.is_file():
            args.recipe = str(saved)


def _preflight_resume(cfg: RunConfig, out: Path, meta_model: object, out_given: bool) -> RunConfig:
    """Check the resume checkpoint before any rank starts (missing, damaged, other model shape).

    Returns the config every rank runs: an explicit resume path is pinned to the checkpoint found
    (a new config object; ``cfg`` is left as it was).
    """
    from shardwise.config import replace_in
    from shardwise.errors import CheckpointError
    from shardwise.runtime.checkpoint import preflight, tensor_shapes
    from shardwise.runtime.checkpoint.locate import resume_source
    from shardwise.runtime.rundir import CHECKPOINTS_DIR

    ck = cfg.checkpoint
    found = resume_source(ck.resume, out / CHECKPOINTS_DIR)
    if not found:
        return cfg  # a fresh start ("" or "auto" with nothing saved yet)
    source = Path(found)
    # The model's tensor shapes, from its meta-device copy (without one, the ranks check at load).
    shapes = tensor_shapes(meta_model.state_dict()) if meta_model is not None else None  # type: ignore[attr-defined]
    try:
        path = preflight(source, shapes)
    except CheckpointError as e:
        if ck.resume == "latest" and not out_given:
            raise CheckpointError(f"{e} --resume without a PATH continues the run given by --out; "
                                  "pass --out RUN_DIR, or --resume PATH.") from None
        raise
    if ck.resume not in ("latest", "auto"):
        # Every rank and every restart loads this very checkpoint.
        return replace_in(cfg, **{"checkpoint.resume": str(path.resolve())})
    return cfg


def dry_run_prediction(run: ResolvedRun) -> Any:
    """The planner's per-rank prediction ``--dry-run`` prints (None without a meta model); the
    trainer's summary.json makes the same ``predict_for_spec`` call on the same config."""
    from shardwise.plan.predict import predict_for_model

    if run.checked.meta_model is None:
        return None
    return predict_for_model(run.checked.meta_model, run.layout, run.config,
                             seq=run.checked.workload.tokens_per_sample, ranks_per_node=run.nproc)


def dry_run_report(run: ResolvedRun, what: str = "train") -> str:
    """What ``--dry-run`` prints: the resolved run, its layout and the planner's per-rank memory."""
    cfg, layout, checked = run.config, run.layout, run.checked
    nodes = f" ({run.nnodes_range or run.nnodes} nodes x {run.nproc})" if run.multi_node else ""
    lines = [f"dry run of `shardwise {what}`: every check passed; no rank was started, nothing was written.",
             f"run: {cfg.name}, {layout.world_size} rank(s){nodes}, run directory {run.out}",
             layout.describe()]
    model = checked.meta_model
    if model is None:
        lines.append("memory: no prediction (the model factory cannot build on the meta device; "
                     "the ranks check the model's shape when they start)")
        return "\n".join(lines)
    prediction = dry_run_prediction(run)
    lines += [
        f"model: {prediction.model}, {prediction.n_params / 1e6:,.2f}M parameters; {cfg.parallel.precision}, "
        f"{prediction.micro_batches} micro-batch(es) of {prediction.micro_batch} x {prediction.seq} tokens per "
        f"step per replica, activation checkpointing {prediction.checkpoint}",
        "predicted memory per rank (the planner's model; the run compares it with the ledger):",
        prediction.table(),
    ]
    lines += [f"note: {n}" for n in prediction.notes]
    return "\n".join(lines)


def _report_interrupt(out: Path, started: float) -> int | None:
    summary = out / "summary.json"
    if not summary.is_file() or summary.stat().st_mtime < started:
        return None
    try:
        data = json.loads(summary.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("interrupted"):
        return None
    print(f"interrupted: checkpoint saved at step {data.get('steps')} ({data.get('checkpoint')}). "
          f"Continue with: shardwise train --out {out} --resume", file=sys.stderr)
    return 130


def _check_train_flags(args: argparse.Namespace) -> None:
    """Flag problems that need no config: text of paths, multi-node flags, contradictions."""
    from shardwise.config import check_text
    from shardwise.launch import check_launch_flags

    for flag, value in (("--out", args.out), ("--resume", args.resume), ("the recipe", args.recipe)):
        if value:
            check_text(flag, value, kind="path")
    check_launch_flags(args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint, args.max_restarts)
    if args.rdzv_id:
        from shardwise.runtime.multinode import check_rdzv_id

        check_rdzv_id(args.rdzv_id)
    if args.local_addr and (not args.local_addr.isprintable() or " " in args.local_addr):
        raise ConfigError(f"--local-addr must be a host name or IP address, got {args.local_addr!r}.")
    if args.overwrite and args.resume == "latest":
        raise ConfigError("--overwrite starts a fresh run (moving the old one aside) and --resume alone "
                          "continues the run in --out: choose one. To continue the old run somewhere "
                          "new, pass --resume OLD_RUN with another --out.")


def _dry_run(run: ResolvedRun, args: argparse.Namespace) -> int:
    """``train --dry-run``: every check a real launch makes (run directory and resume checkpoint
    included), then the layout and the memory prediction; nothing is written."""
    from shardwise.runtime.rundir import check_claim

    check_claim(run.out, run.config, overwrite=args.overwrite, only_lock=True)
    cfg = _preflight_resume(run.config, run.out, run.checked.meta_model, out_given=bool(args.out))
    state = check_claim(run.out, cfg, overwrite=args.overwrite)
    print(dry_run_report(dataclasses.replace(run, config=cfg)))
    print(f"run directory: {run.out} ({state})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from shardwise.config import replace_in, to_toml
    from shardwise.device import accelerator_count
    from shardwise.fsutil import atomic_write_text
    from shardwise.launch import LaunchSpec, nccl_flight_recorder_env, run_torchrun
    from shardwise.runtime.identity import JOB_ID_ENV, LAUNCH_ID_ENV, new_launch_id
    from shardwise.runtime.rundir import admit_run, clear_launch_reports, lock_run_dir
    from shardwise.runtime.trainer import train

    apply_scheduler_defaults(args)
    _check_train_flags(args)
    _use_run_config_for_resume(args)
    if args.resume is not None:
        args.overrides = [*args.overrides, f"checkpoint.resume={json.dumps(args.resume)}"]
    if args.dry_run:
        from shardwise.data.cache import read_only

        with read_only():  # "nothing was written": the data cache is only read (issue 17)
            return _dry_run(resolve_run(args), args)
    run = resolve_run(args)
    nproc, out, cfg = run.nproc, run.out, run.config
    launch_id = new_launch_id()
    agreement, rdzv_id = None, ""
    if run.multi_node:
        agreement, rdzv_id = _meet_other_nodes(args, run, launch_id)
        out, launch_id = agreement.run_dir, agreement.launch_id
        cfg = replace_in(cfg, out_dir=str(out))
    spec = LaunchSpec(nproc=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, run_id=rdzv_id, max_restarts=args.max_restarts,
                      local_addr=args.local_addr)
    # The nodes of one multi-node job share the rendezvous id: they join one lock (each node a
    # member; the last to leave unlocks). A single-node job is this invocation alone.
    job_id = rdzv_id or launch_id
    # Lock first: a live run in --out is reported as such, before its checkpoints are read.
    lock = lock_run_dir(out, job_id)
    try:
        try:
            cfg = _preflight_resume(cfg, out, run.checked.meta_model, out_given=bool(args.out))
            admit_run(lock, cfg, overwrite=args.overwrite)
            if not lock.joined:
                clear_launch_reports(out)  # heartbeats and reports of earlier launches
                try:
                    atomic_write_text(out / "config.toml", to_toml(cfg), durable=True)
                except OSError as e:
                    raise ConfigError(f"cannot write {out / 'config.toml'}: {e.strerror or e}; nothing was "
                                      "started (free space or choose another --out).") from None
        except ShardwiseError as e:
            if agreement is not None and not lock.joined:
                agreement.publish_ready(error=str(e))
            raise
        if agreement is not None:
            # A joining node starts its ranks only once the first one has set the directory up.
            agreement.wait_ready() if lock.joined else agreement.publish_ready()
        started = time.time() - 1.0
        if nproc == 1 and not run.multi_node and not args.max_restarts:
            train(cfg, out, launch_id=launch_id)
            return _report_interrupt(out, started) or 0
        env = {LAUNCH_ID_ENV: launch_id, JOB_ID_ENV: job_id}
        if accelerator_count():
            # NCCL's flight recorder dumps the last collectives of every rank on a timeout.
            env.update(nccl_flight_recorder_env(out))
            (out / "nccl-trace").mkdir(exist_ok=True)
        if cfg.watchdog.debug_collectives:
            env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        if args.max_restarts:
            # With the rendezvous TCPStore shared with the workers (torchrun's default), a restarted
            # rank can read a peer's address left by the previous attempt and fail to connect
            # (pytorch/pytorch#135712). A separate store per attempt avoids that.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        agent_report = out / "logs" / f"agent-{launch_id}.json"
        agent_report.parent.mkdir(exist_ok=True)
        rc = run_torchrun(spec, ["-m", "shardwise.runtime.worker", str(out / "config.toml"),
                                 "--out", str(out)], env=env, agent_report=agent_report)
        return _report_interrupt(out, started) or _report_ranks(rc, out, agent_report)
    finally:
        lock.release()  # (the rendezvous store this launcher may serve lives as long as `agreement`)


def _meet_other_nodes(args: argparse.Namespace, run: ResolvedRun, launch_id: str) -> tuple[Any, str]:
    """Find the job's rendezvous id and agree with the other nodes on run directory and launch id."""
    from shardwise.config import replace_in, to_toml
    from shardwise.runtime.multinode import agree, rendezvous_id

    # What every node's command has in common: not --out (the first node's one is used anyway).
    common = to_toml(replace_in(run.config, out_dir=""))
    rdzv_id, source = rendezvous_id(args.rdzv_id, args.rdzv_endpoint, str(args.nnodes), common)
    agreement = agree(args.rdzv_endpoint, rdzv_id, run.out, launch_id)
    how = "chose" if agreement.first else "joined"
    print(f"shardwise: multi-node job {rdzv_id} ({source}), {args.nnodes} nodes, rendezvous at "
          f"{args.rdzv_endpoint}; this node {how} the run directory {agreement.run_dir}",
          file=sys.stderr, flush=True)
    return agreement, rdzv_id


def _report_ranks(rc: int, out: Path, agent_report: Path | None = None) -> int:
    """Turn a failed torchrun into one clear paragraph naming the failing rank(s) (runtime.outcome)."""
    from shardwise.runtime.outcome import report_ranks

    return report_ranks(rc, out, agent_report)


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
    import tempfile

    from shardwise.config import check_text
    from shardwise.device import default_nproc
    from shardwise.launch import LaunchSpec, check_launch_flags, run_torchrun
    from shardwise.runtime.multinode import rendezvous_id

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
    from shardwise.runtime.outcome import report_script_ranks

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
    import torch
    import torch.distributed as dist

    from shardwise.device import accelerator_count, backend_for, cpu_count, default_nproc

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
                   "shardwise.observe.cli", "shardwise.slurm"):
        _register_optional(module, sub)
    return parser


def _register_optional(module: str, sub: argparse._SubParsersAction) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return
    mod.register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["launch"]:
            # torchrun's options may take their value as the next word: split them off first, or
            # argparse would take `29501` in `--master-port 29501 train.py` for the script.
            from shardwise.launch import split_launch_argv

            own, passthrough, rest = split_launch_argv(argv[1:])
            args = parser.parse_args(["launch", *own, *(["--"] if rest[:1] and rest[0].startswith("-") else []),
                                      *rest])
            args.torchrun_extra = passthrough
        else:
            args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 0
        return int(args.func(args) or 0)
    except ShardwiseError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        import errno

        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: no space left on the device holding {e.filename or 'the run directory'} "
              f"({e.strerror}); free space and retry (a run continues with --resume).", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
