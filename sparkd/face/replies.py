"""One error shape for every reply: ``{"error": <code>, "detail": <str | dict>}``.

``install_error_handlers(app)`` maps ``SparkdError``, request validation errors,
Starlette's HTTP errors and anything unhandled onto it; validation errors name the
field, the value and what is allowed. Browsers get the same body as a page or an
htmx fragment (``sparkd.face.web.error_page``, handed in by the app).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparkd.errors import SparkdError

log = logging.getLogger("sparkd.face.api")

_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}


def jsonable(value: Any) -> Any:
    """``value`` with every non-finite float as a string (``nan``, ``inf``, ``-inf``) and every string
    UTF-8 cannot encode (a lone surrogate such as ``"\\ud800"`` from a JSON body) escaped: always serializes."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _field_of(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header", "cookie")]
    return ".".join(parts) or "body"


_NOT_AN_OBJECT = frozenset({"model_attributes_type", "model_type", "dict_type", "missing"})


def validation_detail(exc: RequestValidationError) -> dict[str, Any]:
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


HtmlPage = Callable[[Request, int, dict[str, Any]], Response]


def install_error_handlers(app: FastAPI, html_page: HtmlPage | None = None) -> None:
    """Map every error onto the one shape; ``html_page(request, status, body)`` renders it for
    browsers (``sparkd.face.web.error_page``, handed in by ``create_app``)."""

    def _reply(request: Request, status: int, body: dict[str, Any]) -> Response:
        body = jsonable(body)  # an error body must always serialize (NaN in a detail, say)
        if html_page is not None and wants_html(request):
            return html_page(request, status, body)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(SparkdError)
    async def _sparkd(request: Request, exc: SparkdError) -> Response:
        return _reply(request, exc.status_code, exc.to_json())

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return _reply(request, 422, {"error": "invalid_input", "detail": validation_detail(exc)})

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
