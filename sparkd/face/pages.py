"""Pages beside the dashboard, each with its JSON twin: ``/incidents/<id>``, ``/events``, ``/launches``.

All read the store in a worker thread. The incident's container log lines come from its
postmortem bundle and are shown only with the token or a session (bundles hold logs).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse

from sparkd.errors import InvalidInput
from sparkd.face import incidents as inc
from sparkd.face import presenters as views
from sparkd.face.live import CHART_LIVE_FIELDS, MARKER_KINDS, mark_of

if TYPE_CHECKING:
    from sparkd.loop.status import DaemonView

EVENTS_PAGE = 100


def _incident_data(daemon: DaemonView, incident_id: int, reader: bool) -> dict[str, Any]:
    store = daemon.store
    if store is None:
        raise InvalidInput("id", incident_id, "an incident recorded in the database (no database is open)")
    data = inc.incident(store, incident_id, daemon.settings.archives_path, with_logs=reader)
    w = data["window"]
    samples = views.samples_columns(store, w["since"], w["until"], 1.0, list(CHART_LIVE_FIELDS))
    marks = [mark_of(e) for e in store.events(since=w["since"], until=w["until"], kinds=MARKER_KINDS, limit=500)]
    # the text alternative of the chart: MemAvailable and MemFree, one row per 5 s around the trip
    table = [
        {"ts": t, "mem_available": a, "mem_free": f}
        for i, (t, a, f) in enumerate(
            zip(samples["ts"], samples["mem_available_min"], samples["mem_free_min"], strict=False)
        )
        if i % 5 == 0
    ]
    return {**data, "samples": samples, "marks": marks, "table": table}


def install_pages(app: FastAPI, daemon: DaemonView) -> None:
    from sparkd.face.web import _is_reader, render

    async def incident_data(request: Request, incident_id: int) -> dict[str, Any]:
        return await asyncio.to_thread(_incident_data, daemon, incident_id, _is_reader(request))

    @app.get("/incidents/{incident_id}.json", tags=["dashboard"])
    async def incident_json(request: Request, incident_id: int) -> JSONResponse:
        """One stop: summary, timeline, stop steps, /dev/shm decisions, samples around the trip, kernel
        lines, the container's last log lines (token or session only; else null), the bundle's URL."""
        return JSONResponse(await incident_data(request, incident_id))

    @app.get("/incidents/{incident_id}", response_class=HTMLResponse, include_in_schema=False)
    async def incident_page(request: Request, incident_id: int) -> HTMLResponse:
        data = await incident_data(request, incident_id)
        chart = {
            "samples": data["samples"],
            "marks": data["marks"],
            "trip_ts": data["trip_ts"],
            "ts": data["ts"],
            "lines": data["stop_lines"],
        }
        # runs folded as on the dashboard (a near miss every 2.5 s filled 19 of 35 rows: helper-48), oldest first
        rows = list(reversed(views.group_bursts(list(reversed(data["timeline"])))))
        return render(request, "incident.html", i=data, chart_json=json.dumps(chart), timeline_rows=rows)

    def _events(kind: list[str] | None, since: float | None, until: float | None, before: int | None) -> Any:
        if daemon.store is None:
            return [], None
        rows = daemon.store.events(kinds=kind or None, since=since, until=until, before_id=before, limit=EVENTS_PAGE)
        older = rows[-1]["id"] if len(rows) == EVENTS_PAGE else None
        for e in rows:  # a trip row links to the incident of the stop it led to
            if e["kind"] == "trip" and (stop := inc.stop_for(daemon.store, e)) is not None:
                e["incident_id"] = stop["id"]
        return rows, older

    def _kinds(kind: list[str] | None) -> list[str] | None:
        return [k.strip() for v in kind or [] for k in v.split(",") if k.strip()] or None

    @app.get("/events.json", tags=["dashboard"])
    async def events_json(
        kind: Annotated[list[str] | None, Query(description="repeat or comma-separate")] = None,
        since: Annotated[float | None, Query(allow_inf_nan=False, description="epoch s")] = None,
        until: Annotated[float | None, Query(allow_inf_nan=False, description="epoch s")] = None,
        before: Annotated[int | None, Query(ge=1, description="page: ids below this")] = None,
    ) -> dict[str, Any]:
        """Events newest first, bursts of one kind grouped; ``older`` is the next page's ``before``."""
        rows, older = await asyncio.to_thread(_events, _kinds(kind), since, until, before)
        return {"rows": views.group_bursts(rows), "older": older}

    @app.get("/events", response_class=HTMLResponse, include_in_schema=False)
    async def events_page(
        request: Request,
        kind: Annotated[list[str] | None, Query()] = None,
        since: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        until: Annotated[float | None, Query(allow_inf_nan=False)] = None,
        before: Annotated[int | None, Query(ge=1)] = None,
    ) -> HTMLResponse:
        kinds = _kinds(kind)
        rows, older = await asyncio.to_thread(_events, kinds, since, until, before)
        return render(
            request, "events.html", rows=views.group_bursts(rows), older=older, kind=",".join(kinds or []), since=since
        )

    def _launches() -> list[dict[str, Any]]:
        rows = views.launches_view(daemon.store, limit=100)
        stops = inc.incidents(daemon.store, limit=200)
        by_launch = {s["launch_id"]: s for s in stops if s.get("launch_id")}
        for r in rows:
            s = by_launch.get(r.get("id"))
            r["incident_url"] = s["url"] if s else None
            r["ended_by"] = (s.get("rule") or s.get("source")) if s else None
        return rows

    @app.get("/launches.json", tags=["dashboard"])
    async def launches_json() -> dict[str, Any]:
        """Launches newest first: plan vs actual, start-up low point, time to ready, how it ended, incident."""
        return {"launches": await asyncio.to_thread(_launches)}

    @app.get("/launches", response_class=HTMLResponse, include_in_schema=False)
    async def launches_page(request: Request) -> HTMLResponse:
        return render(request, "launches.html", launches=await asyncio.to_thread(_launches))
