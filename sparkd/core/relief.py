"""Relief before stopping: drop clean page cache once, before a MemFree rule stops the model.

Source: the source project's watchdog (CONTEXT.md "Relief"): when a MemFree rule is
counting and at least 1 GiB of page cache is reclaimable, drop clean page cache once —
rate-limited, in the background — before stopping; never for the MemAvailable rules
(MemAvailable already counts reclaimable cache: there is nothing to win there).

Pure: the caller passes the meminfo fields, the rules now counting and the monotonic
time; ``ReliefPolicy`` answers whether to relieve now and keeps the rate limit and the
"disabled for this run" latch (a relief that failed or hung is never tried again).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sparkd.units import GiB


def reclaimable_page_cache_bytes(meminfo: Mapping[str, int]) -> int | None:
    """Clean, unmapped file pages the kernel can drop at once, in bytes.

    Active(file) + Inactive(file) − Mapped − Dirty − Writeback, floored at 0 (the
    source project's estimate). ``None`` when a term is missing from /proc/meminfo.
    """
    try:
        v = (
            meminfo["Active(file)"]
            + meminfo["Inactive(file)"]
            - meminfo["Mapped"]
            - meminfo["Dirty"]
            - meminfo["Writeback"]
        )
    except KeyError:
        return None
    return max(0, v)


def uses_mem_free(fields: Iterable[str]) -> bool:
    """Whether a rule's condition fields include MemFree (the only rules relief serves)."""
    return any(f in ("MemFree", "mem_free") for f in fields)


@dataclass
class ReliefPolicy:
    """When to drop clean page cache.

    ``min_reclaimable_bytes``: 1 GiB (source project); ``min_interval_s``: at most once per
    60 s; ``enabled``: off by default in the configuration, as in the field.
    """

    enabled: bool = False
    min_reclaimable_bytes: int = 1 * GiB
    min_interval_s: float = 60.0
    disabled_reason: str | None = None
    last_mono: float | None = None

    def should_relieve(
        self, counting_memfree_rules: Iterable[str], reclaimable_bytes: int | None, now_mono: float
    ) -> bool:
        """True when a MemFree rule is counting, enough is reclaimable and the rate limit allows."""
        if not self.enabled or self.disabled_reason is not None:
            return False
        if not list(counting_memfree_rules):
            return False
        if reclaimable_bytes is None or reclaimable_bytes < self.min_reclaimable_bytes:
            return False
        return self.last_mono is None or now_mono - self.last_mono >= self.min_interval_s

    def started(self, now_mono: float) -> None:
        self.last_mono = now_mono

    def failed(self, why: str) -> None:
        """A relief failed or hung: never again in this run (the reason is shown in status)."""
        self.disabled_reason = why


def relief_helped(mem_free_before: int | None, mem_free_after: int | None, min_gain_bytes: int = 256 * 1024**2) -> bool:
    """Whether the relief raised MemFree by at least ``min_gain_bytes`` (then a rule's counter resets)."""
    if mem_free_before is None or mem_free_after is None:
        return False
    return mem_free_after - mem_free_before >= min_gain_bytes
