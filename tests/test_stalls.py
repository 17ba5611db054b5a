"""Short stalls of the guard loop, summed (``core.stalls``): pure logic here, a real ``sparkd run``
stopped and continued in short cycles in ``test_daemon``."""

from __future__ import annotations

import pytest

from sparkd.core.stalls import STALL_REPORT_S, STALL_WINDOW_S, StallWindow


def test_stalls_that_add_up_to_a_third_of_the_window_are_reported_once() -> None:
    w = StallWindow()
    # a tick every 2 s instead of every 1 s (stopped 1.9 s of 2): 1 s missed each time
    reports = [w.late(t, 2.0, 1.0) for t in range(2, 40, 2)]
    said = [(i, r) for i, r in enumerate(reports) if r is not None]
    assert len(said) == 1, said
    i, r = said[0]
    assert r.missed_s == pytest.approx(STALL_REPORT_S)  # the 10th late tick: 10 x 1 s missed
    assert i == 9 and r.late_ticks == 10 and r.longest_gap_s == 2.0 and r.window_s == STALL_WINDOW_S
    assert "10.0 s of the last 30 s" in r.message() and "10 late ticks" in r.message()
    assert r.details() == {"missed_s": 10.0, "late_ticks": 10, "longest_gap_s": 2.0, "window_s": 30.0}


def test_scattered_late_ticks_never_add_up_and_an_old_episode_rearms() -> None:
    w = StallWindow()
    # one 1.8 s gap at 1 Hz every 10 s: 0.8 s missed per 10 s, never 10 s in 30 s
    assert all(w.late(t, 1.8, 1.0) is None for t in range(0, 600, 10))
    # an episode, said once; after a quiet minute the window has emptied and the next episode is said again
    first = [w.late(1000 + t, 3.0, 1.0) for t in range(0, 30, 3)]
    assert sum(r is not None for r in first) == 1
    assert w.reported and w.episodes == 1
    second = [w.late(1100 + t, 3.0, 1.0) for t in range(0, 30, 3)]
    assert sum(r is not None for r in second) == 1 and w.episodes == 2


def test_a_window_that_cannot_report_is_refused() -> None:
    with pytest.raises(ValueError, match="report_s"):
        StallWindow(window_s=10, report_s=20)
