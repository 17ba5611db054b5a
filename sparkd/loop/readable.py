"""Read the kernel log when it has something: the event loop's epoll says so, not a read per tick.

A non-blocking read of ``/dev/kmsg`` (or journalctl's pipe) that fails with ``EAGAIN`` every tick
was a tenth of an idle tick's CPU (issue 18). ``ReadableGate`` registers the source's descriptor
with the event loop (``add_reader``, level-triggered) and answers the guard's "poll now?":

* ``True`` on the first call, after the descriptor became readable, and always for a source
  without a descriptor (``fileno()`` absent or ``None``: dmesg, a closed reader) or one the
  loop refuses: those are polled every tick as before;
* ``False`` otherwise: nothing arrived since the last poll.

After a readable event the reader is removed until the next poll, so a flood of records wakes
the loop once per tick at most; a poll that leaves records behind (``max_records``) is told to
poll again at the next tick, since the descriptor is still readable when the reader is re-armed.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


class ReadableGate:
    """``gate()`` → poll the source now? See the module docstring. Call on the event loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, source: Any) -> None:
        self.loop = loop
        self.source = source
        self.pending = True
        self.wakeups = 0  # readable events seen (tests, benchmarks)
        self._fd: int | None = None  # the descriptor registered with the loop

    def __call__(self) -> bool:
        fileno = getattr(self.source, "fileno", None)
        fd = fileno() if fileno is not None else None
        if fd is None or (self._fd is not None and fd != self._fd):
            self._disarm()  # closed or replaced: poll every tick (cheap for a closed source)
            return True
        if self._fd is not None and not self.pending:
            return False
        self.pending = False
        if self._fd is None:
            try:
                self.loop.add_reader(fd, self._ready)
            except (OSError, ValueError, NotImplementedError):
                return True  # not pollable here: read every tick
            self._fd = fd
        return True

    def _ready(self) -> None:
        self.wakeups += 1
        self.pending = True
        self._disarm()  # until the next poll: a flood wakes the loop once per tick at most

    def _disarm(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError, ValueError):
                self.loop.remove_reader(self._fd)
            self._fd = None

    def close(self) -> None:
        """Unregister the descriptor (before the source is closed)."""
        self._disarm()
