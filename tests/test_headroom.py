"""The nearest stop line (``core.headroom``) over the default rules and CONTEXT.md's figures."""

from __future__ import annotations

from sparkd.config import DEFAULT_RULES, RuleConfig
from sparkd.core.headroom import nearest_stop
from sparkd.core.rules import RuleState, SlopeWindow, compile_rules
from sparkd.core.sample import Sample
from sparkd.units import GiB, MiB

MEM_TOTAL = round(121.69 * GiB)


def rules() -> list:  # type: ignore[type-arg]
    return compile_rules([RuleConfig(**r) for r in DEFAULT_RULES], MEM_TOTAL)


def S(t: float, avail_gib: float, free_gib: float = 20.0, nvrm: int = 0) -> Sample:
    return Sample(
        ts=1e9 + t,
        mono=t,
        mem_total=MEM_TOTAL,
        mem_available=round(avail_gib * GiB),
        mem_available_minus_cma=round(avail_gib * GiB),  # no CMA here: usable = MemAvailable
        mem_free=round(free_gib * GiB),
        nvrm_recent=nvrm,
    )


def test_it_measures_from_the_nearest_line_not_the_predictive_gate() -> None:
    # issue 14: 8.5 GiB with every rule 0/N was "critical" because of the predictive rule's 16 GiB gate
    ns = nearest_stop(S(0, 8.5), rules(), {}, None, 0.0)
    assert ns is not None
    # low_available (6 GiB) is nearer than collapse_projected's 4 GiB floor; the gate plays no part
    assert (ns.rule, ns.field, ns.threshold_bytes) == ("low_available", "mem_available_minus_cma", 6 * GiB)
    assert ns.headroom_bytes == round(8.5 * GiB) - 6 * GiB
    assert (ns.counter, ns.samples) == (0, 3)
    assert ns.level == "warn"  # within 4 GiB, but no counter: not critical
    assert ns.fall_rate_bytes_per_s is None and ns.time_to_floor_s is None
    # far from every line: ok
    far = nearest_stop(S(0, 30), rules(), {}, None, 0.0)
    assert far is not None and far.level == "ok" and far.headroom_bytes == 24 * GiB


def test_a_two_condition_rule_is_as_far_as_its_furthest_condition() -> None:
    # MemFree 1 GiB is under 2 GiB already; MemAvailable 11 GiB must still fall under 10 GiB: 1 GiB away
    rs = [r for r in rules() if r.name == "low_free_with_evidence"]
    ns = nearest_stop(S(0, 11, free_gib=1, nvrm=1), rs, {}, None, 0.0)
    assert ns is not None and ns.field == "mem_available_minus_cma" and ns.headroom_bytes == 1 * GiB
    # without a driver error the evidence needs MemAvailable < 3 GiB: 8 GiB away
    ns = nearest_stop(S(0, 11, free_gib=1), rs, {}, None, 0.0)
    assert ns is not None and ns.threshold_bytes == 3 * GiB and ns.headroom_bytes == 8 * GiB


def test_counters_raise_the_level() -> None:
    st = {"low_available": RuleState(counter=1)}
    assert nearest_stop(S(0, 30), rules(), st, None, 0.0).level == "warn"  # type: ignore[union-attr]
    st = {"low_available": RuleState(counter=2)}
    ns = nearest_stop(S(0, 30), rules(), st, None, 0.0)
    assert ns is not None and ns.level == "critical" and ns.counter == 2


def test_a_fall_gives_a_rate_and_a_time_to_the_floor() -> None:
    # 7.1 -> 5.7 GiB in 9 s (CONTEXT.md's collapse) seen from 20 GiB: 1.4/9 GiB/s
    w = SlopeWindow(max_window_s=30.0)
    rate = 1.4 * GiB / 9
    for i in range(11):
        w.add(float(i), round(20 * GiB - rate * i))
    last = S(10, (20 * GiB - rate * 10) / GiB)
    ns = nearest_stop(last, rules(), {}, w, 10.0)
    assert ns is not None and ns.fall_rate_bytes_per_s is not None and ns.time_to_floor_s is not None
    assert abs(ns.fall_rate_bytes_per_s - rate) < 1 * MiB
    assert abs(ns.time_to_floor_s - ns.headroom_bytes / rate) < 1.0
    assert ns.level == "warn"  # ~80 s away: more than a 30 s stop, less than 120 s
    # a noise-sized drift (10 MiB/s < 32 MiB/s) is not a fall
    w2 = SlopeWindow(max_window_s=30.0)
    for i in range(11):
        w2.add(float(i), round(20 * GiB - 10 * MiB * i))
    assert nearest_stop(S(10, 19.9), rules(), {}, w2, 10.0).fall_rate_bytes_per_s is None  # type: ignore[union-attr]
    # its JSON is every field, as dataclasses.asdict gave it, and exactly what the status contract reads
    import dataclasses

    from sparkd.loop.status import NearestStopStatus

    assert ns.to_json() == dataclasses.asdict(ns)
    assert set(ns.to_json()) == set(NearestStopStatus.model_fields)


def test_with_nothing_to_stop_no_level_is_about_the_stops_timing() -> None:
    """After the model was stopped, the headline read "projected to reach the line in 16 s, sooner than a 30 s
    stop" (critical) with nothing running: a level about a stop that cannot come. A line already crossed is
    still critical (the host itself is short of memory)."""
    w = SlopeWindow(max_window_s=30.0)
    for i in range(11):  # 8.0 -> 7.0 GiB in 10 s: 0.1 GiB/s, the 6 GiB line in ~10 s
        w.add(float(i), round((8.0 - 0.1 * i) * GiB))
    last = S(10, 7.0)
    st = {"low_available": RuleState(counter=2)}
    running = nearest_stop(last, rules(), st, w, 10.0)
    idle = nearest_stop(last, rules(), st, w, 10.0, can_stop=False)
    assert running is not None and idle is not None
    assert running.level == "critical" and "sooner than a 30 s stop" not in idle.reason
    assert idle.level == "warn" and "nothing for a rule to stop" in idle.reason
    assert idle.time_to_floor_s == running.time_to_floor_s  # the fall is still said: it is a fact about the host
    below = nearest_stop(S(10, 5.0), rules(), {}, None, 10.0, can_stop=False)
    assert below is not None and below.level == "critical" and "nothing for a rule to stop" in below.reason
    assert below.reason.endswith("; the model is not running: nothing for a rule to stop")
    # guard mode with no container by its name: a model may run under another name; "not running" was not so
    named = nearest_stop(
        S(10, 5.0), rules(), {}, None, 10.0, can_stop=False, idle_why="guard mode: no container named x"
    )
    assert named is not None and named.reason.endswith("; guard mode: no container named x: nothing for a rule to stop")
    calm = nearest_stop(S(10, 60.0), rules(), {}, None, 10.0, can_stop=False)
    assert calm is not None and calm.level == "ok" and "nothing" not in calm.reason


def test_no_sample_or_no_stop_rule_gives_none() -> None:
    assert nearest_stop(None, rules(), {}, None, 0.0) is None
    warn_only = compile_rules([RuleConfig(name="w", when=["MemAvailable < 6GiB"], action="warn")], MEM_TOTAL)
    assert nearest_stop(S(0, 30), warn_only, {}, None, 0.0) is None


def test_a_window_that_still_holds_a_fall_while_memory_rises_again_is_no_fall() -> None:
    """Just after a stop the headline read "falling 0.13 GiB/s, reaches the line in 3 s" while MemAvailable rose,
    from the 10 s window that still held the fall (helper-48). The newest half of the window must fall too."""
    w = SlopeWindow(max_window_s=30.0)
    # 7 s falling 1 GiB/s from 14 GiB to 7 GiB (the model grows; the stop), then rising 0.3 GiB/s for 4 s
    values = [14 - i for i in range(8)] + [7 + 0.3 * k for k in range(1, 5)]
    for i, v in enumerate(values):
        w.add(float(i), round(v * GiB))
    now = float(len(values) - 1)
    assert (w.slope(now, 10.0) or 0) < -32 * MiB  # the whole window still reads as a fall
    ns = nearest_stop(S(now, values[-1]), rules(), {}, w, now)
    assert ns is not None and ns.fall_rate_bytes_per_s is None and ns.time_to_floor_s is None
    assert ns.level == "warn" and "projected" not in ns.reason  # 2.2 GiB above the 6 GiB line: within 4 GiB
    # the same fall going on is still projected
    w2 = SlopeWindow(max_window_s=30.0)
    for i in range(12):
        w2.add(float(i), round((30 - i) * GiB))
    ns2 = nearest_stop(S(11.0, 19), rules(), {}, w2, 11.0)
    assert ns2 is not None and ns2.fall_rate_bytes_per_s is not None and abs(ns2.fall_rate_bytes_per_s - GiB) < MiB


def test_the_newest_half_of_the_window_is_judged_at_slow_sampling_too() -> None:
    """At 2 s samples the 5 s half window holds 3 points, under the fit's 4: the check was skipped and the
    window that still held a fall was projected (helper-52). Two points give the direction."""
    w = SlopeWindow(max_window_s=30.0)
    values = [14.0, 12.0, 10.0, 8.0, 9.0, 10.0]  # 2 s apart: falling 1 GiB/s, then rising 0.5 GiB/s
    for i, v in enumerate(values):
        w.add(2.0 * i, round(v * GiB))
    now = 2.0 * (len(values) - 1)
    assert (w.slope(now, 10.0) or 0) < -32 * MiB
    ns = nearest_stop(S(now, values[-1]), rules(), {}, w, now)
    assert ns is not None and ns.fall_rate_bytes_per_s is None, ns
