"""A uvicorn ``Server`` that sleeps while nothing happens.

uvicorn's ``Server.main_loop`` wakes every 0.1 s (``on_tick``) to refresh the ``Date``
header and to look at ``should_exit``: ten event-loop wake-ups a second in a daemon that
otherwise wakes once a second (py-spy, issue 18). Here ``main_loop`` waits on a future
that setting ``should_exit`` resolves, and the ``Date`` header is formatted when a
response asks for the default headers, at most once per second (RFC 9110 §6.6.1: an
origin server with a clock sends Date, one-second resolution).
Source of the overridden behaviour: uvicorn 0.54 ``uvicorn/server.py`` (``Server.main_loop``,
``Server.on_tick``, ``ServerState.default_headers``, read by the protocols per response).
"""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate

import uvicorn
from uvicorn.server import ServerState


class _LazyDateState(ServerState):
    """``default_headers`` with a ``Date`` formatted on read, cached for the current second."""

    def __init__(self, date_header: bool) -> None:
        self._date_header = date_header
        self._base: list[tuple[bytes, bytes]] = []
        self._second = -1
        self._headers: list[tuple[bytes, bytes]] = []
        super().__init__()

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        now = time.time()
        second = int(now)
        if second != self._second:
            date = [(b"date", formatdate(now, usegmt=True).encode())] if self._date_header else []
            self._headers, self._second = date + self._base, second
        return self._headers

    @default_headers.setter
    def default_headers(self, value: list[tuple[bytes, bytes]]) -> None:
        self._base = [h for h in value if h[0] != b"date"]
        self._second = -1


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` without the 0.1 s tick: ``should_exit = True`` wakes ``main_loop``.
    ``limit_max_requests`` and ``callback_notify`` (ticked options) are not supported."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_waiter: asyncio.Future[None] | None = None
        self._should_exit = False
        super().__init__(config)
        self.server_state = _LazyDateState(config.date_header)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        w = self._exit_waiter
        if value and w is not None and not w.done():
            w.get_loop().call_soon_threadsafe(_resolve, w)

    async def main_loop(self) -> None:
        self.server_state.default_headers = self.config.encoded_headers
        if self._should_exit:
            return
        self._exit_waiter = asyncio.get_running_loop().create_future()
        try:
            await self._exit_waiter
        finally:
            self._exit_waiter = None


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
