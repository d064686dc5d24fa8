"""What ``"auto"`` stands for in ``parallel.precision`` and ``train.compile``: the one place that decides.

The launcher (``shardwise train``, and so ``shardwise bench``), the built-in trainer and the Session
API all ask here, so the same job gets the same choice whichever way it was started. The launcher
writes the resolved value into the run's ``config.toml``: a resumed run keeps what it started with.

* precision: ``bf16-mixed`` on a CUDA device with bfloat16 (compute capability 8.0+), ``fp32`` on
  the CPU and on GPUs without bfloat16 (fp16 needs loss scaling, which changes which steps run: it
  stays an explicit choice).
* compile: on where it pays back its own cost within the run. The cost is the compile time, the
  gain the per-step time it saves; both come from this machine's earlier runs of the same job shape
  (``CompileRecord``, cached per device and job shape), or from priors until there is one:

  ======  ===============  ===============  ======================================================
  device  compile time     step-time gain   source of the prior
  ======  ===============  ===============  ======================================================
  cuda    60 s             14 %             torchtitan's Llama 3.1 8B on 8 H100: 5,762 -> 6,667
                                            tokens/s/GPU (+16 %, i.e. 14 % less time per step)
  cpu     60 s             29 %             the lab model on this project's 2-core machine: 1.40x
  ======  ===============  ===============  ======================================================

  and the eager step time from the cache, else 0.1 s (cuda) / 0.3 s (cpu). Compile is turned on
  when ``steps x gain_per_step > compile_time``; off when the strategy or machine cannot compile
  (the reason is the refusal ``check_compile`` would raise for an explicit ``true``), and off on
  other device types, where it is not known to help. Explicit ``true``/``false`` always win.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.core.config import AUTO, RunConfig, replace_in
from shardwise.device import accelerator_count
from shardwise.fsutil import atomic_write_json
from shardwise.parallel.compile import compile_refusal

# Priors until this machine has measured the job (see the module docstring for their sources).
PRIOR_COMPILE_S = {"cuda": 60.0, "cpu": 60.0}
PRIOR_GAIN_FRACTION = {"cuda": 1 - 5762 / 6667, "cpu": 1 - 1 / 1.40}
PRIOR_EAGER_STEP_S = {"cuda": 0.1, "cpu": 0.3}
# Steady-state steps are those after this many (the first ones hold compilation and warm-up).
WARMUP_STEPS = 3
_CACHE_NAME = "compile_gain.json"


@dataclass(frozen=True)
class Choice:
    """A resolved setting: the value used and why (one line for the run's log)."""

    value: Any
    reason: str
    auto: bool  # True when "auto" decided it


@dataclass(frozen=True)
class CompileRecord:
    """What this machine measured for one job shape: seconds; None where not measured yet."""

    compile_s: float | None = None  # the first steps' excess over the steady step, compiled
    compiled_step_s: float | None = None
    eager_step_s: float | None = None


# ------------------------------------------------------------------ precision
def device_type(device: torch.device | str | None = None) -> str:
    """The device type this process trains on ("cuda" when a GPU is visible, else "cpu")."""
    if device is not None:
        return torch.device(device).type
    return "cuda" if accelerator_count() else "cpu"


def _bf16_ok(dev_type: str) -> bool:
    return dev_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_precision(value: str, device: torch.device | str | None = None) -> Choice:
    """``parallel.precision`` for ``device``: explicit values as they are; "auto" as the module says."""
    if value != AUTO:
        return Choice(value, "set explicitly", auto=False)
    dev = device_type(device)
    if dev == "cuda":
        if _bf16_ok(dev):
            return Choice("bf16-mixed", "the GPU supports bfloat16", auto=True)
        return Choice("fp32", "the GPU has no bfloat16 (fp16-mixed needs loss scaling: set it explicitly)",
                      auto=True)
    # Not "bf16 is slower here": on a CPU with native bfloat16 (AVX512-BF16, AMX) bf16 autocast can
    # be faster (2.2x on this project's EPYC machine, docs/performance.md); the CPU keeps fp32 so
    # that CPU runs (tests, verify's references, notebooks) compare in full precision everywhere.
    return Choice("fp32", f"the {dev} default: full precision; bf16-mixed is an explicit choice there", auto=True)


# ------------------------------------------------------------------ compile
def compile_flag(value: Any) -> str:
    """``train.compile`` as one of "auto", "true", "false" (TOML booleans and old bool configs)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).strip().lower()


def resolve_compile(value: Any, device: torch.device | str | None = None, *, steps: int | None,
                    unsupported: str | None = None, record: CompileRecord | None = None) -> Choice:
    """Whether to ``torch.compile`` (a Choice of bool): explicit values win; "auto" compiles where
    the estimated gain over ``steps`` exceeds the compile time (see the module docstring).

    ``steps``: the optimizer steps the run will take (None: unknown, taken as long on a GPU).
    ``unsupported``: why this strategy/machine cannot compile (None when it can).
    ``record``: this machine's measurements for the job shape (``load_record``).
    """
    flag = compile_flag(value)
    if flag != AUTO:
        return Choice(flag == "true", "set explicitly", auto=False)
    dev = device_type(device)
    if unsupported:
        return Choice(False, f"off: {unsupported}", auto=True)
    if dev not in PRIOR_COMPILE_S:
        return Choice(False, f"off: not known to help on {dev}", auto=True)
    rec = record or CompileRecord()
    compile_s = rec.compile_s if rec.compile_s is not None else PRIOR_COMPILE_S[dev]
    source = "measured here" if rec.compile_s is not None else "prior"
    if rec.eager_step_s is not None and rec.compiled_step_s is not None:
        gain_s = rec.eager_step_s - rec.compiled_step_s
        gain_source = "measured here"
        if gain_s <= 0:
            return Choice(False, f"off: measured here, compiled steps are not faster ({rec.compiled_step_s:.3g} s vs "
                                 f"{rec.eager_step_s:.3g} s eager)", auto=True)
    else:
        frac = PRIOR_GAIN_FRACTION[dev]
        if rec.eager_step_s is not None:
            step_s = rec.eager_step_s
        elif rec.compiled_step_s is not None:
            step_s = rec.compiled_step_s / (1 - frac)
        else:
            step_s = PRIOR_EAGER_STEP_S[dev]
        gain_s = frac * step_s
        gain_source = f"prior {frac:.0%} of a {step_s:.3g} s step"
    break_even = compile_s / gain_s
    numbers = (f"compile {compile_s:.0f} s ({source}) vs {gain_s * 1e3:.3g} ms saved per step ({gain_source}): "
               f"pays back after {break_even:,.0f} steps")
    if steps is None:
        # A GPU job is long as a rule; a CPU one is as often a test or a notebook, where minutes of
        # C++ compilation would dominate: there it needs a known length.
        if dev == "cuda":
            return Choice(True, f"on: run length unknown, taken as long; {numbers}", auto=True)
        return Choice(False, f"off: run length unknown (pass steps= to the Session); {numbers}", auto=True)
    if steps > break_even:
        return Choice(True, f"on: {steps:,} steps; {numbers}", auto=True)
    return Choice(False, f"off: {steps:,} steps is too short; {numbers}", auto=True)


# ------------------------------------------------------------------ the measurements cache
def _cache_path(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir) / _CACHE_NAME
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "shardwise" / _CACHE_NAME


def job_key(cfg: RunConfig, device: torch.device | str | None = None, world_size: int | None = None) -> str:
    """The job shape a compile measurement belongs to: device model, model, batch, precision, layout."""
    dev = device_type(device)
    name = torch.cuda.get_device_name() if dev == "cuda" and torch.cuda.is_available() else dev
    p, t = cfg.parallel, cfg.train
    shape = {"device": name, "torch": torch.__version__, "model": dataclasses.asdict(cfg.model),
             "lora": dataclasses.asdict(cfg.lora), "data": cfg.data.kind, "mb": t.micro_batch_size,
             "accum": t.grad_accum_steps, "precision": p.precision, "strategy": p.strategy,
             "ranks": world_size or p.nproc, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ac": p.activation_checkpointing}
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_record(key: str, cache_dir: str | Path | None = None) -> CompileRecord | None:
    """This machine's measurements for job ``key`` (None when there are none, or the cache is unreadable)."""
    try:
        raw = json.loads(_cache_path(cache_dir).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(raw, dict):
        return None
    fields = {f.name for f in dataclasses.fields(CompileRecord)}
    return CompileRecord(**{k: float(v) for k, v in raw.items() if k in fields and isinstance(v, (int, float))})


def record_run(key: str, compiled: bool, step_times_s: list[float],
               cache_dir: str | Path | None = None) -> CompileRecord | None:
    """Add one run's measurement to the cache; return the job's record (None: too few steps to tell).

    The steady step is the median after the first ``WARMUP_STEPS``; a compiled run's compile time
    is what its first steps took beyond that many steady steps.
    """
    if len(step_times_s) <= WARMUP_STEPS + 2:
        return None
    steady = sorted(step_times_s[WARMUP_STEPS:])[len(step_times_s[WARMUP_STEPS:]) // 2]
    old = load_record(key, cache_dir) or CompileRecord()
    if compiled:
        first = sum(step_times_s[:WARMUP_STEPS]) - WARMUP_STEPS * steady
        new = dataclasses.replace(old, compile_s=max(first, 0.0), compiled_step_s=steady)
    else:
        new = dataclasses.replace(old, eager_step_s=steady)
    path = _cache_path(cache_dir)
    try:
        cached = json.loads(path.read_text())
        cached = cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        cached = {}
    cached[key] = {k: v for k, v in dataclasses.asdict(new).items() if v is not None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, cached)
    except OSError:
        pass  # a read-only home: the next run estimates from the priors again, nothing is wrong
    return new


# ------------------------------------------------------------------ whole configs
def resolve_precision_in(cfg: RunConfig, device: torch.device | str | None = None) -> tuple[RunConfig, list[str]]:
    """``cfg`` with ``parallel.precision`` resolved for ``device``, and a log line when "auto" decided."""
    prec = resolve_precision(cfg.parallel.precision, device)
    if not prec.auto:
        return cfg, []
    return (replace_in(cfg, **{"parallel.precision": prec.value}),
            [f"parallel.precision = 'auto' -> {prec.value!r} ({prec.reason})"])


def resolve_compile_in(cfg: RunConfig, strategy: Any, device: torch.device | str | None = None, *,
                       world_size: int | None = None, measured: bool = True) -> tuple[RunConfig, list[str]]:
    """``cfg`` with ``train.compile`` resolved for ``strategy`` on ``device`` over ``train.steps``, and a
    log line when "auto" decided (precision must be resolved first: it is part of the job's shape).

    ``measured=False``: decide from the priors only. The nodes of a multi-node job each resolve their
    own config and must reach the same one (it names their rendezvous), but each has its own cache.
    """
    if compile_flag(cfg.train.compile) != AUTO:
        return cfg, []
    dev = device_type(device)
    comp = resolve_compile(AUTO, dev, steps=cfg.train.steps,
                           unsupported=compile_refusal(strategy, cfg.parallel, dev),
                           record=load_record(job_key(cfg, dev, world_size)) if measured else None)
    flag = "true" if comp.value else "false"
    return replace_in(cfg, **{"train.compile": flag}), [f"train.compile = 'auto' -> {flag} ({comp.reason})"]


def peer_defaults(cfg: RunConfig) -> RunConfig:
    """``cfg`` as a plain PyTorch / Accelerate / Fabric loop runs it by default: "auto" becomes
    fp32 and no compile (the reference loops of ``shardwise bench`` compare defaults with defaults)."""
    changes: dict[str, Any] = {}
    if cfg.parallel.precision == AUTO:
        changes["parallel.precision"] = "fp32"
    if compile_flag(cfg.train.compile) == AUTO:
        changes["train.compile"] = "false"
    return replace_in(cfg, **changes) if changes else cfg


def resolved_config(cfg: RunConfig, session: Any) -> RunConfig:
    """``cfg`` with the precision and compile ``session`` runs (what it resolved "auto" to)."""
    return replace_in(cfg, **{"parallel.precision": session.options.precision,
                              "train.compile": "true" if session.compile else "false"})
