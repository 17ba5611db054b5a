"""A sleep that another callback on the event loop can end early.

A timer and a future per sleep: ``asyncio.wait_for`` on an event would make a task each time,
which a loop that wakes often cannot afford (issue 18). Used by the database keeper (ended by the
writer's ``on_trouble``) and the process scan (ended when the daemon starts sampling fast); the main
loop's ticks are plain callbacks (``Daemon.main_loop``).
"""

from __future__ import annotations

import asyncio


class Alarm:
    """``await alarm.sleep(delay_s)`` returns after ``delay_s`` seconds, or at once when ``wake()``
    is called meanwhile (on the event loop's thread). ``wake()`` while nothing sleeps does nothing."""

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None

    async def sleep(self, delay_s: float) -> None:
        if delay_s <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._fut = fut
        handle = loop.call_later(delay_s, _resolve, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._fut = None

    def wake(self) -> None:
        if self._fut is not None:
            _resolve(self._fut)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
