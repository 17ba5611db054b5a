"""Running for weeks unattended: the supervisor's calls into ``core.supervision``, with the clocks,
the persisted state (``store.supervision_state``) and the events.

The supervisor calls (and nothing else):

* ``load()`` at start; ``status_json()`` for status;
* ``intent_for(source)`` / ``set_intent(...)`` / ``clear_intent(...)`` when it stops or starts;
* ``emergency(key, why)`` for a rule, hard-floor or probe stop (counted once per launch);
* ``after_down(intent, uptime_s, reached_ready)`` after the model went down: the relaunch decision
  (an event naming the intent it respected), executed as a background relaunch after the back-off;
* ``probe(...)`` from the health step while the model is up; ``observe_mem(bytes)`` per sample;
* ``periodic()`` each supervisor tick: breaker alert, maintenance expiry, heartbeat, schedule.

``maintenance_run`` is ``sparkd maintenance run``: maintenance intent → drain → stop → start the same
plan → smoke test → release on pass, alert and hold on fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkd.act.stop import unheard
from sparkd.core.supervision import (
    BackoffPolicy,
    BackoffState,
    Breaker,
    BreakerPolicy,
    HeartbeatFigures,
    IntentRecord,
    ProbePolicy,
    Relaunch,
    StopIntent,
    after_end,
    after_stable,
    boot_reset,
    breaker_alert_due,
    breaker_count,
    decide_relaunch,
    heartbeat_due,
    heartbeat_message,
    intent_for,
    intent_text,
    maintenance_expired,
    parse_schedule,
    probe_outcome,
    probe_skip_reason,
    rearm,
    record_emergency,
    schedule_due,
)
from sparkd.errors import Conflict, MetricsUnavailable, Refused, SparkdError, StoreError
from sparkd.sense.procfs import read_uptime_s
from sparkd.sense.vllm_http import completion_probe, health_check, read_vllm_metrics, served_model
from sparkd.store.supervision_state import SupervisionState, load, path_in, save

if TYPE_CHECKING:
    from sparkd.loop.supervisor import Supervisor

log = logging.getLogger("sparkd.loop.unattended")

#: how long anyone waits for supervision.json to be written (s): an emergency stop saves its intent before the
#: stop and must not wait on a state directory whose storage hung (the write goes on in the background)
SAVE_WAIT_S = 1.0


def probe_api_key(settings: Any) -> str | None:
    """``supervision.api_key``, else ``VLLM_API_KEY`` of ``container.env``, else ``--api-key`` in ``container.args``."""
    if settings.supervision.api_key:
        return str(settings.supervision.api_key)
    c = settings.container
    if c.env.get("VLLM_API_KEY"):
        return str(c.env["VLLM_API_KEY"])
    for i, a in enumerate(c.args):
        if a == "--api-key" and i + 1 < len(c.args):
            return str(c.args[i + 1])
        if a.startswith("--api-key="):
            return str(a.split("=", 1)[1])
    return None


def not_a_launch_failure(e: Conflict | Refused) -> str | None:
    """A start refused without a launch having failed: the severity its ``relaunch_skipped`` is said with; None for a
    launch that failed (its preflight, its plan, Docker's own 409 Conflict), which counts toward the back-off.

    ``Refused.reason`` ``already_running`` (info: nothing to launch) or ``guarded`` (a warning: sparkd launches no
    guarded container), and a Conflict whose detail names the action that holds the supervisor's lock (a stop under
    way, a resize, a maintenance run; ``Supervisor._refuse_if_busy``; a warning)."""
    if isinstance(e, Refused):
        return {"already_running": "info", "guarded": "warning"}.get(e.reason or "")
    return "warning" if isinstance(e.detail, dict) and "action" in e.detail else None


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


class Unattended:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        s = sup.settings
        c, u = s.container, s.supervision
        self.cfg = u
        self.backoff = BackoffPolicy(
            c.restart_cooldown_s, c.restart_backoff_cap_s, c.stable_uptime_s, c.max_failed_launches
        )
        self.breaker_policy = BreakerPolicy(
            u.breaker_threshold, u.breaker_window_s, u.breaker_alert_every_s, u.breaker_reset_on_boot
        )
        self.probe_policy = ProbePolicy(u.probe_interval_s, u.probe_failures, u.probe_adopt_grace_s)
        self.schedule = parse_schedule(u.maintenance_schedule) if u.maintenance_schedule else None
        self.path = path_in(s.state_dir)
        self.state = SupervisionState()
        self.api_key = probe_api_key(s)
        self.started_at = time.time()
        self.probe_failures = 0
        self.last_probe_mono: float | None = None
        self.last_probe: dict[str, Any] | None = None
        self.adopted_at_mono: float | None = None
        self.pending: dict[str, Any] | None = None  # the scheduled relaunch, for status
        self._relaunch: asyncio.Task[None] | None = None
        self._maint: asyncio.Task[Any] | None = None
        self.last_decision: dict[str, Any] | None = None
        self.relaunches: list[float] = []
        self.min_avail_bytes: int | None = None
        self._min_day = time.strftime("%Y-%m-%d")
        self._last_scheduled: datetime | None = None
        self._held: IntentRecord | None = None  # persisted by ``hold`` before a stop, not said yet
        self._dirty = False  # the state changed and is not on disk yet (a save under way, or one that failed)
        self._save_lock = asyncio.Lock()
        self._slow_said = False
        self._save_error_said: str | None = None

    # ------------------------------------------------------------------ persistence
    async def load(self) -> None:
        try:
            self.state = await asyncio.to_thread(load, self.path)
        except StoreError as e:  # refuse to guess: no automatic relaunch until an operator re-arms
            self.state = SupervisionState()
            self.state.breaker = Breaker(open_since=time.time())
            self.sup._event("supervision_state_unreadable", f"{e.message}; breaker held OPEN", severity="critical")
            return
        b = boot_reset(
            self.breaker_policy,
            self.state.breaker,
            host_uptime_s=read_uptime_s(self.sup.settings.proc_root) or 1e9,
            now=time.time(),
        )
        if b is not self.state.breaker:
            self.state.breaker = b
            self.sup._event("breaker_rearmed", "circuit breaker re-armed: the host booted less than 5 min ago")
            await self.save()

    async def save(self) -> None:
        """Persist the state (``supervision.json``: fsync of the file and its directory) in a worker thread, and
        wait for it ``SAVE_WAIT_S`` at most. An emergency stop saves its intent and breaker count before the
        stop: on a state dir whose storage hung (``fsfreeze``) or crawled, the stop waited on these writes, 40 s
        and 12 s in a hostile test, while the status said all was well (note 11). A save still under way after
        ``SAVE_WAIT_S`` goes on in the background (one critical ``supervision_state_slow`` says so), saves run one
        at a time, and the newest state is what is written. A save that failed (a full disk) is tried again at
        the next one and at the state keeper's wakes (``restore_file``) until it is written: a restart read
        the stale file and relaunched a model a rule had stopped."""
        self._dirty = True
        task = asyncio.ensure_future(self._save_now())
        task.add_done_callback(unheard)
        try:
            await asyncio.wait_for(asyncio.shield(task), SAVE_WAIT_S)
        except TimeoutError:
            if not self._slow_said:
                self._slow_said = True
                self.sup._event(
                    "supervision_state_slow",
                    f"{self.path}: writing the stop intent and breaker takes longer than {SAVE_WAIT_S:g} s (the "
                    "state directory's storage is slow or hung); sparkd goes on and writes it in the background",
                    severity="critical",
                )

    def unsaved(self) -> str | None:
        """Why the state sparkd holds (the stop intent, breaker and back-off) is not on disk, one line; None when it
        is. A save that failed (``supervision_state_not_saved``) until a later one succeeds, or one that has taken
        longer than ``SAVE_WAIT_S`` and is still under way (``supervision_state_slow``)."""
        if self._save_error_said is not None:
            return self._save_error_said
        if self._slow_said and (self._dirty or self._save_lock.locked()):
            return f"{self.path}: still being written after more than {SAVE_WAIT_S:g} s (its storage slow or hung?)"
        return None

    async def save_pending(self) -> None:
        """At sparkd's exit: a state not on disk yet (a save that failed, or one still under way) gets one more
        try, ``SAVE_WAIT_S`` at most, so that the next start reads the stop intent and breaker sparkd held."""
        if self._dirty or self._save_lock.locked():
            await self.save()

    async def _save_now(self) -> None:
        async with self._save_lock:  # one at a time; the newest state is the one written
            if not self._dirty:
                return
            self._dirty = False
            snapshot = SupervisionState.from_json(self.state.to_json())  # not the object the loop goes on changing
            try:
                await asyncio.to_thread(save, self.path, snapshot)
            except StoreError as e:
                self._dirty = True  # tried again at the next save and the keeper's next wake
                if e.message != self._save_error_said:
                    self._save_error_said = e.message
                    self.sup._event("supervision_state_not_saved", e.message, severity="critical")
                return
            self._save_error_said = None
            self._slow_said = False

    async def restore_file(self) -> str | None:
        """``Daemon.state_keepers``: the state written again when its file was deleted while sparkd runs
        (an ``rm -rf`` of the state dir): a restart would otherwise read "no file" as a closed breaker and no
        stop intent, and launch a model the guard stopped. The default state needs no file."""
        if self._save_lock.locked():  # a save under way writes the file: not a deleted one (a brand-new state dir's
            return None  # first heartbeat time read as "deleted, or never written" a second after the start: helper-48)
        if self._dirty:  # a save that failed (a full disk): tried again
            await self._save_now()
            return None if self._dirty else f"{self.path} (the stop intent, breaker and back-off, not saved before)"
        if self.state.to_json() == SupervisionState().to_json():
            return None
        if await asyncio.to_thread(os.path.lexists, self.path):
            return None
        await asyncio.to_thread(save, self.path, self.state)  # StoreError: keep_files logs it, tries again
        return f"{self.path} (the stop intent, breaker and back-off)"

    # ------------------------------------------------------------------ intents
    #: a stop's intent from who asked (``core.supervision.intent_for``)
    intent_for = staticmethod(intent_for)

    async def set_intent(self, intent: StopIntent, who: str, reason: str) -> None:
        """Record and persist why the model is stopped (a ``stop_intent`` event). The intent ``hold`` put in
        place before the stop began is said here, not recorded again."""
        cur, held = self.state.intent, self._held
        self._held = None
        if cur is not None and cur is held and (cur.intent, cur.who, cur.reason) == (intent, who, reason):
            pass  # persisted before the stop: say it now
        else:
            self.state.intent = IntentRecord(intent, time.time(), who, reason)
            await self.save()
        self.sup._event(
            "stop_intent",
            intent_text(intent, who, reason),
            details={"intent": intent.value, "who": who, "reason": reason},
        )

    async def hold(self, intent: StopIntent, who: str, reason: str) -> IntentRecord | None:
        """Persist ``intent`` before a stop begins, without an event: sparkd crashing or killed in the middle
        of the stop (archive + up to 30 s of grace + kill) then finds it at its next start and keeps the
        model stopped (``launchbook._remember_last_stop``) instead of relaunching the model it was stopping.
        Returns the intent it replaced, for ``release_hold`` when the stop was not executed."""
        before = self.state.intent
        self._held = self.state.intent = IntentRecord(intent, time.time(), who, reason)
        await self.save()
        return before

    async def release_hold(self, before: IntentRecord | None) -> None:
        """The stop ``hold`` was for was not executed: the intent that held before, persisted, no event."""
        if self._held is not None and self.state.intent is self._held:
            self.state.intent = before
            await self.save()
        self._held = None

    async def clear_intent(self, who: str) -> None:
        self.cancel_relaunch(f"started by {who}")
        old = self.state.intent
        if old is None:
            return
        self.state.intent = None
        await self.save()
        self.sup._event(
            "stop_intent_released",
            f"stop intent {old.intent.value} released by {who}",
            details={"intent": old.intent.value, "who": who},
        )

    # ------------------------------------------------------------------ breaker
    async def emergency(self, key: str, why: str) -> None:
        """Count one emergency (``key``: the launch id) toward the breaker; opening it is an alert."""
        b, opened = record_emergency(self.breaker_policy, self.state.breaker, now=time.time(), key=key)
        self.state.breaker = b
        await self.save()
        if opened:
            self.cancel_relaunch("circuit breaker open")
            self._breaker_alert("breaker_open", why)

    def _breaker_alert(self, kind: str, why: str = "") -> None:
        b = self.state.breaker
        self.state.breaker = replace(b, last_alert_at=time.time())
        n = breaker_count(self.breaker_policy, b, time.time())
        self.sup._event(
            kind,
            f"circuit breaker OPEN: {n} emergency stops within {self.breaker_policy.window_s:g} s"
            + (f" (last: {why})" if why else "")
            + "; no automatic relaunch until `sparkd rearm`",
            severity="critical",
            details={"emergencies": n, "open_since": b.open_since},
        )

    async def rearm(self, who: str) -> dict[str, Any]:
        """Close the breaker (recording who and when) and relaunch when the model is down by an automatic intent."""
        was_open = self.state.breaker.is_open
        self.state.breaker = rearm(self.state.breaker, who=who, now=time.time())
        self.state.backoff = BackoffState()
        await self.save()
        self.sup._event(
            "breaker_rearmed", f"circuit breaker re-armed by {who}", details={"who": who, "was_open": was_open}
        )
        out: dict[str, Any] = {"rearmed_by": who, "rearmed_at": self.state.breaker.rearmed_at, "was_open": was_open}
        intent = self.state.intent.intent if self.state.intent else None
        if (
            self.sup.mode == "managed"
            and not self.sup.running()
            and intent in (None, StopIntent.EMERGENCY, StopIntent.EXITED, StopIntent.FAILED_LAUNCH)
        ):
            started = await self.sup.request("start", source=f"rearm by {who}")
            out["launch_id"] = started.get("launch_id")
        return out

    # ------------------------------------------------------------------ relaunch
    async def after_down(self, intent: StopIntent, *, uptime_s: float | None, reached_ready: bool) -> Relaunch:
        """Record the unplanned end, decide, emit ``relaunch_decision`` naming the intent, and schedule."""
        guarded = self.sup.mode != "managed"
        # guard mode launches nothing: a guarded run that never answered /health is no failed launch of sparkd's
        # (status read "failed_launches: 1" beside "No launches recorded", helper-39)
        if intent in (StopIntent.EMERGENCY, StopIntent.EXITED, StopIntent.FAILED_LAUNCH) and not guarded:
            self.state.backoff = after_end(
                self.backoff, self.state.backoff, uptime_s=uptime_s, reached_ready=reached_ready
            )
        if self.state.intent is None or self.state.intent.intent != intent:
            self.state.intent = IntentRecord(intent, time.time(), "sparkd", f"model went down: {intent.value}")
        await self.save()
        d = decide_relaunch(
            self.backoff,
            self.state.backoff,
            intent=intent,
            breaker_open=self.state.breaker.is_open,
            auto_restart=self.sup.settings.container.auto_restart,
            guarded=guarded,
        )
        self.last_decision = {
            "ts": time.time(),
            "action": d.action,
            "delay_s": d.delay_s,
            "intent": intent.value,
            "reason": d.reason,
        }
        self.sup._event(
            "launch_hold" if d.alert else "relaunch_decision",
            f"{d.action}: {d.reason}",
            severity="critical" if d.alert else "info",
            details=self.last_decision,
        )
        if d.action == "relaunch":
            self.cancel_relaunch("superseded")
            self.pending = {"at": time.time() + d.delay_s, "intent": intent.value, "delay_s": d.delay_s}
            self._relaunch = asyncio.create_task(self._relaunch_after(d), name="sparkd-relaunch")
        return d

    def cancel_relaunch(self, why: str) -> None:
        t = self._relaunch
        if t is not None and not t.done() and t is not asyncio.current_task():
            t.cancel()
            self.sup._event("relaunch_cancelled", f"scheduled relaunch cancelled: {why}")
        self.pending = None

    async def _relaunch_after(self, d: Relaunch) -> None:
        await asyncio.sleep(d.delay_s)
        self.pending = None
        intent = d.intent.value if d.intent else "none"
        if self.state.breaker.is_open:
            self.sup._event("relaunch_skipped", f"relaunch skipped: circuit breaker opened (intent {intent})")
            return
        failed: SparkdError | None = None
        try:
            await self.sup.request("start", source=f"auto-relaunch (intent {intent}, back-off {d.delay_s:g} s)")
        except (Conflict, Refused) as e:
            skipped = not_a_launch_failure(e)
            if skipped is not None:
                # nothing was launched, and nothing failed: the model runs already, or an action holds it (a stop, a
                # resize, a maintenance run: its own decision follows). Counted as a failed launch, it doubled the
                # back-off and could hold the model down as "failing to launch"
                self.sup._event(
                    "relaunch_skipped",
                    f"relaunch skipped: {e.message} (intent {intent})",
                    severity=skipped,
                    details={"intent": intent, "why": getattr(e, "reason", None) or "busy"},
                )
                return
            failed = e
        except SparkdError as e:
            failed = e
        self.relaunches.append(time.time())  # a relaunch tried, launched or failed (``restarts_24h``)
        if failed is None:
            return
        self.sup._event("restart_failed", f"auto-relaunch failed: {failed.message}", severity="critical")
        if isinstance(failed, Refused):  # the launch's preflight or plan refused it: a failed launch
            await self.after_down(StopIntent.FAILED_LAUNCH, uptime_s=None, reached_ready=False)

    async def on_up(self, uptime_s: float) -> None:
        """A running container: reset the back-off once it has been up ``stable_uptime_s``."""
        new = after_stable(self.backoff, self.state.backoff, uptime_s)
        if new != self.state.backoff:
            self.state.backoff = new
            await self.save()

    # ------------------------------------------------------------------ probe
    def observe_mem(self, mem_available_bytes: int | None) -> None:
        day = time.strftime("%Y-%m-%d")
        if day != self._min_day:
            self._min_day, self.min_avail_bytes = day, None
        if mem_available_bytes is not None and (
            self.min_avail_bytes is None or mem_available_bytes < self.min_avail_bytes
        ):
            self.min_avail_bytes = mem_available_bytes

    def new_run(self) -> None:
        """Another run of the container is watched (launched, relaunched, adopted, started outside sparkd): its
        completion probes count from 0. The count went on across runs, so four failures of a run that died and one
        of its successor (a slow first request after its load) made "5 completion probes failed", an emergency
        stop counted toward the breaker (helper-51)."""
        self.probe_failures = 0

    async def probe(self, *, ready: bool, requests_waiting: float | None, startup_phase: str | None) -> None:
        """One completion probe when due; after ``probe_failures`` in a row: congestion or emergency."""
        if not self.cfg.probe:
            return
        now = time.monotonic()
        why = probe_skip_reason(
            self.probe_policy,
            now_s=now,
            last_probe_s=self.last_probe_mono,
            ready=ready,
            startup_phase=startup_phase,
            requests_waiting=requests_waiting,
            adopted_at_s=self.adopted_at_mono,
        )
        if why is not None:
            return
        self.last_probe_mono = now
        port = self.sup.settings.container.port
        p = await asyncio.to_thread(
            completion_probe,
            port,
            api_key=self.api_key,
            timeout_s=self.cfg.probe_timeout_s,
            max_tokens=self.cfg.probe_max_tokens,
        )
        self.last_probe = {"ts": time.time(), **p.to_json()}
        if p.ok:
            if self.probe_failures:
                self.sup._event(
                    "probe_recovered", f"completion probe passes again after {self.probe_failures} failures"
                )
            self.probe_failures = 0
            return
        self.probe_failures += 1
        h = await asyncio.to_thread(health_check, port, "127.0.0.1", 2.0)
        outcome = probe_outcome(self.probe_policy, self.probe_failures, health_ok=h.ok)
        detail = {"failures": self.probe_failures, "probe": p.to_json(), "health": h.status_code}
        self.sup._event(
            "probe_failed",
            f"completion probe failed ({self.probe_failures}): {p.verdict.error}",
            severity="warning",
            details=detail,
        )
        if outcome == "congestion":
            self.probe_failures = 0
            self.sup._event(
                "probe_congestion",
                f"{self.probe_policy.failures} completion probes failed ({p.verdict.error}) while /health answers 200: "
                "congestion, not stopping",
                severity="warning",
                details=detail,
            )
        elif outcome == "emergency":
            self.probe_failures = 0
            reason = f"{self.probe_policy.failures} completion probes failed ({p.verdict.error}) and /health: {h.error}"
            self.sup._bg = asyncio.create_task(self.sup.emergency_stop("probe", reason))

    # ------------------------------------------------------------------ periodic
    async def periodic(self, *, watched: bool = True) -> None:
        """The breaker's re-alerts, the maintenance window's expiry, the heartbeat, a scheduled maintenance.
        ``watched``: the supervisor's last look at the container succeeded; a scheduled maintenance waits for one (it
        began on a stale "ready" while the engine refused inspect, helper-54), the alerts never (helper-57)."""
        now = time.time()
        if (
            breaker_alert_due(self.breaker_policy, self.state.breaker, now)
            and self.state.breaker.last_alert_at is not None
        ):
            self._breaker_alert("breaker_alert")
            await self.save()
        rec = self.state.intent
        if maintenance_expired(rec, now=now, max_s=self.cfg.maintenance_max_s):
            assert rec is not None
            self.state.intent = IntentRecord(rec.intent, rec.since, rec.who, rec.reason, expired_alerted=True)
            await self.save()
            self.sup._event(
                "maintenance_expired",
                f"maintenance window open for {now - rec.since:.0f} s (limit {self.cfg.maintenance_max_s:g} s), "
                f"not released ({rec.reason}); the model stays down until `sparkd start`",
                severity="critical",
                details=rec.to_json(),
            )
        if self.cfg.heartbeat and heartbeat_due(
            self.state.heartbeat_sent_at, now=now, interval_s=self.cfg.heartbeat_interval_s
        ):
            if self.state.heartbeat_sent_at is None:  # first start: the first heartbeat after one interval
                self.state.heartbeat_sent_at = now
            else:
                await self._heartbeat(now)
            await self.save()
        if watched and self.schedule and (self._maint is None or self._maint.done()):
            local = datetime.now()
            if schedule_due(self.schedule, last_run=self._last_scheduled, now=local) and self.sup.running():
                self._last_scheduled = local
                self._maint = asyncio.create_task(self._quiet_maintenance("schedule"))

    def on_event(self, ev: dict[str, Any]) -> None:
        """A ``Daemon.notify_hooks`` entry: a ``leak_trend`` event starts the drain-and-relaunch when
        ``supervision.maintenance_on_leak`` is on (CONTEXT.md: a leak trend wants a planned relaunch, not a
        stop). Never raises; runs on the event loop."""
        if ev.get("kind") != "leak_trend" or not self.cfg.maintenance_on_leak:
            return
        if self._maint is not None and not self._maint.done():
            return
        self._maint = asyncio.get_running_loop().create_task(self._quiet_maintenance("leak trend"))

    async def _quiet_maintenance(self, who: str) -> None:
        try:
            await self.maintenance_run(who)
        except SparkdError as e:
            self.sup._event("maintenance_refused", f"maintenance ({who}) not run: {e.message}", severity="warning")

    async def _heartbeat(self, now: float) -> None:
        size = await asyncio.to_thread(_dir_bytes, Path(self.sup.settings.state_dir))
        f = HeartbeatFigures(
            uptime_s=now - self.started_at,
            restarts_24h=sum(1 for t in self.relaunches if now - t < 86400),
            breaker_open=self.state.breaker.is_open,
            breaker_count=breaker_count(self.breaker_policy, self.state.breaker, now),
            min_mem_available_bytes=self.min_avail_bytes,
            state_dir_bytes=size,
            container_state=self.sup.state,
            intent=self.state.intent.intent.value if self.state.intent else None,
        )
        self.state.heartbeat_sent_at = now
        self.sup._event("heartbeat", heartbeat_message(f), details=f.__dict__)

    # ------------------------------------------------------------------ maintenance
    async def _drain_running(self) -> dict[str, Any]:
        """Wait until ``vllm:num_requests_running`` is 0 (summed over labels), at most ``drain_limit_s``."""
        limit = self.cfg.drain_limit_s
        t0 = time.monotonic()
        last = "unknown"
        while time.monotonic() - t0 < limit:
            try:
                m = await asyncio.to_thread(read_vllm_metrics, self.sup.settings.container.port)
                if m.get("num_requests_running") == 0:
                    return {"drained": True, "waited_s": time.monotonic() - t0}
                last = f"{m.get('num_requests_running', 'no')} running"
            except MetricsUnavailable as e:
                last = e.message
            await asyncio.sleep(0.5)
        return {"drained": False, "waited_s": time.monotonic() - t0, "last": last}

    async def smoke_test(self) -> dict[str, Any]:
        """health, /v1/models, a completion, /metrics, decode tok/s ≥ ``smoke_min_tok_s``; ``{"ok", "checks"}``."""
        port = self.sup.settings.container.port
        checks: dict[str, dict[str, Any]] = {}
        h = await asyncio.to_thread(health_check, port, "127.0.0.1", 5.0)
        checks["health"] = {"ok": h.ok, "error": h.error}
        try:
            name = await asyncio.to_thread(served_model, port, api_key=self.api_key)
            checks["models"] = {"ok": True, "model": name}
        except MetricsUnavailable as e:
            name, checks["models"] = None, {"ok": False, "error": e.message}
        p = await asyncio.to_thread(
            completion_probe,
            port,
            api_key=self.api_key,
            model=name,
            timeout_s=self.cfg.probe_timeout_s,
            max_tokens=self.cfg.probe_max_tokens,
        )
        checks["completion"] = p.to_json()
        try:
            m = await asyncio.to_thread(read_vllm_metrics, port)
            checks["metrics"] = {"ok": "num_requests_running" in m}
        except MetricsUnavailable as e:
            checks["metrics"] = {"ok": False, "error": e.message}
        tok_s = p.tok_s or 0.0
        checks["decode"] = {
            "ok": p.ok and tok_s >= self.cfg.smoke_min_tok_s,
            "tok_s": tok_s,
            "min_tok_s": self.cfg.smoke_min_tok_s,
        }
        return {"ok": all(c["ok"] for c in checks.values()), "checks": checks}

    async def maintenance_run(self, who: str) -> dict[str, Any]:
        """Drain, stop, start the same plan, smoke test; release the maintenance intent only on pass.

        Raises:
            Refused: not a managed container, or it is not running (``reason="not_running"``).
            Conflict: another action is running.
        """
        sup = self.sup
        if sup.mode != "managed":
            raise Refused("maintenance run needs a container sparkd launches (container.image)")
        if not sup.running():
            raise Refused(
                f"{sup.name} is not running (state {sup.state}): nothing to drain and relaunch", reason="not_running"
            )
        began = time.time()
        await self.set_intent(StopIntent.MAINTENANCE, who, "drain and relaunch")
        drain = await self._drain_running()
        sup._event(
            "drained" if drain["drained"] else "drain_timeout",
            f"maintenance drain: {'no requests running' if drain['drained'] else 'limit reached, going ahead'} "
            f"after {drain['waited_s']:.1f} s",
            severity="info" if drain["drained"] else "warning",
            details=drain,
        )
        ok, why = await sup.relaunch_same_plan(f"maintenance by {who}", since=began)
        smoke: dict[str, Any] = (
            await self.smoke_test() if ok else {"ok": False, "checks": {"launch": {"ok": False, "error": why}}}
        )
        out = {"drain": drain, "relaunched": ok, "smoke": smoke, "launch_id": sup.launch_id}
        if smoke["ok"]:
            await self.clear_intent(f"maintenance by {who} (smoke test passed)")
            sup._event("maintenance_done", "maintenance relaunch passed its smoke test; intent released", details=out)
        else:
            failed = sorted(k for k, v in smoke["checks"].items() if not v.get("ok"))
            rec = self.state.intent
            if sup.stopped_meanwhile(began) is None:  # its own failure (a crash, a timeout, a failed smoke test)
                held = (
                    "the maintenance intent"
                    if rec is None or rec.intent is StopIntent.MAINTENANCE
                    else intent_text(rec.intent, rec.who, rec.reason)  # a crash's relaunch decision replaced it
                )
                out["held_by"] = held
                sup._event(
                    "smoke_failed",
                    f"maintenance relaunch failed its smoke test ({', '.join(failed)}); holding {held}",
                    severity="critical",
                    details=out,
                )
            else:
                assert rec is not None
                # a stop asked meanwhile (a rule's, a peer's, an operator's) holds the model now: no smoke test ran,
                # and an operator was paged for their own stop as a critical smoke_failed (helper-54, helper-55)
                out["held_by"] = intent_text(rec.intent, rec.who, rec.reason)
                sup._event(
                    "maintenance_interrupted",
                    f"maintenance interrupted: a stop was asked during its relaunch; the model stays stopped: "
                    f"{out['held_by']}",
                    severity="warning",
                    details=out,
                )
        out["released"] = bool(smoke["ok"])
        return out

    # ------------------------------------------------------------------ status
    def status_json(self) -> dict[str, Any]:
        b, now = self.state.breaker, time.time()
        i = self.state.intent
        return {
            "intent": i.to_json() if i else None,
            "breaker": {
                "open": b.is_open,
                "open_since": b.open_since,
                "count": breaker_count(self.breaker_policy, b, now),
                "threshold": self.breaker_policy.threshold,
                "window_s": self.breaker_policy.window_s,
                "rearmed_by": b.rearmed_by,
                "rearmed_at": b.rearmed_at,
            },
            "backoff": {"failures": self.state.backoff.failures, "failed_launches": self.state.backoff.failed_launches},
            "pending_relaunch": self.pending,
            "last_decision": self.last_decision,
            "probe": {"failures": self.probe_failures, "last": self.last_probe},
            "heartbeat_sent_at": self.state.heartbeat_sent_at,
        }
