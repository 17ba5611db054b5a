"""Launch records, configuration revisions and the launch itself: the bookkeeping half of the
supervisor (``loop.supervisor.Supervisor`` inherits it; split out to keep each module readable).

``LaunchBook`` declares what it uses of the supervisor; it never moves the lifecycle state
itself: a launch ends in ``_launched`` (the supervisor's LAUNCHED transition).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from sparkd.act.docker import ContainerManager
from sparkd.act.pagecache import evict
from sparkd.act.stop import unheard
from sparkd.config import BudgetSettings, Settings
from sparkd.core.lifecycle import ContainerState
from sparkd.core.sample import usable_bytes
from sparkd.core.supervision import IntentRecord, StopIntent, who_and_reason
from sparkd.errors import Refused, SparkdError
from sparkd.loop.launch import LearnedReserve, launch_config_key, launch_spec, learned_reserve, plan_for
from sparkd.loop.status import PlanFigures, diff_figures
from sparkd.ops.preflight import run_preflight
from sparkd.sense import procfs
from sparkd.sense.kernlog import KernRecord
from sparkd.sense.vllm_http import MetricsUnavailable, read_vllm_metrics
from sparkd.sense.vllm_log import LaunchLogParser
from sparkd.store.store import READ_ERRORS
from sparkd.units import GiB, fmt_gib

#: intents that mean the guard (or a peer's) stopped the model: a relaunch under way launches nothing more
EMERGENCY_INTENTS = (StopIntent.EMERGENCY, StopIntent.PEER_EMERGENCY)
#: A stop with one of these intents asked after an action began (a resize, a maintenance run's relaunch) means the
#: action launches nothing more, its rollback included: an operator's (Alertmanager's) too. An operator's stop during
#: a resize was handed over, and the rollback launched the old revision at once (helper-54)
STOPPED_MEANWHILE_INTENTS = (*EMERGENCY_INTENTS, StopIntent.OPERATOR)

if TYPE_CHECKING:
    from sparkd.loop.daemon import Daemon
    from sparkd.loop.unattended import Unattended

log = logging.getLogger("sparkd.loop.supervisor")
# After vLLM's generic "EngineCore failed to start." the root cause follows within the same second in the
# field logs (field-2); the vllm_start_failed event waits this long for it before it says "no root cause".
START_FAILED_CAUSE_WAIT_S = 5.0
#: Sources of an operator's request (the API, the CLI through it, the dashboard): ``source`` starts with one.
OPERATOR_SOURCES = ("api:", "web:")
#: how long a stop's end waits for its launch record to be written (s): storage that hangs held the action's lock
#: (start, restart and resize refused as busy) until the thaw; then it goes through the writer's queue (note 11)
LAUNCH_RECORD_WAIT_S = 2.0


def stored_plan(raw: Any) -> dict[str, Any] | None:
    """A plan read back from a launch record, when it still has ``PlanFigures``' shape; None otherwise (a record
    written by another version, or without a budget): a status that shows it must never fail on it."""
    if not isinstance(raw, dict):
        return None
    try:
        PlanFigures.model_validate(raw)
    except ValueError:  # pydantic.ValidationError is a ValueError
        log.info("the stored plan of the last launch is of another shape; not shown")
        return None
    return raw


class LaunchBook:
    """Launch records and launches. Attributes are set by ``Supervisor.__init__``."""

    settings: Settings
    manager: ContainerManager
    mode: str
    name: str
    daemon: Daemon | None
    lock: asyncio.Lock
    budget: BudgetSettings
    revision: int | None
    container_id: str | None
    image: str | None
    launch_id: str | None
    launch_started_at: float | None
    container_started_at: float | None
    state: ContainerState
    state_reason: str | None
    ready_at: float | None
    trough_bytes: int | None
    plan_json: dict[str, Any] | None
    stay_stopped: bool
    autostart_pending: bool
    mem_limit_bytes: int | None
    mem_swap_bytes: int | None
    first_sight: bool
    unattended: Unattended
    parser: LaunchLogParser | None
    _log_stop: threading.Event | None
    _metrics_prev: dict[str, float] | None
    _stall_polls: int
    _oom_record: KernRecord | None
    _figures_saved: set[str]
    _obs_lock: asyncio.Lock
    _launch_actual: dict[str, Any]  # what this launch measured, kept in the record beside vLLM's figures
    interrupted_stop: IntentRecord | None  # an emergency stop begun before sparkd's last exit, not finished
    emergency_inbox: tuple[str, str] | None  # (source, reason): a stop handed to the relaunch or resize under way

    def _event(self, kind: str, message: str, *, severity: str = "info", details: dict[str, Any] | None = None) -> None:
        raise NotImplementedError

    async def _launched(self, source: str, started_at: float | None) -> None:
        raise NotImplementedError

    async def _remember_last_stop(self) -> None:
        """A model that was stopped (by a rule, an operator, a crash) stays stopped across restarts of sparkd
        until an operator starts it; only a launch that was still up when sparkd went away is relaunched —
        unless the persisted stop intent (loop/unattended) is ``operator`` or ``maintenance``."""
        if self.mode != "managed":
            return
        store = self.daemon.store if self.daemon else None
        intent = self.unattended.state.intent
        if store is None:
            # no database to read the last launch from: never guess "it was running" — a model a rule
            # stopped must not come back because the database was lost (held until `sparkd start`)
            self.autostart_pending = False
            self.stay_stopped = True
            self.state_reason = "the database cannot tell how the last launch ended; stays stopped until `sparkd start`"
            self._event(
                "staying_stopped",
                "not launching at start: the database cannot be read, so how the last launch ended is unknown "
                "(a model a rule stopped must stay stopped); `sparkd start` launches",
                severity="critical",
                details={"intent": intent.intent.value if intent else None},
            )
            return
        try:
            last = await asyncio.to_thread(store.launches, limit=1)
        except READ_ERRORS:
            last = []
        # any persisted stop intent means the model was down when sparkd went away (it is released at the
        # next launch): it holds even when the database lost the launch record (tmpfs full, file gone)
        held = intent is not None
        if (last and last[0]["status"] not in ("starting", "ready")) or held:
            self.autostart_pending = False
            self.stay_stopped = True
            ended = f"the last launch ({last[0]['id']}) ended '{last[0]['status']}'" if last else "no launch yet"
            # an emergency stop sparkd began and never finished (its intent is written before the stop; the
            # launch still reads starting/ready): the supervisor finishes it if that run is still up
            interrupted = (
                intent is not None
                and intent.intent in EMERGENCY_INTENTS
                and bool(last)
                and last[0]["status"] in ("starting", "ready")
            )
            self.interrupted_stop = intent if interrupted else None
            if last and not interrupted:
                rec = last[0]
                # show the container as it was left (its name and image), not as "none"
                states = {
                    "failed": ContainerState.FAILED,
                    "exited": ContainerState.EXITED,
                    "oom_killed": ContainerState.EXITED,
                }
                if rec["status"] != "removed":
                    self.state = states.get(rec["status"], ContainerState.STOPPED)
                    self.image = rec.get("image") or self.image
                    # and the plan it ran with, as a stop within one run of sparkd leaves it shown (/api/status had
                    # plan null after a restart of sparkd; the next start makes its plan from the revision)
                    self.plan_json = self.plan_json or stored_plan(rec.get("plan"))
            why = intent.describe() if intent else ended
            self.state_reason = f"{why}; stays stopped until `sparkd start`"
            self._event(
                "staying_stopped",
                f"not launching at start: {why}; {ended}; `sparkd start` launches again",
                severity="warning",
                details={"intent": intent.intent.value if intent else None},
            )

    def _mem_total(self) -> int:
        d = self.daemon
        if d and d.guard and d.guard.last and d.guard.last.mem_total:
            return d.guard.last.mem_total
        from sparkd.sense.procfs import read_meminfo

        return read_meminfo(self.settings.proc_root).fields["MemTotal"]

    async def _load_revision(self) -> None:
        store = self.daemon.store if self.daemon else None
        if store is None:
            return
        rev = await asyncio.to_thread(store.revision_in_effect, self.settings.budget.model_dump())
        if rev is not None:
            self.budget, self.revision = BudgetSettings(**rev["data"]), rev["id"]
        else:
            self.revision = await self._save_revision(self.settings.budget, who="config file", reason="configuration")

    async def _save_revision(self, budget: BudgetSettings, *, who: str, reason: str) -> int:
        assert self.daemon is not None and self.daemon.store is not None
        data = {**budget.model_dump(), "_config_base": self.settings.budget.model_dump()}
        diff = {k: c.model_dump() for k, c in diff_figures(self.budget.model_dump(), budget.model_dump()).items()}
        self.revision = await asyncio.to_thread(
            self.daemon.store.add_revision, who=who, reason=reason, data=data, diff=diff or None
        )
        return self.revision

    def _stop_rules_holding(self) -> tuple[list[str], str, float] | None:
        """The stop rules that would trip on the last sample (``RuleEngine.holds_now``: every ``when``
        condition, the evidence, a predictive rule's projection) and what to say of them ("stop rules
        low_available (usable 2.00 GiB < 6.00 GiB); repeated_dips (…) hold now"): ``(names, text, sample_ts)``;
        None when none holds or no sample was taken yet."""
        g = self.daemon.guard if self.daemon else None
        if g is None or g.last is None:
            return None
        last = g.last
        tripping = [r for r in g.rules if r.action == "stop" and g.engine.holds_now(r.name, last)]
        if not tripping:
            return None
        held = "; ".join(f"{r.name} ({'; '.join(c.describe(last) for c in r.when)})" for r in tripping)
        many = len(tripping) > 1
        text = f"stop rule{'s' if many else ''} {held} hold{'' if many else 's'} now"
        return [r.name for r in tripping], text, last.ts

    def _refuse_below_a_stop_line(self, source: str, force: bool) -> None:
        """An operator's start (``api:``/``web:``: the API, the CLI, the dashboard) while a stop rule would trip
        on the last sample (``RuleEngine.holds_now``: every ``when`` condition, the evidence, a predictive
        rule's projection) would only be stopped again by the guard, into a host already short of memory:
        refused (``preflight_failed``, a warning: the operator has the refusal) unless ``force``, which is
        recorded (``preflight_forced``).

        Automatic launches (start-up, auto-relaunch, maintenance, resize) are not refused here: a relaunch into
        a shortage is stopped by the guard and counted by the breaker, as before; a refusal would count as a
        failed launch and hold the model down for good once memory came back.

        Raises:
            Refused: a stop rule would trip now and not ``force``.
        """
        if not source.startswith(OPERATOR_SOURCES):
            return
        holding = self._stop_rules_holding()
        if holding is None:
            return
        names, held, sample_ts = holding
        why = f"{held}: the guard would stop the model again"
        details = {"rules": names, "sample_ts": sample_ts}
        if force:
            self._event("preflight_forced", f"launching anyway (forced by {source}): {why}", severity="warning")
            return
        # the operator who asked has the refusal in hand: a warning, not a page per click (helper-44)
        self._event("preflight_failed", f"launch refused: {why}", severity="warning", details=details)
        # helper-35: a forced start at 2 GiB was stopped again 0.08 s after its launch, and nothing had said so;
        # helper-37: at 5 GiB the model came up healthy below the line, and the loop guard demoted the rule instead
        rules = "these rules trip" if len(names) > 1 else "this rule trips"
        raise Refused(
            f"preflight failed: {why}. A forced start (`sparkd start --force`, force=true in the API) launches it "
            f"anyway, and the guard stops it again as soon as {rules} (within seconds while memory stays this "
            "low), unless the model comes up healthy below a rule's line: then the loop guard demotes that rule "
            "to warn (a `watermark` event) and the model runs on without it",
            detail=details,
        )

    async def _launch(self, source: str, *, force: bool = False) -> str:
        d = self.daemon
        assert d is not None
        s = self.settings.model_copy(update={"budget": self.budget})
        plan = plan_for(s, self._mem_total(), base=self.settings.budget)
        learned = await self._learned(s, plan)  # the learned start-up overshoot (preflight) and reserve
        if learned is not None and learned.applied and learned.recommended_reserve_bytes is not None:
            # budget.apply_learned_reserve: the plan with the learned reserve
            reserve_gib = learned.recommended_reserve_bytes / GiB
            s = s.model_copy(update={"budget": s.budget.model_copy(update={"host_reserve_gib": reserve_gib})})
            plan = plan_for(s, self._mem_total(), base=self.settings.budget)
            self._event("learned_reserve_applied", " ".join(learned.lines()), details=learned.to_json())
        spec = launch_spec(s, plan)
        self._refuse_below_a_stop_line(source, force)
        managed = await asyncio.to_thread(self.manager.find_managed)
        running = [i.name for i in managed if i.status == "running"]
        pf = await asyncio.to_thread(
            run_preflight,
            gmu=plan.gmu if plan else None,
            margin_bytes=int(self.budget.preflight_margin_gib * GiB),
            running_managed=running,
            proc_root=s.proc_root,
            shm_dir=s.shm_dir,
            ignore_unreadable_pids=s.shm_ignore_unreadable_pids,
            model_dir=s.container.model_dir,
            learned_overshoot_bytes=learned.learned.overshoot_bytes if learned and learned.learned else None,
        )
        if not pf.ok and not force:
            # critical when nobody asked (autostart, a relaunch: the model stays down, unsaid to anyone); a warning to
            # the operator who clicked Start, whose reply says it: each refused click paged (helper-44)
            asked = source.startswith(OPERATOR_SOURCES)
            self._event(
                "preflight_failed",
                f"launch refused: {pf.describe()}",
                severity="warning" if asked else "critical",
                details=pf.to_json(),
            )
            raise Refused(f"preflight failed: {'; '.join(pf.failures)} (--force overrides)", detail=pf.to_json())
        for old in managed:  # a stopped container of ours with the same name blocks the new one
            if old.name == spec.name and old.status != "running":
                await asyncio.to_thread(self.manager.remove, old.id)
        evicted = await self._evict_checkpoint(s.container.model_dir)
        try:  # the start-up overshoot is learned against this (core.learned), in usable memory as the preflight
            # judges it (MemAvailable − CmaFree): learned in MemAvailable, free CMA growing during a load (0.13 → 8.81
            # GiB) was missing from the overshoot, and the preflight passed a launch that dipped to 0.2 GiB usable
            m = procfs.read_meminfo(s.proc_root).fields
            avail_at_launch = usable_bytes(m.get("MemAvailable"), m.get("CmaFree"))
        except OSError:
            avail_at_launch = None
        launch_id = uuid.uuid4().hex[:12]
        self.launch_id, self.plan_json = launch_id, plan.to_json() if plan else None
        self.launch_started_at, self.ready_at, self.trough_bytes = time.time(), None, None
        self._oom_record, self._metrics_prev, self._stall_polls = None, None, 0
        async with self._obs_lock:  # the loop must not see the new container before it is ours
            self.container_id = await asyncio.to_thread(self.manager.launch, spec, launch_id, self.revision or 0)
            info = await asyncio.to_thread(self.manager.get, self.container_id)
            self.image, self.name, self.container_started_at = info.image, info.name, info.started_at
            self.mem_limit_bytes = spec.mem_limit_bytes
            # read from the first inspect, without a word: a host without swap accounting stores -1 for the spec's
            # "no swap" (moby verifyPlatformContainerResources), and that is not a change by hand
            self.mem_swap_bytes = None
            self._figures_saved = set()
            self._launch_actual = {
                "preflight": pf.to_json(),
                "args": spec.command,
                "mem_available_at_launch_bytes": avail_at_launch,
                "config_key": launch_config_key(s, spec.image),
                **({"checkpoint_evicted": evicted} if evicted is not None else {}),
            }
            self._save_launch(
                status="starting",
                started_at=self.launch_started_at,
                container_id=self.container_id,
                image=spec.image,
                revision=self.revision,
                plan=self.plan_json,
                forced=bool(force and not pf.ok),
                actual={},
            )
            await self._launched(source, info.started_at)
        self._event(
            "launched",
            f"launched {spec.name} ({spec.image}) launch {launch_id}: "
            f"--memory {fmt_gib(spec.mem_limit_bytes)}, args {' '.join(spec.command)}"
            + ("; preflight overridden with --force: " + pf.describe() if force and not pf.ok else ""),
            details={
                "image": spec.image,
                "args": spec.command,
                "mem_limit_bytes": spec.mem_limit_bytes,
                "memswap_limit_bytes": spec.memswap_limit_bytes,
                "revision": self.revision,
                "forced": bool(force and not pf.ok),
                "preflight": pf.to_json(),
            },
        )
        self._follow_logs()
        return launch_id

    async def _learned(self, s: Settings, plan: Any) -> LearnedReserve | None:
        """The start-up overshoot learned from stored launches of this configuration; with
        ``budget.apply_learned_reserve`` and a larger recommended reserve, ``applied``. None without a
        store, a plan or a readable launch history."""
        d = self.daemon
        if d is None or d.store is None or plan is None:
            return None
        try:
            launches = await asyncio.to_thread(d.store.launches, limit=500)
        except Exception as e:
            log.warning("launch history unreadable (ignoring the learned overshoot): %s", e)
            return None
        lr = learned_reserve(
            s,
            launches,
            mem_total_bytes=self._mem_total(),
            budget_bytes=int(plan.budget_gib * GiB),
            image=s.container.image,
        )
        rec = lr.recommended_reserve_bytes
        if s.budget.apply_learned_reserve and rec is not None and rec > lr.host_reserve_bytes:
            return dataclasses.replace(lr, applied=True)
        return lr

    async def _evict_checkpoint(self, model_dir: str | None) -> dict[str, Any] | None:
        """Evict the checkpoint's files from the page cache before a launch (CONTEXT.md "Who holds the memory":
        a freshly written checkpoint's page cache caused an out-of-memory in the middle of weight loading).

        ``posix_fadvise(DONTNEED)`` per file (``act.pagecache.evict``; no root needed). Returns the report
        (bytes cached before/after, evicted) for the launch record, or None without a model directory.
        Never raises: a failure is an event and the launch goes on."""
        if not model_dir:
            return None
        try:
            rep = await asyncio.to_thread(evict, model_dir)
        except OSError as e:
            self._event("checkpoint_evict_failed", f"evicting {model_dir} from the page cache failed: {e}")
            return {"error": str(e)}
        out = rep.to_json()
        self._event(
            "checkpoint_evicted",
            f"evicted {fmt_gib(rep.evicted_bytes)} of {model_dir} from the page cache before launch "
            f"({fmt_gib(rep.cached_after_bytes)} of {fmt_gib(rep.total_bytes)} still cached, {rep.files} files)",
            details={"model_dir": model_dir, **out},
        )
        return out

    async def _take_emergency(self) -> tuple[bool, str | None]:
        raise NotImplementedError

    def stopped_meanwhile(self, since: float | None) -> IntentRecord | None:
        """The stop intent recorded at ``since`` (epoch s) or later that means an action launches nothing more
        (``STOPPED_MEANWHILE_INTENTS``), or None."""
        rec = self.unattended.state.intent
        if since is None or rec is None or rec.since < since or rec.intent not in STOPPED_MEANWHILE_INTENTS:
            return None
        return rec

    async def _launch_and_wait(self, source: str, *, since: float | None = None) -> tuple[bool, str | None]:
        """Launch and wait for ready (a relaunch, a resize). An emergency stop handed over meanwhile
        (``emergency_inbox``) stops the new run at once; one that stopped the model after ``since`` (the drain
        of a maintenance run) means no launch."""
        if self.emergency_inbox is not None:
            return await self._take_emergency()
        rec = self.stopped_meanwhile(since)
        if rec is not None:
            return False, f"not launched: stopped meanwhile ({who_and_reason(rec.who, rec.reason)})"
        try:
            await self._launch(source)
        except SparkdError as e:
            return False, e.message
        deadline = time.monotonic() + self.settings.container.startup_timeout_s
        while time.monotonic() < deadline:
            if self.emergency_inbox is not None:
                return await self._take_emergency()
            if self.state is ContainerState.READY:
                return True, None
            if self.state in (ContainerState.EXITED, ContainerState.FAILED, ContainerState.RESTARTING):
                return False, self.state_reason
            await asyncio.sleep(0.2)
        # the loop marks it failed at the same deadline (STARTUP_EXPIRED); say why here too
        return False, f"not ready within {self.settings.container.startup_timeout_s:g} s ({self.state_reason})"

    async def _drain(self) -> None:
        """Wait until vLLM reports no running or waiting requests (an unreadable count is not zero)."""
        if not self.container_id or self.state not in (ContainerState.READY, ContainerState.UNHEALTHY):
            return
        deadline = time.monotonic() + self.settings.container.drain_timeout_s
        last: str = "unknown"
        while time.monotonic() < deadline:
            if self.emergency_inbox is not None:
                return  # a stop was handed over: the caller stops now, not after the drain
            try:
                m = await asyncio.to_thread(read_vllm_metrics, self.settings.container.port)
                busy = m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0)
                if "num_requests_running" in m and busy == 0:
                    self._event("drained", f"{self.name} drained: no running or waiting requests")
                    return
                last = f"{busy:g} requests running or waiting"
            except MetricsUnavailable as e:
                last = f"request count unreadable ({e.message})"
            await asyncio.sleep(1.0)
        self._event(
            "drain_timeout",
            f"drain timed out after {self.settings.container.drain_timeout_s:g} s ({last}); stopping anyway",
            severity="warning",
        )

    def _follow_logs(self) -> None:
        if self._log_stop:
            self._log_stop.set()
        if not self.container_id:
            return
        stop = threading.Event()
        self._log_stop = stop
        self.parser = parser = LaunchLogParser()
        cid = self.container_id
        loop = asyncio.get_running_loop()

        def on_line(line: str) -> None:
            if parser.feed(line):
                loop.call_soon_threadsafe(self._launch_figures)

        def run() -> None:
            try:
                self.manager.stream_logs(cid, on_line, stop)
            except SparkdError as e:
                log.warning("log follower for %s ended: %s", cid[:12], e)

        threading.Thread(target=run, name=f"logs-{cid[:12]}", daemon=True).start()

    def _launch_figures(self) -> None:
        if self.parser is None:
            return
        rec = self.parser.record
        actual = rec.to_json()
        self._save_launch(actual_figures=actual)
        for key, text in rec.warnings().items():  # e.g. a negative CUDA graph estimate
            if key not in self._figures_saved:
                self._figures_saved.add(key)
                self._event("vllm_start_warning", text, severity="warning", details={"warning": key})
        if rec.failed and rec.failure_kind is None and "failed_wait" not in self._figures_saved:
            # vLLM prints its generic line first and the root cause after it: wait for the cause
            self._figures_saved.add("failed_wait")
            asyncio.get_running_loop().call_later(START_FAILED_CAUSE_WAIT_S, self._start_failed_event)
        elif rec.failed and rec.failure_kind is not None:
            self._start_failed_event()

    def _start_failed_event(self) -> None:
        if self.parser is None or "failed" in self._figures_saved:
            return
        self._figures_saved.add("failed")
        rec = self.parser.record
        self._event(
            "vllm_start_failed",
            rec.failure_summary() or "vLLM failed to start",
            severity="critical",
            details={k: v for k, v in rec.to_json().items() if k.startswith("failure_") or k == "phase"},
        )

    def _save_launch(self, *, actual_figures: dict[str, Any] | None = None, **cols: Any) -> None:
        d = self.daemon
        if not d or not d.writer or not self.launch_id:
            return
        row: dict[str, Any] = {"id": self.launch_id, **cols}
        if actual_figures is not None or "actual" in cols:
            # what the launch recorded (preflight, args, MemAvailable at launch, eviction) stays beside vLLM's figures
            base = {**self._launch_actual, **(cols.get("actual") or {})}
            base.update(self.parser.record.to_json() if self.parser else {})
            row["actual"] = base
        if "started_at" not in row:
            row["started_at"] = self.launch_started_at or time.time()
        if "status" not in row and actual_figures is None:
            row["status"] = self.state.value
        d.writer.submit("launch", row)

    async def _finish_launch(self, status: str) -> None:
        """How a launch ended, written at once (not through the queue): a restart of sparkd reads it to decide
        whether to launch again, so it must survive a crash right after the stop. The write is waited for
        ``LAUNCH_RECORD_WAIT_S``; past that it goes on in its thread and the record is queued too (storage that
        hung held the action's lock until the thaw). With no database open (a full disk, a locked or lost file)
        it goes through the writer's queue and reaches the database when it is back: it was dropped, and a
        restart after the disk was freed relaunched a model a rule had stopped (note 11)."""
        d = self.daemon
        if not d or not self.launch_id:
            return
        if not d.store:
            self._save_launch(status=status, stopped_at=time.time())
            return
        row = {
            "id": self.launch_id,
            "status": status,
            "stopped_at": time.time(),
            "started_at": self.launch_started_at or time.time(),
        }
        write = asyncio.ensure_future(asyncio.to_thread(d.store.save_launch, dict(row)))
        write.add_done_callback(unheard)  # a write that ends after the wait: its error is the queued one's too
        try:
            await asyncio.wait_for(asyncio.shield(write), LAUNCH_RECORD_WAIT_S)
        except Exception as e:  # refused, or not done within LAUNCH_RECORD_WAIT_S (an upsert: twice is harmless)
            why = str(e) or f"not written within {LAUNCH_RECORD_WAIT_S:g} s: storage slow or hung"
            log.warning("launch record not written directly (%s); queued", why)
            if d.writer:  # this launch's row as it was: another launch may have begun during the wait
                d.writer.submit("launch", dict(row))
