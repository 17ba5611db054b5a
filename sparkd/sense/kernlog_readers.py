"""Kernel-log readers, polled once per guard tick; none of them blocks.

Every source has ``name`` (``"kmsg"``, ``"journal"``, ``"dmesg"``, ``"none"``),
``error`` (``None`` while healthy, else a sentence for operators),
``poll() -> list[str]`` (the lines that arrived since the last poll, in kernel
order, without trailing newline; feed each to :func:`sparkd.sense.kernlog.classify`)
and ``close()``. :func:`open_source` picks the best one that works.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Protocol, Self

from sparkd.errors import ConfigError

log = logging.getLogger(__name__)

JOURNAL_CMD: tuple[str, ...] = (
    "journalctl", "-k", "-f", "-o", "short-monotonic", "-n", "0", "-q", "--no-pager",
)  # fmt: skip
JOURNAL_PROBE: tuple[str, ...] = (
    "journalctl", "-k", "-n", "1", "-o", "short-monotonic", "-q", "--no-pager",
)  # fmt: skip
DMESG_CMD: tuple[str, ...] = ("dmesg",)
PREFERENCES = ("auto", "kmsg", "journal", "dmesg")


class KernLogSource(Protocol):
    """What the guard loop needs from a kernel-log reader."""

    name: str
    error: str | None

    def poll(self) -> list[str]: ...

    def close(self) -> None: ...


class _Closing:
    def close(self) -> None:  # pragma: no cover - overridden
        pass

    def fileno(self) -> int | None:
        """The descriptor that becomes readable when ``poll`` has something, or None (poll each tick)."""
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


_ESC = re.compile(rb"\\x([0-9a-fA-F]{2})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _unescape(b: bytes) -> str:
    """Undo the kernel's ``\\xNN`` escaping, decode UTF-8 (replacement), blank controls."""
    text = _ESC.sub(lambda m: bytes([int(m[1], 16)]), b).decode("utf-8", "replace")
    return _CONTROL.sub(" ", text)


def decode_kmsg_record(data: bytes) -> tuple[int | None, str]:
    """Decode one ``/dev/kmsg`` read into ``(seq, text)``.

    ``text`` is ``"prio,seq,usec,flags;message"`` with escapes undone, plus
    ``"\\n KEY=value"`` continuation lines; ``seq`` is ``None`` if the header
    cannot be parsed (the text is still returned).
    """
    first, *cont = data.rstrip(b"\n").split(b"\n")
    header, sep, body = first.partition(b";")
    fields = header.split(b",")
    seq = int(fields[1]) if sep and len(fields) > 2 and fields[1].isdigit() else None
    text = header.decode("ascii", "replace") + ";" + _unescape(body) if sep else _unescape(first)
    return seq, text + "".join("\n " + _unescape(c.strip()) for c in cont)


LOST_LOG_EVERY_S = 10.0  # a flood overwrites records on every poll: say so once per this, with the count


class KmsgSource(_Closing):
    """Read new records from ``/dev/kmsg`` (starts at the end: only records after open).

    Each ``os.read`` returns one record; ``EAGAIN`` ends a poll; ``EPIPE``
    means records were overwritten in the ring buffer before we read them.
    Lost records are counted from the sequence gap in :attr:`lost_records`
    (cumulative) and logged. At most ``max_records`` are returned per poll;
    the rest wait for the next poll.

    Raises:
        OSError: the device cannot be opened (missing, or no permission:
            CAP_SYSLOG / ``kernel.dmesg_restrict``).
    """

    name = "kmsg"

    def __init__(self, path: str = "/dev/kmsg", *, max_records: int = 2000) -> None:
        self.path = path
        self.error: str | None = None
        self.max_records = max_records
        self.last_seq: int | None = None
        self.lost_records = 0
        self.overruns = 0  # EPIPE reads: the ring buffer overwrote records before we read them
        self._lost_logged_at: float | None = None
        self._lost_unlogged = 0
        self._fd: int | None = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._skip_backlog()

    def _skip_backlog(self) -> None:
        """Start after the newest record, knowing its sequence number: a flood that overwrites the ring
        before the first poll is then counted as lost too (``SEEK_END`` alone leaves the first gap unknown)."""
        assert self._fd is not None
        for _ in range(1_000_000):  # the ring holds far fewer; a bound for a device that never says EAGAIN
            try:
                data = os.read(self._fd, 8192)
            except BlockingIOError:
                return
            except BrokenPipeError:
                continue
            except OSError:
                break
            if not data:
                return
            seq, _text = decode_kmsg_record(data)
            if seq is not None:
                self.last_seq = seq if self.last_seq is None else max(self.last_seq, seq)
        os.lseek(self._fd, 0, os.SEEK_END)

    def _note_seq(self, seq: int | None) -> None:
        if seq is None:
            return
        if self.last_seq is not None and seq > self.last_seq + 1:
            gap = seq - self.last_seq - 1
            self.lost_records += gap
            self._lost_unlogged += gap
            now = time.monotonic()
            if self._lost_logged_at is None or now - self._lost_logged_at >= LOST_LOG_EVERY_S:
                log.warning(
                    "kernel log: %d record(s) overwritten before they were read (%d in all)",
                    self._lost_unlogged,
                    self.lost_records,
                )
                self._lost_logged_at, self._lost_unlogged = now, 0
        self.last_seq = seq if self.last_seq is None else max(self.last_seq, seq)

    def poll(self) -> list[str]:
        """Return the records that arrived since the last poll (never blocks)."""
        out: list[str] = []
        overruns = 0
        while self._fd is not None and len(out) < self.max_records:
            try:
                data = os.read(self._fd, 8192)
            except BlockingIOError:  # read fine, nothing new: a passing error is over on a quiet host too
                if self.error is not None:  # (no call at each tick: issue 18)
                    self._read_again()
                break
            except BrokenPipeError:
                overruns += 1  # the next read returns the oldest record still there
                self.overruns += 1
                if overruns > 8:  # a ring buffer overwritten faster than we read: next tick
                    break
                continue
            except OSError as exc:
                self.error = f"reading {self.path} failed: {exc}"
                break
            if not data:
                break
            if self.error is not None:
                self._read_again()
            seq, text = decode_kmsg_record(data)
            self._note_seq(seq)
            out.append(text)
        return out

    def _read_again(self) -> None:
        """A read succeeded: a passing read error, which left the kernel log "blind" for good (helper-51), is over."""
        if self.error is not None:
            log.warning("kernel log: %s reads again (it failed: %s)", self.path, self.error)
            self.error = None

    def fileno(self) -> int | None:
        """/dev/kmsg's descriptor: readable when a record arrives (``devkmsg_poll``); None once closed."""
        return self._fd

    def close(self) -> None:
        """Close the device (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JournalSource(_Closing):
    """Follow ``journalctl -k -f -o short-monotonic -n 0`` through a non-blocking pipe.

    :meth:`poll` returns complete lines only (a partial line waits for its
    newline). If journalctl exits, :attr:`error` says so with its exit status
    and the last stderr text, and :meth:`poll` returns ``[]``.

    Raises:
        OSError: the command cannot be started (e.g. not installed).
    """

    name = "journal"

    def __init__(self, cmd: Sequence[str] = JOURNAL_CMD, *, max_bytes: int = 1 << 20) -> None:
        self.error: str | None = None
        self.max_bytes = max_bytes
        self._buf = b""
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        os.set_blocking(self._proc.stdout.fileno(), False)
        os.set_blocking(self._proc.stderr.fileno(), False)

    def poll(self) -> list[str]:
        """Return complete lines written since the last poll (never blocks)."""
        proc = self._proc
        if proc is None or proc.stdout is None:
            return []
        chunks = [self._buf]
        size, eof = 0, False
        while size < self.max_bytes:
            try:
                chunk = os.read(proc.stdout.fileno(), 65536)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
            size += len(chunk)
        *lines, self._buf = b"".join(chunks).split(b"\n")
        if eof:
            if self._buf:
                lines.append(self._buf)
                self._buf = b""
            self._died(proc)
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines if ln.strip()]

    def _died(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            rc = proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            rc = None
        err = b""
        if proc.stderr is not None:
            with contextlib.suppress(BlockingIOError, ValueError):
                err = proc.stderr.read() or b""
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        self.error = f"journalctl exited (status {rc}) {tail[0]}".strip()
        log.warning("kernel log: %s", self.error)
        self.close()

    def fileno(self) -> int | None:
        """journalctl's stdout: readable on a line or when it exits; None once closed."""
        proc = self._proc
        return proc.stdout.fileno() if proc is not None and proc.stdout is not None else None

    def close(self) -> None:
        """Terminate journalctl (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


_DMESG_TS = re.compile(r"^(?:\x1b\[[0-9;]*m)*(?:<\d+>)?\[\s*(\d+\.\d+)\]")


class DmesgSource(_Closing):
    """Poll ``dmesg`` at most every ``interval_s`` seconds; return lines newer than seen.

    The first poll records the baseline and returns nothing. A line is new when
    its ``[seconds]`` timestamp is later than the last one seen; lines sharing
    the last timestamp are told apart by count. Lines without a timestamp
    (continuations) go with the line before them. Each run is a short
    blocking subprocess (``timeout_s``); a failure sets :attr:`error`.
    """

    name = "dmesg"

    def __init__(
        self,
        cmd: Sequence[str] = DMESG_CMD,
        *,
        interval_s: float = 10.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cmd = list(cmd)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.error: str | None = None
        self._clock = clock
        self._next_at: float | None = None
        self._last_ts: float | None = None
        self._n_at_last = 0  # lines seen carrying _last_ts

    def _run(self) -> list[str] | None:
        try:
            res = subprocess.run(self.cmd, capture_output=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.error = f"{' '.join(self.cmd)} failed: {exc}"
            return None
        if res.returncode != 0:
            tail = res.stderr.decode("utf-8", "replace").strip()
            self.error = f"{' '.join(self.cmd)} exited {res.returncode}: {tail}".strip()
            return None
        self.error = None
        return res.stdout.decode("utf-8", "replace").splitlines()

    def poll(self) -> list[str]:
        """Return the lines logged since the previous run (``[]`` between intervals)."""
        now = self._clock()
        if self._next_at is not None and now < self._next_at:
            return []
        self._next_at = now + self.interval_s
        lines = self._run()
        if lines is None:
            return []
        baseline = self._last_ts is None
        last, n_last = self._last_ts, self._n_at_last
        top, n_top = last, n_last  # newest timestamp seen and how many lines carry it
        out: list[str] = []
        ts: float | None = None
        n_ts, new = 0, False
        for line in lines:
            if m := _DMESG_TS.match(line):
                t = float(m[1])
                n_ts = n_ts + 1 if t == ts else 1
                ts = t
                new = last is None or t > last or (t == last and n_ts > n_last)
                if top is None or t > top:
                    top, n_top = t, n_ts
                elif t == top:
                    n_top = max(n_top, n_ts)
            if new and not baseline and line.strip():
                out.append(line)
        # An empty buffer at baseline: everything later is new.
        self._last_ts, self._n_at_last = (-1.0, 0) if top is None else (top, n_top)
        return out


class NullSource(_Closing):
    """Stand-in when no reader works: the guard keeps running without kernel-log evidence."""

    name = "none"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.error: str | None = reason

    def poll(self) -> list[str]:
        """Always ``[]``."""
        return []


def _journal_usable(probe: Sequence[str]) -> str | None:
    """``None`` if journalctl has kernel entries, else why not."""
    if shutil.which(probe[0]) is None:
        return f"{probe[0]} not found"
    try:
        res = subprocess.run(list(probe), capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if res.returncode != 0:
        return f"exit {res.returncode}: {res.stderr.decode('utf-8', 'replace').strip()}"
    if not res.stdout.strip():
        return "no kernel entries in the journal (is systemd-journald running?)"
    return None


def open_source(
    preference: str = "auto",
    *,
    kmsg_path: str = "/dev/kmsg",
    journal_cmd: Sequence[str] = JOURNAL_CMD,
    journal_probe: Sequence[str] = JOURNAL_PROBE,
    dmesg_cmd: Sequence[str] = DMESG_CMD,
    dmesg_interval_s: float = 10.0,
) -> KmsgSource | JournalSource | DmesgSource | NullSource:
    """Open the first working reader: kmsg, else journal, else dmesg.

    ``preference`` is ``"auto"`` (that order) or one of ``"kmsg"``,
    ``"journal"``, ``"dmesg"`` (only that one). Never fails at run time: when
    nothing works the result is a :class:`NullSource` whose ``reason`` names
    each reader tried and why it failed. The chosen reader is ``.name``.

    Raises:
        ConfigError: ``preference`` is not one of :data:`PREFERENCES`.
    """
    if preference not in PREFERENCES:
        raise ConfigError(f"kernlog source: {preference!r} is not allowed; allowed: {', '.join(PREFERENCES)}")
    wanted = ("kmsg", "journal", "dmesg") if preference == "auto" else (preference,)
    why: list[str] = []
    for name in wanted:
        try:
            if name == "kmsg":
                return KmsgSource(kmsg_path)
            if name == "journal":
                problem = _journal_usable(journal_probe)
                if problem is None:
                    return JournalSource(journal_cmd)
                why.append(f"journal: {problem}")
            if name == "dmesg":
                src = DmesgSource(dmesg_cmd, interval_s=dmesg_interval_s)
                if src._run() is not None:
                    return src
                why.append(f"dmesg: {src.error}")
        except OSError as exc:
            why.append(f"{name}: {exc}")
    reason = "no kernel-log reader works (" + "; ".join(why) + "); NVRM/OOM evidence is off"
    log.error("%s", reason)
    return NullSource(reason)
