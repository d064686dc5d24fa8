"""``shardwise verify``: prove that a strategy trains the same model as one process.

Both runs start from the same weights (same seed) and consume the same global batches: the
strategy's data-parallel ranks read interleaved slices of ``ShardedSampler``'s global order, and
global micro-batch k of size ``B * dp`` is exactly the contiguous block k of that order, which is
what one process reading batches of ``B * dp`` from the same order gets. So the reference is the
built-in trainer with strategy ``single`` and ``micro_batch_size = B * dp`` (same accumulation,
same learning-rate schedule, same clipping), and any difference comes from the strategy alone.

    shardwise verify my_model.toml --strategy fsdp --nproc 4 --steps 10

Prints one row per optimizer step (reference loss, strategy loss, |difference|), then the largest
final parameter difference, and exits 0 only when both are within the precision's tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.core.config import load_config, replace_in, to_toml
from shardwise.data.cache import read_only
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.job.rundir import holds_run, lock_run_dir
from shardwise.job.train import ResolvedRun, dry_run_report
from shardwise.launch import LaunchSpec, run_torchrun
from shardwise.models.names import clean_name
from shardwise.preflight import check_run
from shardwise.runtime.identity import new_launch_id
from shardwise.verify_resume import verify_resume

if TYPE_CHECKING:  # torch is imported where it is used: `shardwise plan` registers this module too
    import torch
    from torch import nn

# precision -> (loss atol, loss rtol, parameter atol): a step passes when
# The degrees the verify table and verify.json name (Layout.to_dict's keys).
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
# |strategy - reference| <= atol + rtol * |reference| (torch.allclose's rule), the final weights
# when max |difference| <= parameter atol.
# fp32: only summation order differs (gradient reduction, sharded norms): typically 1e-7..1e-6 on
# losses of order 1-5, up to ~3e-5 relative at a loss spike, where training itself amplifies
# differences (longer runs at high learning rates drift further). Parameters get more room: AdamW divides
# by sqrt(v), so a weight whose true gradient is ~0 (attention key biases: softmax is
# shift-invariant) moves by O(lr) per step on pure rounding noise, in either run, in any direction.
# Mixed and bf16 modes round activations (and bf16-true the weights) to 8 mantissa bits; FSDP2's
# MixedPrecisionPolicy and torch.autocast also cast different ops, so their tolerances are loose.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "fp32": (1e-5, 1e-4, 5e-3),
    "bf16-mixed": (1e-2, 1e-2, 5e-2),
    "fp16-mixed": (5e-3, 5e-3, 5e-2),
    "bf16-true": (2e-2, 2e-2, 1e-1),
}


@dataclass
class VerifyReport:
    """The comparison of one strategy run against the single-process reference."""

    strategy: str
    world_size: int
    precision: str
    reference_losses: list[float]
    strategy_losses: list[float]
    max_param_diff: float
    worst_param: str
    loss_atol: float
    loss_rtol: float
    param_tol: float
    missing_params: list[str] = field(default_factory=list)
    degrees: dict[str, int] = field(default_factory=dict)  # the strategy run's layout (Layout.to_dict)

    def layout_text(self) -> str:
        """'fsdp (dp_shard=2, ep=2)': the strategy and the degrees above 1 that were in force."""
        shown = ", ".join(f"{k}={v}" for k, v in self.degrees.items() if isinstance(v, int) and v > 1)
        return f"{self.strategy} ({shown})" if shown else self.strategy

    @property
    def loss_diffs(self) -> list[float]:
        return [abs(a - b) for a, b in zip(self.reference_losses, self.strategy_losses)]

    def loss_tol(self, reference: float) -> float:
        """The allowed |loss difference| at a step whose reference loss is ``reference``."""
        return self.loss_atol + self.loss_rtol * abs(reference)

    @property
    def passed(self) -> bool:
        """True when every step's loss and the final parameters are within tolerance."""
        losses_ok = all(d <= self.loss_tol(r) for r, d in zip(self.reference_losses, self.loss_diffs))
        return (not self.missing_params and losses_ok and len(self.reference_losses) == len(self.strategy_losses)
                and self.max_param_diff <= self.param_tol)

    def table(self) -> str:
        """The per-step table and the verdict, as printed by ``shardwise verify``."""
        lines = [f"verify: {self.layout_text()} on {self.world_size} rank(s) vs single process, "
                 f"precision {self.precision}",
                 f"{'step':>4}  {'reference':>12}  {'strategy':>12}  {'|diff|':>10}"]
        for i, (a, b, d) in enumerate(zip(self.reference_losses, self.strategy_losses, self.loss_diffs)):
            flag = "" if d <= self.loss_tol(a) else "  <-- over tolerance"
            lines.append(f"{i + 1:>4}  {a:>12.6f}  {b:>12.6f}  {d:>10.3e}{flag}")
        lines.append(f"max |loss diff| {max(self.loss_diffs, default=0.0):.3e} "
                     f"(tolerance {self.loss_atol:g} + {self.loss_rtol:g} x |reference|)")
        lines.append(f"max |param diff| {self.max_param_diff:.3e} in {self.worst_param or '-'} "
                     f"(tolerance {self.param_tol:g})")
        if self.missing_params:
            lines.append(f"parameters missing from the strategy run: {', '.join(self.missing_params[:5])}")
        lines.append("PASS" if self.passed else "FAIL")
        hint = self.low_precision_hint()
        if hint:
            lines.append(hint)
        return "\n".join(lines)

    def low_precision_hint(self) -> str:
        """What a failing low-precision run may mean: rounding (different in any two layouts: reduction
        order) grows where the loss jumps, so a correct layout can fail at a spike; fp32 decides."""
        if self.passed or self.precision == "fp32" or self.missing_params:
            return ""
        refs = self.reference_losses
        jumps = [i for i, (r, d) in enumerate(zip(refs, self.loss_diffs))
                 if d > self.loss_tol(r) and i and r > refs[i - 1]]
        where = (f" Step {jumps[0] + 1}'s reference loss rose by {refs[jumps[0]] - refs[jumps[0] - 1]:.3f}: "
                 "a loss spike magnifies rounding." if jumps else "")
        return (f"note: in {self.precision} two correct layouts round differently (reduction order).{where} "
                "Re-run in fp32 (--set parallel.precision=fp32, verify's default) to tell a layout's error from "
                "rounding; a lower train.lr keeps low-precision runs closer.")

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "world_size": self.world_size, "degrees": self.degrees,
                "precision": self.precision,
                "reference_losses": self.reference_losses, "strategy_losses": self.strategy_losses,
                "loss_diffs": self.loss_diffs, "max_param_diff": self.max_param_diff,
                "worst_param": self.worst_param, "loss_atol": self.loss_atol,
                "loss_rtol": self.loss_rtol, "param_tol": self.param_tol, "passed": self.passed}


# ------------------------------------------------------------------------------ per-rank work
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return this rank's full (unsharded) parameters on the CPU under single-device names.

    A collective under sharding (every rank must call it). Uses DCP's ``get_model_state_dict``,
    which gathers FSDP2/TP DTensors and strips DDP and checkpoint-wrapper prefixes.
    """
    import torch.distributed as dist  # defers torch

    # Gathering a 2-D-sharded (FSDP x TP) parameter makes DTensor warn, once per rank, that it
    # needs two all-gathers; for a one-off comparison that is expected, not worth N log lines.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        if dist.is_initialized():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # defers torch

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        else:
            state = model.state_dict()
        out = {}
        for name, value in state.items():
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            out[clean_name(name)] = value.detach().to("cpu", copy=True)
    finally:
        redistribute_log.setLevel(level)
    return out


def run_steps(cfg: Any, steps: int, out_dir: str | Path) -> dict[str, Any] | None:
    """Train ``steps`` optimizer steps of ``cfg`` on this rank; rank 0 returns losses and parameters.

    Runs the built-in trainer's own step, so what is verified is what ``shardwise train`` does.
    Parameters of every rank are merged on rank 0 (pipeline stages each hold a part).
    """
    import torch.distributed as dist  # defers torch

    from shardwise.runtime.session import Session  # defers torch
    from shardwise.runtime.trainer import Trainer  # defers numpy and torch

    t = cfg.train
    session = Session(parallel=cfg.parallel, grad_accum_steps=t.grad_accum_steps, seed=t.seed,
                      collective_timeout_s=cfg.watchdog.collective_timeout_s, compile=t.compile,
                      loss_chunks=t.loss_chunks)
    try:
        trainer = Trainer(cfg, out_dir, session)
        batches = trainer.train_loader.forever()
        losses = []
        for _ in range(steps):
            loss, _ = trainer.train_step(batches)
            losses.append(float(session.all_reduce(loss, op="mean")))
        params = session.strategy.full_state_dict(trainer.model)
        if params is None:
            params = full_state_dict(trainer.model)
        if session.is_distributed:
            parts: list[Any] = [None] * session.world_size
            dist.all_gather_object(parts, params)
            params = {k: v for part in parts for k, v in part.items()}
        from shardwise.models.gpt2_qkv import fuse_split_state  # defers torch

        params = fuse_split_state(params)  # GPT-2 under TP trains c_attn as q/k/v: compare it fused
        from shardwise.models.moe import moe_layers  # defers torch

        layout = session.layout
        # MoE aux losses are per pipeline micro-batch (parallel/pipeline/moe.py): the reference splits too.
        split = layout.pp_microbatches if layout.pp > 1 and moe_layers(trainer.model) else 1
        result = {"losses": losses, "params": params, "dp_size": session.dp_size, "split": split,
                  "world_size": session.world_size, "strategy": session.strategy_name,
                  "degrees": {k: v for k, v in layout.to_dict().items() if k in DEGREES}}
        return result if session.is_main else None
    finally:
        session.close()


def verify_defaults(cfg: Any, steps: int, strategy: Any) -> Any:
    """``cfg`` with "auto" settings resolved for a verify: precision fp32 (the exact check; a lower
    precision is verified when asked for), compile as ``runtime.auto`` decides for ``steps`` steps."""
    from shardwise.runtime.auto import resolve_compile_in  # defers torch

    if cfg.parallel.precision == "auto":
        cfg = replace_in(cfg, **{"parallel.precision": "fp32"})
    resolved, _ = resolve_compile_in(replace_in(cfg, **{"train.steps": steps}), strategy,
                                     world_size=cfg.parallel.nproc)
    return replace_in(cfg, **{"train.compile": resolved.train.compile})


def verify_overrides(overrides: list[str]) -> list[str]:
    """The user's ``--set`` overrides, after verify's own: the peak learning rate from step 1.

    Under the recipe's warmup the few verified steps barely move the weights, and a layout that
    trained a weight wrong (two copies of a tied weight) passed within the tolerance; at the peak
    rate it fails clearly. A ``train.warmup_steps`` the user sets is kept.
    """
    if any(o.split("=", 1)[0].strip() == "train.warmup_steps" for o in overrides):
        return list(overrides)
    return ["train.warmup_steps=0", *overrides]


def reference_config(cfg: Any, dp_size: int, split: int = 1) -> Any:
    """The single-process twin of ``cfg``: one rank reading the strategy's whole global batch.

    ``split``: the strategy's micro-batches are cut into that many micro-batches that the loss
    treats separately (a mixture-of-experts model's aux loss under pipeline parallel is one per
    pipeline micro-batch, ``parallel/pipeline/moe.py``), so the reference accumulates as many smaller
    ones. The sampler interleaves the dp ranks' rows, so pipeline micro-batch j of every replica
    together is contiguous block j of the global micro-batch: the same rows.
    """
    return replace_in(cfg, **{
        "train.micro_batch_size": cfg.train.micro_batch_size * dp_size // split,
        "train.grad_accum_steps": cfg.train.grad_accum_steps * split,
        "parallel.strategy": "single", "parallel.nproc": 1, "parallel.tp": 1, "parallel.pp": 1,
        "parallel.dp": 0, "parallel.sequence_parallel": False, "parallel.ep": 1, "parallel.cp": 1,
        "parallel.activation_checkpointing": "none",  # recomputation changes memory, never the numbers
        # The reference runs eager: a compiled strategy run is checked against plain PyTorch, so
        # verify also proves that compiling (fused kernels, reordered reductions) kept the numbers.
        "train.compile": "false",
        "checkpoint.resume": "",
    })


def compare(reference: dict[str, Any], candidate: dict[str, Any], precision: str, *,
            loss_tol: float | None = None, param_tol: float | None = None) -> VerifyReport:
    """Return the report comparing a strategy result with the reference (both from ``run_steps``)."""
    loss_atol, loss_rtol, default_param_tol = TOLERANCES[precision]
    worst, worst_name = 0.0, ""
    missing = sorted(set(reference["params"]) - set(candidate["params"]))
    for name, ref in reference["params"].items():
        got = candidate["params"].get(name)
        if got is None:
            continue
        diff = (ref.double() - got.double()).abs().max().item() if ref.numel() else 0.0
        if diff > worst or not worst_name:
            worst, worst_name = diff, name
    return VerifyReport(
        strategy=candidate.get("strategy", "?"), world_size=candidate.get("world_size", 0),
        precision=precision, reference_losses=list(reference["losses"]),
        strategy_losses=list(candidate["losses"]), max_param_diff=worst, worst_param=worst_name,
        loss_atol=loss_atol if loss_tol is None else loss_tol,
        loss_rtol=loss_rtol if loss_tol is None else 0.0,
        param_tol=default_param_tol if param_tol is None else param_tol, missing_params=missing,
        degrees=dict(candidate.get("degrees", {})),
    )


# ------------------------------------------------------------------------------ driver
def verify(cfg: Any, nproc: int, steps: int, out: str | Path, *, loss_tol: float | None = None,
           param_tol: float | None = None) -> VerifyReport:
    """Run ``cfg``'s strategy on ``nproc`` ranks (torchrun) and the single-process reference.

    ``cfg`` is a validated RunConfig whose ``parallel.strategy`` names the strategy; the run
    directories go under ``out``. Raises ShardwiseError when either run fails.
    """
    import torch  # defers torch

    out = Path(out)
    strategy_dir = out / "strategy"
    strategy_dir.mkdir(parents=True, exist_ok=True)
    cfg = replace_in(cfg, **{"checkpoint.resume": "", "parallel.nproc": nproc})
    config_path = strategy_dir / "config.toml"
    config_path.write_text(to_toml(cfg))
    result_path = strategy_dir / "verify-result.pt"
    result_path.unlink(missing_ok=True)
    rc = run_torchrun(LaunchSpec(nproc=nproc, run_id=f"verify-{os.getpid()}"),
                      ["-m", "shardwise.verify", "--worker", str(config_path), "--out",
                       str(strategy_dir), "--steps", str(steps)])
    if rc != 0 or not result_path.exists():
        failures = sorted(strategy_dir.glob("failure-rank*.json"))
        detail = json.loads(failures[0].read_text())["error"] if failures else f"torchrun exit code {rc}"
        raise ShardwiseError(f"the {cfg.parallel.strategy} run failed: {detail}")

    candidate = torch.load(result_path, weights_only=True)
    reference = run_steps(reference_config(cfg, candidate["dp_size"], candidate.get("split", 1)), steps,
                          out / "reference")
    assert reference is not None  # one process is rank 0
    report = compare(reference, candidate, cfg.parallel.precision, loss_tol=loss_tol, param_tol=param_tol)
    (out / "verify.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check a strategy against the single-process reference (losses, weights)",
        description="Train the same recipe/TOML for a few steps under STRATEGY on N ranks and as "
        "one process, on the same global batches from the same initial weights; print per-step "
        "losses and the final parameter difference; exit 0 only if within tolerance "
        "(loss: atol + rtol x |reference|; params: max absolute difference. fp32: 1e-5 + 1e-4, "
        "5e-3; bf16-mixed: 1e-2 + 1e-2, 5e-2; fp16-mixed: 5e-3 + 5e-3, 5e-2; bf16-true: "
        "2e-2 + 2e-2, 1e-1).",
    )
    p.add_argument("recipe", nargs="?", default=None, metavar="RECIPE_OR_TOML")
    p.add_argument("--strategy", default=None,
                   help="the strategy to verify, e.g. fsdp, zero2, hsdp (with --resume: the config's by default)")
    p.add_argument("--nproc", type=int, default=2, help="ranks for the strategy run (default 2)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to compare (default 5)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, help="folder for both runs (default runs/verify-<strategy>)")
    p.add_argument("--loss-tol", type=float, default=None,
                   help="override the loss tolerance with one absolute bound")
    p.add_argument("--param-tol", type=float, default=None, help="override the parameter tolerance")
    p.add_argument("--dry-run", action="store_true",
                   help="check the strategy run (layout, meta-device model) and print its layout and "
                   "per-rank memory prediction without starting any rank")
    p.add_argument("--resume", action="store_true",
                   help="instead: check that a run interrupted twice (SIGTERM, then SIGINT) and resumed equals "
                   "the uninterrupted run, step by step and in its final weights (runs `shardwise train`)")
    p.add_argument("--resume-nproc", type=int, default=None, metavar="M",
                   help="with --resume: run the last resumed part on M ranks (then close, not bit for bit)")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from shardwise.parallel.implementations import get_strategy  # defers torch

    if not 1 <= args.nproc <= 4096:
        raise ConfigError(f"--nproc must be at least 1 (and at most 4096), got {args.nproc}.")
    if not 1 <= args.steps <= 10**6:
        raise ConfigError(f"--steps must be at least 1 (and at most 1000000), got {args.steps}.")
    for flag, tol in (("--loss-tol", args.loss_tol), ("--param-tol", args.param_tol)):
        if tol is not None and not (math.isfinite(tol) and tol >= 0):
            raise ConfigError(f"{flag} must be a finite number >= 0, got {tol}.")
    if args.resume:
        return _cmd_verify_resume(args)
    if not args.strategy:
        raise ConfigError("shardwise verify needs --strategy (the strategy to check against one process), "
                          "or --resume (check that an interrupted and resumed run equals an uninterrupted one).")
    cfg = load_config(args.recipe, [*verify_overrides(args.overrides), f"parallel.strategy={args.strategy}"])
    # Bad combinations, data or model shapes are refused here, once, before any process starts.
    # --dry-run writes nothing: the data cache is only read.
    with read_only() if args.dry_run else contextlib.nullcontext():
        checked = check_run(cfg, args.nproc, ranks_per_node=args.nproc)
    out = Path(args.out or f"runs/verify-{checked.layout.strategy.replace('+', '_')}")
    cfg = replace_in(checked.config, **{"parallel.nproc": args.nproc})
    cfg = verify_defaults(cfg, args.steps, get_strategy(checked.layout))
    if args.dry_run:
        print(dry_run_report(ResolvedRun(cfg, checked, args.nproc, 1, out), what="verify"))
        return 0
    # The verify folder is verify's own (rewritten by every verify into it), held for the job.
    lock = lock_run_dir(out, new_launch_id(), "shardwise verify")
    try:
        if holds_run(lock.run_dir):
            raise ConfigError(f"{lock.run_dir} is a training run's directory; verify writes its own runs "
                              "and verify.json: choose another --out.")
        report = verify(cfg, args.nproc, args.steps, lock.run_dir, loss_tol=args.loss_tol,
                        param_tol=args.param_tol)
    finally:
        lock.release()
    print(report.table())
    return 0 if report.passed else 1


def _cmd_verify_resume(args: argparse.Namespace) -> int:
    from shardwise.runtime.auto import resolve_precision  # defers torch

    if args.resume_nproc is not None and not 1 <= args.resume_nproc <= 4096:
        raise ConfigError(f"--resume-nproc must be at least 1 (and at most 4096), got {args.resume_nproc}.")
    overrides = list(args.overrides) + ([f"parallel.strategy={args.strategy}"] if args.strategy else [])
    cfg = load_config(args.recipe, overrides)
    checked = check_run(cfg, args.nproc, ranks_per_node=args.nproc)  # refused here, before any run
    out = Path(args.out or f"runs/verify-resume-{checked.layout.strategy.replace('+', '_')}")
    # The bounds of the run's precision ("auto" as the runs decide it).
    loss_atol, _rtol, param_tol = TOLERANCES[resolve_precision(cfg.parallel.precision).value]
    report = verify_resume(args.recipe, overrides, strategy=None, nproc=args.nproc, steps=args.steps,
                           out=out, resume_nproc=args.resume_nproc, reshard_tolerance=(loss_atol, param_tol))
    (out / "verify-resume.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    print(report.table())
    return 0 if report.passed else 1


def _worker_main(argv: list[str]) -> int:
    """Per-rank entry under torchrun: run the steps, rank 0 saves the result for the driver."""
    p = argparse.ArgumentParser(prog="shardwise.verify --worker")
    p.add_argument("--worker", required=True, metavar="CONFIG_TOML")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        import torch  # defers torch

        result = run_steps(load_config(args.worker), args.steps, args.out)
        if result is not None:
            torch.save(result, Path(args.out) / "verify-result.pt")
        return 0
    except ShardwiseError as e:
        (Path(args.out) / f"failure-rank{rank}.json").write_text(json.dumps({"rank": rank, "error": str(e)}))
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    from shardwise.job.exit import exit_rank

    exit_rank(_worker_main(sys.argv[1:]))  # no interpreter teardown after the work is done (job/exit.py)
