"""Keeps the database usable, or says why it is not — the guard never waits for it.

``DbKeeper`` owns the ``Store`` for the daemon. Opening can fail (state dir full,
a corrupt header, another process holding a write lock, the file deleted while
running); none of these stops the guard: the daemon runs from memory, the keeper
is asked to ``attempt()`` again with exponential back-off (1 s doubling to 60 s,
``BACKOFF_*_S``) and reports its state for status, ``/metrics`` and ``doctor``.

A corrupt file is never deleted: it is renamed ``<name>.corrupt-<UTC time>``
(with its ``-wal``/``-shm`` companions) and a fresh database is created beside it.

Every method here blocks (SQLite, the file system): call from a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkd.errors import StoreError
from sparkd.store.store import Store

log = logging.getLogger("sparkd.store.keeper")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
FILE_MODE = 0o600
CORRUPT_MARKERS = ("file is not a database", "malformed", "not a database", "file is encrypted")


def is_corrupt(err: BaseException) -> bool:
    """True when ``err`` (SQLAlchemy, sqlite3 or our ``StoreError``) says the file is not a sound
    SQLite database — SQLite's ``SQLITE_NOTADB``/``SQLITE_CORRUPT`` messages."""
    text = str(getattr(err, "orig", None) or err).lower()
    return any(m in text for m in CORRUPT_MARKERS)


FULL_MARKERS = ("database or disk is full", "no space left on device", "disk quota exceeded")


def is_full(error_text: str | None) -> bool:
    """True when a write's error (``Writer.last_error``) says the file system is full (SQLite's
    ``SQLITE_FULL``, ``ENOSPC``, ``EDQUOT``): retried, but said at once, not after ``FAILING_REPORT_S``
    (a full disk does not pass in seconds the way a backup's lock does)."""
    text = (error_text or "").lower()
    return any(m in text for m in FULL_MARKERS)


def is_permanent(err: BaseException) -> bool:
    """True when retrying the same record cannot succeed (a constraint, a value SQLite or the JSON
    encoder refuses), False for what passes (locked, busy, disk full, I/O) — those are retried."""
    orig = getattr(err, "orig", None) or err
    if isinstance(orig, sqlite3.IntegrityError | sqlite3.InterfaceError | sqlite3.ProgrammingError):
        return True
    if isinstance(orig, UnicodeError | TypeError | ValueError | OverflowError):
        return True
    return isinstance(orig, sqlite3.DataError)


def harden(path: Path) -> None:
    """Mode 0600 for the database and its ``-wal``/``-shm`` files, whatever the umask."""
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if p.exists() and (p.stat().st_mode & 0o777) != FILE_MODE:
                os.chmod(p, FILE_MODE)
        except OSError:
            pass


@dataclass
class DbKeeper:
    """The daemon's database, usable or not.

    ``state`` is ``"opening"`` (before the first attempt ends), ``"ok"`` or ``"unavailable"``;
    ``error`` the last reason (one line); ``since`` (epoch s) when the current state began;
    ``next_attempt_mono`` when to try again (monotonic s). ``moved_aside`` lists corrupt files renamed so far.
    """

    path: Path
    store: Store | None = None
    state: str = "opening"
    error: str | None = "not opened yet"
    since: float = field(default_factory=time.time)
    attempts: int = 0
    backoff_s: float = BACKOFF_FIRST_S
    next_attempt_mono: float = 0.0
    inode: int | None = None
    wal_inode: int | None = None  # of ``<path>-wal`` once a write made it (WAL mode), for ``replaced``
    moved_aside: list[str] = field(default_factory=list)
    suspect_corrupt: bool = False  # a write or read said "malformed": the next open runs quick_check

    def attempt(self, now_mono: float) -> Store | None:
        """Open (and migrate) the database; on a corrupt file move it aside and open a fresh one.

        Returns the ``Store`` or None (``error`` says why; the next attempt is scheduled with back-off).
        """
        self.attempts += 1
        try:
            store = self._open()
            if self.suspect_corrupt and not _sound(store):
                # it opens (the header is intact) but the pages are not: SQLite's "malformed" came from
                # inside the file. Reopening it would fail again at the next write, forever: move it aside.
                store.close()
                raise StoreError(f"database disk image is malformed (quick_check failed): {self.path}")
        except StoreError as e:
            if is_corrupt(e) and self._move_aside():
                try:
                    store = self._open()
                except StoreError as e2:
                    self._failed(str(e2), now_mono)
                    return None
            else:
                self._failed(str(e), now_mono)
                return None
        self.suspect_corrupt = False
        self.store, self.state, self.error, self.since = store, "ok", None, time.time()
        self.backoff_s = BACKOFF_FIRST_S
        harden(self.path)
        self.wal_inode = None  # learnt at the first check after a write of this store
        try:
            self.inode = self.path.stat().st_ino
        except OSError:
            self.inode = None
        return store

    def _open(self) -> Store:
        store = Store.open(self.path, migrate=False)
        if not store.at_head():  # a new file, or one an older sparkd made: Alembic, in a child process
            try:
                store.upgrade_in_child()
            except StoreError:
                store.close()
                raise
        return store

    def _failed(self, why: str, now_mono: float) -> None:
        if self.state == "ok":
            self.since = time.time()
        self.state, self.error, self.store = "unavailable", _line(why), None
        self.next_attempt_mono = now_mono + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)

    def _move_aside(self) -> bool:
        """Rename the corrupt file (and its WAL/SHM) to ``<name>.corrupt-<UTC>``; never delete."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        try:
            os.rename(self.path, target)
        except OSError as e:
            log.error("cannot move the corrupt database %s aside: %s", self.path, e)
            return False
        for suffix in ("-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                with contextlib.suppress(OSError):
                    os.rename(side, target.with_name(target.name + suffix))
        self.moved_aside.append(str(target))
        log.error("database %s is corrupt: moved aside to %s; a new one is created", self.path, target)
        return True

    def lost(self, why: str, now_mono: float, *, at_once: bool = True) -> None:
        """The store failed in use (corrupt, deleted, locked at the first write): drop it and retry —
        at once (``at_once``: a deleted file is recreated, a corrupt one moved aside) or after the
        back-off."""
        store, self.store = self.store, None
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
        if is_corrupt(StoreError(why)):
            self.suspect_corrupt = True  # the next open checks the pages, not just the header
        if at_once:
            self.backoff_s = BACKOFF_FIRST_S
        self._failed(why, now_mono)
        if at_once:
            self.next_attempt_mono = now_mono

    def replaced(self) -> str | None:
        """Why the open file is no longer the one at ``path`` (deleted or replaced), else None.

        SQLite keeps writing into an unlinked file without a word; the inode says it."""
        if self.store is None or self.inode is None:
            return None
        path = str(self.path)  # os.stat of a str: the writer's thread asks after every write (issue 18: a
        # pathlib stat and a Path built per call were ~90 µs of a batch's ~530 on the idle VM, bench/phases.py)
        try:
            ino = os.stat(path).st_ino
        except FileNotFoundError:
            return f"database file {self.path} was deleted while sparkd was running"
        except OSError as e:
            return f"cannot stat database file {self.path}: {e.strerror}"
        if ino != self.inode:
            # deleted and created again (a reader's connection makes an empty file), or replaced
            return f"database file {self.path} was deleted or replaced while sparkd was running"
        # the write-ahead log holds every write since the last checkpoint: unlinked (rm *.db-wal), SQLite
        # keeps appending to the deleted file and a kill -9 loses all of it. While sparkd's connections
        # are open SQLite never removes or recreates it, so another inode is someone else's doing.
        wal = f"{path}-wal"
        try:
            wal_ino = os.stat(wal).st_ino
        except FileNotFoundError:
            if self.wal_inode is None:  # not made yet (or not WAL mode): nothing to compare
                return None
            return f"write-ahead log {wal} was deleted while sparkd was running"
        except OSError as e:
            return f"cannot stat write-ahead log {wal}: {e.strerror}"
        if self.wal_inode is None:
            self.wal_inode = wal_ino
        elif wal_ino != self.wal_inode:
            return f"write-ahead log {wal} was deleted or replaced while sparkd was running"
        return None

    def status(self) -> dict[str, Any]:
        """``{"state", "path", "error", "since", "attempts", "moved_aside"}`` for status and doctor."""
        return {
            "state": self.state,
            "path": str(self.path),
            "error": self.error,
            "since": self.since,
            "attempts": self.attempts,
            "moved_aside": list(self.moved_aside),
        }


def _sound(store: Store) -> bool:
    """``PRAGMA quick_check`` says ``ok`` (a page-level check: a corrupt page inside an intact file)."""
    try:
        with store.engine.connect() as conn:
            return conn.exec_driver_sql("PRAGMA quick_check").scalar() == "ok"
    except Exception:
        return False


def _line(e: BaseException | str) -> str:
    text = str(getattr(e, "orig", None) or e) if not isinstance(e, str) else e
    return (text.splitlines() or [""])[0][:300]
