"""Stop rules: compile, evaluate, counters, reasons, the predictive slope, re-check.

Pure: every sample is built here; no clock, no I/O.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from sparkd.config import DEFAULT_RULES, SEED_RULES, RuleConfig
from sparkd.core.engine import RuleEngine
from sparkd.core.rules import (
    Decision,
    Rule,
    RuleState,
    SlopeWindow,
    compile_condition,
    compile_rules,
    evaluate,
    still_holds,
)
from sparkd.core.sample import Sample, derive
from sparkd.units import GiB, MiB

MEM_TOTAL = round(121.69 * GiB)


def S(t: float, avail_gib: float | None, free_gib: float | None = None, nvrm: int = 0, **kw: Any) -> Sample:
    """A sample at ``t`` seconds with MemAvailable / MemFree in GiB (``None`` = missing)."""
    s = Sample(
        ts=1_700_000_000 + t,
        mono=t,
        mem_total=MEM_TOTAL,
        mem_available=None if avail_gib is None else round(avail_gib * GiB),
        mem_free=None if free_gib is None else round(free_gib * GiB),
        nvrm_recent=nvrm,
        **kw,
    )
    derive(s)  # usable memory, as build_sample derives it
    return s


def rules_of(*configs: dict[str, Any]) -> list[Rule]:
    return compile_rules([RuleConfig(**c) for c in configs], MEM_TOTAL)


def run(
    rules: list[Rule], samples: list[Sample], cooldown_s: float = 0.0
) -> tuple[list[list[Decision]], list[dict[str, int]], dict[str, RuleState]]:
    """Feed samples through the guard's own engine; return decisions and counters per sample."""
    engine = RuleEngine.of(rules, cooldown_s=cooldown_s)
    decisions, counters = [], []
    for s in samples:
        decisions.append(engine.step(s))
        counters.append({r.name: engine.states[r.name].counter for r in rules})
    return decisions, counters, engine.states


LOW = {"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 5}
SEED = [RuleConfig(**r) for r in SEED_RULES]
DEFAULT = [RuleConfig(**r) for r in DEFAULT_RULES]


# ----------------------------------------------------------------- compile


@pytest.mark.parametrize(
    ("text", "attr", "op", "threshold", "is_size"),
    [
        ("MemAvailable < 6GiB", "mem_available", "<", 6 * GiB, True),
        ("mem_free <= 2GiB", "mem_free", "<=", 2 * GiB, True),
        ("MemFree < 512MiB", "mem_free", "<", 512 * MiB, True),
        ("MemAvailable < 5%", "mem_available", "<", 0.05 * MEM_TOTAL, True),
        ("MemAvailable < 10%", "mem_available", "<", 0.10 * MEM_TOTAL, True),
        ("nvrm_recent > 0", "nvrm_recent", ">", 0.0, False),
        ("psi_full_avg10 >= 20", "psi_full_avg10", ">=", 20.0, False),
        ("driver > 90GiB", "driver_bytes", ">", 90 * GiB, True),
    ],
)
def test_compile_condition(text: str, attr: str, op: str, threshold: float, is_size: bool) -> None:
    c = compile_condition(text, MEM_TOTAL)
    assert (c.attr, c.op, c.is_size) == (attr, op, is_size)
    assert c.threshold == pytest.approx(threshold)
    assert c.text == text


def test_percentage_needs_mem_total() -> None:
    with pytest.raises(ValueError, match="percentage needs MemTotal"):
        compile_condition("MemAvailable < 5%", None)


@pytest.mark.parametrize(
    ("interval", "trip_t", "count"),
    [
        (1.0, 4.0, 5),  # the seed's meaning: 5 samples at 1 s, first to last 4 s apart
        (0.25, 4.0, 17),  # fast sampling: still 4 s of low water, not 1.25 s
        (0.5, 4.0, 9),
        (2.0, 4.0, 3),
        (5.0, 10.0, 3),  # coarse: 4 s pass after 2 samples, but at least 3 samples are needed
    ],
)
def test_a_duration_rule_means_the_same_time_at_any_interval(interval: float, trip_t: float, count: int) -> None:
    (r,) = rules_of({"name": "r", "when": ["MemAvailable < 6GiB"], "for_s": 4.0, "samples": 3})
    assert (r.for_s, r.samples, r.duration_based) == (4.0, 3, True)
    n = round(12 / interval) + 1
    decisions, _, _ = run([r], [S(i * interval, 5.0, 50.0) for i in range(n)])
    first = next(i for i, ds in enumerate(decisions) if ds)
    assert first * interval == pytest.approx(trip_t)
    assert decisions[first][0].counter == count


def test_a_duration_rule_without_samples_needs_three() -> None:
    (r,) = rules_of({"name": "r", "when": ["MemAvailable < 6GiB"], "for_s": 1.0})
    assert r.samples == 3
    (c,) = rules_of({"name": "c", "when": ["MemAvailable < 6GiB"]})
    assert (c.samples, c.for_s, c.duration_based) == (5, None, False)  # a count rule keeps the seed's 5


def test_seed_and_default_rules_compile() -> None:
    seed = compile_rules(SEED, MEM_TOTAL)
    assert [(r.name, r.samples, r.for_s, r.gated) for r in seed] == [
        ("low_available", 3, 4.0, False),
        ("low_available_and_free", 3, 4.0, False),
    ]
    default = compile_rules(DEFAULT, MEM_TOTAL)
    assert [(r.name, r.kind, r.samples, r.for_s, r.gated) for r in default] == [
        ("low_available", "threshold", 3, 4.0, False),
        ("low_free_with_evidence", "threshold", 3, 4.0, True),
        ("collapse_projected", "predictive", 2, 0.5, False),
        ("repeated_dips", "threshold", 3, 3.0, False),
    ]
    assert default[-1].in_last_s == 10.0 and all(r.in_last_s is None for r in default[:-1])
    # every default rule judges usable memory (MemAvailable - CmaFree)
    assert {c.attr for r in default for c in (*r.when, *r.evidence) if c.is_size} == {
        "mem_available_minus_cma",
        "mem_free",
    }
    assert default[2].floor_bytes == 4 * GiB
    assert (default[2].within_s, default[2].window_s) == (None, 2.0)  # horizon: the time a stop takes
    assert default[2].fit_windows(30.0) == [
        (2.0, 3.0),
        (4.0, 6.0),
        (8.0, 12.0),
        (16.0, 24.0),
        (32.0, 30.0),
        (64.0, 30.0),
    ]


# ----------------------------------------------------------------- counters


@pytest.mark.parametrize(
    ("avail", "counters"),
    [
        # counts while below 6 GiB, resets to zero as soon as a sample is not below
        ([5.0, 5.0, 5.0], [1, 2, 3]),
        ([5.0, 5.0, 7.0, 5.0], [1, 2, 0, 1]),
        ([5.0, 6.0, 5.0], [1, 0, 1]),  # 6.00 is not < 6 GiB
        ([7.0, 5.9, 5.9, 6.1, 5.9, 5.9, 5.9], [0, 1, 2, 0, 1, 2, 3]),
        ([5.0, None, 5.0], [1, 0, 1]),  # a missing field does not hold and resets too
    ],
)
def test_counter_increments_and_resets(avail: list[float | None], counters: list[int]) -> None:
    rules = rules_of(LOW)
    _, got, _ = run(rules, [S(i, a, 50.0) for i, a in enumerate(avail)])
    assert [c["low_available"] for c in got] == counters


@pytest.mark.parametrize("n", [1, 2, 3, 5, 10])
def test_trips_on_the_nth_consecutive_sample_not_before(n: int) -> None:
    rules = rules_of({**LOW, "samples": n})
    decisions, counters, states = run(rules, [S(i, 5.0, 50.0) for i in range(n)])
    assert all(d == [] for d in decisions[: n - 1])
    assert [d.kind for d in decisions[n - 1]] == ["trip"]
    assert decisions[n - 1][0].counter == n
    assert counters[-1]["low_available"] == 0  # reset after the trip
    assert states["low_available"].trips == 1


@pytest.mark.parametrize(
    ("avail", "free", "tripped"),
    [
        (5.0, 50.0, "low_available"),  # rule 1 alone: MemFree is plentiful
        (8.0, 1.0, "low_available_and_free"),  # rule 2 alone: MemAvailable above 6 GiB
    ],
)
def test_either_seed_rule_trips_alone(avail: float, free: float, tripped: str) -> None:
    rules = compile_rules(SEED, MEM_TOTAL)
    decisions, _, states = run(rules, [S(i, avail, free) for i in range(5)])
    assert [(d.rule, d.kind) for d in decisions[4]] == [(tripped, "trip")]
    assert {k: v.trips for k, v in states.items()} == {
        "low_available": int(tripped == "low_available"),
        "low_available_and_free": int(tripped == "low_available_and_free"),
    }


def test_both_seed_rules_trip_together_with_independent_counters() -> None:
    rules = compile_rules(SEED, MEM_TOTAL)
    # rule 2 starts counting two samples earlier (MemAvailable < 10 & MemFree < 2)
    avail = [9.0, 9.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    decisions, counters, _ = run(rules, [S(i, a, 1.0) for i, a in enumerate(avail)])
    assert [c["low_available_and_free"] for c in counters] == [1, 2, 3, 4, 0, 1, 2]
    assert [c["low_available"] for c in counters] == [0, 0, 1, 2, 3, 4, 0]
    assert [(d.rule, d.kind) for d in decisions[4]] == [("low_available_and_free", "trip")]
    assert [(d.rule, d.kind) for d in decisions[6]] == [("low_available", "trip")]


def test_cooldown() -> None:
    rules = rules_of(LOW)
    samples = [S(i, 5.0, 50.0) for i in range(16)]
    decisions, _, states = run(rules, samples, cooldown_s=8.0)
    kinds = {i: [d.kind for d in ds] for i, ds in enumerate(decisions) if ds}
    # trip at t=4; the counter restarts and reaches 5 again at t=9, 5 s after the trip (< 8 s): cooldown;
    # again at t=14, 10 s after the last real trip: a trip
    assert kinds == {4: ["trip"], 9: ["cooldown"], 14: ["trip"]}
    assert decisions[9][0].reason.endswith(" [cooldown]")
    assert states["low_available"].trips == 2
    assert states["low_available"].last_trip_mono == 14


def test_percentage_threshold_in_evaluate() -> None:
    rules = rules_of({"name": "pct", "when": ["MemAvailable < 5%"], "samples": 2})
    # 5 % of 121.69 GiB = 6.08 GiB: 6.05 counts, 6.10 does not
    _, counters, _ = run(rules, [S(0, 6.05, 50.0), S(1, 6.10, 50.0), S(2, 6.05, 50.0)])
    assert [c["pct"] for c in counters] == [1, 0, 1]
    decisions, _, _ = run(rules, [S(0, 6.05, 50.0), S(1, 6.0, 50.0)])
    assert decisions[1][0].reason == "pct: MemAvailable 6.00 GiB < 6.08 GiB for 2/2 samples (1.00 s)"


def test_missing_field_does_not_hold() -> None:
    rules = compile_rules(SEED, MEM_TOTAL)
    # MemFree unknown: rule 2 cannot count even though MemAvailable < 10 GiB
    decisions, counters, _ = run(rules, [S(i, 8.0, None) for i in range(10)])
    assert all(d == [] for d in decisions)
    assert all(c["low_available_and_free"] == 0 for c in counters)


# ----------------------------------------------------------------- reasons


def test_reason_text_exact() -> None:
    rules = rules_of(LOW)
    decisions, _, states = run(rules, [S(i, 5.21, 50.0) for i in range(5)])
    (d,) = decisions[4]
    assert d.reason == "low_available: MemAvailable 5.21 GiB < 6.00 GiB for 5/5 samples (4.00 s)"
    assert (d.rule, d.kind, d.action, d.counter, d.samples) == ("low_available", "trip", "stop", 5, 5)
    assert d.values == {"MemAvailable": round(5.21 * GiB)}
    assert states["low_available"].last_reason == d.reason


def test_reason_two_conditions() -> None:
    rules = compile_rules(SEED, MEM_TOTAL)
    decisions, _, _ = run(rules, [S(i * 0.5, 8.0, 1.25) for i in range(9)])
    assert all(d == [] for d in decisions[:8])
    (d,) = decisions[8]
    assert d.reason == (
        "low_available_and_free: MemAvailable 8.00 GiB < 10.00 GiB, MemFree 1.25 GiB < 2.00 GiB "
        "for 4.00 s over 9 samples (rule: 4 s, at least 3)"
    )


def test_reason_for_s_shows_both_forms() -> None:
    rules = rules_of({"name": "low_for", "when": ["MemAvailable < 6GiB"], "for_s": "1s"})
    decisions, _, _ = run(rules, [S(i * 0.25, 5.5, 50.0) for i in range(5)])
    (d,) = decisions[4]
    assert d.reason == "low_for: MemAvailable 5.50 GiB < 6.00 GiB for 1.00 s over 5 samples (rule: 1 s, at least 3)"


def test_gated_rule_near_miss_reason_and_counting() -> None:
    rules = compile_rules(DEFAULT, MEM_TOTAL)
    decisions, counters, states = run(rules, [S(i, 7.0, 1.3) for i in range(6)])
    near = [d for ds in decisions for d in ds]
    assert [d.kind for d in near] == ["near_miss"] * 6
    assert all(c["low_free_with_evidence"] == 0 for c in counters)
    assert states["low_free_with_evidence"].near_misses == 6
    assert near[0].reason == (
        "low_free_with_evidence: near miss (suppressed, not counted): "
        "MemFree 1.30 GiB < 2.00 GiB, usable 7.00 GiB < 10.00 GiB; "
        "no evidence (needs nvrm_recent > 0 or usable < 3.00 GiB; now nvrm_recent 0, usable 7.00 GiB)"
    )


def test_a_threshold_below_a_hundredth_of_a_gib_reads_in_mib() -> None:
    rules = rules_of({"name": "g", "when": ["MemAvailable < 10GiB"], "evidence": ["MemFree < 2MiB"]})
    decisions, _, _ = run(rules, [S(i, 7.0, 1.3) for i in range(1)])
    (d,) = decisions[0]
    assert "no evidence (needs MemFree < 2.0 MiB; now MemFree 1.30 GiB)" in d.reason  # was "< 0.00 GiB"


def test_gated_rule_trip_reason_names_the_evidence() -> None:
    rules = compile_rules(DEFAULT, MEM_TOTAL)
    decisions, _, _ = run(rules, [S(i, 7.0, 1.3, nvrm=3) for i in range(5)])
    (d,) = decisions[4]
    assert d.reason == (
        "low_free_with_evidence: MemFree 1.30 GiB < 2.00 GiB, usable 7.00 GiB < 10.00 GiB, "
        "evidence: nvrm_recent 3 > 0 for 4.00 s over 5 samples (rule: 4 s, at least 3)"
    )
    assert d.values["nvrm_recent"] == 3


def test_near_miss_breaks_a_streak() -> None:
    rules = compile_rules(DEFAULT, MEM_TOTAL)
    nvrm = [1, 1, 1, 0, 1, 1, 1, 1, 1]
    _, counters, states = run(rules, [S(i, 7.0, 1.3, nvrm=n) for i, n in enumerate(nvrm)])
    assert [c["low_free_with_evidence"] for c in counters] == [1, 2, 3, 0, 1, 2, 3, 4, 0]
    assert states["low_free_with_evidence"].near_misses == 1
    assert states["low_free_with_evidence"].trips == 1


def test_holds_says_whether_every_condition_and_the_evidence_held_on_the_last_sample_whatever_the_counter() -> None:
    """``RuleState.holds``: the card's "holds now; counting again" after a trip (which starts the counter again),
    never for a near miss (its evidence did not hold) nor a sample above the line."""
    rules = compile_rules(DEFAULT, MEM_TOTAL)
    engine = RuleEngine.of(rules)
    gated = engine.states["low_free_with_evidence"]
    holds = []
    for i, (free, nvrm) in enumerate([(1.3, 1), (1.3, 1), (1.3, 1), (1.3, 1), (1.3, 1), (1.3, 0), (4.0, 1)]):
        kinds = [d.kind for d in engine.step(S(i, 7.0, free, nvrm=nvrm)) if d.rule == "low_free_with_evidence"]
        holds.append((gated.counter, gated.holds, kinds))
    assert holds == [
        (1, True, []),
        (2, True, []),
        (3, True, []),
        (4, True, []),
        (0, True, ["trip"]),  # the trip starts the count again; the rule still holds
        (0, False, ["near_miss"]),  # no evidence: it does not hold
        (0, False, []),  # MemFree above its line
    ], holds


# ----------------------------------------------------------------- predictive


def test_theil_sen_slope_is_robust_to_one_outlier() -> None:
    w = SlopeWindow()
    for i in range(9):  # -1 GiB/s at 0.25 s, one sample 3 GiB off the line
        t = i * 0.25
        v = 12 * GiB - t * GiB - (3 * GiB if i == 7 else 0)
        w.add(t, round(v))
    assert w.slope(2.0, 2.0) == pytest.approx(-1.0 * GiB, rel=1e-6)
    # ordinary least squares on the same points would be pulled off the line
    pts = list(w.points)
    n = len(pts)
    mt = sum(p[0] for p in pts) / n
    mv = sum(p[1] for p in pts) / n
    ols = sum((p[0] - mt) * (p[1] - mv) for p in pts) / sum((p[0] - mt) ** 2 for p in pts)
    assert abs(ols - (-1.0 * GiB)) > 0.01 * GiB


def test_slope_needs_four_points_in_the_window() -> None:
    w = SlopeWindow()
    for t in (0.0, 1.0, 2.0):
        w.add(t, round((10 - t) * GiB))
    assert w.slope(2.0, 2.0) is None  # three points at 1 s fit in a 2 s window: not enough
    w.add(2.5, round(7.5 * GiB))
    assert w.slope(2.5, 2.0) is None  # 0.5..2.5 s: 1.0, 2.0, 2.5 — still three
    w.add(3.0, round(7 * GiB))
    assert w.slope(3.0, 2.0) == pytest.approx(-1.0 * GiB)


def test_slope_window_forgets_old_points() -> None:
    w = SlopeWindow(max_window_s=10.0)
    for t in range(30):
        w.add(float(t), GiB)
    assert w.points[0][0] == 19.0
    w.add(30.0, None)  # a missing MemAvailable is not a point
    assert w.points[-1][0] == 29.0


COLLAPSE = {
    "name": "collapse_projected",
    "kind": "predictive",
    "when": ["MemAvailable < 16GiB"],
    "floor": "4GiB",
    "within_s": 3.0,
    "window_s": 2.0,
    "samples": 2,
}


def test_a_projection_from_below_its_floor_says_already_below_not_in_0_0_s() -> None:
    """helper-37 read "projected to cross 4.00 GiB in 0.0 s" on a trip whose usable memory was under the floor
    already; the reason says so instead, and what the projection looked ahead is no longer written "<= 3 s" beside
    "a stop takes up to 30 s" as if the two were one limit."""
    rules = rules_of(COLLAPSE)
    samples = [S(i * 0.25, 3.9 - 0.5 * i * 0.25, 50.0) for i in range(12)]  # 3.9 GiB, falling 0.5 GiB/s
    decisions, _, _ = run(rules, samples)
    (d,) = next(ds for ds in decisions if ds)
    assert d.kind == "trip" and d.values["eta_s"] < 0, d
    assert "falling 0.50 GiB/s (robust fit over 2 s), at or below the projection's floor 4.00 GiB already" in d.reason
    assert "in 0.0 s" not in d.reason and "projected to cross" not in d.reason, d.reason
    # without within_s the horizon is the stop's own time: said beside what the fit looks ahead
    no_within = rules_of({**COLLAPSE, "within_s": None})
    falling = [S(i * 0.25, 15 - 2 * i * 0.25, 50.0) for i in range(40)]
    decisions, _, _ = run(no_within, falling)
    (d,) = next(ds for ds in decisions if ds)
    assert re.search(
        r"projected to cross 4\.00 GiB in \d+\.\d s \(it looks [\d.]+ s ahead; a stop takes up to 30 s\)", d.reason
    ), d.reason


def test_predictive_fires_on_a_fast_collapse() -> None:
    rules = rules_of(COLLAPSE)
    # -2 GiB/s from 15 GiB at 0.25 s: 4 points after 0.75 s; ETA to 4 GiB = (13.5-4)/2 = 4.75 s > 3 s,
    # ETA falls to 3 s at 10 GiB (t=2.5 s); the 2nd counted sample trips
    samples = [S(i * 0.25, 15 - 2 * i * 0.25, 50.0) for i in range(16)]
    decisions, counters, _ = run(rules, samples)
    first = next(i for i, ds in enumerate(decisions) if ds)
    assert samples[first].mono == 2.75
    assert [c["collapse_projected"] for c in counters[8:12]] == [0, 0, 1, 0]
    (d,) = decisions[first]
    assert d.kind == "trip"
    assert d.reason == (
        "collapse_projected: MemAvailable 9.50 GiB < 16.00 GiB, falling 2.00 GiB/s "
        "(robust fit over 2 s), projected to cross 4.00 GiB in 2.8 s (it looks 3 s ahead) for 2/2 samples (0.25 s)"
    )
    assert d.values["slope_bytes_per_s"] == pytest.approx(-2 * GiB, rel=1e-6)
    assert d.values["eta_s"] == pytest.approx(2.75, abs=0.01)


@pytest.mark.parametrize("interval", [0.25, 1.0])
def test_predictive_quiet_on_slow_steady_decline(interval: float) -> None:
    rules = rules_of(COLLAPSE)
    # 15 → 6.5 GiB at 20 MiB/s: inside the 16 GiB gate all along, ETA to 4 GiB never under 2 minutes
    n = int(((15 - 6.5) * 1024 / 20) / interval)
    samples = [S(i * interval, 15 - i * interval * 20 / 1024, 50.0) for i in range(n)]
    decisions, counters, _ = run(rules, samples)
    assert all(d == [] for d in decisions)
    assert max(c["collapse_projected"] for c in counters) == 0


def test_predictive_quiet_on_a_one_sample_dip() -> None:
    rules = rules_of(COLLAPSE)
    avail = [9.0] * 12 + [5.0] + [9.0] * 12  # one sample 4 GiB low, then back
    decisions, counters, _ = run(rules, [S(i * 0.25, a, 50.0) for i, a in enumerate(avail)])
    assert all(d == [] for d in decisions)
    assert max(c["collapse_projected"] for c in counters) == 0


def test_predictive_gate_must_hold() -> None:
    rules = rules_of(COLLAPSE)
    # a fast fall far above the 16 GiB gate is not counted
    samples = [S(i * 0.25, 60 - 4 * i * 0.25, 50.0) for i in range(20)]  # 60 → 41 GiB at 4 GiB/s
    decisions, _, _ = run(rules, samples)
    assert all(d == [] for d in decisions)


# ----------------------------------------------------------------- re-check


def test_still_holds_threshold_rule() -> None:
    (low,) = rules_of(LOW)
    assert still_holds(low, S(0, 5.9, 50.0), None, 0.0) is True
    assert still_holds(low, S(0, 6.1, 50.0), None, 0.0) is False
    assert still_holds(low, S(0, None, 50.0), None, 0.0) is False


def test_still_holds_gated_rule_needs_evidence() -> None:
    gated = compile_rules(DEFAULT, MEM_TOTAL)[1]
    assert still_holds(gated, S(0, 7.0, 1.3, nvrm=2), None, 0.0) is True
    assert still_holds(gated, S(0, 7.0, 1.3, nvrm=0), None, 0.0) is False
    assert still_holds(gated, S(0, 2.5, 1.3, nvrm=0), None, 0.0) is True  # MemAvailable < 3 GiB is evidence
    assert still_holds(gated, S(0, 7.0, 2.5, nvrm=2), None, 0.0) is False  # MemFree recovered


def test_still_holds_predictive_rule_rechecks_the_projection() -> None:
    (pred,) = rules_of(COLLAPSE)
    w = SlopeWindow()
    for i in range(9):
        w.add(i * 0.25, round((12 - 2 * i * 0.25) * GiB))  # 12 → 8 GiB at -2 GiB/s
    assert still_holds(pred, S(2.0, 8.0, 50.0), w, 2.0) is True  # ETA 2 s
    # the fresh sample shows recovery: added to the window, the robust slope flattens and
    # the projection no longer holds
    flat = SlopeWindow()
    for i in range(9):
        flat.add(i * 0.25, round(8 * GiB))
    assert still_holds(pred, S(2.0, 8.0, 50.0), flat, 2.0) is False
    assert still_holds(pred, S(2.0, 17.0, 50.0), w, 2.0) is False  # gate no longer holds
    assert still_holds(pred, S(2.0, 8.0, 50.0), None, 2.0) is False  # no window: cannot confirm


def test_still_holds_predictive_rule_with_evidence_requires_evidence() -> None:
    (pred,) = rules_of({**COLLAPSE, "name": "gated_collapse", "evidence": ["nvrm_recent > 0"]})
    w = SlopeWindow()
    for i in range(9):
        w.add(i * 0.25, round((12 - 2 * i * 0.25) * GiB))
    # evaluate would not count this sample (no evidence): the re-check must not confirm it either
    states: dict[str, RuleState] = {}
    (d,) = evaluate(S(2.0, 8.0, 50.0, nvrm=0), [pred], states, 2.0, slope=w)
    assert d.kind == "near_miss"
    assert still_holds(pred, S(2.0, 8.0, 50.0, nvrm=0), w, 2.0) is False


def test_a_projection_horizon_is_printed_to_a_tenth_of_a_second() -> None:
    """The horizon is cut to the points' reach: it printed as "<= 5.62621 s" (an operator's walk-through)."""
    from sparkd.core.rules import _secs

    assert [_secs(v) for v in (24.0, 5.62621, 0.25, 120.0)] == ["24", "5.6", "0.2", "120"]


# ----------------------------------------------------------------- held in total within a window (in_last_s)

FLAP = [0.5, 6.5] * 15  # usable flapping across every line at the sampling rate (helper-33): 30 samples
DIPS = {"name": "dips", "when": ["usable < 3GiB"], "for_s": 3.0, "in_last_s": 10.0, "samples": 3}


def test_memory_flapping_at_the_sampling_rate_never_trips_the_consecutive_rules_but_trips_repeated_dips() -> None:
    """helper-33 alternated MemAvailable between 0.5 GiB and 6.5 GiB each sample for 30 samples: every consecutive
    counter reset at each good sample, and nothing was ever stopped. The default ``repeated_dips`` (usable < 3 GiB
    for 3 s in total within the last 10 s) trips on the sixth sample: the low ones at 0, 2 and 4 s each held 1 s,
    the third one's second ending there (a good sample, but the pattern is complete: no wait for the next dip)."""
    rules = compile_rules(DEFAULT, MEM_TOTAL)
    decisions, _, states = run(rules, [S(i, a, 0.3) for i, a in enumerate(FLAP)])
    trips = [(i, d.rule) for i, ds in enumerate(decisions) for d in ds if d.kind == "trip"]
    assert trips[0] == (5, "repeated_dips"), trips
    assert {r for _i, r in trips} == {"repeated_dips"}  # the consecutive rules never trip on it
    (d,) = [d for d in decisions[5] if d.kind == "trip"]
    assert d.reason == (
        "repeated_dips: usable < 3GiB (now usable 6.50 GiB) for 3.00 s in total within the last 10 s over 3 samples "
        "(rule: 3 s, at least 3)"
    ), d.reason
    assert states["low_available"].trips == 0


@pytest.mark.parametrize(
    ("interval", "avail", "trip_at"),
    [
        (1.0, [2, 2, 2, 2], 3),  # consecutive: as a plain duration rule, 3 s after the first low sample
        (0.25, [2] * 13, 12),  # the same 3 s at 4 Hz
        (0.25, [9, 2, 2, 2, 9, 9, 9, 9], None),  # one 0.5 s excursion at 4 Hz (fast sampling near a line): never
        (1.0, [2, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 2, 9], None),  # one dip in 10 s, twice: never
        (1.0, [2, 9, 9, 2, 9, 9, 2, 9, 9, 2], 7),  # a 1-in-3 duty cycle: 3 s in total a second after the third dip
        (1.0, [2, 9, 9, 9, 9, 9, 9, 2, 9, 9, 9, 2, 9, 9, 2], None),  # dips 4 s apart: a window never holds 3 s
        (1.0, [2, None, 2, None, 2, None, 2], 5),  # an unread sample does not count (its interval) nor reset
    ],
)
def test_a_windowed_rule_counts_the_time_held_in_total_within_its_window(
    interval: float, avail: list[float | None], trip_at: int | None
) -> None:
    rules = rules_of(DIPS)
    decisions, _, _ = run(rules, [S(i * interval, a, 50.0) for i, a in enumerate(avail)])
    tripped = [i for i, ds in enumerate(decisions) if ds]
    assert tripped == ([] if trip_at is None else [trip_at])


def test_a_windowed_rule_starts_from_nothing_after_its_trip_and_shows_its_total_while_counting() -> None:
    engine = RuleEngine.of(rules_of(DIPS))
    for i, a in enumerate([2, 9, 2, 9, 2]):
        engine.step(S(i, a, 50.0))
    (r,) = engine.rules_json()
    assert (r["counter"], r["held_s"], r["in_last_s"]) == (3, 2.0, 10.0)
    engine.step(S(5, 9, 50.0))  # the third dip's second ends here: 3 s in total
    assert engine.states["dips"].trips == 1
    (r,) = engine.rules_json()
    assert (r["counter"], r["held_s"]) == (0, None)  # the trip's window is forgotten
    engine.step(S(6, 2, 50.0))
    engine.step(S(7, 2, 50.0))
    (r,) = engine.rules_json()
    assert (r["counter"], r["held_s"]) == (2, 1.0)


def test_a_gated_windowed_rule_counts_a_near_miss_as_not_held() -> None:
    rules = rules_of({**DIPS, "evidence": ["nvrm_recent > 0"]})
    samples = [S(0, 2, 50, nvrm=1), S(1, 2, 50), S(2, 2, 50, nvrm=1), S(3, 2, 50, nvrm=1), S(4, 2, 50, nvrm=1)]
    decisions, _, states = run(rules, samples)
    assert [d.kind for d in decisions[1]] == ["near_miss"]
    assert states["dips"].near_misses == 1
    # held: 0→1 (1 s), 2→3, 3→4: 3 s at the fifth sample; the near miss's interval 1→2 does not count
    assert [d.kind for d in decisions[4]] == ["trip"]


def test_a_windowed_rule_is_not_taken_back_by_one_good_reading_at_the_re_check_but_holds_now_reads_the_sample() -> None:
    engine = RuleEngine.of(rules_of(DIPS, {"name": "low", "when": ["usable < 3GiB"], "samples": 3}))
    good = S(5, 6.5, 50)
    assert engine.recheck("dips", good) is True
    assert engine.recheck("low", good) is False
    # the preflight before an operator's start asks what holds on this sample: a healthy host is not refused
    assert engine.holds_now("dips", good) is False
    assert engine.holds_now("dips", S(5, 2, 50)) is True


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"for_s": None}, "needs for_s"),
        ({"kind": "predictive", "floor": "4GiB"}, "needs for_s, and kind must be"),
        ({"for_s": 12.0}, "for_s (12) must be at most in_last_s (10)"),
        ({"in_last_s": 0}, "greater than 0"),
    ],
)
def test_in_last_s_is_refused_where_it_means_nothing(extra: dict[str, Any], message: str) -> None:
    cfg = {**DIPS, **extra}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RuleConfig(**cfg)


def test_a_percentage_on_psi_is_psi_itself_and_on_a_count_is_refused() -> None:
    """``%`` meant "of MemTotal" for every field: ``psi_full_avg10 > 20%`` (PSI is a percentage itself) compiled to
    27.5e9 on a 128 GiB host, never held, and no ``rule_never_fires`` said so; ``nvrm_recent > 1%`` the same
    (helper-43). PSI's ``%`` is now its own; a count refuses it, naming the field; PSI above 100 never holds."""
    from sparkd.core.conditions import never_fires
    from sparkd.core.rules import compile_condition

    mem_total = 128 << 30
    psi = compile_condition("psi_full_avg10 > 20%", mem_total)
    assert psi.threshold == 20.0 and psi.threshold == compile_condition("psi_full_avg10 > 20", mem_total).threshold
    assert never_fires(["psi_full_avg10 > 20%"], [], mem_total) == []
    assert never_fires(["psi_some_avg10 > 150"], [], mem_total) == [
        "'psi_some_avg10 > 150' can never hold: psi_some_avg10 (a share of time, %) never exceeds 100"
    ]
    with pytest.raises(ValueError, match=r"nvrm_recent in 'nvrm_recent > 1%' is a count: a percentage \(of MemTotal\)"):
        compile_condition("nvrm_recent > 1%", mem_total)
    assert compile_condition("MemAvailable < 5%", mem_total).threshold == 0.05 * mem_total  # sizes: as ever
