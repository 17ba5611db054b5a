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

import os
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass(slots=True)
class MeminfoResult:
    fields: dict[str, int]
    bad_lines: list[str] = field(default_factory=list)


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


@dataclass(slots=True, frozen=True)
class Psi:
    """/proc/pressure/memory: percentages for avg10/avg60/avg300, ``total_us`` in µs."""

    some_avg10: float
    some_avg60: float
    some_avg300: float
    some_total_us: int
    full_avg10: float | None
    full_avg60: float | None
    full_avg300: float | None
    full_total_us: int | None


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


def read_psi(proc_root: str | Path = "/proc") -> Psi | None:
    """Read ``<proc_root>/pressure/memory``; ``None`` when absent or unreadable."""
    try:
        with open(os.path.join(proc_root, "pressure", "memory"), "rb") as f:
            return parse_psi(f.read().decode("ascii", "replace"))
    except OSError:
        return None


def read_shm(shm_dir: str | Path = "/dev/shm") -> tuple[int | None, int | None]:
    """Bytes used by the tmpfs at ``shm_dir`` (statvfs) and its number of entries.

    Returns ``(None, None)`` when the directory cannot be read.
    """
    try:
        st = os.statvfs(shm_dir)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        count = len(os.listdir(shm_dir))
    except OSError:
        return None, None
    return used, count


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
