"""The container side of the daemon: launch, adopt, health, stop, restart, resize.

``make_actions(settings)`` picks the mode:
* ``managed`` — ``container.image`` set: sparkd launches and owns the container
  (labelled ``sparkd.managed=true``);
* ``guard`` — ``container.guard`` names a container the operator launches; sparkd
  stops it on a trip but never launches it;
* monitor-only — neither: decisions are recorded, nothing is acted on.

Docker calls are blocking (docker SDK) and run in worker threads; the guard
loop never waits on them. One action at a time: a second request while one
runs gets ``Conflict("already stopping")`` (HTTP 409).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from sparkd.act.docker import ContainerManager
from sparkd.act.shm import ShmWitness
from sparkd.act.stop import run_stop
from sparkd.config import BudgetSettings, Settings
from sparkd.core.lifecycle import RUNNING_STATES, ContainerState
from sparkd.core.rules import Decision
from sparkd.core.supervision import StopIntent
from sparkd.errors import Conflict, DockerUnavailable, NotFound, Refused, SparkdError
from sparkd.loop.daemon import Actions, MonitorOnly
from sparkd.loop.launch import apply_resize, budget_inputs, launch_spec, plan_for, setting_sources
from sparkd.loop.status import ContainerStatus, PlanFigures, ResizeResult, SupervisionStatus, diff_figures
from sparkd.loop.unattended import Unattended
from sparkd.ops.preflight import run_preflight
from sparkd.sense.kernlog import KernRecord
from sparkd.sense.vllm_http import MetricsUnavailable, health_check, progress_stalled, read_vllm_metrics
from sparkd.sense.vllm_log import LaunchLogParser
from sparkd.units import GiB, fmt_gib

if TYPE_CHECKING:
    from sparkd.core.sample import Sample
    from sparkd.loop.daemon import Daemon

log = logging.getLogger("sparkd.loop.supervisor")
NVML_LOST = "Failed to initialize NVML: Unknown Error"
# After vLLM's generic "EngineCore failed to start." the root cause follows within the same second in the
# field logs (field-2); the vllm_start_failed event waits this long for it before it says "no root cause".
START_FAILED_CAUSE_WAIT_S = 5.0
# How often the container's processes are scanned for the /dev/shm entries they use (act/shm.ShmWitness):
# the evidence that lets the cleanup after a stop remove what was the container's and keep the rest.
SHM_WITNESS_INTERVAL_S = 30.0


def out_reason(reason: str | None, source: str) -> str:
    return reason or f"stop requested by {source}"


def make_actions(settings: Settings) -> Actions:
    c = settings.container
    if not c.image and not c.guard:
        return MonitorOnly("no container configured (container.image or container.guard)")
    return Supervisor(settings)


class Supervisor:
    def __init__(self, settings: Settings, manager: ContainerManager | None = None) -> None:
        self.settings = settings
        c = settings.container
        self.manager = manager or ContainerManager(c.docker_url, selector=c.selector)
        self.mode = "managed" if c.image else "guard"
        self.name = c.name if c.image else (c.guard or "")
        self.daemon: Daemon | None = None
        self.lock = asyncio.Lock()
        self.action: str | None = None
        self.budget: BudgetSettings = settings.budget
        self.revision: int | None = None
        self.engine_up: bool | None = None
        self.engine_error: str | None = None
        self.container_id: str | None = None
        self.image: str | None = None
        self.launch_id: str | None = None
        self.launch_started_at: float | None = None
        self.container_started_at: float | None = None
        self.state = "none"
        self.state_since = time.time()
        self.state_reason: str | None = None
        self.health: str | None = None
        self.ready_at: float | None = None
        self.trough_bytes: int | None = None
        self.plan_json: dict[str, Any] | None = None
        self.stay_stopped = False
        # in a cluster the head launches every node in order (POST /api/cluster/start): no lone autostart
        self.autostart_pending = self.mode == "managed" and settings.container.autostart and not settings.cluster.peers
        self.mem_limit_bytes: int | None = None
        self._cooldown_logged: dict[str, float] = {}
        self.restarts: collections.deque[float] = collections.deque(maxlen=100)
        self.parser: LaunchLogParser | None = None
        self._log_stop: threading.Event | None = None
        self._metrics_prev: dict[str, float] | None = None
        self._stall_polls = 0
        self._oom_record: KernRecord | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_nvml_check = 0.0
        self._figures_saved: set[str] = set()
        self.shm_witness: ShmWitness | None = None
        self._last_shm_observe = -SHM_WITNESS_INTERVAL_S
        self._bg: asyncio.Task[Any] | None = None
        self.stops_total = 0
        self.kills_total = 0
        self.unattended = Unattended(self)

    # ------------------------------------------------------------------ Actions protocol
    async def start(self, daemon: Daemon) -> None:
        self.daemon = daemon
        await self._load_revision()
        await self.unattended.load()
        daemon.notify_hooks.append(self.unattended.on_event)
        await self._remember_last_stop()
        self._task = asyncio.create_task(self._loop(), name="sparkd-supervisor")

    async def _remember_last_stop(self) -> None:
        """A model that was stopped (by a rule, an operator, a crash) stays stopped across restarts of sparkd
        until an operator starts it; only a launch that was still up when sparkd went away is relaunched."""
        store = self.daemon.store if self.daemon else None
        if store is None or self.mode != "managed":
            return
        last = await asyncio.to_thread(store.launches, limit=1)
        rec = self.unattended.state.intent
        if (last and last[0]["status"] not in ("starting", "ready")) or (
            rec is not None and rec.intent in (StopIntent.OPERATOR, StopIntent.MAINTENANCE)
        ):
            self.autostart_pending = False
            self.stay_stopped = True
            ended = f"the last launch ({last[0]['id']}) ended '{last[0]['status']}'" if last else "no launch"
            why = f"stop intent {rec.intent.value} ({rec.who}: {rec.reason})" if rec else ended
            self.state_reason = why
            self._event(
                "staying_stopped",
                f"not launching at start: {why}; {ended}; `sparkd start` launches again",
                severity="warning",
                details={"intent": rec.intent.value if rec else None},
            )

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        if (
            self.settings.container.stop_on_exit
            and self.container_id
            and self.state in ("starting", "ready", "unhealthy")
        ):
            await run_stop(self, "sparkd is stopping (container.stop_on_exit)", "daemon")
        if self._log_stop:
            self._log_stop.set()

    async def on_stop(self, decision: Decision) -> None:
        await self.emergency_stop(f"rule {decision.rule}", decision.reason)

    def running(self) -> bool:
        return self.container_id is not None and self.state in ("starting", "ready", "unhealthy")

    async def emergency_stop(self, source: str, reason: str) -> None:
        """A rule, the hard floor or the probe: stop through the normal procedure, count it once per launch
        toward the breaker, then the relaunch decision (intent ``emergency``)."""
        key, was_running = self.launch_id or self.container_id or "unknown", self.running()
        uptime = time.time() - self.container_started_at if self.container_started_at else None
        ready = self.ready_at is not None
        try:
            await self.request("stop", source=source, reason=reason)
        except SparkdError as e:
            self._event("stop_not_executed", f"{source}: {e.message}", severity="warning")
            if not isinstance(e, Conflict) or self.action != "stopping":
                return
        if was_running:
            await self.unattended.emergency(key, reason)
            if not self.lock.locked():
                self.stay_stopped = False
                await self.unattended.after_down(StopIntent.EMERGENCY, uptime_s=uptime, reached_ready=ready)

    def on_kernel_record(self, rec: KernRecord) -> None:
        if (
            rec.kind in ("oom_kill", "oom_killed")
            and rec.container_id
            and self.container_id
            and (self.container_id.startswith(rec.container_id) or rec.container_id.startswith(self.container_id))
        ):
            self._oom_record = rec

    def observe(self, sample: Sample) -> None:
        self.unattended.observe_mem(sample.mem_available)
        if (
            self.state == "starting"
            and sample.mem_available is not None
            and (self.trough_bytes is None or sample.mem_available < self.trough_bytes)
        ):
            self.trough_bytes = sample.mem_available

    def fast_reason(self) -> str | None:
        return f"container {self.name} starting" if self.state == "starting" else None

    def status_json(self) -> ContainerStatus:
        """The container side of ``Status`` (``sparkd.loop.status.ContainerStatus``).

        While the Docker engine does not answer, ``state`` is ``unknown`` and ``engine`` is ``down``.
        """
        now = time.time()
        state = ContainerState(self.state) if self.engine_up is not False else ContainerState.UNKNOWN
        plan = PlanFigures.model_validate(self.plan_json) if self.plan_json else None
        return ContainerStatus(
            mode="managed" if self.mode == "managed" else "guard",
            name=self.name,
            engine={None: "unknown", True: "up", False: "down"}[self.engine_up],  # type: ignore[arg-type]
            engine_error=self.engine_error,
            state=state,
            state_since=self.state_since,
            state_reason=self.state_reason,
            health=self.health,
            action=self.action,
            container_id=self.container_id,
            image=self.image,
            launch_id=self.launch_id,
            started_at=self.container_started_at,
            uptime_s=(now - self.container_started_at)
            if self.container_started_at and state in RUNNING_STATES
            else None,
            ready_at=self.ready_at,
            trough_bytes=self.trough_bytes,
            revision=self.revision,
            plan=plan,
            gmu=plan.gmu if plan else None,
            memory_bytes=self.mem_limit_bytes,
            stay_stopped=self.stay_stopped,
            restarts_in_window=self._restarts_in_window(),
            busy=self.lock.locked(),
            stops_total=self.stops_total,
            kills_total=self.kills_total,
            supervision=SupervisionStatus.model_validate(self.unattended.status_json()),
        )

    # ------------------------------------------------------------------ control
    async def request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]:
        """start | stop | restart. Raises Conflict (an action is running), Refused, DockerUnavailable."""
        if action not in ("start", "stop", "restart"):
            raise Refused(f"action: {action!r} is not allowed; allowed: start, stop, restart")
        if self.lock.locked():
            raise Conflict(f"already {self.action or 'busy'}", detail={"action": self.action})
        async with self.lock:
            self.action = {"start": "starting", "stop": "stopping", "restart": "restarting"}[action]
            try:
                out: dict[str, Any] = {"action": action}
                if action in ("stop", "restart"):
                    if self.container_id is None or self.state in ("stopped", "exited", "none"):
                        if action == "stop":
                            raise Refused(f"{self.name or 'container'} is not running (state {self.state})")
                    else:
                        rep = await run_stop(self, reason or f"{action} requested by {source}", source)
                        self.set_state("stopped", reason or source)
                        out["stop"] = rep.to_json()
                        self.stay_stopped = action == "stop"
                        await self._finish_launch("stopped")
                        if action == "stop":
                            await self.unattended.set_intent(
                                self.unattended.intent_for(source), source, out_reason(reason, source)
                            )
                if action == "start" and self.container_id and self.state in ("starting", "ready", "unhealthy"):
                    raise Refused(f"{self.name} is already running (state {self.state}); use restart")
                if action in ("start", "restart"):
                    if self.mode != "managed":
                        raise Refused(f"{self.name} is guarded, not launched by sparkd: start it yourself")
                    out["launch_id"] = await self._launch(source, force=force)
                    self.stay_stopped = False
                    await self.unattended.clear_intent(source)
                return out
            finally:
                self.action = None

    async def resize(self, changes: dict[str, Any], *, dry_run: bool, source: str) -> ResizeResult:
        """Dry run: the new plan and the differences, nothing changed. Apply: new revision,
        drain, graceful stop, launch; roll back to the previous revision if the launch fails.

        Raises:
            Refused: not a managed container. InvalidInput: a change out of range.
            Conflict: another action is running.
        """
        if self.mode != "managed":
            raise Refused("resize needs a container sparkd launches (container.image)")
        new_budget = apply_resize(self.budget, changes)
        mem_total = self._mem_total()
        from sparkd.core.budget import make_plan

        sources = setting_sources(new_budget, base=self.settings.budget)
        new_plan = make_plan(budget_inputs(new_budget, self.settings.container, mem_total, sources=sources)).to_json()
        out = ResizeResult(
            plan=PlanFigures.model_validate(new_plan),
            previous=PlanFigures.model_validate(self.plan_json) if self.plan_json else None,
            diff=diff_figures(self.plan_json, new_plan),
            applied=False,
            dry_run=dry_run,
        )
        if dry_run:
            return out
        if self.lock.locked():
            raise Conflict(f"already {self.action or 'busy'}", detail={"action": self.action})
        async with self.lock:
            self.action = "resizing"
            try:
                old_budget, old_rev = self.budget, self.revision
                rev = await self._save_revision(new_budget, who=source, reason=f"resize {changes}")
                diff_text = {k: [c.old, c.new] for k, c in out.diff.items()}
                self._event(
                    "resize", f"resize to revision {rev} by {source}: {diff_text}", details=out.model_dump(mode="json")
                )
                await self._drain()
                if self.container_id and self.state in ("starting", "ready", "unhealthy"):
                    await run_stop(self, f"resize to revision {rev}", source, archive_first=False)
                    await self._finish_launch("stopped")
                self.budget = new_budget
                ok, why = await self._launch_and_wait(source)
                if not ok:
                    self._event(
                        "rollback",
                        f"revision {rev} failed ({why}); rolling back to revision {old_rev}",
                        severity="critical",
                    )
                    if self.container_id and self.state not in ("stopped", "exited", "none"):
                        await run_stop(self, f"rollback from revision {rev}", "sparkd", archive_first=True)
                        await self._finish_launch("failed")
                    self.budget = old_budget
                    await self._save_revision(old_budget, who="sparkd", reason=f"rollback from revision {rev}")
                    ok2, why2 = await self._launch_and_wait("rollback")
                    return out.model_copy(
                        update={"rolled_back": True, "error": why, "rollback_ok": ok2, "rollback_error": why2}
                    )
                return out.model_copy(update={"applied": True, "revision": rev, "launch_id": self.launch_id})
            finally:
                self.action = None

    # ------------------------------------------------------------------ internals
    def _event(self, kind: str, message: str, *, severity: str = "info", details: dict[str, Any] | None = None) -> None:
        if self.daemon:
            self.daemon.event(kind, message, severity=severity, details=details, launch_id=self.launch_id)

    def set_state(self, state: str, reason: str | None = None) -> None:
        if state in ("stopped", "exited", "failed", "none", "stopping"):
            self.health = None
        if state != self.state:
            self.state, self.state_since, self.state_reason = state, time.time(), reason
            self._event(
                f"container_{state}",
                f"{self.name}: {state}" + (f" ({reason})" if reason else ""),
                details={"state": state, "container_id": self.container_id},
            )

    def _mem_total(self) -> int:
        d = self.daemon
        if d and d.guard and d.guard.last and d.guard.last.mem_total:
            return d.guard.last.mem_total
        from sparkd.sense.procfs import read_meminfo

        return read_meminfo(self.settings.proc_root).fields["MemTotal"]

    def _restarts_in_window(self) -> int:
        cut = time.time() - self.settings.container.restart_window_s
        return sum(1 for t in self.restarts if t >= cut)

    async def _load_revision(self) -> None:
        store = self.daemon.store if self.daemon else None
        if store is None:
            return
        revs = await asyncio.to_thread(store.revisions, limit=1)
        base = self.settings.budget.model_dump()
        if revs and revs[0]["data"].get("_config_base") == base:
            data = {k: v for k, v in revs[0]["data"].items() if k != "_config_base"}
            self.budget, self.revision = BudgetSettings(**data), revs[0]["id"]
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

    async def _loop(self) -> None:
        while True:
            try:
                await self._step()
                await self.unattended.periodic()
            except asyncio.CancelledError:
                raise
            except DockerUnavailable as e:
                self._engine_down(str(e))
            except Exception:
                log.exception("supervisor step failed")
            await asyncio.sleep(self.settings.container.health_interval_s)

    def _engine_down(self, why: str) -> None:
        self.engine_error = why
        if self.engine_up is not False:
            self.engine_up = False
            self._event(
                "docker_down",
                f"Docker engine unreachable: {why}; sampling and rules go on (monitor-only)",
                severity="warning",
            )

    async def _step(self) -> None:
        if not await asyncio.to_thread(self.manager.ping):
            self._engine_down("ping failed")
            return
        if self.engine_up is not True:
            if self.engine_up is False:
                self._event("docker_up", "Docker engine reachable again; picking up where sparkd left off")
            self.engine_up, self.engine_error = True, None
            await self._attach()
        if self.container_id is None:
            if self.mode == "guard":
                await self._attach()
            elif self.autostart_pending and not self.stay_stopped and not self.lock.locked():
                self.autostart_pending = False
                try:
                    await self.request("start", source="sparkd start-up")
                except SparkdError as e:
                    self.stay_stopped = True
                    self._event("launch_refused", f"launch refused: {e.message}", severity="critical")
            return
        if self.lock.locked() and self.action in ("stopping", "restarting"):
            return
        try:
            st = await asyncio.to_thread(self.manager.state, self.container_id)
        except NotFound:
            self._event(
                "container_gone",
                f"{self.name} ({self.container_id[:12]}) was removed outside sparkd; staying stopped until "
                "`sparkd start`",
                severity="warning",
            )
            self.container_id = None
            self.stay_stopped = True
            await self._finish_launch("removed")
            self.set_state("none", "container removed outside sparkd")
            return
        if not st.running:
            if self.state not in ("stopping", "stopped", "exited", "failed"):
                await self._exited(st)
            return
        await self._observe_shm(st.pid)
        await self._health()

    async def _attach(self) -> None:
        info = None
        if self.mode == "managed":
            info = await asyncio.to_thread(self.manager.adopt)
        elif self.settings.container.guard:
            info = await asyncio.to_thread(self.manager.guard, self.settings.container.guard)
            if info is not None and info.status != "running":
                info = None
        if info is None:
            return
        if info.id == self.container_id:
            return
        self.container_id, self.image, self.name = info.id, info.image, info.name
        self.launch_id = info.launch_id
        self.container_started_at = info.started_at
        self.launch_started_at = self.launch_started_at or info.started_at
        self.set_state("starting" if self.state == "none" else self.state, "adopted")
        self._event(
            "adopted",
            f"adopted running container {info.name} ({info.id[:12]}), launch {info.launch_id}",
            details={"container_id": info.id, "image": info.image, "launch_id": info.launch_id},
        )
        try:
            ins = await asyncio.to_thread(self.manager.inspect, info.id)
            self.mem_limit_bytes = ins.get("HostConfig", {}).get("Memory") or None
        except SparkdError:
            pass
        if self.daemon and self.daemon.store and info.launch_id:
            rec = await asyncio.to_thread(self.daemon.store.launch, info.launch_id)
            if rec:
                self.plan_json = rec.get("plan")
                self.launch_started_at = rec.get("started_at") or self.launch_started_at
                self.ready_at, self.trough_bytes = rec.get("ready_at"), rec.get("trough_bytes")
        if info.revision not in (None, str(self.revision)) and self.mode == "managed":
            self._event(
                "adopted_other_revision",
                f"{info.name} was launched with configuration revision "
                f"{info.revision}; the current revision is {self.revision} — restart to apply it",
                severity="warning",
            )
        self.unattended.adopted_at_mono = time.monotonic()
        self._follow_logs()

    async def _observe_shm(self, pid: int | None) -> None:
        """Every SHM_WITNESS_INTERVAL_S, what the running container's processes (``pid``: its PID 1 on the
        host) map or hold open in /dev/shm: the evidence of the cleanup after a stop (act/shm.ShmWitness)."""
        cid = self.container_id
        if not cid or time.monotonic() - self._last_shm_observe < SHM_WITNESS_INTERVAL_S:
            return
        self._last_shm_observe = time.monotonic()
        if self.shm_witness is None or self.shm_witness.container_id != cid:
            self.shm_witness = ShmWitness(cid, shm_dir=self.settings.shm_dir, proc_root=self.settings.proc_root)
        await asyncio.to_thread(self.shm_witness.observe, pid)

    async def _health(self) -> None:
        assert self.container_id is not None
        c = self.settings.container
        h = await asyncio.to_thread(health_check, c.port, "127.0.0.1", 2.0)
        now = time.time()
        if h.ok:
            if self.state in ("starting", "none") and self.ready_at is not None:
                self.set_state("ready", "adopted")  # readiness of an adopted launch was recorded when it happened
            elif self.state in ("starting", "none"):
                self.ready_at = now
                t_ready = now - (self.launch_started_at or now)
                self._event(
                    "ready",
                    f"{self.name} /health ready after {t_ready:.1f} s; start-up trough "
                    f"MemAvailable {fmt_gib(self.trough_bytes)}",
                    details={"time_to_ready_s": t_ready, "trough_bytes": self.trough_bytes},
                )
                self.set_state("ready")
                self._save_launch(ready_at=now, trough_bytes=self.trough_bytes, status="ready")
            await self._check_progress()
            await self._check_nvml()
            await self._probe()
        else:
            self.health = h.error
            if self.state == "starting":
                if self.launch_started_at and now - self.launch_started_at > c.startup_timeout_s:
                    why = f"not ready within {c.startup_timeout_s:g} s ({h.error})"
                    self.set_state("failed", why)
                    if not self.lock.locked():  # a resize waits for this itself and rolls back
                        self._bg = asyncio.create_task(self._stop_quietly(why, failed_launch=True))
            elif self.state == "ready":
                self.set_state("unhealthy", f"/health: {h.error}")
            if self.state == "unhealthy":
                await self._probe()
            return
        self.health = "ok" if self.state == "ready" else self.health

    async def _check_progress(self) -> None:
        try:
            cur = await asyncio.to_thread(read_vllm_metrics, self.settings.container.port)
        except MetricsUnavailable:
            return
        prev, self._metrics_prev = self._metrics_prev, cur
        if prev is None:
            return
        self._stall_polls = self._stall_polls + 1 if progress_stalled(prev, cur) else 0
        if self._stall_polls >= 3 and self.state == "ready":
            self.set_state(
                "unhealthy",
                f"answers /health but no token progress with "
                f"{cur.get('num_requests_running', 0):g} running, {cur.get('num_requests_waiting', 0):g} "
                f"waiting for {self._stall_polls} polls",
            )
        elif self._stall_polls == 0 and self.state == "unhealthy":
            self.set_state("ready", "progress resumed")

    async def _check_nvml(self) -> None:
        """On GPU hosts: detect the container losing its GPU after a daemon-reload, and recreate it."""
        if self.mode != "managed" or time.monotonic() - self._last_nvml_check < 60:
            return
        self._last_nvml_check = time.monotonic()
        try:
            if not await asyncio.to_thread(self.manager.has_nvidia_runtime):
                return
            _rc, out = await asyncio.to_thread(self.manager.exec, self.container_id or "", ["nvidia-smi", "-L"])
        except SparkdError:
            return
        if NVML_LOST in out.decode(errors="replace"):
            self._event("gpu_lost", f"{self.name} lost GPU access ({NVML_LOST}); recreating it", severity="critical")
            self._bg = asyncio.create_task(
                self.request("restart", source="sparkd (GPU lost)", reason="GPU access lost")
            )

    async def _stop_quietly(self, reason: str, *, failed_launch: bool = False) -> None:
        source = "sparkd (failed launch)" if failed_launch else "sparkd"
        try:
            await self.request("stop", source=source, reason=reason)
        except SparkdError as e:
            self._event("stop_not_executed", f"{reason}: {e.message}", severity="warning")
            return
        if failed_launch:
            self.stay_stopped = False
            await self.unattended.after_down(StopIntent.FAILED_LAUNCH, uptime_s=None, reached_ready=False)

    async def _probe(self) -> None:
        """The completion probe (loop.unattended) while the model is up; the start-up phase from the launch log."""
        rec = self.parser.record if self.parser else None
        phase = rec.state if rec is not None and rec.lines_seen and rec.state != "failed" else None
        waiting = (self._metrics_prev or {}).get("num_requests_waiting")
        await self.unattended.probe(
            ready=self.state in ("ready", "unhealthy"), requests_waiting=waiting, startup_phase=phase
        )
        if self.container_started_at:
            await self.unattended.on_up(time.time() - self.container_started_at)

    async def _exited(self, st: Any) -> None:
        oom = self._oom_record
        how = f"exit code {st.exit_code}, OOMKilled={st.oom_killed}"
        if oom is not None:
            how += (
                f"; the kernel log shows an OOM kill of pid {oom.pid} ({oom.comm}) in this container "
                f"(Docker reports OOMKilled={st.oom_killed})"
            )
            self._event(
                "oom_kill_attributed",
                f"{self.name} was OOM-killed by the kernel: {oom.message}",
                severity="critical",
                details={"line": oom.raw, "pid": oom.pid},
            )
        self.set_state("exited", how)
        await self._finish_launch("oom_killed" if oom else "exited")
        if self.container_id:  # an exit nobody asked for gets its postmortem too
            from sparkd.act.stop import StopReport, write_postmortem

            rep = StopReport(f"container exited unexpectedly: {how}", "sparkd")
            name = await write_postmortem(self, rep, self.container_id)
            self._event(
                "exited",
                f"{self.name} exited unexpectedly ({how}); archive {name or 'none'}",
                severity="critical",
                details={
                    "exit_code": st.exit_code,
                    "oom_killed": st.oom_killed,
                    "kernel_oom_kill": oom is not None,
                    "archive": name,
                },
            )
        c = self.settings.container
        if (
            self.mode == "managed"
            and c.auto_restart
            and not self.stay_stopped
            and self._restarts_in_window() >= c.restart_cap
        ):
            self._event(
                "restart_cap",
                f"auto-restart cap reached ({c.restart_cap} per {c.restart_window_s:g} s): staying stopped",
                severity="critical",
            )
            self.stay_stopped = True
            return
        if self.mode == "managed" and not self.stay_stopped:
            reached = self.ready_at is not None
            uptime = time.time() - self.container_started_at if self.container_started_at else None
            intent = StopIntent.EXITED if reached else StopIntent.FAILED_LAUNCH
            d = await self.unattended.after_down(intent, uptime_s=uptime, reached_ready=reached)
            if d.action == "relaunch":
                self.restarts.append(time.time())

    async def _launch(self, source: str, *, force: bool = False) -> str:
        d = self.daemon
        assert d is not None
        s = self.settings.model_copy(update={"budget": self.budget})
        plan = plan_for(s, self._mem_total(), base=self.settings.budget)
        spec = launch_spec(s, plan)
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
        )
        if not pf.ok and not force:
            self._event(
                "preflight_failed", f"launch refused: {pf.describe()}", severity="critical", details=pf.to_json()
            )
            raise Refused(f"preflight failed: {'; '.join(pf.failures)} (--force overrides)", detail=pf.to_json())
        for old in managed:  # a stopped container of ours with the same name blocks the new one
            if old.name == spec.name and old.status != "running":
                await asyncio.to_thread(self.manager.remove, old.id)
        launch_id = uuid.uuid4().hex[:12]
        self.launch_id, self.plan_json = launch_id, plan.to_json() if plan else None
        self.launch_started_at, self.ready_at, self.trough_bytes = time.time(), None, None
        self._oom_record, self._metrics_prev, self._stall_polls = None, None, 0
        self.container_id = await asyncio.to_thread(self.manager.launch, spec, launch_id, self.revision or 0)
        info = await asyncio.to_thread(self.manager.get, self.container_id)
        self.image, self.name, self.container_started_at = info.image, info.name, info.started_at
        self.mem_limit_bytes = spec.mem_limit_bytes
        self._figures_saved = set()
        self._save_launch(
            status="starting",
            started_at=self.launch_started_at,
            container_id=self.container_id,
            image=spec.image,
            revision=self.revision,
            plan=self.plan_json,
            forced=bool(force and not pf.ok),
            actual={"preflight": pf.to_json(), "args": spec.command},
        )
        self.set_state("starting", f"launched by {source}")
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

    async def relaunch_same_plan(self, source: str) -> tuple[bool, str | None]:
        """Stop (graceful, archived) and launch the same plan, waiting for ready. Raises Conflict when busy."""
        if self.lock.locked():
            raise Conflict(f"already {self.action or 'busy'}", detail={"action": self.action})
        async with self.lock:
            self.action = "relaunching"  # not "restarting": the supervisor step must keep watching for ready
            try:
                if self.running():
                    await run_stop(self, f"relaunch: {source}", source)
                    self.set_state("stopped", source)
                    await self._finish_launch("stopped")
                return await self._launch_and_wait(source)
            finally:
                self.action = None

    async def _launch_and_wait(self, source: str) -> tuple[bool, str | None]:
        try:
            await self._launch(source)
        except SparkdError as e:
            return False, e.message
        deadline = time.monotonic() + self.settings.container.startup_timeout_s
        while time.monotonic() < deadline:
            if self.state == "ready":
                return True, None
            if self.state in ("exited", "failed"):
                return False, self.state_reason
            await asyncio.sleep(0.2)
        self.set_state("failed", f"not ready within {self.settings.container.startup_timeout_s:g} s")
        return False, self.state_reason

    async def _drain(self) -> None:
        """Wait until vLLM reports no running or waiting requests (an unreadable count is not zero)."""
        if not self.container_id or self.state not in ("ready", "unhealthy"):
            return
        deadline = time.monotonic() + self.settings.container.drain_timeout_s
        last: str = "unknown"
        while time.monotonic() < deadline:
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
            base = dict(cols.get("actual") or {})
            base.update(self.parser.record.to_json() if self.parser else {})
            row["actual"] = base
        if "started_at" not in row:
            row["started_at"] = self.launch_started_at or time.time()
        if "status" not in row and actual_figures is None:
            row["status"] = self.state
        d.writer.submit("launch", row)

    async def _finish_launch(self, status: str) -> None:
        """How a launch ended, written at once (not through the queue): a restart of sparkd reads it to decide
        whether to launch again, so it must survive a crash right after the stop."""
        d = self.daemon
        if not d or not d.store or not self.launch_id:
            return
        row = {
            "id": self.launch_id,
            "status": status,
            "stopped_at": time.time(),
            "started_at": self.launch_started_at or time.time(),
        }
        try:
            await asyncio.to_thread(d.store.save_launch, row)
        except Exception as e:
            log.warning("launch record not written directly (%s); queued", e)
            self._save_launch(status=status, stopped_at=row["stopped_at"])
