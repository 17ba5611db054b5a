"""Watermark sanity on a tuned host: floor warnings, tunables, and the relaunch-loop guard."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sparkd.config import DEFAULT_RULES, RuleConfig
from sparkd.core.engine import RuleEngine
from sparkd.core.floors import LoopGuard, check_floors, demote, loop_floor, read_vm_tunables
from sparkd.core.rules import Rule, compile_rules
from sparkd.core.sample import build_sample
from sparkd.sense import procfs
from sparkd.units import GiB, MiB
from tests.conftest import FIXTURES

PROC = FIXTURES / "proc-watermark"
PAGE = 4096  # the fixture's zoneinfo is in 4 KiB pages
LOW_PAGES = 114340 + 3599965  # DMA + Normal "low" lines


def default_rules(mem_total: int) -> list[Rule]:
    return compile_rules([RuleConfig(**r) for r in DEFAULT_RULES], mem_total)


def fixture_state() -> tuple[int, int, int, dict[str, int | None]]:
    mi = procfs.read_meminfo(PROC).fields
    low = procfs.read_zoneinfo_low_watermark_bytes(PROC)
    assert low is not None
    return mi["MemTotal"], mi["MemAvailable"], low, read_vm_tunables(PROC)


def test_fixture_reads_as_a_tuned_healthy_host() -> None:
    total, avail, low, vm = fixture_state()
    assert total == 127600748 * 1024
    assert avail == 1677824 * 1024 and f"{avail / GiB:.2f}" == "1.60"
    assert low == LOW_PAGES * procfs.os.sysconf("SC_PAGE_SIZE")
    assert vm == {"min_free_kbytes": 2097152, "watermark_scale_factor": 1000, "watermark_boost_factor": None}
    assert procfs.read_psi(PROC) is not None


def test_read_vm_tunables_missing_tree(tmp_path: object) -> None:
    assert read_vm_tunables(str(tmp_path)) == {
        "min_free_kbytes": None,
        "watermark_scale_factor": None,
        "watermark_boost_factor": None,
    }


def test_check_floors_warns_for_the_6gib_rule_with_the_numbers() -> None:
    total, avail, _, vm = fixture_state()
    low = LOW_PAGES * PAGE  # page-size independent
    ws = check_floors(
        default_rules(total),
        healthy_mem_available_bytes=avail,
        low_watermark_bytes=low,
        min_free_kbytes=vm["min_free_kbytes"],
        watermark_scale_factor=vm["watermark_scale_factor"],
    )
    by = {(w.rule, w.problem): w for w in ws}
    w = by[("low_available", "cannot_protect")]
    assert w.severity == "warning" and w.floor_bytes == 6 * GiB and w.healthy_bytes == avail
    assert w.message.startswith(
        "rule low_available cannot protect this host: healthy MemAvailable 1.60 GiB is below its floor "
        "6.00 GiB; stopping would loop"
    )
    assert "vm.min_free_kbytes=2097152" in w.message and "vm.watermark_scale_factor=1000" in w.message
    assert "low watermarks 14.17 GiB in total" in w.message
    # the predictive rule loops too: below its 4 GiB floor the projected crossing is "now"
    p = by[("collapse_projected", "cannot_protect")]
    assert p.floor_bytes == 4 * GiB and "below its floor 4.00 GiB" in p.message
    # the MemFree rule does not loop (a healthy host has MemFree 27 GiB here), but its
    # MemAvailable conditions say nothing on this host, and its MemFree floor sits under the watermarks
    g = by[("low_free_with_evidence", "always_holds")]
    assert g.severity == "info" and "only MemFree < 2GiB decides" in g.message
    assert ("low_free_with_evidence", "cannot_protect") not in by
    mf = [x for x in ws if x.problem == "at_watermark" and x.attr == "mem_free"]
    assert len(mf) == 1 and mf[0].severity == "warning"
    assert "floor MemFree 2.00 GiB is at or below the kernel's low watermarks (14.17 GiB in total)" in mf[0].message


def test_check_floors_quiet_on_a_stock_host() -> None:
    total = 127600748 * 1024
    ws = check_floors(
        default_rules(total),
        healthy_mem_available_bytes=26 * GiB,  # model loaded, stock watermarks
        low_watermark_bytes=80 * MiB,
        min_free_kbytes=67584,
        watermark_scale_factor=10,
    )
    assert [w for w in ws if w.severity == "warning"] == []


def test_check_floors_near_margin() -> None:
    rules = compile_rules([RuleConfig(name="low_available", when=["MemAvailable < 6GiB"])], None)
    ws = check_floors(
        rules,
        healthy_mem_available_bytes=int(6.5 * GiB),
        low_watermark_bytes=None,
        min_free_kbytes=None,
        watermark_scale_factor=None,
    )
    assert [(w.problem, w.severity) for w in ws] == [("near_floor", "warning")]
    assert "within 1.00 GiB of its floor 6.00 GiB" in ws[0].message


def test_a_warn_rule_above_the_healthy_host_is_noted_not_called_a_stop_loop() -> None:
    # only a stop can loop; a warn rule whose line this healthy host is below always holds (info)
    cfgs = [
        RuleConfig(name="climbing", when=["MemAvailable < 30GiB"], action="warn"),
        RuleConfig(name="low_available", when=["MemAvailable < 30GiB"]),
    ]
    ws = check_floors(
        compile_rules(cfgs, None),
        healthy_mem_available_bytes=22 * GiB,
        low_watermark_bytes=None,
        min_free_kbytes=None,
        watermark_scale_factor=None,
    )
    assert [(w.rule, w.problem, w.severity) for w in ws] == [
        ("climbing", "always_holds", "info"),
        ("low_available", "cannot_protect", "warning"),
    ]
    assert "stopping would loop" not in ws[0].message and "already holds on this healthy host" in ws[0].message


def test_a_floor_sized_from_the_healthy_figure_passes() -> None:
    """docs/tuned-hosts.md: a percent-of-MemTotal floor on MemAvailable-CmaFree, more than the
    margin under the healthy figure (here 1.60 − 0.125 CmaFree = 1.48 GiB)."""
    total, avail, low, _ = fixture_state()
    cma_free = procfs.read_meminfo(PROC).fields["CmaFree"]
    rules = compile_rules([RuleConfig(name="low_available", when=["MemAvailable-CmaFree < 0.3%"])], total)
    assert f"{rules[0].when[0].threshold / GiB:.3f}" == "0.365"
    ws = check_floors(
        rules,
        healthy_mem_available_bytes=avail,
        low_watermark_bytes=low,
        min_free_kbytes=None,
        watermark_scale_factor=None,
        healthy_cma_free_bytes=cma_free,
    )
    assert [(w.problem, w.severity) for w in ws] == [("at_watermark", "info")]
    assert loop_floor(rules[0], cma_free) == 0.003 * total + cma_free
    # 0.5% (0.61 GiB) would be within the 1 GiB noise margin of 1.48 GiB
    rules = compile_rules([RuleConfig(name="low_available", when=["MemAvailable-CmaFree < 0.5%"])], total)
    ws = check_floors(
        rules,
        healthy_mem_available_bytes=avail,
        low_watermark_bytes=None,
        min_free_kbytes=None,
        watermark_scale_factor=None,
        healthy_cma_free_bytes=cma_free,
    )
    assert [w.problem for w in ws] == ["near_floor"]


def test_loop_floor_shapes() -> None:
    rules = {r.name: r for r in default_rules(127600748 * 1024)}
    assert loop_floor(rules["low_available"]) == 6 * GiB
    assert loop_floor(rules["low_free_with_evidence"]) is None
    assert loop_floor(rules["collapse_projected"]) == 4 * GiB


def replay_trips(rules: list[Rule], guard: LoopGuard, relaunches: int) -> list[tuple[float, str, str]]:
    """Replay a relaunch loop against the real rule engine on the fixture's healthy sample.

    Each cycle: relaunch at T, the model is healthy and idle at T+120 s (MemAvailable 1.60 GiB,
    noted), the rules then see that healthy sample once a second; on a trip the daemon asks the
    loop guard first and stops (→ next relaunch 30 s later) only without a verdict.
    Returns (t, rule, "stop" | "demoted" | "warn") for every trip.
    """
    mi = procfs.read_meminfo(PROC)
    engine = RuleEngine.of(rules, cooldown_s=60.0)
    log: list[tuple[float, str, str]] = []
    t = 0.0
    for _ in range(relaunches):
        guard.note_launch(t)
        t += 120.0
        healthy = build_sample(t, t, mi, None)
        guard.note_healthy(t, healthy.mem_available)
        stopped = False
        for _ in range(600):  # ten minutes of 1 s samples
            t += 1.0
            s = build_sample(t, t, mi, None)
            for d in engine.step(s):
                if d.kind != "trip":
                    continue
                rule = engine.rule(d.rule)
                assert rule is not None
                if d.action != "stop":
                    log.append((t, d.rule, "warn"))
                    continue
                v = guard.record_trip(rule, t)
                if v is not None:
                    engine.demote(v.rule, v.reason)
                    log.append((t, d.rule, "demoted"))
                else:
                    log.append((t, d.rule, "stop"))
                    stopped = True
            if stopped:
                break
        t += 30.0  # relaunch back-off
    rules[:] = engine.rules  # as the engine holds them now (demoted or not)
    return log


def test_loop_guard_concludes_cannot_protect_at_the_first_trip() -> None:
    rules = [r for r in default_rules(127600748 * 1024) if r.name == "low_available"]
    guard = LoopGuard()
    log = replay_trips(rules, guard, relaunches=3)
    # the first trip (5 samples after the healthy reading) is judged, not stopped on
    assert log[0][1:] == ("low_available", "demoted") and log[0][0] == 120 + 5
    assert [x for x in log if x[2] == "stop"] == []
    assert all(x[2] == "warn" for x in log[1:]) and len(log) > 1
    v = guard.cannot_protect("low_available")
    assert v is not None and v.trips == 1
    assert v.reason.startswith(
        "rule low_available cannot protect this host: healthy MemAvailable 1.60 GiB is below its floor 6.00 GiB; "
        "stopping would loop"
    )
    assert rules[0].action == "warn"
    st = guard.status()
    assert st["rules"]["low_available"]["cannot_protect"] and st["healthy_mem_available_bytes"] == 1677824 * 1024


def test_three_quick_trips_after_relaunches_convict_after_the_first() -> None:
    """The issue's scenario, as trip times: 3 trips each within minutes of a relaunch while
    the idle MemAvailable sat below the floor — "cannot protect" after the first, not the hundredth."""
    rule = next(r for r in default_rules(None) if r.name == "low_available")
    g = LoopGuard()
    verdicts = []
    for i, launch in enumerate([0.0, 400.0, 1300.0]):
        g.note_launch(launch)
        g.note_healthy(launch + 100, int(1.6 * GiB))
        verdicts.append(g.record_trip(rule, launch + 100 + 5 + i))
    assert verdicts[0] is not None and verdicts[1] is None and verdicts[2] is None
    assert g.status()["rules"]["low_available"]["trips"] == 3


def test_genuine_emergencies_are_never_demoted() -> None:
    rule = next(r for r in default_rules(None) if r.name == "low_available")
    g = LoopGuard()
    for launch in (0.0, 200.0, 400.0, 600.0):
        g.note_launch(launch)
        g.note_healthy(launch + 100, 30 * GiB)  # healthy idle host far above the floor
        assert g.record_trip(rule, launch + 150) is None  # a real collapse, every time
    assert g.cannot_protect("low_available") is None


def test_no_healthy_reading_means_no_verdict() -> None:
    rule = next(r for r in default_rules(None) if r.name == "low_available")
    g = LoopGuard()
    g.note_launch(0)
    assert g.record_trip(rule, 30) is None  # leave it to the supervisor's circuit breaker


def test_within_margin_needs_consecutive_quick_trips() -> None:
    rule = next(r for r in default_rules(None) if r.name == "low_available")
    g = LoopGuard(quick_trips=2)
    g.note_launch(0)
    g.note_healthy(60, int(6.5 * GiB))
    assert g.record_trip(rule, 200) is None  # first quick trip: could be real
    g.note_launch(5000)
    assert g.record_trip(rule, 20000) is None  # hours after launch: not quick, streak resets
    g.note_launch(30000)
    assert g.record_trip(rule, 30100) is None
    g.note_launch(30200)
    v = g.record_trip(rule, 30300)
    assert v is not None and v.quick_trips == 2 and "2 trips in a row" in v.reason


def test_a_trip_whose_re_check_recovered_is_taken_back_and_does_not_count_toward_a_loop() -> None:
    """A recovered trip (nothing stopped) then the real one within 15 min of a launch: two quick trips convicted
    the rule ("stopping would loop") with nothing ever stopped (review helper-32)."""
    rule = next(r for r in default_rules(None) if r.name == "low_available")

    def guard() -> LoopGuard:
        g = LoopGuard(quick_trips=2)
        g.note_launch(0)
        g.note_healthy(60, int(6.5 * GiB))  # within the 1 GiB margin of the 6 GiB floor
        assert g.record_trip(rule, 200) is None
        return g

    g = guard()
    g.withdraw_trip(rule.name)  # its re-check found memory recovered
    assert g.record_trip(rule, 205) is None and g.trips[rule.name].trips == 1
    g = guard()  # not withdrawn: the second quick trip convicts, as before
    assert g.record_trip(rule, 205) is not None
    g.withdraw_trip("no_such_rule")  # nothing recorded: nothing changes


def test_rules_without_a_loop_floor_are_never_convicted() -> None:
    rule = next(r for r in default_rules(None) if r.name == "low_free_with_evidence")
    g = LoopGuard()
    g.note_launch(0)
    g.note_healthy(10, int(1.6 * GiB))
    assert g.record_trip(rule, 20) is None


def test_demote_copies() -> None:
    rules = default_rules(None)
    out = demote(rules, ["low_available"])
    assert [r.action for r in out] == ["warn", "stop", "stop", "stop"]
    assert [r.action for r in rules] == ["stop", "stop", "stop", "stop"]


def test_the_docs_example_config_fits_the_fixture_host() -> None:
    """docs/tuned-hosts.md's TOML, validated and checked against the fixture host: no warning."""
    import tomllib

    from tests.conftest import REPO

    text = (REPO / "docs" / "tuned-hosts.md").read_text()
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    cfg = tomllib.loads(block)
    total, avail, low, vm = fixture_state()
    cma = procfs.read_meminfo(PROC).fields["CmaFree"]
    rules = compile_rules([RuleConfig(**r) for r in cfg["rules"]], total)
    ws = check_floors(
        rules,
        healthy_mem_available_bytes=avail,
        low_watermark_bytes=low,
        min_free_kbytes=vm["min_free_kbytes"],
        watermark_scale_factor=vm["watermark_scale_factor"],
        healthy_cma_free_bytes=cma,
    )
    assert {w.problem for w in ws if w.severity == "warning"} <= {"at_watermark"}
    assert not [w for w in ws if w.problem in ("cannot_protect", "near_floor")]
    # and the loop guard leaves every rule armed
    g = LoopGuard()
    g.note_launch(0)
    g.note_healthy(120, avail, cma)
    assert all(g.record_trip(r, 130) is None for r in rules)


def test_a_low_healthy_reading_the_watermarks_do_not_explain_never_demotes_the_rule() -> None:
    # the model started by hand while something else holds the memory: ready at 2 GiB on a host
    # whose low watermarks are 0.08 GiB. That is memory taken, not a tuned host: keep stopping.
    rule = compile_rules([RuleConfig(name="low_available", when=["MemAvailable < 6GiB"])], None)[0]
    g = LoopGuard()
    for k in range(4):  # hand starts, each tripping right after
        g.note_launch(k * 100.0)
        g.note_healthy(k * 100.0 + 1, 2 * GiB, low_watermark_bytes=int(0.08 * GiB))
        assert g.record_trip(rule, k * 100.0 + 2) is None
    assert g.cannot_protect("low_available") is None


def test_a_tuned_hosts_reserve_explains_the_shortfall_and_convicts_at_the_first_trip() -> None:
    # the fixture host: healthy MemAvailable 1.60 GiB with 14.17 GiB of low watermarks (raised min_free_kbytes)
    rule = compile_rules([RuleConfig(name="low_available", when=["MemAvailable < 6GiB"])], None)[0]
    g = LoopGuard()
    g.note_launch(0.0)
    g.note_healthy(100.0, int(1.6 * GiB), low_watermark_bytes=int(14.17 * GiB))
    v = g.record_trip(rule, 101.0)
    assert v is not None and "cannot protect this host" in v.reason
    # the same reading with the watermarks unknown (no zoneinfo): counted as explained, as before
    g2 = LoopGuard()
    g2.note_launch(0.0)
    g2.note_healthy(100.0, int(1.6 * GiB))
    assert g2.record_trip(rule, 101.0) is not None


def test_a_shortfall_the_watermarks_do_not_explain_is_memory_taken_not_a_stop_loop() -> None:
    rules = compile_rules([RuleConfig(name="low_available", when=["MemAvailable < 6GiB"])], None)

    def problems(healthy: float, low_watermark: float | None) -> list[tuple[str, str]]:
        ws = check_floors(
            rules,
            healthy_mem_available_bytes=int(healthy * GiB),
            low_watermark_bytes=None if low_watermark is None else int(low_watermark * GiB),
            min_free_kbytes=None,
            watermark_scale_factor=None,
        )
        return [(w.problem, w.severity) for w in ws if w.problem != "at_watermark"]

    # 2 GiB at a healthy reading with 0.08 GiB of watermarks: something holds the memory
    assert problems(2.0, 0.08) == [("memory_taken", "warning")]
    # the tuned fixture host: 1.60 GiB with 14.17 GiB of watermarks: a stop would loop
    assert problems(1.6, 14.17) == [("cannot_protect", "warning")]
    # watermarks unknown: as before
    assert problems(2.0, None) == [("cannot_protect", "warning")]


def _tuned_host_verdict(g: LoopGuard, rule: Rule) -> None:
    """Run 1 on a tuned host: healthy at 1.6 GiB, below the 6 GiB floor, the watermarks unknown (explained)."""
    g.note_launch(0.0)
    g.note_healthy(100.0, int(1.6 * GiB))
    assert g.record_trip(rule, 101.0) is not None


def test_a_later_run_healthy_well_above_the_floor_rearms_the_rule() -> None:
    # the operator fixed the budget (a smaller GMU) and relaunched: ready with 12 GiB MemAvailable
    rule = compile_rules([RuleConfig(name="low_available", when=["MemAvailable < 6GiB"])], None)[0]
    g = LoopGuard()
    _tuned_host_verdict(g, rule)
    g.note_launch(500.0)
    g.note_healthy(600.0, 12 * GiB)
    (r,) = g.rearm([rule])
    got = (r.rule, r.t, r.floor_bytes, r.healthy_bytes, r.demoted_at)
    assert got == ("low_available", 600.0, 6 * GiB, 12 * GiB, 101.0)
    assert r.reason == (
        "rule low_available stops again: a run launched after it was demoted is healthy with MemAvailable "
        "12.00 GiB, 6.00 GiB above its floor 6.00 GiB (margin 1.00 GiB)"
    )
    assert r.details()["action"] == "re-armed"
    assert g.cannot_protect("low_available") is None and g.rearm([rule]) == []  # withdrawn once
    assert not g.status()["rules"]["low_available"]["cannot_protect"]
    # a trip now is a real collapse: no verdict, it stops
    assert g.record_trip(rule, 700.0) is None
    # and if a still later run is back below the floor, the rule is judged anew (convicted again)
    g.note_launch(800.0)
    g.note_healthy(900.0, int(1.6 * GiB))
    assert g.record_trip(rule, 901.0) is not None


def test_a_verdict_stands_without_a_new_run_or_with_too_little_room() -> None:
    rule = compile_rules([RuleConfig(name="low_available", when=["MemAvailable < 6GiB"])], None)[0]
    g = LoopGuard()
    _tuned_host_verdict(g, rule)
    # the same run reads higher later (a co-tenant left): the run that convicted it has not changed
    g.note_healthy(200.0, 12 * GiB)
    assert g.rearm([rule]) == []
    # a new run, healthy within the margin of the floor: stopping could still loop
    g.note_launch(500.0)
    g.note_healthy(600.0, int(6.5 * GiB))
    assert g.rearm([rule]) == []
    # a new run with room, but the rule is no longer configured: nothing to arm
    g.note_launch(700.0)
    g.note_healthy(800.0, 12 * GiB)
    assert g.rearm([]) == []
    assert g.cannot_protect("low_available") is not None
    # no healthy reading of the new run yet (launched, not ready): the old reading is not the new run's
    g.note_launch(900.0)
    assert g.rearm([rule]) == []


def test_the_daemon_rearms_a_demoted_rule_when_a_resized_run_has_room_and_says_so(tmp_path: Path) -> None:
    """Through the real daemon (its /proc is a file this test writes; the container side records stops):
    run 1 is ready below the floor, the trip is demoted and stops nothing; the operator resizes, run 2 is
    ready with room, a ``watermark`` event says the rule stops again; the next fall is stopped."""
    import asyncio

    from sparkd.config import load_settings
    from sparkd.loop.daemon import Daemon, MonitorOnly

    proc = tmp_path / "proc"
    proc.mkdir()
    low = "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 1677722 kB\n"  # 1.6 GiB
    high = "MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n"  # 12 GiB
    (proc / "meminfo").write_text(high)
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "proc_root": str(proc),
            "kernlog_source": "off",
            "api": {"enabled": False},
            "rules": [{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        }
    )

    class Recorder(MonitorOnly):
        def __init__(self) -> None:
            super().__init__()
            self.stops: list[str] = []

        async def on_stop(self, decision: Any) -> None:
            self.stops.append(decision.rule)

    async def run_ready(d: Daemon, meminfo: str, n: int) -> None:
        (proc / "meminfo").write_text(meminfo)
        assert d._tick_once() is not None
        d.event("launched", f"run {n}", details={"started_at": time.time()})
        d.event("ready", f"run {n} ready")  # the supervisor's healthy-and-idle reading

    async def fall(d: Daemon) -> None:
        (proc / "meminfo").write_text(low)
        for _ in range(2):
            r = d._tick_once()
            assert r is not None
            await d._handle(r)

    async def go() -> tuple[Recorder, Daemon]:
        actions = Recorder()
        d = Daemon(settings, actions=actions)
        await d.startup()
        assert d.guard is not None
        try:
            await run_ready(d, low, 1)
            await fall(d)
            assert actions.stops == [] and d.guard.engine.demoted  # demoted, nothing stopped
            assert next(r for r in d.guard.rules if r.name == "low_available").action == "warn"
            await run_ready(d, high, 2)  # resized: ready with 12 GiB
            assert d.guard.engine.demoted == {}
            assert next(r for r in d.guard.rules if r.name == "low_available").action == "stop"
            await fall(d)
            return actions, d
        finally:
            d.should_exit.set()
            await d.shutdown("test")

    actions, d = asyncio.run(go())
    assert actions.stops == ["low_available"]  # the fall after the resize is stopped
    marks = [(e["details"] or {}).get("action") for e in reversed(d.recent_events) if e["kind"] == "watermark"]
    assert marks[-2:] == ["demoted to warn", "re-armed"], marks
    rearmed = next(e for e in d.recent_events if (e["details"] or {}).get("action") == "re-armed")
    assert rearmed["message"].startswith("rule low_available stops again: a run launched after it was demoted")
    status = d.status_json()
    assert next(r for r in status.rules if r.name == "low_available").demoted is None


def test_a_model_adopted_at_start_withdraws_the_start_reading_so_its_first_trip_stops(tmp_path: Path) -> None:
    """sparkd restarted while a model ran at 5.5 GiB (below the 6 GiB rule): the start-up reading counted as
    healthy, the first trip convicted the rule ("cannot protect this host … demoted to warn") and the model ran
    on below the line (helper-31). A running model found at start (``adopted``) withdraws that reading: the trip
    stops it. Without a model (a tuned host, ``test_field_guard``) the start reading still convicts."""
    import asyncio

    from sparkd.config import load_settings
    from sparkd.loop.daemon import Daemon, MonitorOnly

    proc = tmp_path / "proc"
    proc.mkdir()
    short = "MemTotal: 16777216 kB\nMemFree: 3145728 kB\nMemAvailable: 5767168 kB\n"  # 5.5 GiB, no zoneinfo
    (proc / "meminfo").write_text(short)
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "proc_root": str(proc),
            "kernlog_source": "off",
            "api": {"enabled": False},
            "rules": [{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        }
    )

    class Recorder(MonitorOnly):
        def __init__(self) -> None:
            super().__init__()
            self.stops: list[str] = []

        async def on_stop(self, decision: Any) -> None:
            self.stops.append(decision.rule)

    async def go(adopt: bool) -> tuple[list[str], dict[str, str]]:
        actions = Recorder()
        d = Daemon(settings, actions=actions)
        await d.startup()
        assert d.guard is not None
        try:
            if adopt:  # the supervisor's first step finds the model running, and its first healthy probe
                d.event("adopted", "vllm adopted", details={"started_at": time.time() - 3600})
                # guard mode (or no launch record): `ready` a second later, of the same run under the same load
                d.event("ready", "vllm ready", details={"adopted": True})
            for _ in range(2):
                r = d._tick_once()
                assert r is not None
                await d._handle(r)
            return actions.stops, dict(d.guard.engine.demoted)
        finally:
            d.should_exit.set()
            await d.shutdown("test")

    assert asyncio.run(go(adopt=True)) == (["low_available"], {})  # stopped, not demoted
    stops, demoted = asyncio.run(go(adopt=False))
    assert stops == [] and "low_available" in demoted  # the tuned host without a model: as before
