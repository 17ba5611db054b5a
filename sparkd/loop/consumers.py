"""Who holds the memory, in the running daemon: the periodic process scan and co-tenant warnings.

Every ``consumers.interval_s`` (10 s) while the daemon samples fast, otherwise every
``consumers.quiet_interval_s`` (60 s) once MemAvailable moved ``consumers.quiet_change_gib``
(and at least every ``consumers.store_every_s``), and at every trip, ``ConsumerWatch`` runs one
``sparkd.sense.consumers.ConsumerScanner.scan`` in a worker thread (the guard tick never
waits for it), with the ids of the container the supervisor manages or guards. Each scan:

* is kept in memory (the last ``consumers.history`` scans, each with the MemAvailable read
  at the time) and written through the writer queue as one ``consumer_scans`` row (group
  totals as columns, the JSON summary beside them);
* is checked against the co-tenant limit (``consumers.cotenant_limit``, or derived: what the
  plan left to the host — MemTotal − budget, or ``budget.host_reserve_gib`` without a plan —
  minus ``consumers.cotenant_margin_gib``): while host co-tenants hold more, a
  ``cotenant_high`` event names the biggest, at most once per ``cotenant_repeat_s``.

At a trip the daemon asks ``at_trip()``: a fresh scan (waited for at most ``TRIP_SCAN_WAIT_S``;
the last periodic scan otherwise) and the sentence of who grew since the scan "before the
fall" — the kept scan with the highest MemAvailable (``core.consumers.fall_text``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparkd.config import ConsumersSettings
from sparkd.core.consumers import (
    OUTSIDE_RSS_KEY,
    OUTSIDE_RSS_MIN_BYTES,
    ConsumerSummary,
    cotenant_excess,
    fall_shares,
    fall_text,
    outside_rss,
)
from sparkd.loop.alarm import Alarm
from sparkd.sense.consumers import ConsumerScanner
from sparkd.units import GiB, fmt_gib, parse_size

log = logging.getLogger("sparkd.loop.consumers")

TRIP_SCAN_WAIT_S = 0.25  # a trip's own scan (~40 ms at 1,000 processes); the stop never waits longer for it


@dataclass(frozen=True, slots=True)
class ScanPoint:
    """One scan and the MemAvailable read just before it (bytes; None when unknown)."""

    summary: ConsumerSummary
    mem_available_bytes: int | None


@dataclass(frozen=True, slots=True)
class TripShares:
    """Who grew between the scan before the fall and the trip's scan (bytes per group) and its sentence."""

    text: str
    shares_bytes: dict[str, int]
    before: ScanPoint | None
    after: ScanPoint
    fresh: bool  # False: the trip's own scan did not finish in time; the last periodic scan was used

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "shares_bytes": self.shares_bytes,
            "fresh": self.fresh,
            "before": _point_json(self.before),
            "after": _point_json(self.after),
        }


def _point_json(p: ScanPoint | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {**p.summary.to_json(), "mem_available_bytes": p.mem_available_bytes}


class ConsumerWatch:
    """The scan loop and its kept history. Callables are read at each scan (the container may change).

    ``container_ids()``: ids of the served/guarded container; ``mem_available()``: MemAvailable now
    (bytes) from the guard's last sample; ``plan_left_bytes()``: what the plan leaves the host
    (MemTotal − budget) or None; ``emit(kind, message, severity, details)``: the daemon's event;
    ``submit(kind, item)``: the writer queue.
    """

    def __init__(
        self,
        settings: ConsumersSettings,
        *,
        host_reserve_bytes: int,
        container_ids: Callable[[], list[str]],
        mem_available: Callable[[], int | None],
        plan_left_bytes: Callable[[], int | None],
        emit: Callable[[str, str, str, dict[str, Any]], Any],
        submit: Callable[[str, Any], Any] | None = None,
        scanner: ConsumerScanner | None = None,
        mono: Callable[[], float] = time.monotonic,
        fast: Callable[[], bool] = lambda: True,
    ) -> None:
        self.settings = settings
        self.fast = fast
        self.host_reserve_bytes = host_reserve_bytes
        self.container_ids = container_ids
        self.mem_available = mem_available
        self.plan_left_bytes = plan_left_bytes
        self.emit = emit
        self.submit = submit
        self.scanner = scanner or ConsumerScanner(top_n=settings.top_n, uss_top=settings.uss_top)
        self.mono = mono
        self.history: collections.deque[ScanPoint] = collections.deque(maxlen=settings.history)
        self.scans = 0
        self.last_trip: TripShares | None = None
        self._trips_by_rule: dict[str, TripShares] = {}  # each rule's last trip (``at_trip``)
        self._lock = threading.Lock()  # one scan at a time (periodic and trip scans share the scanner)
        self.alarm = Alarm()  # run()'s sleep between looks; wake() ends it
        self._last_warned: float | None = None
        self._last_stored: float | None = None
        self._stored_totals: dict[str, int] = {}
        self._scanned_ids: list[str] | None = None  # the container ids the last periodic scan grouped by
        self._rescan = False  # ``wake(rescan=True)``: the next look scans, due or not

    # ------------------------------------------------------------------ figures
    @property
    def last(self) -> ScanPoint | None:
        return self.history[-1] if self.history else None

    def cotenant_limit_bytes(self) -> int:
        """The configured limit, or: (MemTotal − plan budget, else host reserve) − margin, floored at 0."""
        if self.settings.cotenant_limit is not None:
            return parse_size(self.settings.cotenant_limit)
        left = self.plan_left_bytes()
        if left is None:
            left = self.host_reserve_bytes
        return max(0, left - int(self.settings.cotenant_margin_gib * GiB))

    def before_fall(self, since: float | None = None) -> ScanPoint | None:
        """The kept scan with the highest MemAvailable (the latest of equals), among those taken at ``since`` (epoch
        s) or later when given; None when none has one."""
        best: ScanPoint | None = None
        for p in self.history:
            if since is not None and p.summary.at < since:
                continue
            if p.mem_available_bytes is not None and (
                best is None or p.mem_available_bytes >= (best.mem_available_bytes or 0)
            ):
                best = p
        return best

    # ------------------------------------------------------------------ scanning
    def _scan_blocking(self, ids: list[str]) -> ConsumerSummary:
        with self._lock:
            return self.scanner.scan(ids)

    async def scan(self) -> ScanPoint:
        """One scan in a worker thread, kept, stored and checked against the co-tenant limit."""
        ids = self.container_ids()
        avail = self.mem_available()
        summary = await asyncio.to_thread(self._scan_blocking, ids)
        self._scanned_ids = ids
        return self._record(summary, avail)

    def _record(self, summary: ConsumerSummary, avail: int | None, *, store: bool = False) -> ScanPoint:
        """Keep a scan in memory; store it when ``store`` (a trip's) or ``store_every_s`` has passed."""
        point = ScanPoint(summary, avail)
        self.history.append(point)
        self.scans += 1
        now = self.mono()
        due = self._last_stored is None or now - self._last_stored >= self.settings.store_every_s
        moved = any(
            abs(v - self._stored_totals.get(g, 0)) >= self.settings.store_change_gib * GiB
            for g, v in summary.totals.items()
        )
        if self.submit is not None and (store or due or moved):
            self._last_stored, self._stored_totals = now, dict(summary.totals)
            self.submit(
                "consumers",
                {
                    "ts": summary.at,
                    "container_bytes": summary.totals.get("container", 0),
                    "host_bytes": summary.totals.get("host", 0),
                    "system_bytes": summary.totals.get("system", 0),
                    "data": {**summary.to_json(), "mem_available_bytes": avail},
                },
            )
        self._check_cotenants(summary)
        return point

    def _check_cotenants(self, summary: ConsumerSummary) -> None:
        limit = self.cotenant_limit_bytes()
        excess = cotenant_excess(summary, limit)
        if excess <= 0:
            self._last_warned = None  # back within: the next crossing warns at once
            return
        now = self.mono()
        if self._last_warned is not None and now - self._last_warned < self.settings.cotenant_repeat_s:
            return
        self._last_warned = now
        names = summary.host_names(5)
        biggest = ", ".join(
            f"{n.name} ×{n.count} {fmt_gib(n.rss_bytes)}" if n.count > 1 else f"{n.name} {fmt_gib(n.rss_bytes)}"
            for n in names
        )
        self.emit(
            "cotenant_high",
            f"host co-tenants hold {fmt_gib(summary.totals.get('host', 0))} RSS, {fmt_gib(excess)} over the "
            f"co-tenant limit {fmt_gib(limit)}: {biggest or 'no names read'}",
            "warning",
            {
                "host_bytes": summary.totals.get("host", 0),
                "limit_bytes": limit,
                "excess_bytes": excess,
                "biggest": [{"name": n.name, "count": n.count, "rss_bytes": n.rss_bytes} for n in names],
            },
        )

    def _quiet(self) -> bool:
        """While sampling normally: has MemAvailable stayed within ``quiet_change_gib`` of the last
        scan's? Then that scan still tells who holds the memory (issue 18: a scan costs 10-40 ms of
        CPU, more than a minute of guard ticks). Unknown MemAvailable never counts as quiet."""
        last = self.last
        avail = self.mem_available()
        if last is None or avail is None or last.mem_available_bytes is None:
            return False
        return abs(avail - last.mem_available_bytes) < self.settings.quiet_change_gib * GiB

    async def run(self) -> None:
        """Scan every ``interval_s`` while ``fast()`` (the daemon samples fast: start-up, a rule counting,
        near a floor), else every ``quiet_interval_s`` once MemAvailable moved ``quiet_change_gib`` since
        the last scan, and at least every ``store_every_s``; until cancelled. A failing scan is logged and
        tried again next time. Looks every ``interval_s`` while fast, every ``quiet_interval_s`` otherwise
        (issue 18: no wake-up every 10 s on a quiet host); ``wake()`` (the daemon, when it starts sampling
        fast) makes it look at once."""
        last: float | None = None
        while True:
            now = self.mono()
            fast = self.fast()
            # another container (launched, adopted, restarted): the last scan counted it as a co-tenant or not
            # at all, so the totals are scanned again at once (``wake``), not a quiet_interval_s later
            moved_on = self._scanned_ids is not None and self.container_ids() != self._scanned_ids
            rescan, self._rescan = self._rescan, False
            if (
                last is None
                or moved_on
                or rescan
                or (
                    now - last >= (self.settings.interval_s if fast else self.settings.quiet_interval_s)
                    and (fast or now - last >= self.settings.store_every_s or not self._quiet())
                )
            ):
                last = now
                try:
                    await self.scan()
                except Exception as e:  # psutil or /proc trouble must never end the daemon
                    log.warning("process scan failed (ignoring until the next one): %s", e)
            if self._rescan:  # asked during the scan just made (its wake found no sleeper): look again at once
                continue
            await self.alarm.sleep(self.settings.interval_s if fast else self.settings.quiet_interval_s)

    def wake(self, *, rescan: bool = False) -> None:
        """Look now whether a scan is due (the daemon starts sampling fast; a container was launched, adopted
        or restarted). ``rescan``: scan at this look, due or not (the container stopped or exited: its processes
        are gone, and the last scan's "container 1.02 GiB" was shown for up to ``interval_s`` after a stop, up to
        ``quiet_interval_s`` on a quiet host, helper-48). On the event loop's thread."""
        self._rescan = self._rescan or rescan
        self.alarm.wake()

    async def at_trip(self, rule: str | None = None) -> TripShares | None:
        """A trip's scan and who grew since the scan before the fall; None when nothing was ever scanned.

        The fall is looked for since the last trip's scan when there was one: trips repeated while memory stays low
        (a rule that holds with the model down trips once per cooldown) each named the first trip's fall ("who grew
        since 18:08:08 … 12.00 → 4.00 GiB") as if it were new; now "no fall since the last trip at 18:08:10 …"
        (note 18 §7). A fall after a recovery since that trip is told as ever. The last trip is ``rule``'s own: a
        second rule's first trip 3 s after another's named "no fall since the last trip" while the 40 → 4 GiB fall
        was told only in the other rule's event (helper-44); a scan since with MemAvailable no higher by
        ``OUTSIDE_RSS_MIN_BYTES`` leaves the trip's scan the one told ("no fall since 23:35:13", a periodic scan,
        hid the trip)."""
        previous = self._trips_by_rule.get(rule) if rule is not None else self.last_trip
        since = previous.after.summary.at if previous is not None else None
        before = self.before_fall(since)  # chosen among the scans before this trip's own
        if previous is not None and before is not None and before is not previous.after:
            was, now_best = previous.after.mem_available_bytes, before.mem_available_bytes
            if was is not None and now_best is not None and now_best - was < OUTSIDE_RSS_MIN_BYTES:
                before = previous.after  # no recovery since that trip: its scan, said as the last trip's
        fresh = True
        try:
            ids, avail = self.container_ids(), self.mem_available()
            summary = await asyncio.wait_for(asyncio.to_thread(self._scan_blocking, ids), TRIP_SCAN_WAIT_S)
            after = self._record(summary, avail, store=True)
        except Exception as e:  # TimeoutError included: the stop goes on with the last periodic scan
            log.warning("trip scan did not finish (%s); using the last periodic scan", e or type(e).__name__)
            fresh = False
            if self.last is None:
                return None
            after = self.last
            if before is after:
                before = None
        text = fall_text(
            before.summary if before else None,
            after.summary,
            mem_available_before_bytes=before.mem_available_bytes if before else None,
            mem_available_after_bytes=after.mem_available_bytes,
            before_is_trip=before is not None and previous is not None and before is previous.after,
        )
        shares = fall_shares(before.summary if before else None, after.summary)
        # the fall's part outside every RSS, as the text says it: the stopped card's "who grew" read "container
        # 0.00 GiB · host 0.01 GiB · system 0.00 GiB" for a 10 GiB fall without it (helper-39)
        outside = outside_rss(shares, before.mem_available_bytes if before else None, after.mem_available_bytes)
        if outside is not None:
            shares = {**shares, OUTSIDE_RSS_KEY: outside}
        self.last_trip = TripShares(text, shares, before, after, fresh)
        if rule is not None:
            self._trips_by_rule[rule] = self.last_trip
        return self.last_trip

    # ------------------------------------------------------------------ readers
    def status(self) -> dict[str, Any] | None:
        """``Status.consumers``: the last scan, the limit, the last trip's shares; None before the first scan."""
        last = self.last
        if last is None:
            return None
        s = last.summary
        return {
            "at": s.at,
            "text": s.text(),
            "totals_bytes": dict(s.totals),
            "top": s.to_json()["top"],
            "by_name": s.to_json()["by_name"],
            "scanned": s.scanned,
            "cpu_s": round(s.cpu_s, 6),
            "scans": self.scans,
            "cotenant_limit_bytes": self.cotenant_limit_bytes(),
            "cotenant_excess_bytes": cotenant_excess(s, self.cotenant_limit_bytes()),
            "last_trip": self.last_trip.text if self.last_trip else None,
        }

    def postmortem(self) -> dict[str, Any] | None:
        """``consumers.json`` of a postmortem archive: the last scan, the trip's shares, the kept history."""
        if self.last is None:
            return None
        return {
            "last": _point_json(self.last),
            "trip": self.last_trip.to_json() if self.last_trip else None,
            "cotenant_limit_bytes": self.cotenant_limit_bytes(),
            "history": [
                {
                    "at": p.summary.at,
                    "totals_bytes": dict(p.summary.totals),
                    "mem_available_bytes": p.mem_available_bytes,
                }
                for p in self.history
            ],
        }

    def summary_line(self) -> str | None:
        """The postmortem summary's ``consumers:`` line: the last trip's sentence, else the last scan's."""
        if self.last_trip is not None:
            return self.last_trip.text
        return self.last.summary.text() if self.last else None
