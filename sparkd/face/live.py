"""Live updates for one open dashboard: one small request every poll, carrying only what changed.

``GET /ui/live.json`` with what the page already has:

* ``have`` — ``part:hash,part:hash`` of the parts it shows; a part comes back (as HTML, rendered
  by the same partial as the page) only when its data hash differs;
* ``ev`` — the newest event id it shows; only newer events come back (HTML rows, folded into runs
  as the page's rows are, and the chart's marker kinds as JSON); ``event_rows_replace`` is ``ev``
  when the page's top row is a run the new rows go on (the page drops that row), else null;
* ``since`` and ``step`` — the chart's last bucket; only buckets from there on come back
  (the columnar shape of ``/api/samples``).

Always: the headline figures (``level``, ``title``, ``nearest_stop``), the sample's time and the
server's time (the page shows the sample's age from them), ``logged_in`` (the page notices an
expired session). Measured in ``bench/ui.py``.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from sparkd.face import incidents as inc
from sparkd.face import presenters as views
from sparkd.store.store import READ_ERRORS

if TYPE_CHECKING:
    from jinja2 import Environment

    from sparkd.loop.status import DaemonView, Status

LIVE_PARTS = ("headline", "stopped", "summary", "rules", "container", "buttons", "budget")
MARKER_KINDS = ("trip", "stopping", "stopped", "killed", "hard_floor_kill", "launched", "ready", "oom_kill", "resize")


def mark_of(event: dict[str, Any]) -> dict[str, Any]:
    """What a chart mark carries of its event (``dashboard.js``, ``incident.js``): id, ts (UTC epoch s), kind,
    message, and severity, by which a trip that asked for no stop (a warn rule, a demotion, the model already
    down: ``loop.daemon_decide.decide``, severity warning) is drawn thin, not as a stop's thick mark."""
    return {k: event[k] for k in ("id", "ts", "kind", "message", "severity")}


CHART_LIVE_FIELDS = ("mem_available", "mem_free", "cached", "anon_pages", "slab", "mem_available_minus_cma")
CHART_LIVE_COLUMNS = (
    "mem_available_avg",
    "mem_available_min",
    "mem_available_minus_cma_avg",
    "mem_free_avg",
    "cached_avg",
    "anon_pages_avg",
    "slab_avg",
)


def part_hashes(env: Environment, ctx: dict[str, Any]) -> dict[str, str]:
    """Each live part's hash: crc32 of the part as rendered with ``stable`` set, i.e. exactly what it
    shows, less the bits a template marks as ticking in the page anyway (the sample's age). A part is
    re-sent only when what it shows changes; rendering all of them costs ~0.2 ms (``bench/live.py``)."""
    stable = {**ctx, "stable": True}
    return {
        name: format(zlib.crc32(env.get_template(f"partials/_{name}.html").render(stable).encode()), "08x")
        for name in LIVE_PARTS
    }


class LastStop:
    """The newest stop's summary, re-read from the store only after a new event was recorded and written."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon
        self._key: Any = object()
        self._value: dict[str, Any] | None = None

    async def get(self) -> dict[str, Any] | None:
        d = self.daemon
        newest = d.recent_events[0] if d.recent_events else None
        key = id(newest)
        if key != self._key:
            try:
                self._value = await asyncio.to_thread(inc.last_stop, d.store)
            except READ_ERRORS:
                return self._value  # the database cannot answer: the last known stop; the keeper says why

            # a stop event reaches the store through the writer queue: until it is there, ask again
            pending = newest is not None and newest["kind"] in inc.STOP_KINDS
            written = self._value is not None and self._value["ts"] >= newest["ts"] - 1e-6 if newest else True
            self._key = key if (not pending or written) else object()
        return self._value


def live_parts(
    status: Status, last_stop: dict[str, Any] | None, logged_in: bool, grace_s: float | None = None
) -> dict[str, Any]:
    """Data of every live part (pure; ``status`` from ``views.status_view``; ``grace_s``: the stop's SIGTERM grace,
    ``container.stop_timeout_s``, said in the stop and restart confirmations)."""
    raw = status.model_dump(mode="json")  # the headline, stopped card and buttons read its JSON form
    stopped = views.stopped_card(raw, last_stop)
    c = views.container_from_status(status)
    if stopped is not None:  # the stopped card says what its stop did not leave behind
        c["stop_not_kept"] = []
    return {
        "headline": views.headline(raw, stopped),
        "stopped": stopped,
        "summary": views.summary_from_status(status),
        "rules": views.rules_from_status(status),
        "container": c,
        "buttons": {**views.buttons_view(raw, logged_in), "grace_s": grace_s},
        "budget": views.budget_from_status(status),
    }


def page_context(parts: dict[str, Any]) -> dict[str, Any]:
    """The template names of the parts (``headline`` → ``h``)."""
    return {**parts, "h": parts["headline"], "btn": parts["buttons"]}


def install_live(app: FastAPI, daemon: DaemonView) -> None:
    from sparkd.face.web import _auth_ctx, templates

    last = LastStop(daemon)
    app.state.last_stop = last
    seen = EventsSeen(daemon)

    @app.get("/ui/live.json", tags=["dashboard"])
    async def live(
        request: Request,
        have: str = "",
        ev: int | None = Query(default=None, ge=0),
        since: float | None = Query(default=None, allow_inf_nan=False),
        step: float | None = Query(default=None, gt=0, allow_inf_nan=False),
    ) -> JSONResponse:
        """What changed since the page's last update (see ``sparkd.face.live``)."""
        auth = _auth_ctx(request)
        status = views.status_view(daemon)
        parts = live_parts(status, await last.get(), auth["logged_in"], daemon.settings.container.stop_timeout_s)
        known = dict(p.split(":", 1) for p in have.split(",") if ":" in p)
        env = templates().env
        ctx = {**auth, **page_context(parts)}
        hashes = part_hashes(env, ctx)
        out: dict[str, Any] = {"parts": {}, "hashes": hashes}
        for name, h in hashes.items():
            if name in known and known[name] != h:
                out["parts"][name] = env.get_template(f"partials/_{name}.html").render(ctx)
        hl = parts["headline"]
        out.update(
            level=hl["level"],
            label=hl["label"],
            title=title_of(hl),
            nearest_stop=hl["nearest"],
            sample_ts=hl["sample_ts"],
            server_ts=time.time(),
            logged_in=auth["logged_in"],
        )
        if since is not None and step is not None:
            out["samples"] = await _samples_tail(daemon, since, step)
        if ev is not None and not seen.nothing_after(ev):
            asked = seen.key(ev)  # before the read: a write that lands during it must not be marked as seen
            events, rows, replaces = await asyncio.to_thread(views.event_rows_after, daemon.store, ev)
            seen.answered(asked, events)
            if events:
                out["event_rows"] = env.get_template("partials/_event_rows.html").render(events=rows)
                out["event_rows_replace"] = replaces
                out["markers"] = [
                    mark_of(e) for e in events if e["kind"] in MARKER_KINDS or e["kind"].startswith("nvrm")
                ]
                out["last_event_id"] = views.last_event_id(events)
        return JSONResponse(out, headers={"Cache-Control": "no-store"})


class EventsSeen:
    """Skips the database read of "events after id N" when nothing can have arrived since the last
    read for N answered "none": no event recorded in memory since, and the writer stored nothing
    since (an event reaches the database through the writer's batches, after it is in memory)."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon
        self._empty: tuple[int, int, int] | None = None

    def key(self, ev: int) -> tuple[int, int, int]:
        """What a read of "events after ``ev``" depends on, as of now: take it before the read."""
        d = self.daemon
        newest = d.recent_events[0] if d.recent_events else None
        writer = getattr(d, "writer", None)
        return (ev, id(newest), writer.written if writer is not None else -1)

    def nothing_after(self, ev: int) -> bool:
        return self._empty is not None and self._empty == self.key(ev)

    def answered(self, asked: tuple[int, int, int], events: list[dict[str, Any]]) -> None:
        """Record a read's answer under ``asked`` (``key`` taken before the read). An empty answer lets
        the next poll skip the read while the key stays the same; a write that landed during the
        read changed the key already, so the next poll reads again."""
        self._empty = None if events else asked


async def _samples_tail(daemon: DaemonView, since: float, step: float) -> dict[str, Any]:
    """The chart's new buckets from ``since`` on, in the columnar shape of ``/api/samples``, only the
    columns the chart draws (``dashboard.js`` SERIES), whole bytes. From the daemon's memory when it
    reaches back that far (the usual case: ``since`` is the chart's last bucket), else the database."""
    fields = list(CHART_LIVE_FIELDS)
    aligned, now = (since // step) * step, time.time()
    reads = daemon.reads
    rows = reads.recent_downsampled(since=aligned, until=now, step_s=step, fields=fields)
    if rows is None:
        rows = await asyncio.to_thread(reads.downsampled, since=aligned, until=now, step_s=step, fields=fields)
    cols = views.bucket_columns(rows, aligned, now, step, fields)
    return {
        k: ([None if v is None else round(v) for v in cols[k]] if k in CHART_LIVE_COLUMNS else cols[k])
        for k in ("since", "until", "step", "points", "ts", *CHART_LIVE_COLUMNS)
    }


def title_of(h: dict[str, Any]) -> str:
    """The tab title: the level and the distance, so a background tab tells the story."""
    ns = h.get("nearest")
    if h.get("stopped"):
        return "sparkd · STOPPED by the guard"
    if not ns:
        return f"sparkd · {h['label']}"
    gib = ns["headroom_bytes"] / 2**30
    # below the line (a dry run, a demoted rule, a stop under way): "-4.0 GiB to" read as a typo (helper-39)
    if gib < 0:
        return f"sparkd · {h['label']} · {-gib:.1f} GiB below {ns['rule']}"
    return f"sparkd · {h['label']} · {gib:.1f} GiB to {ns['rule']}"
