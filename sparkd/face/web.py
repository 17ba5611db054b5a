"""Dashboard HTML routes (Jinja2 + htmx), each view with a JSON twin.

* ``GET /`` — the page; ``GET /dashboard.json`` — the same data as JSON.
* ``GET /ui/<part>`` — one live part alone (htmx polls it, ``hx-swap=outerHTML``);
  ``GET /ui/<part>.json`` — its JSON twin. Both come from the same data function
  in ``sparkd.face.presenters``; the page renders every part inline (healthchecks' pattern),
  so it reads fine with JavaScript off.
* ``GET|POST /login`` — trade the token for a session cookie; ``POST /logout``.
* ``POST /ui/container/<action>``, ``POST /ui/resize`` — control fragments
  (cookie + CSRF, or bearer token).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from pydantic import ValidationError

from sparkd import __version__
from sparkd.core.consumers import OUTSIDE_RSS_KEY
from sparkd.core.rules import ETA_SAID_S
from sparkd.errors import SparkdError
from sparkd.face import presenters as views
from sparkd.face.auth import SESSION_COOKIE, SESSION_MAX_AGE_S, Auth
from sparkd.face.replies import validation_detail
from sparkd.face.schemas import ResizeRequest, form_to_resize
from sparkd.resources import web_dir
from sparkd.units import GiB

if TYPE_CHECKING:
    from fastapi.templating import Jinja2Templates

    from sparkd.loop.status import DaemonView

log = logging.getLogger("sparkd.face.web")

STATUS_PARTS = ("summary", "rules", "container", "budget")
STORE_PARTS = ("events", "launches", "archives")
PARTS = STATUS_PARTS + STORE_PARTS
PLAN_ROWS = (
    ("gmu", "--gpu-memory-utilization", "{:.3f}"),
    ("budget_gib", "vLLM budget (GiB)", "{:.2f}"),
    ("kv_exp_gib", "KV cache expected (GiB)", "{:.2f}"),
    ("kv_need_gib", "KV for one max-length request (GiB)", "{:.2f}"),
    ("max_len_concurrency", "max-length requests that fit", "{:.2f}"),
    ("cap_gib", "host cap (GiB)", "{:.2f}"),
    ("docker_memory_gib", "docker --memory (GiB)", "{:.2f}"),
    ("squeezed", "KV target squeezed by the cap", "{}"),
)


def _fmt_gib(v: Any, digits: int = 2) -> str:
    return "–" if v is None else f"{v / GiB:.{digits}f} GiB"


def _fmt_num(v: Any, fmt: str = "{:.2f}") -> str:
    if v is None:
        return "–"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def _fmt_value(v: Any) -> str:
    """A diff value for people: floats to 3 decimals at most, everything else as is."""
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    return "–" if v is None else str(v)


def _fmt_time(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "–"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%S")


def _fmt_datetime(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "–"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt_duration(s: Any) -> str:
    if not isinstance(s, int | float):
        return "–"
    if s < 10:  # "0 s" for a 0.9 s start-up; a whole figure stays "5 s"
        return f"{round(s, 1):g} s"
    s = int(s)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 172800:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def _fmt_size(n: Any) -> str:
    if not isinstance(n, int | float):
        return "–"
    for unit, div in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


_SIZE_KEYS = frozenset({"MemAvailable", "MemFree", "Cached", "AnonPages", "Slab", "MemAvailable-CmaFree"})


#: Parts of a mapping recorded at a trip said in words (``fall_shares_bytes``' part outside every RSS).
_PART_LABELS = {OUTSIDE_RSS_KEY: "outside any process's RSS (GPU/driver, kernel, page cache)"}


def _fmt_tripval(v: Any, key: str = "") -> str:
    """A value recorded at a trip, by its key: sizes in GiB, slopes in GiB/s, times in s, epoch
    timestamps (``*_ts``) as UTC times, and a mapping of sizes (``fall_shares_bytes``) as
    ``part size · part size``."""
    if isinstance(v, dict):
        return " · ".join(f"{_PART_LABELS.get(k, k)} {_fmt_tripval(x, key)}" for k, x in v.items()) or "–"
    if not isinstance(v, int | float) or isinstance(v, bool):
        return "n/a" if v is None else str(v)
    if key.endswith("_ts"):
        return _fmt_datetime(v)
    if key.endswith("_bytes_per_s"):
        return f"{v / GiB:+.2f} GiB/s"
    if key == "eta_s" and v < ETA_SAID_S:  # "-0.2 s" beside the reason's "at or below the floor already"
        return "at or below the floor already"
    if key.endswith("_s"):
        return f"{v:.1f} s"
    if key in _SIZE_KEYS or key.endswith("_bytes") or abs(v) >= 2**20:
        return f"{v / GiB:.2f} GiB"
    return _fmt_value(v)


_TRIP_LABELS = {
    "sample_ts": "sample taken",
    "fall_shares_bytes": "who grew (since the fall began)",
    # a predictive rule's projection (core.rules)
    "slope_bytes_per_s": "fall rate (robust fit)",
    "eta_s": "projected time to the floor",
    "fit_window_s": "fit window",
}


def _trip_label(key: str) -> str:
    """The row label of a value recorded at a trip (the stopped card, the incident page)."""
    return _TRIP_LABELS.get(key) or f"{key} at the trip"


def _breakable(name: Any) -> Any:
    """An event kind, escaped, that a narrow column may break after each underscore (``<wbr>``): the kind column
    cut ``config_changed_not_applied`` to ``config_changed_not_…`` (note 21)."""
    from markupsafe import Markup, escape

    return Markup("_<wbr>").join(escape(part) for part in str(name).split("_"))


def make_templates() -> Jinja2Templates:
    """The dashboard's templates. Jinja2 (~1.6 MiB resident) is imported at the first page, not by a daemon
    whose dashboard nobody opens (issue 18)."""
    from fastapi.templating import Jinja2Templates

    t = Jinja2Templates(directory=str(web_dir() / "templates"))
    t.env.filters.update(
        gib=_fmt_gib,
        num=_fmt_num,
        val=_fmt_value,
        time=_fmt_time,
        datetime=_fmt_datetime,
        duration=_fmt_duration,
        size=_fmt_size,
        tripval=_fmt_tripval,
        triplabel=_trip_label,
        breakable=_breakable,
    )
    t.env.globals.update(version=__version__, plan_rows=PLAN_ROWS)
    return t


_templates: Jinja2Templates | None = None


def templates() -> Jinja2Templates:
    global _templates
    if _templates is None:
        _templates = make_templates()
    return _templates


def _auth_ctx(request: Request) -> dict[str, Any]:
    auth: Auth | None = getattr(request.app.state, "auth", None)
    sid = auth.session_id(request.cookies.get(SESSION_COOKIE)) if auth else None
    return {"logged_in": sid is not None, "csrf": auth.csrf_for(sid) if auth and sid else ""}


def render(request: Request, name: str, status_code: int = 200, **ctx: Any) -> HTMLResponse:
    return templates().TemplateResponse(
        request, name, {**_auth_ctx(request), "request": request, **ctx}, status_code=status_code
    )


def error_page(request: Request, status: int, body: dict[str, Any]) -> Response:
    """Errors for browsers: a fragment for htmx, a small page otherwise (same shape inside)."""
    detail = body.get("detail")
    message = detail.get("message", json.dumps(detail)) if isinstance(detail, dict) else str(detail)
    name = "partials/_message.html" if request.headers.get("hx-request") else "error.html"
    return render(request, name, status, level="critical", title=body.get("error"), message=message, body=body)


def _status_parts(daemon: DaemonView) -> dict[str, Any]:
    status = views.status_view(daemon)
    return {
        "summary": views.summary_from_status(status),
        "rules": views.rules_from_status(status),
        "container": views.container_from_status(status),
        "budget": views.budget_from_status(status),
        "chart": views.chart_config(status, daemon.settings.interval_s),
    }


def _store_parts(daemon: DaemonView, names: tuple[str, ...], reader: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "events" in names:
        out["events"] = views.events_view(daemon.reads, limit=30)
    if "launches" in names:
        out["launches"] = views.launches_view(daemon.reads, limit=10)
    if "archives" in names:
        # bundles hold container logs and configuration: listed for the token or a session only
        out["archives"] = views.archives_view(daemon.settings.archives_path) if reader else None
    return out


async def view_data(daemon: DaemonView, names: tuple[str, ...], *, reader: bool = False) -> dict[str, Any]:
    """Data of the named parts: status parts on the loop, store parts in a worker thread.

    ``reader``: the request carries the token or a session; without it ``archives`` is None.
    """
    data: dict[str, Any] = {}
    if any(n in STATUS_PARTS or n == "chart" for n in names):
        data.update({k: v for k, v in _status_parts(daemon).items() if k in names})
    store_names = tuple(n for n in names if n in STORE_PARTS)
    if store_names:
        data.update(await asyncio.to_thread(_store_parts, daemon, store_names, reader))
    return data


def _is_reader(request: Request) -> bool:
    auth: Auth | None = getattr(request.app.state, "auth", None)
    return auth is not None and auth.reader(request.headers, request.cookies) is not None


def install_web(app: FastAPI, daemon: DaemonView, auth: Auth) -> None:
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index(request: Request) -> HTMLResponse:
        from sparkd.face.live import live_parts, page_context, part_hashes, title_of

        data = await view_data(daemon, (*PARTS, "chart"), reader=_is_reader(request))
        status = views.status_view(daemon)
        auth_ctx = _auth_ctx(request)
        parts = live_parts(
            status, await app.state.last_stop.get(), auth_ctx["logged_in"], daemon.settings.container.stop_timeout_s
        )
        shown = part_hashes(templates().env, {**auth_ctx, **page_context(parts)})
        hashes = ",".join(f"{k}:{v}" for k, v in shown.items())
        last_id = views.last_event_id(data["events"])
        return render(
            request,
            "index.html",
            **{**data, **page_context(parts)},
            title=title_of(parts["headline"]),
            have=hashes,
            last_event_id=last_id,
            chart_json=json.dumps(data["chart"]),
        )

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> RedirectResponse:
        return RedirectResponse("/static/favicon.svg", status_code=308)

    @app.get("/dashboard.json", tags=["dashboard"])
    async def index_json(request: Request) -> dict[str, Any]:
        """The whole dashboard's data (the JSON twin of ``/``); ``archives`` is null without the token or a session."""
        return await view_data(daemon, (*PARTS, "chart"), reader=_is_reader(request))

    @app.get("/ui/{name}.json", tags=["dashboard"])
    async def part_json(request: Request, name: Literal[PARTS]) -> JSONResponse:  # type: ignore[valid-type]
        """One dashboard part's data (the JSON twin of ``/ui/<name>``); ``archives`` needs the token or a session."""
        data = await view_data(daemon, (name,), reader=_is_reader(request))
        return JSONResponse({name: data[name]})

    @app.get("/ui/{name}", response_class=HTMLResponse, tags=["dashboard"])
    async def part_html(request: Request, name: Literal[PARTS]) -> HTMLResponse:  # type: ignore[valid-type]
        """One dashboard part alone (what htmx polls)."""
        data = await view_data(daemon, (name,), reader=_is_reader(request))
        return render(request, f"partials/_{name}.html", **data)

    # ------------------------------------------------------------------ login
    def _login_response(request: Request) -> RedirectResponse:
        resp = RedirectResponse("/", status_code=303)
        resp.set_cookie(
            SESSION_COOKIE,
            auth.new_session(),
            max_age=SESSION_MAX_AGE_S,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )
        resp.headers["Cache-Control"] = "no-store"
        return resp

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    async def login_page(request: Request) -> Response:
        if "token" in request.query_params:  # never from the URL: it ends up in history and logs
            return render(
                request,
                "login.html",
                400,
                error="The token is not taken from the address (it would stay in history and logs): "
                "paste it into the form, or send 'Authorization: Bearer <token>'.",
            )
        return render(request, "login.html")

    @app.post("/login", response_class=HTMLResponse, include_in_schema=False)
    async def login_post(request: Request) -> Response:
        client = request.client.host if request.client else "?"
        wait = auth.logins.retry_after(client)
        if wait is not None:
            resp = render(request, "login.html", 429, error=f"Too many failed logins: try again in {wait:.0f} s.")
            resp.headers["Retry-After"] = str(max(1, round(wait)))
            return resp
        form = await request.form()
        token = form.get("token")
        if isinstance(token, str) and auth.check_token(token.strip()):
            auth.logins.succeeded(client)
            daemon.event("login", f"dashboard login from {client}", details={"client": client})
            return _login_response(request)
        wait = auth.logins.failed(client)
        n = auth.logins.failures(client)
        log.warning("failed login from %s (%d in a row%s)", client, n, f"; next try in {wait:.0f} s" if wait else "")
        return render(request, "login.html", 401, error="That token is not valid.")

    @app.post("/logout", include_in_schema=False)
    async def logout(request: Request) -> RedirectResponse:
        auth.end_session(request.cookies.get(SESSION_COOKIE))  # the cookie is worthless from now on
        resp = RedirectResponse("/", status_code=303)
        resp.delete_cookie(SESSION_COOKIE, path="/")
        return resp

    # ------------------------------------------------------------------ controls
    def _fragment(request: Request, name: str, status_code: int = 200, **ctx: Any) -> HTMLResponse:
        if request.headers.get("hx-request"):
            return render(request, name, status_code, **ctx)
        return render(request, "standalone.html", status_code, fragment=name, **ctx)

    def _error_fragment(request: Request, e: SparkdError) -> HTMLResponse:
        d = e.to_json()["detail"]
        msg = d.get("message", str(d)) if isinstance(d, dict) else str(d)
        return _fragment(request, "partials/_message.html", e.status_code, level="critical", title=e.code, message=msg)

    @app.post("/ui/container/{action}", response_class=HTMLResponse, include_in_schema=False)
    async def ui_control(request: Request, action: Literal["start", "stop", "restart"]) -> HTMLResponse:
        who = await app.state.require_auth(request)
        try:
            result = await app.state.control(action, f"web:{who}")
        except SparkdError as e:
            return _error_fragment(request, e)
        text = result.get("message") or f"{action} requested"
        return _fragment(request, "partials/_message.html", level="ok", title=action, message=text, result=result)

    @app.post("/ui/breaker/rearm", response_class=HTMLResponse, include_in_schema=False)
    async def ui_rearm(request: Request) -> HTMLResponse:
        who = await app.state.require_auth(request)
        try:
            result = await app.state.rearm(f"web:{who}")
        except SparkdError as e:
            return _error_fragment(request, e)
        text = views.rearm_text(result)
        return _fragment(request, "partials/_message.html", level="ok", title="re-armed", message=text, result=result)

    @app.post("/ui/resize", response_class=HTMLResponse, include_in_schema=False)
    async def ui_resize(request: Request) -> HTMLResponse:

        who = await app.state.require_auth(request)
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        values = form_to_resize(form)
        try:
            req = ResizeRequest.model_validate(values)
        except ValidationError as e:
            from fastapi.exceptions import RequestValidationError

            detail = validation_detail(RequestValidationError(e.errors()))
            msg = detail["message"]
            return _fragment(
                request, "partials/_message.html", 422, level="critical", title="invalid input", message=msg
            )
        try:
            result = await app.state.resize(req, f"web:{who}")
        except SparkdError as e:
            return _error_fragment(request, e)
        # echo what was typed (``28``, not ``28.0``) into the Apply form
        changes = {k: form[k].strip() for k in values if k != "dry_run"}
        return _fragment(
            request,
            "partials/_resize_result.html",
            result=result.model_dump(mode="json"),
            changes=changes,
            dry_run=req.dry_run,
        )
