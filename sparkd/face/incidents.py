"""Incidents: one per stop of the container, read back from the event log. Blocking (SQLite,
tar reads): call from a worker thread.

An incident's id is the id of its ``stopped``/``killed`` event (``sparkd.act.stop`` step 7,
whose details are the ``StopReport``: reason, source, outcome, exit code, OOMKilled, step
durations, /dev/shm decisions, archive name). The rule's ``trip`` event is the newest one
for that rule at most ``TRIP_LOOKBACK_S`` before the stop.

Shapes (all sizes bytes, times UTC epoch s):

* ``last_stop(store) -> dict | None`` — the newest incident's summary (what the stopped card shows);
* ``incident(store, id, archive_dir, with_logs) -> dict`` — the whole page (``/incidents/<id>.json``).

Raises:
    NotFound: no stop event with that id.
"""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkd.errors import NotFound

if TYPE_CHECKING:
    from sparkd.store.store import Store

STOP_KINDS = ("stopped", "killed")
KERNEL_KINDS = ("nvrm_no_memory", "nvrm_other", "oom_invoked", "oom_kill", "oom_killed")
TRIP_LOOKBACK_S = 120.0  # a stop follows its trip within the archive + grace time (30 s) and then some
WINDOW_BEFORE_S = 120.0  # samples and events shown before the trip
WINDOW_AFTER_S = 30.0  # ... and after the stop finished
LOG_TAIL_LINES = 40


#: events that tie this node's stop to a peer's (loop/cluster.py)
PEER_KINDS = ("peer_stop_sent", "peer_unreachable", "peer_stop_requested")


def by_guard(stop: dict[str, Any]) -> bool:
    """A stop the guard decided (a rule, the hard floor, a driver-error action), not an operator's."""
    d = stop.get("details") or {}
    src = str(d.get("source") or "")
    return src.startswith("rule ") or bool(d.get("hard_floor_kill"))


def _rule_of(stop: dict[str, Any]) -> str | None:
    src = str((stop.get("details") or {}).get("source") or "")
    return src.removeprefix("rule ") if src.startswith("rule ") else None


def _trip_for(store: Store, stop: dict[str, Any]) -> dict[str, Any] | None:
    rule = _rule_of(stop)
    if rule is None:
        return None
    for e in store.events(since=stop["ts"] - TRIP_LOOKBACK_S, kinds=["trip"], limit=50):
        if e["ts"] <= stop["ts"] and (e.get("details") or {}).get("rule") == rule:
            return e
    return None


def stop_for(store: Store, trip: dict[str, Any]) -> dict[str, Any] | None:
    """The stop a ``trip`` event led to (the incident's id is that stop's): the first ``stopped``/``killed`` event
    of the same rule within ``TRIP_LOOKBACK_S`` after it, or None (a warn rule, a stop refused or not yet made).
    The inverse of ``_trip_for``: the Events page links a trip row to its incident (note 10, B7)."""
    rule = (trip.get("details") or {}).get("rule")
    if not rule:
        return None
    stops = store.events(since=trip["ts"], until=trip["ts"] + TRIP_LOOKBACK_S, kinds=list(STOP_KINDS), limit=50)
    for e in sorted(stops, key=lambda e: (e["ts"], e["id"])):
        if _rule_of(e) == rule:
            return e
    return None


def _stop_event(store: Store, incident_id: int) -> dict[str, Any]:
    ev = store.event(incident_id)
    if ev is None or ev["kind"] not in STOP_KINDS:
        raise NotFound(f"incident {incident_id}: no stop event with that id")
    return ev


def summary(store: Store, stop: dict[str, Any]) -> dict[str, Any]:
    """The stopped card's figures for one stop event."""
    d = stop.get("details") or {}
    trip = _trip_for(store, stop)
    tripd = (trip or {}).get("details") or {}
    values = {k: v for k, v in tripd.items() if k not in ("rule", "action", "count", "stop_lines")}
    durations = d.get("durations_s") or {}
    return {
        "id": stop["id"],
        "url": f"/incidents/{stop['id']}",
        "kind": stop["kind"],
        "ts": stop["ts"],
        "by_guard": by_guard(stop),
        "rule": _rule_of(stop) or ("hard floor" if d.get("hard_floor_kill") else None),
        "source": d.get("source"),
        "reason": d.get("reason"),
        "trip_ts": (trip or {}).get("ts"),
        "trip_reason": (trip or {}).get("message"),
        "values": values,
        # the tripped rule's stop lines as configured then (trips recorded before 0.2 have none)
        "stop_lines": tripd.get("stop_lines") or [],
        "exit_code": d.get("exit_code"),
        "oom_killed": d.get("oom_killed"),
        "outcome": d.get("outcome"),
        "hard_floor_kill": bool(d.get("hard_floor_kill")),
        "stop_s": durations.get("total"),
        "durations_s": durations,
        "archive": d.get("archive"),
        "archive_url": f"/api/archives/{d['archive']}" if d.get("archive") else None,
        "launch_id": stop.get("launch_id"),
        "errors": d.get("errors") or [],
    }


def last_stop(store: Store | None) -> dict[str, Any] | None:
    """The newest stop's summary, or None when nothing was ever stopped."""
    if store is None:
        return None
    rows = store.events(kinds=STOP_KINDS, limit=1)
    return summary(store, rows[0]) if rows else None


def _log_tail(archive_dir: str | Path, name: str | None, lines: int = LOG_TAIL_LINES) -> list[str] | None:
    """The last ``lines`` of ``container.log`` in the bundle; None without a readable bundle."""
    if not name:
        return None
    from sparkd.act.archive import safe_archive_path

    try:
        path = safe_archive_path(archive_dir, name)
        with tarfile.open(path) as tf:
            f = tf.extractfile("container.log")
            if f is None:
                return None
            # the part is capped at write time (archive.DEFAULT_MAX_PART_BYTES); read its tail only
            data = f.read()[-256 * 1024 :]
    except (OSError, KeyError, tarfile.TarError, NotFound):
        return None
    return data.decode(errors="replace").splitlines()[-lines:]


def incident(store: Store, incident_id: int, archive_dir: str | Path, *, with_logs: bool) -> dict[str, Any]:
    """Everything the incident page shows. ``with_logs``: include the container's last log lines
    (they come from the postmortem bundle, which needs the token or a session).

    Raises:
        NotFound: ``incident_id`` is not a stop event.
    """
    stop = _stop_event(store, incident_id)
    s = summary(store, stop)
    t0 = (s["trip_ts"] or stop["ts"]) - WINDOW_BEFORE_S
    t1 = stop["ts"] + WINDOW_AFTER_S
    events = store.events(since=t0, until=t1, limit=500)
    events.reverse()  # oldest first: a timeline
    kernel = [e for e in events if e["kind"] in KERNEL_KINDS]
    shm = next((e for e in reversed(events) if e["kind"] == "shm_cleanup" and e["ts"] <= stop["ts"]), None)
    d = stop.get("details") or {}
    steps = [
        {"step": k, "seconds": v}
        for k, v in (d.get("durations_s") or {}).items()
        if isinstance(v, int | float) and k != "total"
    ]
    return {
        **s,
        "window": {"since": t0, "until": t1},
        "steps": steps,
        "timeline": [
            {k: e.get(k) for k in ("id", "ts", "kind", "severity", "message")}
            | ({"incident_url": f"/incidents/{e['id']}"} if e["kind"] in STOP_KINDS else {})
            for e in events
        ],
        "shm": {
            "removed": d.get("shm_removed") or [],
            "kept": d.get("shm_kept") or [],
            "message": (shm or {}).get("message"),
        },
        "kernel_lines": [(e.get("details") or {}).get("line") or e["message"] for e in kernel],
        # a cluster of Sparks: the peers this stop was coordinated with, and where their own incident is
        "peers": [
            {
                "node": (e.get("details") or {}).get("peer") or (e.get("details") or {}).get("origin"),
                "kind": e["kind"],
                "message": e["message"],
                "ts": e["ts"],
            }
            for e in events
            if e["kind"] in PEER_KINDS
        ],
        "log_tail": _log_tail(archive_dir, s["archive"]) if with_logs else None,
    }


def incidents(store: Store | None, *, limit: int = 50) -> list[dict[str, Any]]:
    """Stops, newest first, each as ``summary``."""
    if store is None:
        return []
    return [summary(store, e) for e in store.events(kinds=STOP_KINDS, limit=limit)]
