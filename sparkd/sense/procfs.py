"""Read the kernel's memory view: /proc/meminfo, /proc/pressure/memory, /dev/shm.

All sizes are returned in bytes. Every reader takes a ``proc_root`` (default
``/proc``) so tests can feed fixture trees, as earlyoom does.

Shapes:
    ``read_meminfo(proc_root) -> MeminfoResult`` — ``fields``: every field of
    /proc/meminfo as ``{name: bytes}`` (``HugePages_*`` counts stay counts);
    ``bad_lines``: lines that could not be parsed (skipped, never fatal).

    ``read_psi(proc_root) -> Psi | None`` — ``None`` when the file is absent
    (kernel without CONFIG_PSI, or ``psi=0``).

    ``read_shm(shm_dir) -> (bytes_used, entry_count)`` or ``(None, None)``.
"""

from __future__ import annotations

import operator
import os
import re
import time
from pathlib import Path

from sparkd.core.sample import MeminfoResult, Psi

# The fields the rules and the dashboard use by name. Anything else in
# /proc/meminfo is still kept in ``MeminfoResult.fields``.
NAMED_FIELDS: tuple[str, ...] = (
    "MemTotal",
    "MemFree",
    "MemAvailable",
    "Buffers",
    "Cached",
    "SwapTotal",
    "SwapFree",
    "Shmem",
    "AnonPages",
    "Slab",
    "SReclaimable",
    "SUnreclaim",
    "PageTables",
    "KernelStack",
    "CmaTotal",
    "CmaFree",
)


def parse_meminfo(text: str) -> MeminfoResult:
    """Parse the text of /proc/meminfo. ``kB`` values become bytes (×1024).

    A line that is not ``Name: <int> [kB]`` is skipped and returned in
    ``bad_lines``; it never raises.
    """
    out: dict[str, int] = {}
    bad: list[str] = []
    for line in text.splitlines():
        if not line:
            continue
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not name or " " in name:
            bad.append(line)
            continue
        try:
            value = int(parts[0])
        except ValueError:
            bad.append(line)
            continue
        if len(parts) > 1:
            if parts[1] != "kB":
                bad.append(line)
                continue
            value *= 1024
        out[name] = value
    return MeminfoResult(out, bad)


def read_meminfo(proc_root: str | Path = "/proc") -> MeminfoResult:
    """Read and parse ``<proc_root>/meminfo``.

    Raises:
        OSError: the file cannot be read at all (the guard reports and retries).
    """
    with open(os.path.join(proc_root, "meminfo"), "rb") as f:
        data = f.read()
    return parse_meminfo(data.decode("ascii", "replace"))


def parse_psi(text: str) -> Psi | None:
    """Parse the PSI text (``some ...`` and optionally ``full ...`` lines).

    Returns ``None`` when no ``some`` line can be parsed.
    """
    rows: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind not in ("some", "full"):
            continue
        kv = dict(p.split("=", 1) for p in rest.split() if "=" in p)
        rows[kind] = kv
    some = rows.get("some")
    if not some:
        return None
    try:
        full = rows.get("full")
        return Psi(
            float(some["avg10"]),
            float(some["avg60"]),
            float(some["avg300"]),
            int(some["total"]),
            float(full["avg10"]) if full else None,
            float(full["avg60"]) if full else None,
            float(full["avg300"]) if full else None,
            int(full["total"]) if full else None,
        )
    except (KeyError, ValueError):
        return None


# The layout every kernel since 4.20 writes (kernel/sched/psi.c, psi_show): one match instead of
# splitting into dicts each tick (issue 18). Anything else goes through the tolerant ``parse_psi``.
_PSI_NUM = rb"(\d+(?:\.\d+)?)"  # a number float() takes: "avg10=." passed [0-9.]+ and crashed the tick (helper-40)
_PSI_RE = re.compile(
    rb"some avg10=%s avg60=%s avg300=%s total=(\d+)\n(?:full avg10=%s avg60=%s avg300=%s total=(\d+)\n)?\Z"
    % ((_PSI_NUM,) * 6)
)


def parse_psi_bytes(data: bytes) -> Psi | None:
    """``parse_psi`` of the raw bytes, through one regular expression when the text has the kernel's
    layout (``some`` then optionally ``full``, each ``avg10= avg60= avg300= total=``)."""
    m = _PSI_RE.match(data)
    if m is None:
        return parse_psi(data.decode("ascii", "replace"))
    a10, a60, a300, tot, f10, f60, f300, ftot = m.groups()
    if f10 is None:
        return Psi(float(a10), float(a60), float(a300), int(tot), None, None, None, None)
    return Psi(float(a10), float(a60), float(a300), int(tot), float(f10), float(f60), float(f300), int(ftot))


def read_psi(proc_root: str | Path = "/proc") -> Psi | None:
    """Read ``<proc_root>/pressure/memory``; ``None`` when absent or unreadable."""
    try:
        with open(os.path.join(proc_root, "pressure", "memory"), "rb") as f:
            return parse_psi_bytes(f.read())
    except OSError:
        return None


def read_shm(shm_dir: str | Path = "/dev/shm") -> tuple[int | None, int | None]:
    """Bytes used by the tmpfs at ``shm_dir`` (statvfs) and its number of entries.

    Returns ``(None, None)`` when the directory cannot be read.
    """
    return ShmReader(shm_dir).read()


class ShmReader:
    """``read_shm`` for every tick: the directory is listed again only when its mtime moved.

    Adding or removing an entry sets the directory's mtime (POSIX). The kernel's file times are
    coarse (a clock tick, ~4 ms), so two changes in one tick share an mtime: a listing is
    trusted for later reads only when the mtime it saw was at least ``SETTLE_S`` old then.

    ``read(shmem, now_s)`` may answer without a system call: see ``read``.
    """

    SETTLE_S = 0.1
    #: The longest the figures are answered again on an unchanged Shmem (s).
    MAX_AGE_S = 10.0

    def __init__(self, shm_dir: str | Path = "/dev/shm") -> None:
        self.shm_dir = os.fspath(shm_dir)
        self._mtime_ns: int | None = None  # of the listing in _count, when it can be trusted
        self._count = 0
        self.listings = 0  # how many times the directory was listed (tests, benchmarks)
        self.reads = 0  # how many times the file system was asked (statvfs + stat)
        self._last: tuple[int, int] | None = None  # the figures of the last read that succeeded
        self._last_shmem: int | None = None  # meminfo's Shmem (bytes) given with that read
        self._last_at = 0.0

    def read(self, shmem: int | None = None, now_s: float | None = None) -> tuple[int | None, int | None]:
        """``(bytes_used, entry_count)``, or ``(None, None)`` when the directory cannot be read.

        ``shmem``: /proc/meminfo's ``Shmem`` (bytes) read on the same tick, and ``now_s`` a monotonic time
        (s). When both are given, ``shmem`` equals the value given with the last read that succeeded, and that
        read is younger than ``MAX_AGE_S``, its figures are answered again without asking the file system
        (issue 18: ``statvfs`` and ``stat`` were ~30 µs of a cold 1 Hz tick). Pages of a tmpfs such as
        /dev/shm are shmem pages (``NR_SHMEM``, mm/shmem.c), so what is written to or removed from /dev/shm
        moves ``Shmem``; a change that ``Shmem`` does not show (an empty file created, or another shmem user
        moving by exactly as many pages in the same tick) is seen within ``MAX_AGE_S``. The guard passes
        ``shmem`` only while no rule reads ``shm_bytes`` (``Guard.read_sample``): a rule always gets a fresh
        figure."""
        last = self._last
        if (
            shmem is not None
            and now_s is not None
            and last is not None
            and shmem == self._last_shmem
            and 0.0 <= now_s - self._last_at < self.MAX_AGE_S
        ):
            return last
        self.reads += 1
        try:
            st = os.statvfs(self.shm_dir)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            mtime_ns = os.stat(self.shm_dir).st_mtime_ns
            if mtime_ns != self._mtime_ns:
                self._count = len(os.listdir(self.shm_dir))
                self.listings += 1
                settled = time.time_ns() - mtime_ns >= self.SETTLE_S * 1e9
                self._mtime_ns = mtime_ns if settled else None
        except OSError:
            self._mtime_ns = self._last = None
            return None, None
        # an unsettled listing (mtime too recent) is not answered again: the next tick lists once more
        self._last = (used, self._count) if self._mtime_ns is not None else None
        self._last_shmem, self._last_at = shmem, now_s or 0.0
        return used, self._count


def read_zoneinfo_low_watermark_bytes(proc_root: str | Path = "/proc") -> int | None:
    """Sum of every zone's ``low`` watermark from ``<proc_root>/zoneinfo``, in bytes.

    The kernel's MemAvailable already subtracts the low watermarks (mm/show_mem.c,
    ``si_mem_available``), so a host with raised ``vm.min_free_kbytes`` reads a
    lower MemAvailable while healthy. Returns ``None`` when unreadable.
    """
    try:
        with open(os.path.join(proc_root, "zoneinfo")) as f:
            text = f.read()
    except OSError:
        return None
    pages = 0
    found = False
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "low":
            try:
                pages += int(parts[1])
                found = True
            except ValueError:
                continue
    if not found:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class ProcReader:
    """Fast repeated reads for the guard loop.

    Keeps /proc/meminfo and /proc/pressure/memory open and re-reads them with
    ``pread(fd, n, 0)`` (seq_file regenerates the text at offset 0), and parses
    meminfo through a cached layout: /proc/meminfo lists the same fields in the
    same order on a running kernel, so after one full parse the values sit at
    known token positions. Any mismatch (a field appears, a line is garbled)
    falls back to the full, tolerant ``parse_meminfo``. Same results as the
    plain readers; about half their CPU time (see bench/tick.py).
    """

    def __init__(self, proc_root: str | Path = "/proc") -> None:
        self.proc_root = str(proc_root)
        self._mem_fd: int | None = None
        self._psi_fd: int | None = None
        self._psi_absent = False
        self._psi_bytes: bytes | None = None  # the text of the last PSI read, and what it parsed to
        self._psi_last: Psi | None = None
        self._layout: tuple[int, list[bytes], list[tuple[int, str, int]]] | None = None
        # the named fields only (``named_meminfo``): one regular expression over the learned layout
        self._named: tuple[re.Pattern[bytes], tuple[str, ...], tuple[int, ...]] | None = None

    def _open(self, rel: str) -> int:
        return os.open(os.path.join(self.proc_root, rel), os.O_RDONLY | os.O_CLOEXEC)

    def meminfo(self) -> MeminfoResult:
        """Like ``read_meminfo``. Raises OSError when /proc/meminfo cannot be read."""
        return self._parse_meminfo(self._meminfo_bytes())

    def _meminfo_bytes(self) -> bytes:
        """/proc/meminfo's text, re-read at offset 0 of the kept descriptor (reopened after an error)."""
        if self._mem_fd is None:
            self._mem_fd = self._open("meminfo")
        try:
            return os.pread(self._mem_fd, 65536, 0)
        except OSError:
            os.close(self._mem_fd)
            self._mem_fd = None
            raise

    def _parse_meminfo(self, data: bytes) -> MeminfoResult:
        toks = data.split()
        lay = self._layout
        if lay is not None and len(toks) == lay[0] and [toks[i] for i, _n, _m in lay[2]] == lay[1]:
            try:
                return MeminfoResult({name: int(toks[i + 1]) * mult for i, name, mult in lay[2]})
            except ValueError:  # a garbled value in the known layout: the full parse names the bad line
                pass
        res = parse_meminfo(data.decode("ascii", "replace"))
        self._layout = None if res.bad_lines else self._learn(toks, res)
        return res

    def named_meminfo(self) -> MeminfoResult:
        """``NAMED_FIELDS`` of /proc/meminfo only (the guard's tick: the rules and the samples table
        need no other), matched in one pass of a regular expression built from the layout the last
        full parse saw; any other layout goes through ``meminfo`` (all fields, ``bad_lines``).
        Raises OSError when /proc/meminfo cannot be read."""
        data = self._meminfo_bytes()
        named = self._named
        if named is not None:
            m = named[0].fullmatch(data)
            if m is not None:
                # map/zip/dict run in C: no Python frame per field (a cold tick pays for each one, issue 18)
                values = map(operator.mul, map(int, m.groups()), named[2])
                return MeminfoResult(dict(zip(named[1], values, strict=True)))
        res = self._parse_meminfo(data)
        self._named = None if self._layout is None else self._named_pattern(self._layout)
        return res

    @staticmethod
    def _named_pattern(
        layout: tuple[int, list[bytes], list[tuple[int, str, int]]],
    ) -> tuple[re.Pattern[bytes], tuple[str, ...], tuple[int, ...]]:
        parts, names, mults = [], [], []
        for _i, name, mult in layout[2]:
            unit = rb" kB" if mult == 1024 else rb""
            if name in NAMED_FIELDS:
                parts.append(re.escape(name.encode()) + rb": *([0-9]+)" + unit + rb"\n")
                names.append(name)
                mults.append(mult)
            else:
                parts.append(re.escape(name.encode()) + rb": *[0-9]+" + unit + rb"\n")
        return re.compile(b"".join(parts)), tuple(names), tuple(mults)

    @staticmethod
    def _learn(toks: list[bytes], res: MeminfoResult) -> tuple[int, list[bytes], list[tuple[int, str, int]]] | None:
        entries: list[tuple[str, int, int]] = []
        i = 0
        while i < len(toks):
            t = toks[i]
            if not t.endswith(b":") or i + 1 >= len(toks):
                return None
            name = t[:-1].decode("ascii", "replace")
            mult = 1024 if i + 2 < len(toks) and toks[i + 2] == b"kB" else 1
            entries.append((name, i, mult))
            i += 3 if mult == 1024 else 2
        if {n: int(toks[i + 1]) * m for n, i, m in entries} != res.fields:
            return None
        # (token index of the name, name, multiplier); names compared as bytes each read
        return len(toks), [toks[i] for _n, i, _m in entries], [(i, n, m) for n, i, m in entries]

    def psi(self) -> Psi | None:
        """Like ``read_psi``; ``None`` when absent (and not retried every tick)."""
        if self._psi_absent:
            return None
        try:
            if self._psi_fd is None:
                self._psi_fd = self._open("pressure/memory")
            data = os.pread(self._psi_fd, 4096, 0)
        except OSError:
            if self._psi_fd is not None:
                os.close(self._psi_fd)
                self._psi_fd = None
            else:
                self._psi_absent = True
            return None
        # on a quiet host the text does not change between ticks (every avg 0.00, the totals still):
        # the last parse is the answer (``Psi`` is frozen), and a cold tick skips the regex and floats
        if data != self._psi_bytes:
            self._psi_bytes, self._psi_last = data, parse_psi_bytes(data)
        return self._psi_last

    def close(self) -> None:
        for fd in (self._mem_fd, self._psi_fd):
            if fd is not None:
                os.close(fd)
        self._mem_fd = self._psi_fd = None


def read_uptime_s(proc_root: str | Path = "/proc") -> float | None:
    """Seconds since host boot, the first field of ``<proc_root>/uptime``; ``None`` when unreadable."""
    try:
        with open(os.path.join(proc_root, "uptime"), "rb") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
