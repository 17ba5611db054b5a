"""Linear interpolation of a trace onto a finer grid; every made-up point is labelled synthetic."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from sparkd.core.sample import Sample
from sparkd.ops.replay.columns import _FLOAT_FIELDS, _HELD_FIELDS, _SAMPLE_FIELDS, TraceError
from sparkd.ops.replay.traces import MAX_TRACE_POINTS, Trace


def _lerp(a: Any, b: Any, f: float, attr: str) -> Any:
    if a is None or b is None:
        return a if f < 0.5 else b
    v = a + (b - a) * f
    return v if attr in _FLOAT_FIELDS else round(v)


def _round_down(x: float) -> float:
    """``x`` rounded down to three significant figures."""
    if x <= 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - 2
    return float(f"{math.floor(x / 10.0**e + 1e-9) * 10.0**e:.3g}")


def _round_up(x: float) -> float:
    """``x`` rounded up to three significant figures (a suggested interval that suffices)."""
    if x <= 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - 2
    return float(f"{math.ceil(x / 10.0**e - 1e-9) * 10.0**e:.3g}")


def interpolate(trace: Trace, interval_s: float, *, max_points: int | None = None) -> Trace:
    """Linear interpolation onto a grid of ``interval_s`` from the first sample.

    Recorded samples that fall on the grid are kept as they are, and so is the last
    recorded sample when the grid stops short of it; every other point is synthetic.
    Count fields (``nvrm_recent``) are held from the previous recorded sample, not blended.
    The result carries a note: "interpolated to 0.25 s from 2 s samples — synthetic points".

    At most ``max_points`` (default ``MAX_TRACE_POINTS``) points: a finer grid is refused
    before anything is allocated.

    Raises:
        ValueError: ``interval_s`` not positive (or not finite).
        TraceError: the grid would exceed ``max_points``; the message says how many points,
            the cap, and how to narrow it.
    """
    if not interval_s > 0 or not math.isfinite(interval_s):
        raise ValueError(f"interpolation interval must be > 0 s, got {interval_s:g}")
    cap = MAX_TRACE_POINTS if max_points is None else max_points
    src = trace.samples
    if len(src) < 2:
        return trace
    orig = trace.interval_s
    t0 = src[0].mono
    span_s = src[-1].mono - t0
    steps = span_s / interval_s + 1e-9  # may be inf for a huge span; checked before any allocation
    total = math.inf
    if math.isfinite(steps):
        n = math.floor(steps) + 1
        total = n + (1 if t0 + (n - 1) * interval_s < src[-1].mono - 1e-9 else 0)  # + the last, off the grid
    if total > cap:
        would = f"{total:,}" if math.isfinite(total) else "more than can be counted"
        coarsest = _round_up(span_s / max(cap - 2, 1))
        raise TraceError(
            f"{trace.source}: interpolating {span_s:g} s at {interval_s:g} s would make {would} points, "
            f"more than the cap of {cap:,}; use a coarser --interval (at least {coarsest:g} s for this span) "
            "or a shorter range (--since/--until, or fewer CSV rows)"
        )
    out: list[Sample] = []
    synthetic: list[bool] = []
    labels: list[str | None] = []
    j = 0
    for k in range(n):
        t = t0 + k * interval_s
        while j + 1 < len(src) - 1 and src[j + 1].mono <= t + 1e-9:
            j += 1
        a, b = src[j], src[j + 1]
        if abs(a.mono - t) < 1e-9 or abs(b.mono - t) < 1e-9:
            idx = j if abs(a.mono - t) < 1e-9 else j + 1
            rec = src[idx]
            out.append(dataclasses.replace(rec))
            synthetic.append(False)
            labels.append(trace.labels[idx])
            continue
        span = b.mono - a.mono
        f = 0.0 if span <= 0 else (t - a.mono) / span
        s = Sample(ts=a.ts + (b.ts - a.ts) * f, mono=t)
        for attr in _SAMPLE_FIELDS:
            va, vb = getattr(a, attr), getattr(b, attr)
            setattr(s, attr, va if attr in _HELD_FIELDS else _lerp(va, vb, f, attr))
        out.append(s)
        synthetic.append(True)
        labels.append(None)
    last = src[-1]
    if out[-1].mono < last.mono - 1e-9:  # the grid stops short of the last recorded sample: keep it
        out.append(dataclasses.replace(last))
        synthetic.append(False)
        labels.append(trace.labels[-1])
    n_syn = sum(synthetic)
    note = (
        f"interpolated to {interval_s:g} s from {orig:g} s samples — synthetic points "
        f"({n_syn} of {len(out)} samples are synthetic, marked *)"
    )
    return Trace(out, trace.source, synthetic, labels, [*trace.notes, note], trace.epoch)
