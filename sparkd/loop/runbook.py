"""One run of the container, as the supervisor executes ``core.lifecycle`` effects on it:
adopting a run (first sight or started outside sparkd), readiness, the /health and progress
probe (``check_health``), an exit nobody asked for (``handle_exit``) and the managed auto-restart
(``maybe_restart``), the stop (``_stop``, executing ``act.stop.run_stop``).
``loop.supervisor.Supervisor`` inherits it; split out to keep each module readable.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sparkd.act import shm
from sparkd.act.containerspec import swap_allowance_bytes
from sparkd.act.procstop import ProcessStopper
from sparkd.act.stop import (
    ARCHIVE_NOT_WAITED,
    ArchiveFate,
    ExitSeen,
    Stopper,
    StopReport,
    StopTarget,
    run_stop,
    unheard,
    witness_before_stop,
    write_postmortem,
)
from sparkd.core.lifecycle import ACTIVE_STATES, ContainerState, Observation, Probe, Step, transition
from sparkd.core.sample import usable_bytes
from sparkd.core.supervision import EXITED_SOURCE, StopIntent, restart_policy_risk
from sparkd.errors import Conflict, DockerUnavailable, NotFound, Refused, SparkdError
from sparkd.loop.launchbook import LaunchBook, stored_plan
from sparkd.loop.status import LastStopStatus
from sparkd.sense import procfs
from sparkd.sense.vllm_http import MetricsUnavailable, health_check, progress_stalled, read_vllm_metrics
from sparkd.store.supervision_state import LastStopRecord
from sparkd.units import fmt_gib, parse_size

NVML_LOST = "Failed to initialize NVML: Unknown Error"


class RunBook(LaunchBook):
    """Effects on the current run. Attributes are set by ``Supervisor.__init__``."""

    restarts: Any  # collections.deque[float]: auto-restarts and Docker restarts (UTC epoch)
    seen_started_at: float | None
    seen_restart_count: int | None
    _last_nvml_check: float
    _bg: asyncio.Task[Any] | None
    _failed_stop_pending: tuple[str | None, str] | None  # a failed launch's stop left for a free lock (``_step``)
    shm_witness: shm.ShmWitness | None

    stops_total: int
    kills_total: int
    engine_error: str | None  # why the Docker engine did not answer, while it does not
    _policy_said: set[str | None]  # containers whose restart policy was said (``_say_restart_policy``)
    auto_remove: bool = False  # the run's ``HostConfig.AutoRemove`` (`docker run --rm`), read at adoption
    _state_before: ContainerState = ContainerState.NONE  # the state before the transition being applied (``apply``)
    # the last stop ``_stop`` made: (when it began, epoch s; who asked; what became of its archive)
    last_stop: tuple[float, str, ArchiveFate] | None = None

    def _record_state(self, state: ContainerState, reason: str | None) -> None:
        raise NotImplementedError

    async def reconcile(self, *, probe: bool, detail: str | None = None) -> Observation:
        raise NotImplementedError

    async def observe_docker(self, *, probe: bool, detail: str | None = None) -> Observation:
        raise NotImplementedError

    async def apply(self, step: Step, obs: Observation) -> None:
        raise NotImplementedError

    async def request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _restarts_in_window(self) -> int:
        raise NotImplementedError

    async def _take_run(self, obs: Observation, *, first_sight: bool) -> None:
        """This run of the container is the one guarded now: its start time (the /dev/shm age
        test of the next stop), fresh run figures, its log."""
        assert self.container_id is not None
        self.container_started_at = obs.started_at
        self.launch_started_at = (self.launch_started_at or obs.started_at) if first_sight else obs.started_at
        self._oom_record, self._metrics_prev, self._stall_polls = None, None, 0
        self.unattended.new_run()  # "5 probes in a row" are this run's: 4 of the last one's and 1 stopped it
        # a run first seen already running: its `ready` reads memory under a load of unknown age (not "healthy")
        self.first_sight = first_sight
        if first_sight:
            await self._adopted(obs)
        else:
            self.ready_at, self.trough_bytes, self.stay_stopped = None, None, False
            if self.mode == "managed":
                self._save_launch(status="starting")
        self._say_restart_policy(obs)
        self._follow_logs()

    def _say_restart_policy(self, obs: Observation) -> None:
        """A restart policy that undoes sparkd's stop (``core.supervision.restart_policy_risk``: ``always``), said
        once per container as a warning when its run is taken: nothing said so before a dockerd restart brought a
        stopped model back (helper-43). sparkd launches its own containers with ``no``."""
        risk = restart_policy_risk(self.name, obs.restart_policy)
        if risk is None or self.container_id in self._policy_said:
            return
        self._policy_said.add(self.container_id)
        self._event(
            "restart_policy_undoes_stop",
            risk,
            severity="warning",
            details={"container_id": self.container_id, "restart_policy": obs.restart_policy},
        )

    async def _adopted(self, obs: Observation) -> None:
        assert self.container_id is not None
        self.unattended.adopted_at_mono = time.monotonic()  # the completion probe waits out its grace
        cid = self.container_id
        self._event(
            "adopted",
            f"adopted running container {self.name} ({cid[:12]})"
            + (
                f", launch {self.launch_id}"
                if self.launch_id
                # guard mode: there is never a launch record; "no launch record" read as something missing (helper-39)
                else ": guarding it (guard mode, started outside sparkd)"
                if self.mode != "managed"
                else " (not launched by sparkd: no launch record)"
            ),
            details={
                "container_id": cid,
                "image": self.image,
                "launch_id": self.launch_id,
                "started_at": obs.started_at,
            },
        )
        try:
            ins = await asyncio.to_thread(self.manager.inspect, cid)  # --memory: taken from the observation
            revision = (ins.get("Config", {}).get("Labels") or {}).get("sparkd.config_revision")
            self.auto_remove = bool((ins.get("HostConfig") or {}).get("AutoRemove"))
        except SparkdError:
            revision = None
        if self.daemon and self.daemon.store and self.launch_id:
            rec = await asyncio.to_thread(self.daemon.store.launch, self.launch_id)
            if rec:
                self.plan_json = stored_plan(rec.get("plan"))
                self.launch_started_at = rec.get("started_at") or self.launch_started_at
                self.ready_at, self.trough_bytes = rec.get("ready_at"), rec.get("trough_bytes")
                self.ready_timed = self.ready_at is not None
        if revision not in (None, str(self.revision)) and self.mode == "managed":
            self._event(
                "adopted_other_revision",
                f"{self.name} was launched with configuration revision "
                f"{revision}; the current revision is {self.revision} — restart to apply it",
                severity="warning",
            )

    def _follow_memory_limit(self, memory_bytes: int | None, memory_swap_bytes: int | None = None) -> None:
        """Docker's ``--memory`` and ``--memory-swap`` as ``docker inspect`` reads them now (``HostConfig.Memory``
        and ``MemorySwap`` in bytes; ``memory_bytes`` 0: unlimited, None: not read, nothing changes). A ``docker
        update`` by hand is shown in the status from the next observation (it kept the launch's figure, note 11)
        and said once (``memory_limit_changed``): a warning when sparkd manages the container (the plan's budget
        assumed the old limit), info when it only guards it. When the change lets the container swap (``docker
        update --memory`` below its ``--memory-swap``: Docker keeps the old ``--memory-swap``, and the difference
        becomes swap; sparkd launches with none, CONTEXT.md) the event says so: a warning in either mode. The swap
        of a run just launched is taken from its first reading without a word (a host without swap accounting
        stores -1 for "no swap")."""
        if memory_bytes is None:
            return
        swap = swap_allowance_bytes(memory_bytes, memory_swap_bytes)
        if self.mem_swap_bytes is None:
            self.mem_swap_bytes = swap
        memory_changed = (memory_bytes or None) != self.mem_limit_bytes
        swap_changed = swap != self.mem_swap_bytes
        if not memory_changed and not swap_changed:
            return
        was, self.mem_limit_bytes = self.mem_limit_bytes, memory_bytes or None
        was_swap, self.mem_swap_bytes = self.mem_swap_bytes, swap

        def said(b: int | None) -> str:
            return fmt_gib(b) if b else "unlimited"

        parts = []
        if memory_changed:
            parts.append(f"Docker's --memory is {said(self.mem_limit_bytes)} now, was {said(was)}")
        if swap_changed and swap:
            allowed = "unlimited swap (--memory-swap -1)" if swap == -1 else f"{fmt_gib(swap)} of swap beyond --memory"
            parts.append(
                f"the container may use {allowed} where the host has swap (sparkd launches with none: "
                "--memory-swap equal to --memory). Swapping a model's memory slows the host before MemAvailable "
                "trips a rule; `docker update --memory M --memory-swap M` takes it back"
            )
        elif swap_changed and self.mem_limit_bytes:
            parts.append("the container may no longer swap (--memory-swap equal to --memory)")
        if not parts:  # only the swap of a container without --memory changed: neither is limited
            return
        message = f"{self.name}: " + "; ".join(parts) + " (changed outside sparkd: docker update)"
        if self.mode == "managed" and memory_changed:
            message += "; the plan's budget assumed the old limit, and the next launch sets the plan's again"
        self._event(
            "memory_limit_changed",
            message,
            severity="warning" if self.mode == "managed" or swap else "info",
            details={
                "container_id": self.container_id,
                "memory_bytes": self.mem_limit_bytes,
                "was_bytes": was,
                "swap_bytes": swap,
                "was_swap_bytes": was_swap,
            },
        )

    async def _forget(self) -> None:
        assert self.container_id is not None
        if self.auto_remove and self._state_before in ACTIVE_STATES:
            await self._exited_and_removed(self.container_id)
        else:
            by_docker = self.auto_remove  # its exit was said (``exited``); Docker removed it after, as --rm asks
            how = (
                "was removed by Docker after its exit (docker run --rm)" if by_docker else "was removed outside sparkd"
            )
            then = (
                "staying stopped until `sparkd start`" if self.mode == "managed" else "guarding it again once it runs"
            )
            self._event(
                "container_gone",
                f"{self.name} ({self.container_id[:12]}) {how}; {then}",
                severity="info" if by_docker else "warning",
            )
        self.auto_remove = False  # the next run's own flag is read when it is taken
        self.container_id, self.seen_started_at, self.seen_restart_count = None, None, None
        self.stay_stopped = True

    async def _exited_and_removed(self, cid: str) -> None:
        """`docker run --rm` (vLLM's usual way): the run ended on its own and Docker removed it before a look read its
        exit (a poll a second apart races Docker's removal: a crash read "removed outside sparkd", a warning, about
        one time in two, helper-49's test). Its exit code and its log are lost with it: said as the exit it was, with
        the postmortem of what is left (samples, events, kernel lines; it had none, its log being gone)."""
        kernel_oom = _oom_process(self._oom_record)
        how = (
            f"the kernel log shows an OOM kill of {kernel_oom} in this container"
            if kernel_oom
            else "a crash cannot be told from a clean exit here"
        )
        said = "exited unexpectedly and Docker removed it at once (docker run --rm)"
        rep = StopReport(f"container {said}: {how}", EXITED_SOURCE)
        name = await write_postmortem(self, rep, cid, exited=ExitSeen(kernel_oom=kernel_oom, auto_removed=True))
        self._event(
            "exited",
            f"{self.name} ({cid[:12]}) {said} before sparkd read its exit code: {how}; its log went with it: archive "
            f"{name or 'none'} (what is left: samples, events, kernel lines)",
            severity="critical",
            details={
                "exit_code": None,
                "removed": False,
                "auto_remove": True,
                "archive": name,
                "kernel_oom_kill": kernel_oom is not None,
            },
        )

    def _mark_ready(self) -> None:
        if self.ready_at is not None:
            return  # readiness of an adopted launch was recorded when it happened
        now = time.time()
        self.ready_at = now
        # a run first seen running: its /health answered after its adoption, which times nothing of its start-up
        self.ready_timed = not self.first_sight
        t_ready = now - (self.launch_started_at or now) if self.ready_timed else None
        after = f"after {t_ready:.1f} s" if t_ready is not None else "(first seen running: its start-up not timed)"
        self._event(
            "ready",
            f"{self.name} /health ready {after}; start-up trough of usable memory {fmt_gib(self.trough_bytes)}",
            # adopted: a run first seen running (sparkd restarted beside it, guard mode): the loop guard does not
            # take this moment's MemAvailable as the model's healthy figure (helper-32)
            details={"time_to_ready_s": t_ready, "trough_bytes": self.trough_bytes, "adopted": self.first_sight},
        )
        self._save_launch(ready_at=now, trough_bytes=self.trough_bytes, status="ready")

    async def check_health(self) -> tuple[Probe, str | None]:
        """vLLM's /health, then token progress and (managed, GPU hosts) NVML: the probe and why."""
        h = await asyncio.to_thread(health_check, self.settings.container.port, "127.0.0.1", 2.0)
        if not h.ok:
            return Probe.FAILING, h.error
        stall = await self._progress_stall()
        await self._check_nvml()
        return (Probe.STALLED, stall) if stall else (Probe.OK, None)

    async def _progress_stall(self) -> str | None:
        """Why the server makes no progress (3 polls without tokens while requests wait), or None."""
        try:
            cur = await asyncio.to_thread(read_vllm_metrics, self.settings.container.port)
        except MetricsUnavailable:
            return None
        prev, self._metrics_prev = self._metrics_prev, cur
        if prev is None:
            return None
        self._stall_polls = self._stall_polls + 1 if progress_stalled(prev, cur) else 0
        if self._stall_polls < 3:
            return None
        return (
            f"answers /health but no token progress with "
            f"{cur.get('num_requests_running', 0):g} running, {cur.get('num_requests_waiting', 0):g} "
            f"waiting for {self._stall_polls} polls"
        )

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

    def _stop_not_executed(self, said: str, e: SparkdError, *, busy_is_warning: bool = False) -> None:
        """Say ``stop_not_executed`` for a stop that raised ``e``: a warning marked ``nothing_running`` when nothing
        runs (``Refused.reason == "not_running"``: the rules keep their cooldown), else critical, the model may run on
        (the engine refused the stop: a container without sparkd's label, Docker's own 409). ``busy_is_warning``: an
        error that is not a ``Refused`` (Docker busy, an action holding the lock) is a warning, the caller's next try
        acts again (``emergency_stop``: the next trip)."""
        nothing = isinstance(e, Refused) and e.reason == "not_running"
        critical = not nothing and (isinstance(e, Refused) or not busy_is_warning)
        self._event(
            "stop_not_executed",
            said,
            severity="critical" if critical else "warning",
            details={"nothing_running": True} if nothing else None,
        )

    async def _stop_quietly(self, reason: str) -> None:
        """A launch that never became ready: stop it, then the relaunch decision (intent ``failed_launch``).

        A stop not made is ``stop_not_executed``: a warning marked ``nothing_running`` when nothing runs
        (``Refused.reason == "not_running"``), else critical (the engine refused it, a container without sparkd's
        label; Docker's own 409): the failed launch may run on, holding its memory, as ``_stop_as_asked`` says it.
        An action holding the lock leaves the stop for a free lock (``_failed_stop_pending``), unsaid."""
        cid = self.container_id
        rec = self.unattended.state.intent
        # a maintenance run's relaunch that failed: its intent holds the model stopped (smoke_failed says so) until
        # the window expires; the stop keeps it, and decides no relaunch (helper-52)
        maintenance = rec is not None and rec.intent is StopIntent.MAINTENANCE
        source = "maintenance (failed launch)" if maintenance else "sparkd (failed launch)"
        try:
            await self.request("stop", source=source, reason=reason)
        except SparkdError as e:
            if isinstance(e, Conflict) and isinstance(e.detail, dict) and "action" in e.detail:
                # an action took the lock first (an operator's resize, a maintenance run): the stop waits for it, at
                # the supervisor's first step with the lock free, if this run is still up and failed; said as
                # stop_not_executed, it was never tried again and the model ran on, shown "failed" (helper-51).
                # Docker's own 409 has no such detail: said, as any refusal
                self._failed_stop_pending = (cid, reason)
                return
            self._stop_not_executed(f"{source}: {reason}: {e.message}", e)
            return
        if maintenance and rec is not None:
            # the maintenance's own record: its start, who began it and its expiry clock (the stop's request replaced
            # it with one of its own, resetting the window and its alert, helper-54)
            self.unattended.state.intent = rec
            await self.unattended.save()
            return
        if self.mode == "managed":
            self.stay_stopped = False
            await self.unattended.after_down(StopIntent.FAILED_LAUNCH, uptime_s=None, reached_ready=False)

    async def handle_exit(self, obs: Observation) -> None:
        """An exit nobody asked for: the kernel's OOM attribution, the launch record, a postmortem."""
        oom, kernel_oom = self._oom_record, _oom_process(self._oom_record)
        how = f"exit code {obs.exit_code}, OOMKilled={obs.oom_killed}"
        if oom is not None:
            how += (
                f"; the kernel log shows an OOM kill of {kernel_oom} in this container "
                f"(Docker reports OOMKilled={obs.oom_killed})"
            )
            self.state_reason = how
            self._event(
                "oom_kill_attributed",
                f"{self.name} was OOM-killed by the kernel: {oom.message}",
                severity="critical",
                details={"line": oom.raw, "pid": oom.pid},
            )
        await self._finish_launch("oom_killed" if oom else "exited")
        if self.container_id:
            # nobody of sparkd's asked for it: "requested by: sparkd" in summary.txt read as a guard stop (helper-37).
            # Exit code 0 is a clean exit (the server ended, or `docker stop` outside sparkd: its SIGTERM): a warning,
            # not the critical alert of a crash
            clean = obs.exit_code == 0 and not obs.oom_killed and oom is None
            # `docker rm -f` (compose down, a recreate) kills it to remove it: exit 137, read as a crash, paged
            # (helper-48). Docker says so: the container is gone, or being removed
            removed = (
                oom is None
                and not obs.oom_killed
                and obs.exit_code == 137  # the SIGKILL of `docker rm -f`; a crash's exit code is its own
                and await self._being_removed(self.container_id)
            )
            rep = StopReport(f"container exited unexpectedly: {how}", EXITED_SOURCE)
            seen = ExitSeen(obs.exit_code, obs.oom_killed, kernel_oom)
            name = await write_postmortem(self, rep, self.container_id, exited=seen)
            also = " (a clean exit: the server ended, or it was stopped outside sparkd)" if clean else ""
            said = f"{self.name} exited unexpectedly ({how}){also}"
            if removed:
                said = (
                    f"{self.name} was removed outside sparkd (docker rm -f, compose down or a recreate): its removal "
                    f"ended it ({how}), not a crash"
                )
            self._event(
                "exited",
                f"{said}; archive {name or 'none'}",
                severity="warning" if clean or removed else "critical",
                details={
                    "exit_code": obs.exit_code,
                    "oom_killed": obs.oom_killed,
                    "kernel_oom_kill": oom is not None,
                    "archive": name,
                    "removed": removed,
                },
            )

    async def _being_removed(self, cid: str) -> bool:
        """Docker no longer has ``cid``, or is removing it (``State.Status`` ``removing``) and not on its own
        (``docker run --rm``, ``HostConfig.AutoRemove``: removed after any exit, a crash too: helper-49). False when
        the engine cannot say (a crash stays a crash)."""
        try:
            ins = await asyncio.wait_for(asyncio.to_thread(self.manager.inspect, cid), 5)
        except NotFound:
            return not self.auto_remove
        except Exception:
            return False
        if (ins.get("HostConfig") or {}).get("AutoRemove"):
            return False
        return (ins.get("State") or {}).get("Status") == "removing"

    async def maybe_restart(self) -> None:
        """Managed: the relaunch decision of loop.unattended (back-off, breaker, intent ``exited``, or
        ``failed_launch`` when the run never became ready), under the ``container.restart_cap``."""
        c = self.settings.container
        if self.mode != "managed" or self.stay_stopped:
            return
        if c.auto_restart and self._restarts_in_window() >= c.restart_cap:
            self._event(
                "restart_cap",
                f"auto-restart cap reached ({c.restart_cap} per {c.restart_window_s:g} s): staying stopped",
                severity="critical",
            )
            self.stay_stopped = True
            return
        reached = self.ready_at is not None
        uptime = time.time() - self.container_started_at if self.container_started_at else None
        intent = StopIntent.EXITED if reached else StopIntent.FAILED_LAUNCH
        d = await self.unattended.after_down(intent, uptime_s=uptime, reached_ready=reached)
        if d.action == "relaunch":
            self.restarts.append(time.time())

    def _signalled(self) -> None:
        """``run_stop``'s ``signalled``: the SIGTERM goes out next, so the API reads again (``ReadHold``, held by
        ``Supervisor.emergency_stop``; without a hold on, nothing happens)."""
        if self.daemon is not None:
            self.daemon.read_hold.release_any()

    async def _stop(
        self,
        reason: str,
        source: str,
        *,
        stopper: ProcessStopper | None = None,
        grace_s: float | None = None,
        engine_said: str | None = None,
    ) -> StopReport:
        """STOP_REQUESTED (state ``stopping``), the stop procedure (``act.stop.run_stop``) with its
        dependencies handed in, then Docker's state read again (``stopped``).

        ``stopper``: the Docker engine does not answer; the container is stopped by its processes
        (``act.procstop``), its archive written after the stop without the engine's parts
        (``container.log``, ``inspect.json``: missing, with the reason), and no read of Docker's state
        after (the state stays ``stopping`` until the engine answers and the supervisor's next look).
        ``grace_s``: the SIGTERM grace (s); None: ``container.stop_timeout_s``.

        Raises DockerUnavailable when, through Docker, the stop is not confirmed (``StopReport.confirmed``: the
        engine hung in it or failed; a ``stop_unconfirmed`` event says so): an emergency (``emergency_stop``, a
        stop handed over to a relaunch or resize), an operator's stop (``Supervisor.request``) and sparkd's own
        stop at exit then stop the container by its processes; a restart, a resize or a relaunch ends with the
        error, launching nothing. Raises Refused when the engine refused the stop (not sparkd's to stop; no ``reason``:
        the model may run on, never read as ``not_running``)."""
        assert self.container_id is not None
        prior = self.state
        step = transition(self.state, Observation(stopping=True, detail=reason, name=self.name))
        self._record_state(step.state, step.reason)
        s, cid = self.settings, self.container_id
        if stopper is not None:
            cid = stopper.container_id  # the container it was made for (the supervisor's id may move meanwhile)
        keeper: Stopper = stopper if stopper is not None else self.manager
        reader = procfs.ProcReader(s.proc_root)

        witness: list[shm.ShmWitness] = []

        async def before_stop(rep: StopReport) -> None:
            w = await witness_before_stop(
                self.shm_witness, keeper, cid, shm_dir=s.shm_dir, proc_root=s.proc_root, rep=rep
            )
            witness.append(w)

        def cleanup_shm(started_at: float | None, stopped_at: float) -> shm.CleanupResult:
            return shm.cleanup(
                container_started_at=started_at,
                shm_dir=s.shm_dir,
                proc_root=s.proc_root,
                ignore_unreadable_pids=s.shm_ignore_unreadable_pids,
                witness=witness[0] if witness else None,
                container_stopped_at=stopped_at,
            )

        # what the engine did instead of serving the stop, for the archive's missing parts: it refused (the engine up,
        # ``engine_error`` unset: it read "does not answer (no answer)", helper-54), or it does not answer
        engine_error = None if stopper is None else (engine_said or self.engine_error or "the Docker engine: no answer")

        fate = ArchiveFate()
        self.last_stop = (time.time(), source, fate)
        # kept in supervision.json as it changes (a restart of sparkd read no archive warning for a stop before it);
        # not saved here, ahead of the stop: with the archive's fate, or with the intent's next save
        self.unattended.state.last_stop = LastStopRecord(self.last_stop[0], source)
        fate.on_change = lambda: self._keep_last_stop(fate)

        async def postmortem(rep: StopReport) -> str | None:
            return await write_postmortem(self, rep, cid, engine_error=engine_error, fate=fate)

        try:
            rep = await run_stop(
                StopTarget(cid, self.name, self.container_started_at, self.launch_id),
                keeper,
                reason=reason,
                source=source,
                grace_s=s.container.stop_timeout_s if grace_s is None else grace_s,
                hard_floor_bytes=parse_size(s.container.hard_floor),
                read_usable=lambda: _usable(reader.meminfo().fields),  # the stop lines' measure (helper-47)
                emit=self._event,
                postmortem=postmortem,
                archive_after=stopper is not None,  # nothing from the engine in it: the SIGTERM first
                before_stop=before_stop,
                cleanup_shm=cleanup_shm,
                signalled=self._signalled,
            )
        finally:
            reader.close()
        delayed = next((e for e in rep.errors if e.startswith(ARCHIVE_NOT_WAITED)), None)
        if delayed is not None and fate.name is None and fate.error is None:  # still being written in the background
            fate.failed(
                f"the stop did not wait for it ({delayed.removeprefix(ARCHIVE_NOT_WAITED)}); still being written"
            )
        self.stops_total += 1
        self.kills_total += rep.killed
        if stopper is None and not rep.confirmed:
            # never read as stopped. The engine hung in the stop (or failed): an emergency stops the processes.
            # The engine refused it (not sparkd's to stop): said, never escalated to the processes
            why = f"the stop of {self.name} is not confirmed: {rep.engine_hung or '; '.join(rep.errors)[:400]}"
            if rep.engine_hung is None:  # the engine answered (refused, or failed): its state read now
                await self._state_after_stop_not_done(prior, why)
            raise Refused(why) if rep.refused and rep.engine_hung is None else DockerUnavailable(why)
        if stopper is None:
            await self.reconcile(probe=False, detail=reason)
        return rep

    async def _state_after_stop_not_done(self, prior: ContainerState, why: str) -> None:
        """A stop through Docker that the engine refused or failed while answering (``StopReport.engine_hung`` unset):
        the state as Docker has it now, not ``stopping`` for a model that runs on (``core.lifecycle`` keeps
        ``stopping`` for as long as the run is up: the dashboard and `sparkd status` said "stopping" until it exited).

        Docker says the run is up (or restarting): back to ``prior``, the state before the stop (``stopped`` when that
        was ``stopping``: a stop made by the processes, whose run Docker's restart policy brought back), the
        observation read from it. It has exited: the transition from ``stopping`` (``stopped``; gone: ``stopping``
        stays, as after a stop that was made). The look fails: ``prior``. A state another stop moved meanwhile (by the
        processes) is left as it is. An engine hung in the stop is not looked at (its stop may still land; the caller
        stops the processes): ``stopping`` stays."""
        if self.state is not ContainerState.STOPPING:
            return
        said = f"the stop was not executed: {why}"
        try:
            async with self._obs_lock:
                obs = await self.observe_docker(probe=False, detail=said)
                if obs.exists and obs.engine_up and (obs.running or obs.restarting):
                    back = ContainerState.STOPPED if prior is ContainerState.STOPPING else prior
                    self._record_state(back, said)
                await self.apply(transition(self.state, obs), obs)
        except Exception as e:  # the engine went, or refused to say: the state before the stop, said so
            self._record_state(prior, f"{said}; Docker's state not read ({e})")

    def _keep_last_stop(self, fate: ArchiveFate) -> None:
        """``ArchiveFate.on_change``: the last stop's archive as it stands, into ``supervision.json`` (a save in the
        background, on the event loop's thread; a save that fails is said and tried again as any). A fate of a stop
        no longer the last is left alone."""
        rec = self.unattended.state.last_stop
        if self.last_stop is None or self.last_stop[2] is not fate or rec is None or rec.at != self.last_stop[0]:
            return
        rec.archive, rec.archive_error = fate.name, fate.error
        try:
            task = asyncio.get_running_loop().create_task(self.unattended.save())
        except RuntimeError:  # no event loop in this thread: saved with the next save
            return
        task.add_done_callback(unheard)

    def last_stop_status(self) -> LastStopStatus | None:
        """``ContainerStatus.last_stop``: the last stop ``_stop`` made, its archive as it stands now (written late,
        or given up on), and whether the stop intent that holds now is on disk (``Unattended.unsaved``).

        After a restart of sparkd: the last stop as ``supervision.json`` kept it (``LastStopRecord``). An archive it
        did not say written then is not written by this sparkd: held in memory for a retry, it went with the exit
        (``archive_error`` says so); a stop whose archive was still being written is not known to have one."""
        if self.last_stop is not None:
            at, source, fate = self.last_stop
            archive, error = fate.name, fate.error
        elif (rec := self.unattended.state.last_stop) is not None:
            at, source, archive, error = rec.at, rec.source, rec.archive, rec.archive_error
            if archive is None and not (error or "").startswith("lost:"):  # lost: said so at the exit already
                then = f" (then: {error})" if error else " (it was being written)"
                error = f"not known to be written: sparkd restarted before saying it was{then}"
        else:
            return None
        held = self.unattended.state.intent is not None
        unsaved = self.unattended.unsaved() if held else None
        return LastStopStatus(
            at=at,
            source=source,
            archive=archive,
            archive_error=error,
            intent_saved=(unsaved is None) if held else None,
            intent_error=unsaved,
        )


def _usable(fields: dict[str, int]) -> int | None:
    """Usable memory of a /proc/meminfo reading (``core.sample.usable_bytes``): the hard floor judged raw
    MemAvailable, and a host with 8.81 GiB of free CMA in its 10.45 GiB sat at 1.64 GiB usable for the whole grace."""
    return usable_bytes(fields.get("MemAvailable"), fields.get("CmaFree"))


def _oom_process(oom: Any) -> str | None:
    """The process the kernel's OOM kill line names (``sense.kernlog.KernRecord``): "pid 4242 (python3)"; None
    without one."""
    return None if oom is None else f"pid {oom.pid} ({oom.comm})"
