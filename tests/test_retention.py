"""Retention: three days of samples at 1 Hz are aggregated and pruned; the DB stays bounded."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from sparkd.config import Settings, load_settings
from sparkd.loop.daemon import Daemon
from sparkd.store.store import Store
from sparkd.units import GiB

DAY = 86400


def _fill(store: Store, start: float, seconds: int) -> None:
    batch = []
    for i in range(seconds):
        t = start + i
        avail = 20 * GiB + (i % 3600) * 1024 * 1024  # a sawtooth, 1 h period
        batch.append(
            (
                "sample",
                {
                    "ts": t,
                    "mem_total": 120 * GiB,
                    "mem_available": avail,
                    "mem_free": avail // 2,
                    "cached": 4 * GiB,
                    "anon_pages": GiB,
                    "slab": GiB // 2,
                    "driver_bytes": 9 * GiB,
                },
            )
        )
        if len(batch) == 20000:
            store.write_batch(batch)
            batch = []
    if batch:
        store.write_batch(batch)


def _db_bytes(path: Path) -> int:
    return sum(os.path.getsize(p) for p in (path, Path(f"{path}-wal")) if p.exists())


def test_three_days_at_1_hz_are_aggregated_pruned_and_bounded(tmp_path: Path) -> None:
    settings = load_settings(overrides={"state_dir": str(tmp_path), "kernlog_source": "off", "api": {"enabled": False}})
    now = time.time()
    store = Store.open(settings.db_file)
    _fill(store, now - 3 * DAY, 3 * DAY)
    store.add_event(kind="trip", message="low_available: MemAvailable ...", severity="critical", ts=now - 2.5 * DAY)
    full = _db_bytes(settings.db_file)
    assert store.count_samples() == 3 * DAY

    daemon = Daemon(settings, serve_api=False)
    daemon.store = store
    removed = asyncio.run(daemon.retention_once(now=now))
    # raw samples older than 48 h are gone, aggregated per minute
    assert removed["samples"] >= DAY - 60
    assert store.count_samples() <= 2 * DAY + 60
    with store.engine.connect() as c:
        minutes = c.exec_driver_sql(
            "SELECT count(*), min(mem_available_min), max(mem_available_max) FROM sample_minutes"
        ).one()
    assert 1400 <= minutes[0] <= 1500  # one day of minutes
    assert minutes[1] == 20 * GiB and minutes[2] == 20 * GiB + 3599 * 1024 * 1024
    # events are intact
    assert [e["kind"] for e in store.events(since=now - 3 * DAY)] == ["trip"]
    # the 30-day chart still answers, with the aggregated day and the raw two days
    t0 = time.perf_counter()
    chart = store.downsampled(since=now - 30 * DAY, until=now, step_s=3600, fields=["mem_available"])
    took = time.perf_counter() - t0
    assert 70 <= len(chart) <= 74 and took < 5
    assert min(b["mem_available_min"] for b in chart) == 20 * GiB
    # bounded: another day of samples and another pass leave the file no larger than after the first load
    _fill(store, now, DAY)
    asyncio.run(daemon.retention_once(now=now + DAY))
    assert store.count_samples() <= 2 * DAY + 60
    assert _db_bytes(settings.db_file) <= full
    store.close()


def _capped_at_two(tmp_path: Path) -> Settings:
    """Settings of a daemon that keeps two archives at most."""
    overrides = {"state_dir": str(tmp_path), "kernlog_source": "off", "api": {"enabled": False}}
    return load_settings(overrides={**overrides, "retention": {"archives_max_count": 2}})


def test_the_retention_pass_prunes_routine_archives_before_a_trips_postmortem(tmp_path: Path) -> None:
    """The daemon's pass (``retention_once``) with the default classifier: a resize's and a restart's bundles
    newer than the trip's go first; the event names them."""
    from sparkd.act.archive import list_archives, write_archive

    settings = _capped_at_two(tmp_path)
    now = time.time()
    names = []
    for i, source in enumerate(["rule low_available", "api:token", "web:session", "cli"]):
        summary = f"sparkd postmortem\n=================\nreason:       x\nrequested by: {source}\n"
        info = write_archive(settings.archives_path, f"vllm-{i}", {"container.log": b"x"}, summary, now=now + i)
        os.utime(info.path, (now - 100 + i, now - 100 + i))
        names.append(info.name)
    daemon = Daemon(settings, serve_api=False)
    daemon.store = Store.open(settings.db_file)
    assert asyncio.run(daemon.retention_once(now=now))["archives"] == 2
    assert [a.name for a in list_archives(settings.archives_path)] == [names[3], names[0]]
    (ev,) = [e for e in daemon.recent_events if e["kind"] == "archives_pruned"]  # no writer here: in memory
    assert ev["details"]["removed"] == [names[1], names[2]] and "routine stops first" in ev["message"]


def test_the_archive_caps_hold_while_the_database_is_down_and_stale_temp_files_go(tmp_path: Path) -> None:
    """The pass returned before the archives with no database: a full disk, the common reason it is down, left the
    cap unenforced while every stop added a bundle; and a temp file a kill left mid-write stayed for good, outside
    the caps (helper-53). Only sparkd's own temp files, and only old ones, are removed."""
    from sparkd.act.archive import STALE_TEMP_S, list_archives, write_archive

    settings = _capped_at_two(tmp_path)
    now = time.time()
    for i in range(5):
        summary = "sparkd postmortem\n=================\nreason:       x\nrequested by: api:token\n"
        write_archive(settings.archives_path, f"vllm-{i}", {"container.log": b"x"}, summary, now=now + i)
    arch = settings.archives_path
    old_tmp, young_tmp, other = arch / ".sparkd-tmp-abc.tmp", arch / ".sparkd-tmp-def.tmp", arch / "notes.tmp"
    for p in (old_tmp, young_tmp, other):
        p.write_bytes(b"partial")
    for p in (old_tmp, other):
        os.utime(p, (now - STALE_TEMP_S - 60, now - STALE_TEMP_S - 60))
    daemon = Daemon(settings, serve_api=False)
    assert daemon.store is None  # never opened: the database is down
    out = asyncio.run(daemon.retention_once(now=now))
    assert out == {"archives": 3, "archive_temps": 1}, out
    assert len(list_archives(arch)) == 2
    assert not old_tmp.exists() and young_tmp.exists() and other.exists()
