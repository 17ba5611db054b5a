"""One data function per dashboard view, shared by the JSON twin and the HTML partial.

Two kinds, because the guard must never wait on the web side:

* ``*_from_status(status)`` — pure functions over the typed ``sparkd.loop.status.Status``
  (``Daemon.status_json()``; call it on the event loop: it reads in-memory state the loop mutates);
* ``events_view`` / ``launches_view`` / ``archives_view`` — blocking (SQLite,
  directory listing): call them in a worker thread (``asyncio.to_thread``).

Sizes stay bytes in the data (``*_bytes``); GiB appear only as ``*_gib`` display
figures. Levels are ``ok`` / ``warn`` / ``critical``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkd.core.choices import RuleAction
from sparkd.core.conditions import parse_condition
from sparkd.core.lifecycle import ContainerState
from sparkd.core.rules import stop_lines
from sparkd.core.supervision import of_this_run
from sparkd.loop.status import ContainerStatus, GpuStatus, RuleStatus, Status
from sparkd.units import GiB

if TYPE_CHECKING:
    from sparkd.loop.reads import Reads
    from sparkd.loop.status import DaemonView
    from sparkd.store.store import Store

#: Chart series: sample column → label (node_exporter/meminfo words).
CHART_SERIES = {
    "mem_available": "MemAvailable",
    "mem_available_minus_cma": "usable",  # MemAvailable − CmaFree: the default rules' field
    "mem_free": "MemFree",
    "cached": "Cached",
    "anon_pages": "AnonPages",
    "slab": "Slab",
}
#: Event kinds drawn as vertical markers on the chart.
MARKER_KINDS = (
    "trip",
    "stopped",
    "killed",
    "hard_floor_kill",
    "launched",
    "ready",
    "oom_kill",
    "resize",
    "nvrm_no_memory",
)
#: Memory rows of the summary card: sample column → label.
MEMORY_ROWS = {
    "mem_total": "MemTotal",
    "mem_available": "MemAvailable",
    "mem_free": "MemFree",
    "cached": "Cached",
    "anon_pages": "AnonPages",
    "slab": "Slab",
    "page_tables": "PageTables",
    "driver_bytes": "driver (est.)",
    "shm_bytes": "/dev/shm",
}
WARN_MARGIN_BYTES = 4 * GiB  # MemAvailable within this of a floor → warn


def gib(v: float | None) -> float | None:
    return None if v is None else v / GiB


def status_view(daemon: DaemonView) -> Status:
    """``/api/status``: ``Daemon.status_json()`` (its ``plan`` is the container's, or None), for a reader: it
    also asks for fresh GPU readings (``want_gpu``). Loop only."""
    daemon.want_gpu()
    return daemon.status_json()


def guard_age_s(daemon: DaemonView) -> float | None:
    """Seconds since the guard's last sample (monotonic), None before the first."""
    g = daemon.guard
    if g is None or g.last is None:
        return None
    return max(0.0, g.mono() - g.last.mono)


def sample_max_age_s(daemon: DaemonView) -> float:
    """How old the guard's last sample may be and still count as a reading now: 3 intervals, at least 3 s
    (``/healthz``; ``/metrics`` leaves the memory gauges out past it)."""
    return max(3.0, 3 * daemon.settings.interval_s)


def health(daemon: DaemonView) -> dict[str, Any]:
    """``/healthz``: ok when the daemon runs and the guard sampled within ``sample_max_age_s``."""
    age = guard_age_s(daemon)
    limit = sample_max_age_s(daemon)
    ok = bool(daemon.ready) and not daemon.should_exit.is_set() and age is not None and age <= limit
    return {
        "ok": ok,
        "ready": daemon.ready,
        "last_sample_age_s": age,
        "max_age_s": limit,
        "samples_taken": daemon.samples_taken,
    }


def _floors(status: Status, attr: str, action: RuleAction = "stop") -> list[float]:
    out = []
    for r in status.rules:
        if r.action != action:
            continue
        for t in r.thresholds:
            if t.field == attr and t.is_size and t.op in ("<", "<="):
                out.append(float(t.value))
    return out


def unarmed(rules: list[dict[str, Any]]) -> str | None:
    """Why no rule would stop the model, or None when one would (``rules``: ``/api/status``'s, dicts).

    Every rule warns only: configured so (a warn-only rule set, monitor-only) or demoted by the loop
    guard (``demoted``). The page must then say the host is not guarded, never "waiting" or "ok"."""
    if not rules or any(r.get("action") == "stop" for r in rules):
        return None
    demoted = [f"{r['name']} ({r['demoted']})" for r in rules if r.get("demoted")]
    if demoted:
        return "demoted to warn: " + "; ".join(demoted)
    return "every rule only warns (" + ", ".join(str(r.get("name")) for r in rules) + ")"


def _page_level(nearest_level: str | None, has_sample: bool, unarmed_why: str | None) -> str:
    """The page's one level: the nearest stop line's (core.headroom), never an arming threshold;
    ``warn`` when a sample came but no rule would stop (``unarmed``); ``unknown`` before a sample."""
    if nearest_level is not None:
        return nearest_level
    if has_sample and unarmed_why is not None:
        return "warn"
    return "unknown"


def summary_from_status(status: Status) -> dict[str, Any]:
    """Memory now (bytes and GiB), sampling mode and the page's level (``_page_level``)."""
    s = status.sample
    avail = s.mem_available if s else None
    why = unarmed([{"name": r.name, "action": r.action, "demoted": r.demoted} for r in status.rules])
    level = _page_level(status.nearest_stop.level if status.nearest_stop else None, s is not None, why)
    row = s.model_dump() if s else {}
    rows = [{"key": k, "label": label, "bytes": row.get(k), "gib": gib(row.get(k))} for k, label in MEMORY_ROWS.items()]
    if no_nvidia_driver(status):
        for r in rows:
            if r["key"] == "driver_bytes":  # the figure stays in the data (and the database); the card says why not
                r["text"] = NO_DRIVER_TEXT
    total = s.mem_total if s else None
    used_pct = None if not total or avail is None else 100.0 * (total - avail) / total
    return {
        "ts": s.ts if s else None,
        "level": level,
        "mode": status.mode,
        "mode_reason": status.mode_reason,
        "interval_s": status.interval_s,
        "dry_run": status.dry_run,
        "samples_taken": status.samples_taken,
        "memory": rows,
        "used_pct": used_pct,
        "psi_some_avg10": s.psi_some_avg10 if s else None,
        "psi_full_avg10": s.psi_full_avg10 if s else None,
        "nvrm_recent": s.nvrm_recent if s else None,
        "kernel_log": status.kernel_log.model_dump(),
        "writer": status.writer.model_dump(),
        "consumers": status.consumers.model_dump() if status.consumers else None,
        # MemAvailable − CmaFree, what the rules judge; shown only where CMA makes it differ
        "usable_bytes": status.usable_bytes if status.usable_bytes != avail else None,
        "gpu": [gpu_line(g) for g in status.gpu],
        "leak": leak_line(status),
        "watermark_warnings": list(status.watermark.warnings),
        "watermark_notes": list(status.watermark.notes),
    }


#: The Now card's driver row where the host has no NVIDIA driver: the estimate MemTotal − MemFree − Buffers − Cached −
#: AnonPages − Slab − PageTables − KernelStack leaves 0.05–0.28 GiB on such a host (the kernel's other allocations),
#: which read as driver memory.
NO_DRIVER_TEXT = "no NVIDIA driver"


def no_nvidia_driver(status: Status) -> bool:
    """sparkd knows the host has no NVIDIA driver loaded (the GPU reading says ``no_driver``: /proc/driver/nvidia is
    absent, ``sense.gpu_helper``). False while it does not know (no GPU reading yet, NVML failing otherwise)."""
    return any(g.no_driver for g in status.gpu)


def gpu_line(g: GpuStatus) -> dict[str, Any]:
    """One GPU for the Now card: its readings, or n/a with the reason (``level`` ``na``).

    ``memory_supported`` false (GB10: unified memory, NVML has no framebuffer figures) says so
    instead of a 0 GiB reading."""
    if not g.available:
        return {"level": "na", "text": f"n/a ({g.reason or 'no reading'})"}
    parts = [g.name or f"GPU {g.index}"]
    if g.utilization_pct is not None:
        parts.append(f"{g.utilization_pct:.0f} %")
    if g.temperature_c is not None:
        parts.append(f"{g.temperature_c:.0f} °C")
    if g.power_w is not None:
        parts.append(f"{g.power_w:.0f} W")
    if g.memory_supported is False:
        parts.append("memory n/a (unified memory: not reported by NVML)")
    elif g.memory_used_bytes is not None and g.memory_total_bytes:
        parts.append(f"{g.memory_used_bytes / GiB:.1f} of {g.memory_total_bytes / GiB:.1f} GiB")
    return {"level": "ok", "text": " · ".join(parts)}


def leak_line(status: Status) -> dict[str, Any] | None:
    """The driver-memory leak trend (``core.leak``) once it has a baseline: growth since warm-up
    against its alert threshold; ``level`` ``warn`` after an alert. None while there is nothing
    to say (no launch, still warming up)."""
    lk = status.leak
    if lk.growth_bytes is None:
        return None
    if no_nvidia_driver(status):  # the estimate's drift is the kernel's, not a driver's: no trend to read
        return {"level": "ok", "text": f"n/a ({NO_DRIVER_TEXT}: the estimate is no driver memory here)"}
    level = "warn" if lk.alerts else "ok"
    text = (
        f"driver memory {lk.growth_bytes / GiB:+.2f} GiB since warm-up "
        f"(alert at +{lk.threshold_bytes / GiB:.1f} GiB)"
        + (f"; {lk.alerts} alert{'s' if lk.alerts != 1 else ''}" if lk.alerts else "")
    )
    return {"level": level, "text": text}


def rules_from_status(status: Status) -> list[dict[str, Any]]:
    """Each rule: counter/samples (a duration rule: how long it has held of ``for_s``, its progress the lesser of
    the two), near misses, trips, its conditions and a level."""
    out = []
    for r in status.rules:
        counter, need = r.counter, max(1, r.samples)
        frac = counter / need
        if r.for_s:  # a duration rule trips on both: held for_s and at least `samples` samples; the one behind binds
            frac = min(frac, (r.held_s or 0.0) / r.for_s)
        level = "ok" if counter == 0 else ("critical" if frac * 2 >= 1 and r.action == "stop" else "warn")
        # a warn rule's count leads to a warning, never a stop: amber, as its chart line (red read as a stop, helper-55)
        again = r.holds and counter == 0  # a trip started its count again: never a green 0/N (helper-39)
        if again:
            level = "critical" if r.action == "stop" else "warn"
        if r.blind:  # an input it needs was not read: never a quiet 0/N
            level = "critical"
        out.append(
            {
                "name": r.name,
                "kind": r.kind,
                "action": r.action,
                "counter": counter,
                "samples": need,
                "progress_pct": min(100.0, 100.0 * frac),
                "held_s": r.held_s,
                "in_last_s": r.in_last_s,
                "near_misses": r.near_misses,
                "trips": r.trips,
                "idle_trips": r.idle_trips,
                "idle_trips_text": idle_trips_text(r.idle_trips),
                "holds_again": HOLDS_AGAIN_TEXT if again else None,
                "when": list(r.when),
                "cond": rule_cond(r),
                "evidence": list(r.evidence),
                "last_reason": r.last_reason,
                "level": level,
                "blind": r.blind,
                "for_s": r.for_s,
            }
        )
    return out


#: A rule whose conditions held on the last sample with its counter at 0: a trip (or a relief) started its count
#: again, and it is counting toward the next (``RuleStatus.holds``); the card and ``sparkd status`` said a quiet 0/N.
HOLDS_AGAIN_TEXT = "holds now; counting again"


def idle_trips_text(idle_trips: int) -> str:
    """Of a rule's trips since start, those with the model down, in words ("" for none): a rule that holds after
    the guard stopped the model trips once per ``cooldown_s`` with nothing to stop (``loop.daemon_decide``)."""
    return f"{idle_trips} with the model down: nothing to stop" if idle_trips else ""


def rule_cond(r: Any) -> str:
    """What makes the rule act, in one line. A predictive rule's ``when`` only arms the projection (issue 14):
    shown as such, beside the floor it projects to, never as if it were the stop line."""
    if r.kind == "predictive" and r.floor_bytes is not None:
        within = f"{r.within_s:g} s" if r.within_s else "the time a stop takes"
        return (
            f"usable projected to cross {r.floor_bytes / GiB:.1f} GiB within {within} "
            f"(watching while {' and '.join(r.when)})"
        )
    return " and ".join(r.when)


#: What each container mode means for the operator, on the container card and in ``sparkd status`` (``mode_text``).
#: A dry run records a rule's trip without acting on it (``loop.daemon_decide``); the completion probe's emergency
#: stop is not a rule's and still stops the model (``loop.unattended``).
MODE_TEXT = {
    "managed": "managed: sparkd launches, restarts and resizes it, and stops it on a trip or a failed completion probe",
    "guard": "guard: started outside sparkd (docker run, compose…); sparkd stops it on a trip or a failed completion "
    "probe and never starts it",
}
DRY_RUN_MODE_TEXT = {
    "managed": "managed, dry run: sparkd launches, restarts and resizes it; a trip is recorded, not acted on (a "
    "failed completion probe still stops it)",
    "guard": "guard, dry run: started outside sparkd (docker run, compose…); a trip is recorded, not acted on (a "
    "failed completion probe still stops it); sparkd never starts it",
}


def guard_missing_text(name: str | None, candidates: list[str] | None = None) -> str:
    """Guard mode with no container by the guarded name (``ContainerStatus.guard_missing_since``): the headline and
    the container card say it in these words, with the running containers that may be the model meant
    (``ContainerStatus.guard_candidates``, their names alone: "NAME (IMAGE)" loses the image)."""
    said = f"guard mode: no container named {name or '?'} — nothing guarded"
    names = [c.split(" (", 1)[0] for c in candidates or []]
    return f"{said}; running: {', '.join(names)}" if names else said


def config_file_text(cf: dict[str, Any] | None) -> str | None:
    """What the headline and ``sparkd status`` say of the configuration file (``Status.config_file``) when it is
    not what sparkd runs with; None when it is (or is not watched)."""
    if not cf or cf.get("state") in (None, "as_started"):
        return None
    if cf["state"] == "changed":
        return f"configuration file changed since start ({', '.join(cf.get('changed') or [])}): restart sparkd to apply"
    return (
        f"configuration file {cf.get('path')} no longer loads ({cf.get('error')}): sparkd's next start will be "
        "refused, guarding nothing"
    )


def nothing_guarded(c: ContainerStatus) -> bool:
    """Guard mode with no container by its name, as last seen: the engine answers (while it is down, that is said
    instead of what was last seen of the name). The card and ``sparkd status`` read it."""
    return c.mode == "guard" and c.guard_missing_since is not None and c.engine != "down"


def guard_missing_mode_text(name: str | None, dry_run: bool) -> str:
    """The mode row while guard mode has no container by its name: "stops it on a trip" read beside "NOTHING
    GUARDED" (note 18 §7)."""
    dry = ", dry run" if dry_run else ""
    return (
        f"guard{dry}: no container named {name or '?'} to guard, so a trip has nothing to stop; sparkd never starts it"
    )


def start_error_text(mode: str | None) -> str:
    """The supervisor's first steps failed (``ContainerStatus.start_error``): the headline and the card say it so."""
    held = "no launch until they succeed" if mode == "managed" else "the container is guarded as ever"
    return f"sparkd's start-up steps failed (retrying): {held}"


def mode_text(mode: str, dry_run: bool) -> str | None:
    """What ``mode`` means (``MODE_TEXT``, ``DRY_RUN_MODE_TEXT`` in a dry run); None in monitor-only mode."""
    return (DRY_RUN_MODE_TEXT if dry_run else MODE_TEXT).get(mode)


def stop_not_kept(stop: dict[str, Any] | None, mode: str | None) -> list[dict[str, str]]:
    """What a stop (``ContainerStatus.last_stop``, its JSON form) did not leave behind, each ``{"level", "head",
    "text"}``: its postmortem archive (warn: the evidence of what happened), its stop intent on disk (critical:
    sparkd's next start does not know of the stop). The stopped card, the container card and `sparkd status` say
    them; the events alone (``archive_failed``, ``supervision_state_not_saved``) were soon pushed down the list.
    [] once both are written."""
    if not stop:
        return []
    out = []
    if stop.get("archive_error"):
        out.append({"level": "warn", "head": "Postmortem archive NOT written", "text": stop["archive_error"]})
    if stop.get("intent_saved") is False:
        why = stop.get("intent_error") or "not known why"
        after = (
            "after a restart of sparkd the model may be started again"
            if mode == "managed"
            else "after a restart of sparkd it no longer knows that it stopped the model, nor why"
        )
        out.append({"level": "critical", "head": "This stop is NOT saved", "text": f"{after} ({why})"})
    return out


#: Container states that are trouble (critical) rather than merely not ready (warn).
CRITICAL_STATES = frozenset({ContainerState.EXITED, ContainerState.FAILED, ContainerState.UNKNOWN})


def container_from_status(status: Status) -> dict[str, Any]:
    """The container card: monitor-only, or state/health/uptime/image/GMU/--memory."""
    c = status.container
    monitor_only = c.mode == "monitor-only"
    # nothing guarded: no container by that name (as last seen: while the engine is down, that is said instead)
    missing = nothing_guarded(c)
    level = "ok"
    if monitor_only:
        level = "critical" if c.ignored else "warn"
    elif c.state in CRITICAL_STATES or missing or c.watch_error:  # watch_error: its state may be stale
        level = "critical"
    elif c.start_error or c.state != ContainerState.READY or c.health not in (None, "healthy", "ok"):
        level = "warn"
    down = c.down_because()  # why this run is down; not an earlier incident's intent on a model started again by hand
    stop = c.stop_of_this_run()
    return {
        "monitor_only": monitor_only,
        "ignored": c.ignored,  # monitor-only with a container configured: it runs unguarded (helper-45)
        # which of the two container modes (helper-37: neither the dashboard nor `sparkd status` said it)
        "mode_text": guard_missing_mode_text(c.name, status.dry_run) if missing else mode_text(c.mode, status.dry_run),
        "reason": c.reason,
        "state": c.state.value,
        "health": c.health,
        "uptime_s": c.uptime_s,
        "image": c.image,
        "name": c.name,
        "gmu": c.gmu,
        "memory_bytes": c.memory_bytes,
        "memory_gib": gib(c.memory_bytes),
        # the supervisor's action in progress ("starting", "stopping", …); ``busy`` alone is only a flag
        "busy": c.action or ("busy" if c.busy else None),
        "intent": down.intent if down else None,  # (helper-37)
        "intent_who": down.who if down else None,
        # the stop that ended this run: its archive not written, its intent not saved (``live_parts`` leaves them to
        # the stopped card when that shows)
        "stop_not_kept": stop_not_kept(stop.model_dump() if stop else None, c.mode),
        # the breaker holds automatic relaunches, which guard mode never makes: "closed (1/3 emergencies)" beside
        # three stops read as a count that was wrong (helper-39)
        "breaker_applies": c.mode == "managed",
        "breaker_open": bool(c.supervision and c.supervision.breaker.open),
        "breaker_count": c.supervision.breaker.count if c.supervision else None,
        "breaker_threshold": c.supervision.breaker.threshold if c.supervision else None,
        "level": "critical" if (c.supervision and c.supervision.breaker.open) or c.unguarded else level,
        # a same-name container sparkd will not stop (managed mode, started by hand)
        "unguarded": c.unguarded.model_dump(mode="json") if c.unguarded else None,
        # guard mode: no container by the guarded name exists (`docker ps -a` lists none): nothing guarded
        "guard_missing": guard_missing_text(c.name, c.guard_candidates) if missing else None,
        "guard_candidates": c.guard_candidates if missing else [],
        "guard_missing_since": c.guard_missing_since if missing else None,
        # the supervisor's first steps failed (the revision, how the last launch ended): why, while retried
        "start_error": c.start_error,
        "start_error_text": start_error_text(c.mode) if c.start_error else None,
        # the Docker engine does not answer: a trip stops the model by its processes; start, stop and resize wait
        "engine_down": not monitor_only and c.engine == "down",
        "engine_error": c.engine_error,
        "watch_error": None if monitor_only else c.watch_error,
        "raw": c.model_dump(mode="json"),
    }


RUNNING_STATES = ("starting", "ready", "unhealthy", "restarting", "stopping")
#: The headline while the Docker engine does not answer: a stop (a trip's or an operator's) acts on the model's
#: processes (its archive without the container's log), and start, restart and resize wait.
ENGINE_DOWN_LABEL = "Docker engine unreachable: stops act on the model's processes"
#: ``ContainerStatus.watch_error``: the supervisor's looks at Docker fail; the container's state may be stale.
WATCH_ERROR_LABEL = "container not watched: sparkd's looks at it fail, its state may be stale"
_LEVEL_RANK = {"ok": 0, "warn": 1, "critical": 2}


def stopped_card(status: dict[str, Any], last_stop: dict[str, Any] | None) -> dict[str, Any] | None:
    """The "Stopped by the guard" card: the newest stop when a rule or the hard floor made it and the
    model is not running again (monitor-only: never). None otherwise."""
    c = status.get("container") or {}
    if not last_stop or not last_stop.get("by_guard") or c.get("mode") == "monitor-only":
        return None
    if c.get("state") in RUNNING_STATES:
        return None
    # a stop before the run last seen started is an earlier run's: a model started by hand after a guard stop, then
    # stopped with `docker stop`, read "STOPPED by the guard" with the old incident's card (helper-37)
    run_at, ts = c.get("started_at"), last_stop.get("ts")
    if isinstance(run_at, int | float) and isinstance(ts, int | float) and not of_this_run(ts, run_at):
        return None
    # what sparkd holds of its own last stop, when that is this card's (it began before the event; after a restart of
    # sparkd it holds none, and a newer stop is not this one)
    mine = c.get("last_stop")
    mine = mine if mine and isinstance(ts, int | float) and mine["at"] <= ts else None
    return {**last_stop, "state": c.get("state"), "logged_in": None, "not_kept": stop_not_kept(mine, c.get("mode"))}


def _at_least_warn(level: str) -> str:
    """``level``, raised to ``warn`` when it is lower (``_LEVEL_RANK``)."""
    return level if _LEVEL_RANK.get(level, 0) >= 1 else "warn"


def monitor_only_ignored_text(name: str) -> str:
    """Headline and card words for monitor-only mode with a container configured (``ContainerStatus.ignored``)."""
    return f"monitor-only: {name} is NOT guarded (monitor_only = true)"


def headline(status: dict[str, Any], stopped: dict[str, Any] | None) -> dict[str, Any]:
    """The headline: the nearest stop line (``status.nearest_stop``) and the page's one level.

    Level: ``critical`` while the model stays stopped by the guard (never "ok" then); otherwise the
    nearest stop's level (``core.headroom``), raised to ``warn`` when the Docker engine does not answer
    (a stop acts on the processes, without an archive: ``ENGINE_DOWN_LABEL``), when a stop rule is demoted,
    or when the container failed, exited or is unhealthy, or the supervisor's first steps failed
    (``start_error_text``); ``critical`` in guard mode when no container by the guarded name exists
    (``guard_missing_text``: nothing is guarded, as managed mode's "not guarded"); ``warn`` ("not
    guarded") when no rule would stop (``unarmed``); ``unknown`` before the first sample.
    """
    ns = status.get("nearest_stop")
    s = status.get("sample") or {}
    c = status.get("container") or {}
    why = unarmed(status.get("rules") or [])
    demoted = [str(r.get("name")) for r in status.get("rules") or [] if r.get("demoted")]
    level = _page_level(ns["level"] if ns else None, bool(s), why)
    label = level
    blind = blind_text(status)
    db = status.get("database") or {}
    if stopped is not None:
        level, label = "critical", "stopped by the guard"
    elif blind is not None and blind[0]:
        # every stop rule blind (/proc/meminfo unreadable or empty): it read grey "unknown", "No memory stop line —
        # no stop rule has a memory size line", while no rule could stop anything (helper-55)
        level, label = "critical", blind[1]
    elif ns is None and s and why is not None:
        label = "not guarded"
        if demoted and c.get("mode") != "monitor-only" and c.get("state") in RUNNING_STATES:
            # the loop guard switched off every stop rule while a model runs: nothing stops it now (its event is a
            # warning, its notification may be rate-limited): amber read as "mind it" (helper-48)
            level = "critical"
    elif c.get("unguarded"):  # a model sparkd will not stop runs under the managed name: never "ok"
        level, label = "critical", f"not guarded: {c['unguarded']['name']} runs without sparkd's label"
    elif c.get("ignored") and c.get("mode") == "monitor-only":  # a configured container runs unguarded (helper-45)
        level, label = "critical", monitor_only_ignored_text(c["ignored"])  # as its event and card (helper-46)
    elif c.get("engine") == "down" and c.get("mode") != "monitor-only":  # stops by the processes
        level, label = _at_least_warn(level), ENGINE_DOWN_LABEL
    elif c.get("guard_missing_since") is not None and c.get("mode") == "guard":
        # no container by the guarded name: a trip has nothing to stop; it read "ok" (a typo in container.guard), then
        # amber under a calm headroom while its event was critical, as managed mode's "not guarded" is (helper-44)
        level, label = "critical", guard_missing_text(c.get("name"), c.get("guard_candidates"))
    elif c.get("watch_error") and c.get("mode") != "monitor-only":
        # its state may be stale: exits and OOM kills go unseen (helper-51); critical, as its event and card
        level, label = "critical", WATCH_ERROR_LABEL
    elif c.get("start_error") and c.get("mode") != "monitor-only":
        # the supervisor's first steps failed (a locked database): it read "ok" with the container never asked for
        level, label = _at_least_warn(level), start_error_text(c.get("mode"))
    elif blind is not None:  # some stop rules blind: the others guard
        level, label = _at_least_warn(level), blind[1]
    elif db.get("state") == "unavailable" or db.get("write_hung_s"):
        # nothing is recorded (a full disk, a hung write): the guard goes on from memory; it read green "ok" with the
        # only word two events deep in the list (helper-55)
        level, label = _at_least_warn(level), NOT_RECORDING_LABEL
    elif demoted and _LEVEL_RANK.get(level, 0) < 2:  # a stop rule switched off by the loop guard: never "ok",
        # and named over a plain "warn" (near another line): the generic label hid it while memory sat below the
        # demoted rule's line (helper-31)
        level, label = "warn", f"{', '.join(demoted)} demoted to warn (cannot protect this host)"
    elif c.get("state") in ("exited", "failed") and _LEVEL_RANK.get(level, 0) < 1:
        level, label = "warn", f"container {c.get('state')}"
    elif c.get("state") == "unhealthy" and _LEVEL_RANK.get(level, 0) < 1:
        # /health failing or no token progress: the pill and the tab's title read "ok" beside it (helper-39)
        level, label = "warn", "model unhealthy"
    elif c.get("mode") != "monitor-only" and c.get("state") in ("stopped", "exited", "failed"):
        label = f"model {c['state']}"  # the level is the host's (core.headroom, can_stop=False): say why it is calm
    elif (status.get("config_file") or {}).get("state") in ("invalid", "missing") and _LEVEL_RANK.get(level, 0) < 1:
        level, label = "warn", "configuration file invalid"  # the next start is refused: nothing guarded then
    return {
        "level": level,
        "label": label,
        "nearest": ns,
        "headroom_gib": gib(ns["headroom_bytes"]) if ns else None,
        "sample_ts": s.get("ts"),
        "status_ts": status.get("ts"),
        "dry_run": status.get("dry_run"),
        "interval_s": status.get("interval_s"),
        "stopped": stopped is not None,
        "monitor_only": c.get("mode") == "monitor-only",
        "has_sample": bool(s),
        "unarmed": why,
        "blind": blind[1] if blind is not None else None,
        "config_note": config_file_text(status.get("config_file")),
        "config_invalid": (status.get("config_file") or {}).get("state") in ("invalid", "missing"),
    }


#: The headline while the database records nothing (``database.state`` unavailable, or a write hung).
NOT_RECORDING_LABEL = "NOT RECORDING: the database takes nothing; the guard goes on from memory"


def blind_text(status: dict[str, Any]) -> tuple[bool, str] | None:
    """Stop rules that cannot evaluate (``status.blind.rules``): ``(every stop rule is blind, the headline's
    words)``, or None when none is. Monitor-only judges its rules too (they say what it would stop)."""
    blind = (status.get("blind") or {}).get("rules") or {}
    stops = [str(r.get("name")) for r in status.get("rules") or [] if r.get("action") == "stop"]
    out = [n for n in stops if n in blind]
    if not out:
        return None
    why = blind[out[0]]  # the rule's own reason (the first blind sensor may be one only a warn rule reads)
    if len(out) == len(stops):
        return True, f"BLIND: no stop rule can evaluate ({why})"
    return False, f"{', '.join(out)} blind ({why}); the other stop rules guard"


def _ready_s(c: dict[str, Any]) -> float | None:
    """The last launch's time to ready, s: the ``ready`` event's figure (``time_to_ready_s``, from the launch's start);
    from Docker's start of the container for a snapshot without it (it read "0 s" against the event's 1.5 s)."""
    if "time_to_ready_s" in c:  # null: not timed (a run first seen running), so not said
        t = c["time_to_ready_s"]
        return float(t) if isinstance(t, int | float) else None
    ready, started = c.get("ready_at"), c.get("started_at")
    if isinstance(ready, int | float) and isinstance(started, int | float):
        return float(ready - started)
    return None


def buttons_view(status: dict[str, Any], logged_in: bool) -> dict[str, Any]:
    """Which controls apply to the container's state now, and why a disabled one is disabled."""
    c = status.get("container") or {}
    state, busy = c.get("state"), c.get("action") if c.get("busy") else None
    why: str | None = None
    if c.get("mode") == "monitor-only":
        why = "monitor-only: there is no container to start or stop"
    elif not logged_in:
        why = "log in with the API token to use the controls"
    elif busy:
        why = f"{busy} in progress"
    running = state in RUNNING_STATES
    can = why is None
    managed = c.get("mode") == "managed"
    name = c.get("name")
    # stop rules whose conditions held on the last sample: a start would be stopped again (the preflight refuses
    # an operator's start in managed mode, ``LaunchBook``); the guard-mode Start said nothing of it (note 17)
    holding = [r.get("name") for r in status.get("rules") or [] if r.get("holds") and r.get("action") == "stop"]
    many = len(holding) > 1
    holds = f"stop rule{'s' if many else ''} {', '.join(map(str, holding))} hold{'' if many else 's'} now"

    def guarded(verb: str) -> str | None:  # guard mode: the buttons were disabled without a word (helper-37)
        mind = holding and verb == "start" and not running
        if managed:  # (called only when the controls apply: ``why`` is None)
            return f"{holds}: a start is refused unless forced (the guard would stop it again)" if mind else None
        said = f"guard mode: sparkd does not {verb} it; {verb} it yourself (docker {verb} {name})"
        if c.get("guard_missing_since") is not None:  # `docker start NAME` fails: there is no such container
            said = f"guard mode: no container named {name}; set container.guard to the model's container (docker ps)"
        return f"{said}. Mind memory first: {holds}: the guard would stop it again" if mind else said

    return {
        "why": why,
        "state": state,
        "managed": managed,
        "guard": c.get("mode") == "guard",
        "monitor_only": c.get("mode") == "monitor-only",
        "start": can and not running and managed,
        "stop": can and running,
        "restart": can and running and managed,
        "resize": can and managed,
        "start_why": (why or f"already running ({state})") if not can or running else guarded("start"),
        "restart_why": (why or f"not running ({state or 'none'})") if not can or not running else guarded("restart"),
        "resize_why": why or (None if managed else "guard mode: sparkd did not launch it, so it has no plan to resize"),
        "stop_why": None if can and running else (why or f"not running ({state or 'none'})"),
        "last_ready_s": _ready_s(c),
        "rearm": can and managed and bool(((c.get("supervision") or {}).get("breaker") or {}).get("open")),
    }


def budget_from_status(status: Status) -> dict[str, Any] | None:
    """Budget bar segments against MemTotal (GiB). None when there is no plan."""
    plan = status.plan
    if plan is None:
        return None
    total = plan.mem_total_gib or 1.0
    cap, budget = plan.cap_gib, plan.budget_gib
    parts = [
        ("weights", "Weights", plan.weights_gib),
        ("overhead", "Overhead", plan.overhead_gib),
        ("mtp", "MTP", plan.mtp_gib),
        ("state", "Linear-attention state", plan.state_gib),
        ("kv", "KV cache (exp.)", max(0.0, plan.kv_exp_gib)),
        ("slack", "Unallocated", max(0.0, cap - budget)),
        ("reserve", "Host reserve", max(0.0, total - cap)),
    ]
    segments = [{"key": k, "label": label, "gib": v, "pct": 100.0 * v / total} for k, label, v in parts if v > 0]
    s = status.sample
    used = None
    if s and s.mem_total and s.mem_available is not None:
        used = (s.mem_total - s.mem_available) / GiB
    return {
        "mem_total_gib": total,
        "gmu": plan.gmu,
        "budget_gib": budget,
        "cap_gib": cap,
        "kv_exp_gib": plan.kv_exp_gib,
        "kv_need_gib": plan.kv_need_gib,
        "squeezed": plan.squeezed,
        "docker_memory_gib": plan.docker_memory_gib,
        "segments": segments,
        "used_gib": used,
        "used_pct": None if used is None else min(100.0, 100.0 * used / total),
        "warnings": list(plan.warnings),
        "inputs": plan.inputs.model_dump(),
    }


def _condition_words(text: str) -> str:
    """``"usable < 3GiB"`` → ``"usable < 3 GiB"`` (a size's unit spaced, as the chart's labels write it)."""
    fld, op, value = parse_condition(text)
    unit = value.lstrip("0123456789.")
    return f"{fld} {op} {value[: len(value) - len(unit)]} {unit}" if unit and unit != "%" else f"{fld} {op} {value}"


def line_needs(rule: RuleStatus, line: dict[str, Any]) -> str | None:
    """What else ``rule`` needs before it acts besides being under ``line`` (one of its ``stop_lines``): its other
    ``when`` conditions and, when it has any, "evidence", e.g. ``"MemFree < 2 GiB and evidence"``; None when the line
    alone decides (one condition, no evidence; a predictive rule's projected floor, which says "projected" itself)."""
    if rule.kind == "predictive":
        return None
    others = [
        _condition_words(text)
        for text, t in zip(rule.when, rule.thresholds, strict=False)
        if not (t.field == line["field"] and t.value == line["value"])
    ]
    if rule.evidence:
        # the evidence itself is on the rule's card (Stop rules): listed here it ran past the chart's edge
        others.append("evidence")
    return " and ".join(others) or None


def chart_config(status: Status, interval_s: float | None = None) -> dict[str, Any]:
    """What the chart script needs besides samples: series, rule thresholds (bytes; each with its rule's ``action``:
    a warn rule's line is amber and labelled "warn", a stop rule's red), ``cma`` and ``interval_s``.

    ``interval_s``: the configured sampling interval (s; ``settings.interval_s``, not the fast one of now): the
    chart breaks its lines where samples are further apart than 3 intervals (a daemon down, a frozen host), and no
    less than 10 s; at ``interval_s = 40`` a 10 s limit broke every line, and the 5-minute view was empty
    (helper-44).

    ``cma``: the host has a CMA region (CmaTotal > 0), so usable memory (MemAvailable − CmaFree,
    CONTEXT.md "CMA") is a line of its own; without one it is MemAvailable, and a stop line on usable
    is drawn against the MemAvailable line.

    ``needs``: what else the line's rule needs before it acts (its other ``when`` conditions and its evidence), or
    None for a rule that acts on the line alone. The default ``low_free_with_evidence`` line at usable 10 GiB was
    drawn red like ``low_available``'s: it read "stops at 10 GiB", but that rule stops only with MemFree < 2 GiB
    and evidence as well; the chart draws such a line as gated (dotted, magenta) and says what it needs."""
    lines = [
        # a warn rule's line is drawn as one, not as a stop line; a gated one as gated
        {"rule": r.name, "action": r.action, **line, "needs": line_needs(r, line)}
        for r in status.rules
        for line in stop_lines(r.model_dump())
        if line["field"] in CHART_SERIES
    ]
    cma = bool(status.sample and (status.sample.cma_total or status.sample.cma_free))
    return {
        "series": CHART_SERIES,
        "thresholds": lines,
        "markers": list(MARKER_KINDS),
        "cma": cma,
        "interval_s": interval_s,
    }


# --------------------------------------------------------------------------- blocking views
BURST_GAP_S = 5.0  # same-kind events closer than this fold into one row ("25 × nvrm_no_memory in 4 s")
# info events of one kind repeat for as long as their cause lasts (a near miss every 10th gated sample:
# one every 2.5 s at 4 Hz, 10 s at 1 Hz); folded over gaps this long, they cannot bury a trip or a stop
INFO_BURST_GAP_S = 60.0


def group_bursts(
    events: list[dict[str, Any]], gap_s: float = BURST_GAP_S, info_gap_s: float = INFO_BURST_GAP_S
) -> list[dict[str, Any]]:
    """Newest-first events → rows; a run of one kind with gaps ≤ ``gap_s`` (≤ ``info_gap_s`` for a
    run of info events) becomes one row with ``count``, ``span_s`` and ``ids`` (the run's event ids,
    newest first); the newest of the run's messages stands for it. A warning is never folded into a run of info
    events, nor one of them into it; a critical event is never folded (each trip's reason, each stop)."""
    rows: list[dict[str, Any]] = []
    for e in events:
        last = rows[-1] if rows else None
        # a critical event is never folded: two rules' trips in one tick read as one, hiding the first's reason
        fold = e["severity"] != "critical"
        if fold and last is not None and last["kind"] == e["kind"] and last["severity"] == e["severity"]:
            gap = info_gap_s if e["severity"] == "info" else gap_s
            if last["first_ts"] - e["ts"] <= gap:
                last["count"] += 1
                last["first_ts"] = e["ts"]
                last["span_s"] = last["ts"] - e["ts"]
                last["ids"].append(e["id"])
                continue
        rows.append({**e, "count": 1, "first_ts": e["ts"], "span_s": 0.0, "ids": [e["id"]]})
    return rows


EVENTS_READ = 300  # events read to fill the dashboard's rows once runs are folded


def last_event_id(rows: list[dict[str, Any]]) -> int:
    """The highest stored id among ``rows`` (events, or folded rows with their ``ids``): what a page shows up to,
    for its live updates (``/ui/live.json``'s ``ev``). A row's first event may be held in memory (id None); after
    the wall clock stepped back the newest by time is not the highest id (either sent a run twice: helper-49)."""
    return max((i or 0 for e in rows for i in e.get("ids") or [e.get("id")]), default=0)


EVENTS_PAGES = 20  # pages of EVENTS_READ read at most to fill the rows (6,000 events: 25 min of near misses at 4 Hz)


def events_view(store: Store | Reads | None, *, limit: int = 30) -> list[dict[str, Any]]:
    """The dashboard's event rows: recent events newest first, runs folded (``group_bursts``), ``limit`` rows at
    most, older pages read until the rows are filled (300 near misses left one row and pushed the trip out:
    helper-49). Blocking (SQLite): call in a thread."""
    if store is None:
        return []
    events = store.events(limit=EVENTS_READ)
    page = events
    for _ in range(EVENTS_PAGES - 1):
        oldest = min((e["id"] for e in page if e.get("id") is not None), default=None)
        # one row more than shown: the last shown row's run may go on in the next page
        if len(page) < EVENTS_READ or oldest is None or len(group_bursts(events)) > limit:
            break
        page = store.events(before_id=oldest, limit=EVENTS_READ)
        events += page
    return group_bursts(events)[:limit]


def event_rows_after(store: Store | None, ev: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int | None]:
    """What the dashboard adds above the event row whose newest event is ``ev``.

    Returns ``(events, rows, replaces)``: the events newer than ``ev`` (newest first, at most 100),
    their rows folded as ``events_view`` folds them, and ``ev`` when the last of those rows goes on
    the page's top row's run (the page replaces that row with it), else None. Blocking."""
    if store is None:
        return [], [], None
    new = store.events(after_id=ev, limit=100)
    if not new:
        return [], [], None
    fresh = {e["id"] for e in new}
    before = store.events(before_id=ev + 1, limit=EVENTS_READ)
    rows = [r for r in group_bursts(new + before) if fresh.intersection(r["ids"])]
    replaces = ev if rows and ev in rows[-1]["ids"] else None
    return new, rows, replaces


def launches_view(store: Store | Reads | None, *, limit: int = 20) -> list[dict[str, Any]]:
    """Launches with the plan's estimate beside what vLLM reported. Blocking."""
    if store is None:
        return []
    out = []
    for la in store.launches(limit=limit):
        plan, actual = la.get("plan") or {}, la.get("actual") or {}
        est, act = plan.get("kv_exp_gib"), actual.get("kv_cache_available_gib")
        out.append(
            {
                **la,
                "gmu": plan.get("gmu"),
                "kv_exp_gib": est,
                "kv_actual_gib": act,
                "kv_delta_gib": (act - est) if isinstance(est, int | float) and isinstance(act, int | float) else None,
                "graph_capture_gib": actual.get("graph_capture_gib"),
                "max_concurrency": actual.get("max_concurrency"),
                "ready_s": (la["ready_at"] - la["started_at"]) if la.get("ready_at") else None,
                "trough_gib": gib(la.get("trough_bytes")),
            }
        )
    return out


def archives_view(archive_dir: str | Path) -> list[dict[str, Any]]:
    """Postmortem bundles, newest first, with their download URL. Blocking (listdir)."""
    from sparkd.act.archive import list_archives

    return [
        {
            "name": a.name,
            "size_bytes": a.size_bytes,
            "created": a.created,
            "url": f"/api/archives/{a.name}",
        }
        for a in list_archives(archive_dir)
    ]


def samples_columns(store: Store | Reads, since: float, until: float, step: float, fields: list[str]) -> dict[str, Any]:
    """min/avg/max per bucket, columnar (uPlot-ready): ``ts``, ``n`` and ``<field>_<min|avg|max>``
    arrays; buckets on a fixed grid (``since`` floored to ``step``) so incremental fetches line up.
    Blocking (SQLite)."""
    aligned = (since // step) * step
    rows = store.downsampled(since=aligned, until=until, step_s=step, fields=fields)
    return bucket_columns(rows, aligned, until, step, fields)


def bucket_columns(
    rows: list[dict[str, Any]], since: float, until: float, step: float, fields: list[str]
) -> dict[str, Any]:
    """``Store.downsampled`` rows (buckets from ``since``, aligned to ``step``) → the columnar shape
    of ``samples_columns``."""
    out: dict[str, Any] = {"since": since, "until": until, "step": step, "fields": fields, "points": len(rows)}
    out["ts"] = [r["ts"] for r in rows]
    out["n"] = [r["n"] for r in rows]
    for f in fields:
        for agg in ("min", "avg", "max"):
            key = f"{f}_{agg}"
            out[key] = [r.get(key) for r in rows]
    return out


def pick_step(window_s: float) -> float:
    """Bucket width so a window has at most ~2000 points (≥ 1 s)."""
    return float(max(1, math.ceil(window_s / 2000)))


def rearm_text(result: dict[str, Any]) -> str:
    """What a re-arm did, for the CLI and the dashboard: ``result`` is ``Unattended.rearm``'s answer
    (``rearmed_by``, ``was_open``, ``launch_id``). A breaker that was not open is said so (a new user read
    "breaker re-armed" for a breaker that was closed)."""
    launched = f"; launched {result['launch_id']}" if result.get("launch_id") else ""
    if result.get("was_open") is False:
        who = result["rearmed_by"]
        return f"the circuit breaker was not open: nothing to re-arm (relaunch back-off reset by {who}){launched}"
    return f"breaker re-armed by {result['rearmed_by']}{launched}"
