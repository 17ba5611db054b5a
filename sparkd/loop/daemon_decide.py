"""From a tick to an action: record what the guard saw, decide on each rule decision (events, loop
guard, dry run, the re-check before acting, the stop hooks, the stop), and the sampling mode.

Functions over the running ``Daemon`` (its methods delegate here), so ``daemon.py`` keeps the
start-up, the main loop and the shutdown in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import operator
import time
from typing import TYPE_CHECKING, Any

from sparkd.core.lifecycle import ACTIVE_STATES, DOWN_STATES, ContainerState
from sparkd.core.rules import Decision, Rule, missing_inputs, stop_lines
from sparkd.core.sample import Sample
from sparkd.loop import daemon_view as _daemon_view
from sparkd.loop.guard import TickResult
from sparkd.sense.kernlog import KernRecord
from sparkd.units import fmt_gib

log = logging.getLogger("sparkd.loop.daemon")

if TYPE_CHECKING:
    from sparkd.loop.daemon import Daemon

STATUS_EVERY_S = 1.0  # while something moves (a counter, the mode, the container, an event)
STATUS_BLIND_S = 5.0  # while no sample can be read (``Guard.read_error``): `sparkd status` judges liveness by it
# after an event between ticks further apart than twice this (``Daemon._status_soon``): the snapshot and STATUS=
STATUS_SOON_S = STATUS_EVERY_S
NEAR_MISS_EVERY = 10  # a near miss is logged as an event once in this many (each is counted in the rule's state)
STATUS_QUIET_S = 30.0  # otherwise (samples, which `sparkd status` reads beside it, go every store.WRITE_EVERY_S, 10 s)

_COUNTER = operator.attrgetter("counter")


async def handle(daemon: Daemon, result: TickResult) -> None:
    """Everything a tick's result asks for: ``handle_sync``, then each decision that may act, in order."""
    for d, sample in handle_sync(daemon, result):
        await decide(daemon, d, sample)


def handle_sync(daemon: Daemon, result: TickResult) -> list[tuple[Decision, Sample | None]]:
    """The part of a tick's handling that never waits: record the sample, kernel records, bursts,
    near misses and cooldowns, blind inputs, relief, NVRM windows, the status snapshot. Returns the
    decisions that may act (a trip, ``nvrm_action = stop``), in order, for ``decide``: on an idle
    host the list is empty and the main loop stays a plain callback (issue 18)."""
    assert daemon.writer is not None
    sample = result.sample
    # the Sample itself, not a dict of it: no per-tick copy, and ~half the memory of 1,800 kept rows
    daemon.live_samples.append(sample)
    daemon.writer.submit("sample", sample)
    daemon.actions.observe(sample)
    alert = daemon.leak.observe(sample.ts, sample.driver_bytes)
    if alert is not None:
        daemon.event("leak_trend", alert.reason, severity="warning", details=alert.details(), launch_id=alert.launch_id)
    acting: list[tuple[Decision, Sample | None]] = []
    if result.kernel:
        _kernel_records(daemon, result.kernel, sample, acting)
    if result.nvrm_burst is not None:
        daemon.event(
            "nvrm_burst",
            f"{result.nvrm_burst} NV_ERR_NO_MEMORY lines within {daemon.settings.nvrm_window_s:g} s "
            f"(threshold {daemon.settings.nvrm_burst}; usable {fmt_gib(sample.mem_available_minus_cma)})",
            severity="warning",
            details={
                "lines": result.nvrm_burst,
                "threshold": daemon.settings.nvrm_burst,
                "context": sample.context(),
            },
        )
    for d in result.decisions:
        if not decide_quietly(daemon, d):
            acting.append((d, sample))
    _daemon_view.check_blind(daemon)
    if (g := daemon.guard) is not None:  # a MemFree rule counting: maybe drop clean page cache first (relief.enabled)
        daemon.relief.consider(g.engine.rules, g.engine.states)  # (not the properties: a frame each, issue 18)
    for start, count in daemon.guard.nvrm.closed_windows(daemon.guard.mono()) if daemon.guard else []:
        daemon.writer.submit("nvrm_window", (start, daemon.settings.nvrm_window_s, count))
    refresh_status(daemon)
    return acting


def handle_blind_tick(daemon: Daemon) -> None:
    """A tick that could not read /proc/meminfo (``Guard.read_error``): every rule is blind. The
    ``sensor_blind`` event (critical) and the status snapshot say so at once; ``sensors_restored``
    follows the first read that succeeds."""
    daemon._check_blind()
    refresh_status(daemon)


def refresh_status(daemon: Daemon) -> None:
    """The status snapshot `sparkd status` reads: at once when something changed, else every
    ``STATUS_QUIET_S``."""
    assert daemon.writer is not None
    now = daemon.mono()
    since = now - daemon._last_status
    if since >= STATUS_EVERY_S:
        g = daemon.guard
        key = (
            tuple(map(_COUNTER, g.engine.states.values())) if g else (),  # in C: no frame per rule (issue 18)
            daemon.mode,
            daemon.actions.lifecycle_state(),
            id(daemon.recent_events[0]) if daemon.recent_events else None,
        )
        changed = key != daemon._status_key
        # while /proc/meminfo cannot be read no sample is written: the snapshot is what shows sparkd alive
        blind = g is not None and g.read_error is not None
        if changed or since >= (STATUS_BLIND_S if blind else STATUS_QUIET_S):
            daemon._status_key, daemon._last_status = key, now
            # a change is written at once (`sparkd status` reads it within a second), the quiet refresh gathered
            daemon.writer.submit("status", daemon.status_json().model_dump(mode="json"), urgent=changed or blind)
            daemon.notifier.notify(f"STATUS={daemon.summary_line()}")


def _rule(daemon: Daemon, name: str) -> Rule | None:
    return daemon.guard.rule(name) if daemon.guard else None


#: Driver lines (``nvrm*``) recorded one event each per ``nvrm_window_s`` and kind; the rest of a flood is counted
#: (``kcount``, ``nvrm_recent``, the burst event) and said once per window: 20,000 events in 10 s filled the
#: writer's queue and the 100 recent events the dashboard shows, hiding every other event (helper-40).
KERNEL_EVENTS_PER_WINDOW = 20


def _kernel_flood(daemon: Daemon, rec: KernRecord) -> bool:
    """True when ``rec`` is past its kind's events in this window (counted, not an event of its own); says so once
    per window (``kernel_flood``)."""
    if not rec.kind.startswith("nvrm"):
        return False  # OOM kills and the rest: rare, each one matters
    now, window = daemon.mono(), daemon.settings.nvrm_window_s
    start, n = daemon._kernel_window.get(rec.kind, (now, 0))
    if now - start >= window:
        start, n = now, 0
    n += 1
    daemon._kernel_window[rec.kind] = (start, n)
    if n == KERNEL_EVENTS_PER_WINDOW + 1:
        daemon.event(
            "kernel_flood",
            f"more than {KERNEL_EVENTS_PER_WINDOW} {rec.kind} kernel-log lines within {window:g} s: the rest of this "
            "window's are counted (nvrm_recent, the per-minute counts), not recorded one by one",
            severity="warning",
            details={"kind": rec.kind, "window_s": window},
        )
    return n > KERNEL_EVENTS_PER_WINDOW


def _kernel_records(
    daemon: Daemon, records: list[KernRecord], sample: Sample, acting: list[tuple[Decision, Sample | None]]
) -> None:
    """A tick's kernel-log records: one event each (a flood's beyond ``KERNEL_EVENTS_PER_WINDOW`` counted), one
    per-minute count per kind (a flood of 2,000 lines a tick put 2,000 records in the writer's queue and dropped
    records, helper-40), and with ``nvrm_action = stop`` one stop decision for the tick's driver errors."""
    assert daemon.writer is not None
    counts: dict[str, int] = {}
    stop: Decision | None = None
    for rec in records:
        counts[rec.kind] = counts.get(rec.kind, 0) + 1
        daemon._record_kernel(rec, sample)
        if stop is None and rec.kind == "nvrm_no_memory" and daemon.settings.nvrm_action == "stop":
            stop = Decision(
                "nvrm_action", "trip", "stop", f"nvrm_action = stop: driver error {rec.message[:160]}", 1, 1
            )
    minute = sample.ts - sample.ts % 60
    for kind, n in counts.items():
        daemon.writer.submit("kcount", (minute, kind, n))
    if stop is not None:
        acting.append((stop, None))


def record_kernel(daemon: Daemon, rec: KernRecord, sample: Any) -> None:
    """One kernel-log record: its event (unless past a flood's events in this window) and the supervisor's
    attribution (an OOM kill of the container's process). Its per-minute count is ``_kernel_records``'."""
    if _kernel_flood(daemon, rec):
        daemon.actions.on_kernel_record(rec)
        return
    severity = {"nvrm_no_memory": "warning", "oom_kill": "critical", "oom_killed": "critical"}.get(rec.kind, "info")
    details = {"line": rec.raw, "context": sample.context(), **rec.details}
    for key in ("pid", "comm", "container_id"):
        if getattr(rec, key, None) is not None:
            details[key] = getattr(rec, key)
    daemon.event(rec.kind, rec.message, severity=severity, details=details)
    daemon.actions.on_kernel_record(rec)


def decide_quietly(daemon: Daemon, d: Decision) -> bool:
    """Record a decision that never acts (a near miss, a trip held by the cooldown); False for
    one that may (``decide``)."""
    if d.kind == "near_miss":
        # one event in NEAR_MISS_EVERY keeps the log readable; every near miss is counted in the rule state, and the
        # event says which it is: the card read "near misses 302" beside "25 ×" in the log, neither saying why
        n = daemon.guard.states[d.rule].near_misses if daemon.guard else 0
        if n % NEAR_MISS_EVERY == 1:
            daemon.event(
                "near_miss",
                f"{d.reason} (this rule's near misses since sparkd started: {n}; 1 in {NEAR_MISS_EVERY} is logged)",
                severity="info",
                details={"rule": d.rule, "near_misses": n, **_jsonable(d.values)},
            )
        return True
    if d.kind == "cooldown":
        # once per rule per cooldown window: a rule that keeps holding must not flood the event log
        last = daemon._cooldown_logged.get(d.rule)
        now = daemon.mono()
        if last is None or now - last >= max(daemon.settings.cooldown_s, 1.0):
            daemon._cooldown_logged[d.rule] = now
            daemon.event(
                "trip_cooldown",
                d.reason + " (further trips in this cooldown are counted, not logged)",
                severity="warning",
                details={"rule": d.rule},
            )
        return True
    return False


#: How long a trip that finds the model down waits for a fresh look at Docker (``Actions.look_now``), s.
LOOK_NOW_S = 2.0
#: the model's states in which a trip has, as sparkd last saw it, nothing to stop (``decide``)
IDLE_STATES = frozenset({*DOWN_STATES, ContainerState.NONE})


async def decide(daemon: Daemon, d: Decision, sample: Sample | None = None) -> bool:
    """Record a decision and act on it; True when a stop was asked of the container (``on_stop``), False
    when it was recorded only (quiet kinds, a warn rule, a demotion, a dry run, recovered on re-check)."""
    if decide_quietly(daemon, d):
        return False
    shares = await daemon.consumers.at_trip(d.rule) if daemon.consumers else None
    if shares is not None:  # who grew: in the trip event, and in the reason the stop and its archive carry
        said = shares.text if shares.text.startswith("no ") else f"who grew {shares.text}"  # not "who grew no fall"
        d = dataclasses.replace(d, reason=f"{d.reason}; {said}")
    # the loop guard's verdict first: a trip it demotes stops nothing, and its event must say so
    # a container side: only trips while the model runs tell whether stopping loops (a trip after the guard
    # stopped it tells nothing); monitor-only judges every trip (its "would stop" loops as a stop would)
    monitor_only = daemon.actions.status_json().mode == "monitor-only"  # a trip is rare: the status is cheap
    state = daemon.actions.lifecycle_state()
    if d.action == "stop" and not monitor_only and state in IDLE_STATES:
        # down as sparkd last saw it: look at Docker now. A `docker start` by hand a moment before the trip made it
        # a "nothing to stop" trip (warning, collapsed, a thin mark) while its stop stopped that model (helper-42)
        with contextlib.suppress(Exception):  # Docker's trouble: the stop path says it; this look only informs
            await asyncio.wait_for(daemon.actions.look_now(), LOOK_NOW_S)
        state = daemon.actions.lifecycle_state()
    # "unknown": the Docker engine does not answer (dockerd starved by the very memory pressure): the model may run
    # on, and the stop works without the engine (act.procstop). Taken as not running, one good re-check reading
    # muted the rule for its cooldown (60 s) and the loop guard missed the trip (helper-47)
    running = monitor_only or state in ACTIVE_STATES or state == ContainerState.UNKNOWN  # StrEnum: equal to values
    tripped = _rule(daemon, d.rule)  # as configured at the trip (a demotion below replaces the rule list)
    # the loop guard judges trips of a model known to run: with the engine silent since sparkd's start the model was
    # never adopted, the reading taken at the start (under the model's load) was never withdrawn as "healthy", and
    # the first trip demoted the only stop rule instead of stopping (helper-49)
    judged = running and state != ContainerState.UNKNOWN
    rule = tripped if d.action == "stop" and judged else None
    verdict = daemon.loop_guard.record_trip(rule, time.time()) if rule is not None else None
    reason = d.reason
    if verdict is not None:
        reason = f"{d.reason}. NOT stopped: {d.rule} is demoted to warn (see the watermark event)"
    # the model is down as sparkd last saw it (stopped by the guard or an operator, exited): the host is short of
    # memory without it, and there is likely nothing to stop. The stop is still asked of Docker (a container started
    # by hand a moment ago is stopped), and says so if it acts; the trip itself is not a critical stop
    idle = d.action == "stop" and not monitor_only and state in IDLE_STATES
    # guard mode with no container by its name: not a model that is down but one that may run unguarded under
    # another name; that trip read "nothing to stop" as a warning, thin on the chart, never naming it (helper-44)
    cs = daemon.actions.status_json() if idle else None
    unguarded = cs is not None and cs.mode == "guard" and cs.guard_missing_since is not None
    if unguarded and cs is not None:
        running_now = f"; running now: {', '.join(cs.guard_candidates)}" if cs.guard_candidates else ""
        reason = (
            f"{reason}; NOT stopped: nothing is guarded (guard mode: no container named {cs.name}{running_now}); "
            "set container.guard to the model's container"
        )
    elif idle:
        said = "not running" if state == "none" else state  # "the model is none" (helper-44)
        reason = f"{reason}; the model is {said}: nothing to stop unless Docker says otherwise"
        if daemon.guard is not None:  # "trips since start" tells these from the trips that acted
            daemon.guard.engine.note_idle_trip(d.rule)
    daemon.event(
        "trip",
        reason,
        severity="critical" if d.action == "stop" and verdict is None and (not idle or unguarded) else "warning",
        details={
            **({"model_state": state} if idle else {}),
            "rule": d.rule,
            "action": d.action,
            "count": d.counter,
            "sample_ts": sample.ts if sample is not None else None,
            **_jsonable(d.values),
            # the rule's stop lines as configured at the trip: the incident chart draws them (the config may change)
            **({"stop_lines": stop_lines(tripped.to_json())} if tripped is not None else {}),
            **({"fall_shares_bytes": shares.shares_bytes} if shares else {}),
            **({"demoted": verdict.reason} if verdict is not None else {}),
            # a rule that holds while the model is down trips once per cooldown, each trip's figures its own: its
            # notifications collapse to one per notify's collapse window, not one a minute (act.notify)
            **({"collapse_as": f"{d.rule} holds while the model is {state}"} if idle and not unguarded else {}),
            **({"nothing_guarded": True} if unguarded else {}),
        },
    )
    if d.action != "stop":
        return False
    if verdict is not None and daemon.guard is not None:
        daemon.guard.engine.demote(verdict.rule, verdict.reason)
        daemon.event("watermark", verdict.reason, severity="warning", details=verdict.details())
        return False
    if daemon.settings.dry_run:
        daemon.event("dry_run", f"dry run: would stop ({d.reason})", severity="warning", details={"rule": d.rule})
        return False
    if daemon.settings.recheck and daemon.guard:
        fresh: Sample | None = None
        unread = None  # a re-check that cannot read what the rule needs confirms no recovery: the trip acts
        try:
            fresh = daemon.guard.read_sample()
        except (OSError, ValueError) as e:  # /proc/meminfo unreadable now: the stop was skipped by a crash (helper-40)
            unread = f"could not read memory ({e})"
        # MemAvailable missing from one read read as "recovered (MemAvailable n/a)" and waited a for_s (helper-40)
        if fresh is not None and tripped is not None and (missing := missing_inputs(tripped, fresh)):
            unread = "did not read " + ", ".join(missing)
        if unread is not None:
            daemon.event(
                "recheck_unread",
                f"{d.rule}: the re-check before the stop {unread}: acting on the trip",
                severity="warning",
                details={"rule": d.rule},
            )
        elif fresh is not None and tripped is not None and not daemon.guard.engine.recheck(d.rule, fresh):
            # the trip stopped nothing: its rule keeps counting with no cooldown while the model runs. One good
            # reading at the re-check muted the rule for cooldown_s (60 s) while MemAvailable fell to a quarter
            # of its line (helper-31). With the model down there is nothing to stop, and the cooldown stands
            rearmed = running and not idle and not monitor_only
            if rearmed:
                daemon.guard.engine.reset_cooldowns(d.rule)
            if rule is not None:  # nor is it a trip toward "stopping would loop": nothing was stopped
                daemon.loop_guard.withdraw_trip(d.rule)
            daemon.event(
                "recovered_before_stop",
                f"{d.rule}: recovered before stop (MemAvailable {fmt_gib(fresh.mem_available)}, "
                f"usable {fmt_gib(fresh.mem_available_minus_cma)}, "
                f"MemFree {fmt_gib(fresh.mem_free)} on re-check)"
                + ("; the rule keeps counting, with no cooldown: nothing was stopped" if rearmed else ""),
                severity="warning",
                details={"rule": d.rule, "cooldown_reset": rearmed},
            )
            return False
    for hook in daemon.stop_hooks:
        hook(d)
    await daemon.actions.on_stop(d)
    return True


def update_mode(daemon: Daemon, result: TickResult | None) -> None:
    assert daemon.guard is not None
    now = daemon.mono()
    reason = daemon.actions.fast_reason()
    if reason is None and result is not None:
        reason = daemon.guard.fast_reason(result.sample)
    if reason is not None:
        daemon._fast_until = now + daemon.settings.fast_hold_s
        if daemon.mode != "fast":
            if daemon.consumers is not None:
                daemon.consumers.wake()  # its next scan is due at the fast cadence: look now
            daemon.gpu_wanted.set()  # GPU context at gpu_interval_s from now on, not after the quiet wait
            if daemon.writer is not None:  # samples reach the disk within ~1 s, synced (a freeze may follow)
                daemon.writer.set_pressure(True)
            daemon.event(
                "sampling_fast",
                f"sampling every {daemon.settings.fast_interval_s:g} s: {reason}",
                details={"reason": reason},
            )
        daemon.mode, daemon.mode_reason = "fast", reason
    elif daemon.mode == "fast" and now >= daemon._fast_until:
        daemon.mode, daemon.mode_reason = "normal", None
        if daemon.writer is not None:
            daemon.writer.set_pressure(False)
        daemon.event("sampling_normal", f"sampling every {daemon.settings.interval_s:g} s again")


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, int | float | str | None) else str(v)) for k, v in values.items()}
