"""``core.engine.RuleEngine``: step, re-check, demote, and the changes a replay applies."""

from __future__ import annotations

from pathlib import Path

from sparkd.config import DEFAULT_RULES, RuleConfig
from sparkd.core.engine import EngineChange, RuleEngine, engine_changes
from sparkd.core.sample import Sample, derive
from sparkd.ops.replay import replay
from sparkd.units import GiB

MEM_TOTAL = round(121.69 * GiB)


def S(t: float, avail_gib: float, free_gib: float = 20.0) -> Sample:
    s = Sample(ts=1_800_000_000 + t, mono=t, mem_total=MEM_TOTAL, mem_available=round(avail_gib * GiB))
    s.mem_free = round(free_gib * GiB)
    derive(s)
    return s


def engine() -> RuleEngine:
    return RuleEngine([RuleConfig(**r) for r in DEFAULT_RULES], cooldown_s=60.0, horizon_s=30.0)


def fall(n: int, start: float = 20.0, rate: float = 2.0, step: float = 0.25) -> list[Sample]:
    return [S(i * step, start - rate * i * step) for i in range(n)]


def test_a_recheck_judges_a_fresh_sample_without_changing_the_engine() -> None:
    e = engine()
    for s in fall(20):  # 20 -> 10.5 GiB at 2 GiB/s
        e.step(s)
    before = (list(e.slope.points), {k: (v.counter, v.trips) for k, v in e.states.items()})
    assert e.recheck("collapse_projected", S(5.0, 10.0)) is True  # still falling
    assert e.recheck("collapse_projected", S(5.0, 17.0)) is False  # recovered above the gate
    assert e.recheck("no_such_rule", S(5.0, 10.0)) is False
    assert (list(e.slope.points), {k: (v.counter, v.trips) for k, v in e.states.items()}) == before


def test_demote_keeps_counting_but_warns() -> None:
    e = engine()
    e.demote("low_available", "cannot protect this host")  # before the rules are compiled: kept
    e.compile(MEM_TOTAL)
    rule = e.rule("low_available")
    assert rule is not None and rule.action == "warn"
    trips = [d for s in (S(t, 5.0) for t in range(6)) for d in e.step(s) if d.kind == "trip"]
    assert [(d.rule, d.action) for d in trips] == [("low_available", "warn")]
    assert e.rules_json()[0]["demoted"] == "cannot protect this host"


def test_undemote_makes_the_rule_stop_again_and_keeps_other_demotions() -> None:
    e = engine()
    e.compile(MEM_TOTAL)
    e.demote("low_available", "loops")
    e.demote("collapse_projected", "loops too")
    e.undemote("low_available")
    e.undemote("not_a_rule")  # nothing demoted by that name: nothing changes
    actions = {r.name: r.action for r in e.rules}
    assert actions["low_available"] == "stop" and actions["collapse_projected"] == "warn"
    assert e.demoted == {"collapse_projected": "loops too"}
    assert {r.action for r in e.configured_rules} == {"stop"}  # as configured: no demotion in them
    trips = [d for s in (S(t, 5.0) for t in range(6)) for d in e.step(s) if d.kind == "trip"]
    assert [d.action for d in trips if d.rule == "low_available"] == ["stop"]


def test_stored_events_become_engine_changes() -> None:
    events = [
        {"ts": 30.0, "kind": "killed", "details": {"durations_s": {"stop": 31.2}}},
        {"ts": 10.0, "kind": "stopped", "details": {"durations_s": {"stop": 8.0, "total": 9.0}}},
        {
            "ts": 20.0,
            "kind": "watermark",
            "message": "rule x cannot protect",
            "details": {"rule": "x", "action": "demoted to warn"},
        },
        {"ts": 25.0, "kind": "watermark", "message": "rule y may loop", "details": {"rule": "y"}},  # a warning only
        {"ts": 26.0, "kind": "stopped", "details": {"durations_s": {}}},  # no stop duration: nothing
        {"ts": 40.0, "kind": "watermark", "message": "x stops again", "details": {"rule": "x", "action": "re-armed"}},
    ]
    assert engine_changes(events, run_starts=[5.0]) == [
        EngineChange(5.0, "reset"),
        EngineChange(10.0, "stop_duration", seconds=8.0),
        EngineChange(20.0, "demote", rule="x", reason="rule x cannot protect"),
        EngineChange(30.0, "stop_duration", seconds=31.2),
        EngineChange(40.0, "rearm", rule="x"),
    ]


def test_replay_applies_the_daemons_changes_where_the_guard_did() -> None:
    samples = [S(i * 0.25, max(7.0, 30.0 - 0.5 * i * 0.25)) for i in range(300)]  # 0.5 GiB/s to 7 GiB
    base = samples[0].ts
    plain = replay(samples, DEFAULT_RULES, mem_total_bytes=MEM_TOTAL)
    assert plain.first_stop is not None and plain.first_stop.rule == "collapse_projected"
    # a stop measured at 8 s before the fall: the horizon shrinks to 8 s, the trip comes later (at ~8 GiB)
    measured = replay(
        samples,
        DEFAULT_RULES,
        mem_total_bytes=MEM_TOTAL,
        changes=[EngineChange(base - 1, "stop_duration", seconds=8.0)],
    )
    assert measured.first_stop is not None
    assert measured.first_stop.t > plain.first_stop.t + 10
    # a restart after the measured stop forgets it: the same as no change at all
    reset = replay(
        samples,
        DEFAULT_RULES,
        mem_total_bytes=MEM_TOTAL,
        changes=[EngineChange(base - 2, "stop_duration", seconds=8.0), EngineChange(base - 1, "reset")],
    )
    assert reset.first_stop is not None and reset.first_stop.t == plain.first_stop.t
    # a demotion before the fall: the predictive rule warns instead of stopping
    demoted = replay(
        samples,
        DEFAULT_RULES,
        mem_total_bytes=MEM_TOTAL,
        changes=[EngineChange(base - 1, "demote", rule="collapse_projected", reason="loops")],
    )
    assert demoted.first_stop is None or demoted.first_stop.rule != "collapse_projected"
    assert [d.action for d in demoted.trips("collapse_projected")][:1] == ["warn"]
    # re-armed before the fall: the same stop as with no change at all
    rearmed = replay(
        samples,
        DEFAULT_RULES,
        mem_total_bytes=MEM_TOTAL,
        changes=[
            EngineChange(base - 2, "demote", rule="collapse_projected", reason="loops"),
            EngineChange(base - 1, "rearm", rule="collapse_projected"),
        ],
    )
    assert rearmed.first_stop is not None and rearmed.first_stop.t == plain.first_stop.t


def test_the_daemon_hands_each_measured_stop_to_the_engine(tmp_path: Path) -> None:
    import asyncio

    from sparkd.config import load_settings
    from sparkd.loop.daemon import Daemon

    settings = load_settings(overrides={"state_dir": str(tmp_path), "kernlog_source": "off", "api": {"enabled": False}})

    async def go() -> tuple[float, float]:
        d = Daemon(settings)
        await d.startup()
        assert d.guard is not None
        before = d.guard.engine.horizon_s  # container.stop_timeout_s
        # the stop procedure's event (act/stop.py: details = StopReport.to_json())
        d.event("stopped", "sparkd-vllm stopped", details={"durations_s": {"stop": 12.5, "total": 14.0}})
        after = d.guard.engine.horizon_s
        d.should_exit.set()
        await d.shutdown("test")
        return before, after

    assert asyncio.run(go()) == (30.0, 12.5)


def test_holds_now_asks_every_condition_the_evidence_and_the_projection() -> None:
    """The preflight's question before an operator's start ("would a stop rule trip now?"). A size line
    crossed is not enough (an adversarial helper: a launch refused for rules that could not trip)."""
    custom = [
        {"name": "psi_gated", "when": ["MemAvailable < 6GiB", "psi_some_avg10 > 50"]},
        {"name": "evidence_gated", "when": ["MemFree < 2GiB"], "evidence": ["nvrm_recent > 0"]},
        {"name": "plain", "when": ["MemAvailable < 6GiB"]},
        {"name": "projected", "kind": "predictive", "when": ["usable < 16GiB"], "floor": "4GiB"},
    ]
    e = RuleEngine([RuleConfig(**r) for r in custom], cooldown_s=60.0, horizon_s=30.0)
    flat = [S(i * 0.25, 3.0, free_gib=1.0) for i in range(20)]  # below every line, not falling
    for s in flat:
        s.psi_some_avg10, s.nvrm_recent = 0.0, 0
        e.step(s)
    last = flat[-1]
    assert [r.name for r in e.rules if e.holds_now(r.name, last)] == ["plain"]
    last.psi_some_avg10, last.nvrm_recent = 80.0, 2
    assert [r.name for r in e.rules if e.holds_now(r.name, last)] == ["psi_gated", "evidence_gated", "plain"]
    f = RuleEngine([RuleConfig(**r) for r in custom], cooldown_s=60.0, horizon_s=30.0)
    falling = fall(20, start=14.0, rate=2.0)  # 14 → 4.5 GiB at 2 GiB/s: projected to cross 4 GiB
    for s in falling:
        f.step(s)
    assert f.holds_now("projected", falling[-1]) is True and f.holds_now("no_such_rule", falling[-1]) is False


def test_a_duration_rules_held_time_is_reported_from_its_first_counted_sample() -> None:
    """A duration rule's card read "16/3 · 15 s" (counter over its minimum samples): it now reports ``held_s``."""
    e = RuleEngine([RuleConfig(name="held", when=["MemAvailable < 8GiB"], for_s=15.0, samples=3)])
    e.step(S(0.0, 20.0))
    assert e.rules_json()[0]["held_s"] is None  # not counting
    for t in (1.0, 2.0, 3.0, 4.5, 11.0):
        e.step(S(t, 6.0))
    [r] = e.rules_json()
    assert r["counter"] == 5 and r["held_s"] == 10.0 and r["for_s"] == 15.0  # 1.0 .. 11.0
    e.step(S(12.0, 20.0))
    assert e.rules_json()[0]["held_s"] is None  # reset with the counter


def test_a_step_recompiles_percent_thresholds_when_memtotal_changes() -> None:
    """``step`` compiles the rules on the first sample and again when a sample's MemTotal differs (a replay of a
    database from a host with another MemTotal; a kernel that changed its figure): a ``%`` threshold follows."""
    e = RuleEngine(
        [RuleConfig(name="low", when=["MemAvailable < 10%"], samples=2, action="stop")], cooldown_s=60.0, horizon_s=30.0
    )
    e.step(S(0.0, 50.0))
    assert e.rule("low") is not None and e.rule("low").when[0].threshold == 0.10 * MEM_TOTAL  # type: ignore[union-attr]
    bigger = S(1.0, 50.0)
    bigger.mem_total = 2 * MEM_TOTAL
    e.step(bigger)
    assert e.mem_total == 2 * MEM_TOTAL
    assert e.rule("low").when[0].threshold == 0.20 * MEM_TOTAL  # type: ignore[union-attr]
    no_total = S(2.0, 50.0)
    no_total.mem_total = None  # a sample without MemTotal keeps what was compiled
    e.step(no_total)
    assert e.mem_total == 2 * MEM_TOTAL
