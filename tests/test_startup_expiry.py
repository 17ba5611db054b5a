"""A run whose /health does not answer is stopped as a failed launch (``container.startup_timeout_s``) only when it is
a launch of sparkd's that never became ready. The deadline counted from the launch's start (or Docker's start of a
run sparkd found running), so sparkd restarted beside a model that had run for hours stopped it at the first /health
that failed, as "not ready within 1800 s": a model that had been ready (its launch record says so) at a busy moment,
and in guard mode, whose container sparkd never starts, any model whose ``container.port`` answers nothing.

Docker and the /health probe are stubs here (the edge: a probe failing on cue); the lifecycle is the real one
(``Supervisor.reconcile`` → ``core.lifecycle.transition`` → effects)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from sparkd.act.containerspec import ContainerState as DockerState
from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState as S
from sparkd.core.lifecycle import Probe
from sparkd.loop.supervisor import Supervisor

pytestmark = pytest.mark.anyio

CID = "d" * 64


HOUR = 3600.0


class Manager:
    """``docker inspect``'s ``State`` of one running container, started ``age_s`` ago."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at

    def state(self, cid: str) -> DockerState:
        return DockerState("running", True, None, False, self.started_at, None, 4242, None)


def _sup(tmp_path: Path, mode: str, *, ran_for_s: float, ready_before: bool) -> tuple[Supervisor, list[str]]:
    container: dict[str, Any] = {"image": "x:1", "name": "vllm", "startup_timeout_s": 600.0}
    if mode == "guard":
        container = {"guard": "vllm", "startup_timeout_s": 600.0}
    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": container})
    started = time.time() - ran_for_s
    sup = Supervisor(settings, manager=Manager(started))  # type: ignore[arg-type]
    stops: list[str] = []

    async def stop_quietly(reason: str) -> None:
        stops.append(reason)

    async def failing() -> tuple[Probe, str | None]:
        return Probe.FAILING, "connection refused"

    sup._stop_quietly = stop_quietly  # type: ignore[method-assign]
    sup.check_health = failing  # type: ignore[method-assign]
    # a run taken as sparkd takes one it finds running (adopted): its start time seen, the state "starting"
    sup.container_id, sup.state = CID, S.STARTING
    sup.seen_started_at, sup.seen_restart_count = started, 0
    sup.container_started_at = sup.launch_started_at = started
    sup.first_sight = True
    sup.ready_at = started + 120.0 if ready_before else None  # the launch record's ready_at
    return sup, stops


async def _probe(sup: Supervisor) -> None:
    sup._last_probe = 0.0
    await sup.reconcile(probe=True)
    if sup._bg is not None:
        await sup._bg


@pytest.mark.parametrize("mode", ["managed", "guard"])
async def test_a_model_that_was_ready_is_not_stopped_as_a_failed_launch_when_health_fails_at_adoption(
    tmp_path: Path, mode: str
) -> None:
    sup, stops = _sup(tmp_path, mode, ran_for_s=2 * HOUR, ready_before=True)
    await _probe(sup)
    await _probe(sup)
    assert stops == [] and sup.state is not S.FAILED, (stops, sup.state, sup.state_reason)
    assert sup.health == "connection refused"  # said, not acted on
    # and it reads as what it is: a model that was ready and fails /health (it read "starting … adopted" for as long
    # as that lasted, and the completion probe, which runs on a ready or unhealthy model only, never ran; helper-37)
    assert sup.state is S.UNHEALTHY and sup.state_reason == "/health: connection refused", sup.state_reason


async def test_guard_mode_never_stops_a_model_for_its_health(tmp_path: Path) -> None:
    """sparkd does not start a guarded container, so a /health that never answers (a wrong container.port, a model
    still loading) is not a launch of sparkd's that failed: it is said (``health``), never a stop."""
    sup, stops = _sup(tmp_path, "guard", ran_for_s=2 * HOUR, ready_before=False)
    await _probe(sup)
    assert stops == [] and sup.state is S.STARTING and sup.health == "connection refused"
    # nor does it keep the guard sampling fast past a start-up's time (4 Hz for 8 min in helper-37's walk-through)
    assert sup.fast_reason() is None
    young, _ = _sup(tmp_path / "young", "guard", ran_for_s=60.0, ready_before=False)
    await _probe(young)
    assert young.state is S.STARTING and young.fast_reason() == "container vllm starting"


async def test_a_managed_launch_that_never_became_ready_is_still_stopped_when_its_time_is_up(tmp_path: Path) -> None:
    sup, stops = _sup(tmp_path, "managed", ran_for_s=2 * HOUR, ready_before=False)
    await _probe(sup)
    assert sup.state is S.FAILED and len(stops) == 1 and "not ready within 600 s" in stops[0], (sup.state, stops)
    young, stops2 = _sup(tmp_path / "young", "managed", ran_for_s=60.0, ready_before=False)
    await _probe(young)
    assert young.state is S.STARTING and stops2 == []  # within its start-up time


async def test_a_wall_clock_step_during_a_start_up_neither_fails_the_launch_nor_ends_fast_sampling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up's age was read on the wall clock: NTP's first sync after boot (a step of 30 min forward) aged a
    model loading for 60 s past its 600 s: fast sampling ended and the next failing /health marked it failed with a
    stop (helper-40). Its age runs on the monotonic clock from the launch's start."""
    import sparkd.loop.supervisor as supervisor_module

    sup, stops = _sup(tmp_path, "managed", ran_for_s=60.0, ready_before=False)
    await _probe(sup)
    assert sup.fast_reason() == "container vllm starting"
    real = time.time
    monkeypatch.setattr(supervisor_module.time, "time", lambda: real() + 1800.0)
    await _probe(sup)
    assert sup.state is S.STARTING and stops == [], (sup.state, stops)
    assert sup.fast_reason() == "container vllm starting"


def test_the_stubs_take_the_path_the_daemon_takes(tmp_path: Path) -> None:
    """The supervisor's own names the stubs replace exist (a rename would leave this file testing nothing)."""
    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": {"image": "x:1", "name": "vllm"}})
    sup = Supervisor(settings)
    for name in ("_stop_quietly", "check_health", "reconcile", "_last_probe", "first_sight", "_bg", "ready_at"):
        assert hasattr(sup, name), name
    assert asyncio.iscoroutinefunction(Supervisor._stop_quietly) and asyncio.iscoroutinefunction(sup.check_health)


async def test_a_launch_that_fails_while_an_action_holds_the_lock_is_stopped_once_the_lock_is_free(
    tmp_path: Path,
) -> None:
    """A maintenance relaunch (or a resize's rollback) holds the action lock while its launch starts up. The
    supervisor step marked the run failed at its deadline and skipped the stop ("a resize waits for this"); the
    relaunch returned, and the model ran on, shown "failed", never stopped (helper-51). The stop is kept and done
    at the first step with the lock free, if that run is still up and failed; a run the action stopped or replaced
    meanwhile is left alone."""
    from sparkd.errors import NotFound

    def not_found(name: str) -> Any:
        raise NotFound(name)

    for replaced in (False, True):
        sup, stops = _sup(tmp_path / str(replaced), "managed", ran_for_s=2 * HOUR, ready_before=False)
        sup.manager.ping = lambda: True  # type: ignore[attr-defined]
        sup.manager.get = not_found  # type: ignore[attr-defined]
        sup.manager.adopt = lambda: None  # type: ignore[attr-defined]
        sup.engine_up, sup.first_steps_done = True, True
        async with sup.lock:  # relaunch_same_plan holds it while _launch_and_wait waits for ready
            sup.action = "relaunching"
            await _probe(sup)  # the step's look: "relaunching" is not skipped, and the run's time is up
            assert sup.state is S.FAILED and stops == [], (sup.state, stops)
            sup.action = None
            if replaced:  # a rollback launched another run meanwhile
                sup.container_id = "e" * 64
        await sup._step()
        if sup._bg is not None:
            await sup._bg
        if replaced:
            assert stops == [], stops
        else:
            assert len(stops) == 1 and "not ready within 600 s" in stops[0], stops
        await sup._step()  # once only
        assert len(stops) == (0 if replaced else 1), stops


async def test_a_failed_launchs_stop_refused_as_busy_waits_for_the_lock_instead_of_being_dropped(
    tmp_path: Path,
) -> None:
    """The failed launch's stop was asked while an action (an operator's resize, a maintenance run) took the lock:
    Conflict, said as stop_not_executed, never tried again; the model ran on, shown "failed" (helper-51). It is kept
    for the first step with the lock free."""
    from sparkd.errors import NotFound

    def not_found(name: str) -> Any:
        raise NotFound(name)

    sup, stops = _sup(tmp_path, "managed", ran_for_s=2 * HOUR, ready_before=False)
    sup.manager.ping = lambda: True  # type: ignore[attr-defined]
    sup.manager.get = not_found  # type: ignore[attr-defined]
    sup.manager.adopt = lambda: None  # type: ignore[attr-defined]
    sup.engine_up, sup.first_steps_done = True, True
    said: list[str] = []
    sup._event = lambda kind, message, **kw: said.append(kind)  # type: ignore[method-assign]
    await _probe(sup)
    assert sup.state is S.FAILED and len(stops) == 1  # the stub took the step's stop: now the real one, busy
    async with sup.lock:
        sup.action = "resizing"
        await Supervisor._stop_quietly(sup, "not ready within 600 s")  # the real one: request("stop") → Conflict
        sup.action = None
    assert "stop_not_executed" not in said, said
    await sup._step()
    if sup._bg is not None:
        await sup._bg
    assert stops[1:] == ["not ready within 600 s"], stops


async def test_a_failed_maintenance_relaunch_is_stopped_keeping_its_intent_and_a_docker_409_is_said(
    tmp_path: Path,
) -> None:
    """The kept stop of a maintenance run's failed relaunch replaced the maintenance intent (smoke_failed said it is
    held) with failed_launch and decided a relaunch; and a Docker 409 on the stop (not the action lock) was kept
    and retried silently at every step (helper-52)."""
    from sparkd.core.supervision import IntentRecord, StopIntent
    from sparkd.errors import Conflict

    sup, _ = _sup(tmp_path, "managed", ran_for_s=2 * HOUR, ready_before=False)
    asked: list[str] = []
    decided: list[Any] = []
    said: list[str] = []

    async def request(action: str, *, source: str, reason: str | None = None, **kw: Any) -> dict[str, Any]:
        asked.append(source)  # the real one stops a real container, then records the stop's intent as here
        await sup.unattended.set_intent(sup.unattended.intent_for(source), source, reason or "")
        return {"action": action}

    async def after_down(intent: Any, **kw: Any) -> None:
        decided.append(intent)

    sup.request = request  # type: ignore[method-assign]
    sup.unattended.after_down = after_down  # type: ignore[method-assign]
    sup._event = lambda kind, message, **kw: said.append(kind)  # type: ignore[method-assign]
    began = IntentRecord(StopIntent.MAINTENANCE, time.time() - 900, "maintenance (schedule)", "drain and relaunch")
    sup.unattended.state.intent = began
    await Supervisor._stop_quietly(sup, "not ready within 600 s")
    assert asked == ["maintenance (failed launch)"] and decided == [], (asked, decided)
    assert sup.unattended.state.intent == began  # its start, who began it and its expiry clock (helper-54)
    from sparkd.core.supervision import is_incident

    assert is_incident("maintenance (failed launch)")  # its postmortem is an incident's, as a failed launch's
    sup.unattended.state.intent = None  # no maintenance: a failed launch, and the relaunch decision, as ever
    await Supervisor._stop_quietly(sup, "not ready within 600 s")
    assert asked[-1] == "sparkd (failed launch)" and decided == [StopIntent.FAILED_LAUNCH]

    async def docker_409(action: str, **kw: Any) -> dict[str, Any]:
        raise Conflict("stop container: Docker engine: container is paused, unpause it first")

    sup.request = docker_409  # type: ignore[method-assign]
    await Supervisor._stop_quietly(sup, "not ready within 600 s")
    assert said[-1] == "stop_not_executed" and said.count("stop_not_executed") == 1
    assert sup._failed_stop_pending is None
