"""Relief before stopping: the policy (pure) and the real drop path (root)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from sparkdproc import rewrite_in_place

from sparkd.act.pagecache import drop_clean_cache
from sparkd.core.relief import ReliefPolicy, reclaimable_page_cache_bytes, relief_helped, uses_mem_free
from sparkd.sense.procfs import parse_meminfo
from sparkd.units import GiB, MiB
from tests.conftest import fixture, need


def test_it_estimates_reclaimable_cache_from_meminfo() -> None:
    m = {"Active(file)": 3 * GiB, "Inactive(file)": 2 * GiB, "Mapped": 1 * GiB, "Dirty": 100 * MiB, "Writeback": 0}
    # 3 + 2 − 1 − 0.098 GiB
    assert reclaimable_page_cache_bytes(m) == 4 * GiB - 100 * MiB
    assert reclaimable_page_cache_bytes({**m, "Mapped": 9 * GiB}) == 0  # floored
    assert reclaimable_page_cache_bytes({"MemFree": 1}) is None


def test_it_reads_the_gb10_idle_figures() -> None:
    m = parse_meminfo(fixture("meminfo", "gb10-idle.meminfo").read_text()).fields
    r = reclaimable_page_cache_bytes(m)
    assert r is not None
    assert r == m["Active(file)"] + m["Inactive(file)"] - m["Mapped"] - m["Dirty"] - m["Writeback"]


def test_it_relieves_only_for_memfree_rules_with_enough_cache_and_once_a_minute() -> None:
    p = ReliefPolicy(enabled=True)
    assert uses_mem_free(["MemFree", "MemAvailable"]) and not uses_mem_free(["MemAvailable"])
    assert not p.should_relieve([], 5 * GiB, 0.0)  # no MemFree rule counting
    assert not p.should_relieve(["low_free_with_evidence"], 512 * MiB, 0.0)  # < 1 GiB reclaimable
    assert p.should_relieve(["low_free_with_evidence"], 5 * GiB, 0.0)
    p.started(0.0)
    assert not p.should_relieve(["low_free_with_evidence"], 5 * GiB, 59.0)  # rate limit
    assert p.should_relieve(["low_free_with_evidence"], 5 * GiB, 60.0)
    p.failed("drop_caches hung for 5 s")
    assert not p.should_relieve(["low_free_with_evidence"], 5 * GiB, 500.0)  # latched off for the run


def test_it_is_off_by_default() -> None:
    assert not ReliefPolicy().should_relieve(["r"], 10 * GiB, 0.0)


def test_a_counter_resets_only_when_memfree_actually_rose() -> None:
    assert relief_helped(1 * GiB, 2 * GiB)
    assert not relief_helped(1 * GiB, 1 * GiB + 10 * MiB)
    assert not relief_helped(None, 2 * GiB)


def _mem_free() -> int:
    return parse_meminfo(Path("/proc/meminfo").read_text()).fields["MemFree"]


def test_the_real_drop_frees_page_cache(tmp_path: Path) -> None:
    need(os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK), "root and a writable drop_caches")
    # fill the page cache with a clean 512 MiB file
    f = tmp_path / "cache-filler.bin"
    with open(f, "wb") as fh:
        block = os.urandom(1 << 20)
        for _ in range(512):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    with open(f, "rb") as fh:
        while fh.read(1 << 22):
            pass
    before = parse_meminfo(Path("/proc/meminfo").read_text()).fields
    assert reclaimable_page_cache_bytes(before) is not None
    drop_clean_cache()
    after = parse_meminfo(Path("/proc/meminfo").read_text()).fields
    # our 512 MiB file was clean and unmapped: the drop gives (most of) it back as MemFree
    assert after["MemFree"] - before["MemFree"] >= 256 * MiB, (before["MemFree"], after["MemFree"])
    assert after["Cached"] < before["Cached"]


# --------------------------------------------------------------------------- in the running daemon
MEMINFO = (
    "MemTotal: 16777216 kB\nMemFree: {free:>12} kB\nMemAvailable: 12582912 kB\nBuffers: 0 kB\nCached: 6291456 kB\n"
    "Active(file): 4194304 kB\nInactive(file): 2097152 kB\nMapped: 524288 kB\nDirty: 0 kB\nWriteback: 0 kB\n"
)
KIB = 1024


def _write_meminfo(proc: Path, free_bytes: int) -> None:
    rewrite_in_place(proc / "meminfo", MEMINFO.format(free=free_bytes // KIB))


async def _relief_daemon(tmp_path: Path, drop: Any, *, rules: list[dict[str, Any]] | None = None, **relief: Any) -> Any:
    from sparkd.config import load_settings
    from sparkd.loop.daemon import Daemon

    proc = tmp_path / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    _write_meminfo(proc, 1 * GiB)
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "proc_root": str(proc),
            "kernlog_source": "off",
            "api": {"enabled": False},
            "consumers": {"enabled": False},
            "relief": {"enabled": True, **relief},
            "rules": rules
            or [
                {"name": "low_free", "when": ["MemFree < 2GiB"], "samples": 50},
                {"name": "low_available", "when": ["MemAvailable < 13GiB"], "samples": 50},
            ],
        }
    )
    d = Daemon(settings)
    d.relief.drop = drop
    await d.startup()
    return d, proc


async def _ticks(d: Any, n: int) -> None:
    for _ in range(n):
        r = d._tick_once()
        assert r is not None
        await d._handle(r)


def _events(d: Any, kind: str) -> list[dict[str, Any]]:
    return [e for e in d.recent_events if e["kind"] == kind]


@pytest.mark.anyio
async def test_a_relief_that_raised_memfree_resets_only_the_memfree_rules_counter(tmp_path: Path) -> None:
    calls: list[str] = []

    def drop(proc_root: str) -> None:  # the scripted kernel: dropping gives back 512 MiB of MemFree
        calls.append(proc_root)
        _write_meminfo(Path(proc_root), 1 * GiB + 512 * MiB)

    d, proc = await _relief_daemon(tmp_path, drop)
    try:
        # the startup sample already counts for both rules and starts the relief; wait for it before the
        # next tick, so no tick reads /proc while the scripted kernel rewrites it
        assert d.relief.task is not None
        await d.relief.task
        assert calls == [str(proc)]
        ev = _events(d, "relief")
        assert len(ev) == 1
        det = ev[0]["details"]
        # 4 + 2 − 0.5 GiB of the scripted page cache was reclaimable; MemFree rose 1 → 1.5 GiB
        assert det["reclaimable_bytes"] == 5 * GiB + 512 * MiB
        assert det["freed_bytes"] == 512 * MiB and det["counters_reset"] is True
        assert det["rules"] == ["low_free"]  # never for the MemAvailable rule
        assert d.guard.states["low_free"].counter == 0
        assert d.guard.states["low_available"].counter == 1
        await _ticks(d, 3)  # MemFree still < 2 GiB: the rule counts again from zero, no second relief
        assert d.guard.states["low_free"].counter == 3
        assert d.guard.states["low_available"].counter == 4
        assert len(calls) == 1  # at most once per 60 s
    finally:
        await d.shutdown("test")


@pytest.mark.anyio
async def test_a_relief_that_did_not_raise_memfree_leaves_the_counter_going(tmp_path: Path) -> None:
    d, _ = await _relief_daemon(tmp_path, lambda proc_root: None)
    try:
        assert d.relief.task is not None  # started by the startup sample
        await d.relief.task
        det = _events(d, "relief")[0]["details"]
        assert det["freed_bytes"] == 0 and det["counters_reset"] is False
        assert d.guard.states["low_free"].counter == 1
        await _ticks(d, 1)
        assert d.guard.states["low_free"].counter == 2
    finally:
        await d.shutdown("test")


@pytest.mark.anyio
async def test_a_memavailable_rule_alone_never_starts_a_relief(tmp_path: Path) -> None:
    calls: list[str] = []
    d, _ = await _relief_daemon(
        tmp_path, calls.append, rules=[{"name": "low_available", "when": ["MemAvailable < 13GiB"], "samples": 50}]
    )
    try:
        await _ticks(d, 3)
        assert d.guard.states["low_available"].counter == 4
        assert d.relief.task is None and calls == [] and not _events(d, "relief")
    finally:
        await d.shutdown("test")


@pytest.mark.anyio
async def test_a_hung_or_failing_drop_turns_relief_off_for_the_run(tmp_path: Path) -> None:
    import threading

    release = threading.Event()
    d, _ = await _relief_daemon(tmp_path, lambda proc_root: release.wait(5), timeout_s=0.2, min_interval_s=1)
    try:
        assert d.relief.task is not None  # started by the startup sample
        await d.relief.task
        release.set()
        failed = _events(d, "relief_failed")
        assert len(failed) == 1 and "did not finish within 0.2 s" in failed[0]["message"]
        assert d.status_json().relief.disabled_reason == failed[0]["details"]["reason"]  # type: ignore[union-attr]
        d.relief.policy.last_mono = -1e9  # past any rate limit: still never again
        await _ticks(d, 2)
        assert len(_events(d, "relief_failed")) == 1 and not _events(d, "relief")
    finally:
        await d.shutdown("test")

    def not_root(proc_root: str) -> None:
        raise PermissionError(13, "Permission denied", f"{proc_root}/sys/vm/drop_caches")

    d, _ = await _relief_daemon(tmp_path / "b", not_root)
    try:
        assert d.relief.task is not None  # started by the startup sample
        await d.relief.task
        assert "Permission denied" in _events(d, "relief_failed")[0]["message"]
    finally:
        await d.shutdown("test")


@pytest.mark.anyio
async def test_relief_is_off_by_default_in_the_daemon(tmp_path: Path) -> None:
    from sparkd.config import load_settings
    from sparkd.loop.daemon import Daemon

    d = Daemon(load_settings(overrides={"state_dir": str(tmp_path), "kernlog_source": "off"}))
    assert d.status_json().relief.enabled is False  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_the_real_drop_through_the_runner_reports_the_bytes_freed(tmp_path: Path) -> None:
    need(os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK), "root and a writable drop_caches")
    from sparkd.config import ReliefSettings
    from sparkd.loop.relief import ReliefRunner

    f = tmp_path / "cache-filler.bin"
    with open(f, "wb") as fh:
        block = os.urandom(1 << 20)
        for _ in range(512):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    with open(f, "rb") as fh:
        while fh.read(1 << 22):
            pass
    events: list[tuple[str, dict[str, Any]]] = []
    relieved: list[str] = []
    runner = ReliefRunner(
        ReliefSettings(enabled=True),
        proc_root="/proc",
        emit=lambda k, m, s, det: events.append((k, det)),
        relieved=relieved.append,
    )
    before = parse_meminfo(Path("/proc/meminfo").read_text()).fields
    await runner._relieve(["low_free"], before["MemFree"], reclaimable_page_cache_bytes(before))
    assert [k for k, _ in events] == ["relief"]
    det = events[0][1]
    # our clean, unmapped 512 MiB file was dropped: MemFree rose by (most of) it, so the counter reset
    assert det["freed_bytes"] >= 256 * MiB and det["counters_reset"] is True and relieved == ["low_free"]


def test_a_stored_relief_resets_the_counter_in_a_replay_too() -> None:
    from sparkd.core.engine import EngineChange, RuleEngine, engine_changes
    from sparkd.core.rules import compile_rules

    events = [
        {"ts": 10.0, "kind": "relief", "details": {"rules": ["low_free"], "counters_reset": True}},
        {"ts": 20.0, "kind": "relief", "details": {"rules": ["low_free"], "counters_reset": False}},  # no change
    ]
    assert engine_changes(events) == [EngineChange(10.0, "relief", rule="low_free")]
    from sparkd.config import RuleConfig

    engine = RuleEngine.of(compile_rules([RuleConfig(name="low_free", when=["MemFree < 2GiB"])], 16 * GiB))
    engine.states["low_free"].counter = 3
    engine.apply(EngineChange(10.0, "relief", rule="low_free"))
    assert engine.states["low_free"].counter == 0
