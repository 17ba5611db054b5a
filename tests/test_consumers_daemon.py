"""Who holds the memory, wired into the running daemon: the background scan, the stored row,
``/api/status``, ``/metrics``, the dashboard, co-tenant warnings and a trip's fall shares.

A real ``Daemon`` with a real SQLite store samples this machine's /proc and scans its real
processes (psutil); only the container side is ``FakeActions`` (the worked example's plan).
The trip-scan tests hand ``ConsumerWatch`` scripted scans: the real scan at a trip is
covered end to end with a real container in ``tests/test_e2e_consumers.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import FakeActions
from prometheus_client.parser import text_string_to_metric_families

from sparkd.config import ConsumersSettings, load_settings
from sparkd.core.consumers import ConsumerSummary, ProcessMem, summarize
from sparkd.face.app import create_app
from sparkd.loop.consumers import ConsumerWatch
from sparkd.loop.daemon import Daemon
from sparkd.store.store import Store
from sparkd.units import GiB, MiB

BASE = "http://127.0.0.1:8741"
HOG = (
    "import sys, time; b = bytearray(int(sys.argv[1])); b[::4096] = b'x' * len(b[::4096]); "
    "print('ok', flush=True); time.sleep(60)"
)


pytestmark = pytest.mark.anyio


async def _daemon(tmp_path: Path, **overrides: Any) -> Daemon:
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "kernlog_source": "off",
            "interval_s": 0.25,
            "consumers": {
                "interval_s": 1.0,
                "quiet_interval_s": 1.0,
                "quiet_change_gib": 0.0,  # a scan every quiet_interval_s, however still the host
                "store_every_s": 1.0,
                **overrides.pop("consumers", {}),
            },
            **overrides,
        }
    )
    d = Daemon(settings, actions=FakeActions(), serve_api=False)
    await d.startup()
    return d


async def _until(pred: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_it_scans_in_the_background_and_serves_the_totals_everywhere(tmp_path: Path) -> None:
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(512 * MiB)], stdout=subprocess.PIPE, text=True)
    d = await _daemon(tmp_path)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ok"
        assert d.consumers is not None
        start = d.consumers.scans
        await _until(lambda: d.consumers is not None and d.consumers.scans >= start + 2)
        st = d.status_json()
        assert st.consumers is not None
        mine = [p for p in st.consumers.top if p.pid == hog.pid]
        # the 512 MiB host process is among the top consumers, as a host co-tenant
        assert mine and mine[0].group == "host" and mine[0].rss_bytes >= 500 * MiB
        assert st.consumers.totals_bytes["host"] >= 500 * MiB
        assert st.consumers.text.startswith("no container watched · host co-tenants ")  # FakeActions: none
        # the plan's left-over (121.69 GiB − 95.65 GiB budget) minus the 8 GiB margin is the default limit
        plan = d.actions.status_json().plan
        assert plan is not None
        assert st.consumers.cotenant_limit_bytes == int((plan.mem_total_gib - plan.budget_gib) * GiB) - 8 * GiB
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(d)), base_url=BASE) as c:
            api = (await c.get("/api/status")).json()
            metrics = (await c.get("/metrics")).text
            page = (await c.get("/")).text
        assert api["consumers"]["totals_bytes"]["host"] >= 500 * MiB
        got = {
            s.labels["group"]: s.value
            for fam in text_string_to_metric_families(metrics)
            for s in fam.samples
            if s.name == "sparkd_memory_group_rss_bytes"
        }
        assert set(got) == {"container", "host", "system"}  # per-group totals only, no process labels
        assert got["host"] >= 500 * MiB
        assert "Who holds the memory: no container watched · host co-tenants " in page
        # one compact row per stored scan (store_every_s = 1 s here; 60 s by default)
        assert d.writer is not None
        await asyncio.to_thread(d.writer.flush)
        assert d.store is not None
        rows = d.store.consumer_scans(since=0)
        assert len(rows) >= 2
        assert rows[-1]["host_bytes"] == rows[-1]["data"]["totals_bytes"]["host"]
        assert any(p["pid"] == hog.pid for r in rows for p in r["data"]["top"])
    finally:
        hog.kill()
        hog.wait()
        await d.shutdown("test")


async def test_it_warns_once_about_co_tenants_over_the_limit_and_names_the_biggest(tmp_path: Path) -> None:
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(512 * MiB)], stdout=subprocess.PIPE, text=True)
    d = await _daemon(tmp_path, consumers={"cotenant_limit": "256MiB", "cotenant_repeat_s": 600})
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ok"
        assert d.consumers is not None
        start = d.consumers.scans
        await _until(lambda: d.consumers is not None and d.consumers.scans >= start + 3)
        warns = [e for e in d.recent_events if e["kind"] == "cotenant_high"]
        assert len(warns) == 1  # rate-limited: three scans over the limit, one warning
        w = warns[0]
        assert w["severity"] == "warning"
        assert w["details"]["limit_bytes"] == 256 * MiB
        assert w["details"]["excess_bytes"] == w["details"]["host_bytes"] - 256 * MiB > 0
        assert "over the co-tenant limit 0.25 GiB: " in w["message"]
        assert w["details"]["biggest"] and w["details"]["biggest"][0]["rss_bytes"] >= 500 * MiB
    finally:
        hog.kill()
        hog.wait()
        await d.shutdown("test")


def test_a_configured_limit_must_be_a_size() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="cotenant_limit"):
        ConsumersSettings(cotenant_limit="lots")


# --------------------------------------------------------------------------- a trip's fall shares
class ScriptedScanner:
    """Scans in the order given; ``block`` makes the next scan wait (a hung /proc read)."""

    def __init__(self, scans: list[ConsumerSummary]) -> None:
        self.scans = scans
        self.block = threading.Event()
        self.block.set()

    def scan(self, ids: Any = ()) -> ConsumerSummary:
        assert self.block.wait(10)
        return self.scans.pop(0)


def _scan(at: float, container: int, host: int) -> ConsumerSummary:
    return summarize([ProcessMem(10, "vllm", container, "container"), ProcessMem(20, "cc1plus", host, "host")], at=at)


def _watch(scanner: Any, avail: list[int]) -> tuple[ConsumerWatch, list[tuple[str, str]]]:
    events: list[tuple[str, str]] = []
    w = ConsumerWatch(
        ConsumersSettings(),
        host_reserve_bytes=28 * GiB,
        container_ids=lambda: ["ab" * 32],
        mem_available=lambda: avail.pop(0),
        plan_left_bytes=lambda: None,
        emit=lambda k, m, s, det: events.append((k, m)),
        scanner=scanner,
    )
    return w, events


async def test_a_fall_no_process_grew_for_names_its_part_outside_every_rss_in_the_shares_too() -> None:
    """A 10 GiB fall that no process's RSS explains (GPU allocations on a Spark): the reason said "outside any
    process's RSS +9.50 GiB", while ``fall_shares_bytes`` (the stopped card's and the incident page's "who grew")
    read "container 0.00 GiB · host 0.50 GiB · system 0.00 GiB" (helper-39)."""
    from sparkd.face.web import _fmt_tripval

    scans = [_scan(0, 80 * GiB, 1 * GiB), _scan(10, 80 * GiB, int(1.5 * GiB))]
    w, _ = _watch(ScriptedScanner(scans), [30 * GiB, 20 * GiB])
    await w.scan()
    shares = await w.at_trip()
    assert shares is not None
    assert shares.shares_bytes == {"container": 0, "host": GiB // 2, "system": 0, "outside_rss": int(9.5 * GiB)}
    assert "outside any process's RSS +9.50 GiB" in shares.text
    assert _fmt_tripval(shares.shares_bytes, "fall_shares_bytes") == (
        "container 0.00 GiB · host 0.50 GiB · system 0.00 GiB · "
        "outside any process's RSS (GPU/driver, kernel, page cache) 9.50 GiB"
    )


async def test_a_trip_says_how_much_of_the_fall_came_from_the_container_and_from_others() -> None:
    scans = [_scan(0, 80 * GiB, 1 * GiB), _scan(10, 80 * GiB, 1 * GiB), _scan(20, 82 * GiB, 6 * GiB)]
    # MemAvailable at each scan: the highest (30 GiB, the second scan) is "before the fall"
    w, _ = _watch(ScriptedScanner(scans), [29 * GiB, 30 * GiB, 23 * GiB])
    await w.scan()
    await w.scan()
    shares = await w.at_trip()
    assert shares is not None and shares.fresh
    assert shares.shares_bytes == {"container": 2 * GiB, "host": 5 * GiB, "system": 0}
    assert shares.before is not None and shares.before.summary.at == 10
    assert shares.text == (
        "since 00:00:10 UTC MemAvailable 30.00 GiB → 23.00 GiB: container +2.00 GiB, "
        "host co-tenants +5.00 GiB (now cc1plus 6.00 GiB), system services +0.00 GiB"
    )
    pm = w.postmortem()
    assert pm is not None and pm["trip"]["shares_bytes"]["host"] == 5 * GiB and len(pm["history"]) == 3
    assert w.summary_line() == shares.text


async def test_a_trip_repeated_while_memory_stays_low_names_no_new_fall_and_a_fall_after_a_recovery_is_told() -> None:
    """A rule that holds with the model down trips once per cooldown; each trip's reason named the first trip's
    fall again ("who grew since 00:00:10 … 30.00 → 20.00 GiB") as if it were new (note 18 §7)."""
    scans = [_scan(10, 80 * GiB, 1 * GiB), _scan(20, 80 * GiB, 6 * GiB)]
    scans += [_scan(30, 80 * GiB, 6 * GiB), _scan(40, 80 * GiB, 1 * GiB), _scan(50, 80 * GiB, 9 * GiB)]
    w, _ = _watch(ScriptedScanner(scans), [30 * GiB, 20 * GiB, 20 * GiB, 30 * GiB, 18 * GiB])
    await w.scan()
    first = await w.at_trip()
    assert first is not None and first.text.startswith("since 00:00:10 UTC MemAvailable 30.00 GiB → 20.00 GiB")
    again = await w.at_trip()  # the cooldown later, memory as low
    assert again is not None and again.before is first.after
    assert again.text.startswith(
        "no fall since the last trip at 00:00:20 UTC (MemAvailable 20.00 GiB → 20.00 GiB): it was this low already"
    ), again.text
    await w.scan()  # recovered (the co-tenant ended) ...
    third = await w.at_trip()  # ... and fell again: that fall is told, from the scan after the recovery
    assert third is not None and third.before is not None and third.before.summary.at == 40
    assert third.text.startswith("since 00:00:40 UTC MemAvailable 30.00 GiB → 18.00 GiB: container +0.00 GiB"), third


async def test_a_trip_whose_scan_hangs_uses_the_last_periodic_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    import sparkd.loop.consumers as mod

    monkeypatch.setattr(mod, "TRIP_SCAN_WAIT_S", 0.2)
    scanner = ScriptedScanner([_scan(0, 80 * GiB, 1 * GiB), _scan(10, 81 * GiB, 3 * GiB), _scan(20, 0, 0)])
    w, _ = _watch(scanner, [30 * GiB, 25 * GiB, 20 * GiB])
    await w.scan()
    await w.scan()
    scanner.block.clear()
    shares = await w.at_trip()
    scanner.block.set()  # let the stuck thread finish
    assert shares is not None and not shares.fresh
    assert shares.after.summary.at == 10  # the last periodic scan
    # MemAvailable 30 → 25 GiB, 3 GiB of it in RSS: the other 2 GiB outside every RSS
    assert shares.shares_bytes == {"container": 1 * GiB, "host": 2 * GiB, "system": 0, "outside_rss": 2 * GiB}


async def test_a_scan_is_stored_when_a_group_total_moved_a_gib_or_store_every_s_passed() -> None:
    now = [0.0]
    rows: list[dict[str, Any]] = []
    scans = [
        _scan(0, 80 * GiB, 1 * GiB),  # the first: stored
        _scan(10, 80 * GiB, int(1.9 * GiB)),  # host +0.9 GiB: kept in memory only
        _scan(20, 80 * GiB, int(2.1 * GiB)),  # host +1.1 GiB since the stored one: stored
        _scan(30, int(79.5 * GiB), int(2.1 * GiB)),  # -0.5 GiB: not stored
        _scan(700, int(79.5 * GiB), int(2.1 * GiB)),  # store_every_s (600 s) passed: stored
    ]
    w = ConsumerWatch(
        ConsumersSettings(),
        host_reserve_bytes=28 * GiB,
        container_ids=lambda: [],
        mem_available=lambda: None,
        plan_left_bytes=lambda: None,
        emit=lambda *a: None,
        submit=lambda kind, row: rows.append(row),
        scanner=ScriptedScanner(scans),
        mono=lambda: now[0],
    )
    for s in list(scans):
        now[0] = s.at
        await w.scan()
    assert [r["ts"] for r in rows] == [0, 20, 700]
    assert w.scans == 5


async def test_scans_come_every_interval_s_while_sampling_fast_and_every_quiet_interval_s_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = [False]
    now = [0.0]
    w = ConsumerWatch(
        ConsumersSettings(interval_s=10.0, quiet_interval_s=60.0),
        host_reserve_bytes=28 * GiB,
        container_ids=lambda: [],
        mem_available=lambda: None,
        plan_left_bytes=lambda: None,
        emit=lambda *a: None,
        scanner=ScriptedScanner([_scan(i, GiB, GiB) for i in range(100)]),
        mono=lambda: now[0],
        fast=lambda: fast[0],
    )
    at: list[float] = []

    async def scan() -> Any:
        at.append(now[0])

    async def sleep(s: float) -> None:  # the loop's sleeps advance this clock instead of waiting
        target = now[0] + s
        if now[0] < 150 <= target:  # the daemon starts sampling fast at 150 and wakes the watch
            now[0], fast[0] = 150.0, True
        else:
            now[0] = target
        if now[0] >= 300:
            raise asyncio.CancelledError
        await asyncio.sleep(0)

    monkeypatch.setattr(w, "scan", scan)
    monkeypatch.setattr(w.alarm, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await w.run()
    assert at == [0, 60, 120, 150, 160, 170, 180, 190, 200, 210, 220, 230, 240, 250, 260, 270, 280, 290]


async def test_a_quiet_host_keeps_its_last_scan_until_memavailable_moves_or_store_every_s_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [0.0]
    avail = [100 * GiB]
    w = ConsumerWatch(
        ConsumersSettings(interval_s=10.0, quiet_interval_s=60.0, quiet_change_gib=0.5, store_every_s=600.0),
        host_reserve_bytes=28 * GiB,
        container_ids=lambda: [],
        mem_available=lambda: avail[0],
        plan_left_bytes=lambda: None,
        emit=lambda *a: None,
        scanner=ScriptedScanner([_scan(i, GiB, GiB) for i in range(100)]),
        mono=lambda: now[0],
        fast=lambda: False,
    )
    at: list[float] = []
    real_scan = w.scan

    async def scan() -> Any:
        at.append(now[0])
        return await real_scan()

    looks: list[float] = []

    async def sleep(s: float) -> None:
        assert s == 60.0  # quiet: one look per quiet_interval_s, no 10 s wake-ups
        now[0] += s
        looks.append(now[0])
        if now[0] >= 1500:
            raise asyncio.CancelledError
        if now[0] == 180:
            avail[0] -= int(0.4 * GiB)  # less than quiet_change_gib: still quiet
        if now[0] == 240:
            avail[0] -= int(0.2 * GiB)  # 0.6 GiB since the scan at 0: due
        await asyncio.sleep(0)

    monkeypatch.setattr(w, "scan", scan)
    monkeypatch.setattr(w.alarm, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await w.run()
    # 0: first; 180 (moved 0.4 GiB): still quiet; 240: moved 0.6 GiB; 840, 1440: store_every_s apart
    assert at == [0, 240, 840, 1440]
    assert len(looks) == 25  # every 60 s over 1,500 s


async def test_a_trip_before_any_scan_has_no_shares_to_give() -> None:
    w, _ = _watch(ScriptedScanner([_scan(0, GiB, GiB)]), [10 * GiB])
    shares = await w.at_trip()
    assert shares is not None and shares.before is None
    assert shares.text.startswith("no scan before the fall; now: container 1.00 GiB")


def test_scans_are_kept_for_the_retention_of_raw_samples(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "s.db")
    try:
        row = {"container_bytes": 1, "host_bytes": 2, "system_bytes": 3, "data": {"text": "x"}}
        store.write_batch([("consumers", {"ts": 1000.0, **row}), ("consumers", {"ts": 5000.0, **row})])
        assert [r["ts"] for r in store.consumer_scans(since=0)] == [1000.0, 5000.0]
        removed = store.prune(now=5000.0 + 600, raw_keep_s=3600, minutes_keep_s=86400, events_keep_s=86400)
        assert removed["consumer_scans"] == 1
        assert [r["ts"] for r in store.consumer_scans(since=0)] == [5000.0]
    finally:
        store.close()


async def test_sparkd_status_prints_who_holds_the_memory(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sparkd.face.cli import main

    d = await _daemon(tmp_path)
    try:
        assert d.consumers is not None
        await _until(lambda: d.consumers is not None and d.consumers.scans >= 1)
    finally:
        await d.shutdown("test")  # writes the last status snapshot
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    out = CliRunner().invoke(main, ["--config", str(cfg), "status"]).output
    assert "who holds the memory (" in out and " UTC): no container watched · host co-tenants " in out, out
    # a predictive rule's line says what stops it, not its arming gate alone (as the dashboard's card)
    assert (
        "[stop: usable projected to cross 4.0 GiB within the time a stop takes (watching while usable < 16GiB)]" in out
    )
    data = json.loads(CliRunner().invoke(main, ["--config", str(cfg), "status", "--json"]).output)
    assert data["consumers"]["scans"] >= 1 and set(data["consumers"]["totals_bytes"]) == {"container", "host", "system"}


async def test_scans_are_stored_at_most_every_store_every_s(tmp_path: Path) -> None:
    d = await _daemon(tmp_path, consumers={"interval_s": 1.0, "store_every_s": 3600.0, "store_change_gib": 1000.0})
    try:
        assert d.consumers is not None
        await _until(lambda: d.consumers is not None and d.consumers.scans >= 3)
        assert d.writer is not None and d.store is not None
        await asyncio.to_thread(d.writer.flush)
        # three scans in memory, one row on disk: history stays small (bench/idle.py: MB per day)
        assert len(d.store.consumer_scans(since=0)) == 1
        await d.consumers.at_trip()  # a trip's scan is always stored
        await asyncio.to_thread(d.writer.flush)
        assert len(d.store.consumer_scans(since=0)) == 2
    finally:
        await d.shutdown("test")


async def test_the_daemon_starting_to_sample_fast_wakes_the_quiet_scan_at_once(tmp_path: Path) -> None:
    d = await _daemon(tmp_path, consumers={"interval_s": 1.0, "quiet_interval_s": 3600.0})
    try:
        assert d.consumers is not None and d.mode == "normal"
        await _until(lambda: d.consumers is not None and d.consumers.scans == 1)
        await asyncio.sleep(1.2)  # past interval_s since that scan; the quiet look is an hour away
        assert d.consumers.scans == 1
        d.actions.fast_reason = lambda: "a test reason"  # type: ignore[method-assign]
        d._update_mode(None)
        assert d.mode == "fast"
        await _until(lambda: d.consumers is not None and d.consumers.scans == 2, 5.0)
    finally:
        await d.shutdown("test")


async def test_another_container_is_scanned_at_once_not_a_quiet_interval_later() -> None:
    """After a launch or an adoption the last scan counted the new container as a co-tenant, or not at all
    (the card read "container 0.00 GiB" for up to quiet_interval_s): the daemon's wake on those events scans
    again at once; a wake with the same container on a quiet host does not."""
    ids: list[str] = []
    w = ConsumerWatch(
        ConsumersSettings(interval_s=1.0, quiet_interval_s=3600.0, quiet_change_gib=100.0, store_every_s=3600.0),
        host_reserve_bytes=28 * GiB,
        container_ids=lambda: list(ids),
        mem_available=lambda: 100 * GiB,
        plan_left_bytes=lambda: None,
        emit=lambda *a: None,
        scanner=ScriptedScanner([_scan(i, GiB, GiB) for i in range(10)]),
        fast=lambda: False,
    )
    task = asyncio.create_task(w.run())
    try:
        await _until(lambda: w.scans == 1, 5.0)
        w.wake()  # the same (no) container: quiet, no scan
        await asyncio.sleep(0.5)
        assert w.scans == 1
        ids.append("ab" * 32)  # a container was adopted
        w.wake()
        await _until(lambda: w.scans == 2, 5.0)
        await asyncio.sleep(0.5)
        assert w.scans == 2
    finally:
        task.cancel()


async def test_each_rule_tells_the_fall_since_its_own_last_trip_and_a_scan_between_hides_no_trip() -> None:
    """A second rule's first trip 3 s after another's read "no fall since the last trip" while the 30 → 20 GiB fall
    was told only in the first rule's event; and a periodic scan between two trips of one rule, memory as low, made
    it "no fall since <that scan>", hiding the trip (helper-44)."""
    scans = [_scan(10, 80 * GiB, 1 * GiB), _scan(20, 80 * GiB, 6 * GiB), _scan(23, 80 * GiB, 6 * GiB)]
    scans += [_scan(50, 80 * GiB, 6 * GiB), _scan(80, 80 * GiB, 6 * GiB)]
    w, _ = _watch(ScriptedScanner(scans), [30 * GiB, 20 * GiB, 20 * GiB, 20 * GiB, 20 * GiB])
    await w.scan()
    a = await w.at_trip("collapse_projected")
    b = await w.at_trip("low_available")  # its first trip: the fall, as the other rule's said it
    assert a is not None and b is not None
    assert b.text.startswith("since 00:00:10 UTC MemAvailable 30.00 GiB → 20.00 GiB"), b.text
    await w.scan()  # a periodic scan, memory as low
    again = await w.at_trip("low_available")
    assert again is not None and again.text.startswith("no fall since the last trip at 00:00:23 UTC"), again.text


async def test_a_stopped_container_is_scanned_again_at_once_not_shown_as_before_the_stop(tmp_path: Path) -> None:
    """After a stop the Now card read "container 1.02 GiB" about 30 s on (helper-48): the scan is rate-limited and
    a plain wake only looks whether one is due. A stop, kill, exit or removal scans again at once, even on a quiet
    host with the same container id; other events do not."""
    d = await _daemon(
        tmp_path,
        consumers={"interval_s": 1.0, "quiet_interval_s": 3600.0, "quiet_change_gib": 100.0, "store_every_s": 3600.0},
    )
    try:
        assert d.consumers is not None and d.mode == "normal"
        await _until(lambda: d.consumers is not None and d.consumers.scans == 1)
        d.event("heartbeat", "not an end of a run", severity="info")
        await asyncio.sleep(1.2)  # past interval_s: a look was due, but the host is quiet
        assert d.consumers.scans == 1
        for n, kind in enumerate(("stopped", "killed", "exited", "container_gone"), start=2):
            d.event(kind, f"the model's run ended ({kind})", severity="warning")
            await _until(lambda n=n: d.consumers is not None and d.consumers.scans == n, 5.0)  # type: ignore[misc]
    finally:
        await d.shutdown("test")


async def test_a_rescan_asked_while_a_scan_runs_is_made_right_after_it() -> None:
    """A stop's ``wake(rescan=True)`` while a scan ran found no sleeper: the flag waited a whole quiet interval
    (helper-52). The scan that was under way may have counted the processes still exiting; one more follows."""
    scanner = ScriptedScanner([_scan(i, GiB, GiB) for i in range(10)])
    w = ConsumerWatch(
        ConsumersSettings(interval_s=1.0, quiet_interval_s=3600.0, quiet_change_gib=100.0, store_every_s=3600.0),
        host_reserve_bytes=28 * GiB,
        container_ids=lambda: [],
        mem_available=lambda: 100 * GiB,
        plan_left_bytes=lambda: None,
        emit=lambda *a: None,
        scanner=scanner,
        fast=lambda: False,
    )
    scanner.block.clear()  # the first scan is under way, held
    task = asyncio.create_task(w.run())
    try:
        await asyncio.sleep(0.2)
        w.wake(rescan=True)  # the container stopped meanwhile
        scanner.block.set()
        await _until(lambda: w.scans == 2, 5.0)
        await asyncio.sleep(0.5)
        assert w.scans == 2  # once, not in a loop
    finally:
        task.cancel()
