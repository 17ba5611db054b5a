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


def guarded_protocol(cap: int, header_timeout_s: float, stats: HttpStats, limited: RateLimitedLog) -> type[H11Protocol]:
    """uvicorn's ``H11Protocol`` with a connection cap at accept and a deadline for each request head."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _armed: Any = None

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
            self._arm()

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._armed = self.cycle
            self._deadline = self.loop.call_later(header_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._deadline = None
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
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

    return GuardedH11Protocol
