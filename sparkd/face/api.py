"""REST API routes (FastAPI, OpenAPI at /docs) — the read side and the control edge of the daemon.

``sparkd.face.app.create_app`` composes the app; this module adds the JSON routes in
two groups: ``install_read_routes`` (health, status, samples, events, launches,
archives, metrics) and ``install_control_routes`` (container start/stop/restart,
resize). Response bodies are typed where the daemon's contract is
(``sparkd.loop.status.Status`` for ``/api/status``, ``ResizeResult`` for ``/api/resize``).

Runs inside the daemon's event loop (uvicorn ``Server.serve()``), so nothing here
may block it: in-memory state (``status_json``) is read on the loop, SQLite and
directory reads run in worker threads (sync ``def`` endpoints or
``asyncio.to_thread``). Control endpoints hand work to ``daemon.actions``.

Every error has one shape (``sparkd.face.replies``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sparkd.act.archive import open_archive
from sparkd.errors import InvalidInput, Refused
from sparkd.face import presenters as views
from sparkd.face.auth import CLIENT_HEADER, Auth
from sparkd.face.schemas import ResizeRequest, require_finite
from sparkd.loop.status import ResizeResult, Status
from sparkd.store.store import CHART_FIELDS

if TYPE_CHECKING:
    from sparkd.loop.status import DaemonView

MAX_WINDOW_S = 31 * 86400
MAX_POINTS = 20000
DEFAULT_WINDOW_S = 300.0

Control = Callable[..., Awaitable[dict[str, Any]]]
Resize = Callable[[ResizeRequest, str], Awaitable[ResizeResult]]


class StatusCache:
    """``/api/status`` body, rebuilt when the guard took a new sample or after ``max_age_s``.

    Status changes on a tick (or, for the container, asynchronously — hence the age
    limit); 50 dashboards polling must not each re-serialise the same state.
    Call on the event loop only (``status_json`` reads loop-owned state).
    """

    def __init__(self, daemon: DaemonView, max_age_s: float = 0.1) -> None:
        self.daemon = daemon
        self.max_age_s = max_age_s
        self._key: tuple[Any, ...] | None = None
        self._at = 0.0
        self._body = b""

    def body(self) -> bytes:
        d = self.daemon
        key = (d.samples_taken, len(d.recent_events), id(d.recent_events[0]) if d.recent_events else None)
        now = time.monotonic()
        if key != self._key or now - self._at > self.max_age_s:
            self._body = views.status_view(d).model_dump_json().encode()
            self._key, self._at = key, now
        return self._body


async def require_auth(request: Request) -> str:
    """Dependency of every mutating endpoint: bearer token, or session cookie + CSRF token.

    Returns ``"token"``, ``"cli"`` (the token, sent by sparkd's own CLI: ``CLIENT_HEADER: cli``; events and
    archives then say ``api:cli``, not ``api:token``) or ``"session"``. Raises ``Unauthorized`` (401) /
    ``Forbidden`` (403).
    """
    auth: Auth = request.app.state.auth
    form_csrf = None
    if request.headers.get("content-type", "").startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
        form = await request.form()
        v = form.get("csrf_token")
        form_csrf = v if isinstance(v, str) else None
    who = auth.authorize(request.headers, dict(request.cookies), form_csrf)
    # a label only (it grants nothing: the token was checked), and only this value: no caller's text in names
    return "cli" if who == "token" and request.headers.get(CLIENT_HEADER) == "cli" else who


async def require_reader(request: Request) -> str:
    """Dependency of reads that expose secrets (postmortem bundles): bearer token or session cookie.

    No CSRF token: a GET changes nothing. Raises ``Unauthorized`` (401).
    """
    auth: Auth = request.app.state.auth
    return auth.authorize_read(request.headers, request.cookies)


Who = Annotated[str, Depends(require_auth)]
Reader = Annotated[str, Depends(require_reader)]


def samples_query(
    daemon: DaemonView, since: float | None, until: float | None, step: float | None, fields: str | None
) -> dict[str, Any]:
    """``GET /api/samples``: min/avg/max per bucket, columnar. Blocking (SQLite): a worker thread.

    Raises:
        InvalidInput: a non-finite number, ``since`` ≥ ``until``, a window over 31 days,
            more than 20,000 points, or an unknown field (the message names it).
    """
    for name, value in (("since", since), ("until", until), ("step", step)):
        require_finite(name, value)
    u = time.time() if until is None else until
    s = u - DEFAULT_WINDOW_S if since is None else since
    if s >= u:
        raise InvalidInput("since", s, f"a time before until ({u})")
    if u - s > MAX_WINDOW_S:
        raise InvalidInput("since", s, f"a window of at most 31 days (until − since ≤ {MAX_WINDOW_S} s)")
    st = views.pick_step(u - s) if step is None else step
    if (u - s) / st > MAX_POINTS:
        raise InvalidInput("step", st, f"≥ {(u - s) / MAX_POINTS:g} s for this window (≤ {MAX_POINTS} points)")
    flds = list(CHART_FIELDS)
    if fields:
        flds = [f.strip() for f in fields.split(",") if f.strip()]
        bad = [f for f in flds if f not in CHART_FIELDS]
        if bad or not flds:
            raise InvalidInput("fields", fields, ", ".join(CHART_FIELDS))
    aligned = (s // st) * st  # buckets on a fixed grid, so incremental fetches line up
    rows = daemon.reads.downsampled(since=aligned, until=u, step_s=st, fields=flds)
    out: dict[str, Any] = {"since": aligned, "until": u, "step": st, "fields": flds, "points": len(rows)}
    note = daemon.reads.note()
    if note:  # the database cannot answer: the live in-memory view, said
        out["source"], out["message"] = "memory", note
    out["ts"] = [r["ts"] for r in rows]
    out["n"] = [r["n"] for r in rows]
    for f in flds:
        for agg in ("min", "avg", "max"):
            key = f"{f}_{agg}"
            out[key] = [r.get(key) for r in rows]
    return out


def install_read_routes(app: FastAPI, daemon: DaemonView) -> None:
    """Health, ``/api/status`` (cached, typed), samples, events, launches, archives and ``/metrics``."""
    settings = daemon.settings
    status_cache = StatusCache(daemon)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> JSONResponse:
        """200 when the guard loop sampled recently, 503 otherwise."""
        h = views.health(daemon)
        return JSONResponse(h, status_code=200 if h["ok"] else 503)

    @app.get("/api/status", tags=["read"], response_model=Status)
    async def status() -> Response:
        """Everything the daemon knows now (``sparkd.loop.status.Status``; sizes in bytes), with ``plan``
        (the budget plan the container runs with, or null)."""
        return Response(status_cache.body(), media_type="application/json")

    @app.get("/api/samples", tags=["read"])
    def samples(
        since: Annotated[float | None, Query(description="epoch s; default until − 300")] = None,
        until: Annotated[float | None, Query(description="epoch s; default now")] = None,
        step: Annotated[
            float | None, Query(gt=0, allow_inf_nan=False, description="bucket width s; default ≤ 2000 points")
        ] = None,
        fields: Annotated[str | None, Query(description="comma list; default all chart fields")] = None,
    ) -> dict[str, Any]:
        """min/avg/max per bucket, columnar (uPlot-ready): ``ts`` and ``<field>_<min|avg|max>`` arrays."""
        return samples_query(daemon, since, until, step, fields)

    @app.get("/api/events", tags=["read"])
    def events(
        since: Annotated[float | None, Query(description="epoch s")] = None,
        kind: Annotated[list[str] | None, Query(description="repeat or comma-separate")] = None,
        limit: Annotated[int, Query(ge=1, le=5000)] = 100,
    ) -> dict[str, Any]:
        """Events, newest first."""
        require_finite("since", since)
        kinds = [k.strip() for v in kind or [] for k in v.split(",") if k.strip()] or None
        rows = daemon.reads.events(since=since, kinds=kinds, limit=limit)
        note = daemon.reads.note()
        if note:
            return {"events": rows, "source": "memory", "message": note}
        return {"events": rows}

    @app.get("/api/launches", tags=["read"])
    def launches() -> dict[str, Any]:
        """Launches, newest first: the plan's estimate beside vLLM's reported figures."""
        return {"launches": views.launches_view(daemon.reads, limit=50)}

    @app.get("/api/archives", tags=["read"])
    def archives(who: Reader) -> JSONResponse:
        """Postmortem bundles in the archive directory, newest first. Needs the token or a session."""
        body = {"archives": views.archives_view(settings.archives_path)}
        return JSONResponse(body, headers={"Cache-Control": "private, no-store"})

    @app.get("/api/archives/{name:path}", tags=["read"], response_class=StreamingResponse)
    def archive_download(name: str, who: Reader) -> StreamingResponse:
        """Download one bundle (container logs, configuration: needs the token or a session).

        Only plain ``*.tar.gz`` names directly in the archive directory.
        """
        f = open_archive(settings.archives_path, name)

        def chunks() -> Iterator[bytes]:
            with f:
                while block := f.read(1 << 16):
                    yield block

        return StreamingResponse(
            chunks(),
            media_type="application/gzip",
            headers={"Content-Disposition": f'attachment; filename="{name}"', "Cache-Control": "private, no-store"},
        )

    @app.get("/metrics", tags=["health"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus text exposition (memory, PSI, rule counters, trips, container, ticks)."""
        # prometheus_client (~1 MiB resident) is imported at the first scrape, not by a daemon never scraped
        from sparkd.face.exporter import metrics_response

        return await metrics_response(app, daemon)


def make_control(daemon: DaemonView) -> Control:
    """``control(action, source, force=False)``: hand start/stop/restart to the supervisor.

    Raises:
        Refused: monitor-only (no container configured).
    """

    async def control(
        action: Literal["start", "stop", "restart"], source: str, *, force: bool = False
    ) -> dict[str, Any]:
        fn = getattr(daemon.actions, "request", None)
        if fn is None:
            raise Refused(
                "monitor-only: no container configured",
                detail=f"monitor-only: {getattr(daemon.actions, 'why', 'no container configured')}",
            )
        result: dict[str, Any] = await (fn(action, source=source, force=True) if force else fn(action, source=source))
        return result

    return control


def make_resize(daemon: DaemonView) -> Resize:
    """``resize(request, source)``: re-plan (dry run) or apply through the supervisor.

    Raises:
        Refused: monitor-only. InvalidInput: no knob given (names the allowed ones).
    """

    async def resize(req: ResizeRequest, source: str) -> ResizeResult:
        fn = getattr(daemon.actions, "resize", None)
        if fn is None:
            raise Refused(
                "monitor-only: no container configured",
                detail="monitor-only: no container configured — there is no plan to resize",
            )
        changes = req.changes()
        if not changes:
            knobs = sorted(ResizeRequest.model_fields.keys() - {"dry_run"})
            raise InvalidInput("body", {}, "at least one of " + ", ".join(knobs))
        result: ResizeResult = await fn(changes, dry_run=req.dry_run, source=source)
        return result

    return resize


def install_control_routes(app: FastAPI, control: Control, resize: Resize) -> None:
    """``POST /api/container/{start,stop,restart}`` and ``POST /api/resize`` (token or session + CSRF)."""

    @app.post("/api/container/start", tags=["control"])
    async def container_start(who: Who, force: bool = False) -> dict[str, Any]:
        """Launch (preflight first). ``force=true`` launches despite a failed preflight; that is recorded."""
        return await control("start", f"api:{who}", force=force)

    @app.post("/api/container/stop", tags=["control"])
    async def container_stop(who: Who) -> dict[str, Any]:
        return await control("stop", f"api:{who}")

    @app.post("/api/container/restart", tags=["control"])
    async def container_restart(who: Who, force: bool = False) -> dict[str, Any]:
        return await control("restart", f"api:{who}", force=force)

    @app.post("/api/resize", tags=["control"], response_model=ResizeResult)
    async def api_resize(req: ResizeRequest, who: Who) -> ResizeResult:
        """Re-plan the budget: ``dry_run`` (default true) returns the plan and diff without applying."""
        return await resize(req, f"api:{who}")


def install_supervision_routes(app: FastAPI, daemon: DaemonView) -> None:
    """``POST /api/breaker/rearm`` and ``POST /api/maintenance/run`` (token or session + CSRF).

    Raises (as HTTP errors):
        Refused: monitor-only, or (maintenance) the container is not sparkd's or not running.
        Conflict: another action is running.
    """

    def unattended() -> Any:
        u = getattr(daemon.actions, "unattended", None)
        if u is None:
            raise Refused(f"monitor-only: {getattr(daemon.actions, 'why', 'no container configured')}")
        return u

    async def rearm_as(who: str) -> dict[str, Any]:
        result: dict[str, Any] = await unattended().rearm(who)
        return result

    app.state.rearm = rearm_as

    @app.post("/api/breaker/rearm", tags=["control"])
    async def breaker_rearm(who: Who) -> dict[str, Any]:
        """Close the circuit breaker, recording who and when; relaunches a model that an emergency took down."""
        result: dict[str, Any] = await unattended().rearm(f"api:{who}")
        return result

    @app.post("/api/maintenance/run", tags=["control"])
    async def maintenance_run(who: Who) -> dict[str, Any]:
        """Drain, stop, start the same plan, smoke test; the maintenance intent is released only on pass."""
        result: dict[str, Any] = await unattended().maintenance_run(f"api:{who}")
        return result
