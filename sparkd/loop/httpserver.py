"""The API's HTTP server settings: a guard's web side must never take the guard's descriptors.

Found in issue 13: 1,100 idle connections under ``ulimit -n 1024`` gave 354,269 "Too many
open files" tracebacks in 25 s at ~100 % CPU and /dev/shm went unmeasured; 200 slowloris
clients were never closed. Here:

* ``raise_nofile()`` lifts the soft ``RLIMIT_NOFILE`` to the hard limit (the unit sets
  ``LimitNOFILE=``);
* ``connection_cap(max_connections)`` keeps open HTTP connections below that limit minus
  ``FD_RESERVE`` descriptors for the guard and the stop path (/proc reads, the Docker socket,
  the archive, SQLite, the kernel log);
* ``guarded_protocol(...)`` is uvicorn's h11 protocol with that cap enforced at accept (a
  connection over it is closed at once, before it costs more than its socket), a deadline for
  the request head (idle and slow clients are closed after ``header_timeout_s``) and a cap on
  the head's size (``max_header_bytes``, h11 refuses a larger one with 400);
* ``ReadHold``: while the guard stops the model in an emergency, the connections read no new request until the
  stop's SIGTERM is out (the requests under way are answered). The event loop is the guard's too: 150 keep-alive
  connections asking for the dashboard put every worker-thread step of the stop behind their page renders, and the
  SIGTERM went out 6–10 s after the trip instead of 0.4 s (helper-33);
* ``RateLimitedLog`` logs a repeated error (accept failures, EMFILE) once per interval with a
  count of what it held back; ``install_exception_handler`` puts it on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("sparkd.loop.httpserver")

FD_RESERVE = 128  # descriptors HTTP may never take: SQLite (+WAL, SHM), /proc, Docker, archive, kmsg, NVML
# asyncio accepts up to ``backlog`` sockets per readable event before any protocol sees them (so
# before the cap can act): a small backlog bounds that burst. The cap leaves room for two bursts.
ACCEPT_BACKLOG = 64
LOG_EVERY_S = 10.0


def raise_nofile() -> tuple[int, int]:
    """Raise the soft descriptor limit to the hard one; returns (soft, hard) in effect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("cannot raise the descriptor limit %d → %d: %s (ignoring)", soft, hard, e)
    return soft, hard


def connection_cap(max_connections: int, soft_limit: int | None = None) -> int:
    """Open HTTP connections allowed: ``api.max_connections``, but never more than the soft
    descriptor limit minus ``FD_RESERVE`` and two accept bursts (``ACCEPT_BACKLOG``); at least 8."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(8, min(max_connections, soft_limit - FD_RESERVE - 2 * ACCEPT_BACKLOG))


class RateLimitedLog:
    """Log each distinct message at most once per ``every_s`` (monotonic), saying how many were held back."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self.written = 0
        self.held_total = 0

    def log(self, level: int, key: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._held[key] = self._held.get(key, 0) + 1
            self.held_total += 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        self.written += 1
        extra = f" ({held} more like it in the last {self.every_s:g} s)" if held else ""
        self.logger.log(level, "%s%s", message, extra)


class OncePerInterval(logging.Filter):
    """A logging filter: each distinct message (its format string) passes once per ``every_s``."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        super().__init__()
        self.every_s = every_s
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        key = str(record.msg)
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return False
        self._last[key] = now
        return True


#: the longest the API's reading is held for one stop (s): the steps before its SIGTERM are each bounded (the stop
#: intent's write, the engine's ping, the archive's ``ARCHIVE_WAIT_S`` of 10 s); past it the API reads again whatever
#: the stop does, so a stop that hangs never takes the dashboard with it
MAX_HOLD_S = 15.0
#: the most a connection may send while held (bytes): a request head (``api.max_header_bytes``, 16 KiB by default)
#: and a control request's body (``api.max_body_bytes``, 64 KiB) fit; a connection sending more is closed, so a
#: flood cannot grow the guard's memory (OOMScoreAdjust -1000) during the very stop that memory is short for
KEEP_MAX_BYTES = 128 * 1024


class ReadHold:
    """The API's connections read no new request while it is held (``hold`` … ``release``; at most ``MAX_HOLD_S``).

    What a connection receives while held is kept, unparsed, and its reading paused; at ``release`` each such
    connection is handed what it kept, at the loop's next turn (not inside the caller, a stop about to send its
    SIGTERM), and reads again. Answers under way are written, and a request head kept waiting is not closed as
    slow nor as an idle keep-alive. ``holds`` counts holds (each one's number) and ``held_requests`` the
    connections that waited, over all holds. Used on the event loop's thread only."""

    def __init__(self) -> None:
        self.held = False
        self.holds = 0
        self.held_requests = 0  # connections that received data while held, over all holds
        self._waiting: set[Any] = set()  # protocols with data kept
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0
        # (host, port) of the sockets never held: the link network's (``cluster.listen``), where only peers call. A
        # peer's stop request waited out the hold past its ``peer_timeout_s`` and read as a critical
        # ``peer_unreachable`` (helper-34)
        self.exempt: set[tuple[str, int]] = set()

    def hold(self, max_s: float = MAX_HOLD_S) -> int | None:
        """Hold reading from now until ``release`` or ``max_s`` seconds. Returns this hold's number, for its
        owner's ``release``; None when a hold was already on (it is kept, with its deadline, and not this caller's
        to end: one stop's end must not release another's hold before that one's SIGTERM)."""
        if self.held:
            return None
        self.held, self._since = True, time.monotonic()
        self.holds += 1
        self._timer = asyncio.get_running_loop().call_later(max_s, self.release_any)
        return self.holds

    def release(self, hold: int | None) -> None:
        """Its owner's clean-up: end hold number ``hold`` if it is the one on (not a later hold; None: nothing)."""
        if hold is not None and hold == self.holds:
            self.release_any()

    def release_any(self) -> None:
        """Read again, whatever hold is on (a SIGTERM is out, or ``max_s`` passed); each waiting connection gets
        what it kept at the loop's next turn. Idempotent."""
        if not self.held:
            return
        self.held = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, set()
        if waiting:
            log.info(
                "API reading held %.2f s for a stop of the model (%d connections waited)",
                time.monotonic() - self._since,
                len(waiting),
            )
        loop = asyncio.get_running_loop()
        for proto in waiting:
            loop.call_soon(proto.resume_held)

    def keep(self, proto: Any) -> None:
        if proto not in self._waiting:
            self._waiting.add(proto)
            self.held_requests += 1

    def forget(self, proto: Any) -> None:
        self._waiting.discard(proto)


@dataclass
class HttpStats:
    """Counters for status and /metrics: connections refused over the cap, closed for a slow head."""

    cap: int = 0
    refused: int = 0
    head_timeouts: int = 0


def install_exception_handler(loop: asyncio.AbstractEventLoop, limited: RateLimitedLog) -> None:
    """asyncio's own errors (``socket.accept() out of system resource`` on EMFILE — asyncio already
    pauses accepting for 1 s — and the like) once per interval per message, no traceback storm."""

    def handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        msg = str(context.get("message", "asyncio error"))
        exc = context.get("exception")
        text = f"{msg}: {type(exc).__name__}: {exc}" if exc is not None else msg
        limited.log(logging.ERROR, msg, text)

    loop.set_exception_handler(handler)


def guarded_protocol(
    cap: int,
    header_timeout_s: float,
    stats: HttpStats,
    limited: RateLimitedLog,
    hold: ReadHold | None = None,
) -> type[H11Protocol]:
    """uvicorn's ``H11Protocol`` with a connection cap at accept, a deadline for each request head and, with
    ``hold``, no new request read while it is held (``ReadHold``)."""
    gate = hold if hold is not None else ReadHold()

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _armed: Any = None
        _kept: bytes = b""
        _exempt = False

        def _on_hold(self) -> bool:
            """This connection waits on the hold: it is on, or what it kept is not handed back yet (never on the
            link network's sockets, ``ReadHold.exempt``)."""
            return (gate.held or bool(self._kept)) and not self._exempt

        def data_received(self, data: bytes) -> None:
            if self._on_hold():
                if len(self._kept) + len(data) > KEEP_MAX_BYTES:
                    gate.forget(self)
                    self._kept = b""
                    self.transport.abort()
                    return
                self._kept += data  # reading pauses here: one more read of the socket at most
                self.transport.pause_reading()
                self._unset_keepalive_if_required()  # a request waiting is not an idle keep-alive
                gate.keep(self)
                return
            super().data_received(data)

        def resume_held(self) -> None:
            """``ReadHold.release``: what this connection received while held, parsed now; then it reads again
            (unless uvicorn's own flow control holds it: a request body over its high-water mark)."""
            data, self._kept = self._kept, b""
            if self.transport.is_closing():
                return
            if data:
                super().data_received(data)
            if not self.transport.is_closing() and not (self.flow is not None and self.flow.read_paused):
                self.transport.resume_reading()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= cap:
                stats.refused += 1
                self.transport = transport  # connection_lost closes it
                limited.log(
                    logging.WARNING,
                    "http-cap",
                    f"API connection refused: {cap} open connections (api.max_connections / descriptor reserve)",
                )
                transport.abort()
                return
            super().connection_made(transport)
            if gate.exempt:
                name = transport.get_extra_info("sockname")
                self._exempt = isinstance(name, tuple) and tuple(name[:2]) in gate.exempt
            self._arm()

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._armed = self.cycle
            self._deadline = self.loop.call_later(header_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._deadline = None
            if self._on_hold():  # waiting on the hold, not slow: its head is read once it ends
                self._deadline = self.loop.call_later(header_timeout_s, self._head_late)
                return
            if self.cycle is self._armed and not self.transport.is_closing():
                stats.head_timeouts += 1
                limited.log(
                    logging.INFO,
                    "http-head-timeout",
                    f"API connection closed: no complete request head within {header_timeout_s:g} s",
                )
                self.transport.abort()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request head on this keep-alive connection has the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            gate.forget(self)
            self._kept = b""
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

    return GuardedH11Protocol
