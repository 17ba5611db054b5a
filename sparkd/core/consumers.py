"""Who holds the memory: pure attribution and summaries of a process scan.

A scan (``sparkd.sense.consumers``) yields one ``ProcessMem`` per process; this module
decides which group each belongs to and condenses the scan into what is stored, shown
and put in a trip's reason:

* ``container``: a process in the serving container's cgroup (its id appears in
  ``/proc/<pid>/cgroup``: ``/docker/<id>`` under cgroup v1, ``docker-<id>.scope`` under
  the systemd driver of cgroup v2);
* ``system``: a system service (a cgroup under ``system.slice``, or PID 1's own);
* ``host``: everything else — compile jobs, notebooks, a second engine (another container,
  even under ``system.slice/docker-<id>.scope``): the co-tenants.

Source: the operators' incident notes (CONTEXT.md "Who holds the memory"): host sampling
had to add "the processes with the largest RSS" to find who ate the memory before a hang.
No I/O here; sizes are bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from sparkd.units import fmt_gib

Group = Literal["container", "host", "system"]
GROUPS: tuple[Group, ...] = ("container", "host", "system")


@dataclass(frozen=True, slots=True)
class ProcessMem:
    """One process: ``rss_bytes`` resident set; ``uss_bytes`` unique set where it was read (else None)."""

    pid: int
    name: str
    rss_bytes: int
    group: Group
    uss_bytes: int | None = None


def group_of(cgroup_text: str, container_ids: Iterable[str]) -> Group:
    """The group of a process from the text of its ``/proc/<pid>/cgroup``.

    ``container_ids``: full (64 hex) ids of the containers sparkd serves or guards.
    An empty or unreadable cgroup text is ``host`` (the conservative reading: it is
    counted as a co-tenant, never hidden inside the container's share).
    """
    for cid in container_ids:
        if cid and cid in cgroup_text:
            return "container"
    paths = [line.split(":", 2)[-1] for line in cgroup_text.splitlines()]
    if any("/docker-" in p or "/docker/" in p for p in paths):
        return "host"  # another container (a second engine, ComfyUI): a co-tenant, not a system service
    for path in paths:
        if path.startswith("/system.slice/") or path == "/init.scope":
            return "system"
    return "host"


@dataclass(frozen=True, slots=True)
class NameTotal:
    """Processes of one command name in one group: ``count`` of them holding ``rss_bytes``."""

    name: str
    group: Group
    count: int
    rss_bytes: int


@dataclass(frozen=True, slots=True)
class ConsumerSummary:
    """A condensed scan: per-group RSS totals, the top processes and the top command names.

    ``at``: wall-clock time of the scan (UTC epoch seconds, a label only);
    ``scanned``: processes looked at; ``cpu_s``: CPU time the scan cost; ``watched``: a container was
    watched (False in monitor-only, or with no container yet: the ``container`` total is then no measure,
    and ``text`` says so instead of "container 0.00 GiB").
    """

    at: float
    totals: dict[str, int]
    top: tuple[ProcessMem, ...]
    by_name: tuple[NameTotal, ...]
    scanned: int
    cpu_s: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    watched: bool = True

    def to_json(self) -> dict[str, Any]:
        """The stored and served shape (bytes; GiB only in ``text``)."""
        return {
            "at": self.at,
            "totals_bytes": dict(self.totals),
            "top": [
                {"pid": p.pid, "name": p.name, "group": p.group, "rss_bytes": p.rss_bytes, "uss_bytes": p.uss_bytes}
                for p in self.top
            ],
            "by_name": [
                {"name": n.name, "group": n.group, "count": n.count, "rss_bytes": n.rss_bytes} for n in self.by_name
            ],
            "scanned": self.scanned,
            "cpu_s": round(self.cpu_s, 6),
            "watched": self.watched,
            "text": self.text(),
        }

    def host_names(self, limit: int = 3) -> list[NameTotal]:
        """The biggest co-tenant command names (group ``host``), largest first."""
        return sorted((n for n in self.by_name if n.group == "host"), key=lambda n: n.rss_bytes, reverse=True)[:limit]

    def text(self) -> str:
        """One line for operators: ``container 93.1 GiB · host co-tenants 7.2 GiB: cc1plus ×16 5.2 GiB, …``."""
        parts = [f"container {fmt_gib(self.totals.get('container', 0))}" if self.watched else "no container watched"]
        host = f"host co-tenants {fmt_gib(self.totals.get('host', 0))}"
        names = self.host_names()
        if names:
            host += ": " + ", ".join(_name_text(n) for n in names)
        parts.append(host)
        parts.append(f"system services {fmt_gib(self.totals.get('system', 0))}")
        return " · ".join(parts)


def _name_text(n: NameTotal) -> str:
    return f"{n.name} ×{n.count} {fmt_gib(n.rss_bytes)}" if n.count > 1 else f"{n.name} {fmt_gib(n.rss_bytes)}"


def summarize(
    procs: Sequence[ProcessMem], *, at: float, top_n: int = 10, cpu_s: float = 0.0, watched: bool = True
) -> ConsumerSummary:
    """Condense a scan: group totals, the ``top_n`` processes by RSS and the ``top_n`` command names of each group.
    ``watched``: a container was watched (``ConsumerSummary.watched``).

    Raises ValueError when ``top_n`` < 1.
    """
    if top_n < 1:
        raise ValueError(f"top_n = {top_n}: must be at least 1")
    totals: dict[str, int] = dict.fromkeys(GROUPS, 0)
    names: dict[tuple[str, Group], list[int]] = {}
    for p in procs:
        totals[p.group] += p.rss_bytes
        acc = names.setdefault((p.name, p.group), [0, 0])
        acc[0] += 1
        acc[1] += p.rss_bytes
    top = tuple(sorted(procs, key=lambda p: p.rss_bytes, reverse=True)[:top_n])
    ranked = sorted(
        (NameTotal(name, group, c, b) for (name, group), (c, b) in names.items()),
        key=lambda n: n.rss_bytes,
        reverse=True,
    )
    by_name = tuple(n for g in GROUPS for n in [m for m in ranked if m.group == g][:top_n])
    return ConsumerSummary(
        at=at, totals=totals, top=top, by_name=by_name, scanned=len(procs), cpu_s=cpu_s, watched=watched
    )


def cotenant_excess(summary: ConsumerSummary, limit_bytes: int) -> int:
    """Bytes by which host co-tenants exceed ``limit_bytes`` (0 when within it)."""
    return max(0, summary.totals.get("host", 0) - limit_bytes)


def fall_shares(before: ConsumerSummary | None, after: ConsumerSummary) -> dict[str, int]:
    """How much each group grew between two scans (bytes; negative = shrank).

    Used in a trip's reason and the incident summary: "of the fall, the container grew
    by X and host co-tenants by Y". Without a ``before`` scan every delta is 0.
    """
    if before is None:
        return dict.fromkeys(GROUPS, 0)
    return {g: after.totals.get(g, 0) - before.totals.get(g, 0) for g in GROUPS}


#: A fall's part outside every process's RSS is named from this size on, and a fall of MemAvailable is one from this
#: size on (below: scan-to-scan noise).
OUTSIDE_RSS_MIN_BYTES = 256 * 1024 * 1024
#: Its key beside the groups' in a trip's ``fall_shares_bytes`` (present from OUTSIDE_RSS_MIN_BYTES on).
OUTSIDE_RSS_KEY = "outside_rss"


def outside_rss(
    shares: dict[str, int], mem_available_before_bytes: int | None, mem_available_after_bytes: int | None
) -> int | None:
    """The part of a fall of MemAvailable (before − after, bytes) that no process's RSS explains (``shares``:
    ``fall_shares``): on a Spark mostly GPU (driver) allocations, else kernel memory or page cache. None when either
    MemAvailable is unknown or the part is under ``OUTSIDE_RSS_MIN_BYTES`` (scan-to-scan noise)."""
    if mem_available_before_bytes is None or mem_available_after_bytes is None:
        return None
    outside = (mem_available_before_bytes - mem_available_after_bytes) - sum(shares.values())
    return outside if outside >= OUTSIDE_RSS_MIN_BYTES else None


def _signed_gib(n_bytes: int) -> str:
    return ("+" if n_bytes >= 0 else "−") + fmt_gib(abs(n_bytes))


def fall_text(
    before: ConsumerSummary | None,
    after: ConsumerSummary,
    *,
    mem_available_before_bytes: int | None = None,
    mem_available_after_bytes: int | None = None,
    before_is_trip: bool = False,
) -> str:
    """One sentence for a trip's reason and the incident summary: who grew between two scans.

    ``"since 21:14:03 UTC MemAvailable 40.00 GiB → 5.90 GiB: container +0.50 GiB, host co-tenants
    +0.50 GiB (python 0.50 GiB), system services +0.00 GiB"``. Without a ``before`` scan it
    says so and gives the groups' current totals (``after.text()``); so it does when MemAvailable fell by less
    than ``OUTSIDE_RSS_MIN_BYTES`` since (a rule that holds with the model down trips again with memory as low as
    at its last trip: "who grew … MemAvailable 2.00 GiB → 2.00 GiB: container +0.00 GiB" named a fall there was
    not, helper-39). ``before_is_trip``: ``before`` is the last trip's scan, said so ("since the last trip at …").
    """
    if before is None:
        return f"no scan before the fall; now: {after.text()}"
    when = datetime.fromtimestamp(before.at, UTC).strftime("%H:%M:%S UTC")
    if before_is_trip:
        when = f"the last trip at {when}"
    if (
        mem_available_before_bytes is not None
        and mem_available_after_bytes is not None
        and mem_available_before_bytes - mem_available_after_bytes < OUTSIDE_RSS_MIN_BYTES
    ):
        return (
            f"no fall since {when} (MemAvailable {fmt_gib(mem_available_before_bytes)} → "
            f"{fmt_gib(mem_available_after_bytes)}): it was this low already; now: {after.text()}"
        )
    shares = fall_shares(before, after)
    head = f"since {when}"
    if mem_available_before_bytes is not None and mem_available_after_bytes is not None:
        head += f" MemAvailable {fmt_gib(mem_available_before_bytes)} → {fmt_gib(mem_available_after_bytes)}"
    names = after.host_names()
    host = f"host co-tenants {_signed_gib(shares['host'])}"
    if names:
        host += " (now " + ", ".join(_name_text(n) for n in names) + ")"
    text = (
        f"{head}: container {_signed_gib(shares['container'])}, {host}, system services {_signed_gib(shares['system'])}"
    )
    # what no process's RSS explains. Without it a 16 GiB fall read "container +0.00 · host +0.19" (nothing grew)
    outside = outside_rss(shares, mem_available_before_bytes, mem_available_after_bytes)
    if outside is not None:
        text += f", outside any process's RSS {_signed_gib(outside)} (GPU/driver allocations, kernel, page cache)"
    return text
