"""The read side the API and dashboard use: the database when it answers, else the live view.

``Reads(daemon)`` has the store's read methods (``events``, ``downsampled``,
``launches``). Each asks the database; when there is none (``DbKeeper`` says
unavailable) or it fails (corrupt, deleted, locked), it answers from the daemon's
memory — the last ``LIVE_SAMPLES`` samples and the last 100 events — and
``note()`` says so in one line. A corrupt database found by a read is handed to
the keeper (``writer.fatal``), which moves it aside and reopens.

Blocking when the database answers: call from a worker thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sparkd.core.sample import Sample
from sparkd.store.keeper import is_corrupt
from sparkd.store.store import CHART_FIELDS

if TYPE_CHECKING:
    from sparkd.loop.daemon import Daemon

log = logging.getLogger("sparkd.loop.reads")


class Reads:
    """Store reads with a fallback to memory. ``note()`` is None while the database answers."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._failed: str | None = None

    def note(self) -> str | None:
        """One line for a page or response when answers come from memory, else None."""
        d = self.daemon
        why = self._failed if d.store is not None else (d.db.error or "not open")
        if d.store is not None and self._failed is None:
            return None
        return (
            f"database unavailable ({why}): showing the live in-memory view "
            f"(last {len(d.live_samples)} samples, last {len(d.recent_events)} events)"
        )

    def _try(self, name: str, *args: Any, **kwargs: Any) -> Any:
        store = self.daemon.store
        if store is None:
            return None
        try:
            out = getattr(store, name)(*args, **kwargs)
        except Exception as e:
            why = str(getattr(e, "orig", None) or e).splitlines()[0][:200]
            if self._failed != why:
                log.error("database read failed (%s): answering from memory", why)
            self._failed = why
            w = self.daemon.writer
            if w is not None and is_corrupt(e):
                w.fatal = why  # the keeper moves it aside and reopens
            return None
        self._failed = None
        return out

    def events(
        self,
        *,
        since: float | None = None,
        kinds: Iterable[str] | None = None,
        limit: int = 100,
        before_id: int | None = None,
    ) -> list[dict[str, Any]]:
        """Events newest first (``Store.events`` shape; ``id`` None for those from memory). ``before_id``: a page of
        older stored events (ids below it), from the database alone ([] while it cannot be read).

        From the database, with the events it does not hold yet taken from memory: those newer than
        the newest record known stored (``Writer.safe_until``, read before the query). An event is in
        memory at once and in the database a write later; after the keeper reopened the database, the
        events recorded while it was down wait in the writer's queue. Without them an event a reader
        just saw (answered from memory) would vanish until that write."""
        kinds = list(kinds) if kinds else None
        if before_id is not None:
            return list(self._try("events", since=since, kinds=kinds, limit=limit, before_id=before_id) or [])
        w = self.daemon.writer
        stored = w.safe_until if w is not None else None  # before the query, as in ``downsampled``
        rows = self._try("events", since=since, kinds=kinds, limit=limit)
        if rows is None:
            return self._memory_events(since, kinds, limit)
        if stored is None:
            return list(rows)
        seen = {(r["ts"], r["kind"], r["message"]) for r in rows}
        floor = stored if since is None else max(stored, since)
        tail = [e for e in self._memory_events(floor, kinds, limit) if e["ts"] > stored]
        tail = [e for e in tail if (e["ts"], e["kind"], e["message"]) not in seen]
        if not tail:
            return list(rows)
        merged = sorted([*tail, *rows], key=lambda e: e["ts"], reverse=True)
        return merged[:limit]

    def _memory_events(self, since: float | None, kinds: list[str] | None, limit: int) -> list[dict[str, Any]]:
        """The in-memory events (the last 100), newest first, ``id`` None."""
        out = []
        for ev in self.daemon.recent_events:
            if since is not None and ev["ts"] < since:
                continue
            if kinds and ev["kind"] not in kinds:
                continue
            out.append({"id": None, **ev})
            if len(out) >= limit:
                break
        return out

    def launches(self, *, limit: int = 50) -> list[dict[str, Any]]:
        rows = self._try("launches", limit=limit)
        return list(rows) if rows is not None else []

    def downsampled(
        self, *, since: float, until: float, step_s: float, fields: Iterable[str] = CHART_FIELDS
    ) -> list[dict[str, Any]]:
        """``Store.downsampled`` shape (min/avg/max per ``step_s`` bucket), from memory when needed."""
        fields = list(fields)
        # read before the query: what the writer stores while the query runs must not fall between the two
        w = self.daemon.writer
        stored = w.safe_until if w is not None else until
        rows = self._try("downsampled", since=since, until=until, step_s=step_s, fields=fields)
        if rows is not None:
            return self._with_unstored_tail(list(rows), stored, since, until, step_s, fields)
        return self._downsample_memory(since, until, step_s, fields)

    def _with_unstored_tail(
        self, rows: list[dict[str, Any]], stored: float, since: float, until: float, step_s: float, fields: list[str]
    ) -> list[dict[str, Any]]:
        """The database's buckets, with the buckets from the one that holds ``stored`` (the newest sample
        known stored, ``Writer.safe_until``, read before the query) onwards taken from memory: the writer
        gathers samples for up to ``store.WRITE_EVERY_S`` before it writes them, and an answer must not
        end that much early. Kept as the database has them when memory does not reach back that far."""
        if stored >= until:
            return rows
        step_s = max(step_s, 0.001)
        cut_b = max(0, int((stored - since) / step_s))
        if not self.covers(since + cut_b * step_s):
            return rows
        head = [r for r in rows if round((r["ts"] - since) / step_s) < cut_b]
        return head + self._downsample_memory(since, until, step_s, fields, start=since + cut_b * step_s)

    def covers(self, since: float) -> bool:
        """True when the in-memory samples reach back to ``since`` (epoch s)."""
        live = self.daemon.live_samples
        return bool(live) and live[0].ts <= since

    def recent_downsampled(
        self, *, since: float, until: float, step_s: float, fields: Iterable[str] = CHART_FIELDS
    ) -> list[dict[str, Any]] | None:
        """``downsampled`` for a live tail, from memory only: None unless it ``covers(since)`` (then
        ask ``downsampled``, which blocks). Not blocking; samples the writer has not stored yet are
        included; the same buckets as the database's (``since + k·step_s``)."""
        if not self.covers(since):
            return None
        return self._downsample_memory(since, until, step_s, list(fields))

    def _downsample_memory(
        self, since: float, until: float, step_s: float, fields: list[str], *, start: float | None = None
    ) -> list[dict[str, Any]]:
        """Buckets ``since + k·step_s`` of the in-memory samples from ``start`` (default ``since``) to ``until``."""
        step_s = max(step_s, 0.001)
        first = since if start is None else start
        buckets: dict[int, list[Sample]] = {}
        for r in reversed(list(self.daemon.live_samples)):  # newest first: a live tail stops early
            ts = r.ts
            if ts > until:
                continue
            if ts < first:
                break
            buckets.setdefault(int((ts - since) / step_s), []).append(r)
        out = []
        for b in sorted(buckets):
            group = buckets[b]
            group.reverse()  # oldest first, as stored
            d: dict[str, Any] = {"ts": since + b * step_s, "n": len(group)}
            for f in fields:
                vals = [v for g in group if (v := getattr(g, f)) is not None]
                d[f"{f}_min"] = min(vals) if vals else None
                d[f"{f}_avg"] = sum(vals) / len(vals) if vals else None
                d[f"{f}_max"] = max(vals) if vals else None
            out.append(d)
        return out
