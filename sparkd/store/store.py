"""SQLite store (SQLAlchemy 2, WAL) and the batched writer the guard feeds.

The guard loop never waits on the database: it ``submit``s items to a bounded
queue; ``Writer.run`` drains it in batches and writes each batch in one
transaction in a worker thread. If the database is slow, locked or full, items
are dropped *after* the rules saw them, and that is logged once per episode.

Query functions are keyword-only and return plain dicts (times UTC epoch s,
sizes bytes).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Row, create_engine, delete, event, func, insert, select, text, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import SQLAlchemyError

from sparkd.errors import StoreError
from sparkd.resources import migrations_dir
from sparkd.store.schema import (
    AGGREGATE_FIELDS,
    CONFIG_REVISIONS,
    CONSUMER_SCANS,
    DAEMON_RUNS,
    EVENTS,
    GPU_SAMPLES,
    KERNEL_COUNTS,
    LAUNCHES,
    NVRM_WINDOWS,
    SAMPLE_COLUMNS,
    SAMPLE_FROM_DB_FACTOR,
    SAMPLE_MINUTES,
    SAMPLE_TO_DB,
    SAMPLES,
    STATUS,
)

#: what a read of the database can raise when it is corrupt, locked, full or gone (callers outside
#: ``store`` catch this, never SQLAlchemy's classes: SQLAlchemy appears only in this package)
READ_ERRORS: tuple[type[BaseException], ...] = (SQLAlchemyError, sqlite3.Error, OSError)
#: ``READ_ERRORS`` and sparkd's own ``StoreError`` (a database that cannot be opened): what a reading command says in
#: one line (``face.cli.base.unreadable``).
READ_OR_OPEN_ERRORS: tuple[type[BaseException], ...] = (*READ_ERRORS, StoreError)

log = logging.getLogger("sparkd.store.store")

_GPU_COLUMNS = (
    "ts",
    "gpu_index",
    "name",
    "utilization_pct",
    "temperature_c",
    "power_w",
    "memory_total_bytes",
    "memory_used_bytes",
    "memory_supported",
)
# OR IGNORE: ts is the key; a second sample at the very same ts (a clock stepped back) is not a reason
# to refuse the whole batch (and retry it forever)
_INSERT_SAMPLE = (
    f"INSERT OR IGNORE INTO samples ({', '.join(SAMPLE_COLUMNS)}) VALUES ({', '.join('?' * len(SAMPLE_COLUMNS))})"
)
_SAMPLE_CONV = tuple((c, SAMPLE_TO_DB.get(c)) for c in SAMPLE_COLUMNS)  # bytes → KiB, PSI → hundredths


def _sample_params(p: Any) -> tuple[Any, ...]:
    """A samples row (a dict of bytes and floats, or a ``core.sample.Sample``, which the daemon queues
    as it is) as the INSERT's parameters in stored units."""
    if not isinstance(p, dict):
        p = p.to_row()
    return tuple(p.get(c) if f is None else f(p.get(c)) for c, f in _SAMPLE_CONV)


_INSERT_GPU = f"INSERT INTO gpu_samples ({', '.join(_GPU_COLUMNS)}) VALUES ({', '.join('?' * len(_GPU_COLUMNS))})"
_UPSERT_KCOUNT = (
    "INSERT INTO kernel_counts (minute_ts, kind, count) VALUES (?, ?, ?) "
    "ON CONFLICT (minute_ts, kind) DO UPDATE SET count = count + excluded.count"
)
_UPSERT_STATUS = (
    "INSERT INTO status (id, ts, data) VALUES (1, ?, ?) "
    "ON CONFLICT (id) DO UPDATE SET ts = excluded.ts, data = excluded.data"
)

_SYNC_FULL = "PRAGMA synchronous=FULL"
_SYNC_NORMAL = "PRAGMA synchronous=NORMAL"
# the kinds written through prepared statements on the DBAPI connection (``_write_frequent``)
_FAST_KINDS = frozenset({"sample", "gpu", "kcount", "status"})


def _write_frequent(con: Any, frequent: tuple[list[Any], ...], durable: bool) -> None:
    """Samples, GPU rows, kernel counts and the newest status snapshot, as prepared statements on the
    DBAPI connection ``con`` (sqlite3), inside the caller's transaction."""
    samples, gpu, kcounts, statuses = frequent
    cur = con.cursor()
    try:
        # per connection, and before the first statement opens the transaction (pysqlite begins
        # at the first INSERT): set either way, as the pool may hand out a connection set before
        cur.execute(_SYNC_FULL if durable else _SYNC_NORMAL)
        if samples:
            cur.executemany(_INSERT_SAMPLE, samples)
        if gpu:
            cur.executemany(_INSERT_GPU, gpu)
        if kcounts:
            cur.executemany(_UPSERT_KCOUNT, kcounts)
        if statuses:  # one row: only the newest of the batch matters
            cur.execute(_UPSERT_STATUS, (statuses[-1]["ts"], json.dumps(statuses[-1])))
    finally:
        cur.close()


CHART_FIELDS = (
    "mem_available",
    "mem_free",
    "cached",
    "anon_pages",
    "slab",
    "driver_bytes",
    "psi_some_avg10",
    "mem_available_minus_cma",
)


def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA auto_vacuum=INCREMENTAL")  # only takes effect on a new file: freed pages return
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=2000")
    cur.close()


def _event_dict(e: Row[Any]) -> dict[str, Any]:
    return {
        "id": e.id,
        "ts": e.ts,
        "kind": e.kind,
        "severity": e.severity,
        "message": e.message,
        "details": e.details,
        "launch_id": e.launch_id,
    }


class Store:
    """Owns the engine. ``Store.open(path)`` creates the directory and migrates.

    Raises:
        StoreError: the path cannot be created, opened or migrated; the message
            names the path and the OS error.
    """

    def __init__(self, engine: Engine, path: Path) -> None:
        self.engine = engine
        self.path = path
        self._write_lock = threading.Lock()
        # the writer's own pooled connection, kept checked out: a batch of the frequent kinds alone (the
        # idle daemon's every write) skips the pool's checkout, reset and events (issue 18)
        self._fast: Any = None
        self._closed = False

    @classmethod
    def open(cls, path: str | Path, *, migrate: bool = True) -> Store:
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(p.parent, os.W_OK):
                raise PermissionError(f"directory {p.parent} is not writable")
            if p.exists() and not os.access(p, os.W_OK):
                raise PermissionError(f"database file {p} is not writable")
        except OSError as e:
            raise StoreError(f"cannot use database path {p}: {e}") from None
        engine = create_engine(f"sqlite:///{p}", connect_args={"check_same_thread": False, "timeout": 2.0})
        event.listen(engine, "connect", _on_connect)
        store = cls(engine, p)
        if migrate and not store.at_head():
            store.upgrade()
        return store

    def at_head(self) -> bool:
        """True when the database is already at the newest migration (read from the scripts'
        ``revision`` lines): then Alembic, a quarter of a second of imports, is not loaded."""
        try:
            with self.engine.connect() as conn:
                current = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalars().all()
        except SQLAlchemyError:
            return False  # a new file, or not made by sparkd: let Alembic decide
        return current == [script_head()]

    def upgrade(self, revision: str = "head") -> None:
        """Run Alembic migrations up to ``revision``."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(migrations_dir()))
        cfg.set_main_option("sqlalchemy.url", str(self.engine.url))
        try:
            with self.engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
        except (SQLAlchemyError, OSError) as e:
            raise StoreError(f"cannot migrate database {self.path}: {e}") from None

    def upgrade_in_child(self, timeout_s: float = 900.0) -> None:
        """``upgrade()`` to the head in a child process (``python -m sparkd.store.migrate PATH``), so
        the daemon never imports Alembic and Mako: ~11 MiB resident for as long as it runs, for a
        step taken once per release (issue 18). The child opens the file with ``Store.open``.

        Raises:
            StoreError: the child failed (its message, e.g. SQLite's "file is not a database") or
                did not finish within ``timeout_s``.
        """
        import subprocess
        import sys

        cmd = [sys.executable, "-m", "sparkd.store.migrate", str(self.path)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise StoreError(f"cannot migrate database {self.path}: {e}") from None
        if out.returncode != 0:
            lines = (out.stderr or out.stdout).strip().splitlines() or [f"exit status {out.returncode}"]
            raise StoreError(lines[-1].removeprefix("sparkd: ")[:500])

    def current_revision(self) -> str | None:
        with self.engine.connect() as conn:
            try:
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            except SQLAlchemyError:
                return None

    def close(self) -> None:
        """Close the connections. Never waits for a batch the writer's thread is writing (a write lock held
        elsewhere keeps one up to the busy timeout, 2 s, and this runs on the event loop): that batch, once
        it has let go of the lock, closes the writer's connection (``write_batch``)."""
        self._closed = True
        self._close_fast_if_idle()
        self.engine.dispose()

    def _close_fast_if_idle(self) -> None:
        """Close the writer's kept connection unless a batch holds it. Called by ``close`` and, after
        ``close``, by each batch once it let go of the lock: whichever comes last closes it."""
        if not self._write_lock.acquire(blocking=False):
            return
        try:
            fast, self._fast = self._fast, None
            if fast is not None:
                with contextlib.suppress(Exception):
                    # out of the pool, then closed: ``close`` alone would hand it back to a pool that
                    # ``engine.dispose`` has already emptied, and leave the file open
                    fast.detach()
                    fast.close()
        finally:
            self._write_lock.release()

    # ------------------------------------------------------------------ writes
    def write_batch(self, items: list[tuple[str, Any]], *, durable: bool = False) -> None:
        """Write queued items in one transaction. Item kinds: ``sample`` (row dict),
        ``gpu`` (row dict), ``event`` (dict), ``status`` (dict), ``kcount`` ((minute_ts, kind, n)),
        ``nvrm_window`` ((start, window_s, count)), ``launch`` (dict, upsert by id),
        ``run_end`` (dict), ``consumers`` (dict: ts, container/host/system_bytes, data), ``event_replayed``
        (dict: an event written again after the database file was lost; skipped when one with its ts, kind
        and message is there).

        The frequent kinds (samples, GPU rows, the status snapshot, kernel counts) go
        through the DBAPI cursor as prepared statements (one ``executemany`` per kind):
        building and compiling SQLAlchemy statements per batch was half of the idle
        daemon's CPU (py-spy, issue 18). A batch of those kinds alone is written on a connection the
        store keeps checked out (``_write_fast``: no pool checkout, reset or events per batch; 25 % of the
        writer thread's idle CPU, issue 18). The rare kinds keep SQLAlchemy Core.
        Thread-safe (a lock): the writer thread and ``save_launch`` may call it at once.

        ``durable``: the commit reaches the disk before this returns (``PRAGMA synchronous=FULL``: SQLite
        syncs the WAL at the commit), so it survives a power cut, not only a crash of sparkd. Otherwise
        ``synchronous=NORMAL``: WAL commits are synced at checkpoints, and the kernel writes them back
        within its dirty-page expiry (``vm.dirty_expire_centisecs``, 30 s by default) — a host that
        freezes and is power-cycled can lose that much. The writer asks for it under pressure
        (``Writer.pressure``): the samples just before a freeze are the ones a postmortem needs.

        Raises:
            sqlalchemy.exc.SQLAlchemyError, sqlite3.Error: the database refused the batch
                (nothing of it is kept: one transaction).
        """
        samples = [_sample_params(p) for k, p in items if k == "sample"]
        gpu = [tuple(p.get(c) for c in _GPU_COLUMNS) for k, p in items if k == "gpu"]
        kcounts = [p for k, p in items if k == "kcount"]
        statuses = [p for k, p in items if k == "status"]
        frequent = (samples, gpu, kcounts, statuses)
        if all(k in _FAST_KINDS for k, _p in items):
            try:
                with self._write_lock:
                    self._write_fast(frequent, durable)
            finally:
                if self._closed:  # closed while this batch was written (or before): the kept connection too
                    self._close_fast_if_idle()
            return
        events = [p for k, p in items if k == "event"]
        replayed = [p for k, p in items if k == "event_replayed"]
        scans = [p for k, p in items if k == "consumers"]
        with self._write_lock, self.engine.begin() as conn:
            _write_frequent(conn.connection.driver_connection, frequent, durable)
            if scans:
                conn.execute(insert(CONSUMER_SCANS), scans)
            if events:
                conn.execute(insert(EVENTS), events)
            for p in replayed:  # written again from memory after the file was lost: once, even if it reached it
                same = (EVENTS.c.ts == p["ts"], EVENTS.c.kind == p["kind"], EVENTS.c.message == p["message"])
                if conn.execute(select(EVENTS.c.id).where(*same).limit(1)).first() is None:
                    conn.execute(insert(EVENTS), [p])
            for kind, p in items:
                if kind == "nvrm_window":
                    start, w, n = p
                    stmt3 = sqlite_insert(NVRM_WINDOWS).values(window_start=start, window_s=w, count=n)
                    conn.execute(
                        stmt3.on_conflict_do_update(
                            index_elements=["window_start"], set_={"count": NVRM_WINDOWS.c.count + n}
                        )
                    )
                elif kind == "launch":
                    cols = {k: v for k, v in p.items() if k != "id"}  # only what this item sets
                    stmt4 = sqlite_insert(LAUNCHES).values(**{"status": "starting", **p})  # a row not yet written
                    conn.execute(stmt4.on_conflict_do_update(index_elements=["id"], set_=cols) if cols else stmt4)
                elif kind == "run_end":
                    conn.execute(update(DAEMON_RUNS).where(DAEMON_RUNS.c.id == p.pop("id")).values(**p))

    def _write_fast(self, frequent: tuple[list[Any], ...], durable: bool) -> None:
        """``write_batch`` of the frequent kinds alone, on the writer's kept connection; one transaction."""
        if self._fast is None:
            self._fast = self.engine.raw_connection()
        con = self._fast.driver_connection
        try:
            _write_frequent(con, frequent, durable)
            con.commit()
        except BaseException:
            with contextlib.suppress(Exception):
                con.rollback()
            raise

    def start_run(self, *, pid: int, version: str, hostname: str, config: dict[str, Any]) -> int:
        with self.engine.begin() as conn:
            r = conn.execute(
                insert(DAEMON_RUNS).values(
                    started_at=time.time(), pid=pid, version=version, hostname=hostname, config=config, samples=0
                )
            )
            return int(r.inserted_primary_key[0])  # type: ignore[index]

    def add_event(
        self,
        *,
        kind: str,
        message: str,
        severity: str = "info",
        details: dict[str, Any] | None = None,
        launch_id: str | None = None,
        ts: float | None = None,
    ) -> None:
        """Write one event now (for CLI processes; the daemon goes through the queue)."""
        with self.engine.begin() as conn:
            conn.execute(
                insert(EVENTS).values(
                    ts=ts or time.time(),
                    kind=kind,
                    severity=severity,
                    message=message,
                    details=details,
                    launch_id=launch_id,
                )
            )

    # ------------------------------------------------------------------ reads
    def latest_sample(self, *, until: float | None = None) -> dict[str, Any] | None:
        """The newest sample (dict, bytes), or the newest at or before ``until`` (epoch s): after the wall
        clock stepped back, samples dated in the future are not the latest reading."""
        q = select(SAMPLES).order_by(SAMPLES.c.ts.desc()).limit(1)
        if until is not None:
            q = q.where(SAMPLES.c.ts <= until)
        with self.engine.connect() as conn:
            row = conn.execute(q).first()
        return _sample_dict(row) if row else None

    def samples(self, *, since: float, until: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        q = select(SAMPLES).where(SAMPLES.c.ts >= since).order_by(SAMPLES.c.ts)
        if until is not None:
            q = q.where(SAMPLES.c.ts <= until)
        if limit:
            q = q.limit(limit)
        with self.engine.connect() as conn:
            return [_sample_dict(r) for r in conn.execute(q)]

    def count_samples(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(SAMPLES)).scalar_one())

    def downsampled(
        self, *, since: float, until: float, step_s: float, fields: Iterable[str] = CHART_FIELDS
    ) -> list[dict[str, Any]]:
        """min/avg/max of ``fields`` per ``step_s`` bucket, from raw samples and, where raw
        samples have expired, from the per-minute aggregates. Shape: ``[{"ts": bucket_start,
        "n": k, "<f>_min": .., "<f>_avg": .., "<f>_max": ..}, ...]`` sorted by ts.
        """
        fields = list(fields)
        step_s = max(step_s, 0.001)
        bucket = func.cast((SAMPLES.c.ts - since) / step_s, Integer_())
        cols = [bucket.label("b"), func.count().label("n")]
        for f in fields:
            c = SAMPLES.c[f]
            cols += [func.min(c).label(f"{f}_min"), func.avg(c).label(f"{f}_avg"), func.max(c).label(f"{f}_max")]
        q = select(*cols).where(SAMPLES.c.ts >= since, SAMPLES.c.ts <= until).group_by("b").order_by("b")
        out: dict[int, dict[str, Any]] = {}
        with self.engine.connect() as conn:
            for r in conn.execute(q):
                d = dict(r._mapping)
                b = d.pop("b")
                d["ts"] = since + b * step_s
                _scale_avgs(d, fields)
                out[b] = d
            agg_fields = [f for f in fields if f in AGGREGATE_FIELDS]
            first_raw = conn.execute(select(func.min(SAMPLES.c.ts))).scalar()
            agg_until = min(until, first_raw) if first_raw is not None else until
            if agg_fields and agg_until > since:
                mb = func.cast((SAMPLE_MINUTES.c.minute_ts - since) / step_s, Integer_())
                acols = [mb.label("b"), func.sum(SAMPLE_MINUTES.c.n).label("n")]
                for f in agg_fields:
                    acols += [
                        func.min(SAMPLE_MINUTES.c[f"{f}_min"]).label(f"{f}_min"),
                        func.avg(SAMPLE_MINUTES.c[f"{f}_avg"]).label(f"{f}_avg"),
                        func.max(SAMPLE_MINUTES.c[f"{f}_max"]).label(f"{f}_max"),
                    ]
                aq = (
                    select(*acols)
                    .where(SAMPLE_MINUTES.c.minute_ts >= since, SAMPLE_MINUTES.c.minute_ts < agg_until)
                    .group_by("b")
                )
                for r in conn.execute(aq):
                    d = dict(r._mapping)
                    b = d.pop("b")
                    if b not in out:
                        d["ts"] = since + b * step_s
                        out[b] = d
        return [out[b] for b in sorted(out)]

    def events(
        self,
        *,
        since: float | None = None,
        kinds: Iterable[str] | None = None,
        limit: int = 100,
        until: float | None = None,
        after_id: int | None = None,
        before_id: int | None = None,
    ) -> list[dict[str, Any]]:
        """Events newest first. ``since``/``until``: epoch s, inclusive; ``after_id``/``before_id``:
        only ids above/below (live updates and paging)."""
        q = select(EVENTS).order_by(EVENTS.c.ts.desc(), EVENTS.c.id.desc()).limit(limit)
        if since is not None:
            q = q.where(EVENTS.c.ts >= since)
        if until is not None:
            q = q.where(EVENTS.c.ts <= until)
        if after_id is not None:
            q = q.where(EVENTS.c.id > after_id)
        if before_id is not None:
            q = q.where(EVENTS.c.id < before_id)
        if kinds:
            q = q.where(EVENTS.c.kind.in_(list(kinds)))
        with self.engine.connect() as conn:
            rows = list(conn.execute(q))
        return [_event_dict(e) for e in rows]

    def event(self, event_id: int) -> dict[str, Any] | None:
        """One event by id, or None."""
        with self.engine.connect() as conn:
            e = conn.execute(select(EVENTS).where(EVENTS.c.id == event_id)).first()
            return _event_dict(e) if e is not None else None

    def status_snapshot(self) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(STATUS.c.data).where(STATUS.c.id == 1)).first()
        return dict(row[0]) if row else None

    def kernel_counts(self, *, since: float) -> list[dict[str, Any]]:
        q = select(KERNEL_COUNTS).where(KERNEL_COUNTS.c.minute_ts >= since).order_by(KERNEL_COUNTS.c.minute_ts)
        with self.engine.connect() as conn:
            return [{"minute_ts": r.minute_ts, "kind": r.kind, "count": r.count} for r in conn.execute(q)]

    def nvrm_windows(self) -> list[dict[str, Any]]:
        q = select(NVRM_WINDOWS).order_by(NVRM_WINDOWS.c.window_start)
        with self.engine.connect() as conn:
            return [{"window_start": r.window_start, "window_s": r.window_s, "count": r.count} for r in conn.execute(q)]

    def gpu_samples(self, *, since: float, limit: int = 10000) -> list[dict[str, Any]]:
        q = select(GPU_SAMPLES).where(GPU_SAMPLES.c.ts >= since).order_by(GPU_SAMPLES.c.ts).limit(limit)
        with self.engine.connect() as conn:
            return [{c: getattr(r, c) for c in _GPU_COLUMNS} for r in conn.execute(q)]

    def consumer_scans(self, *, since: float, limit: int = 1000) -> list[dict[str, Any]]:
        """Process scans since ``since`` (UTC epoch s), oldest first: ts, group totals (bytes), data."""
        q = select(CONSUMER_SCANS).where(CONSUMER_SCANS.c.ts >= since).order_by(CONSUMER_SCANS.c.ts).limit(limit)
        cols = ("ts", "container_bytes", "host_bytes", "system_bytes", "data")
        with self.engine.connect() as conn:
            return [{c: getattr(r, c) for c in cols} for r in conn.execute(q)]

    def runs(self, *, limit: int = 20) -> list[dict[str, Any]]:
        q = select(DAEMON_RUNS).order_by(DAEMON_RUNS.c.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [
                {
                    "id": r.id,
                    "started_at": r.started_at,
                    "stopped_at": r.stopped_at,
                    "pid": r.pid,
                    "version": r.version,
                    "exit_reason": r.exit_reason,
                    "samples": r.samples,
                }
                for r in conn.execute(q)
            ]

    def unclean_run(self, before_id: int) -> dict[str, Any] | None:
        """The newest run before ``before_id`` if it never recorded its end (``stopped_at`` NULL: a
        ``kill -9``, a power cut, a frozen host), with ``last_sample_ts``: the newest sample before the
        next run started (epoch s; None without one). None when that run ended cleanly, or there is none."""
        with self.engine.connect() as conn:
            prev = conn.execute(
                select(DAEMON_RUNS).where(DAEMON_RUNS.c.id < before_id).order_by(DAEMON_RUNS.c.id.desc()).limit(1)
            ).first()
            if prev is None or prev.stopped_at is not None:
                return None
            nxt = conn.execute(select(DAEMON_RUNS.c.started_at).where(DAEMON_RUNS.c.id == before_id)).scalar()
            q = select(func.max(SAMPLES.c.ts)).where(SAMPLES.c.ts >= prev.started_at)
            last = conn.execute(q.where(SAMPLES.c.ts < nxt) if nxt is not None else q).scalar()
        return {"id": prev.id, "pid": prev.pid, "started_at": prev.started_at, "last_sample_ts": last}

    def launches(self, *, limit: int = 50) -> list[dict[str, Any]]:
        q = select(LAUNCHES).order_by(LAUNCHES.c.started_at.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [_launch_dict(r) for r in conn.execute(q)]

    def launch(self, launch_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(LAUNCHES).where(LAUNCHES.c.id == launch_id)).first()
        return _launch_dict(row) if row else None

    def save_launch(self, data: dict[str, Any]) -> None:
        self.write_batch([("launch", dict(data))])

    # ------------------------------------------------------------------ revisions
    def add_revision(self, *, who: str, reason: str, data: dict[str, Any], diff: dict[str, Any] | None) -> int:
        with self.engine.begin() as conn:
            r = conn.execute(
                insert(CONFIG_REVISIONS).values(ts=time.time(), who=who, reason=reason, data=data, diff=diff)
            )
            return int(r.inserted_primary_key[0])  # type: ignore[index]

    def revision_in_effect(self, base: dict[str, Any]) -> dict[str, Any] | None:
        """The newest configuration revision when it was made on top of ``base`` (the configuration file's
        ``budget`` section as ``model_dump()``): a resize, in effect until the file's budget changes. None when
        there is no revision or the newest was made on another base (the file was edited since: the file wins).
        Shape: ``{"id", "ts", "who", "reason", "data" (the budget settings, without ``_config_base``), "diff"}``.
        The daemon (``LaunchBook._load_revision``) and ``sparkd config show`` / ``plan`` read it the same way."""
        revs = self.revisions(limit=1)
        if not revs or revs[0]["data"].get("_config_base") != base:
            return None
        rev = revs[0]
        return {**rev, "data": {k: v for k, v in rev["data"].items() if k != "_config_base"}}

    def revisions(self, *, limit: int = 50) -> list[dict[str, Any]]:
        q = select(CONFIG_REVISIONS).order_by(CONFIG_REVISIONS.c.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [
                {"id": r.id, "ts": r.ts, "who": r.who, "reason": r.reason, "data": r.data, "diff": r.diff}
                for r in conn.execute(q)
            ]

    # ------------------------------------------------------------------ retention
    def prune(
        self, *, now: float, raw_keep_s: float, minutes_keep_s: float, events_keep_s: float, batch: int = 5000
    ) -> dict[str, int]:
        """Aggregate expiring raw samples into ``sample_minutes`` then delete them, in small
        transactions (``batch`` rows) so the writer is never blocked for long.
        Returns counts of rows removed per table.
        """
        cutoff = now - raw_keep_s
        removed = {"samples": 0, "sample_minutes": 0, "events": 0, "launches": 0, "kernel_counts": 0}
        while True:
            with self.engine.begin() as conn:
                first = conn.execute(select(func.min(SAMPLES.c.ts)).where(SAMPLES.c.ts < cutoff)).scalar()
                if first is None:
                    break
                m0 = first - first % 60
                m1 = min(m0 + 60 * max(1, batch // 60), cutoff)
                mb = (func.cast(SAMPLES.c.ts / 60, Integer_()) * 60).label("m")
                cols: list[Any] = [mb, func.count().label("n")]
                for f in AGGREGATE_FIELDS:
                    c = SAMPLES.c[f]
                    cols += [func.min(c), func.avg(c), func.max(c)]
                rows = conn.execute(select(*cols).where(SAMPLES.c.ts >= m0, SAMPLES.c.ts < m1).group_by("m")).all()
                for r in rows:
                    vals: dict[str, Any] = {"minute_ts": float(r[0]), "n": r[1]}
                    for i, f in enumerate(AGGREGATE_FIELDS):
                        vals[f"{f}_min"], vals[f"{f}_avg"], vals[f"{f}_max"] = r[2 + 3 * i : 5 + 3 * i]
                    _scale_avgs(vals, AGGREGATE_FIELDS)
                    stmt = sqlite_insert(SAMPLE_MINUTES).values(**vals)
                    # a minute split across two prune passes: widen the envelope, weight the mean
                    n_old, n_new = SAMPLE_MINUTES.c.n, vals["n"]
                    merged: dict[str, Any] = {"n": n_old + n_new}
                    for f in AGGREGATE_FIELDS:
                        if vals[f"{f}_avg"] is None:
                            continue
                        merged[f"{f}_min"] = func.min(
                            func.coalesce(SAMPLE_MINUTES.c[f"{f}_min"], vals[f"{f}_min"]), vals[f"{f}_min"]
                        )
                        merged[f"{f}_max"] = func.max(
                            func.coalesce(SAMPLE_MINUTES.c[f"{f}_max"], vals[f"{f}_max"]), vals[f"{f}_max"]
                        )
                        merged[f"{f}_avg"] = (
                            func.coalesce(SAMPLE_MINUTES.c[f"{f}_avg"], vals[f"{f}_avg"]) * n_old
                            + vals[f"{f}_avg"] * n_new
                        ) / (n_old + n_new)
                    conn.execute(stmt.on_conflict_do_update(index_elements=["minute_ts"], set_=merged))
                res = conn.execute(delete(SAMPLES).where(SAMPLES.c.ts >= m0, SAMPLES.c.ts < m1))
                removed["samples"] += res.rowcount or 0
        expire = (
            ("sample_minutes", SAMPLE_MINUTES.c.minute_ts, minutes_keep_s),
            ("events", EVENTS.c.ts, events_keep_s),
            ("launches", LAUNCHES.c.started_at, events_keep_s),
            ("kernel_counts", KERNEL_COUNTS.c.minute_ts, minutes_keep_s),
            ("gpu_samples", GPU_SAMPLES.c.ts, raw_keep_s),
            ("consumer_scans", CONSUMER_SCANS.c.ts, raw_keep_s),
            ("nvrm_windows", NVRM_WINDOWS.c.window_start, minutes_keep_s),
        )
        with self.engine.begin() as conn:
            for name, col, keep_s in expire:
                removed[name] = conn.execute(delete(col.table).where(col < now - keep_s)).rowcount or 0
        return removed

    def vacuum(self) -> None:
        """Return freed pages to the file system (auto_vacuum=INCREMENTAL) and truncate the WAL."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA incremental_vacuum")
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")


_REVISION_LINE = re.compile(r"^(down_revision|revision)\s*=\s*(?:\"([^\"]*)\"|None)", re.M)


def script_head() -> str | None:
    """The newest revision of ``migrations/versions`` (the one no script revises), parsed
    from the scripts' ``revision = "…"`` / ``down_revision = "…"`` lines without Alembic.
    None when that is not a single head (Alembic then decides)."""
    revs: set[str] = set()
    downs: set[str] = set()
    for f in (migrations_dir() / "versions").glob("*.py"):
        for key, value in _REVISION_LINE.findall(f.read_text()):
            (revs if key == "revision" else downs).add(value)
    heads = revs - downs
    return heads.pop() if len(heads) == 1 else None


def _done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _short(e: BaseException) -> str:
    """An error in one line, without the SQL statement and its parameters."""
    orig = getattr(e, "orig", None)
    text = f"{type(orig or e).__name__}: {orig or e}"
    return text.splitlines()[0][:200]


def Integer_() -> Any:
    from sqlalchemy import Integer

    return Integer()


def _scale_avgs(d: dict[str, Any], fields: Iterable[str]) -> None:
    """``<f>_avg`` of samples columns from stored units (KiB, hundredths) to bytes and floats: SQL's
    avg() has no column type, so the model cannot convert it (min and max it does)."""
    for f in fields:
        k = SAMPLE_FROM_DB_FACTOR.get(f)
        if k is not None and d.get(f"{f}_avg") is not None:
            d[f"{f}_avg"] *= k


def _sample_dict(r: Row[Any]) -> dict[str, Any]:
    return {c: getattr(r, c) for c in SAMPLE_COLUMNS}


def _launch_dict(r: Row[Any]) -> dict[str, Any]:
    return {
        "id": r.id,
        "revision": r.revision,
        "started_at": r.started_at,
        "ready_at": r.ready_at,
        "stopped_at": r.stopped_at,
        "container_id": r.container_id,
        "image": r.image,
        "status": r.status,
        "plan": r.plan,
        "actual": r.actual,
        "trough_bytes": r.trough_bytes,
        "driver_baseline_bytes": r.driver_baseline_bytes,
        "forced": r.forced,
    }


WRITE_EVERY_S = 10.0
"""The writer gathers samples (and the other frequent kinds, ``GATHERED``) for this long
before it writes them in one transaction: a sample reaches the database at most this long
(plus the write itself) after the guard took it, and a ``kill -9`` loses at most this much
history. Any other item (an event, a launch, the end of a run) is written at once with what
was gathered. One commit per second cost more than the guard's tick (py-spy, issue 18).
Under pressure (the daemon samples fast) the gathering is ``PRESSURE_WRITE_EVERY_S`` and each
write is synced to the disk."""

PRESSURE_WRITE_EVERY_S = 1.0
"""Under pressure (``Writer.pressure``: the daemon samples fast) the writer gathers at most this long,
and each write is durable (``Store.write_batch(durable=True)``): a ``kill -9`` or a power cut after a
freeze loses at most ~1 s of the samples that led to it. ``WRITE_EVERY_S`` again once the host is quiet."""

FAILING_REPORT_S = 15.0
"""Writes failing this long (a write lock held elsewhere, a full disk: errors that pass) make the
keeper declare the database unavailable (``database_unavailable``, critical; ``database_recovered``
after). Shorter episodes (a backup's lock, ``busy_timeout`` 2 s) are retried quietly."""

DUE_SLACK_S = 0.1  # a submit this close before the due time ends the gathering (ticks jitter)
FALLBACK_S = 1.5  # with no submit, the gathering ends this long after it was due

GATHERED = frozenset({"sample", "gpu", "status", "kcount", "nvrm_window", "consumers"})
#: Places beyond the queue's ``maxsize`` for records of the other kinds (events): a queue full of samples still
#: takes them (``Writer.submit``).
EVENT_RESERVE = 1000


def _ts_of(p: Any) -> float | None:
    """The ``ts`` of a queued record (a dict, or a ``Sample``), or None."""
    ts = p.get("ts") if isinstance(p, dict) else getattr(p, "ts", None)
    return ts if isinstance(ts, int | float) else None


class RecordQueue:
    """The records waiting for the writer, oldest first, at most ``maxsize`` of them (``Writer.submit`` drops a
    record beyond that; ``maxsize`` <= 0: no bound). ``items`` is a ``collections.deque`` (in C, safe to append
    and pop from two threads), not an ``asyncio.Queue``: its ``put_nowait`` ran four Python frames in every
    tick, which on an idle host each cost several µs cold (issue 18). ``Writer.run`` waits for a first record
    through a future of its own."""

    __slots__ = ("items", "maxsize")

    def __init__(self, maxsize: int) -> None:
        self.items: collections.deque[tuple[str, Any]] = collections.deque()
        self.maxsize = maxsize

    def qsize(self) -> int:
        return len(self.items)

    def empty(self) -> bool:
        return not self.items

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self.items)

    def get_nowait(self) -> tuple[str, Any]:
        """The oldest record. Raises IndexError when there is none."""
        return self.items.popleft()


class Writer:
    """Bounded queue → batched writes in the writer's own thread.

    ``submit`` never blocks and never raises: when the queue is full the item is
    dropped and that is logged once until the queue drains again. Samples are
    gathered for up to ``write_every_s`` (``WRITE_EVERY_S``) before a write, under
    ``pressure`` for up to ``PRESSURE_WRITE_EVERY_S`` and written durably; other
    kinds are written at once.

    Wake-ups (issue 18: on an idle host each wake-up of the process costs more than the work it
    does): the gathering ends in the ``submit`` that finds it due, so the guard's own tick hands
    the batch over and the event loop keeps no timer of its own (a fallback timer, cancelled
    while submits come, covers a writer fed by nobody); the batch goes to a thread of the
    writer, which nobody awaits: the loop is not woken when a write completes. Only a writer
    that must wait for the thread (a batch still being written or retried) asks to be woken.
    """

    def __init__(
        self,
        store: Store | None,
        maxsize: int = 10000,
        batch_max: int = 1000,
        write_every_s: float = WRITE_EVERY_S,
    ) -> None:
        if write_every_s < 0:
            raise ValueError(f"write_every_s = {write_every_s!r}: must be >= 0 (seconds)")
        self.store = store
        self.write_every_s = write_every_s
        self._urgent_queued = False  # an item outside GATHERED waits in the queue
        self.queue = RecordQueue(maxsize)
        self._getter: asyncio.Future[None] | None = None  # run() waits on it for a record while none is queued
        self.batch_max = batch_max
        self.dropped = 0
        self.written = 0
        self.failures = 0
        self._drop_logged = False
        self._fail_logged = False
        self._pending: list[tuple[str, Any]] = []
        self.refused = 0
        self.refusals: list[tuple[str, str]] = []
        self.last_error: str | None = None
        self.failing_since: float | None = None  # monotonic time of the first failed write of this episode
        self._write_started: float | None = None  # monotonic time the write in the thread began, while it runs
        self.fatal: str | None = None
        self._retry = threading.Event()  # set by ``attach``: the thread retries a refused batch at once
        self._gather_fut: asyncio.Future[None] | None = None
        self._due = 0.0  # monotonic time the gathering ends
        self._gather_started = 0.0  # monotonic time the gathering began
        # set by the daemon while it samples fast: gather PRESSURE_WRITE_EVERY_S, write durably
        self.pressure = False
        # the batch handed to the thread and not yet written (it retries it with back-off), and the
        # loop's future woken when the thread is done with it (only while the loop waits for that)
        self._inflight: list[tuple[str, Any]] | None = None
        self._inflight_done: asyncio.Future[None] | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        # in the worker thread after each write: why the file written is no longer the database at
        # its path (``keeper.DbKeeper.replaced``: deleted, replaced), or None. SQLite keeps writing
        # into an unlinked file without a word; this finds it within one write (WRITE_EVERY_S).
        self.check_file: Callable[[], str | None] | None = None
        self.lost: str | None = None  # what check_file said (the keeper reopens)
        # newest ``ts`` of a record known to be in the database file at its path (what is newer waits in
        # the queue: ``loop.reads`` answers it from memory)
        self.safe_until = 0.0
        # on the event loop, when the keeper has something to do (fatal, lost, refusals, a watched directory changed)
        self.on_trouble: Callable[[], None] | None = None
        # directories of the state files sparkd writes again when deleted (the token, the stop intent, its log):
        # looked at after each write (``dirs_changed``); the daemon sets them
        self.watched_dirs: tuple[str, ...] = ()
        self._dir_mtimes: dict[str, int | None] = {}
        # held while a batch is written: flush() at shutdown waits for a write still in flight in the
        # worker thread (cancelling ``run`` cannot stop that thread), then sees exactly what is left
        self._lock = threading.Lock()

    def attach(self, store: Store | None) -> None:
        """Write into ``store`` from now on (None: no database; records wait in the queue)."""
        self.store = store
        self.lost = None
        if store is not None:
            self._retry.set()

    def set_pressure(self, on: bool) -> None:
        """Under pressure (the daemon samples fast) or not: see ``PRESSURE_WRITE_EVERY_S``. Turned on
        during a gathering, that gathering ends ``PRESSURE_WRITE_EVERY_S`` after it began (at once if
        longer ago: the next submit ends it)."""
        self.pressure = on
        if on:
            self._due = min(self._due, self._gather_started + PRESSURE_WRITE_EVERY_S)

    def submit(self, kind: str, payload: Any, *, urgent: bool = False) -> bool:
        """Queue one record (never blocks, never raises; False when the queue is full and it was dropped).
        ``urgent``: write it (and what was gathered) at once, though its kind is one ``GATHERED``."""
        q = self.queue
        n = len(q.items)
        # a full queue drops samples, not what a sample cannot give back: events (a trip, a stop) and others beyond
        # GATHERED have EVENT_RESERVE places more. A long outage filled it with samples and the stop's own events
        # were the records dropped, missing from /events and the incidents for good (helper-53)
        if q.maxsize <= 0 or n < q.maxsize or (kind not in GATHERED and n < q.maxsize + EVENT_RESERVE):
            q.items.append((kind, payload))
            if urgent or kind not in GATHERED:
                self._urgent_queued = True
            getter = self._getter
            if getter is not None and not getter.done():
                getter.set_result(None)  # run() waited for a first record
            fut = self._gather_fut
            if (
                fut is not None
                and not fut.done()
                and (self._urgent_queued or time.monotonic() >= self._due - DUE_SLACK_S)
            ):
                fut.set_result(None)  # urgent, or due: this submit (the guard's tick) ends the gathering
            return True
        self.dropped += 1
        if not self._drop_logged:
            log.warning(
                "database writer is behind: queue full (%d items); dropping records after the rules saw them",
                self.queue.maxsize,
            )
            self._drop_logged = True
            if self.on_trouble is not None:  # the keeper reports it (an event, not only a log line)
                self.on_trouble()
        return False

    def _take_batch(self, first: tuple[str, Any] | None = None) -> list[tuple[str, Any]]:
        batch = [first] if first else []
        items = self.queue.items
        while len(batch) < self.batch_max:
            if not items:
                self._urgent_queued = False
                break
            batch.append(items.popleft())
        return batch

    async def _get(self) -> tuple[str, Any]:
        """The oldest queued record, waiting (on the loop) for a ``submit`` while there is none."""
        items = self.queue.items
        while not items:
            loop = self._loop or asyncio.get_running_loop()
            self._getter = loop.create_future()
            try:
                await self._getter
            finally:
                self._getter = None
        return items.popleft()

    def _write(self, batch: list[tuple[str, Any]]) -> bool:
        """Write one batch; False (and logged once per episode) when the database refused it.

        A batch refused for a reason that passes (locked, busy, disk full, no database yet) is kept
        for a retry. A batch refused *permanently* (``keeper.is_permanent``: a constraint, a value
        SQLite cannot store) is written item by item: each refused item is dropped, counted in
        ``refused`` and listed in ``refusals`` (kind, reason) for the daemon to report; the rest is
        written. A corrupt database sets ``fatal`` (the daemon moves it aside and reopens).
        """
        from sparkd.store.keeper import is_corrupt, is_permanent

        store = self.store
        if store is None:
            return False
        self._write_started = time.monotonic()
        try:
            store.write_batch(batch, durable=self.pressure)
        except Exception as e:
            if is_permanent(e):
                return self._write_each(store, batch)
            self.failures += 1
            self.last_error = _short(e)
            if self.failing_since is None:
                self.failing_since = time.monotonic()
            if is_corrupt(e):
                self.fatal = self.last_error
            if not self._fail_logged:
                log.error(
                    "database write failed (%s); the guard goes on, records wait in the queue (%d max) "
                    "and are written when the database recovers",
                    self.last_error,
                    self.queue.maxsize,
                )
                self._fail_logged = True
            return False
        finally:
            self._write_started = None
        self._ok(len(batch))
        return True

    def _write_each(self, store: Store, batch: list[tuple[str, Any]]) -> bool:
        from sparkd.store.keeper import is_permanent

        for i, item in enumerate(batch):
            try:
                store.write_batch([item], durable=self.pressure)
            except Exception as e:
                if not is_permanent(e):
                    self.failures += 1
                    self.last_error = _short(e)
                    del batch[:i]  # the rest waits for a retry; what is written is not written twice
                    return False
                self.refused += 1
                self.refusals.append((item[0], _short(e)))
                continue
            self.written += 1
        self._ok(0)
        return True

    def hung_for(self) -> float:
        """Seconds the write under way in the writer's thread has not returned (0.0 when none runs). A write that
        blocks without failing (a hung disk or mount, an fsync stuck behind writeback under memory pressure) showed
        "database ok" while nothing was recorded, until the queue filled 40 min to hours later (helper-53)."""
        started = self._write_started
        return 0.0 if started is None else time.monotonic() - started

    def write_hung_s(self) -> float | None:
        """Seconds the write under way has not returned, once that is ``FAILING_REPORT_S`` or more: a hung write
        (``database_write_hung``, ``Status.database.write_hung_s``). None before, and when no write runs."""
        hung = self.hung_for()
        return hung if hung >= FAILING_REPORT_S else None

    def failing_for(self) -> float:
        """Seconds the writes have been failing (0.0 when the last one succeeded)."""
        since = self.failing_since
        return 0.0 if since is None else time.monotonic() - since

    def _ok(self, n: int) -> None:
        self.failing_since = None
        self.written += n
        if self._fail_logged:
            log.info("database writes recovered")
        self._fail_logged = False
        self.last_error = None
        if self.queue.qsize() < self.queue.maxsize // 2:
            self._drop_logged = False

    async def run(self) -> None:
        """Gather, hand each batch to the writer's thread; until cancelled (then ``flush`` and ``close``)."""
        self._start_thread()
        while True:
            pending = self._pending if self._pending else None
            if pending is None:
                first = await self._get()
                holder = [first]
                self._pending = holder  # out of the queue while we gather: a shutdown flush must see it
                if first[0] in GATHERED and self.write_every_s > 0:
                    await self._gather()
                if self._pending is not holder:  # a flush wrote it meanwhile
                    continue
                pending = self._pending = self._take_batch(first)
            # one batch at a time with the thread, as one transaction at a time: while it still writes
            # (or retries, the database locked or full) the next batch waits here and the queue fills
            while self._inflight is not None:
                await self._wait_inflight()
            if self._pending is not pending:
                continue  # a flush took it while we waited
            with self._cv:
                self._inflight, self._pending = pending, []
                self._cv.notify()

    async def _wait_inflight(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._inflight_done = fut
        try:
            if self._inflight is None:  # done meanwhile
                return
            await fut
        finally:
            self._inflight_done = None

    def _start_thread(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._thread is None or not self._thread.is_alive():
            self._closing = False
            self._thread = threading.Thread(target=self._thread_main, name="sparkd-writer", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """End the writer's thread (after ``flush`` at shutdown); what it still holds is left for ``flush``."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._retry.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _thread_main(self) -> None:
        from sparkd.store.keeper import is_full

        backoff = 0.25
        while True:
            with self._cv:
                while self._inflight is None and not self._closing:
                    self._cv.wait()
                batch = self._inflight
            if batch is None or self._closing:
                return
            try:
                written = self._write_locked(batch)
            except Exception as e:  # never let the thread end: recording would stop without a word
                written = False
                self.failures += 1
                self.last_error = _short(e)
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                if not self._fail_logged:
                    log.error("database writer: %s; the batch is kept and tried again", self.last_error)
                    self._fail_logged = True
            if not written:
                self._retry.wait(backoff)  # ``attach`` wakes it at once
                self._retry.clear()
                backoff = min(backoff * 2, 5.0)
            else:
                backoff = 0.25
            loop = self._loop
            if loop is None:
                continue
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                if self._inflight is None and self._inflight_done is not None:  # the loop waits for us
                    loop.call_soon_threadsafe(self._done_inflight)
                failing = self.store is not None and (
                    self.failing_for() >= FAILING_REPORT_S or is_full(self.last_error)
                )
                changed = self.dirs_changed()
                if (self.fatal or self.lost or self.refusals or failing or changed) and self.on_trouble is not None:
                    loop.call_soon_threadsafe(self.on_trouble)

    def dirs_changed(self) -> bool:
        """Whether an entry was made or removed in a directory of ``watched_dirs`` (its ``st_mtime_ns`` moved, or
        it is gone) since the last look; the first look only notes them. Called by the writer's thread after each
        write (one ``stat`` per directory every ``WRITE_EVERY_S``): a state file deleted alone (the token, with
        the database beside it untouched) was written again only at the keeper's idle check, 40-55 s later
        (note 11); now within a write. sparkd's own saves move it too: the keeper then finds nothing to do."""
        changed = False
        for d in self.watched_dirs:
            try:
                m: int | None = os.stat(d).st_mtime_ns
            except OSError:
                m = None
            if d in self._dir_mtimes and self._dir_mtimes[d] != m:
                changed = True
            self._dir_mtimes[d] = m
        return changed

    def _done_inflight(self) -> None:
        fut = self._inflight_done
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _write_locked(self, batch: list[tuple[str, Any]]) -> bool:
        with self._lock:
            if self._inflight is not batch:  # a flush took it (and wrote or counted it) meanwhile
                return True
            ok = self._write(batch)
            if ok:
                self._inflight = None
                if self.check_file is not None and self.lost is None:
                    self.lost = self.check_file()
                if self.lost is None:
                    self._stored(batch)
            return ok

    def _stored(self, batch: list[tuple[str, Any]]) -> None:
        """``safe_until`` moves to the newest ``ts`` of a batch just written."""
        self.safe_until = max((ts for _k, p in batch if (ts := _ts_of(p)) is not None), default=self.safe_until)

    async def _gather(self) -> None:
        """Wait ``write_every_s``, or less when an item outside ``GATHERED`` or a full batch is queued.
        Ended by the first ``submit`` at or after the due time (no timer of ours wakes the loop), or
        by a fallback timer ``FALLBACK_S`` later when nothing is submitted."""
        if self.queue.qsize() >= self.batch_max or self._urgent_queued:
            return
        loop = self._loop or asyncio.get_running_loop()  # run() keeps it (get_running_loop costs a getpid())
        fut: asyncio.Future[None] = loop.create_future()
        self._gather_fut = fut
        every_s = min(self.write_every_s, PRESSURE_WRITE_EVERY_S) if self.pressure else self.write_every_s
        self._gather_started = time.monotonic()
        self._due = self._gather_started + every_s
        handle = loop.call_later(self.write_every_s + FALLBACK_S, _done, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._gather_fut = None

    async def written_until(self, ts: float, timeout_s: float) -> bool:
        """Wait on the loop, taking nothing from the writer, until the records up to ``ts`` (UTC epoch s) are in the
        database (``safe_until``), at most ``timeout_s``: True when they are, False at once when no database is
        open. A postmortem archive asks before it reads (``act.stop.write_postmortem``): unlike ``flush``, a
        database locked or gone neither holds up the stop for the retries nor drops the queued records."""
        deadline = time.monotonic() + timeout_s
        while self.safe_until < ts:
            if self.store is None or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def flush(self, attempts: int = 3) -> int:
        """Write everything still queued (synchronously, at shutdown). Returns items written;
        a batch the database keeps refusing after ``attempts`` tries is dropped and counted.

        Waits for a batch the worker thread is still writing, so nothing is written twice or lost.
        """
        with self._lock:
            return self._flush(attempts)

    def _flush(self, attempts: int) -> int:
        n = 0
        with self._cv:  # the batch the thread holds (not being written: we hold the write lock) comes first
            inflight, self._inflight = self._inflight, None
        if inflight:
            self._pending = inflight + self._pending
        if self._loop is not None and self._inflight_done is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._done_inflight)
        if self.store is None:  # no database: what is queued cannot be written now
            left = len(self._pending) + self.queue.qsize()
            self._pending = []
            while not self.queue.empty():
                self.queue.get_nowait()
            self.dropped += left
            return 0
        batches = [self._pending] if self._pending else []
        self._pending = []
        while not self.queue.empty():
            batches.append(self._take_batch())
        for batch in batches:
            for i in range(attempts):
                if self._write(batch):
                    n += len(batch)
                    if self.lost is None:
                        self._stored(batch)
                    break
                time.sleep(0.2 * (i + 1))
            else:
                self.dropped += len(batch)
        return n
