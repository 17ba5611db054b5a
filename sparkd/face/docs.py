"""``/docs``: the OpenAPI reference as Swagger UI, served from the vendored bundle.

FastAPI's own ``/docs`` loads Swagger UI from a CDN and starts it with an inline script: blank on
an offline Spark, and refused by the dashboard's Content-Security-Policy (``script-src 'self'``).
This page loads ``/static/vendor/swagger-ui/`` and starts it from ``/static/docs.js``.
``/openapi.json`` is FastAPI's.
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


def install_docs(app: FastAPI) -> None:
    """Register ``GET /docs`` (the app must be created with ``docs_url=None``)."""

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(PAGE)
