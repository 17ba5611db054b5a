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
import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import sdnotify

from sparkd import __version__
from sparkd.act.notify import Notifier
from sparkd.config import Settings, effective_config
from sparkd.core.choices import SamplingMode
from sparkd.core.floors import FloorWarning, LoopGuard, check_floors, read_vm_tunables
from sparkd.core.leak import LeakTracker
from sparkd.core.rules import Decision
from sparkd.core.sample import Sample
from sparkd.errors import ConfigError, Refused, StoreError
from sparkd.loop.consumers import ConsumerWatch
from sparkd.loop.guard import Guard, TickResult
from sparkd.loop.httpserver import (
    ACCEPT_BACKLOG,
    HttpStats,
    OncePerInterval,
    RateLimitedLog,
    connection_cap,
    guarded_protocol,
    install_exception_handler,
    raise_nofile,
)
from sparkd.loop.reads import Reads
from sparkd.loop.relief import ReliefRunner
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
    NotifyStatus,
    ReliefStatus,
    ResizeResult,
    RuleStatus,
    SampleRow,
    Status,
    WatermarkStatus,
    WriterStatus,
)
from sparkd.sense import procfs
from sparkd.sense.kernlog import KernRecord, open_source
from sparkd.store.keeper import DbKeeper
from sparkd.store.store import Store, Writer
from sparkd.units import GiB, fmt_gib, parse_size

log = logging.getLogger("sparkd.loop.daemon")

STATUS_EVERY_S = 1.0  # while something moves (a counter, the mode, the container, an event)
STATUS_QUIET_S = 5.0  # otherwise: the snapshot `sparkd status` reads is at most this old (+ store.WRITE_EVERY_S)
DB_FIRST_WAIT_S = 1.0  # start-up waits this long for the database before the guard starts without it
DB_CHECK_S = 0.5  # how often the database keeper looks at the writer and the file (inode)
LIVE_SAMPLES = 1800  # samples kept in memory for the read side when the database cannot answer


class Actions(Protocol):
    """What the daemon asks of the container side (filled in by ``supervisor``)."""

    async def start(self, daemon: Daemon) -> None: ...

    async def on_stop(self, decision: Decision) -> None: ...

    def on_kernel_record(self, rec: KernRecord) -> None: ...

    def fast_reason(self) -> str | None: ...

    def observe(self, sample: Sample) -> None: ...

    def status_json(self) -> ContainerStatus: ...

    async def request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]: ...

    async def resize(self, changes: dict[str, Any], *, dry_run: bool, source: str) -> ResizeResult: ...

    async def close(self) -> None: ...


class MonitorOnly:
    """No container to act on: a stop decision is recorded, nothing else happens."""

    def __init__(self, why: str = "no container configured") -> None:
        self.why = why
        self.daemon: Daemon | None = None

    async def start(self, daemon: Daemon) -> None:
        self.daemon = daemon

    async def on_stop(self, decision: Decision) -> None:
        if self.daemon:
            self.daemon.event(
                "stop_not_executed",
                f"monitor-only ({self.why}): would stop: {decision.reason}",
                severity="warning",
                details={"rule": decision.rule},
            )

    def on_kernel_record(self, rec: KernRecord) -> None:
        return None

    def fast_reason(self) -> str | None:
        return None

    def observe(self, sample: Sample) -> None:
        return None

    def status_json(self) -> ContainerStatus:
        return ContainerStatus(mode="monitor-only", reason=self.why)

    async def request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]:
        raise Refused(f"monitor-only: {self.why}; cannot {action} a container")

    async def resize(self, changes: dict[str, Any], *, dry_run: bool, source: str) -> ResizeResult:
        raise Refused(f"monitor-only: {self.why}; nothing to resize")

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
        self.live_samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=LIVE_SAMPLES)
        self.reads = Reads(self)
        self._db_opened = asyncio.Event()
        self._db_good_at = time.time()  # wall time of the last check that found the database file in place
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
        self._wake: asyncio.Future[None] | None = None
        self._last_watchdog = 0.0
        self._watchdog_s = self._watchdog_interval()
        self._tasks: list[asyncio.Task[Any]] = []
        self._read_error_logged = False
        self.api_server: Any = None
        self.http_stats = HttpStats()
        self.http_log: RateLimitedLog | None = None
        self.api_socket: socket.socket | None = None
        self.kern_source_name = "off"
        self.notify_hooks: list[Callable[[dict[str, Any]], None]] = []
        # called with the Decision the moment a stop is decided, beside the local stop (cluster broadcast)
        self.stop_hooks: list[Callable[[Decision], None]] = []
        self.cluster: Any = None  # sparkd.loop.cluster.Cluster when [cluster] has peers
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
        self._cooldown_logged: dict[str, float] = {}
        self._lock_fd: int | None = None
        self.consumers: ConsumerWatch | None = None  # built in startup when consumers.enabled
        self.relief = ReliefRunner(
            settings.relief,
            proc_root=settings.proc_root,
            emit=lambda k, m, sev, det: self.event(k, m, severity=sev, details=det),
            relieved=self._relieved,
            mono=mono,
        )
        self._blind_key: tuple[tuple[str, str], ...] | None = None

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
        if kind in ("stopped", "killed") and self.guard is not None:
            took = ((details or {}).get("durations_s") or {}).get("stop")
            if isinstance(took, int | float):
                self.guard.engine.note_stop_duration(float(took))  # the predictive horizon learns it
        if kind in ("launched", "adopted", "restarted_outside"):  # a new run of the container
            started: float = (details or {}).get("started_at") or time.time()
            self.leak.start_launch(launch_id, started)
            self.loop_guard.note_launch(time.time())
        elif kind == "ready":
            self.check_floors(healthy=True)
        return ev

    def check_floors(self, *, healthy: bool) -> None:
        """Compare each rule's floor with the kernel's low watermark and the MemAvailable seen
        while healthy; report each new problem once as a ``watermark`` warning."""
        g = self.guard
        last = g.last if g else None
        if g is None or last is None or last.mem_available is None:
            return
        if healthy:
            self.loop_guard.note_healthy(time.time(), last.mem_available, last.cma_free)
        self.floor_warnings = check_floors(
            g.rules,
            healthy_mem_available_bytes=last.mem_available,
            low_watermark_bytes=g.low_watermark,
            min_free_kbytes=self.vm_tunables.get("min_free_kbytes"),
            watermark_scale_factor=self.vm_tunables.get("watermark_scale_factor"),
            healthy_cma_free_bytes=last.cma_free,
        )
        for w in self.floor_warnings:
            if w.severity == "warning" and w.message not in self._reported_floors:
                self._reported_floors.add(w.message)
                self.event("watermark", w.message, severity="warning", details=w.details())

    def status_json(self) -> Status:
        """The in-memory state (``sparkd status``, ``/api/status``): a ``sparkd.loop.status.Status``.

        Sizes in bytes. Call on the event loop: it reads state the loop mutates.

        Raises:
            pydantic.ValidationError: a part no longer matches the contract (a bug, not input).
        """
        g = self.guard
        last = g.last if g else None
        ticks = sorted(self.tick_durations)
        container = self.actions.status_json()
        w = self.writer
        return Status(
            ts=time.time(),
            running=not self.should_exit.is_set(),
            version=__version__,
            pid=os.getpid(),
            started_at=self.started_at,
            samples_taken=self.samples_taken,
            interval_s=self.current_interval(),
            mode=self.mode,
            mode_reason=self.mode_reason,
            dry_run=self.settings.dry_run,
            sample=SampleRow.model_validate(last.to_row()) if last else None,
            rules=[RuleStatus.model_validate(r) for r in g.rules_json()] if g else [],
            kernel_log=KernelLogStatus(
                source=self.kern_source_name,
                nvrm_lines=g.nvrm_lines_total if g else 0,
                lines_read=g.kern_lines_total if g else 0,
                # records the kernel's ring buffer overwrote before sparkd read them (/dev/kmsg: EPIPE
                # and the sequence-number gap); 0 for readers that cannot tell
                lost=getattr(g.kern_source, "lost_records", 0) if g else 0,
                nvrm_bursts=g.bursts.bursts if g else 0,
            ),
            blind=BlindStatus.model_validate(self.blind_json()),
            usable_bytes=last.mem_available_minus_cma if last else None,
            container=container,
            writer=WriterStatus(
                queued=w.queue.qsize() if w else 0,
                written=w.written if w else 0,
                dropped=w.dropped if w else 0,
                refused=w.refused if w else 0,
                last_error=w.last_error if w else None,
            ),
            database=DatabaseStatus.model_validate(self.db.status()),
            http=HttpStatus(
                connection_cap=self.http_stats.cap,
                refused=self.http_stats.refused,
                head_timeouts=self.http_stats.head_timeouts,
            ),
            tick_s_p50=ticks[len(ticks) // 2] if ticks else None,
            leak=LeakStatus.model_validate(self.leak.status()),
            watermark=WatermarkStatus.model_validate(
                {
                    "vm": self.vm_tunables,
                    "low_watermark_bytes": g.low_watermark if g else None,
                    **self.loop_guard.status(),
                    "warnings": [fw.message for fw in self.floor_warnings],
                }
            ),
            notify=NotifyStatus.model_validate(self.event_notifier.stats.to_json()) if self.event_notifier else None,
            gpu=[GpuStatus.model_validate(x) for x in self.gpu],
            events=[EventRow.model_validate(e) for e in list(self.recent_events)[:20]],
            plan=container.plan,
            consumers=ConsumersStatus.model_validate(cs) if (cs := self._consumers_status()) else None,
            relief=ReliefStatus.model_validate(self.relief.status()),
        )

    def _relieved(self, rule: str) -> None:
        if self.guard is not None:
            self.guard.engine.relieved(rule)

    def _consumers_status(self) -> dict[str, Any] | None:
        return self.consumers.status() if self.consumers else None

    def _make_consumer_watch(self) -> ConsumerWatch:
        """The process scan, fed with the supervisor's container id, the guard's MemAvailable and the plan."""
        s = self.settings

        def container_ids() -> list[str]:
            cid = self.actions.status_json().container_id
            return [cid] if cid else []

        def mem_available() -> int | None:
            last = self.guard.last if self.guard else None
            return last.mem_available if last else None

        def plan_left() -> int | None:
            plan = self.actions.status_json().plan
            if plan is None:
                return None
            return int((plan.mem_total_gib - plan.budget_gib) * GiB)

        return ConsumerWatch(
            s.consumers,
            host_reserve_bytes=int(s.budget.host_reserve_gib * GiB),
            container_ids=container_ids,
            mem_available=mem_available,
            plan_left_bytes=plan_left,
            emit=lambda k, m, sev, det: self.event(k, m, severity=sev, details=det),
            submit=self.writer.submit if self.writer else None,
        )

    def blind_json(self) -> dict[str, dict[str, str]]:
        """``{"sensors": {input: why}, "rules": {rule: why}}``: each input a rule needs that
        cannot be read (with the rules that need it), and each rule that therefore cannot
        evaluate (never shown as a quiet 0/N). Inputs no rule reads are not listed."""
        g = self.guard
        if g is None:
            return {"sensors": {}, "rules": {}}
        users = g.sensor_users()
        sensors = {
            name: f"{why}; needed by {', '.join(users[name])}"
            for name, why in g.blind_sensors().items()
            if name in users
        }
        return {"sensors": sensors, "rules": g.engine.blind()}

    def _check_blind(self) -> None:
        """An event at start and whenever the set of blind inputs or rules changes."""
        b = self.blind_json()
        key = tuple(sorted(b["sensors"].items())) + tuple(sorted(("rule " + k, v) for k, v in b["rules"].items()))
        if key == self._blind_key:
            return
        first = self._blind_key is None
        self._blind_key = key
        if not key:
            if not first:
                self.event("sensors_restored", "every input the rules need is read again")
            return
        parts = [f"{k}: {v}" for k, v in b["sensors"].items()]
        parts += [f"rule {k} {v}" for k, v in b["rules"].items()]
        self.event(
            "sensor_blind",
            "blind: " + "; ".join(parts),
            severity="critical" if b["rules"] else "warning",
            details=b,
        )

    def current_interval(self) -> float:
        return self.settings.fast_interval_s if self.mode == "fast" else self.settings.interval_s

    def summary_line(self) -> str:
        last = self.guard.last if self.guard else None
        if last is None:
            return "starting"
        counting = [
            f"{r['name']} {r['counter']}/{r['samples']}"
            for r in (self.guard.rules_json() if self.guard else [])
            if r["counter"]
        ]
        c = self.actions.status_json()
        return (
            f"MemAvailable {fmt_gib(last.mem_available)}, MemFree {fmt_gib(last.mem_free)}; "
            f"{'rules: ' + ', '.join(counting) if counting else 'rules quiet'}; "
            f"container: {c.mode if c.mode == 'monitor-only' else c.state}; sampling {self.mode}"
        )

    # ------------------------------------------------------------------ lifecycle
    def _lock_state_dir(self) -> None:
        """One daemon per state directory: an exclusive ``flock`` on ``<state_dir>/sparkd.lock``.

        Raises:
            StoreError: another sparkd holds it (the message names its pid and the directory).
        """
        import fcntl

        path = Path(self.settings.state_dir) / "sparkd.lock"
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if (path.parent.stat().st_mode & 0o777) != 0o700 and path.parent.stat().st_uid == os.geteuid():
                os.chmod(path.parent, 0o700)  # whatever the umask: samples, events and the token are ours
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StoreError(f"cannot use state directory {path.parent}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreError(
                f"another sparkd (pid {other}) is running with state directory {path.parent}; "
                "stop it first, or give this one its own state_dir (SPARKD_STATE_DIR)"
            ) from None
        try:  # the pid is for the message above; a full disk must not stop the guard
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            log.warning("cannot write the pid into %s: %s (ignoring)", path, e.strerror)
        self._lock_fd = fd

    async def startup(self) -> None:
        s = self.settings
        self._lock_state_dir()
        # the guard never depends on the database: a full disk, a corrupt file or a lock held by
        # another process is an event and a status FAIL, retried with back-off (store.keeper)
        # The first open runs beside the guard: start-up waits for it at most DB_FIRST_WAIT_S (a
        # write lock held elsewhere costs SQLite's busy timeout), then sampling starts regardless.
        self.writer = Writer(None, maxsize=s.queue_max)
        db_task = asyncio.create_task(self._db_loop(), name="sparkd-db")
        self._tasks.append(db_task)
        await asyncio.wait([asyncio.ensure_future(self._db_opened.wait())], timeout=DB_FIRST_WAIT_S)
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
        self._tasks.append(asyncio.create_task(self.writer.run(), name="sparkd-writer"))
        self._tasks.append(asyncio.create_task(self._retention_loop(), name="sparkd-retention"))
        self._tasks.append(asyncio.create_task(self._gpu_loop(), name="sparkd-gpu"))
        if s.consumers.enabled:
            self.consumers = self._make_consumer_watch()
        loop = asyncio.get_running_loop()
        self.event_notifier = Notifier(
            s.notify,
            dispatch=loop.call_soon_threadsafe,
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
        if self.store is not None:
            await asyncio.to_thread(self.writer.flush)  # the first sample stored before READY=1
        self.check_floors(healthy=True)  # at start: the host as it is now counts as healthy
        if self.serve_api:
            try:
                await self._start_api()
            except ConfigError as e:  # the token file cannot be made (state dir full): guard without the API
                self.event(
                    "api_unavailable",
                    f"API not served: {e.message}; the guard runs without it (fix and restart sparkd)",
                    severity="critical",
                )
        await self.actions.start(self)
        if self.consumers is not None:  # after the supervisor has attached: the first scan knows the container
            self._tasks.append(asyncio.create_task(self.consumers.run(), name="sparkd-consumers"))
        self.event(
            "daemon_started",
            f"sparkd {__version__} started (pid {os.getpid()}, kernel log: {self.kern_source_name}, db: {s.db_file})",
            details={"dry_run": s.dry_run},
        )
        self.ready = True
        self.notifier.notify("READY=1")
        self.notifier.notify(f"STATUS={self.summary_line()}")

    async def _start_api(self) -> None:
        import uvicorn

        from sparkd.loop.quietserver import QuietServer

        assert self.app_factory is not None
        app = self.app_factory(self)
        host, port = self.settings.api.host, self.settings.api.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto IPPROTO_TCP, as asyncio's own server sockets: asyncio sets TCP_NODELAY only on sockets
        # that say TCP, and without it every response waits ~40 ms for a delayed ACK (bench/api.py)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise OSError(
                f"the API cannot listen on {host}:{port}: {e.strerror} (another sparkd? set api.port "
                "or SPARKD_API__PORT)"
            ) from None
        sock.listen(ACCEPT_BACKLOG)
        sock.set_inheritable(True)
        self.api_socket = sock
        api = self.settings.api
        soft, hard = raise_nofile()
        cap = connection_cap(api.max_connections, soft)
        self.http_stats = HttpStats(cap=cap)
        limited = RateLimitedLog(logging.getLogger("sparkd.api.server"))
        self.http_log = limited
        install_exception_handler(asyncio.get_running_loop(), limited)
        for name in ("uvicorn.error", "asyncio"):
            logging.getLogger(name).addFilter(OncePerInterval())
        log.info(
            "API: at most %d connections (descriptor limit %d/%d), request head within %g s",
            cap,
            soft,
            hard,
            api.header_timeout_s,
        )
        sockets = [sock, *self._link_sockets(port)]
        cfg = uvicorn.Config(
            app,
            host=self.settings.api.host,
            port=self.settings.api.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http=guarded_protocol(cap, api.header_timeout_s, self.http_stats, limited),
            h11_max_incomplete_event_size=api.max_header_bytes,
            timeout_keep_alive=5,
            backlog=ACCEPT_BACKLOG,
        )
        server = QuietServer(cfg)  # no 0.1 s tick (uvicorn's Server wakes the loop ten times a second)
        # the daemon owns SIGTERM/SIGINT; uvicorn must not capture (and later re-raise) them
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self.api_server = server
        self._tasks.append(asyncio.create_task(server.serve(sockets=sockets), name="sparkd-api"))
        for _ in range(200):
            if server.started:
                break
            if server.should_exit:
                raise OSError(f"API could not bind {self.settings.api.host}:{self.settings.api.port}")
            await asyncio.sleep(0.025)
        if self.settings.api.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning(
                "API bound to %s:%d — reachable beyond this machine (api.allow_remote = true)",
                self.settings.api.host,
                self.settings.api.port,
            )

    def _link_sockets(self, port: int) -> list[socket.socket]:
        """Sockets on ``cluster.listen`` (the link network, for peer calls only; see face/peer.py)."""
        out = []
        for host in self.settings.cluster.listen:
            s = socket.socket(
                socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
            )
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                s.close()
                raise OSError(f"cluster.listen: the API cannot listen on {host}:{port}: {e.strerror}") from None
            s.listen(ACCEPT_BACKLOG)
            out.append(s)
        return out

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
        assert self.writer is not None
        sample = result.sample
        row = sample.to_row()
        self.live_samples.append(row)
        self.writer.submit("sample", row)
        self.actions.observe(sample)
        alert = self.leak.observe(sample.ts, sample.driver_bytes)
        if alert is not None:
            self.event(
                "leak_trend", alert.reason, severity="warning", details=alert.details(), launch_id=alert.launch_id
            )
        for rec in result.kernel:
            self._record_kernel(rec, sample)
            if rec.kind == "nvrm_no_memory" and self.settings.nvrm_action == "stop":
                await self._decide(
                    Decision(
                        "nvrm_action", "trip", "stop", f"nvrm_action = stop: driver error {rec.message[:160]}", 1, 1
                    )
                )
        if result.nvrm_burst is not None:
            self.event(
                "nvrm_burst",
                f"{result.nvrm_burst} NV_ERR_NO_MEMORY lines within {self.settings.nvrm_window_s:g} s "
                f"(threshold {self.settings.nvrm_burst}; usable {fmt_gib(sample.mem_available_minus_cma)})",
                severity="warning",
                details={
                    "lines": result.nvrm_burst,
                    "threshold": self.settings.nvrm_burst,
                    "context": sample.context(),
                },
            )
        for d in result.decisions:
            await self._decide(d, sample)
        self._check_blind()
        if self.guard is not None:  # a MemFree rule counting: maybe drop clean page cache first (relief.enabled)
            self.relief.consider(self.guard.rules, self.guard.states)
        now = self.mono()
        for start, count in self.guard.nvrm.closed_windows(self.guard.mono()) if self.guard else []:
            self.writer.submit("nvrm_window", (start, self.settings.nvrm_window_s, count))
        since = now - self._last_status
        if since >= STATUS_EVERY_S:
            g = self.guard
            key = (
                tuple(st.counter for st in g.states.values()) if g else (),
                self.mode,
                self.actions.status_json().state,
                id(self.recent_events[0]) if self.recent_events else None,
            )
            if key != self._status_key or since >= STATUS_QUIET_S:
                self._status_key, self._last_status = key, now
                self.writer.submit("status", self.status_json().model_dump(mode="json"))
                self.notifier.notify(f"STATUS={self.summary_line()}")

    def _record_kernel(self, rec: KernRecord, sample: Any) -> None:
        assert self.writer is not None
        minute = sample.ts - sample.ts % 60
        self.writer.submit("kcount", (minute, rec.kind, 1))
        severity = {"nvrm_no_memory": "warning", "oom_kill": "critical", "oom_killed": "critical"}.get(rec.kind, "info")
        details = {"line": rec.raw, "context": sample.context(), **rec.details}
        for key in ("pid", "comm", "container_id"):
            if getattr(rec, key, None) is not None:
                details[key] = getattr(rec, key)
        self.event(rec.kind, rec.message, severity=severity, details=details)
        self.actions.on_kernel_record(rec)

    async def _decide(self, d: Decision, sample: Sample | None = None) -> None:
        if d.kind == "near_miss":
            # one event per streak start keeps the log readable; every near miss is counted in the rule state
            if self.guard and self.guard.states[d.rule].near_misses % 10 == 1:
                self.event("near_miss", d.reason, severity="info", details={"rule": d.rule, **_jsonable(d.values)})
            return
        if d.kind == "cooldown":
            # once per rule per cooldown window: a rule that keeps holding must not flood the event log
            last = self._cooldown_logged.get(d.rule)
            now = self.mono()
            if last is None or now - last >= max(self.settings.cooldown_s, 1.0):
                self._cooldown_logged[d.rule] = now
                self.event(
                    "trip_cooldown",
                    d.reason + " (further trips in this cooldown are counted, not logged)",
                    severity="warning",
                    details={"rule": d.rule},
                )
            return
        shares = await self.consumers.at_trip() if self.consumers else None
        if shares is not None:  # who grew: in the trip event, and in the reason the stop and its archive carry
            d = dataclasses.replace(d, reason=f"{d.reason}; who grew {shares.text}")
        self.event(
            "trip",
            d.reason,
            severity="critical" if d.action == "stop" else "warning",
            details={
                "rule": d.rule,
                "action": d.action,
                "count": d.counter,
                "sample_ts": sample.ts if sample is not None else None,
                **_jsonable(d.values),
                **({"fall_shares_bytes": shares.shares_bytes} if shares else {}),
            },
        )
        if d.action != "stop":
            return
        rule = self.guard.rule(d.rule) if self.guard else None
        if self.guard and rule is not None:
            verdict = self.loop_guard.record_trip(rule, time.time())
            if verdict is not None:
                self.guard.engine.demote(verdict.rule, verdict.reason)
                self.event("watermark", verdict.reason, severity="warning", details=verdict.details())
                return
        if self.settings.dry_run:
            self.event("dry_run", f"dry run: would stop ({d.reason})", severity="warning", details={"rule": d.rule})
            return
        if self.settings.recheck and self.guard:
            fresh = self.guard.read_sample()
            if self.guard.rule(d.rule) is not None and not self.guard.engine.recheck(d.rule, fresh):
                self.event(
                    "recovered_before_stop",
                    f"{d.rule}: recovered before stop (MemAvailable {fmt_gib(fresh.mem_available)}, "
                    f"usable {fmt_gib(fresh.mem_available_minus_cma)}, "
                    f"MemFree {fmt_gib(fresh.mem_free)} on re-check)",
                    severity="warning",
                    details={"rule": d.rule},
                )
                return
        for hook in self.stop_hooks:
            hook(d)
        await self.actions.on_stop(d)

    def _update_mode(self, result: TickResult | None) -> None:
        assert self.guard is not None
        now = self.mono()
        reason = self.actions.fast_reason()
        if reason is None and result is not None:
            reason = self.guard.fast_reason(result.sample)
        if reason is not None:
            self._fast_until = now + self.settings.fast_hold_s
            if self.mode != "fast":
                self.event(
                    "sampling_fast",
                    f"sampling every {self.settings.fast_interval_s:g} s: {reason}",
                    details={"reason": reason},
                )
            self.mode, self.mode_reason = "fast", reason
        elif self.mode == "fast" and now >= self._fast_until:
            self.mode, self.mode_reason = "normal", None
            self.event("sampling_normal", f"sampling every {self.settings.interval_s:g} s again")

    async def retention_once(self, now: float | None = None) -> dict[str, Any]:
        """Prune and aggregate the store, cap the archives (oldest first, never the newest)."""
        from sparkd.act.archive import prune_archives

        if self.store is None:
            return {}
        r = self.settings.retention
        removed = await asyncio.to_thread(
            self.store.prune,
            now=now or time.time(),
            raw_keep_s=r.raw_samples_s,
            minutes_keep_s=r.minute_aggregates_s,
            events_keep_s=r.events_s,
        )
        await asyncio.to_thread(self.store.vacuum)
        gone = await asyncio.to_thread(
            prune_archives,
            self.settings.archives_path,
            max_count=r.archives_max_count,
            max_total_bytes=parse_size(r.archives_max_bytes),
        )
        if gone:
            self.event(
                "archives_pruned", f"removed {len(gone)} old archives: {', '.join(gone[:5])}", details={"removed": gone}
            )
        return {**removed, "archives": len(gone)}

    async def _retention_loop(self) -> None:
        # not during start-up (the riskiest phase of a launch is then, and the first minute of a daemon)
        await asyncio.sleep(min(60.0, self.settings.retention.interval_s))
        while True:
            try:
                await self.retention_once()
            except Exception as e:
                log.warning("retention failed: %s", e)
            await asyncio.sleep(self.settings.retention.interval_s)

    async def _gpu_loop(self) -> None:
        """NVML readings in a worker thread (an NVML call can block in the driver)."""
        from sparkd.sense.gpu import GpuSampler

        sampler = GpuSampler(self.settings.gpu_interval_s)
        while True:
            try:
                readings = await asyncio.to_thread(sampler.sample)
            except Exception as e:
                log.warning("GPU readings failed: %s", e)
                readings = []
            self.gpu = [r.to_json() for r in readings]
            ts = time.time()
            for r in readings:
                if r.available and self.writer:
                    self.writer.submit(
                        "gpu",
                        {
                            "ts": ts,
                            "gpu_index": r.index,
                            "name": r.name,
                            "utilization_pct": r.utilization_pct,
                            "temperature_c": r.temperature_c,
                            "power_w": r.power_w,
                            "memory_total_bytes": r.memory_total_bytes,
                            "memory_used_bytes": r.memory_used_bytes,
                            "memory_supported": r.memory_supported,
                        },
                    )
            if readings and not any(r.available for r in readings):
                return  # no NVML here: asked once, answered once
            await asyncio.sleep(self.settings.gpu_interval_s)

    async def _begin_run(self) -> bool:
        """Record this run in a just-opened store; False (store dropped, retried later) when the
        database refuses the first write (a write lock held by another process, a full disk)."""
        assert self.store is not None and self.writer is not None
        try:
            self.run_id = await asyncio.to_thread(
                self.store.start_run,
                pid=os.getpid(),
                version=__version__,
                hostname=socket.gethostname(),
                config=effective_config(self.settings),
            )
        except Exception as e:
            self.store = self.writer.store = None
            self.db.lost(_one_line(e), self.mono(), at_once=False)
            return False
        return True

    def _db_down_event(self) -> None:
        nxt = max(0.0, self.db.next_attempt_mono - self.mono())
        self.event(
            "database_unavailable",
            f"database {self.db.path} unusable: {self.db.error}; guarding from memory (samples, rules and "
            f"stops go on, records wait in a bounded queue); retrying in {nxt:.0f} s with back-off",
            severity="critical",
            details=self.db.status(),
        )

    async def _db_loop(self) -> None:
        """Watch the database without ever holding up the guard: a corrupt file (from the writer),
        a deleted or replaced file (inode), records refused for good; reopen with back-off."""
        try:
            self.store = await asyncio.to_thread(self.db.attempt, self.mono())
            if self.store is not None and self.writer is not None:
                self.writer.attach(self.store)
            if self.store is None or not await self._begin_run():
                self._db_down_event()
            if self.db.moved_aside:
                self.event(
                    "database_corrupt",
                    f"database {self.db.path} was corrupt: kept as {', '.join(self.db.moved_aside)}; "
                    "a new database was created and recording goes on",
                    severity="critical",
                    details=self.db.status(),
                )
        finally:
            self._db_opened.set()
        while True:
            try:
                await self._db_step()
            except Exception as e:  # never let the keeper die: it is what brings recording back
                log.error("database keeper: %s", _one_line(e))
            await asyncio.sleep(DB_CHECK_S)

    async def _db_step(self) -> None:
        w, now = self.writer, self.mono()
        if w is None:
            return
        while w.refusals:
            kind, refusal = w.refusals.pop(0)
            self.event(
                "record_refused",
                f"the database refused a {kind} record for good ({refusal}); dropped, later records go on",
                severity="warning",
                details={"kind": kind, "error": refusal},
            )
        if self.db.state == "ok":
            checked_at = time.time()
            why: str | None = w.fatal or await asyncio.to_thread(self.db.replaced)
            if why is None:
                self._db_good_at = checked_at
                return
            w.fatal, self.store = None, None
            w.attach(None)
            self.db.lost(why, now)
            if "deleted" in why or "replaced" in why:
                # what went into the unlinked file since the last good check is written again, from memory
                for row in [r for r in self.live_samples if r["ts"] >= self._db_good_at]:
                    w.submit("sample", row)
                for ev in [e for e in reversed(self.recent_events) if e["ts"] >= self._db_good_at]:
                    w.submit("event", dict(ev))
            self._db_down_event()
            return
        if now < self.db.next_attempt_mono:
            return
        was_error, moved = self.db.error, len(self.db.moved_aside)
        store = await asyncio.to_thread(self.db.attempt, now)
        if store is None:
            if self.db.error != was_error:  # said once per distinct reason, not once per attempt
                self._db_down_event()
            return
        self.store = store
        w.attach(store)
        if not await self._begin_run():
            self._db_down_event()
            return
        aside = self.db.moved_aside[moved:]
        self.event(
            "database_corrupt" if aside else "database_recovered",
            f"database {self.db.path} usable again; recording resumes"
            + (f" (corrupt file kept as {', '.join(aside)})" if aside else ""),
            severity="warning",
            details=self.db.status(),
        )

    def _ping_watchdog(self) -> None:
        if self._watchdog_s is None:
            return
        now = self.mono()
        if now - self._last_watchdog >= self._watchdog_s:
            self._last_watchdog = now
            self.notifier.notify("WATCHDOG=1")

    def _test_stall(self) -> None:
        # test-only hook (issue: "stall the guard loop"): blocks the loop while the file exists
        while self.stall_file and os.path.exists(self.stall_file):
            time.sleep(0.05)

    async def main_loop(self) -> None:
        next_at = self.mono()
        while not self.should_exit.is_set():
            self._test_stall()
            result = self._tick_once()
            if result is not None:
                await self._handle(result)
            self._update_mode(result)
            self._ping_watchdog()
            interval = self.current_interval()
            next_at += interval
            now = self.mono()
            if next_at < now - interval:  # fell behind (suspend, stall): do not burst
                next_at = now
            await self._sleep(next_at - now)

    async def _sleep(self, delay_s: float) -> None:
        """Sleep until the next tick; ``request_exit`` wakes it early. (A timer and a future per tick cost
        far less than ``wait_for`` on the event, which makes a task each time.)"""
        if delay_s <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._wake = fut
        handle = loop.call_later(delay_s, _wake_up, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._wake = None

    def request_exit(self) -> None:
        """Ask the main loop to finish (signal handlers call this; it only sets flags)."""
        self.should_exit.set()
        if self._wake is not None:
            _wake_up(self._wake)

    async def shutdown(self, reason: str = "signal") -> None:
        self.notifier.notify("STOPPING=1")
        await self.actions.close()
        if self.api_server is not None:
            self.api_server.should_exit = True
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
            try:
                self.writer.flush()
                if self.store and self.run_id is not None:
                    end = {"id": self.run_id, "stopped_at": time.time(), "exit_reason": reason}
                    self.store.write_batch([("run_end", {**end, "samples": self.samples_taken})])
            except Exception as e:  # a database that failed while running must not turn a stop into a traceback
                log.error("database at shutdown: %s; %d records not written", _one_line(e), self.writer.queue.qsize())
        if self.guard and self.guard.kern_source is not None:
            self.guard.kern_source.close()
        if self.store:
            with contextlib.suppress(Exception):
                self.store.close()
        if self._lock_fd is not None:  # releases the state-directory lock
            os.close(self._lock_fd)
            self._lock_fd = None

    async def serve(self) -> None:
        """startup → main_loop → shutdown, with SIGTERM/SIGINT setting ``should_exit``."""
        loop = asyncio.get_running_loop()
        reason = {"why": "signal"}

        def _sig(signum: int) -> None:
            reason["why"] = signal.Signals(signum).name
            self.request_exit()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _sig, sig)
        await self.startup()
        try:
            await self.main_loop()
        finally:
            await self.shutdown(reason["why"])


def _wake_up(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _one_line(e: BaseException) -> str:
    text = str(getattr(e, "orig", None) or e)
    return (text.splitlines() or [type(e).__name__])[0][:300]


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, int | float | str | None) else str(v)) for k, v in values.items()}
