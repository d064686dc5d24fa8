"""Fit the planner's per-GPU-generation constants on published training runs, and print the errors.

Data: ``benchmarks/published_runs.json`` (every run cites its source and table; configuration a
source does not state is listed under ``assumed``). Each run is planned exactly as ``shardwise
plan`` would plan it (same ModelSpec, Cluster, Workload, Layout, ``advice.evaluate``), with the
run's own strategy, degrees, micro-batch and checkpointing, and a zero safety margin.

    python benchmarks/calibrate_planner.py              # fit, then print the error table
    python benchmarks/calibrate_planner.py --no-fit     # evaluate the constants in plan/cost.py
    python benchmarks/calibrate_planner.py --markdown   # the table docs/planner.md shows
    python benchmarks/calibrate_planner.py --by-source  # leave-one-source-out error per source
    python benchmarks/calibrate_planner.py --blind      # the held-out sources, against the 10 % goal
                                                        # (and their memory, where a source reads it)

Sources marked ``"held_out": true`` never enter a fit. Every run is scored: a layout the planner
cannot express is a refusal (no prediction, a wrong verdict for a run that ran), never a skipped
row. Each run's stack properties (``kernels``) are read through ``plan --stack-set``'s parser.

The fit (runs marked ``"split": "fit"`` only) minimises the mean squared log error of predicted
tokens/s per GPU over: per generation (a100, h100) the matmul and attention factors (fractions of
the GPU's published kernel ceilings, presets.KERNEL_CEILINGS, confined to cost.FACTOR_BANDS) and
the link efficiency, each with a weak prior at its typical value (PRIORS, per generation where
published kernel measurements differ: GENERATION_PRIORS); shared by all, the elementwise traffic
factor. The allocator fragmentation is fitted on the published peak-memory readings of the
fitted runs. Held-out runs never enter the fit. The
printed ``CALIBRATIONS`` block is what ``src/shardwise/plan/cost.py`` holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing

from shardwise.core.config import ConfigError  # noqa: E402
from shardwise.core.families import CP_FAMILIES  # noqa: E402
from shardwise.core.strategies import REGISTRY  # noqa: E402
from shardwise.plan.advice import (  # noqa: E402
    GIB,
    RUNTIME_RESERVE_GIB,
    Cluster,
    Workload,
    evaluate,
    predict_step_time,
)
from shardwise.plan.cost import (  # noqa: E402
    CALIBRATIONS,
    FACTOR_BANDS,
    TYPICAL_OF_PEAK,
    Calibration,
    flops_per_token,  # noqa: E402
)
from shardwise.plan.memory import Kernels, Layout  # noqa: E402
from shardwise.plan.pipeline import with_stack_split  # noqa: E402
from shardwise.plan.presets import attention_op, ceiling, gpu, gpu_from_dict, model_preset  # noqa: E402
from shardwise.plan.spec import ROOT_UNIT, ModelSpec, ParamInfo, from_gpt2_like, from_hf_config_dict  # noqa: E402
from shardwise.plan.stacks import stack_settings  # noqa: E402

DATA = Path(__file__).with_name("published_runs.json")
GENERATIONS = ("a100", "h100")
PER_GENERATION = ("matmul_factor", "attention_factor", "link_efficiency")
SHARED = ("elementwise_passes",)
# Weak priors: what each constant is where the runs say little about it (when the one source that
# carries the long-sequence runs, or the communication-bound ones, is held out, the others cannot
# pin the attention factor or the link efficiency and the fit ran to its bounds). The priors are
# the typical values (cost.TYPICAL_OF_PEAK: the two factors' as fractions of the dense peak, turned
# into fractions of the generation's measured ceilings by ``prior``; NCCL bus bandwidth at 0.75 of
# the line rate), and weigh as PRIOR_RUNS runs. The elementwise traffic factor has no prior: it is
# a lumped count with no typical value.
PRIORS = {"matmul_factor": TYPICAL_OF_PEAK["matmul"], "attention_factor": TYPICAL_OF_PEAK["attention"],
          "link_efficiency": 0.75}
# Per generation where the kernels' published fractions of peak differ: FlashAttention-2 reaches
# 50-73 % of the A100's peak (Dao 2023, arXiv:2307.08691, abstract) but "only 35 %" of the
# H100's (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, abstract): the H100 attention
# prior is the A100's times 35 / 61.5 (the A100 range's midpoint).
GENERATION_PRIORS = {"h100": {"attention_factor": PRIORS["attention_factor"] * 35 / 61.5}}
# The catalog GPU whose ceilings turn a generation's priors into fractions of the ceiling (every
# GPU of a generation shares its ceiling row: presets.GPUS).
GENERATION_GPU = {"a100": "a100-80gb", "h100": "h100-sxm"}
PRIOR_RUNS = 1.0
BOUNDS = {"link_efficiency": (0.2, 1.0), "elementwise_passes": (0.0, 20.0), "fragmentation": (0.0, 0.5)}


def bounds(name: str, gen: str | None = None) -> tuple[float, float]:
    """Where the fit may put a constant: its generation's band (cost.FACTOR_BANDS), else BOUNDS."""
    return FACTOR_BANDS.get(gen or "", {}).get(name) or BOUNDS[name]


def prior(name: str, gen: str | None = None) -> float | None:
    """A constant's prior in its own units (GENERATION_PRIORS, else PRIORS; None: no prior): a
    factor's typical fraction of peak over the generation's measured ceiling (it may fall outside
    the band, which the fit's bounds then enforce)."""
    typical = GENERATION_PRIORS.get(gen or "", {}).get(name, PRIORS.get(name))
    if typical is None or name not in FACTOR_BANDS.get(gen or "", {}):
        return typical
    # The typical attention fractions of peak are FlashAttention-2's (the kernel of the runs and
    # papers they come from), so that prior is over FlashAttention-2's ceiling (presets.attention_op).
    op = {"matmul_factor": "matmul", "attention_factor": attention_op("flash2")}[name]
    return typical / ceiling(gpu(GENERATION_GPU[gen or ""]), op, "bf16")[0]


# ------------------------------------------------------------------------------ runs -> planner inputs
def model_spec(model: str | dict[str, Any]) -> ModelSpec:
    """A run's model: a planner preset name, or an inline description of an MPT / Megatron GPT."""
    if isinstance(model, str):
        return model_preset(model)
    family = model["family"]
    if family == "hf":  # a Hugging Face config.json, inline: what `plan --hf-config` reads
        return from_hf_config_dict(model["config"], model["name"])
    spec = from_gpt2_like(model["name"], n_layers=model["layers"], hidden=model["hidden"], n_heads=model["heads"],
                          vocab=model["vocab"], n_positions=model["positions"])
    if family in ("mpt", "megatron-gpt"):
        return spec  # GPT-2 blocks (biases, 4h GELU MLP), learned positions, tied head
    if family == "bloom":  # ALiBi (no position table), a LayerNorm after the word embedding, tied head
        h = model["hidden"]
        params = tuple(q for q in spec.params if q.name != "transformer.wpe.weight")
        params = (*params[:1], ParamInfo("transformer.word_embeddings_layernorm.weight", (h,), ROOT_UNIT),
                  ParamInfo("transformer.word_embeddings_layernorm.bias", (h,), ROOT_UNIT), *params[1:])
        return replace(spec, params=params, n_params=sum(q.numel for q in params), learned_positions=False,
                       max_seq=model["positions"])
    if family == "megatron-gpt-untied":
        head = ParamInfo("lm_head.weight", (model["vocab"], model["hidden"]), ROOT_UNIT)
        return replace(spec, tied_embeddings=False, params=(*spec.params, head), n_params=spec.n_params + head.numel)
    raise SystemExit(f"unknown model family {family!r} in {DATA.name}")


@dataclass
class Case:
    """One published run, ready to evaluate."""

    run: dict[str, Any]
    spec: ModelSpec
    cluster: Cluster
    work: Workload
    layout: Layout
    published_tps: float | None
    # Why the planner cannot express this run's layout ('' when it can): such a run has no
    # prediction and counts as a miss, never as a skipped row.
    refused: str = ""
    source_held_out: bool = False

    @property
    def id(self) -> str:
        return self.run["id"]

    @property
    def fitted(self) -> bool:
        return self.run["split"] == "fit" and not self.source_held_out and not self.refused


def published_tokens_per_s(run: dict[str, Any], spec: ModelSpec) -> float | None:
    """Tokens/s per GPU: as published, or from teraFLOP/s with the source's own FLOP formula."""
    pub = run["published"]
    if "tokens_per_s_per_gpu" in pub:
        return float(pub["tokens_per_s_per_gpu"])
    if "step_time_s" in pub:  # seconds per optimizer step of global_batch sequences of run["seq"] tokens
        return pub["global_batch"] * run["seq"] / pub["step_time_s"] / run["gpus"]
    if "tflops_per_gpu" not in pub:
        return None
    s, L, h, V = run["seq"], spec.n_layers, spec.hidden, spec.vocab
    assert L and h and V
    formula = pub["flops_formula"]
    if formula == "narayanan2021-eq3":  # with recomputation: 96 B s l h^2 (1 + s/6h + V/16lh) per iteration
        per_token = 96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    elif formula == "megatron-model-flops":  # 72 B s l h^2 (1 + s/6h + V/12lh)
        per_token = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    elif formula == "megatron-core-2025":
        # Megatron-Core's num_floating_point_operations since ADLR/megatron-lm!2789 (2025-03-06, in
        # force at the source's runs; megatron/training/training.py at aecce9e9, 2025-11-04): GQA
        # projections 12 L h qd (1 + g/n), the causal core attention halved (6 L s qd: "Only half of
        # the attention matrix is non-zero"), SwiGLU MLPs (routed experts: top_k of them), the
        # logits 6 h V; no router, no norms. (V unpadded here: Megatron pads it to 128 x tp, < 0.2 %.)
        assert spec.n_heads and spec.head_dim and spec.n_kv_heads
        qd = spec.n_heads * spec.head_dim
        attn = 12 * L * h * qd * (1 + spec.n_kv_heads / spec.n_heads) + 6 * L * s * qd
        if spec.moe is not None:
            moe_layers = spec.moe.n_moe_layers
            mlp = 6 * spec.moe.params_per_expert * spec.moe.top_k * moe_layers
            mlp += 18 * h * (spec.ffn_hidden or 0) * (L - moe_layers)
        else:
            mlp = 18 * h * (spec.ffn_hidden or 0) * L
        per_token = attn + mlp + 6 * h * V
    elif formula == "planner":  # the source states none: the planner's own convention (plan/cost.py)
        per_token = flops_per_token(spec, s)
    else:
        raise SystemExit(f"{run['id']}: unknown flops_formula {formula!r}")
    return pub["tflops_per_gpu"] * 1e12 / per_token


def run_layout(strategy: str, dp: int, tp: int, pp: int, **extra: Any) -> Layout:
    """The layout of a published run: shardwise's own strategy when the registry has it, else
    another stack's (Megatron's ddp+tp, zero1+tp, ...) described by what its dp ranks hold."""
    # Activations are modelled with sequence parallelism under TP (torchtitan's TP plans and
    # Megatron's --sequence-parallel; the constants were fitted that way) unless the run says its
    # stack had none (``"sequence_parallel": false``: BLOOM's Megatron-DeepSpeed).
    extra.setdefault("sequence_parallel", tp > 1)
    if strategy in REGISTRY:
        return Layout(strategy, dp=dp, tp=tp, pp=pp, **extra)
    base = strategy.split("+")[0]
    dp_kind = {"ddp": "replicate", "zero1": "zero1", "zero2": "zero2", "fsdp": "fsdp"}[base]
    return Layout.external_stack(strategy, dp_kind, dp=dp, tp=tp, pp=pp,
                                 shard=dp if dp_kind in ("zero2", "fsdp") else 1, **extra)


def run_kernels(run: dict[str, Any]) -> Kernels:
    """A run's stack properties, read as ``plan --stack-set KEY=VALUE`` reads them (plan/stacks.py):
    a run can state only what the CLI can say."""
    sets = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in run.get("kernels", {}).items()]
    kernels, _ = stack_settings("shardwise", sets)
    return kernels


def load_cases(data: dict[str, Any]) -> list[Case]:
    gpus = {name: gpu_from_dict({k: v for k, v in spec.items() if k != "why"}, f"{DATA.name} gpus.{name}")
            for name, spec in data.get("gpus", {}).items()}
    cases = []
    held_sources = {name for name, src in data["sources"].items() if src.get("held_out")}
    for run in data["runs"]:
        spec = model_spec(run["model"])
        if "published_params" in run and spec.n_params != run["published_params"]:
            raise SystemExit(f"{run['id']}: the spec has {spec.n_params} parameters, "
                             f"the source {run['published_params']}")
        n = run["gpus"]
        per_node = min(8, n)
        cluster = Cluster(gpus.get(run["gpu"]) or gpu(run["gpu"]), gpus_per_node=per_node, nodes=n // per_node)
        tp, pp = run["tp"], run["pp"]
        dp = n // (tp * pp)
        # A stack that gives the embedding and the head a block's slot each in the pipeline split
        # (BLOOM's --pp-partition-method 'type:transformer|embedding', Megatron's
        # --account-for-embedding/loss-in-pipeline-split) is the runtime's
        # parallel.pp_first_stage_fewer = 1 (plan --pp-first-stage-fewer 1; the end stages may hold no layer).
        extra = {"pp_first_stage_fewer": run["pp_first_stage_fewer"]} if "pp_first_stage_fewer" in run else {}
        if "sequence_parallel" in run:  # a stack without it (Megatron-DeepSpeed 2022): plan --sequence-parallel off
            extra["sequence_parallel"] = run["sequence_parallel"]
        for key in ("cp", "ep", "pp_schedule", "pp_stages_per_rank"):
            if run.get(key, 1) != 1:
                extra[key] = run[key]
        kernels = run_kernels(run)
        if kernels.ep_groups != Kernels().ep_groups:  # the stack's expert groups (plan --stack-set ep_groups)
            extra["ep_groups"] = kernels.ep_groups
        if kernels.experts_tp:  # its experts tensor-parallel (plan --stack-set experts_tp=true)
            extra["experts_tp"] = True
        if kernels.zero1_group:  # its ZeRO-1 shard group (plan --stack-set zero1_group=G)
            extra["zero1_group"] = kernels.zero1_group
        work = Workload(seq=run["seq"], micro_batch=run["micro_batch"], grad_accum=run["grad_accum"],
                        precision=run["precision"], optimizer=run["optimizer"], checkpoint=run["checkpoint"],
                        attention=run["attention"], ac_every=run.get("ac_every", 2), grad_sync=run["grad_sync"],
                        kernels=kernels, safety_margin=0.0,
                        pp_schedule=run.get("pp_schedule", "1f1b"), pp_stages_per_rank=run.get("pp_stages_per_rank", 1),
                        cp_impl=run.get("cp_impl", "auto"))  # plan --cp-impl: the source's context-parallel kind
        refused = ""
        try:
            layout = run_layout(run["strategy"], dp, tp, pp, **extra)
            layout = with_stack_split(spec, layout, kernels.pp_split)  # plan --stack-set pp_split=cost
            if pp > 1 and spec.n_layers:  # the layout's stage split (a stage per rank and layer at most)
                layout.with_blocks(spec.n_layers)
            if run.get("cp", 1) > 1 and spec.moe is not None and spec.family not in CP_FAMILIES:
                raise ConfigError(f"context parallel does not run the {spec.family} family's attention")
        except ConfigError as e:  # a layout the planner (and the runtime) cannot express
            refused = str(e).split("\n")[0]
            plain = {k: v for k, v in extra.items() if k not in ("ep", "cp")}
            layout = run_layout(run["strategy"], dp, tp, pp, **plain)
        cases.append(Case(run, spec, cluster, work, layout, published_tokens_per_s(run, spec), refused,
                          run["source"] in held_sources))
    return cases


# ------------------------------------------------------------------------------ evaluation
@dataclass
class Result:
    case: Case
    predicted_tps: float
    memory_gib: float  # predicted peak reserved memory
    fits: bool
    verdict: str = "fits"  # the planner's fits / tight / no (advice.Candidate.verdict)

    @property
    def error(self) -> float | None:
        p = self.case.published_tps
        return None if p is None or self.case.refused else (self.predicted_tps - p) / p

    @property
    def verdict_right(self) -> bool:
        # A run that ran must not be called "no" (nor be refused); one that ran out of memory must be.
        if self.case.refused:
            return not self.case.run["ran"]
        return (self.verdict != "no") == self.case.run["ran"]

    @property
    def memory_error(self) -> float | None:
        pub = self.case.run["published"].get("memory_gib")
        return None if pub is None else (self.memory_gib - pub) / pub


def evaluate_case(case: Case, calibrations: dict[str, Calibration]) -> Result:
    calib = calibrations[case.cluster.gpu.calibration]
    if case.refused:
        return Result(case, float("nan"), float("nan"), False, "refused")
    cand = evaluate(case.spec, case.cluster, case.work, case.layout, calib)
    return Result(case, cand.time.tokens_per_s_per_gpu, cand.memory.total / GIB, cand.fits, cand.verdict)


def predicted_tps(case: Case, calibrations: dict[str, Calibration]) -> float:
    calib = calibrations[case.cluster.gpu.calibration]
    return predict_step_time(case.spec, case.cluster, case.work, case.layout, calib).tokens_per_s_per_gpu


def log_loss(cases: list[Case], calibrations: dict[str, Calibration]) -> float:
    errs = [math.log(predicted_tps(c, calibrations) / c.published_tps) ** 2 for c in cases if c.published_tps]
    return statistics.fmean(errs) if errs else 0.0


def prior_penalty(name: str, value: float, runs: int, gen: str | None = None) -> float:
    """What the fit adds to the mean squared log error of ``runs`` runs for a constant's distance
    from its prior (``prior``; 0 for the constants without one): the prior weighs as PRIOR_RUNS runs."""
    typical = prior(name, gen)
    if typical is None:
        return 0.0
    return PRIOR_RUNS * math.log(value / typical) ** 2 / max(runs, 1)


def golden_min(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-4) -> float:
    """Argmin of a unimodal f on [lo, hi] by golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol * max(1.0, abs(a) + abs(b)):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit(cases: list[Case], start: dict[str, Calibration],
        use: Callable[[Case], bool] = lambda c: c.fitted) -> dict[str, Calibration]:
    """Coordinate descent (golden section per constant) on the squared log error of the runs
    ``use`` picks (default: those marked ``"split": "fit"``)."""
    fitted = [c for c in cases if use(c) and c.published_tps]
    cal = dict(start)

    def with_value(name: str, gen: str | None, value: float) -> dict[str, Calibration]:
        out = dict(cal)
        for g in ([gen] if gen else GENERATIONS):
            out[g] = replace(out[g], **{name: value})
        return out

    def optimise(name: str, gen: str | None, cases_: list[Case]) -> None:
        nonlocal cal
        n = sum(1 for c in cases_ if c.published_tps)

        def objective(v: float) -> float:
            return log_loss(cases_, with_value(name, gen, v)) + prior_penalty(name, v, n, gen)

        best = golden_min(objective, *bounds(name, gen))
        cal = with_value(name, gen, best)

    previous = math.inf
    for _sweep in range(30):
        for name in SHARED:
            optimise(name, None, fitted)
        for gen in GENERATIONS:
            for name in PER_GENERATION:
                optimise(name, gen, [c for c in fitted if c.cluster.gpu.calibration == gen])
        loss = log_loss(fitted, cal)
        if previous - loss < 1e-7:
            break
        previous = loss
    # Fragmentation: the published peak readings (reserved memory) of the fitted runs.
    readings = [c for c in fitted if "memory_gib" in c.run["published"]]
    if readings:
        def memory_loss(v: float) -> float:
            trial = with_value("fragmentation", None, v)
            return statistics.fmean(math.log(evaluate_case(c, trial).memory_gib / c.run["published"]["memory_gib"]) ** 2
                                    for c in readings)
        cal = with_value("fragmentation", None, golden_min(memory_loss, *BOUNDS["fragmentation"]))
    counts = {g: sum(1 for c in fitted if c.cluster.gpu.calibration == g) for g in GENERATIONS}
    return {g: replace(cal[g], fitted_runs=counts[g]) for g in GENERATIONS}


# ------------------------------------------------------------------------------ reporting
def summary(results: list[Result]) -> dict[str, Any]:
    errs = [abs(r.error) for r in results if r.error is not None]
    # Memory where the source publishes it (a reading, not a bound: reported beside the goal).
    mem = [abs(r.memory_error) for r in results if not r.case.refused and r.memory_error is not None]
    return {"runs": len(results), "with_throughput": len(errs),
            "mean_abs_error": statistics.fmean(errs) if errs else float("nan"),
            "max_abs_error": max(errs) if errs else float("nan"),
            "verdicts_right": sum(r.verdict_right for r in results),
            "refused": sum(bool(r.case.refused) for r in results),
            "with_memory": len(mem), "memory_mean_abs_error": statistics.fmean(mem) if mem else float("nan"),
            "memory_within_10": sum(1 for e in mem if e <= 0.10)}


# The goal every report is checked against (issue: a planner right on runs it has never seen):
# a mean |throughput error| of at most 10 % and every fit verdict right, overall and separately on
# the MoE/EP and the context-parallel runs. Not a bound set at a reached value; a miss is printed.
GOAL_MEAN_ABS_ERROR = 0.10


def run_kind(case: Case) -> str:
    """The kind a run is reported under: moe-ep, cp, pp or dense (the first that applies)."""
    run = case.run
    if case.spec.moe is not None:
        return "moe-ep" if run.get("ep", 1) > 1 else "moe"
    if run.get("cp", 1) > 1:
        return "cp"
    return "pp" if run["pp"] > 1 else "dense"


def goal_check(label: str, results: list[Result]) -> str:
    """One line: the figures of ``results`` against GOAL_MEAN_ABS_ERROR and every verdict right."""
    s = summary(results)
    met = (s["with_throughput"] == s["runs"] - sum(1 for r in results if r.case.published_tps is None)
           and s["with_throughput"] > 0 and s["mean_abs_error"] <= GOAL_MEAN_ABS_ERROR
           and s["verdicts_right"] == s["runs"])
    err = (f"mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%} over {s['with_throughput']}"
           if s["with_throughput"] else "no throughput predicted")
    mem = (f"; memory mean |error| {s['memory_mean_abs_error']:.1%} over {s['with_memory']} "
           f"({s['memory_within_10']} within 10 %)" if s["with_memory"] else "")
    return (f"{label:28s} {s['runs']:>3} runs: {err}; verdicts right {s['verdicts_right']}/{s['runs']}; "
            f"refused {s['refused']}; goal (<= {GOAL_MEAN_ABS_ERROR:.0%} mean, every verdict right): "
            + ("MET" if met else "MISSED") + mem)


def blind(cases: list[Case], calibrations: dict[str, Calibration], rounds: dict[str, str] | None = None) -> str:
    """The held-out sources (``"held_out": true``), with the constants in plan/cost.py: per source,
    per blind round (``rounds``: source -> the round that first evaluated it), per kind, and each
    refused or wrong run by name."""
    held = [c for c in cases if c.source_held_out]
    results = evaluate_all(held, calibrations)
    lines = ["held-out sources, constants as in plan/cost.py (never fitted on these):"]
    for src in dict.fromkeys(c.run["source"] for c in held):
        lines.append("  " + goal_check(src, [r for r in results if r.case.run["source"] == src]))
    rounds = rounds or {}
    for name in dict.fromkeys(rounds[c.run["source"]] for c in held if c.run["source"] in rounds):
        part = [r for r in results if rounds.get(r.case.run["source"]) == name]
        lines.append("  " + goal_check(f"round {name}", part))
    for kind in ("moe-ep", "moe", "cp", "pp", "dense"):
        part = [r for r in results if run_kind(r.case) == kind]
        if part:
            lines.append("  " + goal_check(f"kind {kind}", part))
    lines.append("  " + goal_check("all held-out sources", results))
    for r in results:
        what = (f"refused: {r.case.refused}" if r.case.refused else
                f"predicted {r.predicted_tps:,.0f} vs {r.case.published_tps or float('nan'):,.0f} tok/s/GPU "
                f"({r.error:+.1%})" if r.error is not None else f"predicted {r.predicted_tps:,.0f}")
        mem = ""
        if not r.case.refused and r.memory_error is not None:
            mem = (f"; memory {r.memory_gib:.1f} vs {r.case.run['published']['memory_gib']:.1f} GiB "
                   f"({r.memory_error:+.1%})")
        lines.append(f"    {r.case.id:44s} {run_kind(r.case):6s} {what}; verdict {r.verdict}"
                     + ("" if r.verdict_right else " WRONG") + mem)
    return "\n".join(lines)


def evaluate_all(cases: list[Case], calibrations: dict[str, Calibration]) -> list[Result]:
    return [evaluate_case(c, calibrations) for c in cases]


def format_report(results: list[Result], markdown: bool = False) -> str:
    sources = {}
    lines = []
    head = ["run", "source", "GPUs", "layout", "published tok/s/GPU", "predicted", "error", "memory GiB (pred / pub)",
            "verdict", "split"]
    rows = []
    for r in results:
        c, run = r.case, r.case.run
        lay = c.layout
        layout = run["strategy"] + "".join(f" {k}{v}" for k, v in (("tp", lay.tp), ("pp", lay.pp)) if v > 1)
        layout += f", mb {run['micro_batch']}x{run['grad_accum']}, seq {run['seq']}, ckpt {run['checkpoint']}"
        pub_mem = run["published"].get("memory_gib")
        mem = f"{r.memory_gib:.1f}" + (f" / {pub_mem:.1f}" if pub_mem is not None else "")
        verdict = r.verdict + " / " + ("ran" if run["ran"] else "OOM") + (
            "" if r.verdict_right else " WRONG")
        rows.append([run["id"], run["source"], str(run["gpus"]), layout,
                     f"{c.published_tps:,.0f}" if c.published_tps else "-", f"{r.predicted_tps:,.0f}",
                     f"{r.error:+.1%}" if r.error is not None else "-", mem, verdict, run["split"]])
        sources[run["source"]] = True
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    else:
        widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in rows]
    lines.append("")
    for label, subset in (("fitted", [r for r in results if r.case.fitted]),
                          ("held-out", [r for r in results if not r.case.fitted]), ("all", results)):
        s = summary(subset)
        lines.append(f"{label:8s}: {s['runs']} runs, throughput on {s['with_throughput']}: mean |error| "
                     f"{s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%}; fit verdicts right "
                     f"{s['verdicts_right']}/{s['runs']}")
    by_source: dict[str, list[Result]] = {}
    for r in results:
        by_source.setdefault(r.case.run["source"], []).append(r)
    for src, subset in by_source.items():
        for label, part in (("fitted", [r for r in subset if r.case.fitted]),
                            ("held-out", [r for r in subset if not r.case.fitted])):
            s = summary(part)
            if not s["runs"]:
                continue
            err = (f"mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%} over "
                   f"{s['with_throughput']} runs" if s["with_throughput"] else "no throughput published")
            lines.append(f"  {src:22s} {label:8s}: {err}; verdicts {s['verdicts_right']}/{s['runs']}")
    mem = [r for r in results if r.memory_error is not None]
    for r in mem:
        pub = r.case.run["published"]["memory_gib"]
        lines.append(f"  memory {r.case.id}: predicted {r.memory_gib:.1f} GiB, published {pub} GiB "
                     f"({r.memory_error:+.1%}, {r.case.run['split']})")
    lines.append(f"(verdict: fits = predicted peak reserved memory <= GPU memory - {RUNTIME_RESERVE_GIB:.0f} GiB "
                 "runtime reserve (no safety margin), tight = above that but within the GPU's memory, no = above "
                 "it; right when a run that ran is not 'no' and one that ran out of memory is; 'ran' = the "
                 "source ran it)")
    return "\n".join(lines)


def leave_one_source_out(cases: list[Case], start: dict[str, Calibration]) -> dict[str, list[Result]]:
    """For each source, fit on every other source's runs (both split labels) and evaluate the
    whole source with those constants, which never saw it (a source shares a stack, a cluster and
    a way of measuring, so alternate rows of one table are not independent). Largest source first."""
    sources = sorted({c.run["source"] for c in cases}, key=lambda s: -sum(c.run["source"] == s for c in cases))
    out = {}
    for src in sources:
        cal = fit(cases, start, use=lambda c, src=src: c.run["source"] != src and not c.source_held_out
                  and not c.refused)
        out[src] = evaluate_all([c for c in cases if c.run["source"] == src], cal)
    return out


def by_source(cases: list[Case], start: dict[str, Calibration]) -> str:
    """The leave-one-source-out table (``leave_one_source_out``)."""
    lines = ["held-out source        runs  with tok/s  mean |error|  max |error|  verdicts right  (fitted on)"]
    errors: list[float] = []
    source_means: list[float] = []
    held = leave_one_source_out(cases, start)
    for src, results in held.items():
        s = summary(results)
        errors += [abs(r.error) for r in results if r.error is not None]
        if s["with_throughput"]:
            source_means.append(s["mean_abs_error"])
        err = (f"{s['mean_abs_error']:>11.1%}  {s['max_abs_error']:>11.1%}" if s["with_throughput"]
               else f"{'-':>11}  {'-':>11}")
        wrong = [r.case.id for r in results if not r.verdict_right]
        lines.append(f"{src:22s} {s['runs']:>4}  {s['with_throughput']:>10}  {err}  {s['verdicts_right']:>8}/"
                     f"{s['runs']:<5}  ({len(held) - 1} others)" + (f"  wrong: {', '.join(wrong)}" if wrong else ""))
    lines.append(f"all held-out runs: mean |error| {statistics.fmean(errors):.1%} over {len(errors)} runs; "
                 f"mean of the {len(source_means)} sources' means {statistics.fmean(source_means):.1%}")
    return "\n".join(lines)


def format_calibrations(calibrations: dict[str, Calibration]) -> str:
    """The CALIBRATIONS block for src/shardwise/plan/cost.py."""
    keys = (*PER_GENERATION, *SHARED, "fragmentation", "fitted_runs")
    out = ["CALIBRATIONS: dict[str, Calibration] = {"]
    for g, c in calibrations.items():
        values = dataclasses.asdict(c)
        args = ", ".join(f"{k}={values[k]:.4g}" if isinstance(values[k], float) else f"{k}={values[k]}" for k in keys)
        out.append(f"    {g!r}: Calibration({g!r}, {args}),")
    out.append("}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-fit", action="store_true", help="evaluate the constants in plan/cost.py, do not fit")
    p.add_argument("--markdown", action="store_true", help="print the run table as markdown")
    p.add_argument("--by-source", action="store_true",
                   help="leave-one-source-out: fit on all other sources, report the error per held-out source")
    p.add_argument("--blind", action="store_true",
                   help="evaluate the held-out sources only, with the constants in plan/cost.py (no fit)")
    p.add_argument("--json", metavar="PATH", help="also write every run's prediction to PATH")
    args = p.parse_args(argv)
    data = json.loads(DATA.read_text())
    cases = load_cases(data)
    calibrations = {g: CALIBRATIONS[g] for g in GENERATIONS}
    rounds = {name: src["blind"] for name, src in data["sources"].items() if src.get("blind")}
    if args.blind:
        print(blind(cases, calibrations, rounds))
        return 0
    if args.by_source:
        print(by_source(cases, calibrations))
        print(blind(cases, calibrations, rounds))
        return 0
    if not args.no_fit:
        calibrations = fit(cases, calibrations)
        print(format_calibrations(calibrations))
        print()
    results = evaluate_all(cases, calibrations)
    print(format_report(results, markdown=args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"id": r.case.id, "split": r.case.run["split"], "published": r.case.published_tps,
             "predicted": r.predicted_tps, "error": r.error, "memory_gib": r.memory_gib, "fits": r.fits,
             "ran": r.case.run["ran"]} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
