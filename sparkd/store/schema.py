"""SQLAlchemy 2 Core tables. Times are UTC epoch seconds (float); sizes are bytes (int).

The schema is owned by Alembic (``migrations/``); these tables mirror it.

On disk, the ``samples`` table keeps sizes as integer KiB (``SAMPLE_KIB_COLUMNS``: the
resolution of /proc/meminfo, whose every figure is in kB) and PSI averages as integer
hundredths (``SAMPLE_HUNDREDTHS_COLUMNS``: /proc/pressure prints two decimals); the column types
convert, so everything above this module sees bytes and floats (migration 0005, issue 18:
a 128 GiB figure is 6 bytes in SQLite as bytes, 4 as KiB; a PSI average 8 bytes as REAL,
at most 2 as hundredths).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Column, Float, Index, Integer, MetaData, String, Table, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

# Sample columns (name -> SQL type), shared by the table and the CSV export.
SAMPLE_INT_COLUMNS = (
    "mem_total",
    "mem_free",
    "mem_available",
    "buffers",
    "cached",
    "swap_total",
    "swap_free",
    "shmem",
    "anon_pages",
    "slab",
    "sreclaimable",
    "sunreclaim",
    "page_tables",
    "kernel_stack",
    "cma_total",
    "cma_free",
    "psi_some_total_us",
    "psi_full_total_us",
    "shm_bytes",
    "shm_entries",
    "driver_bytes",
    "nvrm_recent",
    "low_watermark_bytes",
    "mem_available_minus_cma",
)
SAMPLE_FLOAT_COLUMNS = ("psi_some_avg10", "psi_some_avg60", "psi_full_avg10", "psi_full_avg60")
SAMPLE_COLUMNS = ("ts", *SAMPLE_INT_COLUMNS, *SAMPLE_FLOAT_COLUMNS)
# stored as integer KiB (bytes above this module); the other int columns are counts or µs
SAMPLE_KIB_COLUMNS = tuple(
    c for c in SAMPLE_INT_COLUMNS if c not in ("psi_some_total_us", "psi_full_total_us", "shm_entries", "nvrm_recent")
)
SAMPLE_HUNDREDTHS_COLUMNS = SAMPLE_FLOAT_COLUMNS  # stored as integer hundredths


def bytes_to_kib(v: int | None) -> int | None:
    """Bytes → integer KiB as stored (rounded to the nearest KiB; meminfo figures are exact)."""
    return None if v is None else (int(v) + 512) // 1024


def hundredths(v: float | None) -> int | None:
    """A PSI average (two decimals in /proc/pressure) → integer hundredths as stored."""
    return None if v is None else round(v * 100)


#: column name → stored value from the value above the store (bytes, float); identity for the rest
SAMPLE_TO_DB = {
    **{c: bytes_to_kib for c in SAMPLE_KIB_COLUMNS},
    **{c: hundredths for c in SAMPLE_HUNDREDTHS_COLUMNS},
}
#: column name → factor from the stored value to bytes or the float (for aggregates SQL computes)
SAMPLE_FROM_DB_FACTOR = {**{c: 1024 for c in SAMPLE_KIB_COLUMNS}, **{c: 0.01 for c in SAMPLE_HUNDREDTHS_COLUMNS}}


class KiB(TypeDecorator[int]):
    """Bytes in Python, integer KiB in SQLite."""

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: int | None, dialect: Dialect) -> int | None:
        return bytes_to_kib(value)

    def process_result_value(self, value: int | None, dialect: Dialect) -> int | None:
        return None if value is None else int(value) * 1024


class Hundredths(TypeDecorator[float]):
    """A float with two decimals in Python, integer hundredths in SQLite."""

    impl = Integer
    cache_ok = True

    def process_bind_param(self, value: float | None, dialect: Dialect) -> int | None:
        return hundredths(value)

    def process_result_value(self, value: int | None, dialect: Dialect) -> float | None:
        return None if value is None else value / 100


# Fields kept as per-minute min/avg/max after raw samples expire (retention).
AGGREGATE_FIELDS = (
    "mem_available",
    "mem_free",
    "cached",
    "anon_pages",
    "slab",
    "driver_bytes",
    "psi_some_avg10",
    "mem_available_minus_cma",  # usable: the default rules' field (migration 0006)
)


metadata = MetaData()
"""The tables, as SQLAlchemy Core ``Table`` objects (no ORM: importing ``sqlalchemy.orm`` costs
6 MiB of resident memory in the daemon, issue 18). ``tests/test_store.py`` checks them against
the migrated database with Alembic's ``compare_metadata``."""


def _sample_column(name: str) -> Column[Any]:
    if name in SAMPLE_FLOAT_COLUMNS:
        return Column(name, Hundredths, nullable=True)
    return Column(name, KiB if name in SAMPLE_KIB_COLUMNS else BigInteger, nullable=True)


SAMPLES = Table(
    "samples",
    metadata,
    # keyed by ts and WITHOUT ROWID (migration 0003): the table is its own time index
    Column("ts", Float, primary_key=True),
    *(_sample_column(c) for c in (*SAMPLE_INT_COLUMNS, *SAMPLE_FLOAT_COLUMNS)),
    sqlite_with_rowid=False,
)
"""One guard sample per row."""

SAMPLE_MINUTES = Table(
    "sample_minutes",
    metadata,
    Column("minute_ts", Float, primary_key=True),
    Column("n", Integer, nullable=False),
    *(Column(f"{f}_{agg}", Float, nullable=True) for f in AGGREGATE_FIELDS for agg in ("min", "avg", "max")),
)
"""Per-minute min/avg/max of ``AGGREGATE_FIELDS`` after raw samples expire."""

EVENTS = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("ts", Float, nullable=False, index=True),
    Column("kind", String(64), nullable=False, index=True),
    Column("severity", String(16), nullable=False),
    Column("message", Text, nullable=False),
    Column("details", JSON, nullable=True),
    Column("launch_id", String(64), nullable=True, index=True),
)
Index("ix_events_kind_ts", EVENTS.c.kind, EVENTS.c.ts)

DAEMON_RUNS = Table(
    "daemon_runs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("started_at", Float, nullable=False),
    Column("stopped_at", Float, nullable=True),
    Column("pid", Integer, nullable=False),
    Column("version", String(32), nullable=False),
    Column("hostname", String(255), nullable=False),
    Column("exit_reason", Text, nullable=True),
    Column("samples", Integer, nullable=False, default=0),
    Column("config", JSON, nullable=True),
)

KERNEL_COUNTS = Table(
    "kernel_counts",
    metadata,
    Column("minute_ts", Float, primary_key=True),
    Column("kind", String(32), primary_key=True),
    Column("count", Integer, nullable=False),
)
"""Per-minute counts of classified kernel-log records, so bursts are visible."""

NVRM_WINDOWS = Table(
    "nvrm_windows",
    metadata,
    Column("window_start", Float, primary_key=True),
    Column("window_s", Float, nullable=False),
    Column("count", Integer, nullable=False),
)
"""Driver-error lines per non-overlapping window (each line counted once)."""

STATUS = Table(
    "status",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("ts", Float, nullable=False),
    Column("data", JSON, nullable=False),
)
"""The daemon's latest in-memory state (rule counters, container), one row (id 1)."""

LAUNCHES = Table(
    "launches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("revision", Integer, nullable=True),
    Column("started_at", Float, nullable=False, index=True),
    Column("ready_at", Float, nullable=True),
    Column("stopped_at", Float, nullable=True),
    Column("container_id", String(80), nullable=True),
    Column("image", String(255), nullable=True),
    Column("status", String(32), nullable=False),
    Column("plan", JSON, nullable=True),
    Column("actual", JSON, nullable=True),
    Column("trough_bytes", BigInteger, nullable=True),
    Column("driver_baseline_bytes", BigInteger, nullable=True),
    Column("forced", Boolean, nullable=False, default=False),
)

CONFIG_REVISIONS = Table(
    "config_revisions",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("ts", Float, nullable=False),
    Column("who", String(128), nullable=False),
    Column("reason", Text, nullable=False),
    Column("data", JSON, nullable=False),
    Column("diff", JSON, nullable=True),
)

GPU_SAMPLES = Table(
    "gpu_samples",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("ts", Float, nullable=False, index=True),
    Column("gpu_index", Integer, nullable=True),
    Column("name", String(128), nullable=True),
    Column("utilization_pct", Float, nullable=True),
    Column("temperature_c", Float, nullable=True),
    Column("power_w", Float, nullable=True),
    Column("memory_total_bytes", BigInteger, nullable=True),
    Column("memory_used_bytes", BigInteger, nullable=True),
    Column("memory_supported", Boolean, nullable=True),
)
"""NVML readings; ``memory_supported`` False where the driver says Not Supported (GB10)."""

CONSUMER_SCANS = Table(
    "consumer_scans",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("ts", Float, nullable=False, index=True),
    Column("container_bytes", BigInteger, nullable=False),
    Column("host_bytes", BigInteger, nullable=False),
    Column("system_bytes", BigInteger, nullable=False),
    Column("data", JSON, nullable=False),
)
"""Who holds the memory: one process scan (every ``consumers.interval_s``, and at trips). Group RSS
totals as columns (bytes); ``data``: the JSON summary (top processes, top command names, MemAvailable
at the scan) — ``sparkd.core.consumers.ConsumerSummary.to_json()``."""
