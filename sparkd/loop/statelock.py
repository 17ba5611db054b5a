"""One daemon per state directory, held two ways for as long as the process lives.

* An exclusive ``flock`` on ``<state_dir>/sparkd.lock`` (the file also carries the pid, for the message).
* A listening Unix socket in the abstract namespace named after the state directory's real path. It needs
  no file: ``rm -rf`` of the state directory while sparkd runs removes the lock file, and a second sparkd
  would then take a fresh ``flock`` and guard (and stop containers) beside the first. The socket name is
  released only when the process ends. Its holder's pid and uid come from ``SO_PEERCRED``; a holder of
  another uid is not a sparkd of ours (abstract names have no permissions: anyone can bind one), so it is
  logged and ignored rather than allowed to keep the guard from starting.

``StateLock.acquire(state_dir)`` returns the held lock; ``release()`` ends both.

Raises (``acquire``):
    StoreError: another sparkd holds the directory (the message names its pid and the directory), or the
        directory cannot be created or opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import socket
import struct
from pathlib import Path

from sparkd.errors import StoreError

log = logging.getLogger("sparkd.loop.statelock")

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def socket_name(state_dir: Path) -> str:
    """The abstract socket name for ``state_dir`` (its real path, hashed: names are at most 107 bytes)."""
    key = hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:32]
    return f"\0sparkd-state-{key}"


def _refused(pid: object, state_dir: Path, extra: str = "") -> StoreError:
    return StoreError(
        f"another sparkd (pid {pid}) is running with state directory {state_dir}{extra}; "
        "stop it first, or give this one its own state_dir (SPARKD_STATE_DIR)"
    )


class StateLock:
    def __init__(self, fd: int, sock: socket.socket | None) -> None:
        self._fd: int | None = fd
        self._sock = sock
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def acquire(cls, state_dir: Path) -> StateLock:
        path = state_dir / "sparkd.lock"
        try:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if (state_dir.stat().st_mode & 0o777) != 0o700 and state_dir.stat().st_uid == os.geteuid():
                os.chmod(state_dir, 0o700)  # whatever the umask: samples, events and the token are ours
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StoreError(f"cannot use state directory {state_dir}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise _refused(other, state_dir) from None
        try:
            sock = _claim_name(state_dir)
        except StoreError:
            os.close(fd)
            raise
        try:  # the pid is for the message above; a full disk must not stop the guard
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            log.warning("cannot write the pid into %s: %s (ignoring)", path, e.strerror)
        return cls(fd, sock)

    def answer_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Accept and close each connection to the socket name on ``loop`` (a callback only when one comes): a
        connection only reads the holder's credentials, and one never accepted stays queued. From the 65th
        ``daemon_pid`` of a daemon's lifetime the queue was full, every look failed, and `sparkd stop` said "no sparkd
        runs", `sparkd status` "NOT running" (helper-54)."""
        sock = self._sock
        if sock is None:
            return
        sock.setblocking(False)

        def drain() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as e:
                    # out of descriptors, say: the connection stays queued and the socket readable, and the reader
                    # ran on every pass of the loop, a warning each (40,000 a second, helper-57). It waits 1 s
                    log.warning("the state directory's socket: %s; looked at again in 1 s", e)
                    loop.remove_reader(sock.fileno())
                    loop.call_later(1.0, watch)
                    return
                conn.close()

        def watch() -> None:
            if self._sock is sock:  # not released meanwhile
                loop.add_reader(sock.fileno(), drain)
                drain()

        loop.add_reader(sock.fileno(), drain)
        self._loop = loop
        drain()  # looks made before the loop answered

    def release(self) -> None:
        if self._sock is not None:
            if self._loop is not None:
                with contextlib.suppress(Exception):  # a closed loop: nothing to remove
                    self._loop.remove_reader(self._sock.fileno())
                self._loop = None
            self._sock.close()
            self._sock = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _claim_name(state_dir: Path) -> socket.socket | None:
    """Bind and listen on ``socket_name(state_dir)``; None (logged) where that cannot be done at all."""
    name = socket_name(state_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(name)
        sock.listen(64)  # accepted and closed at once by the daemon's loop (``answer_on``)
        return sock
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            log.warning("cannot hold the state directory's socket name (%s); the lock file alone guards it", e)
            return None
    pid, uid = _holder(name)
    if uid is not None and uid != os.geteuid():
        log.warning(
            "the state directory's socket name is held by pid %s of uid %s, not a sparkd of this user: ignored "
            "(the lock file still guards the directory)",
            pid,
            uid,
        )
        return None
    raise _refused(pid if pid is not None else "?", state_dir, " (its lock file was removed while it ran)")


def _holder(name: str) -> tuple[int | None, int | None]:
    """(pid, uid) of the process listening on ``name`` (``SO_PEERCRED``), or (None, None)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(1.0)
        c.connect(name)
        pid, uid, _gid = _UCRED.unpack(c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        return pid, uid
    return None, None


def daemon_pid(state_dir: Path) -> int | None:
    """The pid of the sparkd of this user that holds ``state_dir`` (its socket name, ``SO_PEERCRED``), or None when
    none runs: the CLI sends its API token only to the socket that process listens on (``face.cli.control``)."""
    pid, uid = _holder(socket_name(state_dir))
    return pid if uid == os.geteuid() else None
