"""REST API (FastAPI, OpenAPI at /docs) — the read side and the control edge of the daemon.

Runs inside the daemon's event loop (uvicorn ``Server.serve()``), so nothing here
may block it: in-memory state (``status_json``) is read on the loop, SQLite and
directory reads run in worker threads (sync ``def`` endpoints or
``asyncio.to_thread``). Control endpoints hand work to ``daemon.actions``.

Every error has one shape: ``{"error": <code>, "detail": <str | dict>}``
(``sparkd.errors``; validation errors name the field and what is allowed).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.gzip import GZipMiddleware

from sparkd import __version__
from sparkd.act.archive import open_archive
from sparkd.errors import InvalidInput, Refused, SparkdError
from sparkd.face import presenters as views
from sparkd.face.auth import Auth, GuardMiddleware, ensure_token
from sparkd.face.exporter import metrics_response
from sparkd.resources import web_dir
from sparkd.store.store import CHART_FIELDS

if TYPE_CHECKING:
    from sparkd.loop.daemon import Daemon

log = logging.getLogger("sparkd.face.api")

MAX_WINDOW_S = 31 * 86400
MAX_POINTS = 20000
DEFAULT_WINDOW_S = 300.0
_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}


class ResizeRequest(BaseModel):
    """``POST /api/resize``: the budget knobs to change (GiB at this edge). Unset = keep.

    ``dry_run`` defaults to true: nothing changes unless a client asks for it.
    Numbers are strict: ``true`` is not 1, ``"8"`` is not 8, ``4096.5`` is not an
    integer; a JSON integer is fine for a float field (2 → 2.0). NaN and ±Infinity
    (which Python's JSON parser accepts) are refused.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kv_target_gib: float | None = Field(default=None, ge=0, le=1024, strict=True)
    max_model_len: int | None = Field(default=None, ge=1, le=16_777_216, strict=True)
    max_num_seqs: int | None = Field(default=None, ge=1, le=4096, strict=True)
    host_reserve_gib: float | None = Field(default=None, ge=0, le=1024, strict=True)
    kv_cache_dtype: Literal["auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = None
    gmu_override: float | None = Field(default=None, gt=0, le=1, strict=True)
    docker_headroom_gib: float | None = Field(default=None, ge=0, le=1024, strict=True)
    dry_run: bool = True

    def changes(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True, exclude={"dry_run"})


RESIZE_INT_FIELDS = frozenset({"max_model_len", "max_num_seqs"})
RESIZE_FLOAT_FIELDS = frozenset({"kv_target_gib", "host_reserve_gib", "gmu_override", "docker_headroom_gib"})


def form_to_resize(form: dict[str, str]) -> dict[str, Any]:
    """Dashboard form strings → ``ResizeRequest`` input (the model is strict; forms only have strings).

    A number that does not parse stays a string, so the model names the field.
    """
    data: dict[str, Any] = {k: v.strip() for k, v in form.items() if k != "csrf_token" and v.strip() != ""}
    for k, v in data.items():
        try:
            if k in RESIZE_INT_FIELDS:
                data[k] = int(v)
            elif k in RESIZE_FLOAT_FIELDS:
                data[k] = float(v)
        except ValueError:
            pass
    if "dry_run" in data:
        data["dry_run"] = data["dry_run"].lower() in ("1", "true", "yes", "on")
    return data


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float as a string (``nan``, ``inf``, ``-inf``): always serializes."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def require_finite(field: str, value: float | None) -> None:
    """Query parameters: refuse NaN and ±Infinity (``since=nan``, ``1e999``) naming the field.

    Raises:
        InvalidInput: ``value`` is not finite.
    """
    if value is not None and not math.isfinite(value):
        raise InvalidInput(field, value, "a finite number")


def _field_of(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header", "cookie")]
    return ".".join(parts) or "body"


_NOT_AN_OBJECT = frozenset({"model_attributes_type", "model_type", "dict_type", "missing"})


def _validation_detail(exc: RequestValidationError) -> dict[str, Any]:
    errors = []
    for e in exc.errors():
        loc = tuple(e.get("loc", ()))
        fld = _field_of(loc)
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        etype = e.get("type")
        if etype == "json_invalid" or (loc == ("body",) and etype in _NOT_AN_OBJECT):
            fld = "body"
            why = (e.get("ctx") or {}).get("error") if etype == "json_invalid" else None
            msg = "the request body must be a JSON object" + (f" (not valid JSON: {why})" if why else "")
            errors.append({"field": fld, "message": f"{fld}: {msg}", "location": "body"})
            continue
        if etype == "finite_number":
            msg = "a finite number is required (not NaN or Infinity)"
        elif isinstance(e.get("input"), bool) and etype in ("int_type", "float_type"):
            msg = f"{msg}, not true/false"
        item = {"field": fld, "message": f"{fld}: {msg}", "location": (e.get("loc") or ["?"])[0]}
        value = e.get("input")
        if e.get("type") != "missing" and isinstance(value, str | int | float | bool):
            item["value"] = value if not isinstance(value, str) else value[:200]
        errors.append(item)
    first = errors[0] if errors else {"field": "body", "message": "invalid request"}
    return {"field": first["field"], "message": first["message"], "errors": errors}


def wants_html(request: Request) -> bool:
    path = request.url.path
    if path.startswith(("/api/", "/metrics", "/healthz", "/docs", "/openapi")) or path.endswith(".json"):
        return False
    return bool(request.headers.get("hx-request")) or "text/html" in request.headers.get("accept", "")


def install_error_handlers(app: FastAPI) -> None:
    def _reply(request: Request, status: int, body: dict[str, Any]) -> Response:
        body = jsonable(body)  # an error body must always serialize (NaN in a detail, say)
        if wants_html(request):
            from sparkd.face.web import error_page

            return error_page(request, status, body)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(SparkdError)
    async def _sparkd(request: Request, exc: SparkdError) -> Response:
        return _reply(request, exc.status_code, exc.to_json())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _reply(request, 422, {"error": "invalid_input", "detail": _validation_detail(exc)})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        detail = exc.detail
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no such path: {request.url.path}"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}"
        resp = _reply(request, exc.status_code, {"error": code, "detail": detail})
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse({"error": "internal_error", "detail": type(exc).__name__}, status_code=500)


class StatusCache:
    """``/api/status`` body, rebuilt when the guard took a new sample or after ``max_age_s``.

    Status changes on a tick (or, for the container, asynchronously — hence the age
    limit); 50 dashboards polling must not each re-serialise the same state.
    Call on the event loop only (``status_json`` reads loop-owned state).
    """

    def __init__(self, daemon: Daemon, max_age_s: float = 0.1) -> None:
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
            self._body = json.dumps(views.status_view(d), separators=(",", ":")).encode()
            self._key, self._at = key, now
        return self._body


async def require_auth(request: Request) -> str:
    """Dependency of every mutating endpoint: bearer token, or session cookie + CSRF token.

    Returns ``"token"`` or ``"session"``. Raises ``Unauthorized`` (401) / ``Forbidden`` (403).
    """
    auth: Auth = request.app.state.auth
    form_csrf = None
    if request.headers.get("content-type", "").startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
        form = await request.form()
        v = form.get("csrf_token")
        form_csrf = v if isinstance(v, str) else None
    return auth.authorize(request.headers, dict(request.cookies), form_csrf)


async def require_reader(request: Request) -> str:
    """Dependency of reads that expose secrets (postmortem bundles): bearer token or session cookie.

    No CSRF token: a GET changes nothing. Raises ``Unauthorized`` (401).
    """
    auth: Auth = request.app.state.auth
    return auth.authorize_read(request.headers, request.cookies)


Who = Annotated[str, Depends(require_auth)]
Reader = Annotated[str, Depends(require_reader)]


def create_app(daemon: Daemon) -> FastAPI:
    """The ASGI app: JSON API, dashboard (``sparkd.face.web``), ``/metrics``, ``/healthz``.

    Creates the API token file on first use (``settings.token_file``, mode 0600).

    Raises:
        ConfigError: the token file cannot be created or read.
    """
    settings = daemon.settings
    auth = Auth(ensure_token(settings.token_file))
    app = FastAPI(
        title="sparkd",
        version=__version__,
        description="Memory guard for vLLM on DGX Spark: status, samples, events, container control.",
    )
    app.state.daemon = daemon
    app.state.auth = auth
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, allowed_hosts=settings.api.allowed_hosts)
    # outermost: compresses pages, JSON and static files over 500 bytes (the dashboard's live
    # updates included); bundles (application/gzip) and event streams are left alone by default
    app.add_middleware(GZipMiddleware, minimum_size=500)
    app.mount("/static", StaticFiles(directory=web_dir() / "static"), name="static")

    app.state.require_auth = require_auth
    status_cache = StatusCache(daemon)

    # ------------------------------------------------------------------ read side
    @app.get("/healthz", tags=["health"])
    async def healthz() -> JSONResponse:
        """200 when the guard loop sampled recently, 503 otherwise."""
        h = views.health(daemon)
        return JSONResponse(h, status_code=200 if h["ok"] else 503)

    @app.get("/api/status", tags=["read"], response_class=JSONResponse)
    async def status() -> Response:
        """``Daemon.status_json()`` (sizes in bytes) plus ``plan`` (the current budget plan or null)."""
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
        if daemon.store is None:
            aligned = (s // st) * st
            return {"since": aligned, "until": u, "step": st, "fields": flds, "points": 0, "ts": [], "n": []}
        return views.samples_columns(daemon.store, s, u, st, flds)

    @app.get("/api/events", tags=["read"])
    def events(
        since: Annotated[float | None, Query(description="epoch s")] = None,
        kind: Annotated[list[str] | None, Query(description="repeat or comma-separate")] = None,
        limit: Annotated[int, Query(ge=1, le=5000)] = 100,
    ) -> dict[str, Any]:
        """Events, newest first."""
        require_finite("since", since)
        kinds = [k.strip() for v in kind or [] for k in v.split(",") if k.strip()] or None
        rows = daemon.store.events(since=since, kinds=kinds, limit=limit) if daemon.store else []
        return {"events": rows}

    @app.get("/api/launches", tags=["read"])
    def launches() -> dict[str, Any]:
        """Launches, newest first: the plan's estimate beside vLLM's reported figures."""
        return {"launches": views.launches_view(daemon.store, limit=50)}

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
        return await metrics_response(app, daemon)

    # ------------------------------------------------------------------ control
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

    async def resize(req: ResizeRequest, source: str) -> dict[str, Any]:
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
        result: dict[str, Any] = await fn(changes, dry_run=req.dry_run, source=source)
        return result

    app.state.control = control
    app.state.resize = resize

    @app.post("/api/resize", tags=["control"])
    async def api_resize(req: ResizeRequest, who: Who) -> dict[str, Any]:
        """Re-plan the budget: ``dry_run`` (default true) returns the plan and diff without applying."""
        return await resize(req, f"api:{who}")

    from sparkd.face.live import install_live
    from sparkd.face.pages import install_pages
    from sparkd.face.web import install_web

    install_live(app, daemon)
    install_pages(app, daemon)
    install_web(app, daemon, auth)
    return app
