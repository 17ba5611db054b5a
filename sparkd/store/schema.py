"""SQLAlchemy 2 models. Times are UTC epoch seconds (float); sizes are bytes (int).

The schema is owned by Alembic (``migrations/``); these models mirror it.

On disk, the ``samples`` table keeps sizes as integer KiB (``SAMPLE_KIB_COLUMNS``: the
resolution of /proc/meminfo, whose every figure is in kB) and PSI averages as integer
hundredths (``SAMPLE_HUNDREDTHS_COLUMNS``: /proc/pressure prints two decimals); the models
convert, so everything above this module sees bytes and floats (migration 0005, issue 18:
a 128 GiB figure is 6 bytes in SQLite as bytes, 4 as KiB; a PSI average 8 bytes as REAL,
at most 2 as hundredths).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Float, Index, Integer, String, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Sample columns (name -> SQL type), shared by the model and the CSV export.
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
AGGREGATE_FIELDS = ("mem_available", "mem_free", "cached", "anon_pages", "slab", "driver_bytes", "psi_some_avg10")


class Base(DeclarativeBase):
    pass


class SampleRow(Base):
    """One guard sample. Keyed by ``ts`` and ``WITHOUT ROWID`` (migration 0003): the table is
    its own time index, no rowid and no separate index per row."""

    __tablename__ = "samples"
    __table_args__ = ({"sqlite_with_rowid": False},)
    ts: Mapped[float] = mapped_column(Float, primary_key=True)
    # the class namespace is a dict: declare the many sample columns from the one list
    for _c in SAMPLE_INT_COLUMNS:
        locals()[_c] = mapped_column(_c, KiB if _c in SAMPLE_KIB_COLUMNS else BigInteger, nullable=True)
    for _c in SAMPLE_FLOAT_COLUMNS:
        locals()[_c] = mapped_column(_c, Hundredths, nullable=True)
    del _c


class SampleMinute(Base):
    __tablename__ = "sample_minutes"
    minute_ts: Mapped[float] = mapped_column(Float, primary_key=True)
    n: Mapped[int] = mapped_column(Integer)
    for _f in AGGREGATE_FIELDS:
        for _agg in ("min", "avg", "max"):
            locals()[f"{_f}_{_agg}"] = mapped_column(f"{_f}_{_agg}", Float, nullable=True)
    del _f, _agg


class Event(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    kind: Mapped[str] = mapped_column(String(64), index=True)
    severity: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    launch_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)


class DaemonRun(Base):
    __tablename__ = "daemon_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[float] = mapped_column(Float)
    stopped_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    pid: Mapped[int] = mapped_column(Integer)
    version: Mapped[str] = mapped_column(String(32))
    hostname: Mapped[str] = mapped_column(String(255))
    exit_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    config: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class KernelCount(Base):
    """Per-minute counts of classified kernel-log records, so bursts are visible."""

    __tablename__ = "kernel_counts"
    minute_ts: Mapped[float] = mapped_column(Float, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    count: Mapped[int] = mapped_column(Integer)


class NvrmWindow(Base):
    """Driver-error lines per non-overlapping window (each line counted once)."""

    __tablename__ = "nvrm_windows"
    window_start: Mapped[float] = mapped_column(Float, primary_key=True)
    window_s: Mapped[float] = mapped_column(Float)
    count: Mapped[int] = mapped_column(Integer)


class StatusSnapshot(Base):
    """The daemon's latest in-memory state (rule counters, container), one row."""

    __tablename__ = "status"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


class Launch(Base):
    __tablename__ = "launches"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    revision: Mapped[int | None] = mapped_column(Integer, nullable=True)
    started_at: Mapped[float] = mapped_column(Float, index=True)
    ready_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    stopped_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    container_id: Mapped[str | None] = mapped_column(String(80), nullable=True)
    image: Mapped[str | None] = mapped_column(String(255), nullable=True)
    status: Mapped[str] = mapped_column(String(32))
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    actual: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    trough_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    driver_baseline_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    forced: Mapped[bool] = mapped_column(default=False)


class ConfigRevision(Base):
    __tablename__ = "config_revisions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float)
    who: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    diff: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class GpuSample(Base):
    """NVML readings; ``memory_supported`` False where the driver says Not Supported (GB10)."""

    __tablename__ = "gpu_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    gpu_index: Mapped[int | None] = mapped_column(Integer, nullable=True)
    name: Mapped[str | None] = mapped_column(String(128), nullable=True)
    utilization_pct: Mapped[float | None] = mapped_column(Float, nullable=True)
    temperature_c: Mapped[float | None] = mapped_column(Float, nullable=True)
    power_w: Mapped[float | None] = mapped_column(Float, nullable=True)
    memory_total_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    memory_used_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    memory_supported: Mapped[bool | None] = mapped_column(nullable=True)


class ConsumerScan(Base):
    """Who holds the memory: one process scan (every ``consumers.interval_s``, and at trips).

    Group RSS totals as columns (bytes); ``data``: the JSON summary (top processes, top command
    names, MemAvailable at the scan) — ``sparkd.core.consumers.ConsumerSummary.to_json()``.
    """

    __tablename__ = "consumer_scans"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[float] = mapped_column(Float, index=True)
    container_bytes: Mapped[int] = mapped_column(BigInteger)
    host_bytes: Mapped[int] = mapped_column(BigInteger)
    system_bytes: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


Index("ix_events_kind_ts", Event.kind, Event.ts)
