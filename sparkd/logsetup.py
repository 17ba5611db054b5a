"""Logging: journald-friendly on stderr, plus a rotated file in the logs directory.

Under systemd (``JOURNAL_STREAM`` set) lines carry an sd-daemon severity prefix
(``<4>`` = warning, see sd-daemon(3)) and no timestamp — journald adds its own.
Elsewhere they carry an ISO timestamp. The file (``sparkd.log``, rotated at
10 MiB × 5) always has timestamps; the postmortem archive includes it.

The daemon logs through a queue (``background=True``): the event loop only puts a record in a bounded queue, and a
thread of the stdlib's ``QueueListener`` writes stderr and the file. A sink that blocks (a pipe nobody reads, a
terminal paused with Ctrl-S, a stalled journald, the log directory on a frozen file system) froze the whole guard:
no sample for 115 s after a trip's log lines filled a 4 KiB pipe (note 11). Now the records wait, and beyond
``QUEUE_MAX`` are dropped and counted (said in one line once the sink takes them again); the guard goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import logging.handlers
import os
import queue
import sys
from pathlib import Path
from typing import Any

QUEUE_MAX = 10000  # log records waiting for a blocked sink before new ones are dropped (and counted)
STOP_WAIT_S = 2.0  # at exit, how long the queued records get to reach a sink that may be blocked

_SD_PRIORITY = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = _SD_PRIORITY.get(record.levelno, 6)
        return f"<{prio}>{record.name}: {record.getMessage()}" + (
            "\n" + self.formatException(record.exc_info) if record.exc_info else ""
        )


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """A ``QueueHandler`` that never blocks and never raises: a record that finds the queue full is dropped and
    counted (``dropped``); the next record that fits is preceded by one warning saying how many were lost."""

    def __init__(self, q: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(q)
        self.dropped = 0  # in all
        self._unsaid = 0  # dropped since the last line that said so

    def enqueue(self, record: logging.LogRecord) -> None:
        q = self.queue
        assert isinstance(q, queue.Queue)
        try:
            if self._unsaid:
                note = logging.LogRecord(
                    "sparkd.logsetup",
                    logging.WARNING,
                    __file__,
                    0,
                    f"{self._unsaid} log lines dropped: the log's sink (stderr, the file) did not take them",
                    None,
                    None,
                )
                q.put_nowait(note)
                self._unsaid = 0
            q.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            self._unsaid += 1


class RawStderr:
    """stderr for the log thread: ``os.write`` on descriptor 2, no Python buffer. A write that blocks (a full pipe)
    then holds no lock of ``sys.stderr``, which the interpreter's exit flushes (a daemon thread holding it there
    aborts the process)."""

    def write(self, text: str) -> int:
        data = text.encode("utf-8", "replace")
        view = memoryview(data)
        while view:
            view = view[os.write(2, view) :]
        return len(text)

    def flush(self) -> None:
        pass


_listener: logging.handlers.QueueListener | None = None


class LogFileHandler(logging.handlers.RotatingFileHandler):
    """sparkd's log file. A line it cannot write (a full disk: ENOSPC) printed logging's ~15-line "--- Logging error
    ---" traceback to stderr, the journal, for every line, and nothing said which lines the file lacks (helper-45).
    Now one line on stderr says the file is not written (stderr still has every line), the lines are counted, and the
    next line the file takes is preceded by "N log lines were not written to this file (why)"."""

    lost = 0  # lines not written since the last one that was
    lost_why = ""
    _said = False  # stderr told: said once per outage

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):  # a bug in a log call (its arguments do not fit its format): logging's
            super().handleError(record)  # traceback names the call; the file is fine, and no line is counted lost
            return
        self.lost += 1
        self.lost_why = f"{type(exc).__name__}: {exc}" if exc else "unknown error"
        if not self._said:
            self._said = True
            with contextlib.suppress(Exception):
                sys.stderr.write(
                    f"sparkd: cannot write {self.baseFilename} ({self.lost_why}); its lines are lost until it can "
                    "be written (stderr has them)\n"
                )

    def emit(self, record: logging.LogRecord) -> None:
        if self.lost:
            n, why = self.lost, self.lost_why
            self.lost = 0
            note = logging.LogRecord(
                "sparkd.log",
                logging.WARNING,
                __file__,
                0,
                f"up to {n} log lines were not written to this file, or only in part ({why})",
                None,
                None,
            )
            super().emit(note)
            if self.lost:  # still not written: the note is not one of the lines
                self.lost = n
            else:
                self._said = False
        super().emit(record)


_sinks: list[logging.Handler] = []  # the handlers that write (stderr, the file), wherever they are attached


def setup_logging(
    log_dir: Path | None, *, level: str = "INFO", file_name: str = "sparkd.log", background: bool = False
) -> Path | None:
    """Configure the ``sparkd`` logger. Returns the log file path, or ``None`` if the
    directory cannot be written (then only stderr is used, and that is said once).

    ``background``: the daemon's way (see the module docstring): the ``sparkd`` logger and the root logger (uvicorn,
    asyncio) put records in a bounded queue, written by a thread; records still queued at exit get ``STOP_WAIT_S``."""
    global _listener
    root = logging.getLogger("sparkd")
    root.setLevel(level)
    root.handlers.clear()
    root.propagate = False
    if _listener is not None:
        _stop_listener()
    _sinks.clear()
    err: logging.StreamHandler[Any] = logging.StreamHandler(RawStderr() if background else sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        err.setFormatter(JournalFormatter())
    else:
        err.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    _sinks.append(err)
    path = None
    problem = None
    if log_dir is not None:
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            path = log_dir / file_name
            fh = LogFileHandler(path, maxBytes=10 * 2**20, backupCount=5)
        except OSError as e:
            path, problem = None, (log_dir, e)
        else:
            fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
            _sinks.append(fh)
    if background:
        q: queue.Queue[logging.LogRecord] = queue.Queue(QUEUE_MAX)
        handler = DroppingQueueHandler(q)
        root.addHandler(handler)
        top = logging.getLogger()  # uvicorn's and asyncio's records too: none written from the loop itself
        top.handlers = [h for h in top.handlers if not isinstance(h, DroppingQueueHandler)] + [handler]
        _listener = logging.handlers.QueueListener(q, *_sinks, respect_handler_level=True)
        _listener.start()
        atexit.register(_stop_listener)
    else:
        for h in _sinks:
            root.addHandler(h)
    if problem is not None:
        root.warning("cannot write the log file in %s (%s); logging to stderr only", *problem)
    return path


def _stop_listener() -> None:
    """Let the listener write what is queued, ``STOP_WAIT_S`` at most (a sink may be blocked: never hang the exit)."""
    global _listener
    listener, _listener = _listener, None
    if listener is None:
        return
    thread = listener._thread  # the stdlib's stop() joins without a time limit
    with contextlib.suppress(queue.Full):
        listener.queue.put_nowait(listener._sentinel)  # type: ignore[attr-defined]
    if thread is not None:
        thread.join(STOP_WAIT_S)
        if thread.is_alive():  # stuck in a write: logging's own exit flush would wait on these handlers' locks forever
            logging._handlerList[:] = [r for r in logging._handlerList if r() not in _sinks]  # type: ignore[attr-defined]
    listener._thread = None


def reopen_if_gone() -> str | None:
    """The ``sparkd`` logger's file opened again when it was deleted or replaced while sparkd ran
    (an ``rm -rf`` of the state directory, whose ``logs`` it may be): the lines would otherwise go on
    into a file nobody can open, and a postmortem archive would hold no sparkd log. Returns the path
    written again, or None (nothing gone, no file handler). Raises OSError when the file cannot be made
    again (the handler goes on writing where it did). Checked with two ``stat`` calls, not per line
    (``logging.handlers.WatchedFileHandler`` stats at every line)."""
    for h in [*_sinks, *logging.getLogger("sparkd").handlers]:
        if not isinstance(h, logging.handlers.RotatingFileHandler):
            continue
        path = Path(h.baseFilename)
        h.acquire()  # not while a rollover swaps the stream
        try:
            try:
                st = os.stat(path)
                cur = os.fstat(h.stream.fileno()) if h.stream is not None else None
                gone = cur is None or (st.st_dev, st.st_ino) != (cur.st_dev, cur.st_ino)
            except FileNotFoundError:
                gone = True
            if not gone:
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
            old, h.stream = h.stream, h._open()
            if old is not None:
                old.close()
        finally:
            h.release()
        return str(path)
    return None
