"""Trace columns: which CSV/DB column feeds which ``Sample`` field (names, unit suffixes,
other watchdogs' aliases, ``--column NAME=FIELD``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from sparkd.core.sample import FIELD_ALIASES, MEMINFO_ATTRS, Sample
from sparkd.errors import SparkdError
from sparkd.units import GiB, MiB


class TraceError(SparkdError):
    """A trace cannot be read: the message names what was found and what is accepted."""

    status_code = 422
    code = "invalid_trace"


# Accepted time columns, in order of preference. ``phase`` means "row order, no times";
# ``epoch``/``timestamp``/``unix`` are epoch seconds (other watchdogs' CSV rings).
TIME_COLUMNS = (
    "t_s",
    "ts",
    "time",
    "t",
    "time_s",
    "elapsed_s",
    "seconds",
    "epoch",
    "timestamp",
    "unix",
    "epoch_s",
    "unix_s",
    "epoch_ms",
    "timestamp_ms",
    "unix_ms",
    "ts_ms",
    "phase",
)
EPOCH_COLUMNS = frozenset(
    {"ts", "epoch", "timestamp", "unix", "epoch_s", "unix_s", *[c for c in TIME_COLUMNS if c.endswith("_ms")]}
)
# Time columns in milliseconds (divided by 1000).
MS_COLUMNS = frozenset(c for c in TIME_COLUMNS if c.endswith("_ms"))

# Other watchdogs' names for sparkd's fields (matched case-insensitively, before a unit suffix
# _gib/_mib/_kib/_kb/_bytes): homelab rings write mem_avail_gib, usable_gib, anon_gib, ... A decimal
# _gb/_mb suffix is not guessed (GB or GiB? the configuration refuses it too): map it with --column.
COLUMN_ALIASES: dict[str, str] = {
    "mem_avail": "mem_available",
    "memavailable": "mem_available",
    "memavail": "mem_available",
    "available": "mem_available",
    "avail": "mem_available",
    "memfree": "mem_free",
    "free": "mem_free",
    "cache": "cached",
    "anon": "anon_pages",
    "anonpages": "anon_pages",
    "cmafree": "cma_free",
    "cmatotal": "cma_total",
    "usable": "mem_available_minus_cma",
    "mem_usable": "mem_available_minus_cma",
    "some_avg10": "psi_some_avg10",
    "full_avg10": "psi_full_avg10",
    "memtotal": "mem_total",
    "total": "mem_total",
    "avail_mem": "mem_available",
    "available_mem": "mem_available",
    "free_mem": "mem_free",
    "usable_mem": "mem_available_minus_cma",
    "usable_memory": "mem_available_minus_cma",
    "cma_avail": "cma_free",
}
_UNIT_SUFFIXES: tuple[tuple[str, float], ...] = (
    ("_gib", float(GiB)),
    ("_mib", float(MiB)),
    ("_kib", 1024.0),
    ("_kb", 1024.0),
    ("_bytes", 1.0),
)

# Sample attributes a trace may carry (everything but the clocks and the meminfo dict).
_SAMPLE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Sample) if f.name not in ("ts", "mono", "meminfo")
)
_FLOAT_FIELDS = frozenset(f for f in _SAMPLE_FIELDS if "avg" in f)
# Counts are held (zero-order) between recorded samples when interpolating, never blended:
# a driver error is not "half seen" between two samples.
_HELD_FIELDS = frozenset({"nvrm_recent", "shm_entries"})

ACCEPTED_COLUMNS_TEXT = (
    f"time: one of {', '.join(TIME_COLUMNS)} (phase = row order; epoch, timestamp, unix = epoch seconds, "
    "*_ms = epoch milliseconds); "
    "memory: mem_available_gib, mem_free_gib, cma_free_gib, cached_gib, ... (GiB; also _mib, _kb, _bytes), "
    "MemAvailable, MemFree, ... (bytes), mem_available, mem_free, ... (bytes, as 'sparkd samples --csv' "
    f"writes them), and the aliases {', '.join(sorted(COLUMN_ALIASES))}; at least MemAvailable or MemFree. "
    "Map any other column with --column NAME=FIELD (e.g. --column avail_g=mem_available_gib, "
    "--column when=epoch)"
)


def resolve_field(name: str) -> tuple[str, float] | None:
    """A column name (or a ``--column`` FIELD) → ``(Sample attribute, factor to bytes)``, or ``None``.

    Accepted: a meminfo name (``MemAvailable``: bytes), a Sample attribute (``mem_available``:
    bytes), either with a unit suffix (``mem_available_gib``), a rule field name
    (``MemAvailable-CmaFree``, ``usable``) or an alias of ``COLUMN_ALIASES`` (case-insensitive).
    """
    name = name.strip()
    if name in MEMINFO_ATTRS:
        return MEMINFO_ATTRS[name], 1.0
    if name in _SAMPLE_FIELDS:
        return name, 1.0
    if name in FIELD_ALIASES and FIELD_ALIASES[name] in _SAMPLE_FIELDS:
        return FIELD_ALIASES[name], 1.0
    low = name.lower()
    for suffix, f in (*_UNIT_SUFFIXES, ("", 1.0)):
        if suffix and not low.endswith(suffix):
            continue
        base = low.removesuffix(suffix) if suffix else low
        attr = base if base in _SAMPLE_FIELDS else COLUMN_ALIASES.get(base)
        if attr is None:
            attr = next((a for m, a in MEMINFO_ATTRS.items() if m.lower() == base), None)
        if attr is None:
            continue
        if suffix and attr in _FLOAT_FIELDS:
            continue  # a percentage has no unit
        return attr, f
    return None


def parse_column_options(options: Sequence[str]) -> dict[str, str]:
    """``--column NAME=FIELD`` options → ``{NAME: FIELD}``; FIELD ``epoch``/``time``/``t_s``/``phase``
    makes NAME the time column.

    Raises:
        TraceError: not ``NAME=FIELD``, or FIELD is not a field sparkd knows (the message lists examples).
    """
    out: dict[str, str] = {}
    for opt in options:
        name, sep, fld = opt.partition("=")
        name, fld = name.strip(), fld.strip()
        if not sep or not name or not fld:
            raise TraceError(f"--column {opt!r}: expected NAME=FIELD (e.g. --column avail_g=mem_available_gib)")
        if fld not in TIME_COLUMNS and resolve_field(fld) is None:
            raise TraceError(
                f"--column {opt!r}: unknown field {fld!r}; use a time column name ({', '.join(TIME_COLUMNS)}) "
                "or a field such as mem_available_gib, mem_free_gib, cma_free_gib, MemAvailable (bytes), usable_gib"
            )
        out[name] = fld
    return out


def _column_map(
    columns: Sequence[str], overrides: Mapping[str, str] | None = None
) -> tuple[dict[str, tuple[str, float]], list[str]]:
    """Map CSV columns to ``(Sample attribute, factor to bytes)``; return the ignored ones.
    ``overrides``: ``{column: field}`` from ``--column``; the first column for one field wins."""
    out: dict[str, tuple[str, float]] = {}
    ignored = []
    taken: set[str] = set()
    for col in columns:
        name = col.strip()
        fld = (overrides or {}).get(name)
        if fld is None and name.lower() in TIME_COLUMNS:
            continue
        if fld is not None and fld in TIME_COLUMNS:
            continue
        hit = resolve_field(fld if fld is not None else name)
        if hit is None or hit[0] in taken:
            ignored.append(name)
        else:
            taken.add(hit[0])
            out[col] = hit
    return out, ignored


def _time_column(columns: Sequence[str], overrides: Mapping[str, str] | None) -> tuple[str | None, str | None]:
    """``(column, kind)``: the time column and what it holds (a ``TIME_COLUMNS`` name)."""
    for col, fld in (overrides or {}).items():
        if fld in TIME_COLUMNS and col in columns:
            return col, fld
    for kind in TIME_COLUMNS:
        for col in columns:
            if col.strip().lower() == kind:
                return col, kind
    return None, None
