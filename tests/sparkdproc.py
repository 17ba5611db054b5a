"""Start a real ``sparkd run`` subprocess for tests (own state dir, own port)."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on the host right now, on every address (containers use the host network)."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def rewrite_in_place(path: Path, text: str) -> None:
    """Write a scripted /proc file the way the kernel serves one: same inode (sparkd keeps /proc/meminfo
    open and preads it), one write at offset 0, then the length cut; write texts of one length (fixed-width
    numbers) and a reader never sees a half-empty file, which it would between a truncate and a write."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def db_query(db: Path, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def wait_for(pred: Any, timeout_s: float, step_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout_s`` passes (the last value).
    A database being written or a file not there yet counts as "not yet"."""
    end = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < end:
        try:
            last = pred()
        except (sqlite3.OperationalError, OSError):
            last = None
        if last:
            return last
        time.sleep(step_s)
    return last


@contextmanager
def sparkd_run(
    tmp_path: Path,
    *,
    config: str = "",
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = ("--no-api",),
    state_dir: Path | None = None,
    nofile: int | None = None,
) -> Iterator[subprocess.Popen[str]]:
    """Run ``python -m sparkd.face.cli --config CFG run ARGS``; SIGTERM and wait on exit.

    The config file is ``tmp_path/sparkd.toml``; the state directory ``state_dir`` (default ``tmp_path``);
    ``nofile``: the daemon's descriptor limit (soft = hard), as ``ulimit -n`` would set it."""
    cfg = tmp_path / "sparkd.toml"
    state = state_dir or tmp_path
    cfg.write_text(f'state_dir = "{state}"\nlog_dir = "{tmp_path / "logs"}"\n' + config)
    e = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SPARKD_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")
    }
    e.update(env or {})
    p = subprocess.Popen(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(cfg), "run", *args],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None,
    )
    try:
        yield p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class NotifySocket:
    """A systemd ``NOTIFY_SOCKET`` of the test's own (``path``): ``got`` holds each datagram a daemon sent, with its
    monotonic arrival time, as ``drain`` reads them."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.srv.bind(self.path)
        self.srv.settimeout(0.2)
        self.got: list[tuple[float, str]] = []

    def drain(self, until: float) -> None:
        """Read datagrams until the monotonic time ``until``."""
        while time.monotonic() < until:
            with contextlib.suppress(TimeoutError):
                self.got.append((time.monotonic(), self.srv.recv(4096).decode()))

    def wait_ready(self, timeout_s: float = 30.0) -> float:
        """Read until ``READY=1`` (start-up: a fresh clone compiles its .pyc files first); its arrival time."""
        deadline = time.monotonic() + timeout_s
        while not any(m == "READY=1" for _, m in self.got) and time.monotonic() < deadline:
            self.drain(time.monotonic() + 0.2)
        return next(t for t, m in self.got if m == "READY=1")

    def close(self) -> None:
        self.srv.close()
