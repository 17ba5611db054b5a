"""Logging: journald-friendly on stderr, plus a rotated file in the logs directory.

Under systemd (``JOURNAL_STREAM`` set) lines carry an sd-daemon severity prefix
(``<4>`` = warning, see sd-daemon(3)) and no timestamp — journald adds its own.
Elsewhere they carry an ISO timestamp. The file (``sparkd.log``, rotated at
10 MiB × 5) always has timestamps; the postmortem archive includes it.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path

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


def setup_logging(log_dir: Path | None, *, level: str = "INFO", file_name: str = "sparkd.log") -> Path | None:
    """Configure the ``sparkd`` logger. Returns the log file path, or ``None`` if the
    directory cannot be written (then only stderr is used, and that is said once)."""
    root = logging.getLogger("sparkd")
    root.setLevel(level)
    root.handlers.clear()
    root.propagate = False
    err = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        err.setFormatter(JournalFormatter())
    else:
        err.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root.addHandler(err)
    if log_dir is None:
        return None
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / file_name
        fh = logging.handlers.RotatingFileHandler(path, maxBytes=10 * 2**20, backupCount=5)
    except OSError as e:
        root.warning("cannot write the log file in %s (%s); logging to stderr only", log_dir, e)
        return None
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root.addHandler(fh)
    return path


def reopen_if_gone() -> str | None:
    """The ``sparkd`` logger's file opened again when it was deleted or replaced while sparkd ran
    (an ``rm -rf`` of the state directory, whose ``logs`` it may be): the lines would otherwise go on
    into a file nobody can open, and a postmortem archive would hold no sparkd log. Returns the path
    written again, or None (nothing gone, no file handler). Raises OSError when the file cannot be made
    again (the handler goes on writing where it did). Checked with two ``stat`` calls, not per line
    (``logging.handlers.WatchedFileHandler`` stats at every line)."""
    for h in logging.getLogger("sparkd").handlers:
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
