from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect

from sparkd.errors import StoreError
from sparkd.store.store import Store, Writer
from sparkd.units import KiB


def _row(ts: float, avail: int) -> dict:
    """A samples row; sizes in bytes (stored to the KiB, as meminfo gives them: pass KiB multiples
    where a test reads a size back)."""
    return {"ts": ts, "mem_available": avail, "mem_free": avail // 2, "mem_total": 100 * KiB}


def test_it_creates_the_schema_through_alembic(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "db" / "sparkd.db")
    assert s.current_revision() == "0006"
    tables = set(inspect(s.engine).get_table_names())
    assert {"samples", "events", "daemon_runs", "kernel_counts", "status", "launches", "alembic_version"} <= tables
    with s.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_the_core_tables_match_the_migrated_database(tmp_path: Path) -> None:
    """``schema``'s tables (Core, no ORM) against what the migrations made: Alembic's autogenerate
    comparison finds no table, column, type, nullability or index that differs."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from sparkd.store.schema import metadata

    s = Store.open(tmp_path / "sparkd.db")
    with s.engine.connect() as c:
        diff = compare_metadata(MigrationContext.configure(c, opts={"compare_type": True}), metadata)
    assert diff == []
    assert set(metadata.tables) == set(inspect(s.engine).get_table_names()) - {"alembic_version"}


def test_an_unwritable_path_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError) as e:
        Store.open(blocker / "sub" / "sparkd.db")
    assert str(blocker / "sub" / "sparkd.db") in e.value.message


def test_downsampling_returns_min_avg_max_per_bucket(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "s.db")
    t0 = 1_700_000_000.0
    s.write_batch([("sample", {**_row(t0 + i, (1000 + i) * KiB), "psi_some_avg10": i / 100}) for i in range(120)])
    b = s.downsampled(since=t0, until=t0 + 119, step_s=60, fields=["mem_available", "psi_some_avg10"])
    assert [x["n"] for x in b] == [60, 60]
    # stored as KiB and hundredths (migration 0005), read as bytes and floats: min, max and the mean
    assert (b[0]["mem_available_min"], b[0]["mem_available_max"]) == (1000 * KiB, 1059 * KiB)
    assert b[0]["mem_available_avg"] == pytest.approx(1029.5 * KiB)
    assert (b[1]["psi_some_avg10_min"], b[1]["psi_some_avg10_max"]) == (0.6, 1.19)
    assert b[1]["psi_some_avg10_avg"] == pytest.approx(0.895)


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
    s.write_batch([("sample", _row(t0 + i, (5000 + (i % 60)) * KiB)) for i in range(0, 3 * 3600, 1)])
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
    assert all(x["mem_available_min"] == 5000 * KiB and x["mem_available_max"] == 5059 * KiB for x in chart)


def test_usable_memory_is_charted_from_raw_samples_and_from_the_minute_aggregates(tmp_path: Path) -> None:
    """The default rules judge usable = MemAvailable − CmaFree (CONTEXT.md "CMA"): the chart's usable
    line and its stop lines need it both within and beyond the raw samples' retention (migration 0006)."""
    s = Store.open(tmp_path / "u.db")
    now = time.time()
    t0 = now - 2 * 3600
    rows = []
    for i in range(2 * 3600):
        avail, cma = (20_000 + i % 60) * KiB, 8_000 * KiB  # a host with 8,000 KiB of free CMA
        rows.append(("sample", {**_row(t0 + i, avail), "cma_free": cma, "mem_available_minus_cma": avail - cma}))
    s.write_batch(rows)
    s.prune(now=now, raw_keep_s=3600, minutes_keep_s=30 * 86400, events_keep_s=365 * 86400)
    chart = s.downsampled(since=t0, until=now, step_s=600, fields=["mem_available", "mem_available_minus_cma"])
    assert len(chart) == 12  # 1 h from minute aggregates + 1 h raw
    for x in chart:
        assert (x["mem_available_minus_cma_min"], x["mem_available_minus_cma_max"]) == (12_000 * KiB, 12_059 * KiB)
        assert x["mem_available_minus_cma_avg"] == pytest.approx(x["mem_available_avg"] - 8_000 * KiB)


def test_an_event_written_again_after_the_file_was_lost_is_kept_once(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "e.db")
    ev = {"ts": 1.5, "kind": "trip", "severity": "critical", "message": "m", "details": None, "launch_id": None}
    s.write_batch([("event", dict(ev))])
    s.write_batch([("event_replayed", dict(ev)), ("event_replayed", {**ev, "ts": 2.5})])
    assert [(e["ts"], e["kind"]) for e in s.events()] == [(2.5, "trip"), (1.5, "trip")]


def test_a_locked_database_delays_records_but_loses_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import sqlite3

    db = tmp_path / "l.db"
    store = Store.open(db)

    async def go() -> Writer:
        w = Writer(store, maxsize=1000, write_every_s=0)  # write each sample at once: the lock outlasts a try
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


def test_the_frequent_kinds_round_trip_through_the_prepared_statements(tmp_path: Path) -> None:
    s = Store.open(tmp_path / "p.db")
    t0 = 1_700_000_000.0
    gpu = {"ts": t0, "gpu_index": 0, "name": "GB10", "utilization_pct": 3.0, "memory_supported": False}
    s.write_batch(
        [
            ("sample", _row(t0, 7 << 30)),
            ("sample", {**_row(t0 + 1, 6 << 30), "psi_some_avg10": 1.5}),
            ("gpu", gpu),
            ("kcount", (t0 - t0 % 60, "oom_kill", 1)),
            ("kcount", (t0 - t0 % 60, "oom_kill", 2)),
            ("status", {"ts": t0, "n": 1}),
            ("status", {"ts": t0 + 1, "n": 2}),
        ]
    )
    rows = s.samples(since=t0)
    assert [(r["ts"], r["mem_available"], r["psi_some_avg10"]) for r in rows] == [
        (t0, 7 << 30, None),
        (t0 + 1, 6 << 30, 1.5),
    ]
    g = s.gpu_samples(since=t0)
    assert len(g) == 1 and g[0]["name"] == "GB10" and g[0]["memory_supported"] is False
    assert s.kernel_counts(since=t0 - 60) == [{"minute_ts": t0 - t0 % 60, "kind": "oom_kill", "count": 3}]
    assert s.status_snapshot() == {"ts": t0 + 1, "n": 2}  # the newest of the batch


def test_samples_are_gathered_for_write_every_s_and_an_event_is_written_at_once(tmp_path: Path) -> None:
    db = tmp_path / "g.db"
    store = Store.open(db)

    def count(table: str) -> int:
        import sqlite3

        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return int(con.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
        finally:
            con.close()

    async def go() -> tuple[list[tuple[float, int]], float]:
        w = Writer(store, write_every_s=1.5)
        task = asyncio.create_task(w.run())
        t0 = time.monotonic()
        seen: list[tuple[float, int]] = []  # (s since the first sample, rows in the database)
        for i in range(6):
            w.submit("sample", _row(float(i), i))
            await asyncio.sleep(0.25)
            seen.append((time.monotonic() - t0, await asyncio.to_thread(count, "samples")))
        for _ in range(60):  # the first batch is due 1.5 s after the first sample
            if await asyncio.to_thread(count, "samples") == 6:
                break
            await asyncio.sleep(0.05)
        w.submit("sample", _row(10.0, 10))
        t_event = time.monotonic()
        w.submit("event", {"ts": 10.0, "kind": "trip", "severity": "critical", "message": "m"})
        while await asyncio.to_thread(count, "events") == 0 and time.monotonic() - t_event < 5:
            await asyncio.sleep(0.02)
        event_after_s = time.monotonic() - t_event
        task.cancel()
        return seen, event_after_s

    seen, event_after_s = asyncio.run(go())
    # nothing is written before write_every_s has passed since the first sample of a batch
    assert all(n == 0 for t, n in seen if t < 1.4), seen
    assert store.count_samples() == 7
    # an event does not wait for the gathering window, and takes the sample queued before it along
    assert event_after_s < 1.0


def test_an_urgent_status_snapshot_ends_the_gathering_and_a_quiet_one_waits(tmp_path: Path) -> None:
    """The daemon submits a changed status snapshot urgent (`sparkd status` reads it within a second)
    and the quiet 30 s refresh gathered with the samples."""
    db = tmp_path / "u.db"
    store = Store.open(db)

    def stored_ts() -> float | None:
        import sqlite3

        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            row = con.execute("SELECT ts FROM status").fetchone()
            return float(row[0]) if row else None
        finally:
            con.close()

    async def go() -> tuple[float | None, float]:
        w = Writer(store, write_every_s=5.0)
        task = asyncio.create_task(w.run())
        w.submit("sample", _row(1.0, 1))
        w.submit("status", {"ts": 1.0, "mode": "normal"})  # quiet: gathered
        await asyncio.sleep(0.6)
        quiet = await asyncio.to_thread(stored_ts)
        t0 = time.monotonic()
        w.submit("status", {"ts": 2.0, "mode": "fast"}, urgent=True)
        while await asyncio.to_thread(stored_ts) != 2.0 and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        took = time.monotonic() - t0
        task.cancel()
        return quiet, took

    quiet, took = asyncio.run(go())
    assert quiet is None  # still gathered after 0.6 s of a 5 s gathering
    assert took < 1.0 and store.count_samples() == 1  # written at once, with the sample gathered before it


def test_the_daemon_submits_a_changed_snapshot_urgent_and_the_quiet_refresh_gathered(tmp_path: Path) -> None:
    from sparkd.config import load_settings
    from sparkd.loop import daemon_decide
    from sparkd.loop.daemon import Daemon, MonitorOnly

    settings = load_settings(overrides={"state_dir": str(tmp_path), "kernlog_source": "off", "api": {"enabled": False}})

    async def go() -> list[tuple[str, bool]]:
        d = Daemon(settings, actions=MonitorOnly(), serve_api=False)
        await d.startup()
        assert d.writer is not None
        got: list[tuple[str, bool]] = []
        real = d.writer.submit

        def spy(kind: str, payload: Any, *, urgent: bool = False) -> bool:
            if kind == "status":
                got.append((payload["mode"], urgent))
            return real(kind, payload, urgent=urgent)

        d.writer.submit = spy  # type: ignore[method-assign]
        mono = [d.mono()]
        d.mono = lambda: mono[0]  # type: ignore[method-assign]
        for step, mode in ((2.0, "normal"), (2.0, "fast"), (2.0, "fast"), (daemon_decide.STATUS_QUIET_S, "fast")):
            mono[0] += step
            d.mode = mode  # type: ignore[assignment]
            r = d._tick_once()
            assert r is not None
            daemon_decide.handle_sync(d, r)
        out = list(got)
        await d.shutdown("test")
        return out

    got = asyncio.run(go())
    # the first tick: changed since start-up's snapshot (the daemon_started event): urgent; the mode
    # changed: urgent; unchanged 2 s later: nothing; unchanged STATUS_QUIET_S later: the gathered refresh
    assert got == [("normal", True), ("fast", True), ("fast", False)], got


def test_under_pressure_the_gathering_is_one_second_and_ends_early_when_pressure_begins(tmp_path: Path) -> None:
    """The daemon sets ``Writer.pressure`` while it samples fast: a batch is gathered at most
    PRESSURE_WRITE_EVERY_S (1 s), and a 5 s gathering under way when the pressure begins ends 1 s
    after it began; back to 5 s once the pressure ends."""
    from sparkd.store.store import PRESSURE_WRITE_EVERY_S

    db = tmp_path / "p.db"
    store = Store.open(db)

    def count() -> int:
        import sqlite3

        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return int(con.execute("SELECT count(*) FROM samples").fetchone()[0])
        finally:
            con.close()

    async def first_write_after(w: Writer, start: float, *, pressure_at: float | None = None) -> float:
        """Submit a sample every 0.1 s (a fast guard's ticks) from ``start``; seconds until the first is stored."""
        t0, ts, before = time.monotonic(), start, await asyncio.to_thread(count)
        while time.monotonic() - t0 < 8:
            if pressure_at is not None and time.monotonic() - t0 >= pressure_at:
                w.set_pressure(True)
                pressure_at = None
            w.submit("sample", _row(ts, 1))
            ts += 0.1
            await asyncio.sleep(0.1)
            if await asyncio.to_thread(count) > before:
                return time.monotonic() - t0
        return float("inf")

    async def go() -> tuple[float, float, float]:
        w = Writer(store, write_every_s=5.0)
        task = asyncio.create_task(w.run())
        w.set_pressure(True)
        under = await first_write_after(w, 100.0)
        w.set_pressure(False)
        await asyncio.sleep(0.5)
        quiet = await first_write_after(w, 200.0)
        await asyncio.sleep(0.5)
        began = await first_write_after(w, 300.0, pressure_at=0.5)  # a 5 s gathering, pressure 0.5 s in
        task.cancel()
        return under, quiet, began

    under, quiet, began = asyncio.run(go())
    assert PRESSURE_WRITE_EVERY_S <= under < PRESSURE_WRITE_EVERY_S + 0.8, under
    assert 4.9 <= quiet < 6.0, quiet
    assert PRESSURE_WRITE_EVERY_S <= began < PRESSURE_WRITE_EVERY_S + 0.8, began


def _wal_syncs(tmp_path: Path, db: Path, *, durable: bool) -> list[str]:
    """The fsync/fdatasync calls on ``db``'s WAL (strace) while another process writes its second batch
    (the first starts a WAL, whose header SQLite syncs either way; a marker system call between them)."""
    import shutil
    import subprocess
    import sys

    from conftest import need

    need(shutil.which("strace") is not None, "strace is not installed (scripts/setup-test-env installs it)")
    out = tmp_path / f"strace-{durable}.txt"
    marker = f"/sparkd-test-marker-{os.getpid()}"
    code = (
        "import os; from sparkd.store.store import Store\n"
        f"s = Store.open({str(db)!r})\n"
        f"s.write_batch([('sample', {{'ts': {10.0 + 2 * durable}, 'mem_available': 1024}})])\n"
        f"os.access({marker!r}, os.F_OK)\n"
        f"s.write_batch([('sample', {{'ts': {11.0 + 2 * durable}, 'mem_available': 1024}})], durable={durable})\n"
        "os._exit(0)  # no close: closing the last connection checkpoints the WAL, which syncs anyway\n"
    )
    trace = "trace=fsync,fdatasync,access,faccessat,faccessat2"
    cmd = ["strace", "-f", "-qq", "-y", "-e", trace, "-o", str(out), sys.executable, "-c", code]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = out.read_text().splitlines()
    at = [i for i, line in enumerate(lines) if marker in line]
    assert at, lines[-20:]
    return [line for line in lines[at[-1] :] if f"{db.name}-wal" in line and "sync" in line]


def test_a_durable_write_syncs_the_wal_at_its_commit_and_a_normal_one_does_not(tmp_path: Path) -> None:
    """``write_batch(durable=True)`` (the writer under pressure) reaches the disk at its commit:
    SQLite fsyncs the WAL (seen with strace, the real system calls). A normal write leaves the WAL to
    the checkpoint and the kernel's write-back, as before (no sync per write: the idle cost)."""
    db = tmp_path / "d.db"
    Store.open(db).close()  # created and migrated here: the traced processes only write
    normal = _wal_syncs(tmp_path, db, durable=False)
    durable = _wal_syncs(tmp_path, db, durable=True)
    assert normal == [], normal
    assert durable, "no fsync/fdatasync of the WAL for a durable write"
    assert Store.open(db).count_samples() == 4  # every write is in the database


def test_the_parsed_head_is_alembics_head_and_a_current_database_opens_without_alembic(tmp_path: Path) -> None:
    import subprocess
    import sys

    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from sparkd.resources import migrations_dir
    from sparkd.store.store import script_head

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    assert script_head() == ScriptDirectory.from_config(cfg).get_current_head()
    db = tmp_path / "h.db"
    Store.open(db).close()  # a new file: migrated by Alembic
    code = (
        "import sys; from sparkd.store.store import Store; s = Store.open(sys.argv[1]); "
        "print(s.current_revision(), 'alembic' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(db)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [script_head(), "False"]


def test_a_database_made_by_0_1_upgrades_with_its_samples_kept_and_readable(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "old.db"
    old = Store.open(db, migrate=False)
    old.upgrade("0002")  # the schema sparkd 0.1 made
    old.close()
    t0 = 1_700_000_000.0
    con = sqlite3.connect(db)
    con.executemany(
        "INSERT INTO samples (ts, mem_total, mem_available, mem_free, psi_some_avg10) VALUES (?, ?, ?, ?, ?)",
        [(t0 + i, 128 << 30, (60 << 30) + i * KiB, 1 << 30, 0.5) for i in range(100)] + [(t0 + 5, 1, 2, 3, 4.0)],
    )
    m0 = t0 - 3600  # a minute aggregated by 0.1 (bytes, as sample_minutes keeps them)
    con.execute(
        "INSERT INTO sample_minutes (minute_ts, n, mem_available_min, mem_available_avg, mem_available_max) "
        "VALUES (?, 60, ?, ?, ?)",
        (m0, 50 << 30, 55 << 30, 59 << 30),
    )
    con.commit()
    con.close()
    s = Store.open(db)
    assert s.current_revision() == "0006"
    rows = s.samples(since=t0)
    assert len(rows) == 100  # the duplicate ts kept its first row
    assert rows[5]["mem_available"] == (60 << 30) + 5 * KiB and rows[5]["mem_total"] == 128 << 30
    assert rows[99]["psi_some_avg10"] == 0.5
    latest = s.latest_sample()
    assert latest is not None and latest["ts"] == t0 + 99
    [minute] = s.downsampled(since=m0, until=m0 + 60, step_s=60, fields=["mem_available", "mem_available_minus_cma"])
    assert (minute["n"], minute["mem_available_min"], minute["mem_available_max"]) == (60, 50 << 30, 59 << 30)
    assert minute["mem_available_minus_cma_avg"] is None  # not aggregated before 0006: a gap, nothing made up
    s.write_batch([("sample", _row(t0 + 100, 7 * KiB)), ("sample", _row(t0 + 100, 8 * KiB))])  # the first is kept
    assert s.count_samples() == 101 and s.samples(since=t0 + 100)[0]["mem_available"] == 7 * KiB
    with s.engine.connect() as c:  # on disk: KiB and hundredths (migration 0005), the 0.1 rows converted
        raw = c.exec_driver_sql("SELECT mem_total, mem_available, psi_some_avg10 FROM samples WHERE ts = ?", (t0 + 5,))
        assert raw.one() == (128 << 20, (60 << 20) + 5, 50)
    with s.engine.connect() as c:
        ddl = c.exec_driver_sql("SELECT sql FROM sqlite_master WHERE name = 'samples'").scalar_one()
        indexes = c.exec_driver_sql("SELECT name FROM sqlite_master WHERE tbl_name = 'samples' AND type = 'index'")
        assert "WITHOUT ROWID" in ddl and indexes.all() == []  # the table is its own ts index
    from alembic import command
    from alembic.config import Config

    from sparkd.resources import migrations_dir

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    with s.engine.begin() as conn:  # and back: the rows survive a downgrade too, in bytes and floats again
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0003")
    with s.engine.connect() as c:
        raw = c.exec_driver_sql("SELECT mem_total, mem_available, psi_some_avg10 FROM samples WHERE ts = ?", (t0 + 5,))
        assert raw.one() == (128 << 30, (60 << 30) + 5 * KiB, 0.5)
    assert Store.open(db, migrate=False).current_revision() == "0003"
    assert Store.open(db, migrate=False).count_samples() == 101


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

        def write_batch(self, batch: list[tuple[str, object]], *, durable: bool = False) -> None:
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


def test_the_keeper_migrates_in_a_child_process_and_the_daemon_never_imports_alembic_or_the_orm(tmp_path: Path) -> None:
    import subprocess
    import sys

    db = tmp_path / "old.db"
    old = Store.open(db, migrate=False)
    old.upgrade("0002")  # what sparkd 0.1 made
    old.close()
    code = (
        "import sys; from pathlib import Path; from sparkd.store.keeper import DbKeeper\n"
        f"k = DbKeeper(Path({str(db)!r})); s = k.attempt(0.0)\n"
        "s.add_event(kind='probe', message='m'); s.write_batch([('sample', {'ts': 1.0, 'mem_available': 1024})])\n"
        "assert s.events(limit=1)[0]['kind'] == 'probe' and s.samples(since=0)[0]['mem_available'] == 1024\n"
        "print(s.current_revision(), k.state, *(m in sys.modules for m in ('alembic', 'mako', 'sqlalchemy.orm')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    head = __import__("sparkd.store.store", fromlist=["script_head"]).script_head()
    assert out.stdout.split() == [head, "ok", "False", "False", "False"], out.stderr
    # a file that is not a database: the child's one-line reason, which the keeper reads as corrupt
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"x" * 4096)
    s = Store.open(bad, migrate=False)
    with pytest.raises(StoreError) as err:
        s.upgrade_in_child()
    assert "file is not a database" in err.value.message and "\n" not in err.value.message


def test_the_gathering_ends_in_the_submit_that_finds_it_due_and_a_write_never_wakes_the_loop(tmp_path: Path) -> None:
    """The writer keeps no timer that wakes the event loop while submits come (the tick's submit
    ends the gathering), and a completed write does not wake the loop either (issue 18)."""
    from sparkd.store import store as mod

    async def go() -> tuple[list[int], int, float]:
        store = Store.open(tmp_path / "g.db")
        w = Writer(store, write_every_s=0.3)
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(*a: Any, **k: Any) -> Any:
            nonlocal wakes
            wakes += 1
            return real(*a, **k)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        task = asyncio.create_task(w.run())
        counts = []
        try:
            for i in range(8):  # a tick every 0.1 s: a write every ~0.3 s, each ended by a submit
                w.submit("sample", _row(float(i), i * KiB))
                await asyncio.sleep(0.1)
                counts.append(store.count_samples())
            while store.count_samples() < 8:  # the rest, then the writer waits for the next item
                await asyncio.sleep(0.05)
            # no submit after this one: the fallback timer ends the gathering FALLBACK_S after it was due
            w.submit("sample", _row(100.0, KiB))
            t0 = time.monotonic()
            while store.count_samples() < 9:
                await asyncio.sleep(0.05)
            waited = time.monotonic() - t0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            w.close()
        return counts, wakes, waited

    counts, wakes, waited = asyncio.run(go())
    assert counts[0] == 0 and counts[-1] >= 6  # gathered, then written while the ticks went on
    assert wakes == 0  # not one write woke the event loop
    assert 0.3 + mod.FALLBACK_S - 0.2 <= waited <= 0.3 + mod.FALLBACK_S + 1.0


def test_an_unexpected_error_in_the_writer_thread_is_counted_and_the_batch_written_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer's thread must outlive anything a write raises: dead, it would stop recording silently."""

    async def go() -> tuple[int, int, str | None]:
        store = Store.open(tmp_path / "e.db")
        w = Writer(store, write_every_s=0)
        calls = {"n": 0}

        def check() -> str | None:  # the file check raises once (a bug, not an OSError)
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("boom")
            return None

        w.check_file = check
        task = asyncio.create_task(w.run())
        try:
            w.submit("sample", _row(1.0, KiB))
            w.submit("event", {"ts": 2.0, "kind": "k", "severity": "info", "message": "m", "details": None,
                               "launch_id": None})  # fmt: skip
            for _ in range(100):
                if store.count_samples() == 1 and calls["n"] >= 2:
                    break
                await asyncio.sleep(0.05)
            w.submit("sample", _row(3.0, KiB))  # the thread still writes
            for _ in range(100):
                if store.count_samples() == 2:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            w.close()
        return store.count_samples(), w.failures, w.last_error

    n, failures, err = asyncio.run(go())
    assert n == 2 and failures == 1
    assert err is None  # the next write succeeded
    assert any("database writer: RuntimeError: boom" in r.getMessage() for r in caplog.records)


def test_the_writers_kept_connection_writes_the_frequent_kinds_beside_sqlalchemys_batches(tmp_path: Path) -> None:
    """Issue 18: a batch of the frequent kinds alone goes through one connection the store keeps (no pool
    checkout per batch); a batch with any other kind through SQLAlchemy. Interleaved, every record lands
    once, and a refused batch leaves nothing of itself behind on the kept connection."""
    import sqlite3

    s = Store.open(tmp_path / "k.db")
    t0 = 1_700_000_000.0
    s.write_batch([("sample", _row(t0, 7 << 30)), ("status", {"ts": t0, "n": 1})])
    kept = s._fast
    assert kept is not None
    event = {"ts": t0 + 1, "kind": "x", "severity": "info", "message": "m"}
    s.write_batch([("sample", _row(t0 + 1, 6 << 30)), ("event", event)])
    s.write_batch([("sample", _row(t0 + 2, 5 << 30))])
    assert s._fast is kept  # the same connection, batch after batch
    # a snapshot JSON cannot encode, after the sample of its batch was inserted: nothing of the batch stays
    with pytest.raises(TypeError):
        s.write_batch([("sample", _row(t0 + 4, 4 << 30)), ("status", {"ts": t0 + 4, "bad": object()})])
    s.write_batch([("sample", _row(t0 + 5, 3 << 30))])  # the connection is usable after the refusal
    assert [r["ts"] for r in s.samples(since=t0)] == [t0, t0 + 1, t0 + 2, t0 + 5]  # t0 + 4 rolled back
    assert [e["kind"] for e in s.events(limit=10)] == ["x"]
    assert s.status_snapshot() == {"ts": t0, "n": 1}
    dbapi = kept.driver_connection
    s.close()
    assert s._fast is None
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):  # really closed, not handed back to a pool
        dbapi.execute("SELECT 1")


def test_closing_the_store_does_not_wait_for_a_batch_held_by_a_write_lock(tmp_path: Path) -> None:
    """``Store.close`` runs on the event loop (the keeper's reopen): it must not wait while the writer's
    thread is stuck in a batch behind another process's write lock (up to the 2 s busy timeout; the guard
    would miss its ticks). The batch's end closes the kept connection instead."""
    import sqlite3
    import threading

    db = tmp_path / "c.db"
    s = Store.open(db)
    s.write_batch([("sample", _row(1.0, 1 << 30))])  # the kept connection exists
    dbapi = s._fast.driver_connection
    holder = sqlite3.connect(db, timeout=0)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    errors: list[BaseException] = []

    def batch() -> None:
        try:
            s.write_batch([("sample", _row(2.0, 1 << 30))])
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=batch)
    t.start()
    while t.is_alive() and not s._write_lock.locked():  # the batch is under way (behind the lock)
        time.sleep(0.001)
    s.close()
    closed_while_held = t.is_alive()  # close returned while the batch still waited on the lock
    holder.rollback()
    holder.close()
    t.join(10)
    assert closed_while_held, "Store.close waited for the batch"
    assert s._fast is None  # the batch's end closed the kept connection: really closed, not handed to a pool
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        dbapi.execute("SELECT 1")
    assert len(errors) <= 1 and all("locked" in str(e) for e in errors), errors


def test_a_queue_full_of_samples_still_takes_the_stops_events(tmp_path: Path) -> None:
    """A long outage filled the queue with samples, and the trip's and the stop's events were the records dropped:
    missing from /events and the incidents for good once the database came back (helper-53). Events have
    ``EVENT_RESERVE`` places more; samples are dropped."""
    from sparkd.store.store import EVENT_RESERVE

    async def go() -> Writer:
        w = Writer(None, maxsize=10)  # no database: records wait in the queue
        for i in range(12):
            w.submit("sample", _row(float(i), i))
        assert w.dropped == 2
        for kind in ("trip", "stopped"):
            assert w.submit("event", {"ts": 20.0, "kind": kind, "message": kind, "severity": "critical"}) is True
        return w

    w = asyncio.run(go())
    assert w.dropped == 2 and w.queue.qsize() == 12
    w.attach(Store.open(tmp_path / "w.db"))
    assert w.flush() == 12
    assert w.store is not None and [e["kind"] for e in w.store.events(since=0)] == ["stopped", "trip"]
    assert EVENT_RESERVE >= 100


def test_a_write_is_hung_once_it_has_not_returned_for_the_failing_report_time() -> None:
    """``Writer.write_hung_s``: the one threshold of ``database_write_hung`` and ``Status.database.write_hung_s``."""
    from sparkd.store.store import FAILING_REPORT_S

    w = Writer(None)
    assert w.write_hung_s() is None  # no write runs
    w._write_started = time.monotonic() - (FAILING_REPORT_S - 1)
    assert w.hung_for() > 0 and w.write_hung_s() is None
    w._write_started = time.monotonic() - (FAILING_REPORT_S + 1)
    assert (w.write_hung_s() or 0) >= FAILING_REPORT_S + 1
