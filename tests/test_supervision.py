"""Pure supervision decisions (core.supervision): back-off, breaker, relaunch, probe, intents, heartbeat,
alert collapse. Times are plain numbers; nothing here reads a clock."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from sparkd.core.supervision import (
    BackoffPolicy,
    BackoffState,
    Breaker,
    BreakerPolicy,
    Collapse,
    HeartbeatFigures,
    IntentRecord,
    ProbePolicy,
    StopIntent,
    after_end,
    after_stable,
    backoff_delay_s,
    boot_reset,
    breaker_alert_due,
    breaker_count,
    decide_relaunch,
    guard_candidates,
    heartbeat_due,
    heartbeat_message,
    judge_completion,
    maintenance_expired,
    parse_schedule,
    probe_outcome,
    probe_skip_reason,
    rearm,
    record_emergency,
    schedule_due,
)

P = BackoffPolicy()  # 30 s doubling to 900 s


@pytest.mark.parametrize(
    ("failures", "delay_s"),
    [
        (0, 0.0),
        (-1, 0.0),
        (1, 30.0),
        (2, 60.0),
        (3, 120.0),
        (4, 240.0),
        (5, 480.0),
        (6, 900.0),
        (40, 900.0),
        (10**6, 900.0),
    ],
)
def test_it_doubles_the_back_off_from_30_s_to_the_15_min_cap(failures: int, delay_s: float) -> None:
    assert backoff_delay_s(P, failures) == delay_s


def test_it_counts_failures_and_resets_after_a_stable_run() -> None:
    st = BackoffState()
    st = after_end(P, st, uptime_s=5, reached_ready=True)
    st = after_end(P, st, uptime_s=5, reached_ready=True)
    assert st == BackoffState(failures=2, failed_launches=0)
    # a run of stable_uptime_s starts the count again: this end is failure 1
    assert after_end(P, st, uptime_s=600, reached_ready=True) == BackoffState(1, 0)
    # unknown uptime is not stable
    assert after_end(P, st, uptime_s=None, reached_ready=True).failures == 3
    # while running: reset only once stable
    assert after_stable(P, st, 599.9) == st and after_stable(P, st, 600) == BackoffState()


def test_it_counts_failed_launches_until_one_reaches_ready() -> None:
    st = BackoffState()
    for _ in range(3):
        st = after_end(P, st, uptime_s=1, reached_ready=False)
    assert st.failed_launches == 3
    assert after_end(P, st, uptime_s=1, reached_ready=True).failed_launches == 0


def R(
    intent: StopIntent | None,
    *,
    failures: int = 1,
    failed: int = 0,
    breaker: bool = False,
    auto: bool = True,
    guarded: bool = False,
) -> Any:
    return decide_relaunch(
        P, BackoffState(failures, failed), intent=intent, breaker_open=breaker, auto_restart=auto, guarded=guarded
    )


@pytest.mark.parametrize(
    ("kw", "action", "delay_s", "alert", "says"),
    [
        ({"intent": StopIntent.OPERATOR}, "hold", 0, False, "intent operator"),
        ({"intent": StopIntent.MAINTENANCE}, "hold", 0, False, "intent maintenance"),
        ({"intent": StopIntent.PEER_EMERGENCY}, "hold", 0, False, "intent peer_emergency"),
        ({"intent": StopIntent.EMERGENCY, "breaker": True}, "hold", 0, False, "breaker open"),
        ({"intent": StopIntent.EXITED, "auto": False}, "hold", 0, False, "auto_restart is off"),
        ({"intent": StopIntent.FAILED_LAUNCH, "failed": 3, "failures": 3}, "hold", 0, True, "3 consecutive failed"),
        ({"intent": StopIntent.FAILED_LAUNCH, "failed": 2, "failures": 2}, "relaunch", 60, False, "failed_launch"),
        ({"intent": StopIntent.EXITED, "failures": 1}, "relaunch", 30, False, "intent exited"),
        ({"intent": StopIntent.EMERGENCY, "failures": 3}, "relaunch", 120, False, "intent emergency"),
        # the operator's hold beats everything, even an open breaker
        ({"intent": StopIntent.OPERATOR, "breaker": True}, "hold", 0, False, "intent operator"),
        # guard mode: not "container.auto_restart is off", as if turning it on would relaunch it (helper-39)
        ({"intent": StopIntent.EMERGENCY, "auto": False, "guarded": True}, "hold", 0, False, "guard mode, sparkd"),
        ({"intent": StopIntent.EXITED, "failed": 5, "guarded": True}, "hold", 0, False, "never starts the container"),
    ],
)
def test_it_decides_relaunch_and_names_the_intent(
    kw: dict[str, Any], action: str, delay_s: float, alert: bool, says: str
) -> None:
    d = R(**kw)
    assert (d.action, d.delay_s, d.alert) == (action, delay_s, alert)
    assert says in d.reason and d.intent == kw["intent"]


BP = BreakerPolicy()  # 3 in 7200 s


def test_it_opens_the_breaker_at_three_emergencies_in_two_hours() -> None:
    b = Breaker()
    b, opened = record_emergency(BP, b, now=0, key="a")
    b, opened2 = record_emergency(BP, b, now=100, key="b")
    assert not (opened or opened2 or b.is_open)
    b, opened = record_emergency(BP, b, now=7000, key="c")
    assert opened and b.is_open and b.open_since == 7000 and breaker_count(BP, b, 7000) == 3


def test_it_forgets_emergencies_older_than_the_window() -> None:
    b = Breaker()
    for t, k in ((0, "a"), (100, "b"), (7200, "c")):  # "a" is exactly 2 h old at the third
        b, opened = record_emergency(BP, b, now=t, key=k)
    assert not opened and not b.is_open and [k for _, k in b.emergencies] == ["b", "c"]


def test_it_counts_one_emergency_once_however_many_paths_report_it() -> None:
    b = Breaker()
    for _ in range(5):  # the rule, the hard floor and the probe all report launch "L1"
        b, _ = record_emergency(BP, b, now=10, key="L1")
    assert len(b.emergencies) == 1 and not b.is_open


def test_it_stays_open_until_rearmed_and_records_who() -> None:
    b = Breaker()
    for i in range(4):
        b, _ = record_emergency(BP, b, now=i, key=str(i))
    assert b.is_open and b.open_since == 2  # a fourth does not move the opening time
    r = rearm(b, who="token:api", now=50)
    assert not r.is_open and r.emergencies == () and (r.rearmed_by, r.rearmed_at) == ("token:api", 50)
    with pytest.raises(ValueError, match="who"):
        rearm(b, who=" ", now=50)


def test_it_repeats_the_breaker_alert_every_30_min() -> None:
    b = Breaker(open_since=0)
    assert breaker_alert_due(BP, b, 0)  # at once
    b = Breaker(open_since=0, last_alert_at=0)
    assert not breaker_alert_due(BP, b, 1799.9) and breaker_alert_due(BP, b, 1800)
    assert not breaker_alert_due(BP, Breaker(), 10**6)  # closed: never


@pytest.mark.parametrize(
    ("reset_on_boot", "uptime_s", "stays_open"), [(False, 10, True), (True, 10, False), (True, 300, True)]
)
def test_it_resets_on_boot_only_when_asked_and_just_booted(
    reset_on_boot: bool, uptime_s: float, stays_open: bool
) -> None:
    p = BreakerPolicy(reset_on_boot=reset_on_boot)
    b = boot_reset(p, Breaker(open_since=1, emergencies=((1, "x"),)), host_uptime_s=uptime_s, now=5)
    assert b.is_open is stays_open
    if not stays_open:
        assert b.rearmed_by == "host boot"


def test_it_round_trips_the_breaker_and_the_intent_through_json() -> None:
    b = Breaker(emergencies=((1.5, "a"),), open_since=2.0, last_alert_at=3.0)
    assert Breaker.from_json(b.to_json()) == b
    rec = IntentRecord(StopIntent.OPERATOR, 10.0, "cli", "stop requested")
    assert IntentRecord.from_json(rec.to_json()) == rec


GOOD = {"choices": [{"text": " x", "finish_reason": "length"}], "usage": {"completion_tokens": 16}}


@pytest.mark.parametrize(
    ("code", "body", "ok", "error"),
    [
        (200, GOOD, True, None),
        (
            200,
            {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 0}},
            False,
            "completion_tokens is 0",
        ),
        (
            200,
            {"choices": [{"text": "x", "finish_reason": None}], "usage": {"completion_tokens": 3}},
            False,
            "no finish_reason",
        ),
        (200, {"choices": [], "usage": {"completion_tokens": 3}}, False, "no finish_reason"),
        (200, {"choices": [{"finish_reason": "stop"}]}, False, "completion_tokens is None"),
        (
            200,
            {"choices": [{"finish_reason": "stop"}], "usage": {"completion_tokens": True}},
            False,
            "completion_tokens is True",
        ),
        (200, [1, 2], False, "not a JSON object"),
        (500, GOOD, False, "HTTP 500"),
        (None, None, False, "no answer"),
    ],
)
def test_it_judges_completions(code: int | None, body: Any, ok: bool, error: str | None) -> None:
    v = judge_completion(code, body)
    assert v.ok is ok
    assert (error is None and v.error is None) or (error is not None and v.error is not None and error in v.error)


PP = ProbePolicy(interval_s=60, failures=5, adopt_grace_s=300)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({}, None),
        ({"ready": False}, "not ready"),
        ({"startup_phase": "graph_capture"}, "start-up phase graph_capture"),
        ({"startup_phase": "ready"}, None),
        ({"requests_waiting": 2.0}, "2 requests waiting"),
        ({"adopted_at_s": 900.0}, "adoption grace"),
        ({"adopted_at_s": 700.0}, None),
        ({"last_probe_s": 950.0}, "not due"),
        ({"last_probe_s": 940.0}, None),
    ],
)
def test_it_skips_probes_when_they_would_mislead(kw: dict[str, Any], why: str | None) -> None:
    args: dict[str, Any] = {
        "now_s": 1000.0,
        "last_probe_s": None,
        "ready": True,
        "startup_phase": None,
        "requests_waiting": 0.0,
        "adopted_at_s": None,
    } | kw
    assert probe_skip_reason(PP, **args) == why


@pytest.mark.parametrize(
    ("failures", "health_ok", "outcome"),
    [
        (0, True, "ok"),
        (1, False, "failing"),
        (4, False, "failing"),
        (5, True, "congestion"),
        (5, False, "emergency"),
        (9, False, "emergency"),
    ],
)
def test_it_calls_five_failures_congestion_or_emergency_by_health(failures: int, health_ok: bool, outcome: str) -> None:
    assert probe_outcome(PP, failures, health_ok=health_ok) == outcome


def test_it_expires_a_maintenance_intent_once_after_two_hours() -> None:
    m = IntentRecord(StopIntent.MAINTENANCE, 0.0, "cli", "drain")
    assert not maintenance_expired(m, now=7199, max_s=7200)
    assert maintenance_expired(m, now=7200, max_s=7200)
    assert not maintenance_expired(IntentRecord(StopIntent.MAINTENANCE, 0.0, "cli", "d", True), now=9000, max_s=7200)
    assert not maintenance_expired(IntentRecord(StopIntent.OPERATOR, 0.0, "cli", "d"), now=9000, max_s=7200)
    assert not maintenance_expired(None, now=9000, max_s=7200)


def test_it_writes_a_heartbeat_with_every_figure() -> None:
    f = HeartbeatFigures(
        uptime_s=3 * 86400 + 4 * 3600,
        restarts_24h=1,
        breaker_open=False,
        breaker_count=0,
        min_mem_available_bytes=int(12.3 * 2**30),
        state_dir_bytes=int(1.5 * 2**30),
        container_state="ready",
    )
    msg = heartbeat_message(f)
    for part in ("up 3d 4h", "container ready", "1 restarts in 24 h", "breaker closed", "12.3 GiB", "1.50 GiB"):
        assert part in msg
    assert "unknown" in heartbeat_message(HeartbeatFigures(60, 0, True, 3, None, 0, "stopped", "emergency"))
    assert heartbeat_due(None, now=0, interval_s=86400) and not heartbeat_due(0, now=86399, interval_s=86400)
    assert heartbeat_due(0, now=86400, interval_s=86400)
    # the wall clock stepped back a day after a heartbeat: due now, not ~48 h after it (helper-43); NTP's small slews
    # (a last heartbeat seconds "ahead") are not a step
    assert heartbeat_due(86400, now=0, interval_s=86400) and not heartbeat_due(100, now=0, interval_s=86400)


def test_it_collapses_identical_alerts_and_counts_only_delivered_ones() -> None:
    c = Collapse(window_s=900)
    k = ("breaker_open", "circuit breaker open")
    assert c.admit(k, 0)
    assert not c.admit(k, 1)  # in flight: collapsed
    c.done(k, 2, ok=False)  # failed: not counted as sent
    assert c.admit(k, 3)  # so the next copy goes out
    assert c.pending(k) == 1  # and reports the collapsed one
    c.done(k, 4, ok=True, reported=1)
    assert c.pending(k) == 0
    assert not c.admit(k, 903) and c.admit(k, 904)  # one per 900 s from the delivery
    assert c.admit(("breaker_open", "another message"), 905)  # a different message is not identical


@pytest.mark.parametrize(
    ("text", "spec"), [("Sun 04:00", (6, 4, 0)), ("daily 23:59", (None, 23, 59)), ("monday 00:30", (0, 0, 30))]
)
def test_it_parses_a_schedule(text: str, spec: tuple[int | None, int, int]) -> None:
    assert parse_schedule(text) == spec


@pytest.mark.parametrize("text", ["Sunday", "Sun 25:00", "Sun 4", "often 04:00", "Sun 04:60"])
def test_it_refuses_a_bad_schedule_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="maintenance_schedule"):
        parse_schedule(text)


SUN_4 = (6, 4, 0)


@pytest.mark.parametrize(
    ("last_run", "now", "due"),
    [
        (None, datetime(2026, 11, 29, 4, 30), True),  # Sunday 04:30, never ran: inside the hour
        (None, datetime(2026, 11, 30, 4, 30), False),  # Monday: Sunday's window is not run late
        (None, datetime(2026, 11, 29, 3, 59), False),  # not yet
        (datetime(2026, 11, 29, 4, 1), datetime(2026, 11, 29, 5, 30), False),  # ran this week
        (datetime(2026, 11, 29, 4, 1), datetime(2026, 12, 6, 4, 0), True),  # next Sunday
    ],
)
def test_it_knows_when_the_schedule_is_due(last_run: datetime | None, now: datetime, due: bool) -> None:
    assert schedule_due(SUN_4, last_run=last_run, now=now) is due


@pytest.mark.parametrize(
    ("source", "intent"),
    [
        ("rule low_available", StopIntent.EMERGENCY),
        ("probe", StopIntent.EMERGENCY),
        ("peer:spark-b", StopIntent.PEER_EMERGENCY),
        ("maintenance by api:token", StopIntent.MAINTENANCE),
        ("sparkd (failed launch)", StopIntent.FAILED_LAUNCH),
        ("api:token", StopIntent.OPERATOR),
        ("cli", StopIntent.OPERATOR),
    ],
)
def test_it_names_the_intent_of_a_stop_by_who_asked(source: str, intent: StopIntent) -> None:
    from sparkd.loop.unattended import Unattended

    assert Unattended.intent_for(source) is intent


@pytest.mark.parametrize(
    ("source", "incident"),
    [
        ("rule low_available", True),
        ("rule hard_floor", True),
        ("probe", True),
        ("peer:spark-b", True),
        ("sparkd (failed launch)", True),
        ("sparkd (GPU lost)", True),
        ("sparkd", True),  # a rollback from a resize that did not reach ready; an exit's postmortem before 0.2
        # an exit nobody of sparkd's asked for (RunBook.handle_exit's postmortem; it read "sparkd": helper-37)
        ("nobody: the container exited on its own, or was stopped outside sparkd", True),
        ("alertmanager", True),  # face.alertmanager: an alert's stop (an operator's intent, an incident's archive)
        ("maintenance by api:token", False),
        ("api:token", False),
        ("web:session", False),
        ("cli", False),
        ("daemon", False),  # sparkd's own exit (stop_on_exit)
        ("auto-relaunch (intent emergency, back-off 30 s)", False),
    ],
)
def test_it_tells_an_incident_by_who_asked_for_the_stop(source: str, incident: bool) -> None:
    from sparkd.core.supervision import is_incident

    assert is_incident(source) is incident


def test_a_rules_stop_intent_names_the_rule_once() -> None:
    """The intent read "stop intent emergency (rule repeated_dips: repeated_dips: usable …)" (helper-35): a trip's
    reason begins with the rule's name. Other sources' reasons are kept whole."""
    from sparkd.core.supervision import IntentRecord, StopIntent, intent_text

    reason = "repeated_dips: usable 0.50 GiB < 3.00 GiB held 3 s in the last 10 s"
    assert intent_text(StopIntent.EMERGENCY, "rule repeated_dips", reason) == (
        "stop intent emergency (rule repeated_dips: usable 0.50 GiB < 3.00 GiB held 3 s in the last 10 s)"
    )
    assert IntentRecord(StopIntent.EMERGENCY, 0.0, "rule repeated_dips", reason).describe() == intent_text(
        StopIntent.EMERGENCY, "rule repeated_dips", reason
    )
    # another rule's name at the start of the reason, and an operator's reason, are not cut
    assert intent_text(StopIntent.EMERGENCY, "rule low_available", reason).endswith(f"(rule low_available: {reason})")
    assert intent_text(StopIntent.OPERATOR, "api:cli", "low_available: x") == (
        "stop intent operator (api:cli: low_available: x)"
    )


RUNNING = [
    ("a" * 64, "open-webui", "ghcr.io/open-webui/open-webui:main"),
    ("b" * 64, "llm-vllm-1", "nvcr.io/nvidia/vllm:25.09-py3"),  # docker compose: project llm, service vllm
    ("c" * 64, "vlm", "busybox"),
    ("d" * 64, "qwen-server", "vllm/vllm-openai:v0.11.0"),
    ("e" * 64, "/postgres", "postgres:16"),
]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # compose's <project>-<service>-1 holds the service's name; a typo is close; then any vLLM image
        (
            "vllm",
            ["llm-vllm-1 (nvcr.io/nvidia/vllm:25.09-py3)", "vlm (busybox)", "qwen-server (vllm/vllm-openai:v0.11.0)"],
        ),
        # case aside; "vlm" is close to "vllm-1" too (ratio 0.67)
        (
            "VLLM-1",
            ["llm-vllm-1 (nvcr.io/nvidia/vllm:25.09-py3)", "vlm (busybox)", "qwen-server (vllm/vllm-openai:v0.11.0)"],
        ),
        (
            "postgre",
            [
                "postgres (postgres:16)",
                "llm-vllm-1 (nvcr.io/nvidia/vllm:25.09-py3)",
                "qwen-server (vllm/vllm-openai:v0.11.0)",
            ],
        ),
        # an id (container.guard takes one): its letters match nothing; the vLLM images alone
        ("0123456789ab", ["llm-vllm-1 (nvcr.io/nvidia/vllm:25.09-py3)", "qwen-server (vllm/vllm-openai:v0.11.0)"]),
    ],
)
def test_guard_candidates_name_the_running_containers_that_may_be_the_model_meant(
    name: str, expected: list[str]
) -> None:
    assert guard_candidates(name, RUNNING) == expected


def test_guard_candidates_name_nothing_unlike_the_model_and_at_most_three() -> None:
    assert guard_candidates("vllm", [("a" * 64, "open-webui", "ghcr.io/open-webui/open-webui:main")]) == []
    many = [(str(i) * 12, f"vllm-{i}", "img") for i in range(5)]
    assert guard_candidates("vllm", many) == [f"vllm-{i} (img)" for i in range(3)]


def test_guard_candidates_rank_compose_naming_of_the_service_first() -> None:
    """``h44-vllm`` sorted before compose's ``h44proj-vllm-1`` (both hold "vllm"; helper-44)."""
    running = [("a" * 64, "h44-vllm", "img"), ("b" * 64, "h44proj-vllm-1", "img"), ("c" * 64, "old_vllm_2", "img")]
    assert guard_candidates("vllm", running) == ["h44proj-vllm-1 (img)", "old_vllm_2 (img)", "h44-vllm (img)"]
