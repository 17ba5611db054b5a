"""The guard against real memory: a bounded hog (1.5 GiB) and thresholds relative to now."""

from __future__ import annotations

import time
from pathlib import Path

from hog import Hog

from sparkd.config import load_settings
from sparkd.loop.guard import Guard
from sparkd.sense import procfs
from sparkd.units import GiB, fmt_gib


def _avail() -> int:
    return procfs.read_meminfo().fields["MemAvailable"]


def test_a_rule_trips_after_exactly_n_samples_under_a_real_hog_and_resets(tmp_path: Path) -> None:
    start = _avail()
    threshold = start - GiB
    n = 4
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "rules": [{"name": "low_available", "when": [f"MemAvailable < {threshold}B"], "samples": n}],
        }
    )
    guard = Guard(settings)
    assert guard.tick().decisions == []
    assert guard.states["low_available"].counter == 0
    with Hog(2048) as hog:  # 1 GiB of margin on each side of the line: other processes move MemAvailable
        hog.wait_ready()
        assert _avail() < threshold, "the hog did not push MemAvailable under the threshold"
        decisions_per_tick = []
        for _ in range(n):
            r = guard.tick()
            decisions_per_tick.append(r.decisions)
            time.sleep(0.05)
        # nothing on samples 1..n-1, the trip on sample n
        assert decisions_per_tick[:-1] == [[]] * (n - 1)
        (trip,) = decisions_per_tick[-1]
        assert trip.kind == "trip" and trip.action == "stop" and trip.counter == n
        avail = r.sample.mem_available
        assert trip.reason.startswith(
            f"low_available: MemAvailable {fmt_gib(avail)} < {fmt_gib(threshold)} for {n}/{n} samples ("
        )
        guard.tick()
        assert guard.states["low_available"].counter == 1  # counting again (cooldown only mutes the next trip)
        hog.free()
        deadline = time.monotonic() + 15
        while _avail() < threshold and time.monotonic() < deadline:  # other processes may hold memory briefly
            time.sleep(0.1)
        guard.tick()
        assert guard.states["low_available"].counter == 0
        assert guard.last is not None and guard.last.mem_available is not None
        assert guard.last.mem_available >= threshold


def test_a_garbage_meminfo_line_and_a_missing_psi_file_do_not_stop_the_guard(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(
        "MemTotal: 1000000 kB\nMemFree: 500000 kB\n%%% garbage %%%\nMemAvailable: 600000 kB\n"
    )
    settings = load_settings(overrides={"state_dir": str(tmp_path), "proc_root": str(proc)})
    guard = Guard(settings)
    for _ in range(3):
        r = guard.tick()
    assert r.sample.mem_available == 600000 * 1024
    assert r.sample.psi_some_avg10 is None
    assert r.sample.cached is None  # missing fields are None
    assert guard._bad_lines_logged == {"%%% garbage %%%"}
