"""``shardwise rehearse``: the same arguments as ``train``, played at full size on this machine.

The run is resolved exactly as ``train`` resolves it (``job.train.resolve_run``: config, flags,
layout, preflight, meta model), its per-rank prediction is ``train --dry-run``'s, and the played
ranks are ``rehearse.launch``'s processes. Nothing is written outside a temporary folder.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardwise.cli import _add_run_options
from shardwise.core.config import load_config, to_toml
from shardwise.data.cache import read_only
from shardwise.errors import ConfigError
from shardwise.job.train import dry_run_prediction, resolve_run
from shardwise.plan.advice import Cluster, predict_step_for_spec
from shardwise.plan.predict import model_name
from shardwise.plan.presets import gpu
from shardwise.plan.spec import from_module
from shardwise.rehearse import launch, report
from shardwise.rehearse.report import format_text

# No rendezvous is started; multi-node flag checks want an endpoint, and the loopback one resolves.
_NO_RENDEZVOUS = "127.0.0.1:29500"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``rehearse`` sub-command to the main CLI's sub-parsers."""
    p = subparsers.add_parser(
        "rehearse", help="play ranks of a run at its full size on this machine (fake devices and collectives) "
        "and measure their memory against the plan",
        description="Run the real runtime for chosen ranks of a job at its real world size, on fake tensors "
        "and torch's fake process group: Session.prepare, several training steps, the memory of each "
        "played rank by kind next to the planner's prediction, the collectives of one step, and a verdict.")
    _add_run_options(p)
    for action in p._actions:  # the rehearsed job's ranks per node, not this machine's
        if action.dest == "nproc":
            action.help = "ranks per node of the rehearsed job (default 8)"
    add_rehearse_options(p)
    p.set_defaults(func=cmd_rehearse)


def add_rehearse_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes of the rehearsed job (default 1)")
    p.add_argument("--gpu", default="h100-sxm", help="the target GPU kind: its memory budget (default h100-sxm)")
    p.add_argument("--ranks", default="", metavar="R[,R|A-B...]",
                   help="ranks to play (default: one of each role: rank 0, the first rank of the last pipeline "
                        "stage, of the last context-parallel chunk and of the last experts, the last rank)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: fake tensors (any machine); cuda: real tensors on this machine's GPU, fake collectives, "
                        "and one more step timed alone (no tracker or counter) as the rank's measured step")
    p.add_argument("--steps", type=int, default=3, metavar="N",
                   help="optimizer steps per played rank (default and least 3: memory is read over all but "
                        "the last, which counts collectives; the optimizer's state exists from the first step on)")
    p.add_argument("--jobs", type=int, default=1, metavar="J", help="played ranks at a time (default 1)")
    p.add_argument("--rank-timeout", type=float, default=900.0, metavar="S",
                   help="seconds a played rank may take (default 900)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def title_of(run: Any, gpu_name: str, nnodes: int) -> str:
    """e.g. ``llama-3-70b on 4x8 h100-sxm, fsdp tp=2``."""
    layout = run.layout
    degrees = " ".join(f"{n}={getattr(layout, n)}" for n in ("dp_replicate", "tp", "pp", "cp", "ep")
                       if getattr(layout, n) > 1)
    return (f"{model_name(run.config.model)} on {nnodes}x{run.nproc} {gpu_name}, {layout.strategy}"
            f"{' ' + degrees if degrees else ''}")


def rehearse(args: argparse.Namespace) -> dict[str, Any]:
    """Resolve the run as ``train`` does, play its ranks and return the report (``report.build``)."""
    from shardwise.parallel.implementations import get_strategy  # defers torch

    if args.nnodes < 1 or args.steps < 1 or args.jobs < 1:
        raise ConfigError(f"--nnodes, --steps and --jobs must be >= 1, got {args.nnodes}, {args.steps}, {args.jobs}.")
    launch.check_device(args.device)
    target = gpu(args.gpu)
    overrides, notes = list(args.overrides), ()
    if load_config(args.recipe, overrides).parallel.precision == "auto":
        # "auto" decides for the machine that runs: this one would pick fp32 (its CPU), the target
        # GPU bf16-mixed (every GPU kind the planner knows has bfloat16), so the GPU's choice is played.
        overrides.append('parallel.precision="bf16-mixed"')
        notes = (f"parallel.precision = 'auto' -> 'bf16-mixed' (as on the target {target.name}, which supports "
                 "bfloat16; this machine's CPU would pick fp32)",)
    run_args = argparse.Namespace(recipe=args.recipe, overrides=overrides, strategy=args.strategy,
                                  nproc=args.nproc or 8, nnodes=str(args.nnodes), node_rank=0,
                                  rdzv_endpoint=_NO_RENDEZVOUS if args.nnodes > 1 else "", max_restarts=0, out=None)
    with read_only():  # the rehearsal writes nothing outside its temporary folder
        run = resolve_run(run_args)
    strategy = get_strategy(run.layout)
    if strategy.owns_step:
        raise ConfigError(f"strategy {run.layout.strategy} runs DeepSpeed's engine, which allocates real buffers "
                          "and runs its own collectives outside torch's fake process group: it cannot be "
                          "rehearsed. Rehearse the FSDP2 equivalent (fsdp, fsdp-offload) for the layout, or "
                          "run it on its cluster.")
    if strategy.replicates_with_ddp:
        # Torch's DDP runs with its C++ reducer replaced by the rehearsal's stand-in (rehearse/fake_ddp.py,
        # which says why); the report says so.
        from shardwise.rehearse.fake_ddp import NOTE  # defers torch

        notes = (*notes, NOTE)
    ranks = launch.parse_ranks(args.ranks, run.layout.world_size) if args.ranks else launch.default_ranks(run.layout)
    prediction = dry_run_prediction(run)
    planned_step = _planned_step(run, target.name, args.nnodes)
    if planned_step and args.device == "cuda" and "refused" not in planned_step:
        # The played rank's step runs on this machine's GPU: the planner's term it is set beside is
        # priced on that GPU, not on the target (an A100 against an h100-sxm plan says nothing).
        import torch  # defers torch

        from shardwise.observe.throughput import catalog_gpu  # defers torch

        here = catalog_gpu(torch.cuda.get_device_name())
        if here and here != target.name:
            planned_step = {**planned_step, "here": {**(_planned_step(run, here, args.nnodes) or {}), "gpu": here}}
    results = launch.play(to_toml(run.config), world_size=run.layout.world_size, nproc=run.nproc, ranks=ranks,
                          device=args.device, steps=args.steps, timeout_s=args.rank_timeout, jobs=args.jobs)
    budget = Cluster(gpu=target, gpus_per_node=run.nproc, nodes=args.nnodes).usable_gib
    return report.build(title=title_of(run, target.name, args.nnodes), prediction=prediction, results=results,
                        budget_gib=budget, gpu_name=target.name, device=args.device, notes=notes,
                        planned_step=planned_step)


def _planned_step(run: Any, gpu_name: str, nnodes: int) -> dict[str, Any] | None:
    """The planner's step time for the rehearsed command on its target (what ``plan`` prints for the
    same settings): compute, exposed communication, pipeline bubble, in seconds. None without a
    meta model; the planner's refusal as ``refused`` (the rehearsal itself still runs)."""
    if run.checked.meta_model is None:
        return None
    spec = from_module(run.checked.meta_model, name=model_name(run.config.model))
    try:
        t = predict_step_for_spec(spec, run.layout, run.config, seq=run.checked.workload.tokens_per_sample,
                                  gpu_name=gpu_name, gpus_per_node=run.nproc, nodes=nnodes,
                                  plain_ce=run.checked.workload.plain_token_ce)
    except ConfigError as e:
        return {"refused": str(e)}
    return {"step_s": t.step_s, "compute_s": t.compute_s, "comm_exposed_s": t.comm_exposed_s, "bubble_s": t.bubble_s}


def cmd_rehearse(args: argparse.Namespace) -> int:
    result = rehearse(args)
    print(json.dumps(result, indent=2, default=str) if args.json else format_text(result))
    return {"runs": 0, "refused": 2}.get(result["outcome"], 1)
