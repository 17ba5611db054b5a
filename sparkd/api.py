"""REST API and dashboard app (FastAPI). Reads ``DaemonState``; control endpoints enqueue actions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from .errors import SparkdError

if TYPE_CHECKING:
    from .daemon import Daemon


def create_app(daemon: Daemon) -> FastAPI:
    app = FastAPI(title="sparkd", version="0.1.0")

    @app.exception_handler(SparkdError)
    async def _err(_req: Any, exc: SparkdError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status_code)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": daemon.ready, "samples_taken": daemon.samples_taken}

    @app.get("/api/status")
    async def status() -> dict[str, Any]:
        return daemon.status_json()

    return app
