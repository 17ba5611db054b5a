"""What the daemon shows: the typed ``Status`` (``/api/status``, the snapshot ``sparkd status`` reads),
blind sensors, the systemd STATUS line, the watermark checks.

Functions over the running ``Daemon`` (its methods delegate here), so ``daemon.py`` keeps the
start-up, the main loop and the shutdown in one place.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from sparkd import __version__
from sparkd.core.conditions import never_fires, unread_fields
from sparkd.core.floors import check_floors
from sparkd.core.headroom import nearest_stop
from sparkd.core.lifecycle import DOWN_STATES, ContainerState
from sparkd.loop.consumers import ConsumerWatch
from sparkd.loop.status import (
    BlindStatus,
    ConsumersStatus,
    ContainerStatus,
    DatabaseStatus,
    EventRow,
    GpuStatus,
    HttpStatus,
    KernelLogStatus,
    LeakStatus,
    NearestStopStatus,
    NotifyStatus,
    ReliefStatus,
    RuleStatus,
    SampleRow,
    Status,
    WatermarkStatus,
    WriterStatus,
)
from sparkd.units import GiB, fmt_gib

log = logging.getLogger("sparkd.loop.daemon")

if TYPE_CHECKING:
    from sparkd.loop.daemon import Daemon


def status_json(daemon: Daemon) -> Status:
    """The in-memory state (``sparkd status``, ``/api/status``): a ``sparkd.loop.status.Status``.

    Sizes in bytes. Call on the event loop: it reads state the loop mutates.

    Raises:
        pydantic.ValidationError: a part no longer matches the contract (a bug, not input).
    """
    g = daemon.guard
    last = g.last if g else None
    ticks = sorted(daemon.tick_durations)
    container = daemon.actions.status_json()
    w = daemon.writer
    return Status(
        ts=time.time(),
        running=not daemon.should_exit.is_set(),
        version=__version__,
        pid=os.getpid(),
        started_at=daemon.started_at,
        samples_taken=daemon.samples_taken,
        interval_s=daemon.current_interval(),
        mode=daemon.mode,
        mode_reason=daemon.mode_reason,
        dry_run=daemon.settings.dry_run,
        sample=SampleRow.model_validate(last.to_row()) if last else None,
        rules=[RuleStatus.model_validate(r) for r in g.rules_json()] if g else [],
        nearest_stop=nearest_stop_status(
            daemon, can_stop=container.mode == "monitor-only" or not _down(container), idle_why=_idle_why(container)
        ),
        kernel_log=KernelLogStatus(
            source=daemon.kern_source_name,
            nvrm_lines=g.nvrm_lines_total if g else 0,
            lines_read=g.kern_lines_total if g else 0,
            # records the kernel's ring buffer overwrote before sparkd read them (/dev/kmsg: EPIPE
            # and the sequence-number gap); 0 for readers that cannot tell
            lost=getattr(g.kern_source, "lost_records", 0) if g else 0,
            nvrm_bursts=g.bursts.bursts if g else 0,
        ),
        blind=BlindStatus.model_validate(daemon.blind_json()),
        usable_bytes=last.mem_available_minus_cma if last else None,
        container=container,
        writer=WriterStatus(
            queued=w.queue.qsize() if w else 0,
            written=w.written if w else 0,
            dropped=w.dropped if w else 0,
            refused=w.refused if w else 0,
            last_error=w.last_error if w else None,
        ),
        database=DatabaseStatus.model_validate(
            {
                **daemon.db.status(),
                "write_hung_s": round(h, 1) if w is not None and (h := w.write_hung_s()) is not None else None,
            }
        ),
        http=HttpStatus(
            connection_cap=daemon.http_stats.cap,
            refused=daemon.http_stats.refused,
            head_timeouts=daemon.http_stats.head_timeouts,
        ),
        api_error=daemon.api_error,
        config_file=daemon.config_file,
        tick_s_p50=ticks[len(ticks) // 2] if ticks else None,
        leak=LeakStatus.model_validate(daemon.leak.status()),
        watermark=WatermarkStatus.model_validate(
            {
                "vm": daemon.vm_tunables,
                "low_watermark_bytes": g.low_watermark if g else None,
                **daemon.loop_guard.status(),
                "warnings": [fw.message for fw in daemon.floor_warnings if fw.severity == "warning"],
                "notes": [fw.message for fw in daemon.floor_warnings if fw.severity != "warning"],
            }
        ),
        notify=NotifyStatus.model_validate(daemon.event_notifier.stats.to_json()) if daemon.event_notifier else None,
        gpu=[GpuStatus.model_validate(x) for x in daemon.gpu],
        events=[EventRow.model_validate(e) for e in list(daemon.recent_events)[:20]],
        plan=container.plan,
        consumers=ConsumersStatus.model_validate(cs) if (cs := daemon._consumers_status()) else None,
        relief=ReliefStatus.model_validate(daemon.relief.status()),
    )


def blind_json(daemon: Daemon) -> dict[str, dict[str, str]]:
    """``{"sensors": {input: why}, "rules": {rule: why}}``: each input a rule needs that
    cannot be read (with the rules that need it), and each rule that therefore cannot
    evaluate (never shown as a quiet 0/N). Inputs no rule reads are not listed."""
    g = daemon.guard
    if g is None:
        return {"sensors": {}, "rules": {}}
    users = g.sensor_users()
    sensors = {
        name: f"{why}; needed by {', '.join(users[name])}" for name, why in g.blind_sensors().items() if name in users
    }
    return {"sensors": sensors, "rules": g.engine.blind()}


def check_blind(daemon: Daemon) -> None:
    """An event at start and whenever the set of blind inputs or rules changes."""
    if daemon.guard is not None:
        inputs = daemon.guard.blind_key()
        if inputs == daemon._blind_inputs:
            return
        daemon._blind_inputs = inputs
    b = daemon.blind_json()
    key = tuple(sorted(b["sensors"].items())) + tuple(sorted(("rule " + k, v) for k, v in b["rules"].items()))
    if key == daemon._blind_key:
        return
    first = daemon._blind_key is None
    daemon._blind_key = key
    if not key:
        if not first:
            daemon.event("sensors_restored", "every input the rules need is read again")
        return
    parts = [f"{k}: {v}" for k, v in b["sensors"].items()]
    parts += [f"rule {k} {v}" for k, v in b["rules"].items()]
    daemon.event(
        "sensor_blind",
        "blind: " + "; ".join(parts),
        severity="critical" if b["rules"] else "warning",
        details=b,
    )


def summary_line(daemon: Daemon) -> str:
    last = daemon.guard.last if daemon.guard else None
    if last is None:
        return "starting"
    counting = [
        f"{r['name']} {r['counter']}/{r['samples']}"
        for r in (daemon.guard.rules_json() if daemon.guard else [])
        if r["counter"]
    ]
    state = daemon.actions.lifecycle_state()
    return (
        f"MemAvailable {fmt_gib(last.mem_available)}, MemFree {fmt_gib(last.mem_free)}; "
        f"{'rules: ' + ', '.join(counting) if counting else 'rules quiet'}; "
        f"container: {state}; sampling {daemon.mode}"
    )


def run_floor_checks(daemon: Daemon, *, healthy: bool, at_start: bool = False) -> None:
    """Compare each rule's floor with the kernel's low watermark and the MemAvailable seen
    while healthy; report each new problem once as a ``watermark`` warning. A healthy reading may
    also re-arm a rule the loop guard demoted (``LoopGuard.rearm``: a later run sits well above its
    floor), said as a ``watermark`` event with ``action = "re-armed"``. ``at_start``: sparkd's own start,
    before it knows whether a model runs (``LoopGuard.forget_start_reading`` when one is adopted)."""
    g = daemon.guard
    last = g.last if g else None
    if g is None or last is None or last.mem_available is None:
        return
    if healthy:
        daemon.loop_guard.note_healthy(
            time.time(), last.mem_available, last.cma_free, g.low_watermark, at_start=at_start
        )
        for r in daemon.loop_guard.rearm(g.engine.configured_rules):
            g.engine.undemote(r.rule)
            daemon.event("watermark", r.reason, details=r.details())
    daemon.floor_warnings = check_floors(
        g.rules,
        healthy_mem_available_bytes=last.mem_available if healthy else None,
        low_watermark_bytes=g.low_watermark,
        min_free_kbytes=daemon.vm_tunables.get("min_free_kbytes"),
        watermark_scale_factor=daemon.vm_tunables.get("watermark_scale_factor"),
        healthy_cma_free_bytes=last.cma_free,
    )
    for w in daemon.floor_warnings:
        if w.severity == "warning" and w.message not in daemon._reported_floors:
            daemon._reported_floors.add(w.message)
            daemon.event("watermark", w.message, severity="warning", details=w.details())


def report_rules_that_never_fire(daemon: Daemon) -> None:
    """A ``rule_never_fires`` warning at start for each rule this host can never trip
    (``core.conditions.never_fires``: a line below 0, above MemTotal, or conditions that exclude
    each other). Such a rule is accepted (a 0.1 configuration still starts the guard) but said
    loudly: it looks armed and guards nothing. ``sparkd doctor`` reports the same (WARN)."""
    last = daemon.guard.last if daemon.guard else None
    total = last.mem_total if last else None
    unread = unread_fields(daemon.settings.kernlog_source)
    for r in daemon.settings.rules:
        for why in never_fires(r.when, r.evidence, total, r.floor, unread):
            daemon.event(
                "rule_never_fires",
                f"rule {r.name} can never fire: {why}; it guards nothing",
                severity="warning",
                details={"rule": r.name, "why": why},
            )


def consumers_status(daemon: Daemon) -> dict[str, Any] | None:
    return daemon.consumers.status() if daemon.consumers else None


def make_consumer_watch(daemon: Daemon) -> ConsumerWatch:
    """The process scan, fed with the supervisor's container id, the guard's MemAvailable and the plan."""
    s = daemon.settings

    def container_ids() -> list[str]:
        cid = daemon.actions.status_json().container_id
        return [cid] if cid else []

    def mem_available() -> int | None:
        last = daemon.guard.last if daemon.guard else None
        return last.mem_available if last else None

    def plan_left() -> int | None:
        plan = daemon.actions.status_json().plan
        if plan is None:
            return None
        return int((plan.mem_total_gib - plan.budget_gib) * GiB)

    return ConsumerWatch(
        s.consumers,
        host_reserve_bytes=int(s.budget.host_reserve_gib * GiB),
        container_ids=container_ids,
        mem_available=mem_available,
        plan_left_bytes=plan_left,
        emit=lambda k, m, sev, det: daemon.event(k, m, severity=sev, details=det),
        submit=daemon.writer.submit if daemon.writer else None,
        fast=lambda: daemon.mode == "fast",
    )


def _down(container: ContainerStatus) -> bool:
    """The managed or guarded model is stopped, exited, failed or absent: nothing for a rule to stop."""
    return container.state in DOWN_STATES or container.state == ContainerState.NONE


def _idle_why(container: ContainerStatus) -> str:
    """Why no model runs for a rule to stop: guard mode with no container by its name says so; it read "the model
    is not running" while a model may run under another name (note 18 §7)."""
    if container.mode == "guard" and container.guard_missing_since is not None:
        return f"guard mode: no container named {container.name}"
    return "the model is not running"


def nearest_stop_status(
    daemon: Daemon, *, can_stop: bool = True, idle_why: str = "the model is not running"
) -> NearestStopStatus | None:
    """``core.headroom.nearest_stop`` over the guard's last sample (None before the first); ``can_stop``:
    whether a model runs that a rule would stop; ``idle_why``: why none does."""
    g = daemon.guard
    if g is None or g.last is None:
        return None
    ns = nearest_stop(g.last, g.rules, g.states, g.slope, g.last.mono, can_stop=can_stop, idle_why=idle_why)
    return NearestStopStatus.model_validate(ns.to_json()) if ns else None
