"""Adaptive sampling: the guard samples fast near a floor, while a rule counts or while
MemAvailable falls fast, and returns to the normal interval ``fast_hold_s`` after the
last reason (issue "React in time").

The real tests run ``sparkd run`` against this host's /proc with a bounded hog
(≤ 2 GiB) and thresholds relative to the MemAvailable read at the start; the
sampling cadence is read back from the stored samples' timestamps and the
``sampling_fast`` / ``sampling_normal`` events.
"""

from __future__ import annotations

import json
import statistics
import time
from itertools import pairwise
from pathlib import Path

import pytest
from hog import Hog
from sparkdproc import db_query, sparkd_run, wait_for

from sparkd.config import load_settings
from sparkd.core.sample import Sample, derive
from sparkd.loop.daemon import Daemon
from sparkd.loop.guard import Guard
from sparkd.sense import procfs
from sparkd.store.store import WRITE_EVERY_S, Writer
from sparkd.units import GiB

NORMAL = 1.0
FAST = 0.25
# 5 samples at NORMAL after the switch back, in the database: the quiet writer gathers WRITE_EVERY_S first
AFTER_S = WRITE_EVERY_S + 5 * NORMAL + 3.0
HOLD = 10.0  # the default fast_hold_s


def _avail() -> int:
    return procfs.read_meminfo().fields["MemAvailable"]


# --------------------------------------------------------------------------- unit level: Guard.fast_reason


def _guard(tmp_path: Path, **overrides: object) -> Guard:
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "kernlog_source": "off",
            "fast_margin": "1GiB",
            "fast_fall_rate": "512MiB",
            "rules": [
                {"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 5},
                {"name": "low_free", "when": ["MemFree < 2GiB", "MemAvailable < 10GiB"], "samples": 5},
                {"name": "above", "when": ["MemAvailable > 1GiB"], "samples": 5},  # not a floor ('>')
            ],
            **overrides,
        }
    )
    return Guard(settings)


def _sample(mono: float, avail_gib: float, free_gib: float = 20.0) -> Sample:
    s = Sample(
        ts=1_700_000_000.0 + mono,
        mono=mono,
        mem_total=int(100 * GiB),
        mem_available=int(avail_gib * GiB),
        mem_free=int(free_gib * GiB),
    )
    derive(s)  # usable memory, as build_sample derives it
    return s


def _steady(g: Guard, avail_gib: float, free_gib: float = 20.0) -> Sample:
    """Compile the rules and feed three flat samples (a slope of zero); return the last."""
    s = _sample(0.0, avail_gib, free_gib)
    for i in range(3):
        s = _sample(i * 0.25, avail_gib, free_gib)
        g.ensure_rules(s)
        g.slope.add(s.mono, s.mem_available)
    return s


def test_fast_reason_is_none_far_from_every_floor_with_flat_memory(tmp_path: Path) -> None:
    g = _guard(tmp_path)
    s = _steady(g, 30.0)
    assert g.fast_reason(s) is None


def test_fast_reason_a_counting_rule_means_fast(tmp_path: Path) -> None:
    g = _guard(tmp_path)
    s = _steady(g, 30.0)
    g.states["low_free"].counter = 1
    assert g.fast_reason(s) == "rule low_free counting"
    g.states["low_free"].counter = 0
    assert g.fast_reason(s) is None


def test_fast_reason_within_the_margin_of_a_floor_means_fast_strictly(tmp_path: Path) -> None:
    g = _guard(tmp_path)
    # MemAvailable floors: 6 GiB (low_available) and 10 GiB (low_free); margin 1 GiB
    s = _steady(g, 11.0)
    assert g.fast_reason(s) is None  # exactly the margin away from the 10 GiB floor: not within
    s = _steady(g, 11.0 - 1 / 1024)
    assert g.fast_reason(s) == "mem_available within 1GiB of low_free's floor"
    s = _steady(g, 3.0)  # already below the floors (and no counter yet): still fast, said "below" (helper-50)
    assert g.fast_reason(s) == "mem_available below low_available's floor"
    # MemFree is a floor too (low_free's "MemFree < 2GiB")
    s = _steady(g, 30.0, free_gib=2.5)
    assert g.fast_reason(s) == "mem_free within 1GiB of low_free's floor"


def test_fast_reason_a_predictive_rules_floor_counts(tmp_path: Path) -> None:
    # the gate is no size floor, so only the predictive floor (4 GiB) is one
    rule = {"name": "collapse", "kind": "predictive", "when": ["nvrm_recent >= 0"], "floor": "4GiB", "samples": 2}
    g = _guard(tmp_path, rules=[rule])
    assert g.fast_reason(_steady(g, 5.0)) is None
    assert g.fast_reason(_steady(g, 4.5)) == "usable within 1GiB of collapse's floor"
    # a '<' size gate is where the projection starts (not a stop line): near or below it, sampling is fast
    g = _guard(tmp_path, rules=[{**rule, "when": ["MemAvailable < 16GiB"]}])
    assert g.fast_reason(_steady(g, 17.5)) is None
    watch = "mem_available near or below collapse's watch level 16.00 GiB (projecting; not a stop line)"
    assert g.fast_reason(_steady(g, 16.5)) == watch
    assert g.fast_reason(_steady(g, 10.0)) == watch


def test_fast_reason_follows_the_rules_when_the_engine_compiles_them_again(tmp_path: Path) -> None:
    """The floors are kept between ticks (issue 18) and built again when the rules are: a '%' floor
    moves with MemTotal (a new compile), and a demoted rule keeps its floor under its new object."""
    g = _guard(tmp_path, rules=[{"name": "pct", "when": ["MemAvailable < 10%"], "samples": 5}])
    s = _steady(g, 10.5)  # MemTotal 100 GiB: the floor is 10 GiB, 0.5 GiB away
    assert g.fast_reason(s) == "mem_available within 1GiB of pct's floor"
    big = Sample(ts=s.ts, mono=s.mono, mem_total=int(200 * GiB), mem_available=int(10.5 * GiB), mem_free=int(20 * GiB))
    derive(big)
    g.ensure_rules(big)  # MemTotal 200 GiB: the floor is 20 GiB now, and 10.5 GiB is below it
    assert g.rules[0].floors() == [("mem_available", 20 * GiB)]
    assert g.fast_reason(big) == "mem_available below pct's floor"
    far = Sample(ts=s.ts, mono=s.mono, mem_total=int(200 * GiB), mem_available=int(40 * GiB), mem_free=int(20 * GiB))
    derive(far)
    assert g.fast_reason(far) is None
    near = Sample(ts=s.ts, mono=s.mono, mem_total=int(200 * GiB), mem_available=int(20.5 * GiB), mem_free=int(20 * GiB))
    derive(near)
    assert g.fast_reason(near) == "mem_available within 1GiB of pct's floor"  # 100 GiB's floor would say None
    g.engine.demote("pct", "test")
    assert g.rules[0].action == "warn" and g.fast_reason(near) is not None


def test_fast_reason_falling_faster_than_the_rate_means_fast(tmp_path: Path) -> None:
    g = _guard(tmp_path)
    g.ensure_rules(_sample(0.0, 30.0))
    # 30 GiB falling 1 GiB/s at 4 Hz: far from every floor, but falling fast
    pts = [_sample(i * 0.25, 30.0 - i * 0.25) for i in range(5)]
    for p in pts:
        g.slope.add(p.mono, p.mem_available)
    assert g.fast_reason(pts[-1]) == "MemAvailable falling 1.00 GiB/s"


def test_fast_reason_falling_slower_than_the_rate_or_rising_is_not_fast(tmp_path: Path) -> None:
    g = _guard(tmp_path)
    g.ensure_rules(_sample(0.0, 30.0))
    slow = [_sample(i * 0.25, 30.0 - i * 0.25 * 0.4) for i in range(5)]  # 0.4 GiB/s < 512 MiB/s
    for p in slow:
        g.slope.add(p.mono, p.mem_available)
    assert g.fast_reason(slow[-1]) is None
    g2 = _guard(tmp_path)
    g2.ensure_rules(_sample(0.0, 20.0))
    rising = [_sample(i * 0.25, 20.0 + i) for i in range(5)]
    for p in rising:
        g2.slope.add(p.mono, p.mem_available)
    assert g2.fast_reason(rising[-1]) is None


def test_fast_reason_one_dip_is_not_a_fall(tmp_path: Path) -> None:
    # the slope is robust (Theil–Sen): one low sample among flat ones does not make a fall
    g = _guard(tmp_path)
    g.ensure_rules(_sample(0.0, 30.0))
    pts = [_sample(i * 0.25, v) for i, v in enumerate([30.0, 30.0, 28.0, 30.0, 30.0])]
    for p in pts:
        g.slope.add(p.mono, p.mem_available)
    assert g.fast_reason(pts[-1]) is None


def test_fast_reason_falling_at_the_normal_interval(tmp_path: Path) -> None:
    # at 1 Hz the fall is seen once three samples lie within the 2 s slope window
    g = _guard(tmp_path)
    g.ensure_rules(_sample(0.0, 30.0))
    pts = [_sample(float(i), 30.0 - i) for i in range(3)]  # 1 GiB/s
    for p in pts:
        g.slope.add(p.mono, p.mem_available)
    assert g.fast_reason(pts[-1]) == "MemAvailable falling 1.00 GiB/s"


def test_fast_reason_falling_at_the_normal_interval_with_real_timing_jitter(tmp_path: Path) -> None:
    # sample times as the daemon's 1 s grid produces them: each read a little late (0.5 ms, 1 ms)
    g = _guard(tmp_path)
    g.ensure_rules(_sample(0.0, 30.0))
    pts = [_sample(t, 30.0 - i) for i, t in enumerate([0.0, 1.0005, 2.001])]  # 1 GiB/s
    for p in pts:
        g.slope.add(p.mono, p.mem_available)
    assert g.fast_reason(pts[-1]) == "MemAvailable falling 1.00 GiB/s"


def test_update_mode_holds_fast_for_fast_hold_s_after_the_last_reason(tmp_path: Path) -> None:
    clock = [100.0]
    g = _guard(tmp_path, interval_s=NORMAL, fast_interval_s=FAST, fast_hold_s=HOLD)
    d = Daemon(g.settings, guard=g, mono=lambda: clock[0], notifier=_NullNotifier(), serve_api=False)
    assert d.current_interval() == NORMAL

    class R:  # the part of TickResult that _update_mode reads
        def __init__(self, s: Sample) -> None:
            self.sample = s

    d.writer = Writer(None)
    near = _steady(g, 6.5)
    d._update_mode(R(near))  # type: ignore[arg-type]
    assert (d.mode, d.current_interval(), d.writer.pressure) == ("fast", FAST, True)
    assert d.mode_reason == "mem_available within 1GiB of low_available's floor"
    far = _steady(g, 30.0)
    clock[0] += HOLD - 0.01
    d._update_mode(R(far))  # type: ignore[arg-type]
    assert d.mode == "fast"  # still held
    clock[0] += 0.01
    d._update_mode(R(far))  # type: ignore[arg-type]
    assert (d.mode, d.mode_reason, d.current_interval(), d.writer.pressure) == ("normal", None, NORMAL, False)
    kinds = [e["kind"] for e in reversed(d.recent_events)]
    assert kinds == ["sampling_fast", "sampling_normal"]
    # a read error (no result) neither enters nor leaves fast mode by itself
    d._update_mode(None)
    assert d.mode == "normal"


class _NullNotifier:
    def notify(self, msg: str) -> None:
        return None


# --------------------------------------------------------------------------- real: sparkd run + a hog


def _stamps(db: Path, t0: float, t1: float = float("inf")) -> list[float]:
    """Sample times in [t0, t1]; with a finite ``t1``, once the samples up to it are written (the writer
    gathers them for store.WRITE_EVERY_S, 10 s)."""
    if t1 != float("inf"):
        wait_for(
            lambda: (db_query(db, "SELECT max(ts) FROM samples")[0][0] or 0.0) >= t1, WRITE_EVERY_S + 5.0, step_s=0.1
        )
    return [r[0] for r in db_query(db, "SELECT ts FROM samples WHERE ts >= ? AND ts <= ? ORDER BY ts", (t0, t1))]


def _gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in pairwise(stamps)]


def _events(db: Path, kind: str, since: float = 0.0) -> list[tuple[float, str, dict[str, object]]]:
    rows = db_query(db, "SELECT ts, message, details FROM events WHERE kind = ? AND ts >= ? ORDER BY ts", (kind, since))
    return [(ts, msg, json.loads(det) if det else {}) for ts, msg, det in rows]


def _status(db: Path) -> dict[str, object]:
    return json.loads(db_query(db, "SELECT data FROM status WHERE id = 1")[0][0])


def _quiet_normal(db: Path, timeout_s: float = 40.0) -> float:
    """Wait until the last 4 gaps are ~1 s (no one else's memory spike holds fast mode); return the last ts.

    Other processes on this host may allocate concurrently; a transient spike only delays this.
    """

    def ok() -> float | None:
        ts = _stamps(db, 0.0)[-5:]
        g = _gaps(ts)
        return ts[-1] if len(g) == 4 and all(0.8 <= x <= 1.25 for x in g) else None

    last = wait_for(ok, timeout_s, step_s=0.2)
    assert last, f"no quiet stretch of 1 s sampling within {timeout_s:g} s: gaps {_gaps(_stamps(db, 0.0)[-8:])}"
    return float(last)


def _cfg(rule_floor: int, *, margin: str, fall: str) -> str:
    return (
        f"interval_s = {NORMAL}\nfast_interval_s = {FAST}\nfast_hold_s = {HOLD}\n"
        f'fast_margin = "{margin}"\nfast_fall_rate = "{fall}"\nkernlog_source = "off"\n'
        "monitor_only = true\n"  # a warn-only rule set must say so (config refuses it otherwise)
        f"[[rules]]\n"
        f'name = "test_floor"\nwhen = ["MemAvailable < {rule_floor}B"]\nsamples = 3600\naction = "warn"\n'
    )


def _assert_cadence(
    db: Path, *, before_end: float, hog_start: float, freed: float, want_reason: str, hold_s: float
) -> None:
    """The cadence around one hog: ~1 s before, ~0.25 s while held, ~1 s again after the hold."""
    before = _gaps(_stamps(db, before_end - 4.5, before_end))
    assert len(before) >= 3 and statistics.median(before) == pytest.approx(NORMAL, abs=0.1), before

    fast_evs = _events(db, "sampling_fast", since=hog_start)
    assert fast_evs, "no sampling_fast event after the hog started"
    fast_at, msg, det = fast_evs[0]
    assert fast_at < freed
    assert want_reason in str(det["reason"]), det
    assert msg.startswith(f"sampling every {FAST:g} s: ")
    # no return to normal while the hog holds the memory
    assert [e for e in _events(db, "sampling_normal", since=hog_start) if e[0] < freed] == []

    during = _gaps(_stamps(db, fast_at + 0.3, freed))
    assert len(during) >= 8, during  # the hog was held >= 3 s after the switch
    assert statistics.median(during) == pytest.approx(FAST, abs=0.05), during
    assert sum(g < 0.4 for g in during) >= 0.8 * len(during), during  # a loaded host may delay a few

    normal_evs = wait_for(lambda: _events(db, "sampling_normal", since=freed), 60.0, step_s=0.2)
    assert normal_evs, "no sampling_normal within a minute after the hog freed its memory"
    normal_at = normal_evs[0][0]
    # the hold: fast for fast_hold_s after the last reason (seen at most one fast interval before 'freed')
    assert normal_at >= freed + hold_s - FAST - 0.2, (normal_at - freed, hold_s)
    held = _gaps(_stamps(db, freed, normal_at))
    assert statistics.median(held) == pytest.approx(FAST, abs=0.05), held
    after = wait_for(lambda: _stamps(db, normal_at)[:5] if len(_stamps(db, normal_at)) >= 5 else None, AFTER_S, 0.2)
    assert after, f"fewer than 5 samples within {AFTER_S} s after sampling_normal"
    assert statistics.median(_gaps(after)) == pytest.approx(NORMAL, abs=0.1), _gaps(after)


def test_near_a_floor_the_daemon_samples_fast_and_returns_to_normal_after_the_hold(tmp_path: Path) -> None:
    """Margin trigger: floor = start − 3 GiB, margin 1.75 GiB → fast below start − 1.25 GiB; hog 2 GiB."""
    db = tmp_path / "sparkd.db"
    start = _avail()
    floor = start - 3 * GiB
    trigger = floor + int(1.75 * GiB)
    # the fall trigger is out of reach here (1 TiB/s), so only the margin can switch the mode
    with sparkd_run(tmp_path, config=_cfg(floor, margin="1792MiB", fall="1TiB")):
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] >= 1, 15.0)
        before_end = _quiet_normal(db)
        st = _status(db)
        assert (st["mode"], st["interval_s"], st["mode_reason"]) == ("normal", NORMAL, None)
        hog_start = time.time()
        with Hog(2048) as hog:
            hog.wait_ready()
            assert _avail() < trigger, "the hog did not bring MemAvailable within the margin"
            # held for 4 s: ~16 fast samples
            assert wait_for(lambda: _status(db)["mode"] == "fast", 6.0)  # a changed snapshot is written at once
            st = _status(db)
            assert st["interval_s"] == FAST and "within 1792MiB of test_floor's floor" in str(st["mode_reason"])
            # under pressure the writer gathers 1 s (store.PRESSURE_WRITE_EVERY_S), not 10: the newest
            # sample in the database stays young (quiet, it reaches ~11 s)
            lags = []
            for _ in range(20):
                time.sleep(0.2)
                lags.append(time.time() - (db_query(db, "SELECT max(ts) FROM samples")[0][0] or 0.0))
            assert max(lags) < 2.5, [round(x, 2) for x in lags]
            hog.free()
            freed = time.time()
        _assert_cadence(
            db,
            before_end=before_end,
            hog_start=hog_start,
            freed=freed,
            want_reason="mem_available within 1792MiB of test_floor's floor",
            hold_s=HOLD,
        )
        st = _status(db)
        assert (st["mode"], st["interval_s"]) == ("normal", NORMAL)


def test_a_fast_fall_far_from_every_floor_switches_to_fast_sampling(tmp_path: Path) -> None:
    """Fall trigger: the floor is out of reach (margin 0), the hog takes 2 GiB over ~4 s (~0.5 GiB/s)."""
    db = tmp_path / "sparkd.db"
    floor = max(_avail() - 12 * GiB, GiB)  # far below anything the hog reaches
    with sparkd_run(tmp_path, config=_cfg(floor, margin="0B", fall="192MiB")):
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] >= 1, 15.0)
        before_end = _quiet_normal(db)
        hog_start = time.time()
        with Hog(2048, step_mib=64, delay_s=0.12) as hog:
            hog.wait_ready()
            ramp_s = time.time() - hog_start
            assert ramp_s >= 3.0, f"the hog ramped in {ramp_s:.1f} s; the test needs a sustained fall"
            fast_evs = _events(db, "sampling_fast", since=hog_start)
            assert fast_evs and "MemAvailable falling" in str(fast_evs[0][2]["reason"]), fast_evs
            # detected while the fall went on: with 1 s samples, by the third sample of the fall
            assert fast_evs[0][0] - hog_start <= 3.0 + 0.5, fast_evs[0][0] - hog_start
            hog.free()
            freed = time.time()
        # the fall reason ends with the fall (at the end of the ramp), so the hold counts from then:
        # normal again within hold + a little, and never before the hold has passed
        normal_evs = wait_for(lambda: _events(db, "sampling_normal", since=hog_start), 60.0, step_s=0.2)
        assert normal_evs, "no sampling_normal within a minute"
        normal_at = normal_evs[0][0]
        last_fall = hog_start + ramp_s
        assert normal_at >= fast_evs[0][0] + HOLD - 0.2
        assert normal_at <= max(last_fall, freed) + HOLD + 5.0, (normal_at - last_fall, normal_at - freed)
        during = _gaps(_stamps(db, fast_evs[0][0] + 0.3, normal_at))
        assert statistics.median(during) == pytest.approx(FAST, abs=0.05), during
        before = _gaps(_stamps(db, before_end - 4.5, before_end))
        assert statistics.median(before) == pytest.approx(NORMAL, abs=0.1), before
        after = wait_for(lambda: _stamps(db, normal_at)[:5] if len(_stamps(db, normal_at)) >= 5 else None, AFTER_S, 0.2)
        assert after and statistics.median(_gaps(after)) == pytest.approx(NORMAL, abs=0.1)


def test_a_counting_rule_samples_fast_so_n_samples_take_n_fast_intervals(tmp_path: Path) -> None:
    """Counter trigger: margin 0 and no fall trigger; a rule with samples = 5 at floor start − 1 GiB.

    The first counted sample comes at the normal interval; the other four at the fast one,
    so the trip follows the first counted sample by ~4 × 0.25 s, not 4 × 1 s.
    """
    db = tmp_path / "sparkd.db"
    threshold = _avail() - GiB
    cfg = (
        f"interval_s = {NORMAL}\nfast_interval_s = {FAST}\nfast_hold_s = {HOLD}\n"
        f'fast_margin = "0B"\nfast_fall_rate = "1TiB"\nkernlog_source = "off"\ndry_run = true\n'
        f"[[rules]]\n"
        f'name = "test_low"\nwhen = ["MemAvailable < {threshold}B"]\nsamples = 5\n'
    )
    with sparkd_run(tmp_path, config=cfg):
        assert wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] >= 1, 15.0)
        _quiet_normal(db)
        hog_start = time.time()
        with Hog(2048) as hog:  # 1 GiB beyond the threshold: other processes freeing memory meanwhile
            hog.wait_ready()
            assert _avail() < threshold
            trips = wait_for(lambda: _events(db, "trip", since=hog_start), 10.0, step_s=0.05)
            assert trips, "no trip"
            trip_at = trips[0][0]
            fast_evs = _events(db, "sampling_fast", since=hog_start)
            assert fast_evs and fast_evs[0][2]["reason"] == "rule test_low counting", fast_evs
            # the samples that counted: the ones below the threshold up to the trip
            counted = [
                r[0]
                for r in db_query(
                    db,
                    # mem_available is stored in KiB (migration 0005)
                    "SELECT ts FROM samples WHERE ts >= ? AND ts <= ? AND mem_available * 1024 < ? ORDER BY ts",
                    (hog_start, trip_at, threshold),
                )
            ]
            assert len(counted) == 5, counted
            assert trip_at - counted[0] == pytest.approx(4 * FAST, abs=0.15), (trip_at - counted[0], _gaps(counted))
            assert _events(db, "dry_run", since=hog_start), "dry run: the stop must be recorded, not executed"
            hog.free()
