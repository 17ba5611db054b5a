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


@pytest.mark.parametrize("source", ["alertmanager", "api (admin)", "peer:b", "rule low_available"])
async def test_a_stop_handed_over_to_a_resize_is_not_undone_by_its_rollback(tmp_path: Path, source: str) -> None:
    """An operator's (Alertmanager's) stop handed over during a resize: the resize took the stop for a failed
    revision and its rollback launched the old one at once, the model running while the status said "stopped by the
    operator" (helper-54). A stop asked meanwhile ends the resize: no rollback, nothing launched. The real
    ``request`` and ``_apply_resize``; Docker's stop and launch are the stubbed edge."""
    from types import SimpleNamespace

    from sparkd.core.lifecycle import ContainerState as S

    sup, m, events = _sup(tmp_path)
    m.refusing = False
    launched: list[str] = []

    async def save_revision(budget: Any, *, who: str, reason: str) -> int:
        return 7

    async def drain() -> None:  # the stop arrives while the resize drains the model
        out = await sup.request("stop", source=source, reason="asked")
        assert out.get("handed_over") is True

    async def stop(reason: str, src: str, **kw: Any) -> None:
        sup.state = S.STOPPED

    async def finish(how: str) -> None:
        return None

    async def launch(src: str, *, force: bool = False) -> str:
        launched.append(src)
        sup.state = S.READY
        return "L2"

    sup._save_revision = save_revision  # type: ignore[method-assign]
    sup._drain = drain  # type: ignore[method-assign]
    sup._stop = stop  # type: ignore[method-assign]
    sup._finish_launch = finish  # type: ignore[method-assign]
    sup._launch = launch  # type: ignore[method-assign]
    out = SimpleNamespace(diff={}, model_dump=lambda **kw: {}, model_copy=lambda update: update)
    async with sup.lock:
        sup.action = "resizing"
        res = await sup._apply_resize(sup.budget, {"x": 1}, "api (admin)", out)  # type: ignore[arg-type]
    assert launched == [], (source, res)
    assert res["applied"] is False and "stopped by" in (res["error"] or ""), res
    assert not any(e["kind"] == "rollback" for e in events), [e["kind"] for e in events]
    [cut] = [e for e in events if e["kind"] == "resize_interrupted"]  # said, not only in the API's answer
    assert "revision 7 (not tried yet) is what the next start launches" in cut["message"], cut
    assert sup.unattended.state.intent is not None and sup.stay_stopped


def test_sparkd_stop_says_its_stop_was_handed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sparkd stop` printed nothing and exited 0 when its stop was handed over to a relaunch (helper-54). The
    daemon's answer is the edge stubbed here; its shape is ``Supervisor._hand_over_stop``'s (tested above)."""
    from click.testing import CliRunner

    from sparkd.face.cli import control, main

    answer = {
        "action": "stop",
        "accepted": True,
        "handed_over": True,
        "message": "handed over to the relaunching under way: it stops the model now and launches nothing more",
    }
    monkeypatch.setattr(control, "_api", lambda *a, **k: answer)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n[container]\nimage = "vllm/vllm-openai:v1"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "stop"])
    assert r.exit_code == 0 and r.output.strip() == answer["message"], r.output


async def test_a_handed_over_stop_left_for_after_the_lock_finds_the_model_down_and_records_its_intent(
    tmp_path: Path,
) -> None:
    """A stop handed over after the action's last look (its launch failed, or its run exited) is asked once the lock
    is free: "not running" was a critical stop_not_executed for a model that is down, and the asker's intent was
    never recorded (helper-54). The stop is done: the intent is recorded and the model stays stopped."""
    from sparkd.act.containerspec import ContainerState as DockerState

    sup, m, events = _sup(tmp_path)
    m.refusing = False
    m.state = lambda cid: DockerState("exited", False, 0, False, m.started_at, None, None, None)  # type: ignore[method-assign]
    from sparkd.core.lifecycle import ContainerState as S

    sup.state = S.STOPPED  # the action's run is down, as sparkd saw it
    await sup._stop_as_asked("api (admin)", "operator stop")
    assert not any(e["kind"] == "stop_not_executed" for e in events), events
    assert sup.unattended.state.intent is not None and sup.unattended.state.intent.intent is StopIntent.OPERATOR
    assert sup.stay_stopped is True


async def test_a_stop_not_running_is_told_by_its_reason_not_by_its_words(tmp_path: Path) -> None:
    """``_stop_as_asked`` reads ``Refused.reason``: a refusal that only reads "is not running" (no reason) is said as
    not executed; one with ``reason="not_running"`` is the stop done. The supervisor's own not-running refusals, a
    stop's and a maintenance run's, carry the code."""
    from sparkd.core.lifecycle import ContainerState as S
    from sparkd.errors import Refused

    for reason, said in ((None, True), ("not_running", False)):
        sup, _m, events = _sup(tmp_path / str(reason))

        async def request(action: str, *, source: str, reason: str | None = None, why: Any = reason) -> None:
            raise Refused("vllm is not running (state stopped)", reason=why)

        sup.request = request  # type: ignore[method-assign]
        await sup._stop_as_asked("api (admin)", "operator stop")
        assert any(e["kind"] == "stop_not_executed" for e in events) is said, events
        assert sup.stay_stopped is not said and (sup.unattended.state.intent is None) is said
    sup, m, _ = _sup(tmp_path / "own")
    m.refusing = False
    sup.mode, sup.state = "managed", S.STOPPED
    with pytest.raises(Refused) as e:
        await sup.unattended.maintenance_run("api (admin)")
    assert e.value.reason == "not_running", e.value
