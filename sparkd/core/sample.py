"""One guard sample: the memory view at one instant, in bytes.

``Sample`` is what the sampler produces, the rules read and the store writes.
Field names are snake_case of the kernel's names (``mem_available`` is
MemAvailable); rules may name fields either way (see ``FIELD_ALIASES``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class MeminfoResult:
    fields: dict[str, int]
    bad_lines: list[str] = field(default_factory=list)


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


# meminfo name -> Sample attribute
MEMINFO_ATTRS: dict[str, str] = {
    "MemTotal": "mem_total",
    "MemFree": "mem_free",
    "MemAvailable": "mem_available",
    "Buffers": "buffers",
    "Cached": "cached",
    "SwapTotal": "swap_total",
    "SwapFree": "swap_free",
    "Shmem": "shmem",
    "AnonPages": "anon_pages",
    "Slab": "slab",
    "SReclaimable": "sreclaimable",
    "SUnreclaim": "sunreclaim",
    "PageTables": "page_tables",
    "KernelStack": "kernel_stack",
    "CmaTotal": "cma_total",
    "CmaFree": "cma_free",
}

# Every name a rule condition may use, mapped to the Sample attribute.
FIELD_ALIASES: dict[str, str] = {
    **MEMINFO_ATTRS,
    **{v: v for v in MEMINFO_ATTRS.values()},
    "driver_bytes": "driver_bytes",
    "driver": "driver_bytes",
    "nvrm_recent": "nvrm_recent",
    "low_watermark": "low_watermark_bytes",
    "low_watermark_bytes": "low_watermark_bytes",
    "mem_available_minus_cma": "mem_available_minus_cma",
    "MemAvailable-CmaFree": "mem_available_minus_cma",
    "usable": "mem_available_minus_cma",
    "psi_some_avg10": "psi_some_avg10",
    "psi_full_avg10": "psi_full_avg10",
    "shm_bytes": "shm_bytes",
}

# Fields whose values are sizes (bytes); the others are counts or percentages.
SIZE_ATTRS = frozenset(
    [*MEMINFO_ATTRS.values(), "driver_bytes", "low_watermark_bytes", "mem_available_minus_cma", "shm_bytes"]
)

DISPLAY_NAMES: dict[str, str] = {v: k for k, v in MEMINFO_ATTRS.items()} | {
    "driver_bytes": "driver memory",
    "nvrm_recent": "NVRM errors (recent)",
    "low_watermark_bytes": "low watermark",
    "mem_available_minus_cma": "MemAvailable-CmaFree",
    "psi_some_avg10": "PSI some avg10",
    "psi_full_avg10": "PSI full avg10",
    "shm_bytes": "/dev/shm",
}


@dataclass(slots=True)
class Sample:
    ts: float  # UTC epoch seconds
    mono: float  # time.monotonic() at read
    mem_total: int | None = None
    mem_free: int | None = None
    mem_available: int | None = None
    buffers: int | None = None
    cached: int | None = None
    swap_total: int | None = None
    swap_free: int | None = None
    shmem: int | None = None
    anon_pages: int | None = None
    slab: int | None = None
    sreclaimable: int | None = None
    sunreclaim: int | None = None
    page_tables: int | None = None
    kernel_stack: int | None = None
    cma_total: int | None = None
    cma_free: int | None = None
    psi_some_avg10: float | None = None
    psi_some_avg60: float | None = None
    psi_some_total_us: int | None = None
    psi_full_avg10: float | None = None
    psi_full_avg60: float | None = None
    psi_full_total_us: int | None = None
    shm_bytes: int | None = None
    shm_entries: int | None = None
    # derived signals
    driver_bytes: int | None = None
    nvrm_recent: int = 0
    low_watermark_bytes: int | None = None
    mem_available_minus_cma: int | None = None

    def get(self, name: str) -> Any:
        """Value of a field by rule name (``MemAvailable`` or ``mem_available``).

        Raises:
            KeyError: unknown field name.
        """
        return getattr(self, FIELD_ALIASES[name])

    def to_row(self) -> dict[str, Any]:
        """Columns for the ``samples`` table (everything but ``mono``)."""
        return {name: getattr(self, name) for name in ROW_FIELDS}

    def context(self) -> dict[str, Any]:
        """The meminfo context the seed watchdog records beside a driver error (bytes)."""
        return {
            "MemAvailable": self.mem_available,
            "MemFree": self.mem_free,
            "Cached": self.cached,
            "Buffers": self.buffers,
            "AnonPages": self.anon_pages,
            "Slab": self.slab,
            "PageTables": self.page_tables,
            "driver_bytes": self.driver_bytes,
        }


def driver_bytes(m: dict[str, int]) -> int | None:
    """Estimate memory taken through the GPU driver, in bytes.

    MemTotal − MemFree − Buffers − Cached − AnonPages − Slab − PageTables − KernelStack
    (source: the operators' change log, CONTEXT.md "What the operators learned").
    Returns ``None`` when any term is missing.
    """
    try:
        return (
            m["MemTotal"]
            - m["MemFree"]
            - m["Buffers"]
            - m["Cached"]
            - m["AnonPages"]
            - m["Slab"]
            - m["PageTables"]
            - m["KernelStack"]
        )
    except KeyError:
        return None


def build_sample(
    ts: float,
    mono: float,
    meminfo: MeminfoResult,
    psi: Psi | None,
    shm: tuple[int | None, int | None] = (None, None),
    *,
    nvrm_recent: int = 0,
    low_watermark_bytes: int | None = None,
) -> Sample:
    """Assemble a ``Sample`` from the readers' results and compute the derived signals."""
    m = meminfo.fields
    get = m.get
    some10, some60, some_total, full10, full60, full_total = (
        _NO_PSI
        if psi is None
        else (psi.some_avg10, psi.some_avg60, psi.some_total_us, psi.full_avg10, psi.full_avg60, psi.full_total_us)
    )
    s = Sample(
        ts,
        mono,
        get("MemTotal"),
        get("MemFree"),
        get("MemAvailable"),
        get("Buffers"),
        get("Cached"),
        get("SwapTotal"),
        get("SwapFree"),
        get("Shmem"),
        get("AnonPages"),
        get("Slab"),
        get("SReclaimable"),
        get("SUnreclaim"),
        get("PageTables"),
        get("KernelStack"),
        get("CmaTotal"),
        get("CmaFree"),
        some10,
        some60,
        some_total,
        full10,
        full60,
        full_total,
        shm[0],
        shm[1],
        driver_bytes(m),
        nvrm_recent,
        low_watermark_bytes,
    )
    derive(s)
    return s


_NO_PSI: tuple[None, ...] = (None,) * 6


def derive(s: Sample) -> None:
    """Set the derived usable memory: ``mem_available_minus_cma`` = MemAvailable − CmaFree
    (MemAvailable where the kernel reports no CMA), or ``None`` without MemAvailable.

    Free CMA counts in MemAvailable but the GPU driver's allocations cannot use it (a host
    died at MemAvailable 10.45 GiB of which 8.81 GiB was free CMA: field-2/homelab-kill7-cma.csv).
    One function for the live guard (``build_sample``) and replay's loaders alike."""
    s.mem_available_minus_cma = usable_bytes(s.mem_available, s.cma_free)


def usable_bytes(mem_available: int | None, cma_free: int | None) -> int | None:
    """Usable memory, bytes: MemAvailable − CmaFree (CmaFree absent: 0), None without MemAvailable. What the
    default stop lines, the hard floor during a stop and the launch preflight judge (``derive``'s source)."""
    return None if mem_available is None else mem_available - (cma_free or 0)


ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Sample) if f.name != "mono")

# build_sample passes the fields by position (one call instead of 30 attribute sets; issue 18): the
# order it assumes is checked at import
if [f.name for f in fields(Sample)][2:18] != list(MEMINFO_ATTRS.values()):  # pragma: no cover - a bug
    raise ImportError("core.sample: Sample's meminfo fields are not in MEMINFO_ATTRS order")
