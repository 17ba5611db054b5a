"""Alertmanager webhook payloads (version 4) → stop requests.

Alertmanager posts ``{"version": "4", "status": "firing"|"resolved", "alerts": [...],
"groupLabels", "commonLabels", "commonAnnotations", "externalURL", "receiver",
"groupKey", "truncatedAlerts"}``; each alert has ``status``, ``labels``,
``annotations``, ``startsAt``, ``endsAt``, ``generatorURL`` and ``fingerprint``
(https://prometheus.io/docs/alerting/latest/configuration/#webhook_config).

An alert asks sparkd to stop when it is **firing** and carries the label
``sparkd_action="stop"``; when it also carries ``sparkd_node``, only the node of that
name acts (a fleet-wide route can then address one node). Resolved alerts and alerts
without the label never stop anything. The reason is the alert's ``summary``
annotation (else ``description``, else its ``alertname``). Pure: dicts in, data out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ACTION_LABEL = "sparkd_action"
NODE_LABEL = "sparkd_node"
MAX_REASON_CHARS = 300


class PayloadError(ValueError):
    """Not an Alertmanager v4 webhook payload; the message names the field."""


@dataclass(frozen=True, slots=True)
class AlertStop:
    """One firing alert that asks this node to stop: ``alertname``, ``reason``, ``fingerprint``."""

    alertname: str
    reason: str
    fingerprint: str | None


def _str_map(value: Any, where: str) -> Mapping[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PayloadError(f"{where}: must be an object of strings")
    return value


def parse_stops(payload: Any, *, node: str | None) -> list[AlertStop]:
    """The stop requests in a payload for this ``node`` (None: a node without a name in ``[cluster]``).

    Raises PayloadError naming the field when the payload is not version 4 or malformed.
    """
    if not isinstance(payload, Mapping):
        raise PayloadError("body: must be a JSON object (Alertmanager webhook payload)")
    if str(payload.get("version")) != "4":
        raise PayloadError(f'version: {payload.get("version")!r} is not supported; allowed: "4"')
    alerts = payload.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: must be a list")
    out: list[AlertStop] = []
    for i, alert in enumerate(alerts):
        if not isinstance(alert, Mapping):
            raise PayloadError(f"alerts[{i}]: must be an object")
        labels = _str_map(alert.get("labels", {}), f"alerts[{i}].labels")
        annotations = _str_map(alert.get("annotations", {}), f"alerts[{i}].annotations")
        if alert.get("status") != "firing" or labels.get(ACTION_LABEL) != "stop":
            continue
        target = labels.get(NODE_LABEL)
        if target is not None and target != node:
            continue
        name = labels.get("alertname", "alert")
        reason = annotations.get("summary") or annotations.get("description") or name
        fp = alert.get("fingerprint")
        out.append(AlertStop(name, reason[:MAX_REASON_CHARS], fp if isinstance(fp, str) else None))
    return out
