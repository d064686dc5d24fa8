"""The rehearsal's report: per played rank, memory by kind next to the plan, the collectives of
one step, time and host memory; and one verdict line for the whole run (text or ``--json``)."""

from __future__ import annotations

from typing import Any

from shardwise.plan.presets import gpu
from shardwise.rehearse.compare import compare_rank

GIB = 2**30
MIB = 2**20

# What playing a rank on fake ``cpu`` tensors does not see, printed with every such report.
FAKE_CPU_LIMITS = (
    "played on fake cpu tensors (this torch build has no CUDA; FSDP2 asks torch.cuda.current_device()): "
    "every tensor has its real shape, dtype and bytes, but there is no caching allocator (no block "
    "rounding or fragmentation), no CUDA context, NCCL buffers or kernel workspaces (cuBLAS, flash "
    "attention), and attention runs the CPU's SDPA kernel, whose saved tensors can differ from the "
    "CUDA kernels'. Wall times are the fake run's, not the GPU's."
)
UNMEASURED = (
    "not rehearsed: the NCCL flight recorder; DeepSpeed strategies (their engine allocates real "
    "buffers and runs its own collectives outside the fake backend). The roofline is a floor on the "
    "step's compute (every op at the GPU's peak or its memory bandwidth), not a prediction of it."
)


def roofline_s(ops: list[list[Any]], *, peak_flops: dict[str, float], bytes_per_s: float) -> float:
    """Seconds a played rank's grouped ops (``rehearse.roofline.OpCounter``: kind, FLOPs, bytes,
    count) take at the roofline: each op max(FLOPs / the peak of its kind, bytes / bandwidth), summed.
    ``peak_flops``: FLOP/s by kind ("16-bit", "fp32"); "other" ops (integer, boolean) by their bytes."""
    total = 0.0
    for kind, flops, nbytes, count in ops:
        peak = peak_flops.get(kind)
        compute = flops / peak if peak and flops else 0.0
        total += count * max(compute, nbytes / bytes_per_s)
    return total


def _price(compute: dict[str, Any], gpu_name: str) -> dict[str, Any]:
    """One step's counted ops priced on ``gpu_name``: FLOPs, bytes and the roofline seconds. fp32
    ops at the TF32 peak, as the planner prices an fp32 run (plan/advice.py)."""
    g = gpu(gpu_name)  # the planner's GPU table: one owner of peaks and bandwidths
    seconds = roofline_s(compute["ops"], peak_flops={"16-bit": g.peak_tflops("bf16-mixed") * 1e12,
                                                     "fp32": g.peak_tflops("fp32") * 1e12},
                         bytes_per_s=g.mem_bw_tbs * 1e12)
    return {"flops": compute["flops"], "bytes": compute["bytes"], "roofline_s": seconds,
            "peak_tflops_16bit": g.bf16_tflops, "mem_bw_tbs": g.mem_bw_tbs,
            "uncounted": compute.get("uncounted") or {}}


def build(*, title: str, prediction: Any, results: list[dict[str, Any]], budget_gib: float | None,
          gpu_name: str, device: str, notes: tuple[str, ...] = (),
          planned_step: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report as data (what ``--json`` prints); ``notes``: the run's own (what "auto" became);
    ``planned_step``: the planner's step time for the command on ``gpu_name`` (seconds by term)."""
    ranks = []
    for result in results:
        rows = compare_rank(prediction, result)
        result = dict(result)
        if "compute" in result:  # priced here, on the target GPU; the grouped ops are not reported
            result["roofline"] = _price(result.pop("compute"), gpu_name)
        ranks.append({**result, "comparison": [r.to_dict() for r in rows]})
    failed = [r for r in ranks if "failed" in r]
    refused = [r for r in ranks if "refused" in r]
    outcome = "failed" if failed else "refused" if refused else "runs"
    notes = [*notes, *([FAKE_CPU_LIMITS] if device == "cpu" else []), UNMEASURED]
    return {"title": title, "outcome": outcome, "gpu": gpu_name, "budget_gib": budget_gib, "device": device,
            "prediction": prediction.to_dict() if prediction is not None else None, "ranks": ranks,
            "planned_step": planned_step,
            "verdict": _verdict(title, outcome, ranks, budget_gib), "notes": notes}


def _measured_peak(rank: dict[str, Any]) -> int:
    cuda = rank.get("cuda")
    return int(cuda["max_memory_allocated"]) if cuda else int(rank["memory"]["peak"].get("peak_bytes", 0))


def _size(nbytes: int) -> str:
    """GiB for a real model's sizes, MiB below one GiB (a tiny test model's would print 0.00 GiB)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.2f} MiB"


def _verdict(title: str, outcome: str, ranks: list[dict[str, Any]], budget_gib: float | None) -> str:
    if outcome == "failed":
        r = next(r for r in ranks if "failed" in r)
        return f"{title}: the rehearsal failed on rank {r['rank']} ({r['failed']})"
    if outcome == "refused":
        r = next(r for r in ranks if "refused" in r)
        return f"{title}: refused on rank {r['rank']}: {r['refused']}"
    top = max(ranks, key=_measured_peak)
    peak = _measured_peak(top)
    planned = next((c["predicted"] for c in top["comparison"] if c["column"] == "peak_bytes"), None)
    text = f"{title}: runs; rank {top['rank']} peaks at {_size(peak)}"
    if planned is not None:
        text += f", planned {_size(planned)}"
    if budget_gib is not None:
        fits = "fits" if peak <= budget_gib * GIB else "does NOT fit"
        text += f", {fits} the {budget_gib:.1f} GiB budget"
    return text


def _cell(nbytes: int) -> str:
    return f"{nbytes / MIB:12.2f}"


def _pipeline_messages(collectives: list[dict[str, Any]], prediction: dict[str, Any],
                       pp_rank: int | None) -> list[str]:
    """This rank's pipeline sends and receives of one step next to the planner's: one boundary tensor per
    micro-batch for each stage boundary the rank holds that joins another rank, each way (the count the
    step time charges, ``core.pp_schedules.p2p_messages_per_step``)."""
    sent = [c for c in collectives if c["op"] == "send"]
    received = [c for c in collectives if c["op"] == "recv_"]
    if not sent and not received:
        return []

    def total(rows: list[dict[str, Any]]) -> str:
        return f"{sum(c['count'] for c in rows)} ({sum(c['bytes'] for c in rows) / MIB:.2f} MiB)"

    line = f"  pipeline messages in one step: sent {total(sent)}, received {total(received)}"
    message, planned = prediction.get("pp_message_bytes", 0), prediction.get("pp_messages") or []
    if message and pp_rank is not None and pp_rank < len(planned):
        line += (f"; the plan charges {planned[pp_rank]} x {message / MIB:.3f} MiB each way "
                 f"= {planned[pp_rank] * message / MIB:.2f} MiB")
    return [line]


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 1000 else f"{ms:.4g} ms"  # never 1.63e+04


def _measured_step(rank: dict[str, Any]) -> tuple[float, str]:
    """A GPU rank's step time and what it is: the step run with no tracker and no counter (the
    others carry their per-op Python work), or the fastest step where there is none (a result
    written before that step existed)."""
    if rank.get("timed_step_s"):
        return rank["timed_step_s"], "uninstrumented"
    return min(rank["step_s"]), "the fastest, instrumented"


def _planned_compute(planned: dict[str, Any] | None, roofline: dict[str, Any], rank: dict[str, Any]) -> list[str]:
    """The planner's step terms beside the roofline floor and, on a real GPU, the measured step (its
    collectives are fake there, so the measured step is compute: the planner's compute term's match)."""
    if not planned:
        return []
    if "refused" in planned:
        return [f"  the planner's step time: not computed ({planned['refused']})"]
    if planned["compute_s"] <= 0:
        return ["  the planner's step: no compute term (the model's shape is unknown to it)"]
    line = (f"  the planner's step: compute {_ms(planned['compute_s'])} (the roofline floor is "
            f"{roofline['roofline_s'] / planned['compute_s']:.0%} of it), exposed communication "
            f"{_ms(planned['comm_exposed_s'])}, bubble {_ms(planned['bubble_s'])}")
    if rank.get("cuda") and rank.get("step_s"):
        measured, how = _measured_step(rank)
        here = planned.get("here") or {}
        compute, priced = ((here["compute_s"], f" priced on this {here['gpu']}") if here.get("compute_s")
                           else (planned["compute_s"], ""))
        line += (f"; measured step on this GPU ({how}, fake collectives: compute only) {_ms(measured)}, "
                 f"the planner's compute{priced} {_ms(compute)}: {100 * (compute - measured) / measured:+.1f}%")
    return [line]


def format_text(report: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [f"rehearsal of {report['title']} ({len(report['ranks'])} played rank(s), device {report['device']})"]
    for rank in report["ranks"]:
        if "refused" in rank:
            lines += [f"rank {rank['rank']}: refused: {rank['refused']}"]
            continue
        if "failed" in rank:
            lines += [f"rank {rank['rank']}: failed: {rank['failed']}"]
            if rank.get("traceback"):
                lines += ["  " + ln for ln in rank["traceback"].rstrip().splitlines()[-6:]]
            continue
        coords = ", ".join(f"{k}={v}" for k, v in rank["coords"].items())
        lines.append(f"rank {rank['rank']} ({coords}): prepared in {rank['prepare_s']:.1f} s, "
                     f"{len(rank['step_s'])} step(s) in {sum(rank['step_s']):.1f} s, "
                     f"host peak RSS {rank['peak_rss_bytes'] / GIB:.2f} GiB")
        if rank["comparison"]:
            lines.append("  column              planned_MiB  measured_MiB     diff   bound")
            for c in rank["comparison"]:
                diff = "n/a" if c["diff_pct"] is None else f"{c['diff_pct']:+.1f}%"
                mark = "" if c["within"] else "  OUTSIDE"
                lines.append(f"  {c['column']:<18}{_cell(c['predicted'])}  {_cell(c['measured'])}  {diff:>7}"
                             f"  {c['bound_pct']:>4.0f}%{mark}")
        if rank.get("cuda"):
            cu = rank["cuda"]
            lines.append(f"  {cu['device_name']}: max_memory_allocated {cu['max_memory_allocated'] / GIB:.2f} GiB, "
                         f"reserved {cu['max_memory_reserved'] / GIB:.2f} GiB, "
                         "step {:.3f} s ({})".format(*_measured_step(rank)))
        if rank.get("modules"):
            # Every ancestor of the module running at the peak shares its peak: name the deepest one.
            top = max(m["peak_bytes"] for m in rank["modules"])
            at_peak = max((m for m in rank["modules"] if m["peak_bytes"] == top), key=lambda m: m["module"].count("."))
            lines.append(f"  the peak falls while {at_peak['module']} runs (per-module rows: --json)")
        plan = rank.get("save_plan") or {}
        if "not_rehearsed" in plan:
            lines.append(f"  checkpoint save plan: not rehearsed ({plan['not_rehearsed']})")
        elif plan:
            lines.append(f"  checkpoint save plan (DCP, this rank, nothing written): {plan['tensor_items']} tensor "
                         f"chunk(s), {plan['tensor_bytes'] / MIB:.2f} MiB, {plan['other_items']} other item(s)")
        if rank.get("roofline"):
            r = rank["roofline"]
            lines.append(f"  compute in one step (torch's FLOP formulas, this rank): {r['flops'] / 1e12:.3f} TFLOP, "
                         f"{r['bytes'] / GIB:.2f} GiB read and written; roofline on {report['gpu']} "
                         f"({r['peak_tflops_16bit']:.0f} TFLOPS 16-bit, {r['mem_bw_tbs']:.2f} TB/s): "
                         f"{r['roofline_s'] * 1e3:.1f} ms, a floor")
            lines += _planned_compute(report.get("planned_step"), r, rank)
            if r.get("uncounted"):
                lines.append("  FLOPs not counted (torch's formula refused their shapes; their bytes are): "
                             + ", ".join(f"{name} x{n}" for name, n in sorted(r["uncounted"].items())))
        if rank["collectives"]:
            lines.append("  collectives and pipeline messages in one step (op, mesh dimension, count, buffer MiB):")
            lines += [f"    {c['op']:<28} {c['dim']:<12} {c['count']:>5}  {c['bytes'] / MIB:10.2f}"
                      for c in rank["collectives"]]
            lines += _pipeline_messages(rank["collectives"], report.get("prediction") or {},
                                        rank["coords"].get("pp"))
    lines.append(f"verdict: {report['verdict']}")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)
