"""Read a torch.profiler Chrome trace back into where each step's time went, and the top ops.

Every profiled step (the ``ProfilerStep#k`` span torch.profiler's schedule records) is split into
four parts that add up to the step's wall time, each instant counted once, in this priority:

* ``compute``: an operator runs (CPU traces: a host op on any thread; CUDA traces: a kernel,
  memcpy or memset on the device -- host ops there are only launches);
* ``data``: the rank waits for the data loader (``enumerate(DataLoader)...`` spans) and nothing
  computes;
* ``comm``: a collective is in flight or waited on and nothing computes or loads data, i.e.
  *exposed* communication (the part overlapped with compute is counted as compute);
* ``other``: none of these (Python overhead between ops, idle).

``comm_total`` is the whole time some collective is in flight during the step, overlapped or not.
A collective is an event named by a process group (``gloo:all_reduce``, ``nccl:all_gather``, ...:
they span enqueue to completion on the backend's threads), a c10d operator (``c10d::allreduce_``,
``c10d::_reduce_scatter_base_``, ``_c10d_functional::wait_tensor``, ...) or, on CUDA, an NCCL
kernel. On one host thread a collective or data-loader span overrides the operators nested inside
it (the ops a data loader runs to collate a batch are data loading, not compute).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.observe import intervals as iv

# Names a process group gives the work it runs (ProcessGroup profiling titles).
BACKEND_PREFIXES = ("gloo:", "nccl:", "ucc:", "mpi:", "xccl:")
# c10d operators: the host side of a collective, and blocking waits on one.
C10D_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms")
DATA_PREFIXES = ("enumerate(DataLoader)",)
HOST_OP_CATS = ("cpu_op",)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


def load_trace(path: str | Path) -> dict[str, Any]:
    """The JSON object of a Chrome trace file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the profiler trace {str(path)!r}: {e}.") from None
    if isinstance(data, list):  # the bare-array form of the Chrome trace format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ConfigError(f"{str(path)!r} is not a Chrome trace (no traceEvents list).")
    return data


def _is_comm(name: str, cat: str, device_trace: bool) -> bool:
    if cat == "kernel":
        return "nccl" in name.lower()
    if name.startswith(("gloo:", "ucc:", "mpi:")):
        return True  # host-side backends: the span is the collective's real run time
    if device_trace:
        return False  # NCCL's host spans and c10d ops only enqueue; the kernels are the work
    return name.startswith(BACKEND_PREFIXES + C10D_PREFIXES)


def _duration_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"]
            if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)) and e.get("dur", 0) >= 0]


def _step_windows(events: list[dict[str, Any]], device_trace: bool) -> list[tuple[int, float, float]]:
    """(profiler step index, start, end) of each recorded step, in order."""
    host, device = {}, {}
    for e in events:
        m = STEP_RE.match(e.get("name", ""))
        if not m:
            continue
        target = device if e.get("cat") == "gpu_user_annotation" else host
        target[int(m.group(1))] = (e["ts"], e["ts"] + e["dur"])
    # On CUDA the device runs a step later than the host launches it; Kineto also marks each
    # step on the device timeline, and that is the window the kernels belong to.
    chosen = device if device_trace and device else host
    return [(k, *chosen[k]) for k in sorted(chosen)]


def _thread_labels(events: list[dict[str, Any]], device_trace: bool
                   ) -> tuple[list[iv.Interval], list[iv.Interval], list[iv.Interval]]:
    """Unions of (compute, data, comm) time over all threads and streams, per-thread overrides applied."""
    per_thread: dict[tuple[Any, Any], dict[str, list[iv.Interval]]] = defaultdict(
        lambda: {"compute": [], "data": [], "comm": []})
    for e in events:
        name, cat = e.get("name", ""), e.get("cat", "")
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        slot = per_thread[(e.get("pid"), e.get("tid"))]
        if name.startswith(DATA_PREFIXES):
            slot["data"].append(span)
        elif _is_comm(name, cat, device_trace):
            slot["comm"].append(span)
        elif cat in DEVICE_CATS or (cat in HOST_OP_CATS and not device_trace):
            slot["compute"].append(span)
    compute, data, comm = [], [], []
    for slot in per_thread.values():
        d, c = iv.union(slot["data"]), iv.union(slot["comm"])
        # On one thread, what a data-loader or collective span contains belongs to it.
        c_only = iv.subtract(c, d)
        compute += iv.subtract(iv.subtract(iv.union(slot["compute"]), d), c)
        data += d
        comm += c_only
    return iv.union(compute), iv.union(data), iv.union(comm)


def step_split(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Per recorded step: ``step_s``, ``compute_s``, ``data_s``, ``comm_s`` (exposed),
    ``other_s`` (these four add up to ``step_s``) and ``comm_total_s``; ``step`` is the trainer's
    step number when the trace says where it started (shardwise traces), else the profiler's."""
    events = _duration_events(trace)
    device_trace = any(e.get("cat") in DEVICE_CATS for e in events)
    compute, data, comm = _thread_labels(events, device_trace)
    offset = int((trace.get("shardwise") or {}).get("first_step", 0))
    windows = _step_windows(events, device_trace)
    if not windows and events:  # a trace recorded without a schedule: one window over everything
        windows = [(0, min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events))]
    rows = []
    for k, lo, hi in windows:
        c = iv.clip(compute, lo, hi)
        cd = iv.union(c + iv.clip(data, lo, hi))
        cdm = iv.union(cd + iv.clip(comm, lo, hi))
        total = hi - lo
        c_s, d_s, m_s = iv.length(c), iv.length(cd) - iv.length(c), iv.length(cdm) - iv.length(cd)
        rows.append({"step": offset + k if offset else k, "step_s": total / 1e6, "compute_s": c_s / 1e6,
                     "data_s": d_s / 1e6, "comm_s": m_s / 1e6,
                     "other_s": max(0.0, total - c_s - d_s - m_s) / 1e6,
                     "comm_total_s": iv.length(iv.clip(comm, lo, hi)) / 1e6})
    return rows


def top_ops(trace: dict[str, Any], n: int = 15) -> list[dict[str, Any]]:
    """The ``n`` operators (host ops and device kernels) with the most self time, inside the steps.

    Self time is an op's duration minus the ops nested directly inside it on the same thread.
    Each entry: ``name``, ``where`` (host/device), ``calls``, ``self_s``, ``total_s``.
    """
    events = _duration_events(trace)
    device_trace = any(e.get("cat") in DEVICE_CATS for e in events)
    windows = _step_windows(events, device_trace)
    lo = min((w[1] for w in windows), default=float("-inf"))
    hi = max((w[2] for w in windows), default=float("inf"))
    stats: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    threads: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_OP_CATS + DEVICE_CATS and lo <= e["ts"] <= hi:
            threads[(e.get("pid"), e.get("tid"))].append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        self_us = [float(e["dur"]) for e in evs]
        stack: list[int] = []
        for i, e in enumerate(evs):
            while stack and evs[stack[-1]]["ts"] + evs[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                self_us[stack[-1]] -= float(e["dur"])
            stack.append(i)
        for e, s in zip(evs, self_us):
            key = (e["name"], "device" if e.get("cat") in DEVICE_CATS else "host")
            row = stats[key]
            row[0] += 1
            row[1] += max(0.0, s)
            row[2] += float(e["dur"])
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": name, "where": where, "calls": int(calls), "self_s": self_s / 1e6,
             "total_s": total / 1e6} for (name, where), (calls, self_s, total) in ranked]


def collectives(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Calls and summed duration of every collective event name in the recorded steps."""
    out: dict[str, dict[str, float]] = {}
    events = _duration_events(trace)
    for e in events:
        name = e.get("name", "")
        if name.startswith(BACKEND_PREFIXES + C10D_PREFIXES) or (e.get("cat") == "kernel" and "nccl" in name.lower()):
            row = out.setdefault(e["name"], {"calls": 0, "total_s": 0.0})
            row["calls"] += 1
            row["total_s"] += float(e["dur"]) / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["total_s"]))


def summarize(trace: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """Everything ``shardwise profile`` prints for one rank's trace, as a JSON-ready dict."""
    meta = trace.get("shardwise") or {}
    dist_info = trace.get("distributedInfo") or {}
    steps = step_split(trace)
    totals = {k: sum(r[k] for r in steps) for k in
              ("step_s", "compute_s", "data_s", "comm_s", "other_s", "comm_total_s")}
    return {"rank": meta.get("rank", dist_info.get("rank", 0)),
            "world_size": meta.get("world_size", dist_info.get("world_size", 1)),
            "backend": dist_info.get("backend"), "strategy": meta.get("strategy"),
            "device": "cuda" if any(e.get("cat") in DEVICE_CATS for e in trace["traceEvents"]) else "cpu",
            "steps": steps, "totals": totals, "top_ops": top_ops(trace, top),
            "collectives": collectives(trace)}


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:5.1f}%" if whole > 0 else "    -"


def format_summary(s: dict[str, Any]) -> str:
    """A plain-text report of ``summarize``'s dict: the per-step split and the top ops."""
    head = f"rank {s['rank']} of {s['world_size']}"
    extras = [x for x in (s.get("strategy"), s.get("backend"), s.get("device")) if x]
    lines = [head + (f" ({', '.join(extras)})" if extras else "")]
    lines.append("  step    step_ms   compute      data  comm(exposed)   other   comm in flight")
    rows = s["steps"] + ([{"step": "all", **s["totals"]}] if len(s["steps"]) > 1 else [])
    for r in rows:
        t = r["step_s"]
        lines.append(f"  {r['step']!s:>4} {t * 1e3:10.1f}    {_pct(r['compute_s'], t)}    {_pct(r['data_s'], t)}"
                     f"         {_pct(r['comm_s'], t)}  {_pct(r['other_s'], t)}           "
                     f"{_pct(r['comm_total_s'], t)}")
    if s["collectives"]:
        shown = list(s["collectives"].items())[:6]
        lines.append("  collectives: " + ", ".join(
            f"{name} x{int(c['calls'])} ({c['total_s'] * 1e3:.1f} ms)" for name, c in shown))
    if s["top_ops"]:
        lines.append(f"  top ops by self time ({len(s['top_ops'])}):")
        lines.append("      self_ms  total_ms   calls  where   name")
        for o in s["top_ops"]:
            lines.append(f"    {o['self_s'] * 1e3:9.2f} {o['total_s'] * 1e3:9.2f} {o['calls']:7d}  "
                         f"{o['where']:<6}  {o['name'][:80]}")
    return "\n".join(lines)
