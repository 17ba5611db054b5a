"""NVML in a helper process: the daemon asks, a child ``python -m sparkd.sense.gpu_helper`` reads the driver.

Why a second process (issue 18, and the guard's own safety):
- **Memory.** An NVML session maps the NVIDIA driver's user-space libraries into the process that opens it
  (``libnvidia-ml.so``, and ``libcuda.so`` through it) and never gives it back: +19.2 MiB of RSS measured on an
  H200 host (``bench/nvml.py``, note 10), which took the daemon from ~60 to ~80 MiB. In the helper it is the
  helper's, and it ends with it.
- **A driver call that never returns.** ``nvmlDevice*`` calls can block inside the driver (a GPU fallen off the
  bus, a wedged driver under memory exhaustion: the moment sparkd exists for). In a thread of the daemon such a
  call holds the thread for ever and cannot be cancelled. The helper is killed after ``READ_TIMEOUT_S`` and a
  new one is started later.
- **A crash in the driver's library** (a segfault in ``libnvidia-ml.so``) ends the helper, not the guard, which
  runs at ``OOMScoreAdjust=-1000``. The helper sets its own ``oom_score_adj`` and nice value back to 0: it
  guards nothing.

Protocol (line-based, on the helper's stdin and stdout): the daemon writes ``read\\n``; the helper answers one
line of JSON, ``{"readings": [GpuReading.to_json(), ...]}``. At end of file on its stdin (the daemon closed it,
or the daemon died, kill -9 included) the helper calls ``nvmlShutdown`` and exits.

Shapes:
    ``GpuHelper().read() -> list[GpuReading]``: ``sparkd.sense.gpu.GpuSession.read``'s shape, never raises.
    A failed helper answers ``[GpuReading.unavailable(reason, final=False)]``: worth asking again.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Literal

from sparkd.sense.gpu import GpuReading, GpuSession

#: Where the NVIDIA kernel driver says it is loaded (``/proc/driver/nvidia/version``). Without it NVML cannot
#: initialize, and no helper is started (``GpuHelper.read`` answers "unavailable" at once, final).
NVIDIA_DRIVER_PROC = Path("/proc/driver/nvidia")

#: The longest a reading may take (s). A session's first reading includes ``nvmlInit``, 13.5 ms on an H200
#: host (bench/nvml.py) but seconds on a many-GPU host without the persistence daemon; later readings take
#: ~0.2 ms of CPU. A helper that has not answered by then is killed.
START_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 10.0

#: After a helper failed (killed for its silence, crashed, answered garbage), the next one is started no
#: sooner than this (s), doubled at each failure in a row up to ``RESPAWN_MAX_S``: a driver that crashes its
#: client at every reading costs a Python start (~40 ms of CPU) per attempt, not one per reading.
RESPAWN_BACKOFF_S = 60.0
RESPAWN_MAX_S = 960.0

#: How long a killed helper is waited for (s). A process inside a driver call may not die at SIGKILL (it sleeps
#: uninterruptibly, state D); it is left, and no other is started while it lives.
REAP_WAIT_S = 1.0


class GpuHelper:
    """The daemon's side: one helper process at a time, started at the first ``read``. Not thread-safe for
    readers (one reader at a time, the GPU loop's worker thread); ``close`` may be called from another thread.

    Args:
        argv: the helper's command line; default ``[sys.executable, "-P", "-m", "sparkd.sense.gpu_helper"]``.
        env: the helper's environment; default the daemon's.
        driver_proc: the NVIDIA driver's ``/proc`` entry, default ``NVIDIA_DRIVER_PROC`` (read at each reading);
            ``None`` skips that check.
        start_timeout_s, read_timeout_s, backoff_s: ``START_TIMEOUT_S``, ``READ_TIMEOUT_S``,
            ``RESPAWN_BACKOFF_S``.
        clock: monotonic seconds, for the back-off.
    """

    def __init__(
        self,
        argv: list[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        driver_proc: Path | Literal["default"] | None = "default",
        start_timeout_s: float = START_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        backoff_s: float = RESPAWN_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # -P: the working directory (the unit's /var/lib/sparkd) is not put first on sys.path of a root process
        self.argv = argv or [sys.executable, "-P", "-m", "sparkd.sense.gpu_helper"]
        self._env = dict(env) if env is not None else None
        self._driver_proc = driver_proc
        self._start_timeout_s = start_timeout_s
        self._read_timeout_s = read_timeout_s
        self._backoff_s = backoff_s
        self._clock = clock
        self.proc: subprocess.Popen[bytes] | None = None
        self._session_open = False  # the current helper's last answer was whole: its NVML session is open
        self._mu = threading.Lock()  # self.proc and self._closed, between a reader and close()
        self._closed = False
        self._stuck: subprocess.Popen[bytes] | None = None  # a killed helper that has not ended
        self._failures = 0  # failures in a row
        self._next_start_at = 0.0  # clock s
        self._last_failure: str | None = None

    def read(self) -> list[GpuReading]:
        if self._closed:
            return [GpuReading.unavailable("the NVML helper was closed")]
        driver_proc = NVIDIA_DRIVER_PROC if self._driver_proc == "default" else self._driver_proc
        if driver_proc is not None and not driver_proc.exists():
            return [GpuReading.unavailable(f"no NVIDIA driver is loaded ({driver_proc} is absent)", no_driver=True)]
        if self._stuck is not None:
            if self._stuck.poll() is None:
                return [self._failed_again(f"the NVML helper (pid {self._stuck.pid}) is still stuck in the driver")]
            self._stuck = None
        proc = self.proc
        if proc is None or proc.poll() is not None:
            if proc is not None:  # it ended between readings
                self._failure(f"the NVML helper ended ({_how(proc.returncode)})")
                self.proc = None
            wait_s = self._next_start_at - self._clock()
            if wait_s > 0:
                return [self._failed_again(f"{self._last_failure}; the next one starts in {wait_s:.0f} s")]
            with self._mu:  # not after close(): a helper started then would outlive the daemon's shutdown
                if self._closed:
                    return [GpuReading.unavailable("the NVML helper was closed")]
                try:
                    proc = self.proc = subprocess.Popen(
                        self.argv,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        env=self._env,
                        close_fds=True,
                    )
                except OSError as exc:
                    return [self._fail(None, f"the NVML helper could not start: {exc}")]
            self._session_open = False
        # nvmlInit is asked again after an answer that was not whole (the helper's session closes itself then)
        timeout_s = self._read_timeout_s if self._session_open else self._start_timeout_s
        try:
            line = _ask(proc, timeout_s)
        except EOFError:  # it closed its stdout: it died (its exit status may lag its pipe's end: waited for)
            return [self._fail(proc, f"the NVML helper ended ({_how(_reap(proc))})")]
        except Exception as exc:  # a broken pipe, or closed under us: never raised to the reader
            return [self._fail(proc, f"the NVML helper ended ({_how(_reap(proc))}: {exc})")]
        if line is None:
            why = f"NVML did not answer within {timeout_s:g} s (the helper, pid {proc.pid}, was killed)"
            return [self._fail(proc, why)]
        try:
            readings = [GpuReading.from_json(r) for r in json.loads(line)["readings"]]
        except Exception as exc:  # whatever the helper wrote, the reader gets a reading
            return [self._fail(proc, f"the NVML helper answered garbage: {exc}: {line[:120]!r}")]
        self._session_open = bool(readings) and all(r.available for r in readings)
        self._failures = 0
        self._last_failure = None
        return readings

    def close(self) -> None:
        """End the helper for good: close its stdin (it shuts NVML down and exits), kill it if it has not after
        ``REAP_WAIT_S``; no helper is started after it. Safe from another thread while ``read`` waits on the
        helper: its stdout is left to the reader (closing it under a ``poll`` could hand its fd number to a file
        opened meanwhile), which sees the end of file and returns."""
        with self._mu:
            self._closed = True
            proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(REAP_WAIT_S)
        except subprocess.TimeoutExpired:
            _kill(proc, close_pipes=False)

    def _fail(self, proc: subprocess.Popen[bytes] | None, why: str) -> GpuReading:
        if proc is not None:
            if not _kill(proc):
                self._stuck = proc
            self.proc = None
        self._failure(why)
        return GpuReading.unavailable(why, final=False)

    def _failure(self, why: str) -> None:
        self._last_failure = why
        # RESPAWN_BACKOFF_S doubled per failure in a row, at most RESPAWN_MAX_S (the exponent capped: 2**1024
        # is an OverflowError after ~11 days of failures at the cap)
        self._next_start_at = self._clock() + min(self._backoff_s * 2 ** min(self._failures, 16), RESPAWN_MAX_S)
        self._failures += 1

    def _failed_again(self, why: str) -> GpuReading:
        return GpuReading.unavailable(why, final=False)


def _ask(proc: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """Write one request and read one line of answer within ``timeout_s``; ``None`` at the deadline. Raises
    ``EOFError`` at the end of its stdout (it died), ``OSError`` when the request cannot be written (the helper
    is gone), ``ValueError`` when its pipes were closed. ``poll``, not ``select``: a daemon with over 1,023
    files open (``LimitNOFILE=8192``, idle API connections) gives the pipe a descriptor ``select`` refuses."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"read\n")
    proc.stdin.flush()
    fd = proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000))):
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError("the helper closed its stdout")
        buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace")


def _kill(proc: subprocess.Popen[bytes], *, close_pipes: bool = True) -> bool:
    """SIGKILL and reap within ``REAP_WAIT_S`` (and close its pipes, unless ``close_pipes`` is false); False when
    it has not ended (asleep in the driver)."""
    with contextlib.suppress(OSError):
        proc.kill()
    try:
        proc.wait(REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        return False
    for pipe in (proc.stdin, proc.stdout) if close_pipes else ():
        with contextlib.suppress(OSError, ValueError):
            if pipe is not None:
                pipe.close()
    return True


def _reap(proc: subprocess.Popen[bytes]) -> int | None:
    try:
        return proc.wait(REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        return None


def _how(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def serve(stdin: IO[bytes], stdout: IO[bytes], session: GpuSession | None = None) -> int:
    """The helper's loop: one ``GpuSession`` open for the helper's life; each ``read`` line answered with one
    JSON line; ``nvmlShutdown`` and exit 0 at end of file. Any other request line is answered with an error
    line (``{"error": ...}``), which the daemon takes as garbage."""
    session = session or GpuSession()
    try:
        for raw in stdin:
            if raw.strip() == b"read":
                out: dict[str, Any] = {"readings": [r.to_json() for r in session.read()]}
            else:
                out = {"error": f"unknown request {raw[:40]!r}; the one request is 'read'"}
            stdout.write(json.dumps(out, separators=(",", ":")).encode() + b"\n")
            stdout.flush()
    finally:
        session.close()
    return 0


def main() -> int:
    """``python -m sparkd.sense.gpu_helper``: serve readings on stdin/stdout until end of file."""
    # the helper guards nothing: it leaves the daemon's OOMScoreAdjust=-1000 and Nice=-5 (systemd/sparkd.service;
    # raising one's own score or nice value needs no privilege)
    with contextlib.suppress(OSError):
        Path("/proc/self/oom_score_adj").write_text("0")
    with contextlib.suppress(OSError):
        if os.getpriority(os.PRIO_PROCESS, 0) < 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    return serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    raise SystemExit(main())
