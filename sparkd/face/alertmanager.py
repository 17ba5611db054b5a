"""``POST /api/alertmanager``: an Alertmanager webhook receiver that can stop the model.

Token-authenticated like every control route (``Authorization: Bearer <token>``; in
Alertmanager's ``webhook_config`` use ``http_config.authorization.credentials_file``).
Firing alerts labelled ``sparkd_action="stop"`` (see ``sparkd.core.alertmanager``) stop
the container through the normal stop procedure with the alert's summary as the reason
and ``alertmanager`` as the origin; anything else is acknowledged and ignored.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from sparkd.core.alertmanager import PayloadError, parse_stops
from sparkd.errors import InvalidInput, Refused, SparkdError
from sparkd.face.api import Who

if TYPE_CHECKING:
    from sparkd.loop.status import DaemonView

MAX_BODY_BYTES = 1 << 20  # Alertmanager truncates large groups (truncatedAlerts); 1 MiB is ample


def install_alertmanager(app: FastAPI, daemon: DaemonView) -> None:
    """Register the route on ``app`` (called by ``create_app``)."""

    @app.post("/api/alertmanager", tags=["control"])
    async def alertmanager(request: Request, who: Who) -> dict[str, Any]:
        """Alertmanager webhook (payload version 4). Returns what was done for each alert."""
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise InvalidInput("body", f"{len(body)} bytes", f"at most {MAX_BODY_BYTES} bytes")
        try:
            payload = json.loads(body)
            node = getattr(getattr(daemon.settings, "cluster", None), "node", None)
            stops = parse_stops(payload, node=node)
        except (ValueError, PayloadError) as exc:
            raise InvalidInput("body", "Alertmanager payload", str(exc)) from None
        if not stops:
            daemon.event("alertmanager", "Alertmanager webhook: no firing alert asks this node to stop")
            return {"stopped": False, "alerts": 0}
        first = stops[0]
        reason = f"alertmanager: {first.alertname}: {first.reason}"
        fn = getattr(daemon.actions, "request", None)
        if fn is None:
            raise Refused("monitor-only: no container configured", detail="monitor-only: nothing to stop")
        daemon.event(
            "alertmanager",
            f"Alertmanager asks to stop: {first.alertname} ({len(stops)} alert(s)); caller {who}",
            severity="critical",
            details={"alerts": [s.alertname for s in stops], "fingerprints": [s.fingerprint for s in stops]},
        )
        try:
            result: dict[str, Any] = await fn("stop", source="alertmanager", reason=reason)
        except SparkdError as exc:
            # the critical event above said a stop was asked; Alertmanager does not retry a 4xx (helper-53)
            daemon.event(
                "alertmanager_stop_not_executed",
                f"Alertmanager's stop ({first.alertname}) was not carried out: {exc}",
                severity="critical",
                details={"alerts": [s.alertname for s in stops]},
            )
            raise
        return {"stopped": True, "alerts": len(stops), "reason": reason, "result": result}
