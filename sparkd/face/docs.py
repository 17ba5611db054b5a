"""``/docs`` and ``/redoc``: the OpenAPI reference as Swagger UI and as ReDoc, served from the
vendored bundles.

FastAPI's own pages load both from a CDN and start them with an inline script: blank on an offline
Spark, and refused by the dashboard's Content-Security-Policy (``script-src 'self'``). These pages
load ``/static/vendor/swagger-ui/`` (started from ``/static/docs.js``) and
``/static/vendor/redoc/`` (ReDoc 2.5.4, which starts itself from the ``<redoc spec-url>``
element). ``/openapi.json`` is FastAPI's.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>sparkd API</title>
<link rel="stylesheet" href="/static/vendor/swagger-ui/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/static/vendor/swagger-ui/swagger-ui-bundle.js"></script>
<script src="/static/docs.js"></script>
</body>
</html>
"""


REDOC_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>sparkd API (ReDoc)</title>
</head>
<body>
<redoc spec-url="/openapi.json"></redoc>
<script src="/static/vendor/redoc/redoc.standalone.js"></script>
</body>
</html>
"""


def install_docs(app: FastAPI) -> None:
    """Register ``GET /docs`` and ``GET /redoc`` (the app must be created with ``docs_url=None`` and
    ``redoc_url=None``)."""

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return HTMLResponse(REDOC_PAGE)
