"""Replay stop rules over a recorded trace: what would have fired, when, and why.

Pure core, thin edges:

* loaders turn a trace into a ``Trace`` (a list of ``Sample``; ``mono`` = seconds
  from the trace start, sizes in bytes): ``load_db`` (sparkd's own samples table),
  ``load_csv`` (``sparkd samples --csv`` output, or a generic CSV with a time
  column and GiB/byte memory columns such as the shared meminfo fixtures); they refuse
  non-finite or negative values and repeated or backward times (naming the row and
  column), drop exact duplicate rows with a note, and hold at most ``MAX_TRACE_POINTS``;
* ``interpolate`` resamples linearly to a finer interval; every point that is not
  a recorded sample is flagged synthetic and the trace carries a note saying so; a grid
  over ``MAX_TRACE_POINTS`` is refused before it is built;
* ``replay`` runs the real ``rules.evaluate`` over the samples, exactly as the
  guard does (slope window fed first, same ``now``, same cooldown), and returns
  a ``ReplayResult`` with each sample's decisions and each rule's first trip;
* ``replay_command`` is the ``sparkd replay`` click command (registered by
  ``cli.main.add_command``); it is importable and runnable on its own.

What a replay does not model: the daemon's adaptive sampling (it samples every
``interval_s`` and switches to ``fast_interval_s`` near a floor) — a replay sees
exactly the samples it is given; and the re-check before a stop reads a *fresh*
sample in the daemon, here the next recorded one.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import inspect
import io
import itertools
import json
import math
import statistics
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from sparkd.config import DEFAULT_RULES, SEED_RULES, RuleConfig, Settings, load_settings
from sparkd.core.rules import Rule, RuleState, SlopeWindow, compile_rules, evaluate, still_holds
from sparkd.core.sample import MEMINFO_ATTRS, Sample
from sparkd.errors import ConfigError, SparkdError
from sparkd.units import GiB, MiB, fmt_gib, parse_duration_s

# The most samples a replay holds, read or interpolated. Measured: a replay of 200,000
# points with the default rules peaks near 300 MB RSS (1,000,000 points: 1.3 GB) — memory
# taken from the pool sparkd guards. 48 h of 1 s samples (the raw retention) fits.
MAX_TRACE_POINTS = 200_000

# The predictive rules' robust slope, as the guard runs it: the fewest points it fits
# (``SlopeWindow.slope``'s ``min_points``) and the longest window the guard keeps.
SLOPE_MIN_POINTS: int = inspect.signature(SlopeWindow.slope).parameters["min_points"].default
SLOPE_MAX_WINDOW_S = 30.0

# Accepted time columns, in order of preference. ``phase`` means "row order, no times".
TIME_COLUMNS = ("t_s", "ts", "time", "t", "phase")

# Sample attributes a trace may carry (everything but the clocks and the meminfo dict).
_SAMPLE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Sample) if f.name not in ("ts", "mono", "meminfo")
)
_FLOAT_FIELDS = frozenset(f for f in _SAMPLE_FIELDS if "avg" in f)
# Counts are held (zero-order) between recorded samples when interpolating, never blended:
# a driver error is not "half seen" between two samples.
_HELD_FIELDS = frozenset({"nvrm_recent", "shm_entries"})

ACCEPTED_COLUMNS_TEXT = (
    f"time: one of {', '.join(TIME_COLUMNS)} (phase = row order); memory: mem_available_gib, mem_free_gib, "
    "cached_gib, ... (GiB), MemAvailable, MemFree, ... (bytes), mem_available, mem_free, ... (bytes, as "
    "'sparkd samples --csv' writes them); at least MemAvailable or MemFree"
)


class TraceError(SparkdError):
    """A trace cannot be read: the message names what was found and what is accepted."""

    status_code = 422
    code = "invalid_trace"


# --------------------------------------------------------------------------- traces


@dataclass(slots=True)
class Trace:
    """Samples in time order. ``synthetic[i]``: sample i was made by interpolation.

    ``labels[i]``: a row label (the ``phase`` column), or ``None``. ``notes``: lines that
    must be shown with any result (how times were derived, interpolation, ignored columns).
    """

    samples: list[Sample]
    source: str
    synthetic: list[bool] = field(default_factory=list)
    labels: list[str | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    epoch: bool = False  # ts are wall-clock epoch seconds (DB, sparkd CSV) rather than relative

    def __post_init__(self) -> None:
        n = len(self.samples)
        if not self.synthetic:
            self.synthetic = [False] * n
        if not self.labels:
            self.labels = [None] * n

    @property
    def duration_s(self) -> float:
        return self.samples[-1].mono - self.samples[0].mono if self.samples else 0.0

    @property
    def interval_s(self) -> float | None:
        """Median spacing of the samples (``None`` with fewer than two)."""
        gaps = [b.mono - a.mono for a, b in zip(self.samples, self.samples[1:], strict=False)]
        return statistics.median(gaps) if gaps else None

    @property
    def mem_total(self) -> int | None:
        return next((s.mem_total for s in self.samples if s.mem_total), None)


# Spelled-out "missing" values (a blank cell is missing too). ``nan``/``inf`` are not among
# them: a non-finite number is refused, never read as a gap, so a replay does not quietly
# differ from what the guard would have seen.
_MISSING = frozenset({"", "none", "null", "n/a"})
# Fields that may legitimately be negative (differences/estimates); every other size, count
# and pressure is refused when negative.
_SIGNED_FIELDS = frozenset({"driver_bytes", "mem_available_minus_cma"})


def _cell(raw: Any, source: str, row: int, column: str) -> float | None:
    """A value cell as a finite float, or ``None`` when missing.

    Raises:
        TraceError: not a number, or not finite; the message names the row and column.
    """
    if raw is None:
        return None
    text = str(raw).strip()
    if text.lower() in _MISSING:
        return None
    try:
        v = float(text)
    except ValueError:
        raise TraceError(f"{source}: row {row}, column {column}: {text!r} is not a number") from None
    if not math.isfinite(v):
        raise TraceError(f"{source}: row {row}, column {column}: {text!r} is not a finite number")
    return v


def _parse_time(text: str, column: str, row: int, source: str = "") -> float:
    """Seconds from a time cell (a number, or ISO-8601 for ``time``/``ts``).

    Raises:
        TraceError: not a time, or not finite.
    """
    where = f"{source + ': ' if source else ''}row {row}, column {column}"
    try:
        v = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(v):
            raise TraceError(f"{where}: {text.strip()!r} is not a finite number")
        return v
    if column in ("time", "ts"):
        try:
            d = dt.datetime.fromisoformat(text.strip())
        except ValueError:
            pass
        else:
            if d.tzinfo is None:
                d = d.replace(tzinfo=dt.UTC)
            return d.timestamp()
    raise TraceError(f"{where}: {text.strip()!r} is not a number of seconds (or an ISO-8601 time)")


def _column_map(columns: Sequence[str]) -> tuple[dict[str, tuple[str, float]], list[str]]:
    """Map CSV columns to ``(Sample attribute, factor to bytes)``; return the ignored ones."""
    out: dict[str, tuple[str, float]] = {}
    ignored = []
    for col in columns:
        name = col.strip()
        if name in TIME_COLUMNS:
            continue
        attr: str | None = None
        factor = 1.0
        if name in MEMINFO_ATTRS:
            attr = MEMINFO_ATTRS[name]
        elif name in _SAMPLE_FIELDS:
            attr = name
        else:
            for suffix, f in (("_gib", float(GiB)), ("_mib", float(MiB))):
                base = name.removesuffix(suffix)
                if name.endswith(suffix) and base in _SAMPLE_FIELDS and base not in _FLOAT_FIELDS:
                    attr, factor = base, f
        if attr is None:
            ignored.append(name)
        else:
            out[col] = (attr, factor)
    return out, ignored


def samples_from_rows(
    rows: Iterable[Mapping[str, Any]],
    *,
    source: str,
    row_interval_s: float = 1.0,
    max_rows: int | None = None,
) -> Trace:
    """Build a trace from dict rows (CSV rows or ``Store.samples`` rows), one row at a time.

    Rows are numbered from 1, the first row after the CSV header. Times must increase:
    a row that repeats the previous row exactly (same time, same values — as when two
    overlapping logs are concatenated) is dropped, and a note says which; a repeated time
    with different values is refused, because the guard never sees two samples at one
    instant and a replay would count the pair twice toward ``samples`` and toward the
    predictive fit's minimum. ``max_rows`` (default ``MAX_TRACE_POINTS``): more rows are
    refused before they are held in memory.

    Raises:
        TraceError: no accepted time column, no memory column, a bad, non-finite or
            negative value, times that repeat or go backwards, or more than ``max_rows``
            rows; the message names the row and column, or the columns found and accepted.
    """
    cap = MAX_TRACE_POINTS if max_rows is None else max_rows
    it = iter(rows)
    first = next(it, None)
    if first is None:
        raise TraceError(f"{source}: no samples")
    columns = list(first.keys())
    time_col = next((c for c in TIME_COLUMNS if c in columns), None)
    mapping, ignored = _column_map(columns)
    attrs = {a for a, _ in mapping.values()}
    if time_col is None or not attrs & {"mem_available", "mem_free"}:
        missing = "time column" if time_col is None else "MemAvailable or MemFree column"
        raise TraceError(
            f"{source}: unknown trace layout: no {missing}. Columns found: {', '.join(columns) or '(none)'}. "
            f"Accepted: {ACCEPTED_COLUMNS_TEXT}"
        )
    notes: list[str] = []
    labels: list[str | None] = []
    out: list[Sample] = []
    dropped: list[int] = []
    prev: Mapping[str, Any] | None = None
    t0 = 0.0
    for i, row in enumerate(itertools.chain([first], it)):
        n = i + 1
        if len(out) >= cap:
            raise TraceError(
                f"{source}: more than {cap:,} rows; a replay holds at most {cap:,} samples — "
                "replay a shorter range (--since/--until, or fewer CSV rows)"
            )
        raw = row.get(time_col)
        if time_col == "phase":
            t = i * row_interval_s
            label = None if raw is None else str(raw)
        else:
            if raw is None or str(raw).strip() == "":
                raise TraceError(f"{source}: row {n}, column {time_col}: empty")
            t = _parse_time(str(raw), time_col, n, source)
            label = None
            if out:
                t_prev = out[-1].ts
                if t == t_prev and prev is not None and dict(row) == dict(prev):
                    dropped.append(n)
                    continue
                if t == t_prev:
                    raise TraceError(
                        f"{source}: row {n}, column {time_col}: time {t:g} repeats the previous row's with "
                        "different values; times must increase"
                    )
                if t < t_prev:
                    raise TraceError(f"{source}: row {n}, column {time_col}: time goes backwards ({t_prev:g} → {t:g})")
        if not out:
            t0 = t
        s = Sample(ts=t, mono=t - t0)
        for col, (attr, factor) in mapping.items():
            v = _cell(row.get(col), source, n, col)
            if v is None:
                continue
            if v < 0 and attr not in _SIGNED_FIELDS:
                raise TraceError(f"{source}: row {n}, column {col}: {v:g} is negative (sizes and counts cannot be)")
            if attr in _FLOAT_FIELDS:
                setattr(s, attr, v)
            else:
                setattr(s, attr, round(v * factor))
        out.append(s)
        labels.append(label)
        prev = row
    if time_col == "phase":
        notes.append(
            f"rows are phases without times ({', '.join(str(x) for x in labels)}); "
            f"spaced {row_interval_s:g} s apart by assumption"
        )
    if dropped:
        shown = ", ".join(str(x) for x in dropped[:10]) + (", ..." if len(dropped) > 10 else "")
        notes.append(
            f"dropped {len(dropped)} exact duplicate row(s) (row {shown}): same time and values as the row before"
        )
    if ignored:
        notes.append(f"columns not used: {', '.join(ignored)}")
    return Trace(out, source, labels=labels, notes=notes, epoch=time_col == "ts")


def load_csv(path: str | Path, *, row_interval_s: float = 1.0, max_rows: int | None = None) -> Trace:
    """Read a CSV trace (``sparkd samples --csv`` or a generic time/GiB layout), streaming:
    at most ``max_rows`` (default ``MAX_TRACE_POINTS``) rows are read, more are refused.

    Raises:
        TraceError: unreadable file, unknown layout, a bad row, or too many rows.
    """
    p = Path(path)
    try:
        with p.open(newline="") as f:
            return _csv_trace(f, source=p.name, row_interval_s=row_interval_s, max_rows=max_rows)
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {p}: {e}") from None


def loads_csv(text: str, *, source: str = "<csv>", row_interval_s: float = 1.0, max_rows: int | None = None) -> Trace:
    """``load_csv`` on CSV text (tests, stdin)."""
    return _csv_trace(io.StringIO(text), source=source, row_interval_s=row_interval_s, max_rows=max_rows)


def _csv_trace(f: Iterable[str], *, source: str, row_interval_s: float, max_rows: int | None) -> Trace:
    reader = csv.DictReader(f)
    try:
        first = next(reader, None)
        if first is None:
            raise TraceError(f"{source}: no rows (a header and at least one sample are needed)")
        return samples_from_rows(
            itertools.chain([first], reader), source=source, row_interval_s=row_interval_s, max_rows=max_rows
        )
    except csv.Error as e:
        raise TraceError(f"{source} is not a readable CSV: {e}") from None


def load_db(store: Any, *, since: float, until: float | None = None, max_rows: int | None = None) -> Trace:
    """sparkd's own samples between ``since`` and ``until`` (UTC epoch s) from a ``Store``.

    At most ``max_rows`` (default ``MAX_TRACE_POINTS``) samples: one more is asked for, and
    if it comes the range is refused (narrow it with --since/--until).

    Raises:
        TraceError: no samples in that range, or too many.
    """
    cap = MAX_TRACE_POINTS if max_rows is None else max_rows
    rows = store.samples(since=since, until=until, limit=cap + 1)
    span = f"{_utc(since)} – {_utc(until) if until is not None else 'now'} UTC"
    if not rows:
        raise TraceError(f"no samples in the database between {span}")
    source = f"database {getattr(store, 'path', '')} {span}".replace("  ", " ")
    return samples_from_rows(rows, source=source, max_rows=cap)


def _utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


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
            out.append(dataclasses.replace(rec, meminfo=dict(rec.meminfo)))
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
        out.append(dataclasses.replace(last, meminfo=dict(last.meminfo)))
        synthetic.append(False)
        labels.append(trace.labels[-1])
    n_syn = sum(synthetic)
    note = (
        f"interpolated to {interval_s:g} s from {orig:g} s samples — synthetic points "
        f"({n_syn} of {len(out)} samples are synthetic, marked *)"
    )
    return Trace(out, trace.source, synthetic, labels, [*trace.notes, note], trace.epoch)


# --------------------------------------------------------------------------- replay


@dataclass(slots=True)
class ReplayDecision:
    """One rule decision on one sample. ``t``: seconds from the trace start.

    ``recheck``: for a stop trip, whether ``rules.still_holds`` is true on the next
    recorded sample (the daemon re-checks on a fresh sample before stopping);
    ``None`` when the trace ended first or for other decisions.
    """

    t: float
    ts: float
    rule: str
    kind: str  # trip | near_miss | cooldown
    action: str
    reason: str
    counter: int
    samples: int
    mem_available: int | None
    mem_free: int | None
    synthetic: bool
    recheck: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class ReplayStep:
    """One sample of the replay: its values, every rule's counter after it, its decisions."""

    t: float
    ts: float
    mem_available: int | None
    mem_free: int | None
    nvrm_recent: int
    synthetic: bool
    label: str | None
    counters: dict[str, int]
    decisions: list[ReplayDecision] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["decisions"] = [x.to_json() for x in self.decisions]
        return d


@dataclass(slots=True)
class ReplayResult:
    rules: list[Rule]
    steps: list[ReplayStep]
    first_trip: dict[str, ReplayDecision | None]
    max_counter: dict[str, int]
    near_misses: dict[str, int]
    cooldown_s: float
    fast_interval_s: float
    mem_total_bytes: int | None
    # predictive rules: the most MemAvailable points their fit window ever held on this trace
    fit_points: dict[str, int] = field(default_factory=dict)
    trace_interval_s: float | None = None

    def why_no_trip(self, rule: Rule) -> str | None:
        """For a predictive rule whose fit window never held the points the robust slope
        needs (``SLOPE_MIN_POINTS``): why it could never evaluate, and what to try."""
        held = self.fit_points.get(rule.name)
        if rule.kind != "predictive" or held is None or held >= SLOPE_MIN_POINTS:
            return None
        iv = self.trace_interval_s
        spacing = f" at {iv:g} s spacing" if iv is not None else ""
        window = min(rule.window_s, SLOPE_MAX_WINDOW_S)
        coarsest = window / (SLOPE_MIN_POINTS - 1)  # floor(window / iv) + 1 >= min points
        suggest = self.fast_interval_s if self.fast_interval_s <= coarsest else _round_down(coarsest)
        return (
            f"its {window:g} s fit window holds at most {held} sample{'s' if held != 1 else ''}{spacing} — "
            f"needs {SLOPE_MIN_POINTS}; try --interpolate --interval {suggest:g}"
        )

    @property
    def decisions(self) -> list[ReplayDecision]:
        return [d for s in self.steps for d in s.decisions]

    def trips(self, rule: str | None = None) -> list[ReplayDecision]:
        return [d for d in self.decisions if d.kind == "trip" and (rule is None or d.rule == rule)]

    @property
    def first_stop(self) -> ReplayDecision | None:
        return next((d for d in self.decisions if d.kind == "trip" and d.action == "stop"), None)

    @property
    def last(self) -> ReplayStep | None:
        return self.steps[-1] if self.steps else None

    def summary(self) -> str:
        """``first stop: collapse_projected at t=3.50 s, MemAvailable 13.90 GiB`` or why none."""
        stop = self.first_stop
        if stop is not None:
            syn = " (synthetic point)" if stop.synthetic else ""
            return f"first stop: {stop.rule} at t={stop.t:.2f} s, MemAvailable {fmt_gib(stop.mem_available)}{syn}"
        last = self.last
        if last is None:
            return "no stop: the trace is empty"
        return (
            f"no stop: no stop rule tripped before the trace ended "
            f"(t={last.t:.2f} s, MemAvailable {fmt_gib(last.mem_available)})"
        )

    def to_json(self) -> dict[str, Any]:
        stop = self.first_stop
        return {
            "summary": self.summary(),
            "first_stop": stop.to_json() if stop else None,
            "first_trip": {k: (v.to_json() if v else None) for k, v in self.first_trip.items()},
            "max_counter": self.max_counter,
            "near_misses": self.near_misses,
            "rules": [r.to_json() for r in self.rules],
            "cooldown_s": self.cooldown_s,
            "fast_interval_s": self.fast_interval_s,
            "mem_total_bytes": self.mem_total_bytes,
            "fit_points": self.fit_points,
            "no_trip_reasons": {r.name: w for r in self.rules if (w := self.why_no_trip(r)) is not None},
            "decisions": [d.to_json() for d in self.decisions],
        }


def rule_configs(rules: Iterable[RuleConfig | Mapping[str, Any]]) -> list[RuleConfig]:
    """Validate rule dicts (``SEED_RULES``, TOML tables) into ``RuleConfig``s."""
    return [r if isinstance(r, RuleConfig) else RuleConfig(**r) for r in rules]


def replay(
    samples: Trace | Sequence[Sample],
    rule_configs_: Iterable[RuleConfig | Mapping[str, Any]],
    *,
    mem_total_bytes: int | None = None,
    fast_interval_s: float = 0.25,
    cooldown_s: float = 60.0,
) -> ReplayResult:
    """Run the rules over the samples as the guard would, one ``evaluate`` per sample.

    ``mem_total_bytes``: for ``%`` thresholds; ``None`` takes MemTotal from the trace.
    ``fast_interval_s``: how ``for_s`` rules are compiled (the guard's fast interval).

    Raises:
        ValueError: a ``%`` threshold with MemTotal unknown, or an invalid rule.
    """
    trace = samples if isinstance(samples, Trace) else Trace(list(samples), "samples")
    if mem_total_bytes is None:
        mem_total_bytes = trace.mem_total
    rules = compile_rules(rule_configs(rule_configs_), mem_total_bytes, fast_interval_s)
    states: dict[str, RuleState] = {r.name: RuleState() for r in rules}
    by_name = {r.name: r for r in rules}
    slope = SlopeWindow(max_window_s=SLOPE_MAX_WINDOW_S)  # as Guard
    steps: list[ReplayStep] = []
    first: dict[str, ReplayDecision | None] = {r.name: None for r in rules}
    max_counter = {r.name: 0 for r in rules}
    pending: list[ReplayDecision] = []
    for i, s in enumerate(trace.samples):
        slope.add(s.mono, s.mem_available)
        for p in pending:  # re-check the previous sample's stop trips on this one
            p.recheck = still_holds(by_name[p.rule], s, slope, s.mono)
        pending = []
        decisions = evaluate(s, rules, states, s.mono, cooldown_s=cooldown_s, slope=slope)
        step = ReplayStep(
            t=s.mono,
            ts=s.ts,
            mem_available=s.mem_available,
            mem_free=s.mem_free,
            nvrm_recent=s.nvrm_recent or 0,
            synthetic=trace.synthetic[i],
            label=trace.labels[i],
            counters={},
        )
        for d in decisions:
            rd = ReplayDecision(
                t=s.mono,
                ts=s.ts,
                rule=d.rule,
                kind=d.kind,
                action=d.action,
                reason=d.reason,
                counter=d.counter,
                samples=d.samples,
                mem_available=s.mem_available,
                mem_free=s.mem_free,
                synthetic=trace.synthetic[i],
            )
            step.decisions.append(rd)
            if d.kind == "trip":
                if first[d.rule] is None:
                    first[d.rule] = rd
                if d.action == "stop":
                    pending.append(rd)
            if d.kind in ("trip", "cooldown"):
                max_counter[d.rule] = max(max_counter[d.rule], d.counter)
        for r in rules:
            step.counters[r.name] = states[r.name].counter
            max_counter[r.name] = max(max_counter[r.name], states[r.name].counter)
        steps.append(step)
    return ReplayResult(
        rules=rules,
        steps=steps,
        first_trip=first,
        max_counter=max_counter,
        near_misses={r.name: states[r.name].near_misses for r in rules},
        cooldown_s=cooldown_s,
        fast_interval_s=fast_interval_s,
        mem_total_bytes=mem_total_bytes,
        fit_points={
            r.name: _most_in_window(trace.samples, min(r.window_s, SLOPE_MAX_WINDOW_S), slope.points.maxlen)
            for r in rules
            if r.kind == "predictive"
        },
        trace_interval_s=trace.interval_s,
    )


def _most_in_window(samples: Sequence[Sample], window_s: float, max_points: int | None) -> int:
    """The most MemAvailable points a ``SlopeWindow.slope`` over ``window_s`` ever sees here."""
    monos = [s.mono for s in samples if s.mem_available is not None]
    best = lo = 0
    for hi, t in enumerate(monos):
        while t - monos[lo] > window_s + 1e-9:
            lo += 1
        best = max(best, hi - lo + 1)
    return best if max_points is None else min(best, max_points)


# --------------------------------------------------------------------------- rendering

MAX_TABLE_ROWS = 200


def render(result: ReplayResult, trace: Trace, *, title: str, show_all: bool = False) -> str:
    """The readable table and summary printed by ``sparkd replay``."""
    lines = [f"rules: {title} — " + ", ".join(f"{r.name} ({r.samples} samples, {r.action})" for r in result.rules)]
    quiet = 0
    rows: list[str] = [
        f"  {'t (s)':>9}  {'MemAvailable':>12}  {'MemFree':>10}  {'nvrm':>4}  counting",
    ]
    for st in result.steps:
        active = {k: v for k, v in st.counters.items() if v}
        if not show_all and len(result.steps) > MAX_TABLE_ROWS and not active and not st.decisions:
            quiet += 1
            continue
        mark = "*" if st.synthetic else " "
        counting = ", ".join(
            f"{k} {v}/{next(r.samples for r in result.rules if r.name == k)}" for k, v in active.items()
        )
        label = f"  [{st.label}]" if st.label else ""
        rows.append(
            f"{mark} {st.t:>9.2f}  {fmt_gib(st.mem_available):>12}  {fmt_gib(st.mem_free):>10}  "
            f"{st.nvrm_recent:>4}  {counting}{label}"
        )
        for d in st.decisions:
            tag = {"trip": f"TRIP ({d.action})", "near_miss": "near miss", "cooldown": "cooldown"}[d.kind]
            extra = ""
            if d.kind == "trip" and d.action == "stop" and d.recheck is not None:
                extra = (
                    "  [re-check on the next sample: still holds]"
                    if d.recheck
                    else "  [re-check on the next sample: recovered — the daemon would not stop]"
                )
            rows.append(f"{'':>13}→ {tag}: {d.reason}{extra}")
    lines += rows
    if quiet:
        lines.append(f"  ({quiet} quiet samples not shown; --all shows every sample)")
    lines.append(result.summary())
    stop = result.first_stop
    if stop is not None:
        lines.append(f"  reason: {stop.reason}")
        if trace.epoch:
            lines.append(f"  at {_utc(stop.ts)} UTC")
    for r in result.rules:
        ft = result.first_trip[r.name]
        nm = result.near_misses[r.name]
        nm_text = f", {nm} near misses (suppressed)" if nm else ""
        if ft is None and (why := result.why_no_trip(r)) is not None:
            lines.append(f"  {r.name}: no trip; {why}{nm_text}")
        elif ft is None:
            lines.append(f"  {r.name}: no trip (highest count {result.max_counter[r.name]}/{r.samples}){nm_text}")
        else:
            lines.append(
                f"  {r.name}: first trip at t={ft.t:.2f} s, MemAvailable {fmt_gib(ft.mem_available)}, "
                f"{len(result.trips(r.name))} trip(s){nm_text}"
            )
    return "\n".join(lines)


def compare_text(a: ReplayResult, a_name: str, b: ReplayResult, b_name: str) -> str:
    """One line: which rule set stops first, and by how much."""
    sa, sb = a.first_stop, b.first_stop
    if sa is None and sb is None:
        return f"compare: neither {a_name} nor {b_name} stops before the trace ends"
    if sb is None:
        assert sa is not None and a.last is not None
        return (
            f"compare: {a_name} stops at t={sa.t:.2f} s (MemAvailable {fmt_gib(sa.mem_available)}); "
            f"{b_name} does not stop before the trace ends (t={a.last.t:.2f} s, "
            f"MemAvailable {fmt_gib(a.last.mem_available)})"
        )
    if sa is None:
        return (
            f"compare: {b_name} stops at t={sb.t:.2f} s (MemAvailable {fmt_gib(sb.mem_available)}); "
            f"{a_name} does not stop before the trace ends"
        )
    delta = sb.t - sa.t
    if abs(delta) < 1e-9:
        rel = "at the same time"
    else:
        rel = f"{abs(delta):.2f} s {'earlier' if delta > 0 else 'later'} than {b_name}"
    return (
        f"compare: {a_name} stops at t={sa.t:.2f} s (MemAvailable {fmt_gib(sa.mem_available)}), {rel} "
        f"(t={sb.t:.2f} s, MemAvailable {fmt_gib(sb.mem_available)})"
    )


# --------------------------------------------------------------------------- CLI


def load_rule_set(spec: str, settings: Settings) -> tuple[str, list[RuleConfig]]:
    """``seed`` | ``default`` | ``config`` | a TOML file with ``[[rules]]`` tables.

    Raises:
        ConfigError: the file is missing, not TOML, has no rules, or a rule is invalid.
    """
    if spec == "seed":
        return "seed", rule_configs(SEED_RULES)
    if spec == "default":
        return "default", rule_configs(DEFAULT_RULES)
    if spec == "config":
        return "configured", list(settings.rules)
    p = Path(spec)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"rules file {p} does not exist (use seed, default or a TOML file)") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"rules file {p} cannot be read as TOML: {e}") from None
    rules = data.get("rules")
    if not isinstance(rules, list) or not rules:
        raise ConfigError(f"rules file {p} has no [[rules]] tables")
    try:
        return p.name, rule_configs(rules)
    except ValueError as e:
        raise ConfigError(f"rules file {p}: {e}") from None


def _when(text: str, option: str, now: float) -> float:
    """``2h`` (ago), an epoch number, or an ISO-8601 time (UTC when naive)."""
    try:
        return now - parse_duration_s(text)
    except ValueError:
        pass
    try:
        return _parse_time(text, "time", 0)
    except TraceError:
        raise click.BadParameter(
            f"{text!r} is neither a duration ago (30s, 10m, 2h) nor a time (epoch or ISO-8601)", param_hint=option
        ) from None


@click.command("replay")
@click.argument("trace_path", metavar="TRACE.csv", required=False, type=click.Path(dir_okay=False))
@click.option("--db", "use_db", is_flag=True, help="Replay sparkd's own samples from its database.")
@click.option("--db-file", type=click.Path(dir_okay=False), default=None, help="Database file (default: settings).")
@click.option("--since", default=None, help="With --db: start, as a duration ago (2h) or a time.")
@click.option("--until", default=None, help="With --db: end, as a duration ago or a time (default now).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None, help="sparkd TOML settings.")
@click.option("--rules", "rules_spec", default=None, help="seed | default | FILE.toml; default: configured.")
@click.option("--compare", "compare_spec", default=None, help="Also replay this rule set and compare first stops.")
@click.option("--interval", type=float, default=None, help="Interpolation interval (s), or row spacing for phases.")
@click.option("--interpolate", is_flag=True, help="Interpolate linearly to --interval (synthetic points, labelled).")
@click.option("--mem-total-gib", type=float, default=None, help="MemTotal for % thresholds when the trace lacks it.")
@click.option("--cooldown", "cooldown_s", type=float, default=None, help="Rule cooldown in s (default: settings).")
@click.option("--all", "show_all", is_flag=True, help="Show every sample, not only active ones in long traces.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def replay_command(ctx: click.Context, **params: Any) -> None:
    """Replay stop rules over a recorded trace: what would have fired, when, and why.

    TRACE.csv is 'sparkd samples --csv' output or a CSV with a time column (t_s, ts, time,
    t, or phase) and MemAvailable/MemFree columns in GiB (mem_available_gib) or bytes.
    """
    params["interpolate_"] = params.pop("interpolate")  # the function of that name is used inside
    try:
        _replay_cli(ctx, **params)
    except SparkdError as e:
        click.echo(f"sparkd replay: {e.message}", err=True)
        ctx.exit(2)


def _replay_cli(
    ctx: click.Context,
    *,
    trace_path: str | None,
    use_db: bool,
    db_file: str | None,
    since: str | None,
    until: str | None,
    config_path: str | None,
    rules_spec: str | None,
    compare_spec: str | None,
    interval: float | None,
    interpolate_: bool,
    mem_total_gib: float | None,
    cooldown_s: float | None,
    show_all: bool,
    as_json: bool,
) -> None:
    if (trace_path is None) == (not use_db):
        raise click.UsageError("give either TRACE.csv or --db (with --since)")
    for opt, v in (("--interval", interval), ("--mem-total-gib", mem_total_gib)):
        if v is not None and (not math.isfinite(v) or v <= 0):
            raise click.BadParameter(f"must be a finite number > 0, got {v:g}", param_hint=opt)
    if cooldown_s is not None and (not math.isfinite(cooldown_s) or cooldown_s < 0):
        raise click.BadParameter(f"must be a finite number >= 0, got {cooldown_s:g}", param_hint="--cooldown")
    parent = ctx.find_root().obj if ctx.find_root().obj is not None else {}
    cfg = config_path or (parent.get("config") if isinstance(parent, dict) else None)
    settings = load_settings(cfg)
    now = time.time()
    if use_db:
        if since is None:
            raise click.UsageError("--db needs --since (e.g. --since 2h)")
        from sparkd.store.store import Store

        path = Path(db_file) if db_file else settings.db_file
        if not path.exists():
            raise TraceError(f"database {path} does not exist")
        store = Store.open(path, migrate=False)
        try:
            trace = load_db(
                store, since=_when(since, "--since", now), until=None if until is None else _when(until, "--until", now)
            )
        finally:
            store.close()
    else:
        if since is not None or until is not None:
            raise click.UsageError("--since/--until apply to --db only")
        assert trace_path is not None
        trace = load_csv(trace_path, row_interval_s=interval or settings.interval_s)
    if interpolate_:
        trace = interpolate(trace, interval or settings.fast_interval_s)
    elif interval is not None and not any(trace.labels):
        raise click.UsageError(
            f"--interval {interval:g} resamples a timed trace; add --interpolate to accept synthetic points"
        )
    mem_total = round(mem_total_gib * GiB) if mem_total_gib is not None else None
    cd = settings.cooldown_s if cooldown_s is None else cooldown_s
    name, rules = load_rule_set(rules_spec or "config", settings)
    runs: list[tuple[str, ReplayResult]] = []
    for nm, rs in [(name, rules), *([load_rule_set(compare_spec, settings)] if compare_spec else [])]:
        try:
            res = replay(trace, rs, mem_total_bytes=mem_total, fast_interval_s=settings.fast_interval_s, cooldown_s=cd)
        except ValueError as e:
            raise ConfigError(
                f"rule set {nm} cannot be compiled against this trace: {e}; give MemTotal with --mem-total-gib"
            ) from None
        runs.append((nm, res))
    if as_json:
        out: dict[str, Any] = {
            "trace": {
                "source": trace.source,
                "samples": len(trace.samples),
                "duration_s": trace.duration_s,
                "interval_s": trace.interval_s,
                "synthetic": sum(trace.synthetic),
                "notes": trace.notes,
            },
            "runs": {nm: res.to_json() for nm, res in runs},
        }
        if len(runs) == 2:
            out["compare"] = compare_text(runs[0][1], runs[0][0], runs[1][1], runs[1][0])
        click.echo(json.dumps(out, indent=2))
        return
    iv = trace.interval_s
    click.echo(
        f"trace: {trace.source} — {len(trace.samples)} samples over {trace.duration_s:.2f} s"
        + (f" (every {iv:g} s)" if iv is not None else "")
    )
    for note in trace.notes:
        click.echo(f"note: {note}")
    click.echo(f"cooldown {cd:g} s; for_s rules counted at {settings.fast_interval_s:g} s")
    for nm, res in runs:
        click.echo("")
        click.echo(render(res, trace, title=nm, show_all=show_all))
    if len(runs) == 2:
        click.echo("")
        click.echo(compare_text(runs[0][1], runs[0][0], runs[1][1], runs[1][0]))
