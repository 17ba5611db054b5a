"""Alertmanager webhook (payload version 4) → a stop, and only for firing alerts that ask for one."""

from __future__ import annotations

import copy
import re
from typing import Any

import httpx
import pytest

from sparkd.core.alertmanager import PayloadError, parse_stops

pytest_plugins = ["dockerkit"]

# An Alertmanager v4 webhook payload as Alertmanager sends it (one group, two alerts).
PAYLOAD: dict[str, Any] = {
    "version": "4",
    "groupKey": '{}:{alertname="SparkdClusterNodeLow"}',
    "truncatedAlerts": 0,
    "status": "firing",
    "receiver": "sparkd-stop",
    "groupLabels": {"alertname": "SparkdClusterNodeLow"},
    "commonLabels": {"alertname": "SparkdClusterNodeLow", "severity": "critical", "sparkd_action": "stop"},
    "commonAnnotations": {},
    "externalURL": "http://alertmanager.local:9093",
    "alerts": [
        {
            "status": "firing",
            "labels": {"alertname": "SparkdClusterNodeLow", "cluster": "pair", "sparkd_action": "stop"},
            "annotations": {"summary": "a node of cluster pair has less than 4 GiB MemAvailable"},
            "startsAt": "2026-11-30T21:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus.local:9090/graph?g0.expr=...",
            "fingerprint": "c1a4d2e0f3b5a6c7",
        },
        {
            "status": "firing",
            "labels": {"alertname": "SparkdRuleCounting", "rule": "low_available", "severity": "warning"},
            "annotations": {"summary": "stop rule low_available has been counting for 30 s"},
            "startsAt": "2026-11-30T21:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus.local:9090/graph",
            "fingerprint": "d2b5e3f1a4c6b7d8",
        },
    ],
}


def test_it_takes_only_firing_alerts_labelled_stop() -> None:
    stops = parse_stops(PAYLOAD, node="spark-a")
    assert [(s.alertname, s.fingerprint) for s in stops] == [("SparkdClusterNodeLow", "c1a4d2e0f3b5a6c7")]
    assert stops[0].reason == "a node of cluster pair has less than 4 GiB MemAvailable"


def test_a_resolved_alert_stops_nothing() -> None:
    p = copy.deepcopy(PAYLOAD)
    p["status"] = "resolved"
    for a in p["alerts"]:
        a["status"] = "resolved"
    assert parse_stops(p, node="spark-a") == []


def test_an_alert_addressed_to_another_node_is_not_ours() -> None:
    p = copy.deepcopy(PAYLOAD)
    p["alerts"][0]["labels"]["sparkd_node"] = "spark-b"
    assert parse_stops(p, node="spark-a") == []
    assert len(parse_stops(p, node="spark-b")) == 1


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ([], "body"),
        ({**PAYLOAD, "version": "3"}, "version"),
        ({**PAYLOAD, "alerts": {}}, "alerts"),
        ({**PAYLOAD, "alerts": [{"status": "firing", "labels": {"a": 1}}]}, "alerts[0].labels"),
    ],
)
def test_a_malformed_payload_names_the_field(payload: Any, field: str) -> None:
    with pytest.raises(PayloadError, match="^" + re.escape(field) + ":"):
        parse_stops(payload, node=None)


def test_the_webhook_stops_a_real_container(sparkd_factory: Any, docker_client: Any) -> None:
    # a real sparkd with its API and a managed test container on the real Docker engine
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    url = f"http://127.0.0.1:{s.api_port}/api/alertmanager"
    # without the token: refused, nothing stopped
    assert httpx.post(url, json=PAYLOAD, timeout=30).status_code == 401
    # an unlabelled, resolved alert: acknowledged, nothing stopped
    quiet = copy.deepcopy(PAYLOAD)
    quiet["alerts"] = [quiet["alerts"][1]]
    r = httpx.post(url, json=quiet, headers={"Authorization": f"Bearer {s.token}"}, timeout=30)
    assert r.status_code == 200 and r.json()["stopped"] is False
    assert docker_client.containers.get(c["container_id"]).status == "running"
    # the firing, labelled alert: a graceful stop with the alert's summary as the reason
    r = httpx.post(url, json=PAYLOAD, headers={"Authorization": f"Bearer {s.token}"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["stopped"] is True
    assert docker_client.containers.get(c["container_id"]).status == "exited"
    stopped = s.wait_event("stopping")
    assert "alertmanager: SparkdClusterNodeLow: a node of cluster pair" in stopped["message"]


@pytest.mark.anyio
async def test_a_stop_alertmanager_asked_for_that_is_refused_is_said(tmp_path: Any, anyio_backend: str) -> None:
    """The critical "Alertmanager asks to stop" event went out, the request got a 409 that Alertmanager does not
    retry, and nothing said the stop was not carried out (helper-53)."""
    from fakes import FakeActions
    from test_api import _bearer, _client, _daemon

    assert anyio_backend == "asyncio"

    actions = FakeActions()
    actions.busy = "stopping"  # an operator's stop under way, say: the request is refused as busy
    d = await _daemon(tmp_path, actions=actions)
    try:
        async with _client(d) as c:
            r = await c.post("/api/alertmanager", json=PAYLOAD, headers=_bearer(d))
        assert r.status_code == 409, r.text
        kinds = [(e["kind"], e["severity"]) for e in d.recent_events]
        assert ("alertmanager_stop_not_executed", "critical") in kinds, kinds
        [ev] = [e for e in d.recent_events if e["kind"] == "alertmanager_stop_not_executed"]
        assert ev["message"] == ("Alertmanager's stop (SparkdClusterNodeLow) was not carried out: already stopping"), (
            ev["message"]
        )
    finally:
        await d.shutdown("test")
