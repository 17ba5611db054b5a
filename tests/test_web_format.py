"""The dashboard's formatting of values recorded at a trip (stopped card, incident page)."""

from __future__ import annotations

from sparkd.face.web import _fmt_tripval, _trip_label
from sparkd.units import GiB, MiB


def test_trip_values_are_shown_in_their_units() -> None:
    assert _fmt_tripval(4 * GiB, "MemAvailable") == "4.00 GiB"
    assert _fmt_tripval(-GiB // 2, "mem_available_slope_bytes_per_s") == "-0.50 GiB/s"
    assert _fmt_tripval(2.25, "for_s") == "2.2 s"
    # an epoch timestamp is a time, not 1.67 "GiB"
    assert _fmt_tripval(1796091866.7, "sample_ts") == "2026-12-01 02:24:26 UTC"
    # who grew: each share in GiB, in the recorded order
    shares = {"container": 2 * GiB, "host": 512 * MiB, "system": 0}
    assert _fmt_tripval(shares, "fall_shares_bytes") == "container 2.00 GiB · host 0.50 GiB · system 0.00 GiB"
    assert _fmt_tripval(None, "MemFree") == "n/a"
    assert _fmt_tripval({}, "fall_shares_bytes") == "–"


def test_trip_rows_are_labelled_for_people() -> None:
    assert _trip_label("MemAvailable") == "MemAvailable at the trip"
    assert _trip_label("sample_ts") == "sample taken"
    assert _trip_label("fall_shares_bytes") == "who grew (since the fall began)"
    # a predictive trip's projection: words, not its keys (an operator's walk-through)
    assert [_trip_label(k) for k in ("slope_bytes_per_s", "eta_s", "fit_window_s")] == [
        "fall rate (robust fit)",
        "projected time to the floor",
        "fit window",
    ]
    # below the floor already: the stopped card read "projected time to the floor -0.2 s" beside the reason's words
    assert [_fmt_tripval(v, "eta_s") for v in (-0.2, 0.0, 0.04, 2.46)] == [
        "at or below the floor already",
        "at or below the floor already",
        "at or below the floor already",
        "2.5 s",
    ]


def test_the_headline_names_a_demoted_stop_rule_over_a_plain_warn_not_over_critical() -> None:
    """The loop guard demoted low_available and memory sat near collapse_projected's line ("warn"): the headline
    read "warn · 0.5 GiB to collapse_projected" and never named the rule that no longer stops (helper-31)."""
    from sparkd.face.presenters import headline

    rules = [
        {"name": "low_available", "action": "warn", "demoted": "cannot protect this host"},
        {"name": "collapse_projected", "action": "stop", "demoted": None},
    ]

    def at(level: str) -> dict[str, object]:
        ns = {"level": level, "rule": "collapse_projected", "headroom_bytes": GiB // 2}
        return headline({"nearest_stop": ns, "sample": {"ts": 1.0}, "rules": rules, "container": {}}, None)

    for level in ("ok", "warn"):
        h = at(level)
        assert (h["level"], h["label"]) == ("warn", "low_available demoted to warn (cannot protect this host)"), h
    assert (at("critical")["level"], at("critical")["label"]) == ("critical", "critical")  # the nearer danger first


def test_a_short_duration_keeps_its_tenths_and_the_restart_confirmation_says_the_ready_events_figure() -> None:
    """The restart confirmation read "the last launch took 0 s to become ready" against the ``ready`` event's 1.5 s
    (helper-35): the figure was cut to whole seconds, and measured from Docker's start of the container rather than
    the launch's start. Below 10 s a duration keeps its tenths; the figure is ``container.time_to_ready_s``."""
    from sparkd.face.presenters import buttons_view
    from sparkd.face.web import _fmt_duration

    assert [_fmt_duration(s) for s in (0.44, 1.5, 5.0, 9.96, 16.7, 90, 300, None)] == [
        "0.4 s",
        "1.5 s",
        "5 s",
        "10 s",
        "16 s",
        "90 s",
        "5 min",
        "–",
    ]
    c = {"mode": "managed", "state": "ready", "started_at": 100.9, "ready_at": 101.3, "time_to_ready_s": 1.5}
    assert buttons_view({"container": c}, True)["last_ready_s"] == 1.5
    old = {k: v for k, v in c.items() if k != "time_to_ready_s"}  # a snapshot written before the field
    assert buttons_view({"container": old}, True)["last_ready_s"] == 101.3 - 100.9


def test_the_tab_title_says_below_a_line_not_a_negative_distance_to_it() -> None:
    """A dry run below low_available's line: the tab read "sparkd · critical · -4.0 GiB to low_available"
    (helper-39)."""
    from sparkd.face.live import title_of

    def h(headroom_gib: float) -> dict[str, object]:
        ns = {"headroom_bytes": int(headroom_gib * GiB), "rule": "low_available"}
        return {"label": "critical", "nearest": ns, "stopped": False}

    assert title_of(h(-4.0)) == "sparkd · critical · 4.0 GiB below low_available"
    assert title_of(h(2.5)) == "sparkd · critical · 2.5 GiB to low_available"
