"""The dashboard's events panel folds runs of one kind (note 19 §7, helper-44): a near miss every
10th gated sample while memory stays low (one every 2.5 s at 4 Hz) filled its 30 rows and pushed
the trip and the stop off the panel. Real store; the live endpoint's test is in test_api.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparkd.face import presenters as views
from sparkd.store.store import Store


def _ev(i: int, ts: float, kind: str = "near_miss", severity: str = "info") -> dict[str, Any]:
    return {"id": i, "ts": ts, "kind": kind, "severity": severity, "message": f"{kind} {i}"}


def test_info_runs_fold_over_a_minute_and_alarms_over_5_s_only() -> None:
    newest_first = [
        _ev(6, 130.0),  # near misses 10 s apart (1 Hz, every 10th sample): one row
        _ev(5, 120.0),
        _ev(4, 110.0),
        _ev(3, 100.0, "trip", "critical"),
        _ev(2, 90.0, "trip", "critical"),  # 10 s apart: two trips stay two rows
        _ev(1, 20.0),  # 70 s before the next near miss would be: its own row (and not past the trips)
    ]
    rows = views.group_bursts(newest_first)
    assert [(r["kind"], r["count"], r["ids"]) for r in rows] == [
        ("near_miss", 3, [6, 5, 4]),
        ("trip", 1, [3]),
        ("trip", 1, [2]),
        ("near_miss", 1, [1]),
    ]
    assert rows[0]["span_s"] == 20.0 and rows[0]["message"] == "near_miss 6"
    # a warning of the same kind is not folded into a run of info events
    mixed = views.group_bursts([_ev(2, 11.0, "x"), _ev(1, 10.0, "x", "warning")])
    assert [r["count"] for r in mixed] == [1, 1]
    # alarms 5 s apart or less still fold (an NVRM flood)
    flood = views.group_bursts([_ev(i, 100.0 - i, "nvrm_no_memory", "warning") for i in range(1, 26)])
    assert [(r["count"], r["span_s"]) for r in flood] == [(25, 24.0)]


def _store_with_storm(tmp_path: Path) -> Store:
    s = Store.open(tmp_path / "sparkd.db")
    s.add_event(kind="trip", message="low_available tripped", severity="critical", ts=1000.0)
    s.add_event(kind="stopped", message="vllm stopped", severity="critical", ts=1001.0)
    for i in range(60):  # ten minutes of near misses
        s.add_event(kind="near_miss", message=f"near miss {i}", ts=1002.0 + 10 * i)
    return s


def test_a_near_miss_storm_leaves_the_stop_on_the_dashboard(tmp_path: Path) -> None:
    s = _store_with_storm(tmp_path)
    rows = views.events_view(s, limit=30)
    assert [(r["kind"], r["count"]) for r in rows] == [("near_miss", 60), ("stopped", 1), ("trip", 1)]
    # before: the 30 newest near misses, one row each
    assert all(e["kind"] == "near_miss" for e in s.events(limit=30))


def test_rows_after_an_id_go_on_the_top_run_or_above_it(tmp_path: Path) -> None:
    s = _store_with_storm(tmp_path)
    top = views.events_view(s)[0]
    s.add_event(kind="near_miss", message="near miss 60", ts=1002.0 + 600)
    events, rows, replaces = views.event_rows_after(s, top["id"])
    assert [e["message"] for e in events] == ["near miss 60"]
    assert replaces == top["id"] and [(r["count"], r["message"]) for r in rows] == [(61, "near miss 60")]
    # a stop after it starts a row of its own: the top run stays as the page shows it
    newest = rows[0]["id"]
    s.add_event(kind="stopped", message="stopped again", severity="critical", ts=1002.0 + 601)
    events, rows, replaces = views.event_rows_after(s, newest)
    assert replaces is None and [(r["kind"], r["count"]) for r in rows] == [("stopped", 1)]
    assert views.event_rows_after(s, rows[0]["id"]) == ([], [], None)


def test_two_rules_tripping_in_one_tick_stay_two_rows() -> None:
    """Two critical trips 0 s apart folded into one row: the first rule's reason was off the dashboard (helper-49)."""
    ev = [
        {"id": 2, "ts": 100.0, "kind": "trip", "severity": "critical", "message": "low_usable: usable 1.2 GiB < 2 GiB"},
        {"id": 1, "ts": 100.0, "kind": "trip", "severity": "critical", "message": "psi_full: some avg10 80 > 40"},
    ]
    assert [r["count"] for r in views.group_bursts(ev)] == [1, 1]


def test_a_run_longer_than_a_read_still_leaves_the_trip_on_the_dashboard(tmp_path: Path) -> None:
    """300 near misses after a trip (12.5 min at 4 Hz) filled the one read of 300 events: one row, the trip and the
    stop nowhere (helper-49). Older pages are read until the rows are filled."""
    s = Store.open(tmp_path / "sparkd.db")
    s.add_event(kind="trip", message="low_available tripped", severity="critical", ts=1000.0)
    s.add_event(kind="stopped", message="vllm stopped", severity="critical", ts=1001.0)
    for i in range(700):
        s.add_event(kind="near_miss", message=f"near miss {i}", ts=1002.0 + 2.5 * i)
    rows = views.events_view(s, limit=30)
    assert [(r["kind"], r["count"]) for r in rows] == [("near_miss", 700), ("stopped", 1), ("trip", 1)]


def test_the_id_a_page_shows_up_to_is_its_highest_stored_one(tmp_path: Path) -> None:
    """A run topped by an event still in memory (id None), or events after a wall-clock step back (the newest by
    time is not the highest id): the next live update sent a run again (helper-49)."""
    s = Store.open(tmp_path / "sparkd.db")
    for i in range(20):
        s.add_event(kind="near_miss", message=f"near miss {i}", ts=1010.0 + 10 * i)
    unstored = {"id": None, "ts": 1210.0, "kind": "near_miss", "severity": "info", "message": "near miss 20"}
    page = views.group_bursts([unstored, *s.events(limit=100)])
    assert views.last_event_id(page) == 20  # was 0: every stored event came again
    s.add_event(kind="ready", message="vllm ready", ts=5000.0)  # id 21
    s.add_event(kind="trip", message="after the step back", severity="critical", ts=1401.0)  # id 22
    events, _rows, _ = views.event_rows_after(s, 20)
    assert views.last_event_id(events) == 22  # events[0] (newest by time) is id 21
    assert views.event_rows_after(s, views.last_event_id(events)) == ([], [], None)


def test_a_near_miss_event_says_which_near_miss_it_is_and_that_1_in_10_is_logged() -> None:
    """The rule card read "near misses 302" beside "25 ×" in the log, and neither said why: every near miss is
    counted in the rule's state, one in ``NEAR_MISS_EVERY`` is an event. The event says its number and that."""
    from types import SimpleNamespace

    from sparkd.core.rules import Decision, RuleState
    from sparkd.loop.daemon_decide import NEAR_MISS_EVERY, decide_quietly

    state = RuleState()
    said: list[tuple[str, str, dict[str, Any]]] = []
    daemon = SimpleNamespace(
        guard=SimpleNamespace(states={"gated": state}),
        event=lambda kind, msg, severity="info", details=None: said.append((kind, msg, details or {})),
    )
    d = Decision("gated", "near_miss", "stop", "gated: near miss (suppressed, not counted): MemFree 1.30 GiB", 0, 3)
    for _ in range(2 * NEAR_MISS_EVERY + 1):
        state.near_misses += 1  # the engine counts it before the daemon records it
        assert decide_quietly(daemon, d) is True  # type: ignore[arg-type]
    assert [det["near_misses"] for _, _, det in said] == [1, NEAR_MISS_EVERY + 1, 2 * NEAR_MISS_EVERY + 1]
    assert said[1][1] == (
        "gated: near miss (suppressed, not counted): MemFree 1.30 GiB (this rule's near misses since sparkd "
        f"started: {NEAR_MISS_EVERY + 1}; 1 in {NEAR_MISS_EVERY} is logged)"
    )


def test_a_long_event_kind_may_break_after_its_underscores_and_is_escaped() -> None:
    """The kind column cut ``config_changed_not_applied`` to ``config_changed_not_…`` (note 21): the whole kind is
    there, breakable after each underscore, and its full text in the title."""
    from sparkd.face.web import templates

    kind = "config_changed_not_applied"
    row = {"id": 1, "ts": 1e9, "severity": "warning", "kind": kind, "message": "m"}
    html = templates().env.get_template("partials/_event_rows.html").render(events=[row])
    assert f'<span class="kind" title="{kind}">config_<wbr>changed_<wbr>not_<wbr>applied</span>' in html
    assert str(templates().env.filters["breakable"]("a<b>_c")) == "a&lt;b&gt;_<wbr>c"


def test_a_warn_rules_card_counting_is_amber_never_the_red_of_a_stop() -> None:
    """A warn rule counting turned its card red like a stop rule's, beside its amber chart line (helper-55)."""
    from sparkd.face.presenters import rules_from_status
    from sparkd.loop.status import RuleStatus, Status

    def card(action: str, counter: int) -> str:
        rule = RuleStatus.model_construct(
            name="r",
            kind="threshold",
            action=action,
            counter=counter,
            samples=2,
            for_s=None,
            held_s=None,
            in_last_s=None,
            near_misses=0,
            trips=0,
            idle_trips=0,
            holds=True,
            when=["MemAvailable < 80GiB"],
            evidence=[],
            last_reason=None,
            blind=None,
            thresholds=[],
            floor_bytes=None,
            demoted=None,
        )
        st = Status.model_construct(rules=[rule])
        return str(rules_from_status(st)[0]["level"])

    assert card("stop", 1) == "critical" and card("warn", 1) == "warn" and card("warn", 2) == "warn"
