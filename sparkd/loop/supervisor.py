"""The container side of the daemon: launch, adopt, health, stop, restart, resize.

``loop.daemon.make_actions(settings)`` picks the mode:
* ``managed`` — ``container.image`` set: sparkd launches and owns the container
  (labelled ``sparkd.managed=true``);
* ``guard`` — ``container.guard`` names a container the operator launches; sparkd
  stops it on a trip but never launches it;
* monitor-only — neither: decisions are recorded, nothing is acted on.

Every tick (``container.health_interval_s``, at most 1 s apart) the supervisor reconciles with
Docker's truth in named steps: ``observe_docker`` (one ``docker inspect``, and the /health probe
via ``check_health`` when it is due) builds a ``core.lifecycle.Observation``;
``core.lifecycle.transition`` decides the next state and the effects; ``apply`` records the
change (one ``container_<state>`` event) and runs the effects (``handle_exit`` then
``maybe_restart`` for an exit nobody asked for). Stop and start requests reconcile first, so
they act on what Docker says, not on a cached state.

Docker calls are blocking (docker SDK) and run in worker threads; the guard
loop never waits on them. One action at a time: a second request while one
runs gets ``Conflict("already stopping")`` (HTTP 409).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sparkd.act.containerspec import swap_allowance_bytes
from sparkd.act.docker import ContainerManager
from sparkd.act.procstop import ProcessStopper
from sparkd.act.shm import ShmWitness
from sparkd.act.stop import WITNESS_WAIT_S, StopReport, apart, fallback_grace_s, unheard
from sparkd.config import BudgetSettings, Settings
from sparkd.core.lifecycle import (
    ACTIVE_STATES,
    DOWN_STATES,
    RUNNING_STATES,
    ContainerState,
    Effect,
    EffectKind,
    Observation,
    Probe,
    Step,
    transition,
)
from sparkd.core.rules import Decision
from sparkd.core.supervision import (
    IntentRecord,
    StopIntent,
    guard_candidates,
    intent_for,
    of_this_run,
    who_and_reason,
)
from sparkd.errors import Conflict, DockerUnavailable, EngineRefused, NotFound, Refused, SparkdError
from sparkd.loop.launch import apply_resize, budget_inputs, setting_sources, with_stop_line_warnings
from sparkd.loop.runbook import RunBook
from sparkd.loop.status import (
    ContainerStatus,
    PlanFigures,
    ResizeResult,
    SupervisionStatus,
    UnguardedContainer,
    diff_figures,
)
from sparkd.loop.unattended import Unattended
from sparkd.sense.kernlog import KernRecord
from sparkd.sense.vllm_log import LaunchLogParser

if TYPE_CHECKING:
    from sparkd.act.containerspec import ContainerState as DockerState
    from sparkd.core.sample import Sample
    from sparkd.loop.daemon import Daemon

log = logging.getLogger("sparkd.loop.supervisor")
#: Supervisor steps failing in a row before it is said (one a second at most: ``health_interval_s``, RECONCILE_MAX_S).
WATCH_FAILURES_SAID = 3


def _engine_says(why: str, refused: bool) -> str:
    """How a stop by processes names the engine's trouble: it refused (``EngineRefused``: it answers), or it does not
    answer."""
    return f"the Docker engine refuses ({why})" if refused else f"the Docker engine does not answer ({why})"


S = ContainerState
#: the longest pause between two reconciliations with Docker (a start by hand is seen within it)
RECONCILE_MAX_S = 1.0
# How often the container's processes are scanned for the /dev/shm entries they use (act/shm.ShmWitness):
# the evidence that lets the cleanup after a stop remove what was the container's and keep the rest.
SHM_WITNESS_INTERVAL_S = 30.0
# While sparkd's container runs, how often the container name is checked for another container holding it
# (sparkd's renamed while running); every reconciliation while none of sparkd's runs.
UNGUARDED_CHECK_S = 10.0
# Guard mode with no container by ``container.guard``'s name: how often the running containers are listed for the
# one that may be the model meant (``Supervisor._look_for_candidates``; one ``docker ps``).
GUARD_CANDIDATES_EVERY_S = 30.0
# How long the supervisor waits for the database's first open before it decides how the last launch ended.
DB_DECIDE_WAIT_S = 30.0
# The first steps (``Supervisor._first_steps``: the revision, how the last launch ended) that failed are tried again
# after this long, doubled at each failure up to ``FIRST_STEPS_RETRY_MAX_S`` (a locked database is tried again
# within seconds; one that stays broken is not asked every second, each call waiting out SQLite's busy timeout).
FIRST_STEPS_RETRY_MAX_S = 60.0
# Actions that hold the lock until their new run is ready: an emergency stop is handed over to them.
HANDING_OVER = ("relaunching", "resizing")
#: Stops handed over to such an action (``_hand_over_stop``): the guard's, a peer's, an operator's (Alertmanager's is
#: an operator's). Not sparkd's own stop of a failed launch: that is of one run, not of the one the action launches.
HANDED = (StopIntent.EMERGENCY, StopIntent.PEER_EMERGENCY, StopIntent.OPERATOR)
# An emergency stop pings the Docker engine first and waits this long at most (s). A hung engine (dockerd
# stopped or starved) made each attempt wait out the API timeout, 30-56 s, and fail, with the model still
# running; a dead one (dockerd killed, containerd-shim keeping the container) failed at once, 80 times a
# minute (measured with a private engine, closing note of 2026-12-02). No answer: the container is stopped
# by its processes (act/procstop.py). A healthy engine answers a ping in milliseconds.
EMERGENCY_PING_S = 3.0


def _processes_of(container_id: str) -> list[int]:
    """The pids of the container's processes by cgroup (``ProcessStopper.pids``); [] for an id it cannot read."""
    try:
        return ProcessStopper(container_id).pids()
    except ValueError:
        return []


def _no_answer() -> str:
    """Why the engine counts as down after ``_engine_answers`` said no."""
    return f"no answer to a ping within {EMERGENCY_PING_S:g} s"


class Supervisor(RunBook):
    def __init__(self, settings: Settings, manager: ContainerManager | None = None) -> None:
        self.settings = settings
        c = settings.container
        self.manager = manager or ContainerManager(c.docker_url, selector=c.selector)
        self.mode = "managed" if c.image else "guard"
        self.name = c.name if c.image else (c.guard or "")
        self.daemon: Daemon | None = None
        self.lock = asyncio.Lock()
        self._obs_lock = asyncio.Lock()
        self.action: str | None = None
        self.budget: BudgetSettings = settings.budget
        self.revision: int | None = None
        self.engine_up: bool | None = None
        # (source, reason) of an emergency stop made by the container's processes while the engine did not answer:
        # finished through Docker once it answers (its restart policy must not bring the model back; --rm: forget)
        self.stopped_without_docker: tuple[str, str] | None = None
        self._ping: asyncio.Future[bool] | None = None  # the engine's ping in flight (``_engine_answers``)
        self.engine_error: str | None = None
        self.container_id: str | None = None
        self.image: str | None = None
        self.launch_id: str | None = None
        self.launch_started_at: float | None = None
        self.container_started_at: float | None = None
        self.state = S.NONE
        self.state_since = time.time()
        self.state_reason: str | None = None
        self.health: str | None = None
        self.ready_at: float | None = None
        # ready_at - launch_started_at is a start-up's time (a launch of sparkd's, or an adopted run's launch record);
        # not for a run first seen running whose /health first answered after its adoption (helper-37: "209.4 s")
        self.ready_timed = False
        self.trough_bytes: int | None = None
        self.plan_json: dict[str, Any] | None = None
        self.stay_stopped = False
        # in a cluster the head launches every node in order (POST /api/cluster/start): no lone autostart
        self.autostart_pending = self.mode == "managed" and settings.container.autostart and not settings.cluster.peers
        self.mem_limit_bytes: int | None = None
        # swap the watched run may use beyond --memory (containerspec.swap_allowance_bytes); None: not read yet
        self.mem_swap_bytes: int | None = None
        self.first_sight = False  # the run watched was first seen already running (``_take_run``)
        self.restarts: collections.deque[float] = collections.deque(maxlen=100)
        self.parser: LaunchLogParser | None = None
        self._log_stop: threading.Event | None = None
        self._metrics_prev: dict[str, float] | None = None
        self._stall_polls = 0
        self._oom_record: KernRecord | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_nvml_check = 0.0
        self._last_probe = 0.0
        self._figures_saved: set[str] = set()
        self._launch_actual: dict[str, Any] = {}
        self.shm_witness: ShmWitness | None = None
        self._last_shm_observe = -SHM_WITNESS_INTERVAL_S
        self._bg: asyncio.Task[Any] | None = None
        self._failed_stop_pending: tuple[str | None, str] | None = None  # (container id, reason): ``_step``
        self.stops_total = 0
        self.kills_total = 0
        # what sparkd saw of Docker last (core.lifecycle.Observation's sparkd side)
        self.seen_started_at: float | None = None
        self.seen_restart_count: int | None = None
        self.restart_warned = False
        self.restart_count = 0  # Docker's RestartCount, as last observed
        self.restart_policy: str | None = None
        self._policy_said: set[str | None] = set()  # containers whose restart policy was said (runbook)
        self.docker_restarts_seen = 0
        self.unattended = Unattended(self)  # back-off, breaker, intents, probe, maintenance (loop/unattended)
        # managed mode: a running container by our name without our label (``_check_unguarded``)
        self.unguarded: UnguardedContainer | None = None
        self.interrupted_stop: IntentRecord | None = None  # set by _remember_last_stop, finished by _attach
        self.emergency_inbox: tuple[str, str] | None = None  # (source, reason) handed to a relaunch or resize
        self._unguarded_checked = -UNGUARDED_CHECK_S
        # guard mode: since when no container by ``container.guard``'s name (or id) exists and none is watched
        # (``_note_guard_target``); None: one was found, or Docker was not asked yet
        self.guard_missing_since: float | None = None
        # the first steps (``_first_steps``) done; until then no start-up launch and no scheduled relaunch (they
        # decide on the revision and on how the last launch ended), while Docker is watched and trips stop the model
        self.first_steps_done = False
        self._launch_anchor: tuple[float, float] | None = None  # (launch_started_at, its monotonic time): _launch_age_s
        self.start_error: str | None = None  # why the first steps failed, while they are tried again
        self.watch_error: str | None = None  # why the supervisor's steps fail, said after WATCH_FAILURES_SAID in a row
        self._step_failures = 0
        self._guard_target_seen = False  # a container by that name was found since sparkd started
        self._shm_scan: asyncio.Future[Any] | None = None  # the /dev/shm witness scan in its own thread
        # guard mode, no container by that name: running containers that may be the model meant
        # (``core.supervision.guard_candidates``), looked for at most every GUARD_CANDIDATES_EVERY_S
        self.guard_candidates: list[str] = []
        self._candidates_looked = -GUARD_CANDIDATES_EVERY_S

    # ------------------------------------------------------------------ Actions protocol
    async def start(self, daemon: Daemon) -> None:
        self.daemon = daemon
        await self.unattended.load()
        daemon.notify_hooks.append(self.unattended.on_event)
        daemon.state_keepers.append(self.unattended.restore_file)
        self._task = asyncio.create_task(self._loop(), name="sparkd-supervisor")

    async def _first_steps(self) -> None:
        """Before the first reconciliation: the database's first open (start-up waits only
        ``DB_FIRST_WAIT_S`` for it, so that the guard starts), then the revision and how the last launch ended.
        Decided on "no database" only once its first open failed: a slow open (a loaded host, a migration) read
        as "cannot tell how the last launch ended" and kept the model from starting."""
        d = self.daemon
        if d is not None and d.store is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(d._db_opened.wait(), DB_DECIDE_WAIT_S)
        await self._load_revision()
        await self._remember_last_stop()

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        if self.settings.container.stop_on_exit and self.container_id and self.state in ACTIVE_STATES:
            why = "sparkd is stopping (container.stop_on_exit)"
            began = time.monotonic()
            try:
                await self._stop(why, "daemon")
            except DockerUnavailable as e:  # never out of the daemon's shutdown: its records are still to be written
                await self._stop_without_docker("daemon", why, e.message, emergency=True, began_at=began)
            except SparkdError as e:  # the model runs on after sparkd's exit unless nothing ran: critical then
                self._stop_not_executed(f"daemon ({why}): {e.message}", e)
        await self.unattended.save_pending()
        if self._log_stop:
            self._log_stop.set()

    async def on_stop(self, decision: Decision) -> None:
        await self.emergency_stop(f"rule {decision.rule}", decision.reason)

    async def look_now(self) -> None:
        """Docker's truth about the watched container now (``reconcile``), not at the next step: a trip read the model
        as stopped a moment after a ``docker start`` by hand, and was recorded as one with nothing to stop (a
        warning, collapsed in notify, a thin chart mark) while its stop stopped that model (helper-42)."""
        if self.container_id is None or self.engine_up is False:
            return
        with contextlib.suppress(SparkdError, OSError):
            await self.reconcile(probe=False)

    def running(self) -> bool:
        return self.container_id is not None and self.state in RUNNING_STATES

    def breaker_key(self) -> str:
        """What an emergency stop counts toward the breaker under: the launch (counted once per launch), else
        the container. Read it before the stop: the stop forgets both."""
        return self.launch_id or self.container_id or "unknown"

    async def _hold_and_count(self, key: str, source: str, reason: str) -> IntentRecord | None:
        """Before an emergency stop begins: its intent persisted, so a crash or kill -9 of sparkd in the middle of
        it does not relaunch the model it was stopping at its next start (it stays stopped, as after a finished
        emergency stop), and the stop counted toward the breaker under ``key``, so such a crash cannot keep it
        from the breaker (once per launch: a count after the stop changes nothing then). Returns the intent
        that held before (``Unattended.release_hold`` puts it back when the stop is not carried out)."""
        before = await self.unattended.hold(self.unattended.intent_for(source), source, reason)
        await self.unattended.emergency(key, reason)
        return before

    async def emergency_stop(self, source: str, reason: str) -> None:
        """A rule, the hard floor or the probe: stop through the normal procedure, count it once per launch
        toward the breaker, then the relaunch decision (intent ``emergency``)."""
        key, was_running = self.breaker_key(), self.running()
        began = time.monotonic()  # the stop's grace counts from here, through Docker or not (fallback_grace_s)
        uptime = time.time() - self.container_started_at if self.container_started_at else None
        ready = self.ready_at is not None
        held = was_running and not self.lock.locked()
        gate = self.daemon.read_hold if held and self.daemon is not None else None
        # the API reads no new request until the SIGTERM is out (``_stop``'s ``signalled``), at most MAX_HOLD_S:
        # every step before it waits on the event loop, which a flood of page requests held 6-10 s
        mine = gate.hold() if gate is not None else None
        try:
            if held:
                before = await self._hold_and_count(key, source, reason)
            try:
                if not await self._engine_answers():
                    raise DockerUnavailable(_no_answer())
                await self._request("stop", source=source, reason=reason)
            except Conflict as e:
                if self.action in HANDING_OVER:
                    # a relaunch or resize holds the lock until its new run is ready, minutes of start-up (when memory
                    # peaks): the stop cannot wait for it. It is handed over; that action stops the run at once and
                    # launches nothing more (``_take_emergency``)
                    self._hand_over_stop(source, reason)
                    return
                if self.action == "stopping":
                    # a stop of the model is under way (a peer's, an operator's, another rule's): it covers this one.
                    # `stop_not_executed` reset the rules' cooldowns, so the rule tripped critically again every few
                    # samples through the grace, each trip broadcast to the peers again (helper-33)
                    self._event(
                        "trip_during_stop",
                        f"{source}: {reason}; not acted on: a stop of {self.name} is under way and covers it",
                        details={"source": source, "covered_by": "the stop under way"},
                    )
                    if was_running:  # the host's own emergency all the same: counted toward the breaker (once per
                        # launch), which a peer's or an operator's stop under way does not count
                        await self.unattended.emergency(key, reason)
                    return
                self._event("stop_not_executed", f"{source}: {e.message}", severity="warning")
                if held:
                    await self.unattended.release_hold(before)
                return
            except (DockerUnavailable, EngineRefused) as e:
                # the engine is down or hung, or answers with errors of its own (an inspect refused with HTTP 500
                # stopped nothing: each trip said stop_not_executed while the model ran on, helper-51): the model is
                # stopped by its processes, as the engine would have
                if self.action in HANDING_OVER:  # the relaunch or resize must launch nothing more when it resumes
                    self.emergency_inbox = (source, reason)
                not_done = await self._stop_without_docker(
                    source, reason, e.message, emergency=True, began_at=began, refused=isinstance(e, EngineRefused)
                )
                if isinstance(not_done, str):
                    self._event(
                        "stop_not_executed",
                        f"{source}: {e.message}; {not_done}",
                        severity="warning",
                        # no id known: the next trip acts again (the engine may answer by then); else nothing runs
                        details=None if self.container_id is None else {"nothing_running": True},
                    )
                    if held:
                        await self.unattended.release_hold(before)
                    return
            except SparkdError as e:
                # Refused "not_running": nothing runs to be stopped (the guard stopped it already, or it exited). No
                # retry is due: the daemon keeps the rule's cooldown (a trip every `samples` ticks for as long as
                # memory stays low would flood the events and the chart, and feed nothing). Refused otherwise: the
                # engine refused the stop (a container without sparkd's label), the model runs on: critical, and the
                # next trip acts again (it was read as nothing running). Docker down or busy: retried.
                self._stop_not_executed(f"{source}: {e.message}", e, busy_is_warning=True)
                if held:
                    await self.unattended.release_hold(before)  # nothing was stopped: the intent as it was
                return
            if was_running:
                await self.unattended.emergency(key, reason)
                if not self.lock.locked():
                    self.stay_stopped = False
                    await self.unattended.after_down(StopIntent.EMERGENCY, uptime_s=uptime, reached_ready=ready)
        finally:
            if gate is not None:  # the stop ended before its SIGTERM (its own hold only; off already: nothing)
                gate.release(mine)

    def _refuse_if_busy(self) -> None:
        """Raises Conflict ("already <action>") while an action holds the lock: one action at a time."""
        if self.lock.locked():
            raise Conflict(f"already {self.action or 'busy'}", detail={"action": self.action})

    async def _engine_answers(self) -> bool:
        """Does the Docker engine answer a ping within ``EMERGENCY_PING_S``? A ping still in flight (a hung engine
        holds it up to the API timeout, 30 s, in its worker thread) is waited on again, not doubled: trips and
        operators' stops against a hung engine hold one thread, not one each."""
        ping = self._ping
        if ping is None or ping.done():
            ping = self._ping = asyncio.ensure_future(asyncio.to_thread(self.manager.ping))
            ping.add_done_callback(unheard)  # an answer nobody waits for any more is not an error
        try:
            return bool(await asyncio.wait_for(asyncio.shield(ping), EMERGENCY_PING_S))
        except Exception:  # TimeoutError, or the engine's error: no answer
            return False

    async def _stop_without_docker(
        self,
        source: str,
        reason: str,
        why: str,
        *,
        emergency: bool,
        began_at: float | None = None,
        refused: bool = False,
    ) -> tuple[StopReport, list[int]] | str:
        """The stop when the Docker engine does not answer: the container stopped by its processes
        (``act.procstop``: SIGTERM to its init, SIGKILL after ``container.stop_timeout_s``, the hard floor
        kills at once) through the normal stop procedure, its archive written after it without the engine's
        parts. A critical ``stop_without_docker`` event says so first, a critical ``stop_incomplete`` when
        processes remain. Returns the stop's report and the pids still running after it (empty: stopped);
        or, when nothing was done, why (no process of the container runs, or its id is not known yet). The
        state stays ``stopping`` until the engine answers again; the supervisor then finishes the stop through
        Docker (``finish_stop_with_docker``).

        ``began_at``: when the stop began (monotonic s), before a try through Docker: the SIGTERM grace is what is
        left of ``container.stop_timeout_s`` since then, at least ``act.stop.FALLBACK_MIN_GRACE_S``
        (``fallback_grace_s``; an engine hung in ``docker stop`` took the model to SIGKILL after ~70 s at the
        default 30 s grace). None: the whole grace.

        ``emergency``: a rule, the hard floor or the probe. An action hung on the engine may hold the lock; an
        emergency does not wait for it. Anyone else (an operator's stop) is refused with Conflict then, as
        ``request`` refuses while an action runs: two stops never run at once.

        ``refused``: the engine answered, and refused (``EngineRefused``): it is not marked down, and the events say
        "refuses", not "does not answer" (a docker_down/docker_up pair at each such stop, helper-52)."""
        try:  # the real /proc: the signals go to real pids (settings.proc_root may be a test's)
            stopper = ProcessStopper(self.container_id or "")
        except ValueError:
            return "the container's id is not known (the engine has not answered since sparkd started)"
        pids = await asyncio.to_thread(stopper.pids)
        if not pids:
            return f"no process of {self.name or 'the container'} runs"
        if not emergency:
            self._refuse_if_busy()
        if not refused:
            self._engine_down(why)
        engine = _engine_says(why, refused)
        full = self.settings.container.stop_timeout_s
        spent = 0.0 if began_at is None else max(0.0, time.monotonic() - began_at)
        grace = fallback_grace_s(full, spent)
        left_of = f" (what is left of the {full:g} s grace: the stop began {spent:.0f} s ago)" if grace < full else ""
        self._event(
            "stop_without_docker",
            f"{source}: {engine}: stopping {self.name} by its {len(pids)} "
            f"processes: SIGTERM to its init, SIGKILL after {grace:g} s{left_of}",
            severity="critical",
            details={
                "container_id": stopper.container_id,
                "pids": pids[:100],
                "engine_error": why,
                "grace_s": round(grace, 1),
                "stop_began_s_ago": round(spent, 1),
            },
        )
        async with self.lock if not self.lock.locked() else contextlib.nullcontext():
            action, self.action = self.action, "stopping"
            try:
                rep = await self._stop(
                    f"{reason} ({engine}: stopped by its processes)",
                    source,
                    stopper=stopper,
                    grace_s=grace,
                    engine_said=engine,
                )
            finally:
                if self.action == "stopping":  # a hung action that held the lock may have ended meanwhile
                    self.action = action
        self.stopped_without_docker = (source, reason)
        left = await asyncio.to_thread(stopper.pids)
        if left:  # refused signals, or a process in uninterruptible sleep (a call into the driver): say so
            errors = f": {'; '.join(stopper.errors[-3:])}" if stopper.errors else " (uninterruptible, in the driver?)"
            self._event(
                "stop_incomplete",
                f"{len(left)} processes of {self.name} still run after SIGKILL{errors}; the memory they hold is "
                "not released",
                severity="critical",
                details={"pids": left[:100], "errors": stopper.errors[-10:]},
            )
        await self._finish_launch("stopped")
        return rep, left

    async def finish_stop_with_docker(self) -> None:
        """The engine answers again after an emergency stop made by the container's processes: the stop is
        finished through Docker. A run Docker's restart policy brought back (it never saw a ``docker stop``)
        is stopped through the normal procedure; a container Docker removed meanwhile (``--rm``) is forgotten,
        so that the next run of that name is guarded; one that stays exited reads ``stopped``."""
        pending, self.stopped_without_docker = self.stopped_without_docker, None
        if pending is None or self.container_id is None:
            return
        source, reason = pending
        if not await asyncio.to_thread(_processes_of, self.container_id):
            # its processes are gone: Docker's word is only read (an engine still hung in containerd would take each
            # stop through it for the grace + ENGINE_MARGIN_S, with an archive and a critical event every time)
            try:
                obs = await self.reconcile(probe=False)
            except Exception:
                # the engine refuses to say (EngineRefused) or went again: the finish waits for the next step. It was
                # dropped, and a restart policy bringing the run back later read as a start by hand (helper-54)
                self.stopped_without_docker = pending
                raise
            if obs.exists and (obs.running or obs.restarting):
                self.stopped_without_docker = pending  # Docker has not caught up yet: read again at the next step
            elif not obs.exists and self.container_id is not None:  # (the look forgets it itself when stopped)
                await self._forget()
                await self._finish_launch("removed")
            return
        try:
            await self._request("stop", source=source, reason=f"{reason} (finishing the stop made without the engine)")
        except Refused as e:
            if e.reason != "not_running":  # the engine refused the stop (a container without sparkd's label): said
                self._event(
                    "stop_not_executed",
                    f"{source}: {reason}: finishing the stop made without the engine: {e.message}",
                    severity="critical",
                )
                return
            # not running: Docker's state read in request() moved it to stopped (or it is gone)
            if self.container_id is not None and self.state is S.STOPPING:
                obs = await self.observe_docker(probe=False)
                if not obs.exists:
                    await self._forget()
                    await self._finish_launch("removed")
        except SparkdError as e:  # the engine went again, or an action holds the lock: the next step retries
            self.stopped_without_docker = pending
            log.warning("finishing the stop made without the engine: %s", e.message)

    def on_kernel_record(self, rec: KernRecord) -> None:
        if (
            rec.kind in ("oom_kill", "oom_killed")
            and rec.container_id
            and self.container_id
            and (self.container_id.startswith(rec.container_id) or rec.container_id.startswith(self.container_id))
        ):
            self._oom_record = rec

    def observe(self, sample: Sample) -> None:
        """A memory sample (the daemon's tick): the start-up trough of usable memory (MemAvailable − CmaFree, what
        the preflight and the stop lines judge; ``launchbook``'s figure at the launch is the same)."""
        self.unattended.observe_mem(sample.mem_available)
        usable = sample.mem_available_minus_cma
        if (
            self.state is S.STARTING
            and usable is not None
            and (self.trough_bytes is None or usable < self.trough_bytes)
        ):
            self.trough_bytes = usable

    def fast_reason(self) -> str | None:
        """Sample fast while the container starts (a model's load is when memory climbs), for ``startup_timeout_s`` of
        its launch at most: a guarded container whose ``container.port`` answers nothing stays "starting", and the
        guard sampled at 4 Hz for as long as it ran (4.2 % of a core over 8 min, helper-37)."""
        if self.state is not S.STARTING:
            return None
        age_s = self._launch_age_s()
        if age_s is not None and age_s > self.settings.container.startup_timeout_s:
            return None
        return f"container {self.name} starting"

    def _launch_age_s(self) -> float | None:
        """Seconds since the launch's start (``launch_started_at``, wall time from Docker or the launch record), on
        the monotonic clock from the first time it is asked (each tick while starting): a wall-clock step (NTP's
        first sync after boot) aged a loading model by the step, ended its fast sampling and marked it failed
        with a stop (helper-40). None without a launch."""
        began = self.launch_started_at
        if began is None:
            return None
        anchor = self._launch_anchor
        if anchor is None or anchor[0] != began:  # a new launch: its age now, by the wall clock, once
            anchor = self._launch_anchor = (began, time.monotonic() - max(0.0, time.time() - began))
        return time.monotonic() - anchor[1]

    def _shown_state(self) -> ContainerState:
        """The state status shows: ``unknown`` while the Docker engine does not answer."""
        return self.state if self.engine_up is not False else ContainerState.UNKNOWN

    def lifecycle_state(self) -> str:
        """``status_json().state`` without building the status (the daemon's per-second snapshot key)."""
        return str(self._shown_state())

    def _stays_stopped(self, state: S) -> bool:
        """``ContainerStatus.stay_stopped``: the model is down and nothing of sparkd's will bring it back, so it stays
        down until an operator starts it. True when it is not running, no action is under way, no relaunch is
        scheduled, and either sparkd was told to keep it down (``stay_stopped``: a stop by hand, a removed container,
        the restart cap) or a stop intent holds it (an emergency stop, an exit, a failed launch: the relaunch decision
        was ``hold``). The flag alone read false after an emergency stop (it gives the relaunch decision its turn),
        though the intent kept the model down (helper-35)."""
        if state not in DOWN_STATES and state is not S.NONE:  # running, restarting, or not known (engine down)
            return False
        if self.lock.locked() or self.unattended.pending is not None:
            return False
        if self.stay_stopped:
            return True
        # an intent older than the last run seen is about an earlier incident (a guarded model started by hand after
        # its emergency stop, then crashed or stopped by hand: the intent is never cleared in guard mode; helper-36)
        intent = self.unattended.state.intent
        return intent is not None and of_this_run(intent.since, self.container_started_at)

    def status_json(self) -> ContainerStatus:
        """The container side of ``Status`` (``sparkd.loop.status.ContainerStatus``).

        While the Docker engine does not answer, ``state`` is ``unknown`` and ``engine`` is ``down``.
        """
        now = time.time()
        state = self._shown_state()
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
            time_to_ready_s=self.ready_at - self.launch_started_at
            if self.ready_timed and self.ready_at is not None and self.launch_started_at is not None
            else None,
            trough_bytes=self.trough_bytes,
            revision=self.revision,
            plan=plan,
            gmu=plan.gmu if plan else None,
            memory_bytes=self.mem_limit_bytes,
            stay_stopped=self._stays_stopped(state),
            restarts_in_window=self._restarts_in_window(),
            restart_count=self.restart_count,
            restart_policy=self.restart_policy,
            docker_restarts_seen=self.docker_restarts_seen,
            busy=self.lock.locked(),
            stops_total=self.stops_total,
            kills_total=self.kills_total,
            last_stop=self.last_stop_status(),
            supervision=SupervisionStatus.model_validate(self.unattended.status_json()),
            unguarded=self.unguarded,
            guard_missing_since=self.guard_missing_since if self.mode == "guard" else None,
            guard_candidates=self.guard_candidates if self.mode == "guard" and self.guard_missing_since else [],
            start_error=self.start_error,
            watch_error=self.watch_error,
        )

    # ------------------------------------------------------------------ control
    async def request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]:
        """start | stop | restart, decided on Docker's state read now (not the cached one): the API, the
        Alertmanager webhook, a peer Spark and sparkd's own steps.

        A stop while the Docker engine does not answer a ping within ``EMERGENCY_PING_S`` (hung or down:
        when memory runs short dockerd may be starved too, and that is when an operator stops the model)
        is made by the container's processes, as the guard's emergency stop is (``_stop_without_docker``),
        and the model stays stopped; the answer says ``"stopped_by": "processes"``. Before, it waited out
        the engine's API timeout (30 s) and was refused.

        Raises Conflict (an action is running: ``detail["action"]``), Refused (not running, or no process of it runs
        with the engine silent: ``reason="not_running"``; already running: ``"already_running"``; guarded:
        ``"guarded"``; the launch's preflight or plan: no reason), DockerUnavailable (start or restart with the
        engine down; a stop when the container's id is not known yet)."""
        if action not in ("start", "stop", "restart"):
            raise Refused(f"action: {action!r} is not allowed; allowed: start, stop, restart")
        if action != "stop" and self.mode != "managed":
            # before anything is done: a restart refused after its stop left the model down (note 11)
            # helper-37: a guard-mode start was refused without a word about memory while three rules held
            holding = self._stop_rules_holding() if action == "start" and not self.running() else None
            mind = f". Mind memory first: {holding[1]}: the guard would stop the model again" if holding else ""
            raise Refused(
                f"{self.name} is guarded, not launched by sparkd: {action} it yourself (docker {action} {self.name}); "
                f"sparkd can stop it{mind}",
                reason="guarded",
            )
        if action == "stop" and self.lock.locked() and self.action in HANDING_OVER and intent_for(source) in HANDED:
            return self._hand_over_stop(source, reason or f"stop requested by {source}")
        self._refuse_if_busy()
        began = time.monotonic()
        if action == "stop" and not await self._engine_answers():
            return await self._requested_stop_without_docker(source, reason, began_at=began)
        try:
            return await self._request(action, source=source, reason=reason, force=force)
        except (DockerUnavailable, EngineRefused) as e:
            if action != "stop" or self.container_id is None:
                raise
            # the engine answered its ping, then hung in the stop or refused it (RunBook._stop), or refused to say how
            # the container is (an inspect answered HTTP 500: a peer's stop ended "not executed", helper-52): the
            # processes
            refused = isinstance(e, EngineRefused)
            return await self._requested_stop_without_docker(source, reason, e.message, began_at=began, refused=refused)

    async def _requested_stop_without_docker(
        self,
        source: str,
        reason: str | None,
        why: str | None = None,
        *,
        began_at: float | None = None,
        refused: bool = False,
    ) -> dict[str, Any]:
        """``request("stop")`` with the engine silent (``why``: what it did instead of answering): stopped by its
        processes; the operator's intent is set (it stays stopped, and a relaunch scheduled before is cancelled)."""
        error = why or self.engine_error
        why = why or _no_answer()
        reason = reason or f"stop requested by {source}"
        done = await self._stop_without_docker(source, reason, why, emergency=False, began_at=began_at, refused=refused)
        engine = _engine_says(why, refused)
        if isinstance(done, str):
            if self.container_id is None:
                raise DockerUnavailable(f"{engine} and {done}")
            raise Refused(f"{done} ({engine})", reason="not_running")  # its id known: no process of it runs
        rep, left = done
        self.stay_stopped = True
        self.unattended.cancel_relaunch(f"stopped by {source}")
        await self.unattended.set_intent(self.unattended.intent_for(source), source, reason)
        error = error or why
        what = (
            f"stopping {self.name} by its processes left {len(left)} of them running after SIGKILL (stop_incomplete)"
            if left
            else f"stopped {self.name} by its processes"
        )
        return {
            "action": "stop",
            "stopped_by": "processes",
            "engine_error": error,
            "stop": rep.to_json(),
            "left_pids": left[:100],
            "message": f"{what}: {_engine_says(error, refused)}; archive {rep.archive or 'none'}",
        }

    async def _request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]:
        """``request`` once the engine is known to answer (or for start/restart)."""
        self._refuse_if_busy()
        async with self.lock:
            self.action = {"start": "starting", "stop": "stopping", "restart": "restarting"}[action]
            try:
                if self.container_id is None:
                    await self._attach()
                obs = await self.reconcile(probe=False) if self.container_id else None
                up = obs is not None and obs.exists and (obs.running or obs.restarting)
                out: dict[str, Any] = {"action": action}
                if action in ("stop", "restart"):
                    if not up:
                        if action == "stop":
                            raise Refused(
                                f"{self.name or 'container'} is not running (state {self.state})", reason="not_running"
                            )
                    else:
                        rep = await self._stop(reason or f"{action} requested by {source}", source)
                        out["stop"] = rep.to_json()
                        self.stay_stopped = action == "stop"
                        await self._finish_launch("stopped")
                        if action == "stop":
                            intent = self.unattended.intent_for(source)
                            await self.unattended.set_intent(intent, source, reason or f"stop requested by {source}")
                if action == "start" and up:
                    raise Refused(
                        f"{self.name} is already running (state {self.state}); use restart", reason="already_running"
                    )
                if action in ("start", "restart"):
                    out["launch_id"] = await self._launch(source, force=force)
                    self.stay_stopped = False
                    await self.unattended.clear_intent(source)
                    if self.unattended.state.breaker.is_open:  # a start by hand is allowed; said, not silent
                        out["warning"] = (
                            "the circuit breaker is still open: automatic relaunches after a stop stay off until "
                            "`sparkd rearm`"
                        )
                        self._event("started_with_breaker_open", f"{source}: {out['warning']}", severity="warning")
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
        new_plan = with_stop_line_warnings(
            make_plan(budget_inputs(new_budget, self.settings.container, mem_total, sources=sources)), self.settings
        ).to_json()
        out = ResizeResult(
            plan=PlanFigures.model_validate(new_plan),
            previous=PlanFigures.model_validate(self.plan_json) if self.plan_json else None,
            diff=diff_figures(self.plan_json, new_plan),
            applied=False,
            dry_run=dry_run,
        )
        if dry_run:
            return out
        self._refuse_if_busy()
        async with self.lock:
            self.action = "resizing"
            try:
                return await self._apply_resize(new_budget, changes, source, out)
            finally:
                self.action = None
                self._inbox_left()

    async def _apply_resize(
        self, new_budget: BudgetSettings, changes: dict[str, Any], source: str, out: ResizeResult
    ) -> ResizeResult:
        old_budget, old_rev = self.budget, self.revision
        began = time.time()  # an emergency stop after this (handed over during the resize): no launch, no rollback's
        rev = await self._save_revision(new_budget, who=source, reason=f"resize {changes}")
        diff_text = {k: [c.old, c.new] for k, c in out.diff.items()}
        self._event("resize", f"resize to revision {rev} by {source}: {diff_text}", details=out.model_dump(mode="json"))
        await self._drain()
        if self.container_id and self.state in ACTIVE_STATES:
            # archived as a restart's stop is: the old run's container (and its log) is removed at the launch (C3)
            await self._stop(f"resize to revision {rev}", source)
            await self._finish_launch("stopped")
        self.budget = new_budget
        ok, why = await self._launch_and_wait(source, since=began)
        stop = self.stopped_meanwhile(began) if not ok else None
        if stop is not None:
            # a stop was asked meanwhile (a rule's, a peer's, an operator's, handed over): the model stays stopped,
            # with this revision; no rollback launches the old one behind the stop (helper-54). Said: only the API's
            # answer did, and the next start launches this untried revision (helper-57)
            self._event(
                "resize_interrupted",
                f"resize to revision {rev} interrupted: {who_and_reason(stop.who, stop.reason)} stopped the model "
                f"meanwhile; it stays stopped, and revision {rev} (not tried yet) is what the next start launches",
                severity="warning",
                details={"revision": rev, "previous_revision": old_rev, "stopped_by": stop.who},
            )
            return out.model_copy(update={"applied": False, "revision": rev, "error": why})
        if not ok:
            self._event(
                "rollback",
                f"revision {rev} failed ({why}); rolling back to revision {old_rev}",
                severity="critical",
            )
            if self.container_id and self.state not in (S.STOPPED, S.EXITED, S.NONE):
                await self._stop(f"rollback from revision {rev}", "sparkd")
                await self._finish_launch("failed")
            self.budget = old_budget
            await self._save_revision(old_budget, who="sparkd", reason=f"rollback from revision {rev}")
            ok2, why2 = await self._launch_and_wait("rollback", since=began)
            return out.model_copy(
                update={"rolled_back": True, "error": why, "rollback_ok": ok2, "rollback_error": why2}
            )
        return out.model_copy(update={"applied": True, "revision": rev, "launch_id": self.launch_id})

    # ------------------------------------------------------------------ lifecycle
    def _event(self, kind: str, message: str, *, severity: str = "info", details: dict[str, Any] | None = None) -> None:
        if self.daemon:
            self.daemon.event(kind, message, severity=severity, details=details, launch_id=self.launch_id)

    def _record_state(self, state: ContainerState, reason: str | None) -> None:
        """One event per change of state: ``container_<state>`` with the reason."""
        if state in (S.STOPPED, S.EXITED, S.FAILED, S.NONE, S.STOPPING, S.RESTARTING):
            self.health = None
        if state != self.state:
            self.state, self.state_since, self.state_reason = state, time.time(), reason
            self._event(
                f"container_{state.value}",
                f"{self.name}: {state.value}" + (f" ({reason})" if reason else ""),
                details={"state": state.value, "container_id": self.container_id, "reason": reason},
            )

    async def _launched(self, source: str, started_at: float | None) -> None:
        """sparkd launched a new container (called by ``_launch`` under the observation lock)."""
        self.seen_started_at, self.seen_restart_count, self.restart_warned = started_at, 0, False
        self.restart_count, self.restart_policy = 0, "no"
        self.first_sight = False  # sparkd saw this run start: its `ready` is a healthy reading
        self.auto_remove = False  # sparkd's own launch (no --rm): an adopted run's flag is not this one's (helper-57)
        self.unattended.new_run()  # its completion probes count from 0 (``_take_run`` is for runs not launched here)
        obs = Observation(launched=True, started_at=started_at, detail=f"launched by {source}", name=self.name)
        await self.apply(transition(self.state, obs), obs)

    def _restarts_in_window(self) -> int:
        cut = time.time() - self.settings.container.restart_window_s
        return sum(1 for t in self.restarts if t >= cut)

    async def _loop(self) -> None:
        pause_s = min(self.settings.container.health_interval_s, RECONCILE_MAX_S)
        retry_s, retry_at = pause_s, 0.0
        while True:
            try:
                # inside the loop's try: a database error in the first steps ("database is locked" at the revision's
                # write) ended the supervisor's task without a word; Docker was never asked again
                due = not self.first_steps_done and time.monotonic() >= retry_at
                if due and not await self._try_first_steps():
                    retry_at, retry_s = time.monotonic() + retry_s, min(retry_s * 2, FIRST_STEPS_RETRY_MAX_S)
                await self._step()
            except asyncio.CancelledError:
                raise
            except DockerUnavailable as e:
                self._engine_down(str(e))
            except Exception as e:
                log.exception("supervisor step failed")
                self._step_failed(e)
            try:
                # a scheduled relaunch decides on the revision and the last launch; not on a state a failed look left
                # stale (a scheduled maintenance began while the engine refused inspect, helper-54)
                if self.first_steps_done:
                    await self.unattended.periodic(watched=self._step_failures == 0)
            except asyncio.CancelledError:
                raise
            except Exception:  # its own: a database error here is no failed look at the container (helper-52)
                log.exception("supervision's periodic work failed")
            await asyncio.sleep(pause_s)

    def _step_failed(self, e: Exception) -> None:
        """A step that raised: after ``WATCH_FAILURES_SAID`` in a row, said once (``watch_failing``, critical;
        ``status.container.watch_error``). An engine that answers its ping and refuses ``docker inspect`` (HTTP 500)
        made every step fail, said only in sparkd's log: the container's state stayed "ready" while exits, OOM kills,
        /health and the completion probe went unobserved (helper-51)."""
        self._step_failures += 1
        if self._step_failures < WATCH_FAILURES_SAID or self.watch_error is not None:
            return
        self.watch_error = f"{type(e).__name__}: {e}"
        self._event(
            "watch_failing",
            f"sparkd cannot watch {self.name or 'the container'}: its last {self._step_failures} looks at the "
            f"container failed ({self.watch_error}); the state shown ({self.state.value}) may be stale: exits, OOM "
            "kills, /health and the completion probe are not observed; a trip still stops the model (by its "
            "processes if the engine refuses)",
            severity="critical",
            details={"error": self.watch_error},
        )

    def _watched(self) -> None:
        """A look at the container (``reconcile``, or the lookup of the container to watch) succeeded: the count of
        failed steps starts again, and a ``watch_failing`` said is over (``watch_recovered``). Only then: a step that
        returned early (the engine's ping failed, an action's stop under way) looked at nothing, and
        ``watch_recovered`` beside ``docker_down`` was false (helper-52)."""
        self._step_failures = 0
        if self.watch_error is not None:
            self._event(
                "watch_recovered",
                f"sparkd watches {self.name or 'the container'} again (its looks at the container failed: "
                f"{self.watch_error})",
                details={"error": self.watch_error},
            )
            self.watch_error = None

    async def _try_first_steps(self) -> bool:
        """``_first_steps``, its failure said once (``supervisor_start_failed``, critical in managed mode: nothing is
        launched at start until they succeed; ``status.container.start_error``) and its success after one
        (``supervisor_start_recovered``). True when done."""
        try:
            await self._first_steps()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("the supervisor's first steps failed")
            why = f"{type(e).__name__}: {e}"
            if self.start_error is None:
                held = (
                    "no launch at start and no scheduled relaunch until they succeed"
                    if self.mode == "managed"
                    else "guarding the container as ever"
                )
                self._event(
                    "supervisor_start_failed",
                    f"the supervisor's first steps (the budget revision, how the last launch ended) failed: {why}; "
                    f"Docker is watched and a trip stops the model; {held}; tried again with back-off",
                    severity="critical" if self.mode == "managed" else "warning",
                    details={"error": why},
                )
            self.start_error = why
            return False
        self.first_steps_done = True
        if self.start_error is not None:
            self._event(
                "supervisor_start_recovered",
                f"the supervisor's first steps succeeded after failing ({self.start_error})",
                details={"error": self.start_error},
            )
            self.start_error = None
        return True

    def _engine_down(self, why: str) -> None:
        self.engine_error = why
        if self.engine_up is not False:
            self.engine_up = False
            self._event(
                "docker_down",
                f"Docker engine unreachable: {why}; sampling and rules go on; an emergency stop acts on the "
                "container's processes (its archive without the container's log), start, restart and resize wait "
                "for the engine",
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
        if self.stopped_without_docker is not None and not self.lock.locked():
            # at any step the engine answers, not only at docker_up: it may come back while that stop still runs
            await self.finish_stop_with_docker()
        if self._failed_stop_pending is not None and not self.lock.locked():
            cid, reason = self._failed_stop_pending
            self._failed_stop_pending = None
            if cid is not None and cid == self.container_id and self.state is S.FAILED:
                self._bg = asyncio.create_task(self._stop_quietly(reason))
        if self.mode == "managed":
            # the name may be someone else's now: sparkd's container removed, or renamed (stopped or running).
            # Every step while none of sparkd's runs; while one runs, every UNGUARDED_CHECK_S (a Docker call)
            active = self.container_id is not None and self.state in ACTIVE_STATES
            if not active and not self.lock.locked():
                # a container with sparkd's labels run by hand (`docker run` with them after a `docker rm -f` of
                # sparkd's) is sparkd's to guard, as at start-up: it showed "none" until a trip adopted it (note 11)
                await self._attach(unless_busy=True)
                active = self.container_id is not None and self.state in ACTIVE_STATES
            if not active or time.monotonic() - self._unguarded_checked >= UNGUARDED_CHECK_S:
                self._unguarded_checked = time.monotonic()
                await self._check_unguarded()
        elif self.mode == "guard" and self.container_id is not None and not self.lock.locked():
            # the guarded name may be another container now: the one watched stopped or exited and a new one runs
            # by the name (never watched: each trip said "not running"), or the watched one was renamed and
            # another took the name. Every step while the watched one is down; while it runs, every
            # UNGUARDED_CHECK_S (a Docker call)
            active = self.state in ACTIVE_STATES
            if not active or time.monotonic() - self._unguarded_checked >= UNGUARDED_CHECK_S:
                self._unguarded_checked = time.monotonic()
                await self._follow_guarded_name(active)
        if self.container_id is None:
            if self.mode == "guard":
                await self._attach()
                self._watched()
                return
            self._watched()  # managed: the lookups above answered; none of sparkd's runs
            if self.autostart_pending and self.first_steps_done and not self.stay_stopped and not self.lock.locked():
                self.autostart_pending = False
                try:
                    await self.request("start", source="sparkd start-up")
                except SparkdError as e:
                    self.stay_stopped = True
                    self._event("launch_refused", f"launch refused: {e.message}", severity="critical")
            return
        if self.lock.locked() and self.action in ("stopping", "restarting"):
            return  # the action reconciles itself when it is done
        await self.reconcile(probe=True)
        self._watched()
        if self.state in (S.READY, S.UNHEALTHY):
            await self._probe()

    async def _probe(self) -> None:
        """The completion probe (loop.unattended) while the model is up; the start-up phase from the launch log."""
        rec = self.parser.record if self.parser else None
        phase = rec.state if rec is not None and rec.lines_seen and rec.state != "failed" else None
        waiting = (self._metrics_prev or {}).get("num_requests_waiting")
        await self.unattended.probe(ready=True, requests_waiting=waiting, startup_phase=phase)
        if self.container_started_at:
            await self.unattended.on_up(time.time() - self.container_started_at)

    async def relaunch_same_plan(self, source: str, *, since: float | None = None) -> tuple[bool, str | None]:
        """Stop (graceful, archived) and launch the same plan, waiting for ready. Raises Conflict when busy.
        ``since``: when the action that asks began (a maintenance run drains first): an emergency stop after it
        means no launch."""
        self._refuse_if_busy()
        since = time.time() if since is None else since
        async with self.lock:
            self.action = "relaunching"  # not "restarting": the supervisor step must keep watching for ready
            try:
                if self.running():
                    await self._stop(f"relaunch: {source}", source)
                    await self._finish_launch("stopped")
                return await self._launch_and_wait(source, since=since)
            finally:
                self.action = None
                self._inbox_left()

    def _hand_over_stop(self, source: str, reason: str) -> dict[str, Any]:
        """A stop asked of sparkd (an operator, a peer Spark's trip, Alertmanager) while a relaunch or resize holds
        the lock until its new run is ready, minutes of start-up: handed over as the guard's own trips are
        (``_take_emergency``: the run stopped at once, nothing more launched). It was refused with "already
        relaunching", the peer told "accepted", the model came up while the other Spark stopped (helper-53). A
        rule's stop already handed over is kept over anyone else's (its intent, emergency, and its breaker count); a
        later rule's stop replaces it, as an emergency stop's handover always did."""
        kept = self.emergency_inbox
        if (
            kept is None
            or intent_for(source) is StopIntent.EMERGENCY
            or intent_for(kept[0]) is not StopIntent.EMERGENCY
        ):
            self.emergency_inbox = (source, reason)
        self._event(
            "stop_handed_over",
            f"{source}: {reason}; the {self.action} under way stops the model now and launches nothing more",
            severity="warning",
            details={"action": self.action, "source": source},
        )
        return {
            "action": "stop",
            "accepted": True,
            "handed_over": True,
            "message": f"handed over to the {self.action} under way: it stops the model now and launches nothing more",
        }

    def _inbox_left(self) -> None:
        """A stop handed over after the action's last look at the inbox (its new run ready, the lock about to
        go): stopped as any emergency, in the background, once the lock is released (it waited a cooldown)."""
        if self.emergency_inbox is not None:
            source, reason = self.emergency_inbox
            self.emergency_inbox = None
            if intent_for(source) is StopIntent.EMERGENCY:
                self._bg = asyncio.create_task(self.emergency_stop(source, reason))
            else:  # an operator's, a peer's or Alertmanager's: stopped as asked, not counted toward the breaker
                self._bg = asyncio.create_task(self._stop_as_asked(source, reason))

    async def _stop_as_asked(self, source: str, reason: str) -> None:
        """A stop handed over (``_hand_over_stop``) that the action left for after its lock: ``request("stop")``
        now; its failure said (``stop_not_executed``, critical: who asked was told it was taken)."""
        try:
            await self.request("stop", source=source, reason=reason)
        except Refused as e:
            if e.reason != "not_running":  # refused otherwise (a container without sparkd's label): said
                self._event("stop_not_executed", f"{source}: {reason}: {e.message}", severity="critical")
                return
            # nothing runs (the action's launch failed, or its run exited): the stop is done; its asker's intent is
            # recorded, the model stays stopped (a critical "not executed" for a model that is down, helper-54)
            self.stay_stopped = True
            self.unattended.cancel_relaunch(f"stopped by {source}")
            await self.unattended.set_intent(self.unattended.intent_for(source), source, reason)
        except SparkdError as e:
            self._event("stop_not_executed", f"{source}: {reason}: {e.message}", severity="critical")

    async def _take_emergency(self) -> tuple[bool, str | None]:
        """The stop ``emergency_stop`` handed over while this relaunch or resize held the lock: the run is
        stopped now (within the lock: archive, grace, kill, /dev/shm), counted toward the breaker, and the model
        stays stopped until `sparkd start`; the action launches nothing more."""
        assert self.emergency_inbox is not None
        source, reason = self.emergency_inbox
        self.emergency_inbox = None
        intent = self.unattended.intent_for(source)
        if self.running():
            if intent is StopIntent.EMERGENCY:
                await self._hold_and_count(self.breaker_key(), source, reason)
            else:  # an operator's, a peer's or Alertmanager's stop handed over: its intent, no breaker count
                await self.unattended.hold(intent, source, reason)
            began = time.monotonic()
            try:
                await self._stop(reason, source)
            except (DockerUnavailable, EngineRefused) as e:  # hung or refusing: its processes, as emergency_stop
                await self._stop_without_docker(
                    source, reason, e.message, emergency=True, began_at=began, refused=isinstance(e, EngineRefused)
                )
            await self._finish_launch("stopped")
        self.stay_stopped = True
        await self.unattended.set_intent(intent, source, reason)
        return False, f"stopped by {source}: {reason}"

    async def _check_unguarded(self) -> None:
        """Managed mode: a running container sparkd will not stop, so no stop rule can protect the host from it:
        - one by ``container.name`` without sparkd's label, while none of sparkd's runs (``docker rm`` or ``docker
          rename`` of sparkd's, then ``docker run --name`` by hand; paused counts: it holds its memory): sparkd
          never stops an unlabelled container it was not told to guard;
        - one **with** sparkd's labels beside the run sparkd watches (its command line copied from ``docker
          inspect``, say; or a second one found at start-up, when the newest is adopted): sparkd watches one run
          at a time, and a trip stops that one only. Looked for only while no action holds the lock (a relaunch's
          new container runs before it is watched; its labels, the launch id too, may be copies of the watched one's:
          a relaunch or resize holds it for minutes of start-up). While none of sparkd's runs is watched, the step
          adopts a labelled one first (``_attach``), and no look is made.
        Said at once and loudly (``unguarded_container``, critical; ``status.container.unguarded``), once per
        container; ``unguarded_container_gone`` when it stops, is removed, or becomes the run sparkd watches."""
        try:
            info = await asyncio.to_thread(self.manager.get, self.settings.container.name)
        except NotFound:
            info = None
        found: UnguardedContainer | None = None
        if (
            info is not None
            and info.name == self.settings.container.name.lstrip("/")  # a name, not an id prefix that matched
            and info.id != self.container_id
            and not info.managed
            and info.status in ("running", "restarting", "paused")
        ):
            found = UnguardedContainer(id=info.id, name=info.name, image=info.image, since=time.time())
        old = self.unguarded
        if found is None:
            watching = self.container_id is not None and self.state in ACTIVE_STATES
            if not watching or self.lock.locked():
                # not looked at while an action runs, nor while no run is watched (the step adopts a labelled one
                # first): what was said stands until the next look
                if old is not None and old.labelled:
                    return
            else:
                try:
                    labelled = await asyncio.to_thread(self.manager.running_managed)
                except SparkdError as e:  # an engine error answer: the step goes on (reconcile, probe)
                    log.warning("looking for other containers with sparkd's labels failed: %s", e)
                    return
                if self.lock.locked():  # an action began during the call: its new run may be in the answer
                    return
                for cid, name, image in labelled:
                    if cid != self.container_id:
                        found = UnguardedContainer(id=cid, name=name, image=image, since=time.time(), labelled=True)
                        break
        if found is not None and (old is None or old.id != found.id):
            self.unguarded = found
            if found.labelled:
                message = (
                    f"container {found.name} ({found.id[:12]}, {found.image}) runs with sparkd's labels beside the "
                    f"one sparkd watches, {self.name} ({(self.container_id or '')[:12]}): sparkd watches one run at "
                    f"a time and a trip stops that one only, so no stop rule protects this host from "
                    f"{found.name}. Stop it (`docker stop {found.name}`), or stop both and `sparkd start`"
                )
            else:
                message = (
                    f"container {found.name} ({found.id[:12]}, {found.image}) runs without sparkd's label "
                    f"(started outside sparkd): sparkd will not stop it, so no stop rule protects this host from "
                    f"it. Stop it and `sparkd start` to run the model under sparkd, or guard it as it is "
                    f"(container.guard = {found.name!r}, without container.image)"
                )
            self._event(
                "unguarded_container",
                message,
                severity="critical",
                details={
                    "container_id": found.id,
                    "name": found.name,
                    "image": found.image,
                    "labelled": found.labelled,
                },
            )
        elif found is None and old is not None:
            self.unguarded = None
            self._event(
                "unguarded_container_gone",
                f"container {old.name} ({old.id[:12]}), which ran unguarded, is no longer running",
                details={"container_id": old.id, "name": old.name},
            )

    async def _attach(self, *, unless_busy: bool = False) -> None:
        """Find the container to watch (managed: the running labelled one; guard: the named one, running, restarting
        or paused: a container paused when sparkd started was "not running" and each trip's stop was refused while it
        held its memory, note 11) and reconcile with it: first sight gives ``adopted``, with the figures of the run
        watched before forgotten (ready time, trough, plan: the launch record gives them back when it has them), and
        a scheduled relaunch cancelled (the model runs). ``unless_busy``: nothing is changed when an action took the
        lock during the Docker call (its answer may name the container the action just stopped or replaced)."""
        info = None
        if self.mode == "managed":
            info = await asyncio.to_thread(self.manager.adopt)
        elif self.settings.container.guard:
            info = await asyncio.to_thread(self.manager.guard, self.settings.container.guard)
            if info is None and self.container_id is None:
                await self._look_for_candidates(self.settings.container.guard)
            self._note_guard_target(info is not None)
            if info is not None and info.status not in ("running", "restarting", "paused"):
                info = None
        if unless_busy and self.lock.locked():
            return
        if info is None or info.id == self.container_id:
            if info is None and self.interrupted_stop is not None and self.mode == "managed":
                self.interrupted_stop = None  # that run ended meanwhile (Docker finished the stop): stopped
                self._record_state(S.STOPPED, self.state_reason)
            return
        self.container_id, self.image, self.name, self.launch_id = info.id, info.image, info.name, info.launch_id
        u = self.unguarded
        if u is not None and u.id == info.id:  # the labelled one said to run beside the watched run is watched now
            self.unguarded = None
            self._event(
                "unguarded_container_gone",
                f"container {u.name} ({u.id[:12]}), which ran unguarded, is now the run sparkd watches",
                details={"container_id": u.id, "name": u.name},
            )
        elif u is not None and not u.labelled:
            self.unguarded = None  # a container of sparkd's runs by that name now: the unlabelled one has another
        self.seen_started_at, self.seen_restart_count, self.restart_warned = None, None, False
        # another run than the one watched before (its container removed or replaced by hand): none of its figures,
        # and a first sight (``adopted``), not "started outside sparkd (it was exited)" of another container
        self.ready_at = self.trough_bytes = self.launch_started_at = self.plan_json = None
        self.state = S.NONE
        self.unattended.cancel_relaunch(f"{info.name} ({info.id[:12]}) runs: adopted")
        await self.reconcile(probe=False)
        rec, self.interrupted_stop = self.interrupted_stop, None
        if rec is not None and self.running() and (self.container_started_at or 0.0) < rec.since:
            # the run sparkd was stopping in an emergency when it went away (crash, kill -9): the decision stands
            self._bg = asyncio.create_task(self._finish_interrupted_stop(rec))

    async def _look_for_candidates(self, name: str) -> None:
        """Guard mode, no container by ``name``: the running containers that may be the model meant
        (``guard_candidates``), at most every ``GUARD_CANDIDATES_EVERY_S`` (one ``docker ps``). An engine that does
        not answer leaves the last list (the name's lookup, just made, said so)."""
        now = time.monotonic()
        if now - self._candidates_looked < GUARD_CANDIDATES_EVERY_S:
            return
        self._candidates_looked = now
        try:
            running = await asyncio.to_thread(self.manager.running_containers)
        except (SparkdError, OSError) as e:
            log.info("guard mode: could not list running containers: %s", e)
            return
        self.guard_candidates = guard_candidates(name, running)

    def _note_guard_target(self, found: bool) -> None:
        """Guard mode, after each ``docker inspect`` of the guarded name: no container by that name or id exists
        (``docker ps -a`` lists none) while none is watched, so a trip has nothing to stop. A typo in
        ``container.guard``, or docker compose's ``<project>-<service>-1`` naming, guarded nothing without a word:
        state ``none``, the headline "ok", each trip "nothing to stop". Said once per change: ``guard_target_missing``
        (critical when no container by that name was seen since sparkd started: the host runs unguarded; a warning
        when the one seen was removed, ``docker rm``, ``--rm``, ``compose down``, as ``container_gone`` says),
        ``guard_target_found`` when one appears. A container that exists but is stopped or exited is no fault (it is
        guarded again once it runs), nor is a renamed one still watched by its id."""
        name = self.settings.container.guard or ""
        if found:
            self._guard_target_seen = True
            self.guard_candidates = []
            if self.guard_missing_since is not None:
                self.guard_missing_since = None
                self._event(
                    "guard_target_found",
                    f"a container named {name!r} exists now: guarding it (stopped on a trip while it runs)",
                    details={"name": name},
                )
            return
        if self.container_id is not None or self.guard_missing_since is not None:
            return
        self.guard_missing_since = time.time()
        if self._guard_target_seen:
            message = (
                f"no container named {name!r} exists any more (`docker ps -a` lists none by that name or id): it was "
                "removed; nothing is guarded until a container by that name runs"
            )
        else:
            message = (
                f"guard mode: no container named {name!r} (`docker ps -a` lists none by that name or id): nothing is "
                "guarded, and a trip has nothing to stop. Fix container.guard to the name `docker ps -a` shows "
                "(docker compose names it <project>-<service>-1), or start the container by that name"
            )
        if self.guard_candidates:
            message += f"; running now: {', '.join(self.guard_candidates)}"
        self._event(
            "guard_target_missing",
            message,
            severity="warning" if self._guard_target_seen else "critical",
            details={"name": name, "removed": self._guard_target_seen, "candidates": self.guard_candidates},
        )

    async def _follow_guarded_name(self, was_active: bool) -> None:
        """Guard mode: watch the running container that has the guarded name now, when it is not the one watched
        (``_attach``); a ``guarded_container_changed`` event names both, critical when the one left still runs
        (renamed: it is not stopped by a trip any more)."""
        old_id, old_name, old_state = self.container_id, self.name, self.state
        await self._attach()
        if self.container_id == old_id or old_id is None:
            return
        left = (
            f"the one watched before, {old_name} ({old_id[:12]}), still ran under another name: NOT guarded any more"
            if was_active
            else f"the one watched before, {old_id[:12]}, was {old_state}"
        )
        self._event(
            "guarded_container_changed",
            f"now guarding {self.name} ({(self.container_id or '')[:12]}), the running container named "
            f"{self.settings.container.guard!r}; {left}",
            severity="critical" if was_active else "warning",
            details={"container_id": self.container_id, "previous_id": old_id, "previous_running": was_active},
        )

    async def _finish_interrupted_stop(self, rec: IntentRecord) -> None:
        """Finish an emergency stop begun before sparkd's last exit (its intent was written before the stop;
        Docker may still be within the grace, or the stop never reached it): counted toward the breaker,
        stopped through the normal procedure, and the model stays stopped until `sparkd start`, as when
        sparkd finds it already down. A run started after the intent (by hand) is not stopped.

        A stop not made is ``stop_not_executed``: a warning marked ``nothing_running`` when nothing runs
        (``Refused.reason == "not_running"``), else critical (the engine refused it, a container without sparkd's
        label; an action held the lock; the engine down with the id not known): the model may run on, as
        ``emergency_stop`` and ``_stop_as_asked`` say it."""
        said = who_and_reason(rec.who, rec.reason)
        reason = f"finishing the {rec.intent.value} stop begun before sparkd's last exit ({said})"
        self._event("stop_resumed", reason, severity="warning", details={"intent": rec.intent.value, "who": rec.who})
        await self.unattended.emergency(self.breaker_key(), reason)
        try:
            await self.request("stop", source=rec.who, reason=rec.reason)
        except SparkdError as e:
            self._stop_not_executed(f"{rec.who} (resumed): {e.message}", e)

    async def reconcile(self, *, probe: bool, detail: str | None = None) -> Observation:
        """One observation of Docker's truth, its transition and effects. Returns the observation."""
        async with self._obs_lock:
            obs = await self.observe_docker(probe=probe, detail=detail)
            await self.apply(transition(self.state, obs), obs)
            return obs

    async def observe_docker(self, *, probe: bool, detail: str | None = None) -> Observation:
        """``docker inspect`` of the container (+ the /health probe when due and the run is known)."""
        assert self.container_id is not None
        base = Observation(
            name=self.name,
            seen_started_at=self.seen_started_at,
            seen_restart_count=self.seen_restart_count,
            restart_warned=self.restart_warned,
            guarded=self.mode != "managed",
            was_ready=self.ready_at is not None,
            auto_remove=self.auto_remove,
            detail=detail,
        )
        try:
            st: DockerState = await asyncio.to_thread(self.manager.state, self.container_id)
        except NotFound:
            return replace(base, exists=False)
        if st.started_at is not None and st.started_at == self.seen_started_at:  # a run already taken (not adopting)
            self._follow_memory_limit(st.memory_bytes, st.memory_swap_bytes)
        elif st.memory_bytes is not None:  # a run being taken (adopted, restarted): its limits, without a word
            self.mem_limit_bytes = st.memory_bytes or None
            self.mem_swap_bytes = swap_allowance_bytes(st.memory_bytes, st.memory_swap_bytes)
        obs = replace(
            base,
            running=st.running,
            restarting=st.restarting,
            exit_code=st.exit_code,
            oom_killed=st.oom_killed,
            restart_count=st.restart_count,
            started_at=st.started_at,
            docker_health=st.health,
            restart_policy=st.restart_policy,
        )
        same_run = st.running and not st.restarting and st.started_at == self.seen_started_at
        if st.running and not st.restarting:
            await self._observe_shm(st.pid)
        due = time.monotonic() - self._last_probe >= self.settings.container.health_interval_s
        if probe and same_run and due and self.state not in (S.STOPPING, S.FAILED) and st.status == "paused":
            # frozen by `docker pause`: /health cannot answer, and "unhealthy: ReadTimeout" sent the operator
            # debugging the model (helper-48). Still a running model (it holds its memory; a trip stops it)
            self._last_probe = time.monotonic()
            frozen = f"paused (docker pause): it holds its memory and answers nothing until docker unpause {self.name}"
            return replace(obs, probe=Probe.FAILING, detail=frozen)
        if probe and same_run and due and self.state not in (S.STOPPING, S.FAILED):
            self._last_probe = time.monotonic()
            result, why = await self.check_health()
            c = self.settings.container
            # a failed launch is a launch of sparkd's that never became ready: not a run that was ready (its launch
            # record says so) and fails /health when sparkd comes back beside it, nor a guarded container, which
            # sparkd never starts (a wrong container.port): both were stopped at the first failing /health once
            # they had run for startup_timeout_s (tests/test_startup_expiry.py)
            expired = (
                self.state is S.STARTING
                and self.mode == "managed"
                and self.ready_at is None
                and (self._launch_age_s() or 0.0) > c.startup_timeout_s
            )
            if expired and result is not Probe.OK:
                why = f"not ready within {c.startup_timeout_s:g} s ({why})"
            obs = replace(obs, probe=result, detail=why or detail, startup_expired=expired)
        return obs

    async def _observe_shm(self, pid: int | None) -> None:
        """Every SHM_WITNESS_INTERVAL_S, what the running container's processes (``pid``: its PID 1 on the
        host) map or hold open in /dev/shm: the evidence of the cleanup after a stop (act/shm.ShmWitness)."""
        cid = self.container_id
        if not cid or time.monotonic() - self._last_shm_observe < SHM_WITNESS_INTERVAL_S:
            return
        self._last_shm_observe = time.monotonic()
        if self.shm_witness is None or self.shm_witness.container_id != cid:
            self.shm_witness = ShmWitness(cid, shm_dir=self.settings.shm_dir, proc_root=self.settings.proc_root)
        if self._shm_scan is not None and not self._shm_scan.done():
            return  # the last scan has not ended (a /proc/PID/maps read blocked): never a second thread beside it
        # in a thread of its own, waited on briefly: this runs under ``_obs_lock``, which a trip's stop takes next; a
        # read that waits on a process stuck in the driver held the trip's stop for ever, unsaid (helper-43)
        self._shm_scan = asyncio.ensure_future(apart(None, self.shm_witness.observe, pid))
        self._shm_scan.add_done_callback(unheard)
        done, _ = await asyncio.wait({self._shm_scan}, timeout=WITNESS_WAIT_S)
        if not done:
            log.warning(
                "/dev/shm witness: the scan of %s's processes has not ended within %g s (a /proc/PID/maps read "
                "blocked?); no new scan until it does",
                self.name,
                WITNESS_WAIT_S,
            )

    async def apply(self, step: Step, obs: Observation) -> None:
        """Execute one transition: adopt first (a new run), then the state change, then the rest."""
        self._state_before = self.state  # what a removal ended (``_forget``)
        for eff in step.effects:
            if eff.kind is EffectKind.ADOPT:
                await self._take_run(obs, first_sight=eff.event == "adopted")
        if obs.exists and obs.engine_up and not obs.launched and not obs.stopping:
            self.seen_started_at, self.seen_restart_count = obs.started_at, obs.restart_count
            self.container_started_at = obs.started_at or self.container_started_at  # Docker's, of this run
            self.restart_count, self.restart_policy = obs.restart_count, obs.restart_policy
        self._record_state(step.state, step.reason)
        if obs.probe is Probe.OK:
            self.health = "ok"
        elif obs.probe is Probe.FAILING:
            self.health = obs.detail
        for eff in step.effects:
            await self._effect(eff, obs)

    async def _effect(self, eff: Effect, obs: Observation) -> None:
        if eff.kind is EffectKind.EMIT and eff.event:
            if eff.event == "restart_loop":
                self.restart_warned = True
            details = {"container_id": self.container_id, "started_at": obs.started_at}
            details |= {"restart_count": obs.restart_count, "restart_policy": obs.restart_policy}
            self._event(eff.event, eff.message, severity=eff.severity, details=details)
            if eff.event == "restarted_outside" and self.mode != "managed":
                # guard mode: the operator's start is how it runs (sparkd never starts it): the stop's intent is
                # over. /api/status kept "emergency" for the running model (helper-48)
                await self.unattended.clear_intent("a start outside sparkd")
        elif eff.kind is EffectKind.COUNT_RESTARTS:
            self.docker_restarts_seen += eff.count
            self.restarts.extend([time.time()] * eff.count)
            self.container_started_at = obs.started_at or self.container_started_at
        elif eff.kind is EffectKind.MARK_READY:
            self._mark_ready()
        elif eff.kind is EffectKind.RECORD_EXIT:
            await self.handle_exit(obs)
            self._bg = asyncio.create_task(self.maybe_restart())
        elif eff.kind is EffectKind.FORGET:
            await self._forget()
            await self._finish_launch("removed")
        elif eff.kind is EffectKind.STOP and not self.lock.locked():
            self._bg = asyncio.create_task(self._stop_quietly(eff.message))
        elif eff.kind is EffectKind.STOP:
            # an action holds the lock (a maintenance relaunch, a resize or its rollback waiting for ready): it may
            # stop this run itself (a resize rolls back), or return with it running (a relaunch, a rollback that
            # failed too). The stop is kept and done once the lock is free if the run is still up and failed: it
            # was skipped, and the model ran on, shown "failed", never stopped (helper-51)
            self._failed_stop_pending = (self.container_id, eff.message)
