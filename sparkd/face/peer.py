"""Peer routes of a cluster of Sparks, and the rule that the link network is for peers only.

* ``POST /api/peer/stop`` (``{"origin", "rule", "reason", "intent"}``): a peer's trip asks
  this node to stop its container. Accepted only from a configured peer address with that
  peer's token; answers 202 at once and stops in the background through the normal
  procedure (the caller never waits for our 30 s grace).
* ``GET /api/cluster``: this node and every peer side by side (headroom, container state,
  last incident), read from the peers' ``/api/status`` with the peer token.
* ``PeerOnlyMiddleware``: a request that arrived on a ``cluster.listen`` address (the link
  network) from anyone but a configured peer is refused (403) whatever its path.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from sparkd.errors import Forbidden
from sparkd.face import presenters as views
from sparkd.face.api import Who

if TYPE_CHECKING:
    from sparkd.loop.cluster import Cluster
    from sparkd.loop.status import DaemonView


class PeerStop(BaseModel):
    model_config = ConfigDict(extra="forbid")

    origin: str = Field(min_length=1, max_length=64)
    rule: str = Field(min_length=1, max_length=128)
    reason: str = Field(max_length=1000)
    intent: str = Field(default="peer_emergency", pattern="^peer_emergency$")


def _norm(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


class PeerOnlyMiddleware:
    """Refuse non-peers on the link-network listen addresses (see module doc)."""

    def __init__(self, app: ASGIApp, cluster: Cluster) -> None:
        self.app = app
        self.cluster = cluster
        self.link = {_norm(a) for a in cluster.settings.listen}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.link:
            server = scope.get("server")
            client = scope.get("client")
            on_link = server is not None and _norm(str(server[0])) in self.link
            if on_link and self.cluster.peer_from(str(client[0]) if client else None) is None:
                resp = JSONResponse(
                    {"error": "forbidden", "message": "the link network is for configured peers only"}, 403
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_peer(app: FastAPI, daemon: DaemonView, cluster: Cluster) -> None:
    """Register the peer routes and the link-network middleware (called by ``create_app``)."""
    app.add_middleware(PeerOnlyMiddleware, cluster=cluster)

    def _peer(request: Request) -> str:
        auth = request.headers.get("authorization", "")
        bearer = auth[7:] if auth.lower().startswith("bearer ") else None
        peer = cluster.authenticate(request.client.host if request.client else None, bearer)
        if peer is None:
            daemon.event(
                "peer_refused",
                f"peer call refused from {request.client.host if request.client else '?'}: not a configured "
                "peer address with its token",
                severity="warning",
            )
            raise Forbidden("peer calls need a configured peer address and that peer's token")
        return peer.name

    @app.post("/api/peer/stop", tags=["cluster"], status_code=202)
    async def peer_stop(req: PeerStop, request: Request) -> dict[str, Any]:
        """A peer's trip: stop this node's container (intent peer_emergency). 202 at once."""
        return cluster.accept_stop(_peer(request), origin=req.origin, rule=req.rule, reason=req.reason)

    @app.post("/api/peer/start", tags=["cluster"])
    async def peer_start(request: Request) -> dict[str, Any]:
        """The head's coordinated launch asks this node (a worker) to launch now; answers once launched."""
        return await cluster.accept_start(_peer(request))

    @app.post("/api/cluster/start", tags=["cluster"])
    async def cluster_start(who: Who) -> dict[str, Any]:
        """Coordinated launch from the head: every worker first (each runs its own preflight), then this
        node after ``cluster.worker_start_delay_s``; if a worker fails, this node is not launched."""
        return await cluster.coordinated_launch(f"api:{who}")

    @app.get("/api/cluster", tags=["cluster"])
    async def cluster_view() -> dict[str, Any]:
        """This node and its peers side by side; a silent peer with the age of its last status."""
        return {"node": cluster.settings.node, "role": cluster.settings.role, "peers": await cluster.peer_statuses()}

    @app.get("/cluster", response_class=HTMLResponse, include_in_schema=False)
    async def cluster_page(request: Request) -> HTMLResponse:
        """Every node side by side: headroom to its nearest stop line, container state, last stop."""
        from sparkd.face.web import render

        status = views.status_view(daemon).model_dump(mode="json")
        local: dict[str, Any] = {"node": cluster.settings.node, "reachable": True, "age_s": 0.0, "status": status}
        nodes = [local, *await cluster.peer_statuses()]
        return render(request, "cluster.html", nodes=[node_row(n) for n in nodes], role=cluster.settings.role)


def node_row(n: dict[str, Any]) -> dict[str, Any]:
    """One node of ``/api/cluster`` as the cluster page shows it (GiB at this edge)."""
    st = n.get("status") or {}
    ns = st.get("nearest_stop") or {}
    last = next((e for e in st.get("events") or [] if e.get("kind") in ("stopped", "killed")), None)
    gib = 1024**3
    return {
        "node": n["node"],
        "reachable": n["reachable"],
        "age_s": n.get("age_s"),
        "error": n.get("error"),
        "mem_available_gib": ((st.get("sample") or {}).get("mem_available") or 0) / gib if st else None,
        "headroom_gib": ns["headroom_bytes"] / gib if ns else None,
        "rule": ns.get("rule"),
        "counter": f"{ns['counter']}/{ns['samples']}" if ns else None,
        "state": (st.get("container") or {}).get("state"),
        "last_stop": last["message"] if last else None,
    }
