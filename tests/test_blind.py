"""Blind sensors are loud (issue 12, kind 5): an input a rule needs that cannot be read is an
event at start and on change, and status names each rule that cannot evaluate and why.

The daemon runs in-process over a scripted /proc tree (``proc_root``) and real SQLite.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sparkd.config import load_settings
from sparkd.loop.daemon import Daemon
from sparkd.loop.guard import Guard
from sparkd.sense.kernlog_readers import NullSource
from tests.conftest import fixture

WHY = "cannot evaluate: MemAvailable not read"


def _proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text(fixture("meminfo", "gb10-idle.meminfo").read_text())
    return proc


def _without(proc: Path, name: str) -> None:
    text = fixture("meminfo", "gb10-idle.meminfo").read_text()
    (proc / "meminfo").write_text("".join(x for x in text.splitlines(True) if not x.startswith(name + ":")))


def _settings(tmp_path: Path, proc: Path, **over: Any) -> Any:
    return load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "proc_root": str(proc),
            "kernlog_source": "off",
            "api": {"enabled": False},
            **over,
        }
    )


async def _ticks(d: Daemon, n: int) -> None:
    for _ in range(n):
        r = d._tick_once()
        assert r is not None
        await d._handle(r)


def test_losing_and_regaining_memavailable_is_one_event_each(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    # the guard keeps meminfo open and preads it: write_text rewrites the same file in place
    settings = _settings(tmp_path, proc)

    async def go() -> list[tuple[str, str, str]]:
        d = Daemon(settings)
        await d.startup()
        await _ticks(d, 3)
        assert d.blind_json() == {"sensors": {}, "rules": {}}  # healthy: nothing blind, no event
        _without(proc, "MemAvailable")
        await _ticks(d, 5)
        st = d.status_json()
        names = ("low_available", "low_free_with_evidence", "collapse_projected", "repeated_dips")
        assert st.blind.rules == dict.fromkeys(names, WHY)
        assert [r.blind for r in st.rules] == [WHY] * 4  # never a quiet 0/N
        assert st.blind.sensors["MemAvailable"] == (
            f"no MemAvailable line in {proc}/meminfo; needed by {', '.join(names)}"
        )
        (proc / "meminfo").write_text(fixture("meminfo", "gb10-idle.meminfo").read_text())
        await _ticks(d, 3)
        assert d.status_json().blind.model_dump() == {"sensors": {}, "rules": {}}
        evs = [(e["kind"], e["severity"], e["message"]) for e in reversed(d.recent_events)]
        d.should_exit.set()
        await d.shutdown("test")
        return [e for e in evs if e[0] in ("sensor_blind", "sensors_restored")]

    evs = asyncio.run(go())
    assert [(k, s) for k, s, _ in evs] == [("sensor_blind", "critical"), ("sensors_restored", "info")]
    assert evs[0][2].startswith(f"blind: MemAvailable: no MemAvailable line in {proc}/meminfo; needed by ")
    assert f"rule low_available {WHY}" in evs[0][2]


def test_meminfo_failing_mid_run_makes_every_rule_blind_loudly_and_the_recovery_is_said(tmp_path: Path) -> None:
    """/proc/meminfo that cannot be read any more (an lxcfs or FUSE /proc that died: ENOTCONN) while
    the main loop runs: a critical ``sensor_blind`` naming every rule, the rules shown blind (never a
    quiet 0/N), the status snapshot refreshed so `sparkd status` still sees sparkd alive; then
    ``sensors_restored``. The kernel records of the failed ticks are handed on with the next sample.
    (It was one log line: the status kept showing the last sample and nothing blind.)"""
    import errno

    from sparkd.sense.kernlog import KernRecord

    proc = _proc(tmp_path)
    settings = _settings(tmp_path, proc, interval_s=0.1, fast_interval_s=0.1)

    async def go() -> tuple[list[tuple[str, str, str]], Any, int, list[Any]]:
        d = Daemon(settings)
        await d.startup()
        assert d.guard is not None and d.writer is not None
        reader = d.guard.proc
        real = reader._meminfo_bytes
        failing = [False]

        def read() -> bytes:
            if failing[0]:
                raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
            return real()

        reader._meminfo_bytes = read  # type: ignore[method-assign]
        held: list[Any] = []
        record = d._record_kernel
        d._record_kernel = lambda rec, sample: (held.append(rec), record(rec, sample))  # type: ignore[method-assign]
        task = asyncio.create_task(d.main_loop())
        await asyncio.sleep(0.5)
        submitted: list[Any] = []
        submit = d.writer.submit
        d.writer.submit = lambda k, p, urgent=False: (submitted.append((k, urgent)), submit(k, p, urgent=urgent))[1]  # type: ignore[method-assign]
        failing[0] = True
        rec = KernRecord(kind="nvrm_no_memory", message="m", raw="NVRM: ... NV_ERR_NO_MEMORY")
        d.guard._held_kernel = [rec]  # as if polled on a tick whose read failed
        await asyncio.sleep(1.0)
        blind = d.status_json()
        taken = d.samples_taken
        failing[0] = False
        await asyncio.sleep(0.5)
        evs = [(e["kind"], e["severity"], e["message"]) for e in reversed(d.recent_events)]
        d.request_exit()
        await task
        await d.shutdown("test")
        statuses = [u for k, u in submitted if k == "status"]
        return [e for e in evs if e[0] in ("sensor_blind", "sensors_restored")], blind, taken, [held, statuses]

    evs, blind, taken, (held, statuses) = asyncio.run(go())
    assert [(k, s) for k, s, _ in evs] == [("sensor_blind", "critical"), ("sensors_restored", "info")], evs
    why = f"cannot read {proc}/meminfo: Transport endpoint is not connected"
    assert why in evs[0][2] and "rule low_available cannot evaluate" in evs[0][2]
    assert set(blind.blind.rules) == {"low_available", "low_free_with_evidence", "collapse_projected", "repeated_dips"}
    assert all(r.blind == f"cannot evaluate: {why}" for r in blind.rules)
    assert blind.blind.sensors["MemAvailable"].startswith(why)
    assert statuses and statuses[0] is True  # the blind status is written at once
    assert [r.kind for r in held] == ["nvrm_no_memory"]  # recorded with the first sample after the failure
    assert taken > 0


def test_a_rule_on_psi_without_psi_names_the_input_and_the_rule(tmp_path: Path) -> None:
    proc = _proc(tmp_path)  # no pressure/memory in this tree
    rules = [{"name": "psi_high", "when": ["psi_full_avg10 > 20"], "samples": 2}]
    settings = _settings(tmp_path, proc, rules=rules)

    async def go() -> dict[str, Any]:
        d = Daemon(settings)
        await d.startup()
        await _ticks(d, 2)
        b = d.blind_json()
        evs = [e for e in d.recent_events if e["kind"] == "sensor_blind"]
        d.should_exit.set()
        await d.shutdown("test")
        return {"blind": b, "events": evs}

    out = asyncio.run(go())
    assert out["blind"]["rules"] == {"psi_high": "cannot evaluate: PSI not read"}
    assert out["blind"]["sensors"] == {"PSI": f"{proc}/pressure/memory absent or unreadable; needed by psi_high"}
    assert len(out["events"]) == 1  # at start, not once per sample


def test_an_unreadable_shm_dir_and_a_dead_kernel_log_are_named(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    rules = [
        {"name": "shm_full", "when": ["shm_bytes > 8GiB"], "samples": 2},
        {"name": "driver_errors", "when": ["MemAvailable < 10GiB"], "evidence": ["nvrm_recent > 0"], "samples": 2},
    ]
    settings = _settings(tmp_path, proc, rules=rules, shm_dir=str(tmp_path / "no-shm"), kernlog_source="auto")
    g = Guard(settings, NullSource("no kernel-log reader works (kmsg: permission denied)"))
    g.tick()
    assert g.blind_sensors() == {
        "/dev/shm": f"cannot read {tmp_path / 'no-shm'}",
        "PSI": f"{proc}/pressure/memory absent or unreadable",
        "kernel log": "no kernel-log reader works (kmsg: permission denied)",
    }
    assert g.engine.blind() == {"shm_full": "cannot evaluate: /dev/shm not read"}
    assert g.sensor_users() == {
        "/dev/shm": ["shm_full"],
        "MemAvailable": ["driver_errors"],
        "kernel log": ["driver_errors"],
    }


class LostLines:
    """A reader stand-in that reports what /dev/kmsg's sequence gaps counted (KmsgSource.lost_records,
    tested against real sequence numbers in test_kernlog)."""

    name = "kmsg"
    error = None
    lost_records = 27_000  # the flood of 50,000 lines in the field lost 27,000

    def poll(self) -> list[str]:
        return []

    def close(self) -> None:
        return None


def test_kernel_lines_lost_to_the_ring_buffer_are_counted_in_status(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    settings = _settings(tmp_path, proc)

    async def go() -> Any:
        d = Daemon(settings, guard=Guard(settings, LostLines()))
        await d.startup()
        await _ticks(d, 1)
        st = d.status_json()
        d.should_exit.set()
        await d.shutdown("test")
        return st

    st = asyncio.run(go())
    assert st.kernel_log.lost == 27_000


def test_sparkd_run_on_a_proc_without_memavailable_says_so_and_status_shows_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    from sparkdproc import db_query, sparkd_run, wait_for

    proc = fixture("field-2", "proc-no-memavailable")
    db = tmp_path / "sparkd.db"
    cfg = f'proc_root = "{proc}"\nkernlog_source = "off"\ninterval_s = 0.25\nfast_interval_s = 0.25\n'
    with sparkd_run(tmp_path, config=cfg):
        rows = wait_for(lambda: db_query(db, "SELECT severity, message FROM events WHERE kind = 'sensor_blind'"), 10.0)
        assert rows, "no sensor_blind event at start"
        assert rows[0][0] == "critical" and rows[0][1].startswith("blind: MemAvailable: no MemAvailable line in ")
        assert wait_for(lambda: db_query(db, "SELECT 1 FROM status"), 10.0)
        human = subprocess.run(
            [sys.executable, "-m", "sparkd.face.cli", "--config", str(tmp_path / "sparkd.toml"), "status"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    assert "low_available              BLIND (cannot evaluate: MemAvailable not read)" in human
    assert "collapse_projected         BLIND (cannot evaluate: MemAvailable not read)" in human
    assert f"BLIND: MemAvailable: no MemAvailable line in {proc}/meminfo; needed by low_available" in human
    assert " 0/3" not in human  # a blind rule is never a quiet 0/N
    # once, at start: the input stays missing, so no second event
    assert len(db_query(db, "SELECT 1 FROM events WHERE kind = 'sensor_blind'")) == 1
