"""Trace loaders: a CSV or sparkd's database → a ``Trace`` of ``Sample``s (bytes, ``mono`` =
seconds from the trace start). Refusals name the row, the column and what is accepted."""

from __future__ import annotations

import csv
import datetime as dt
import io
import itertools
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkd.core.sample import Sample, derive
from sparkd.ops.replay.columns import (
    _FLOAT_FIELDS,
    ACCEPTED_COLUMNS_TEXT,
    EPOCH_COLUMNS,
    MS_COLUMNS,
    TraceError,
    _column_map,
    _time_column,
)
from sparkd.units import MiB

# The most samples a replay holds, read or interpolated. Measured: a replay of 200,000
# points with the default rules peaks near 300 MB RSS (1,000,000 points: 1.3 GB) — memory
# taken from the pool sparkd guards. 48 h of 1 s samples (the raw retention) fits.
MAX_TRACE_POINTS = 200_000


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
    if column in ("time", "ts", "timestamp"):
        try:
            d = dt.datetime.fromisoformat(text.strip())
        except ValueError:
            pass
        else:
            if d.tzinfo is None:
                d = d.replace(tzinfo=dt.UTC)
            return d.timestamp()
    raise TraceError(f"{where}: {text.strip()!r} is not a number of seconds (or an ISO-8601 time)")


def _layout(
    columns: list[str], columns_map: Mapping[str, str] | None, source: str
) -> tuple[str, str, dict[str, tuple[str, float]], list[str]]:
    """``(time column, its kind, {column: (attribute, factor)}, ignored columns)`` of a header.

    Raises:
        TraceError: a ``--column`` names no column, or no time or memory column; the message
            names the columns found, what is accepted and the ``--column`` flag.
    """
    unknown = [c for c in (columns_map or {}) if c not in columns]
    if unknown:
        raise TraceError(
            f"{source}: --column names {', '.join(unknown)}, not a column of this trace. "
            f"Columns found: {', '.join(columns) or '(none)'}"
        )
    time_col, time_kind = _time_column(columns, columns_map)
    mapping, ignored = _column_map(columns, columns_map)
    attrs = {a for a, _ in mapping.values()}
    if time_col is None or time_kind is None or not attrs & {"mem_available", "mem_free", "mem_available_minus_cma"}:
        missing = "time column" if time_col is None else "MemAvailable or MemFree column"
        raise TraceError(
            f"{source}: unknown trace layout: no {missing}. Columns found: {', '.join(columns) or '(none)'}. "
            f"Accepted: {ACCEPTED_COLUMNS_TEXT}"
        )
    return time_col, time_kind, mapping, ignored


def samples_from_rows(
    rows: Iterable[Mapping[str, Any]],
    *,
    source: str,
    row_interval_s: float = 1.0,
    max_rows: int | None = None,
    columns_map: Mapping[str, str] | None = None,
) -> Trace:
    """Build a trace from dict rows (CSV rows or ``Store.samples`` rows), one row at a time.

    Columns are matched by ``resolve_field`` (names, unit suffixes, aliases); ``columns_map``
    (``--column NAME=FIELD``) names the rest. Usable memory (``mem_available_minus_cma``) is
    derived from MemAvailable and CmaFree exactly as the live guard derives it
    (``core.sample.derive``); a usable column is used only when MemAvailable is absent.

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
    time_col, time_kind, mapping, ignored = _layout(list(first.keys()), columns_map, source)
    attrs = {a for a, _ in mapping.values()}
    given_usable = "mem_available_minus_cma" in attrs
    usable_replaced = 0
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
        if time_kind == "phase":
            t = i * row_interval_s
            label = None if raw is None else str(raw)
        else:
            if raw is None or str(raw).strip() == "":
                raise TraceError(f"{source}: row {n}, column {time_col}: empty")
            t = _parse_time(str(raw), time_kind or time_col, n, source)
            if time_kind in MS_COLUMNS:
                t /= 1000.0
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
        given = s.mem_available_minus_cma
        derive(s)  # usable = MemAvailable − CmaFree, as build_sample does for the live guard
        if s.mem_available_minus_cma is None:
            s.mem_available_minus_cma = given
        elif given is not None and abs(given - s.mem_available_minus_cma) > 16 * MiB:
            usable_replaced += 1
        out.append(s)
        labels.append(label)
        prev = row
    if given_usable and usable_replaced:
        notes.append(
            "usable memory derived from MemAvailable and CmaFree as the guard does; the trace's usable column "
            f"differed by more than 16 MiB on {usable_replaced} row(s) and was not used there"
        )
    if time_kind == "phase":
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
    return Trace(out, source, labels=labels, notes=notes, epoch=time_kind in EPOCH_COLUMNS)


def load_csv(
    path: str | Path,
    *,
    row_interval_s: float = 1.0,
    max_rows: int | None = None,
    columns_map: Mapping[str, str] | None = None,
) -> Trace:
    """Read a CSV trace (``sparkd samples --csv`` or a generic time/GiB layout), streaming:
    at most ``max_rows`` (default ``MAX_TRACE_POINTS``) rows are read, more are refused.

    Raises:
        TraceError: unreadable file, unknown layout, a bad row, or too many rows.
    """
    p = Path(path)
    try:
        with p.open(newline="") as f:
            return _csv_trace(
                f, source=p.name, row_interval_s=row_interval_s, max_rows=max_rows, columns_map=columns_map
            )
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {p}: {e}") from None


def loads_csv(
    text: str,
    *,
    source: str = "<csv>",
    row_interval_s: float = 1.0,
    max_rows: int | None = None,
    columns_map: Mapping[str, str] | None = None,
) -> Trace:
    """``load_csv`` on CSV text (tests, stdin)."""
    return _csv_trace(
        io.StringIO(text), source=source, row_interval_s=row_interval_s, max_rows=max_rows, columns_map=columns_map
    )


def _csv_trace(
    f: Iterable[str],
    *,
    source: str,
    row_interval_s: float,
    max_rows: int | None,
    columns_map: Mapping[str, str] | None = None,
) -> Trace:
    reader = csv.DictReader(f)
    try:
        first = next(reader, None)
        if first is None:
            raise TraceError(f"{source}: no rows (a header and at least one sample are needed)")
        return samples_from_rows(
            itertools.chain([first], reader),
            source=source,
            row_interval_s=row_interval_s,
            max_rows=max_rows,
            columns_map=columns_map,
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
