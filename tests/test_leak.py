"""Leak trend: baseline = min in the post-warm-up window, one alert per day, none below threshold."""

from __future__ import annotations

import pytest

from sparkd.core.leak import STATE_IDLE, STATE_MEASURING, STATE_TRACKING, STATE_WAITING, LeakAlert, LeakTracker
from sparkd.core.sample import driver_bytes
from sparkd.sense.procfs import parse_meminfo
from sparkd.units import GiB, MiB
from tests.conftest import fixture

DAY = 86400.0
BASE = int(9.2 * GiB)


def series(step_bytes: int, step_at_s: float, days: float = 3.0, every_s: float = 60.0) -> list[tuple[float, int]]:
    """Driver memory of one launch, sampled every minute: noise during warm-up, a dip to the
    baseline inside the window, then a step of ``step_bytes`` at ``step_at_s``."""
    out = []
    t = 0.0
    while t <= days * DAY:
        if t < 900:
            v = BASE + 6 * GiB if t < 300 else BASE + 2 * GiB  # graph capture, profiling
        elif t < 1500:
            v = BASE + (0 if 1100 <= t < 1200 else 300 * MiB)  # min inside the window = BASE
        else:
            v = BASE + 200 * MiB + (step_bytes if t >= step_at_s else 0)
        out.append((t, v))
        t += every_s
    return out


def run(tracker: LeakTracker, pts: list[tuple[float, int]], t0: float = 0.0) -> list[LeakAlert]:
    tracker.start_launch("L1", t0)
    alerts = []
    for t, v in pts:
        a = tracker.observe(t0 + t, v)
        if a:
            alerts.append(a)
    return alerts


def test_a_5gib_step_alerts_once_a_day_for_three_days() -> None:
    tr = LeakTracker(900, 1500, 4 * GiB, DAY)
    alerts = run(tr, series(5 * GiB, step_at_s=2 * 3600))
    assert [round(a.t) for a in alerts] == [7200, 7200 + 86400, 7200 + 2 * 86400]
    a = alerts[0]
    assert a.baseline_bytes == BASE
    assert a.growth_bytes == 5 * GiB + 200 * MiB
    assert a.reason == (
        "driver memory 14.4 GiB is 5.2 GiB above the post-warm-up baseline 9.2 GiB (threshold 4.0 GiB): plan a relaunch"
    )
    assert a.details()["threshold_bytes"] == 4 * GiB
    st = tr.status()
    assert st["state"] == STATE_TRACKING and st["alerts"] == 3 and st["baseline_bytes"] == BASE


def test_a_3gib_step_raises_nothing() -> None:
    tr = LeakTracker(900, 1500, 4 * GiB, DAY)
    assert run(tr, series(3 * GiB, step_at_s=2 * 3600)) == []
    st = tr.status()
    assert st["growth_bytes"] == 3 * GiB + 200 * MiB and st["alerts"] == 0


def test_the_reason_text_matches_the_issue() -> None:
    tr = LeakTracker(900, 1500, 4 * GiB, DAY)
    tr.start_launch("L", 0)
    tr.observe(1000, int(9.2 * GiB))
    a = tr.observe(2000, int(14.2 * GiB))
    assert a is not None
    assert a.reason == (
        "driver memory 14.2 GiB is 5.0 GiB above the post-warm-up baseline 9.2 GiB (threshold 4.0 GiB): plan a relaunch"
    )


def test_baseline_is_the_minimum_inside_the_window_only() -> None:
    tr = LeakTracker(900, 1500, 4 * GiB, DAY)
    tr.start_launch("L", 100.0)  # launch clock offset
    assert tr.status()["state"] == STATE_WAITING
    tr.observe(100 + 10, 1 * GiB)  # before the window: ignored (weights loading)
    assert tr.status()["state"] == STATE_WAITING and tr.baseline is None
    for t, v in [(900, 10 * GiB), (1000, 9 * GiB), (1400, 11 * GiB)]:
        tr.observe(100 + t, v)
    assert tr.status()["state"] == STATE_MEASURING and tr.baseline == 9 * GiB
    tr.observe(100 + 1500, 8 * GiB)  # window closed: a lower figure does not move the baseline
    st = tr.status()
    assert st["state"] == STATE_TRACKING and st["baseline_bytes"] == 9 * GiB
    assert st["growth_bytes"] == -1 * GiB and not st["baseline_late"]


def test_a_new_launch_resets_baseline_and_alerts() -> None:
    tr = LeakTracker(900, 1500, 4 * GiB, DAY)
    assert run(tr, series(5 * GiB, 7200, days=0.5)) != []
    tr.start_launch("L2", 10 * DAY)
    assert tr.status()["alerts"] == 0 and tr.baseline is None and tr.status()["launch_id"] == "L2"
    tr.observe(10 * DAY + 1000, BASE)
    assert tr.observe(10 * DAY + 2000, BASE + 5 * GiB) is not None  # repeat timer reset too


def test_no_figure_in_the_window_takes_the_first_after_it() -> None:
    tr = LeakTracker(900, 1500, 4 * GiB, DAY)
    tr.start_launch("L", 0)
    assert tr.observe(3000, 10 * GiB) is None
    assert tr.status()["baseline_late"] and tr.baseline == 10 * GiB
    assert tr.observe(3100, 14 * GiB) is not None


def test_no_launch_and_missing_figures_are_ignored() -> None:
    tr = LeakTracker()
    assert tr.observe(5000, 50 * GiB) is None and tr.status()["state"] == STATE_IDLE
    tr.start_launch(None, 0)
    assert tr.observe(1000, None) is None and tr.baseline is None


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        LeakTracker(1500, 900)
    with pytest.raises(ValueError):
        LeakTracker(threshold_bytes=0)


def test_driver_estimate_of_the_idle_gb10_fixture_by_hand() -> None:
    m = parse_meminfo(fixture("meminfo", "gb10-idle.meminfo").read_text()).fields
    # MemTotal − MemFree − Buffers − Cached − AnonPages − Slab − PageTables − KernelStack, in kB:
    # 127600748 − 112874312 = 14726436
    #  14726436 −    412388 = 14314048   (Buffers)
    #  14314048 −   6384120 =  7929928   (Cached)
    #   7929928 −   1709184 =  6220744   (AnonPages)
    #   6220744 −    929792 =  5290952   (Slab)
    #   5290952 −     38912 =  5252040   (PageTables)
    #   5252040 −     24576 =  5227464   (KernelStack)  → 5227464 kB ≈ 4.99 GiB
    assert driver_bytes(m) == 5227464 * 1024 == 5352923136
    assert round(5227464 / 1024 / 1024, 2) == 4.99
