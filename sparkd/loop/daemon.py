"""``sparkd run``: one asyncio process — startup() → main_loop() → shutdown().

The guard loop samples, evaluates and hands work off; it never waits on the
database (bounded queue → ``store.Writer``) or on HTTP (the API only reads
``DaemonState``). Signal handlers only set ``should_exit`` (as uvicorn does).

systemd notify protocol (through ``sdnotify``): ``READY=1`` once the first
sample is stored and the API socket is up; ``STATUS=`` one-line summary;
``WATCHDOG=1`` from the guard loop itself every ``WATCHDOG_USEC / 2``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import sdnotify

from sparkd import __version__
from sparkd.act.notify import Notifier
from sparkd.config import Settings
from sparkd.core.choices import SamplingMode
from sparkd.core.floors import FloorWarning, LoopGuard, read_vm_tunables
from sparkd.core.leak import LeakTracker
from sparkd.core.rules import Decision
from sparkd.core.sample import Sample
from sparkd.core.stalls import LATE_FACTOR, StallWindow
from sparkd.errors import ConfigError, Refused, StoreError
from sparkd.errors import one_line as _one_line
from sparkd.loop import daemon_db as _daemon_db
from sparkd.loop import daemon_decide as _daemon_decide
from sparkd.loop import daemon_http as _daemon_http
from sparkd.loop import daemon_view as _daemon_view
from sparkd.loop.alarm import Alarm
from sparkd.loop.consumers import ConsumerWatch
from sparkd.loop.daemon_db import keep_log_file as _keep_log_file
from sparkd.loop.daemon_decide import STATUS_SOON_S
from sparkd.loop.guard import Guard, TickResult
from sparkd.loop.httpserver import (
    HttpStats,
    RateLimitedLog,
    ReadHold,
)
from sparkd.loop.readable import ReadableGate
from sparkd.loop.reads import Reads
from sparkd.loop.relief import ReliefRunner
from sparkd.loop.statelock import StateLock
from sparkd.loop.status import (
    ConfigFileStatus,
    ContainerStatus,
    ResizeResult,
    Status,
)
from sparkd.sense import procfs
from sparkd.sense.kernlog import KernRecord, open_source
from sparkd.store.keeper import DbKeeper
from sparkd.store.store import Store, Writer
from sparkd.units import parse_size

log = logging.getLogger("sparkd.loop.daemon")

#: A stop decision still running this long past ``container.stop_timeout_s`` is said to be stuck (``stop_stuck``):
#: the archive (``act.stop.ARCHIVE_WAIT_S``, 10 s), the witness (2 s), the kill fallback and the /dev/shm cleanup
#: (10 s) all fit in it.
DECISION_MARGIN_S = 60.0

#: Events after which the container's processes are gone: who holds the memory is scanned again at once.
RUN_ENDED_KINDS = ("stopped", "killed", "exited", "container_gone")
LIVE_SAMPLES = 1800  # samples kept in memory for the read side when the database cannot answer


class Actions(Protocol):
    """What the daemon asks of the container side (filled in by ``supervisor``)."""

    async def start(self, daemon: Daemon) -> None: ...

    async def on_stop(self, decision: Decision) -> None: ...

    def on_kernel_record(self, rec: KernRecord) -> None: ...

    def fast_reason(self) -> str | None: ...

    def observe(self, sample: Sample) -> None: ...

    def status_json(self) -> ContainerStatus: ...

    def lifecycle_state(self) -> str:
        """``status_json().state`` (or the mode when there is no container), without building the
        status: the daemon asks it every second to see whether the stored snapshot is due."""
        ...

    async def request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]: ...

    async def resize(self, changes: dict[str, Any], *, dry_run: bool, source: str) -> ResizeResult: ...

    async def look_now(self) -> None:
        """Look at Docker now, before ``lifecycle_state`` is read again (a trip that finds the model down: was it
        started by hand a moment ago?). Never raises for Docker's trouble; the caller bounds its time."""
        ...

    async def close(self) -> None: ...


def make_actions(settings: Settings) -> Actions:
    """The container side for ``settings``: a ``loop.supervisor.Supervisor`` (managed or guard mode),
    or ``MonitorOnly``. The supervisor and the Docker SDK (requests, urllib3: ~8 MiB resident) are
    imported only when there is a container to act on."""
    c = settings.container
    if settings.monitor_only:
        named = c.guard or c.image  # said, not silently dropped: a leftover SPARKD_MONITOR_ONLY did so (helper-45)
        return MonitorOnly("monitor_only = true", ignored=(c.guard or c.name) if named else None)
    if not c.image and not c.guard:
        return MonitorOnly("no container configured (container.image or container.guard)")
    from sparkd.loop.supervisor import Supervisor

    return Supervisor(settings)


def _where(e: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``e``'s traceback (for the crash event)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"


class MonitorOnly:
    """No container to act on: a stop decision is recorded, nothing else happens."""

    def __init__(self, why: str = "no container configured", *, ignored: str | None = None) -> None:
        self.why = why
        self.ignored = ignored  # the container the configuration names, which monitor_only leaves unguarded
        self.daemon: Daemon | None = None

    async def start(self, daemon: Daemon) -> None:
        self.daemon = daemon
        if self.ignored:
            daemon.event(
                "monitor_only_ignores_container",
                f"{self.why}: {self.ignored}, which the configuration names (container.guard or container.image), "
                "is NOT guarded: sparkd never stops it on a trip. Remove monitor_only (or SPARKD_MONITOR_ONLY) to "
                "guard it",
                severity="critical",
                details={"container": self.ignored},
            )

    async def on_stop(self, decision: Decision) -> None:
        if self.daemon:
            self.daemon.event(
                "stop_not_executed",
                f"monitor-only ({self.why}): would stop: {decision.reason}",
                severity="warning",
                details={"rule": decision.rule, "monitor_only": True},
            )

    def on_kernel_record(self, rec: KernRecord) -> None:
        return None

    def fast_reason(self) -> str | None:
        return None

    def observe(self, sample: Sample) -> None:
        return None

    def status_json(self) -> ContainerStatus:
        return ContainerStatus(mode="monitor-only", reason=self.why, ignored=self.ignored)

    def lifecycle_state(self) -> str:
        return "monitor-only"

    async def request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]:
        raise Refused(f"monitor-only: {self.why}; cannot {action} a container")

    async def resize(self, changes: dict[str, Any], *, dry_run: bool, source: str) -> ResizeResult:
        raise Refused(f"monitor-only: {self.why}; nothing to resize")

    async def look_now(self) -> None:
        return None

    async def close(self) -> None:
        return None


class Daemon:
    """The running daemon. Construct with validated ``Settings``.

    Raises (from ``startup``):
        StoreError: the database path cannot be used (message names the path).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        actions: Actions | None = None,
        guard: Guard | None = None,
        notifier: Any = None,
        serve_api: bool | None = None,
        app_factory: Callable[[Daemon], Any] | None = None,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.mono = mono
        self.should_exit = asyncio.Event()
        self.guard = guard
        self.actions: Actions = actions or MonitorOnly()
        self.store: Store | None = None
        self.writer: Writer | None = None
        self.db = DbKeeper(settings.db_file)
        # the live view: what the read side answers from when the database cannot (newest last)
        self.live_samples: collections.deque[Sample] = collections.deque(maxlen=LIVE_SAMPLES)
        self.reads = Reads(self)
        self._db_opened = asyncio.Event()
        self._db_alarm = Alarm()  # the database keeper's sleep; the writer's on_trouble ends it
        self._drops_said = 0  # Writer.dropped already reported in a records_dropped event
        self._write_hung_said = False  # database_write_hung said, its return not yet
        self._unclean_checked = False  # the run before this process's first run row was checked (unclean_exit)
        self.notifier = notifier or sdnotify.SystemdNotifier()
        # the HTTP side is composed by the caller (``sparkd.face.app``); loop never imports face
        self.app_factory = app_factory
        self.serve_api = (settings.api.enabled if serve_api is None else serve_api) and app_factory is not None
        self.recent_events: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        self.run_id: int | None = None
        self.started_at = time.time()
        self.samples_taken = 0
        self.tick_durations: collections.deque[float] = collections.deque(maxlen=600)
        self.mode: SamplingMode = "normal"
        self.mode_reason: str | None = None
        self._fast_until = 0.0
        self._last_status = 0.0
        self._status_key: tuple[Any, ...] | None = None
        # an event between two ticks far apart (interval_s up to 60 s): the snapshot and systemd's STATUS= a second
        # later, not at the next tick (``_status_soon``)
        self._status_soon_handle: asyncio.TimerHandle | None = None
        # the main loop's pending tick (a TimerHandle) and the future main_loop waits on (set by a tick that
        # has decisions to act on, by request_exit, or with a tick's exception)
        self._tick_handle: asyncio.TimerHandle | None = None
        self._tick_fut: asyncio.Future[Any] | None = None
        self._next_at = 0.0
        self._last_watchdog = 0.0
        self._early_wake = False  # the tick scheduled is a wake for the watchdog only (_schedule_tick)
        self.config_baseline: dict[str, Any] | None = None  # the file's settings as loaded at start (face.cli.run)
        self.config_file: ConfigFileStatus | None = None  # the file against what runs (daemon_db.config_watch_loop)
        self.api_error: str | None = None  # why the API is not served, while it is tried again (daemon_http)
        self._interval_in_effect: float | None = None  # the interval the next tick was scheduled at (_after_tick)
        self._watchdog_s = self._watchdog_interval()
        self._tasks: list[asyncio.Task[Any]] = []
        # decisions that may act (trips, nvrm_action = stop), handed over by ticks to the decider task
        self._decisions: collections.deque[tuple[Decision, Sample | None]] = collections.deque()
        self._decider: asyncio.Task[None] | None = None
        self._decider_error: BaseException | None = None
        self._last_tick_at: float | None = None  # monotonic time the last tick ended (guard_gap)
        self._read_error_logged = False
        self.api_server: Any = None
        self.http_stats = HttpStats()
        # the API reads no new request while an emergency stop gets its SIGTERM out (Supervisor.emergency_stop)
        self.read_hold = ReadHold()
        self.http_log: RateLimitedLog | None = None
        self.api_socket: socket.socket | None = None
        self.kern_source_name = "off"
        self.notify_hooks: list[Callable[[dict[str, Any]], None]] = []
        # files of the state dir that sparkd holds in memory, written again when deleted while it runs (an
        # ``rm -rf`` of the state dir, a deleted token): each returns what it wrote, or None (daemon_db.keep_files)
        self.state_keepers: list[Callable[[], Awaitable[str | None]]] = [_keep_log_file]
        self._keep_errors_said: set[str] = set()
        # called with the Decision the moment a stop is decided, beside the local stop (cluster broadcast)
        self.stop_hooks: list[Callable[[Decision], None]] = []
        self.blind_gaps = 0  # ticks that came far too late (``guard_gap`` events)
        self.stalls = StallWindow()  # short stalls, summed (``guard_stalled`` events)
        self.cluster: Any = None  # sparkd.loop.cluster.Cluster when [cluster] has peers
        # the configuration file it was started from (``sparkd run`` sets it): watched for an edit that breaks it
        self.config_path: Path | None = None
        self.stall_file = os.environ.get("SPARKD_TEST_HOOK_STALL_FILE")
        self.ready = False
        self.event_notifier: Notifier | None = None
        self.leak = LeakTracker(
            settings.leak_warmup_start_s,
            settings.leak_warmup_end_s,
            parse_size(settings.leak_threshold),
            settings.leak_repeat_s,
        )
        self.loop_guard = LoopGuard()
        self.vm_tunables = read_vm_tunables(settings.proc_root)
        self.floor_warnings: list[FloorWarning] = []
        self._reported_floors: set[str] = set()
        self.gpu: list[dict[str, Any]] = []
        # the GPU loop's cadence (daemon_db.gpu_loop): when its last reading was taken (monotonic s), and the
        # event that asks for one sooner (a reader looks at the status: want_gpu)
        self.gpu_read_at: float | None = None
        self.gpu_wanted = asyncio.Event()
        self._cooldown_logged: dict[str, float] = {}
        self._kernel_window: dict[str, tuple[float, int]] = {}  # kind → (window start, lines): daemon_decide
        self._lock: StateLock | None = None
        self.consumers: ConsumerWatch | None = None  # built in startup when consumers.enabled
        self.relief = ReliefRunner(
            settings.relief,
            proc_root=settings.proc_root,
            emit=lambda k, m, sev, det: self.event(k, m, severity=sev, details=det),
            relieved=self._relieved,
            mono=mono,
        )
        self._blind_key: tuple[tuple[str, str], ...] | None = None
        self._kern_gate: ReadableGate | None = None  # the kernel log is read when the event loop saw it readable
        self._blind_inputs: tuple[Any, ...] | None = None  # Guard.blind_key() when the report was last built

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _watchdog_interval() -> float | None:
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 1e6 / 2
        except ValueError:
            return None

    def event(
        self,
        kind: str,
        message: str,
        *,
        severity: str = "info",
        details: dict[str, Any] | None = None,
        launch_id: str | None = None,
    ) -> dict[str, Any]:
        """Record an event: in memory now, in the database through the writer queue."""
        ev = {
            "ts": time.time(),
            "kind": kind,
            "severity": severity,
            "message": message,
            "details": details,
            "launch_id": launch_id,
        }
        self.recent_events.appendleft(ev)
        lvl = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING}.get(
            severity, logging.INFO
        )
        log.log(lvl, "%s: %s", kind, message)
        if self.writer:
            self.writer.submit("event", dict(ev))
        for hook in self.notify_hooks:
            hook(ev)
        if self.ready and self._status_soon_handle is None and self.current_interval() > 2 * STATUS_SOON_S:
            self._status_soon()
        if kind in ("stopped", "killed") and self.guard is not None:
            took = ((details or {}).get("durations_s") or {}).get("stop")
            if isinstance(took, int | float):
                self.guard.engine.note_stop_duration(float(took))  # the predictive horizon learns it
        if (
            kind in ("launched", "adopted", "restarted_outside", "stop_not_executed")
            and self.guard is not None
            and not (details or {}).get("monitor_only")
            and not (details or {}).get("nothing_running")
        ):
            # a new run of the container, or a trip that stopped nothing: the next trip must act (a rule's
            # cooldown is for a stop that happened, never for a container the operator just started). Not in
            # monitor-only, where no stop can ever happen, nor when nothing was running to stop: the reset only
            # repeated the critical trip every `samples` ticks for as long as memory stayed low (24 in 2 min
            # after a guard stop, each fed to the loop guard); the cooldown applies as after a stop.
            self.guard.engine.reset_cooldowns()
        if kind == "adopted" and self.loop_guard.forget_start_reading():
            log.info("loop guard: the MemAvailable read at sparkd's start is not a healthy reading (a model runs)")
            self.check_floors(healthy=False)  # the start-up reading's floor warnings go with it
        if kind in ("launched", "adopted", "restarted_outside"):  # a new run of the container
            started: float = (details or {}).get("started_at") or time.time()
            self.leak.start_launch(launch_id, started)
            if kind == "launched":  # only sparkd's own (re)launch can make stopping loop: a run started by hand (guard
                # mode never starts one) counted, and two trips soon after demoted the only stop rule while the model
                # ran on below its line, unguarded (helper-48); the operator is the loop's end there
                self.loop_guard.note_launch(time.time())
            if self.consumers is not None:
                self.consumers.wake()  # who holds the memory: this container's share, not the last one's
            self.sample_soon()  # its start-up, the riskiest phase, sampled fast from now, not the next tick on
        elif kind in RUN_ENDED_KINDS and self.consumers is not None:
            self.consumers.wake(rescan=True)  # its processes are gone: who holds the memory now, not before the stop
        elif kind == "ready":  # healthy unless the run was first seen already running (adopted: load unknown)
            self.check_floors(healthy=not (details or {}).get("adopted"))
        return ev

    def check_floors(self, *, healthy: bool) -> None:
        """Compare each rule's floor with the kernel's low watermark and the MemAvailable seen
        while healthy; report each new problem once as a ``watermark`` warning. ``healthy`` False: the
        watermark checks only (the MemAvailable now is not a healthy figure)."""
        _daemon_view.run_floor_checks(self, healthy=healthy)

    def status_json(self) -> Status:
        """The in-memory state (``sparkd status``, ``/api/status``): a ``sparkd.loop.status.Status``.

        Sizes in bytes. Call on the event loop: it reads state the loop mutates.

        Raises:
            pydantic.ValidationError: a part no longer matches the contract (a bug, not input).
        """
        return _daemon_view.status_json(self)

    def _relieved(self, rule: str) -> None:
        if self.guard is not None:
            self.guard.engine.relieved(rule)

    def _consumers_status(self) -> dict[str, Any] | None:
        return _daemon_view.consumers_status(self)

    def _make_consumer_watch(self) -> ConsumerWatch:
        """The process scan, fed with the supervisor's container id, the guard's MemAvailable and the plan."""
        return _daemon_view.make_consumer_watch(self)

    def blind_json(self) -> dict[str, dict[str, str]]:
        """``{"sensors": {input: why}, "rules": {rule: why}}``: each input a rule needs that
        cannot be read (with the rules that need it), and each rule that therefore cannot
        evaluate (never shown as a quiet 0/N). Inputs no rule reads are not listed."""
        return _daemon_view.blind_json(self)

    def _check_blind(self) -> None:
        """An event at start and whenever the set of blind inputs or rules changes."""
        _daemon_view.check_blind(self)

    def sample_soon(self) -> None:
        """The next sample now, when it is further off than ``fast_interval_s``: a model started between two ticks
        far apart (``interval_s`` up to 60 s) was not sampled through its start-up, fast sampling began only at the
        next tick (helper-44: at 40 s a 25 s start-up had no sample; "start-up trough n/a"). On the event loop's
        thread only; elsewhere (and before the main loop runs) nothing changes."""
        handle, fut = self._tick_handle, self._tick_fut
        if handle is None or fut is None or fut.done():
            return
        now = self.mono()
        if self._next_at - now <= self.settings.fast_interval_s:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        handle.cancel()
        self._next_at = now
        self._schedule_tick(loop, 0.0)

    def _status_soon(self) -> None:
        """Refresh the status snapshot and systemd's ``STATUS=`` ``STATUS_SOON_S`` after an event, when ticks are
        further apart than twice that: at ``interval_s = 40`` a stop's "container: stopped" reached ``sparkd status``
        and ``systemctl status`` up to 40 s late (note 18 §7). Only on the event loop's thread (an event said from a
        worker thread waits for the next tick, as before)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._status_soon_handle = loop.call_later(STATUS_SOON_S, self._refresh_soon)

    def _refresh_soon(self) -> None:
        self._status_soon_handle = None
        if self.should_exit.is_set() or self.writer is None:
            return
        try:
            _daemon_decide.refresh_status(self)
        except Exception:  # the next tick refreshes it; never an exception out of a timer callback
            log.exception("status refresh after an event failed")

    def current_interval(self) -> float:
        return self.settings.fast_interval_s if self.mode == "fast" else self.settings.interval_s

    def summary_line(self) -> str:
        return _daemon_view.summary_line(self)

    # ------------------------------------------------------------------ lifecycle
    def _lock_state_dir(self) -> None:
        """One daemon per state directory (``statelock.StateLock``: a ``flock`` and an abstract socket name).

        Raises:
            StoreError: another sparkd holds it (the message names its pid and the directory).
        """
        self._lock = StateLock.acquire(Path(self.settings.state_dir))
        with contextlib.suppress(RuntimeError):  # no running loop (a test's bare lock): nothing to answer on
            self._lock.answer_on(asyncio.get_running_loop())

    async def startup(self) -> None:
        s = self.settings
        self._lock_state_dir()
        # the guard never depends on the database: a full disk, a corrupt file or a lock held by
        # another process is an event and a status FAIL, retried with back-off (store.keeper)
        # The first open runs beside the guard: start-up waits for it at most DB_FIRST_WAIT_S (a
        # write lock held elsewhere costs SQLite's busy timeout), then sampling starts regardless.
        self.writer = Writer(None, maxsize=s.queue_max)
        self.writer.check_file = self.db.replaced
        self.writer.on_trouble = self._db_alarm.wake
        # a state file deleted alone (the token) is written again within a write, not at the keeper's idle check
        dirs = (s.state_dir, str(s.logs_path), str(s.token_file.parent))
        self.writer.watched_dirs = tuple(dict.fromkeys(os.path.abspath(d) for d in dirs))
        db_task = asyncio.create_task(self._db_loop(), name="sparkd-db")
        self._tasks.append(db_task)
        await asyncio.wait([asyncio.ensure_future(self._db_opened.wait())], timeout=_daemon_db.DB_FIRST_WAIT_S)
        kern = None
        if s.kernlog_source != "off":
            kern = open_source(s.kernlog_source)
            self.kern_source_name = getattr(kern, "name", "unknown")
            reason = getattr(kern, "reason", None)
            if reason:
                log.warning("kernel log: %s", reason)
        if self.guard is None:
            self.guard = Guard(s, kern)
        elif kern is not None and self.guard.kern_source is None:
            self.guard.kern_source = kern
        loop = asyncio.get_running_loop()
        if self.guard.kern_source is not None and self.guard.kern_gate is None:
            self._kern_gate = ReadableGate(loop, self.guard.kern_source)
            self.guard.kern_gate = self._kern_gate
        self._tasks.append(asyncio.create_task(self.writer.run(), name="sparkd-writer"))
        self._tasks.append(asyncio.create_task(self._retention_loop(), name="sparkd-retention"))
        if self.config_path is not None:
            watch = _daemon_db.config_watch_loop(self, self.config_path)
            self._tasks.append(asyncio.create_task(watch, name="sparkd-config-watch"))
        self._tasks.append(asyncio.create_task(self._gpu_loop(), name="sparkd-gpu"))
        if s.consumers.enabled:
            self.consumers = self._make_consumer_watch()
        self.event_notifier = Notifier(
            s.notify,
            dispatch=loop.call_soon_threadsafe,
            collapse_s=s.supervision.alert_collapse_s,
            on_failure=lambda k, m, d: self.event(k, m, severity="warning", details=d),
        )
        self.notify_hooks.append(self.event_notifier.submit)
        self.leak.start_launch(None, time.time())
        # first sample, stored before READY=1; a /proc that cannot be read at all is a configuration error
        try:
            procfs.read_meminfo(s.proc_root)
        except OSError as e:
            raise ConfigError(f"proc_root = {s.proc_root!r}: cannot read {e.filename}: {e.strerror}") from None
        result = self._tick_once()
        if result is not None:
            await self._handle(result)
        # its sampling mode too: a first sample near a floor waited a whole interval (40 s) before fast sampling
        # began, as every later tick does not (helper-50)
        self._update_mode(result)
        if self.store is not None:
            await asyncio.to_thread(self.writer.flush)  # the first sample stored before READY=1
        # at start: the host as it is now counts as healthy (a tuned host without a model), until a running model
        # is adopted (``forget_start_reading``)
        _daemon_view.run_floor_checks(self, healthy=True, at_start=True)
        _daemon_view.report_rules_that_never_fire(self)
        if self.serve_api:  # or said, and tried again: the guard never waits on the API
            await _daemon_http.serve_api_or_say(self)
        await self.actions.start(self)
        if self.consumers is not None:  # after the supervisor has attached: the first scan knows the container
            self._tasks.append(asyncio.create_task(self.consumers.run(), name="sparkd-consumers"))
        if self.cluster is not None:  # peers named by host name: resolved again, and said when they resolve to nothing
            self._tasks.append(asyncio.create_task(self.cluster.keep_resolved(), name="sparkd-cluster-resolve"))
        self.event(
            "daemon_started",
            f"sparkd {__version__} started (pid {os.getpid()}, kernel log: {self.kern_source_name}, db: {s.db_file})"
            # a dry run was said nowhere at start (helper-39): trips are recorded, nothing is stopped
            + ("; DRY RUN: stop rules are recorded, not acted on" if s.dry_run else ""),
            details={"dry_run": s.dry_run, "event_loop": type(loop).__module__.split(".")[0]},
        )
        self._say_refused_starts()
        self.ready = True
        self.notifier.notify("READY=1")
        self.notifier.notify(f"STATUS={self.summary_line()}")
        # what start-up built (modules, settings, the app: ~110,000 objects) lives as long as the process:
        # after one collection of start-up's garbage, the collector's passes skip it (issue 18)
        gc.collect()
        gc.freeze()

    def _say_refused_starts(self) -> None:
        """Starts the configuration refused before this one (``store.refused``, counted by ``sparkd run``): a
        critical ``start_refused``, with how long nothing was guarded at least (from the first refusal). The history
        read ``daemon_stopped`` then ``daemon_started``, and a restart loop on a broken file was said nowhere
        (helper-45)."""
        from sparkd.store import refused

        rec = refused.take(Path(self.settings.state_dir))
        if rec is None:
            return
        first, last, n = float(rec["first_ts"]), float(rec["last_ts"]), int(rec["count"])
        unguarded_s = max(0.0, time.time() - first)

        def utc(t: float) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))

        when = f"at {utc(first)}" if n == 1 else f"{n} times from {utc(first)} to {utc(last)}"
        self.event(
            "start_refused",
            f"sparkd refused to start {when}: its configuration did not load ({rec['error']}); nothing was guarded "
            f"for at least {unguarded_s:.0f} s before this start",
            severity="critical",
            details={**rec, "unguarded_s": unguarded_s},
        )

    async def _start_api(self) -> None:
        await _daemon_http.start_api(self)

    def _link_sockets(self, port: int) -> list[socket.socket]:
        """Sockets on ``cluster.listen`` (the link network, for peer calls only; see face/peer.py)."""
        return _daemon_http.link_sockets(self, port)

    def _tick_once(self) -> TickResult | None:
        assert self.guard is not None
        t0 = time.perf_counter()
        try:
            result = self.guard.tick()
        except OSError as e:
            if not self._read_error_logged:
                log.error("cannot read memory state: %s (retrying every interval)", e)
                self._read_error_logged = True
            return None
        self._read_error_logged = False
        self.tick_durations.append(time.perf_counter() - t0)
        self.samples_taken += 1
        return result

    async def _handle(self, result: TickResult) -> None:
        await _daemon_decide.handle(self, result)

    def _record_kernel(self, rec: KernRecord, sample: Any) -> None:
        _daemon_decide.record_kernel(self, rec, sample)

    async def _decide(self, d: Decision, sample: Sample | None = None) -> bool:
        return await _daemon_decide.decide(self, d, sample)

    def _update_mode(self, result: TickResult | None) -> None:
        _daemon_decide.update_mode(self, result)

    async def retention_once(self, now: float | None = None) -> dict[str, Any]:
        """Prune and aggregate the store, cap the archives (oldest first, never the newest)."""
        return await _daemon_db.retention_once(self, now)

    async def _retention_loop(self) -> None:
        # not during start-up (the riskiest phase of a launch is then, and the first minute of a daemon)
        await _daemon_db.retention_loop(self)

    async def _gpu_loop(self) -> None:
        """NVML readings in a worker thread (an NVML call can block in the driver)."""
        await _daemon_db.gpu_loop(self)

    async def _begin_run(self) -> bool:
        """Record this run in a just-opened store; False (store dropped, retried later) when the
        database refuses the first write (a write lock held by another process, a full disk)."""
        return await _daemon_db.begin_run(self)

    def _db_down_event(self) -> None:
        _daemon_db.db_down_event(self)

    async def _db_loop(self) -> None:
        """Watch the database without ever holding up the guard: a corrupt file (from the writer),
        a deleted or replaced file (inode), records refused for good; reopen with back-off."""
        await _daemon_db.db_loop(self)

    async def _db_step(self) -> None:
        await _daemon_db.db_step(self)

    def want_gpu(self) -> None:
        """A reader looks at the status (the dashboard, ``/api/status``, a peer Spark): the GPU loop reads NVML
        every ``gpu_interval_s`` rather than every ``gpu_quiet_interval_s`` (``daemon_db.gpu_loop``). The
        status snapshot, ``/metrics`` and shutdown do not ask."""
        read_at = self.gpu_read_at
        if read_at is None or self.should_exit.is_set():
            return
        if self.mono() - read_at >= self.settings.gpu_interval_s:
            self.gpu_wanted.set()

    def _ping_watchdog(self, *, now_too: bool = False) -> None:
        """``WATCHDOG=1`` when ``WATCHDOG_USEC / 2`` has passed since the last (``now_too``: in any case)."""
        if self._watchdog_s is None:
            return
        now = self.mono()
        if now_too or now - self._last_watchdog >= self._watchdog_s:
            self._last_watchdog = now
            self.notifier.notify("WATCHDOG=1")

    def _schedule_tick(self, loop: asyncio.AbstractEventLoop, delay_s: float) -> None:
        """The next tick (``_on_tick``) in ``delay_s``. A delay longer than the watchdog's half period (``interval_s``
        ≥ ``WatchdogSec / 2``: the config allows 60 s) wakes the tick chain early only to ping it: the pings came
        once per tick, and at ``interval_s = 40`` the shipped unit's 30 s watchdog killed the daemon before its
        second sample (helper-40). A wedged event loop still goes unpinged."""
        w = self._watchdog_s
        ping_in = 0.0 if w is None else max(0.0, self._last_watchdog + w - self.mono())
        self._early_wake = w is not None and delay_s > ping_in
        self._tick_handle = loop.call_later(ping_in if self._early_wake else delay_s, self._on_tick)

    def _test_stall(self) -> None:
        # test-only hook (issue: "stall the guard loop"): blocks the loop while the file exists
        while self.stall_file and os.path.exists(self.stall_file):
            time.sleep(0.05)

    async def main_loop(self) -> None:
        """Tick every ``current_interval()`` until ``request_exit``.

        Each tick is a plain callback of the event loop (``_on_tick``, scheduled with ``call_later``):
        sample, rules, ``handle_sync``, sampling mode, watchdog, next tick. On an idle host that is all,
        and this coroutine is not resumed at all (issue 18: resuming it, its future and its timer
        each tick cost more than the tick). A tick whose result may act (a trip; ``nvrm_action =
        stop``) hands its decisions here, to the decider task (``_run_decisions``): they run in order,
        one at a time, while the ticks go on. A stop can take its whole grace (30 s); meanwhile the guard
        keeps sampling (the postmortem's samples, the dashboard, the kernel log, the watchdog's pings) and
        the rules keep counting (a second trip is held by the cooldown, or covered by the stop under way:
        ``_run_decisions``). On exit the
        decision in progress is finished, never cut short. An exception in a tick or in a decision
        ends this coroutine (the daemon reports a crash)."""
        loop = asyncio.get_running_loop()
        # one interval after start-up's own sample (taken before READY=1), not a second sample right after it
        self._next_at = self.mono() + (self.current_interval() if self.samples_taken else 0.0)
        while not self.should_exit.is_set():
            if self._decider_error is not None:
                raise self._decider_error
            fut: asyncio.Future[tuple[TickResult, list[tuple[Decision, Sample | None]]] | None]
            fut = self._tick_fut = loop.create_future()
            self._schedule_tick(loop, max(0.0, self._next_at - self.mono()))
            try:
                acting = await fut
            finally:
                self._tick_fut = None
                if self._tick_handle is not None:
                    self._tick_handle.cancel()
                    self._tick_handle = None
            if acting is None:
                continue
            result, decisions = acting
            self._decisions.extend(decisions)
            if self._decider is None or self._decider.done():
                self._decider = asyncio.create_task(self._run_decisions(), name="sparkd-decide")
                self._decider.add_done_callback(self._decider_done)
            self._after_tick(result)
        if self._decider is not None:  # a stop in progress is finished before the daemon stops
            await self._decider

    async def _run_decisions(self) -> None:
        """The decisions ticks handed over, in order, one at a time (a stop is awaited to its end).

        After a stop was asked of the container, the stop decisions queued meanwhile (a rule that held
        through the stop with a short cooldown, a second rule of the same tick, ``nvrm_action = stop``)
        are covered by it: each is an info ``trip_during_stop`` event, not a second stop refused as "not
        running". A stop that failed resets the cooldowns (``stop_not_executed``): a rule that still
        holds trips again, and that trip acts."""
        loop = asyncio.get_running_loop()
        while self._decisions:
            d, sample = self._decisions.popleft()
            stuck_s = self.settings.container.stop_timeout_s + DECISION_MARGIN_S
            watch = loop.call_later(stuck_s, self._decision_stuck, d, stuck_s) if d.action == "stop" else None
            try:
                acted = await self._decide(d, sample)
            finally:
                if watch is not None:
                    watch.cancel()
            if not acted:
                continue
            covered = [x for x in self._decisions if x[0].action == "stop"]
            if not covered:
                continue
            self._decisions = collections.deque(x for x in self._decisions if x[0].action != "stop")
            for c, c_sample in covered:
                self.event(
                    "trip_during_stop",
                    f"{c.reason}; not acted on: the stop for {d.rule} was under way and covers it",
                    details={
                        "rule": c.rule,
                        "covered_by": d.rule,
                        "sample_ts": c_sample.ts if c_sample is not None else None,
                    },
                )

    def _decision_stuck(self, d: Decision, after_s: float) -> None:
        """A stop decision still running ``after_s`` after it began (the grace plus ``DECISION_MARGIN_S``): a step
        that never returns (a read of a process stuck in the driver, a Docker call that hangs) held it, and every
        later trip queued behind it, without a word (helper-43). Said once, critical; the decision is not cut."""
        self.event(
            "stop_stuck",
            f"the stop for {d.rule} has not ended {after_s:g} s after it began ({d.reason}); later trips wait for it. "
            "Check the model (`docker ps`) and the host: a process stuck in the driver?",
            severity="critical",
            details={"rule": d.rule, "after_s": after_s, "queued": len(self._decisions)},
        )

    def _decider_done(self, task: asyncio.Task[None]) -> None:
        """A decision that raised ends the main loop as a failed tick does (``daemon_crashed``)."""
        if task.cancelled() or task.exception() is None:
            return
        self._decider_error = task.exception()
        fut = self._tick_fut
        if fut is not None and not fut.done():
            fut.set_exception(self._decider_error)  # type: ignore[arg-type]

    def _on_tick(self) -> None:
        """One tick on the event loop; schedules the next one, or hands decisions to ``main_loop``."""
        fut = self._tick_fut
        self._tick_handle = None
        if fut is None or fut.done():
            return
        try:
            if self._early_wake and (left_s := self._next_at - self.mono()) > 0.001:  # a wake for the watchdog only
                self._ping_watchdog(now_too=True)
                self._schedule_tick(fut.get_loop(), left_s)
                return
            if self.stall_file:
                self._test_stall()
            result = self._tick_once()
            if result is None:  # /proc/meminfo could not be read: blind, and said so (event, status)
                _daemon_decide.handle_blind_tick(self)
            acting = _daemon_decide.handle_sync(self, result) if result is not None else []
            if acting:
                assert result is not None
                fut.set_result((result, acting))
                return
            delay_s = self._after_tick(result)
            # the loop main_loop runs on (asyncio.get_running_loop() costs a getpid() system call)
            self._schedule_tick(fut.get_loop(), delay_s)
        except BaseException as e:  # never a silent end of the ticks: main_loop raises it
            fut.set_exception(e)

    def _after_tick(self, result: TickResult | None) -> float:
        """Sampling mode, watchdog, and the next tick's time; returns the delay until it (s)."""
        _daemon_decide.update_mode(self, result)  # (not through _update_mode: a frame less per tick, issue 18)
        self._ping_watchdog()
        interval = self.current_interval()
        # the gap is judged by the interval this tick was scheduled at: a switch to fast sampling (0.25 s) read a
        # 40 s interval's wait as "no sample for 40.0 s (interval 0.25 s)", a critical guard_gap (helper-42)
        waited, self._interval_in_effect = self._interval_in_effect or interval, interval
        self._next_at += interval
        now = self.mono()
        last, self._last_tick_at = self._last_tick_at, now
        # the time since the previous tick: the whole hole in the samples (from the time this tick was
        # due, it read one interval short: 9.4 s for a 10 s SIGSTOP at 1 Hz)
        gap_s = now - last if last is not None else 0.0
        if gap_s > LATE_FACTOR * waited and not self._note_gap(gap_s, waited):
            self._note_stall(now, gap_s, waited)  # a short stall: many of them are reported together
        if self._next_at < now + interval / 2:
            # fell behind (a stall, a suspend, a slow tick): the next sample one interval on, never a catch-up
            # tick at once (two samples 0.00 s apart counted "2/2 samples" after a SIGSTOP: no debounce)
            self._next_at = now + interval
        return max(0.0, self._next_at - now)

    def _note_stall(self, now: float, gap_s: float, interval_s: float) -> None:
        report = self.stalls.late(now, gap_s, interval_s)
        if report is not None:
            self.event("guard_stalled", report.message(), severity="critical", details=report.details())

    def _note_gap(self, gap_s: float, interval_s: float) -> bool:
        """A tick came far too late (the process was stopped, the host froze or starved us): the guard
        saw nothing meanwhile — say so, loudly, instead of leaving a silent hole in the samples.
        Returns whether it was reported (False: a short stall, for ``core.stalls``)."""
        if gap_s < max(3 * interval_s, 2.0):
            return False
        self.blind_gaps += 1
        self.event(
            "guard_gap",
            f"no sample for {gap_s:.1f} s (interval {interval_s:g} s): the guard was not running "
            "(process stopped, host frozen or CPU-starved); nothing was guarded in that time",
            severity="critical",
            details={"gap_s": round(gap_s, 3), "interval_s": interval_s},
        )
        return True

    def request_exit(self) -> None:
        """Ask the main loop to finish (signal handlers call this; it only sets flags)."""
        self.should_exit.set()
        fut = self._tick_fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def shutdown(self, reason: str = "signal") -> None:
        self.should_exit.set()  # the last snapshot says "not running", whatever ended the loop
        if self._decider is not None and not self._decider.done():
            await asyncio.wait([self._decider])  # a stop in progress is finished, never cut short
        self.notifier.notify("STOPPING=1")
        await self.actions.close()
        if self.api_server is not None:
            self.api_server.should_exit = True
        from sparkd.act.stop import archives_last_try

        await archives_last_try(self)  # a postmortem held in memory (a full disk) is tried once more, or said lost
        self.event("daemon_stopped", f"sparkd stopping ({reason})")
        if self.writer:
            self.writer.submit("status", self.status_json().model_dump(mode="json"))
        if self.event_notifier is not None:
            await asyncio.to_thread(self.event_notifier.close, 5.0)
        if self.relief.task is not None:
            self.relief.task.cancel()
        for t in self._tasks:
            if t.get_name() != "sparkd-api":
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.writer:
            if self.guard:
                for start, count in self.guard.nvrm.flush():
                    self.writer.submit("nvrm_window", (start, self.settings.nvrm_window_s, count))
            end: dict[str, Any] | None = None
            if self.run_id is not None:
                end = {"id": self.run_id, "stopped_at": time.time(), "exit_reason": reason}
                end["samples"] = self.samples_taken
            try:
                self.writer.flush()
                self.writer.close()
                if self.store and end is not None:
                    self.store.write_batch([("run_end", dict(end))])  # it pops the id
                    end = None
            except Exception as e:  # a database that failed while running must not turn a stop into a traceback
                log.error("database at shutdown: %s; %d records not written", _one_line(e), self.writer.queue.qsize())
            if end is not None:  # not in the database: the next start takes it from the state dir
                _daemon_db.note_run_end(self, end)
        if self._kern_gate is not None:
            self._kern_gate.close()
        if self.guard and self.guard.kern_source is not None:
            self.guard.kern_source.close()
        if self.store:
            with contextlib.suppress(Exception):
                self.store.close()
        if self._lock is not None:  # releases the state-directory lock
            self._lock.release()
            self._lock = None

    async def serve(self) -> None:
        """startup → main_loop → shutdown, with SIGTERM/SIGINT setting ``should_exit``."""
        loop = asyncio.get_running_loop()
        reason = {"why": "signal"}

        def _sig(signum: int) -> None:
            reason["why"] = signal.Signals(signum).name
            self.request_exit()

        def _hup() -> None:  # its default action ended the guard at once, unsaid, and systemd's on-failure counts
            # SIGHUP as a clean exit: no restart (helper-40; a closed terminal of a foreground `sparkd run` sends it)
            self.event(
                "signal_ignored",
                "SIGHUP ignored: sparkd does not reload its configuration and goes on guarding; to apply a changed "
                "configuration, restart it (systemctl restart sparkd)",
                severity="warning",
                details={"signal": "SIGHUP"},
            )

        def _tty_stop() -> None:  # Ctrl-Z on a foreground `sparkd run`: the default action froze the guard,
            # unsaid until a guard_gap after SIGCONT (helper-45)
            self.event(
                "signal_ignored",
                "SIGTSTP ignored: a guard does not pause (a terminal's Ctrl-Z); to stop guarding, stop sparkd "
                "(systemctl stop sparkd, or Ctrl-C)",
                severity="warning",
                details={"signal": "SIGTSTP"},
            )

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _sig, sig)
        loop.add_signal_handler(signal.SIGHUP, _hup)
        loop.add_signal_handler(signal.SIGTSTP, _tty_stop)
        # a background run that reads or writes its terminal (`stty tostop`): ignored outright, not handled. A
        # handler returns into the write the kernel restarts, which signals again, for ever (helper-46); ignored,
        # the write goes through
        for sig in (signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(sig, signal.SIG_IGN)
        try:
            await self.startup()
        except Exception as e:  # a start-up that fails past the config checks: said, as a crash of the loop is
            if isinstance(e, ConfigError | StoreError):
                raise  # a configuration or database refusal: its own clear message, exit code 2
            reason["why"] = self._crashed(e, "start-up")
            with contextlib.suppress(Exception):
                await self.shutdown(reason["why"])
            raise
        try:
            await self.main_loop()
        except Exception as e:  # the guard itself failed: say so loudly, never as a clean stop by a signal
            reason["why"] = self._crashed(e, "loop")
            raise
        finally:
            await self.shutdown(reason["why"])

    def _crashed(self, e: BaseException, where: str) -> str:
        """Say that the guard failed (``daemon_crashed``, critical; the log): never a clean stop by a signal.
        Returns the exit reason ("crash: …")."""
        err = f"{type(e).__name__}: {_one_line(e)}"
        log.critical("the guard %s failed, sparkd stops (systemd restarts it): %s", where, err, exc_info=True)
        self.event(
            "daemon_crashed",
            f"the guard {'failed' if where == 'loop' else 'failed at start-up'} and sparkd stops: {err}; nothing is "
            "guarded until it is started again",
            severity="critical",
            details={"error": err, "where": _where(e)},
        )
        return f"crash: {err}"
