"""``shardwise train`` from parsed flags to an exit code: resolve the config and layout, check
the run directory and resume checkpoint, lock the directory, meet the other nodes, start the ranks
(torchrun through the agent, or this process), and report how they ended.

The command line (``shardwise.cli``) only parses; ``verify``, ``slurm`` and ``bench`` reuse
``resolve_run``/``dry_run_report`` from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.core.config import check_text, load_config, replace_in, to_toml
from shardwise.core.run_files import CHECKPOINTS_DIR, default_run_dir
from shardwise.data.cache import read_only
from shardwise.errors import CheckpointError, ConfigError, ShardwiseError
from shardwise.fsutil import atomic_write_text, real_path
from shardwise.job.multinode import agree, check_rdzv_id, rendezvous_id, slurm_environment
from shardwise.job.outcome import report_ranks
from shardwise.job.resume_config import adopt_run_config
from shardwise.job.rundir import admit_run, check_claim, clear_launch_reports, lock_run_dir
from shardwise.job.worker import INTERNAL_EXIT_CODE, describe_unexpected
from shardwise.launch import LaunchSpec, check_launch_flags, nccl_flight_recorder_env, run_torchrun
from shardwise.plan.predict import predict_for_model
from shardwise.preflight import check_run
from shardwise.runtime.identity import JOB_ID_ENV, LAUNCH_ID_ENV, new_launch_id

if TYPE_CHECKING:
    from shardwise.core.config import RunConfig
    from shardwise.core.layout import Layout
    from shardwise.preflight import Preflight


def apply_scheduler_defaults(args: argparse.Namespace, env: dict[str, str] | None = None) -> None:
    """Fill --nnodes/--node-rank/--rdzv-endpoint from a Slurm allocation of several nodes; flags win.

    Outside such an allocation: one node, node rank 0.
    """
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
    auto_notes: tuple[str, ...] = ()  # what "auto" precision/compile became, and why (runtime.auto)

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
    from shardwise.device import default_nproc  # defers torch
    from shardwise.parallel.implementations import get_strategy  # defers torch
    from shardwise.runtime.auto import resolve_compile_in, resolve_precision_in  # defers torch

    overrides = list(args.overrides)
    if args.strategy:
        check_text("--strategy", args.strategy)
        overrides.append(f"parallel.strategy={json.dumps(args.strategy)}")
    cfg = load_config(args.recipe, overrides)
    # "auto" precision is decided before the checks (the planner predicts its bytes), compile after
    # them (it asks the resolved strategy); config.toml records both, so a resumed run keeps them.
    cfg, auto_notes = resolve_precision_in(cfg)
    nnodes_text = str(getattr(args, "nnodes", None) or 1)
    nnodes, most = check_launch_flags(args.nproc, nnodes_text, getattr(args, "node_rank", None) or 0,
                                      getattr(args, "rdzv_endpoint", ""), getattr(args, "max_restarts", 0))
    nproc = args.nproc or cfg.parallel.nproc or default_nproc()
    checked = check_run(cfg, nproc * nnodes, ranks_per_node=nproc, workload=workload, meta=meta)
    out = Path(getattr(args, "out", None) or cfg.out_dir or default_run_dir(cfg.name, checked.layout.strategy))
    cfg = replace_in(checked.config, **{"parallel.nproc": nproc, "out_dir": str(out)})
    # Nodes of one job decide from the priors alone: their caches differ, their configs may not.
    cfg, compile_notes = resolve_compile_in(cfg, get_strategy(checked.layout), world_size=nproc * nnodes,
                                            measured=nnodes == 1 and most == nnodes)
    # A multi-node run without --out proposes this default; the first node's proposal wins
    # (job.multinode.agree), so the nodes' clocks never need to agree.
    return ResolvedRun(cfg, checked, nproc, nnodes, out, nnodes_text if most != nnodes else "",
                       auto_notes=(*auto_notes, *compile_notes))


def _preflight_resume(cfg: RunConfig, out: Path, meta_model: object, out_given: bool) -> RunConfig:
    """Check the resume checkpoint before any rank starts (missing, damaged, other model shape).

    Returns the config every rank runs: an explicit resume path is pinned to the checkpoint found
    (a new config object; ``cfg`` is left as it was).
    """
    from shardwise.runtime.checkpoint.locate import resume_source  # defers torch
    from shardwise.runtime.checkpoint.manifest import tensor_shapes  # defers torch
    from shardwise.runtime.checkpoint.preflight import preflight  # defers torch

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
        return replace_in(cfg, **{"checkpoint.resume": str(real_path(path))})
    return cfg


def dry_run_prediction(run: ResolvedRun) -> Any:
    """The planner's per-rank prediction ``--dry-run`` prints (None without a meta model); the
    trainer's summary.json makes the same ``predict_for_spec`` call on the same config."""
    if run.checked.meta_model is None:
        return None
    return predict_for_model(run.checked.meta_model, run.layout, run.config,
                             seq=run.checked.workload.tokens_per_sample, ranks_per_node=run.nproc,
                             plain_ce=run.checked.workload.plain_token_ce)


def dry_run_report(run: ResolvedRun, what: str = "train") -> str:
    """What ``--dry-run`` prints: the resolved run, its layout and the planner's per-rank memory."""
    cfg, layout, checked = run.config, run.layout, run.checked
    nodes = f" ({run.nnodes_range or run.nnodes} nodes x {run.nproc})" if run.multi_node else ""
    lines = [f"dry run of `shardwise {what}`: every check passed; no rank was started, nothing was written.",
             f"run: {cfg.name}, {layout.world_size} rank(s){nodes}, run directory {run.out}",
             layout.describe(checked.cp_impl), *run.auto_notes]
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


def check_train_flags(args: argparse.Namespace) -> None:
    """Flag problems that need no config: text of paths, multi-node flags, contradictions."""
    for flag, value in (("--out", args.out), ("--resume", args.resume), ("the recipe", args.recipe)):
        if value:
            check_text(flag, value, kind="path")
    check_launch_flags(args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint, args.max_restarts)
    if args.rdzv_id:
        check_rdzv_id(args.rdzv_id)
    if args.local_addr and (not args.local_addr.isprintable() or " " in args.local_addr):
        raise ConfigError(f"--local-addr must be a host name or IP address, got {args.local_addr!r}.")
    if args.overwrite and args.resume == "latest":
        raise ConfigError("--overwrite starts a fresh run (moving the old one aside) and --resume alone "
                          "continues the run in --out: choose one. To continue the old run somewhere "
                          "new, pass --resume OLD_RUN with another --out.")


def _dry_run(run: ResolvedRun, args: argparse.Namespace, resumed: Any = None) -> int:
    """``train --dry-run``: every check a real launch makes (run directory and resume checkpoint
    included), then the layout and the memory prediction; nothing is written."""
    check_claim(run.out, run.config, overwrite=args.overwrite, only_lock=True)
    cfg = _preflight_resume(run.config, run.out, run.checked.meta_model, out_given=bool(args.out))
    state = check_claim(run.out, cfg, overwrite=args.overwrite)
    if resumed is not None:
        print(resumed.describe(), file=sys.stderr, flush=True)
    print(dry_run_report(dataclasses.replace(run, config=cfg)))
    print(f"run directory: {run.out} ({state})")
    return 0


def _show(args: argparse.Namespace) -> int:
    """``train RECIPE --show``: the resolved config as TOML (nothing checked beyond the config itself)."""
    overrides = list(args.overrides)
    if args.strategy:
        overrides.append(f"parallel.strategy={json.dumps(args.strategy)}")
    if args.nproc:
        overrides.append(f"parallel.nproc={args.nproc}")
    cfg = load_config(args.recipe, overrides, check=False)
    print(to_toml(cfg), end="")
    try:
        load_config(args.recipe, overrides)
    except ConfigError as e:
        print(f"# not runnable as it stands: {e}", file=sys.stderr)
    return 0


def run_train(args: argparse.Namespace) -> int:
    """``shardwise train``: resolve and check the run, lock its directory, start the ranks (or
    train in this process), and turn their outcome into an exit code."""
    from shardwise.device import accelerator_count  # defers torch
    from shardwise.runtime.trainer import train  # defers numpy and torch

    apply_scheduler_defaults(args)
    check_train_flags(args)
    resumed = adopt_run_config(args)  # a resume continues the run's own config.toml
    if args.resume is not None:
        args.overrides = [*args.overrides, f"checkpoint.resume={json.dumps(args.resume)}"]
    if getattr(args, "show", False):
        return _show(args)
    if args.dry_run:
        with read_only():  # "nothing was written": the data cache is only read
            return _dry_run(resolve_run(args), args, resumed)
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
            # What "auto" became, once the run is accepted (a refused run's message comes alone).
            for note in run.auto_notes:
                print(f"shardwise: {note}", file=sys.stderr, flush=True)
            if resumed is not None and not lock.joined:
                print(resumed.describe(), file=sys.stderr, flush=True)
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
            try:
                train(cfg, out, launch_id=launch_id)
            except (ShardwiseError, KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as e:  # noqa: BLE001 - as on N ranks: one line, the traceback in the log
                return _report_in_process_failure(e, out)
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
        rc = run_torchrun(spec, ["-m", "shardwise.job.worker", str(out / "config.toml"),
                                 "--out", str(out)], env=env, agent_report=agent_report)
        return _report_interrupt(out, started) or _report_ranks(rc, out, agent_report)
    finally:
        lock.release()  # (the rendezvous store this launcher may serve lives as long as `agreement`)


def _report_in_process_failure(error: BaseException, out: Path) -> int:
    """A one-process run's unexpected failure, worded as a rank's is (``job.worker``): one line on
    the console, the traceback in ``logs/rank-0.log``. A full disk stays the CLI's exit 2."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        raise error
    log = out / "logs" / "rank-0.log"
    where = ""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as f:
            traceback.print_exception(error, file=f)
        where = f" (traceback in {log})"
    except OSError:
        traceback.print_exception(error, file=sys.stderr)  # no log to keep it: the console is all there is
    print(f"error: {describe_unexpected(error)}{where}", file=sys.stderr)
    return INTERNAL_EXIT_CODE


def _meet_other_nodes(args: argparse.Namespace, run: ResolvedRun, launch_id: str) -> tuple[Any, str]:
    """Find the job's rendezvous id and agree with the other nodes on run directory and launch id."""
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
    """Turn a failed torchrun into one clear paragraph naming the failing rank(s) (job.outcome)."""
    return report_ranks(rc, out, agent_report)
