"""The composition root of the HTTP side: ``create_app(daemon)`` wires auth, error
replies, the Host/Origin guard, static files, the API routes and the dashboard.

``sparkd run`` builds ``Daemon(..., app_factory=create_app)``: the loop never imports
the face (DESIGN.md, uvicorn's ``main → Config → Server.serve()``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.middleware.gzip import GZipMiddleware

from sparkd import __version__
from sparkd.face.alertmanager import install_alertmanager
from sparkd.face.api import (
    install_control_routes,
    install_read_routes,
    install_supervision_routes,
    make_control,
    make_resize,
    require_auth,
)
from sparkd.face.auth import Auth, GuardMiddleware, ensure_token, restore_token
from sparkd.face.docs import install_docs
from sparkd.face.live import install_live
from sparkd.face.pages import install_pages
from sparkd.face.replies import install_error_handlers
from sparkd.face.web import error_page, install_web
from sparkd.resources import web_dir

if TYPE_CHECKING:
    from sparkd.loop.status import DaemonView


def create_app(daemon: DaemonView) -> FastAPI:
    """The ASGI app: JSON API, dashboard (``sparkd.face.web``), ``/metrics``, ``/healthz``.

    Creates the API token file on first use (``settings.token_file``, mode 0600).
    ``app.state`` carries what the dashboard routes share with the API: ``daemon``,
    ``auth``, ``require_auth``, ``control`` and ``resize``.

    Raises:
        ConfigError: the token file cannot be created or read.
    """
    settings = daemon.settings
    auth = Auth(ensure_token(settings.token_file))

    async def keep_token() -> str | None:  # deleted while the daemon runs: written again (daemon_db.keep_files)
        wrote = await asyncio.to_thread(restore_token, settings.token_file, auth.token)
        return f"{settings.token_file} (the API token this daemon accepts)" if wrote else None

    daemon.state_keepers.append(keep_token)
    app = FastAPI(
        title="sparkd",
        version=__version__,
        description="Memory guard for vLLM on DGX Spark: status, samples, events, container control.",
        docs_url=None,  # face/docs.py serves /docs from the vendored Swagger UI (offline, CSP-clean)
        redoc_url=None,  # face/docs.py serves /redoc from the vendored ReDoc bundle (offline)
    )
    app.state.daemon = daemon
    app.state.auth = auth
    app.state.require_auth = require_auth
    install_error_handlers(app, html_page=error_page)
    # the link-network addresses of [cluster] are hosts of this API too (peer calls; face/peer.py)
    app.add_middleware(
        GuardMiddleware,
        allowed_hosts=[*settings.api.allowed_hosts, *settings.cluster.listen],
        max_body_bytes=settings.api.max_body_bytes,
    )
    # outermost: compresses pages, JSON and static files over 500 bytes (the dashboard's live
    # updates included); bundles (application/gzip) and event streams are left alone by default
    app.add_middleware(GZipMiddleware, minimum_size=500)
    app.mount("/static", StaticFiles(directory=web_dir() / "static"), name="static")

    control, resize = make_control(daemon), make_resize(daemon)
    app.state.control, app.state.resize = control, resize
    install_read_routes(app, daemon)
    install_control_routes(app, control, resize)
    install_supervision_routes(app, daemon)
    install_alertmanager(app, daemon)
    if daemon.cluster is not None:
        from sparkd.face.peer import install_peer

        install_peer(app, daemon, daemon.cluster)
    install_live(app, daemon)
    install_pages(app, daemon)
    install_docs(app)
    install_web(app, daemon, auth)
    return app
