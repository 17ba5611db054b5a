"""A stop asked of sparkd while a relaunch or resize holds the action lock (minutes of start-up, when memory peaks).

The guard's own trips were handed over to that action (it stops the run at once and launches nothing more); a stop
from a peer Spark's trip, from Alertmanager or from an operator went through ``request`` and was refused, "already
relaunching": the peer had been answered "accepted" and stopped its own model while this one came up, and
Alertmanager got a 409 it does not retry (helper-53). They are handed over the same way now, with their own intent
and no count toward the breaker; a rule's stop already handed over is kept. A real ``Supervisor`` and ``Cluster``;
Docker stubbed at the edge (``test_watch_failing``'s). The whole handover against a real engine:
``test_e2e_unattended.py::test_a_trip_during_a_maintenance_relaunchs_start_up_stops_the_new_run_at_once``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_watch_failing import _sup

from sparkd.config import ClusterSettings, PeerSettings
from sparkd.core.supervision import StopIntent
from sparkd.loop.cluster import Cluster

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_peers_or_an_operators_stop_during_a_relaunch_is_handed_over_not_refused(tmp_path: Path) -> None:
    sup, m, events = _sup(tmp_path)
    m.refusing = False
    tok = tmp_path / "token"
    tok.write_text("secret\n")
    peer = PeerSettings(name="b", url="http://127.0.0.9:1", token_file=str(tok))
    cl = Cluster(ClusterSettings(node="a", peers=[peer]))
    said: list[tuple[str, str]] = []
    cl.emit = lambda kind, msg, *, severity, details: said.append((kind, severity))  # type: ignore[assignment]
    cl.actions = sup
    async with sup.lock:  # relaunch_same_plan holds it until its new run is ready
        sup.action = "relaunching"
        answer = cl.accept_stop("b", origin="b", rule="low_available", reason="MemAvailable 3 GiB")
        await asyncio.gather(*cl.tasks)
        assert answer["accepted"] is True
        assert [k for k, _ in said] == ["peer_stop_requested"], said  # no peer_stop_not_executed
        assert sup.emergency_inbox is not None and sup.emergency_inbox[0] == "peer:b"
        [ev] = [e for e in events if e["kind"] == "stop_handed_over"]
        assert "peer:b: peer_emergency from b: low_available" in ev["message"]
        assert "the relaunching under way stops the model now and launches nothing more" in ev["message"]
        # an operator's stop (the API, `sparkd stop`): handed over too, with an answer that says so
        sup.emergency_inbox = None
        out = await sup.request("stop", source="api (admin)", reason="operator stop")
        assert out["handed_over"] is True and sup.emergency_inbox == ("api (admin)", "operator stop")
        # a rule's stop handed over first is kept: its intent is emergency, and it counts toward the breaker
        sup.emergency_inbox = ("rule low_available", "usable 2 GiB < 6 GiB")
        await sup.request("stop", source="api (admin)", reason="operator stop")
        assert sup.emergency_inbox == ("rule low_available", "usable 2 GiB < 6 GiB")


async def test_a_handed_over_operators_stop_holds_its_own_intent_and_is_not_counted_toward_the_breaker(
    tmp_path: Path,
) -> None:
    for source, intent, counted in (
        ("api (admin)", StopIntent.OPERATOR, 0),
        ("peer:b", StopIntent.PEER_EMERGENCY, 0),
        ("rule low_available", StopIntent.EMERGENCY, 1),
    ):
        sup, m, _ = _sup(tmp_path / source.split()[0].replace(":", "-"))
        m.refusing = False
        stopped: list[str] = []

        async def stop(reason: str, src: str, stopped: list[str] = stopped, **kw: Any) -> None:
            stopped.append(src)  # the real one stops a real container

        async def finish(how: str) -> None:
            return None

        sup._stop = stop  # type: ignore[method-assign]
        sup._finish_launch = finish  # type: ignore[method-assign]
        sup.emergency_inbox = (source, "asked")
        async with sup.lock:
            sup.action = "relaunching"
            ok, why = await sup._take_emergency()
        assert (ok, stopped) == (False, [source]) and why == f"stopped by {source}: asked"
        assert sup.unattended.state.intent is not None and sup.unattended.state.intent.intent is intent
        assert len(sup.unattended.state.breaker.emergencies) == counted, (source, sup.unattended.state.breaker)
