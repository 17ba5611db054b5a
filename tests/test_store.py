from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from sqlalchemy import inspect

from sparkd.errors import StoreError
from sparkd.store.store import Store, Writer


def _row(ts: float, avail: int) -> dict:
    return {"ts": ts, "mem_available": avail, "mem_free": avail // 2, "mem_total": 100}


def test_it_creates_the_schema_through_alembic(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "db" / "sparkd.db")
    assert s.current_revision() == "0003"
    tables = set(inspect(s.engine).get_table_names())
    assert {"samples", "events", "daemon_runs", "kernel_counts", "status", "launches", "alembic_version"} <= tables
    with s.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_an_unwritable_path_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError) as e:
        Store.open(blocker / "sub" / "sparkd.db")
    assert str(blocker / "sub" / "sparkd.db") in e.value.message


def test_downsampling_returns_min_avg_max_per_bucket(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "s.db")
    t0 = 1_700_000_000.0
    s.write_batch([("sample", _row(t0 + i, 1000 + i)) for i in range(120)])
    b = s.downsampled(since=t0, until=t0 + 119, step_s=60, fields=["mem_available"])
    assert [x["n"] for x in b] == [60, 60]
    assert (b[0]["mem_available_min"], b[0]["mem_available_max"]) == (1000, 1059)
    assert b[0]["mem_available_avg"] == pytest.approx(1029.5)


def test_the_writer_drops_when_full_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> Writer:
        w = Writer(Store.open(tmp_path / "w.db"), maxsize=10)
        for i in range(25):
            w.submit("sample", _row(float(i), i))
        return w

    with caplog.at_level(logging.WARNING, logger="sparkd.store.store"):
        w = asyncio.run(go())
    assert w.dropped == 15
    assert sum("queue full" in r.message for r in caplog.records) == 1
    assert w.flush() == 10
    assert w.store is not None and w.store.count_samples() == 10


def test_a_failing_database_never_raises_into_the_guard(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> Writer:
        store = Store.open(tmp_path / "f.db")
        store.engine.dispose()
        (tmp_path / "f.db").unlink()
        (tmp_path / "f.db").mkdir()  # the path is now a directory: every write fails
        w = Writer(store, maxsize=100)
        for i in range(5):
            w.submit("sample", _row(float(i), i))
        return w

    with caplog.at_level(logging.ERROR, logger="sparkd.store.store"):
        w = asyncio.run(go())
        w.flush()
        w.submit("sample", _row(9.0, 9))
        w.flush()
    assert w.failures == 6 and w.dropped == 6  # three attempts per batch at shutdown, then counted as dropped
    assert sum("database write failed" in r.message for r in caplog.records) == 1


def test_retention_aggregates_then_prunes(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "r.db")
    now = time.time()
    t0 = now - 3 * 3600
    s.write_batch([("sample", _row(t0 + i, 5000 + (i % 60))) for i in range(0, 3 * 3600, 1)])
    s.write_batch(
        [
            (
                "event",
                {"ts": t0, "kind": "trip", "severity": "critical", "message": "m", "details": None, "launch_id": None},
            )
        ]
    )
    removed = s.prune(now=now, raw_keep_s=3600, minutes_keep_s=30 * 86400, events_keep_s=365 * 86400)
    assert removed["samples"] == 2 * 3600
    assert s.count_samples() == 3600
    assert s.events() and s.events()[0]["kind"] == "trip"
    chart = s.downsampled(since=t0, until=now, step_s=600, fields=["mem_available"])
    assert len(chart) == 18  # 2 h from minute aggregates + 1 h raw, in 10-minute buckets
    assert all(x["mem_available_min"] == 5000 and x["mem_available_max"] == 5059 for x in chart)


def test_a_locked_database_delays_records_but_loses_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import sqlite3

    db = tmp_path / "l.db"
    store = Store.open(db)

    async def go() -> Writer:
        w = Writer(store, maxsize=1000)
        task = asyncio.create_task(w.run())
        holder = sqlite3.connect(db, timeout=0)
        holder.execute("BEGIN EXCLUSIVE")  # another process holds the database
        for i in range(20):
            w.submit("sample", _row(float(i), i))
            await asyncio.sleep(0.2)  # held 4 s > the 2 s busy_timeout: writes fail and are retried
        holder.rollback()
        holder.close()
        for _ in range(100):
            if w.written == 20:
                break
            await asyncio.sleep(0.1)
        task.cancel()
        return w

    with caplog.at_level(logging.ERROR, logger="sparkd.store.store"):
        w = asyncio.run(go())
    assert w.failures >= 1 and w.dropped == 0
    assert store.count_samples() == 20
    msgs = [r.getMessage() for r in caplog.records if "database write failed" in r.getMessage()]
    assert len(msgs) == 1 and "INSERT" not in msgs[0] and "locked" in msgs[0]


def test_a_batch_in_flight_when_shutdown_cancels_the_writer_is_written_once() -> None:
    """Shutdown cancels ``Writer.run`` while its worker thread writes; ``flush`` then waits for that
    write and neither loses nor repeats the batch (seen as a lost last status snapshot)."""
    import asyncio
    import threading

    from sparkd.store.store import Writer

    class SlowStore:  # the edge: a database whose write takes a while
        def __init__(self) -> None:
            self.rows: list[tuple[str, object]] = []
            self.started = threading.Event()

        def write_batch(self, batch: list[tuple[str, object]]) -> None:
            self.started.set()
            time.sleep(0.3)
            self.rows.extend(batch)

    async def go() -> SlowStore:
        store = SlowStore()
        w = Writer(store)  # type: ignore[arg-type]
        task = asyncio.create_task(w.run())
        for i in range(3):
            w.submit("event", i)
        await asyncio.to_thread(store.started.wait, 5)
        w.submit("event", 3)  # queued behind the batch in flight
        task.cancel()  # shutdown
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(w.flush)
        return store

    store = asyncio.run(go())
    assert [p for _, p in store.rows] == [0, 1, 2, 3]
