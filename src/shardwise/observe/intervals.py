"""Interval arithmetic on (start, end) pairs: union, subtraction, clipping, total length."""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The sorted, non-overlapping union of ``intervals`` (empty ones dropped)."""
    merged: list[Interval] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if merged and lo <= merged[-1][1]:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a`` minus ``b``; both must be unions (sorted, non-overlapping)."""
    out: list[Interval] = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        cur = lo
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def clip(a: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of union ``a`` inside [lo, hi]."""
    return [(max(s, lo), min(e, hi)) for s, e in a if e > lo and s < hi]


def length(a: Iterable[Interval]) -> float:
    """Total length of a union."""
    return sum(e - s for s, e in a)
