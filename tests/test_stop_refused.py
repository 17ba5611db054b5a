"""A stop the Docker engine refuses (``docker stop`` of a container without sparkd's label, not guarded: "not sparkd's
to stop") raises ``Refused`` from ``RunBook._stop``, as a stop of a model that is not running does. The guard's
emergency stop read every ``Refused`` as "nothing runs": a stop that stopped nothing was a warning
``stop_not_executed`` marked ``nothing_running``, so the rule's cooldown held and the next trip did not act while the
model ran on; and the stop finished through Docker after one made by the container's processes took such a refusal
for "not running" too, with no ``stop_not_executed`` (only the procedure's ``stop_unconfirmed``). Only
``Refused.reason == "not_running"`` means nothing runs now; any other refusal is said as the stop not executed
(critical), as ``_stop_as_asked`` says it.

A real ``Supervisor`` running the real stop procedure (``act.stop.run_stop``); the Docker engine is stubbed at the
edge, refusing the stop and the kill as ``ContainerManager._owned`` does."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_api import _daemon
from test_stop_not_kept import Manager

from sparkd.act.containerspec import StopResult
from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState as S
from sparkd.core.supervision import IntentRecord, StopIntent
from sparkd.errors import DockerUnavailable, NotFound, Refused
from sparkd.loop import supervisor as supervisor_module
from sparkd.loop.daemon import Daemon
from sparkd.loop.supervisor import Supervisor

pytestmark = pytest.mark.anyio
CID = "f" * 64
RULE = "rule low_available"
NOT_OURS = f"will not stop container 'vllm' ({CID[:12]}): it lacks the label sparkd.managed=true and is not guarded"


class RefusingManager(Manager):
    """The container runs; the engine refuses to stop or kill it (not sparkd's, as ``ContainerManager._owned``)."""

    def stop(self, cid: str, timeout_s: float = 30.0) -> StopResult:
        raise Refused(NOT_OURS, detail={"container": "vllm", "action": "stop"})

    def kill(self, cid: str) -> bool:
        raise Refused(NOT_OURS.replace("will not stop", "will not kill"), detail={"container": "vllm"})

    def stream_logs(
        self, cid: str, callback: Callable[[str], None], stop_event: threading.Event, since: float | None = None
    ) -> None:
        """Its log, followed once a run is taken (adopted): nothing more to say."""


async def _sup(tmp_path: Path, manager: Manager) -> tuple[Supervisor, Daemon, list[str | None]]:
    """The supervisor of a running guarded container, with a real daemon (its events, the rules' cooldowns); the
    third item lists each reset of the rules' cooldowns (``Daemon.event``: a trip that stopped nothing)."""
    (tmp_path / "shm").mkdir(parents=True)
    overrides: dict[str, Any] = {"shm_dir": str(tmp_path / "shm"), "container": {"guard": "vllm"}}
    settings = load_settings(overrides={"state_dir": str(tmp_path / "state"), **overrides})
    sup = Supervisor(settings, manager=manager)  # type: ignore[arg-type]
    sup._loop = lambda: asyncio.sleep(0)  # type: ignore[method-assign]  # no steps of its own: the stop only
    d = await _daemon(tmp_path, actions=sup, **overrides)
    sup.container_id, sup.state, sup.engine_up, sup.name = CID, S.READY, True, "vllm"
    sup.seen_started_at = sup.container_started_at = manager.started_at
    resets: list[str | None] = []

    def reset_cooldowns(rule_name: str | None = None) -> None:
        resets.append(rule_name)

    assert d.guard is not None
    d.guard.engine.reset_cooldowns = reset_cooldowns  # type: ignore[method-assign]
    return sup, d, resets


def _not_executed(d: Daemon) -> list[dict[str, Any]]:
    return [e for e in d.recent_events if e["kind"] == "stop_not_executed"]


async def test_an_emergency_stop_the_engine_refuses_is_said_as_not_executed_not_as_nothing_running(
    tmp_path: Path,
) -> None:
    sup, d, resets = await _sup(tmp_path, RefusingManager())
    try:
        await sup.emergency_stop(RULE, "usable 1.2 GiB < 3 GiB")
        [ev] = _not_executed(d)
        assert ev["severity"] == "critical" and ev["message"].startswith(f"{RULE}: ") and NOT_OURS in ev["message"], ev
        # not "nothing running": the rules' cooldowns are reset, so the next trip acts again while the model runs on
        assert not (ev["details"] or {}).get("nothing_running") and resets == [None], (ev, resets)
        assert sup.unattended.state.intent is None  # nothing was stopped: the intent held for the stop is released
    finally:
        await d.shutdown("test")


async def test_an_emergency_stop_of_a_model_that_is_not_running_stays_a_warning_marked_nothing_running(
    tmp_path: Path,
) -> None:
    m = Manager()
    m.running = False  # Docker says it has exited: Refused(reason="not_running")
    sup, d, resets = await _sup(tmp_path, m)
    try:
        await sup.emergency_stop(RULE, "usable 1.2 GiB < 3 GiB")
        [ev] = _not_executed(d)
        assert ev["severity"] == "warning" and ev["details"] == {"nothing_running": True}, ev
        assert "vllm is not running" in ev["message"] and resets == [], (ev, resets)  # the cooldown holds
    finally:
        await d.shutdown("test")


async def test_a_stop_finished_through_docker_that_the_engine_refuses_is_said_not_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine answers again after a stop made by the container's processes, and the run is up (its restart policy
    brought it back): the stop through Docker that finishes it is refused. It was taken for "not running": no
    ``stop_not_executed``. Docker saying the run has exited is still nothing running, and nothing is said."""
    monkeypatch.setattr(supervisor_module, "_processes_of", lambda cid: [4242])  # the run's processes are up
    for manager, said in ((RefusingManager(), True), (Manager(), False)):
        manager.running = said  # not said: Docker says it has exited (its processes not gone from /proc yet)
        sup, d, _resets = await _sup(tmp_path / str(said), manager)
        try:
            sup.state = S.STOPPING  # as the stop by processes left it
            sup.stopped_without_docker = (RULE, "usable 1.2 GiB < 3 GiB")
            await sup.finish_stop_with_docker()
            assert sup.stopped_without_docker is None  # not tried again at each step (each a critical event)
            if not said:
                assert _not_executed(d) == [], d.recent_events
                continue
            [ev] = _not_executed(d)
            assert ev["severity"] == "critical" and ev["message"].startswith(f"{RULE}: ") and NOT_OURS in ev["message"]
            assert "finishing the stop made without the engine" in ev["message"], ev
            # the run Docker brought back is read as running again (started anew), not "stopping" while it runs
            assert sup.state is S.STARTING, sup.state
        finally:
            await d.shutdown("test")


async def test_the_stop_procedures_refusal_carries_no_not_running_reason(tmp_path: Path) -> None:
    """``RunBook._stop`` raises ``Refused`` without ``reason="not_running"`` when the engine refuses the stop: the
    handlers above tell it from "nothing runs" by that code alone."""
    sup, d, _resets = await _sup(tmp_path, RefusingManager())
    try:
        with pytest.raises(Refused) as e:
            await sup._stop("usable 1.2 GiB < 3 GiB", RULE)
        assert e.value.reason is None and NOT_OURS in e.value.message, e.value
    finally:
        await d.shutdown("test")


class RemovedManager(Manager):
    """The container is gone: removed (``docker rm``, ``--rm``) after the stop made by its processes."""

    def state(self, cid: str) -> Any:
        raise NotFound(f"no such container: {cid}")


@pytest.mark.parametrize("state", [S.STOPPING, S.STOPPED])
async def test_a_stop_finished_through_docker_finds_the_container_removed_and_forgets_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state: S
) -> None:
    """The engine answers again after a stop made by the container's processes; the processes are gone and so is the
    container. The look at Docker (``reconcile``) forgets it itself when its state says so (stopped): the finish then
    forgot it a second time and failed on the missing id (an AssertionError out of the supervisor's step, helper-61).
    Either way the container is forgotten once and the finish ends quietly."""
    monkeypatch.setattr(supervisor_module, "_processes_of", lambda cid: [])  # its processes are gone
    sup, d, _resets = await _sup(tmp_path, RemovedManager())
    try:
        sup.state = state
        sup.stopped_without_docker = (RULE, "usable 1.2 GiB < 3 GiB")
        await sup.finish_stop_with_docker()
        assert sup.container_id is None and sup.stopped_without_docker is None
        assert len([e for e in d.recent_events if e["kind"] == "container_gone"]) == 1, d.recent_events
    finally:
        await d.shutdown("test")


class FailingManager(Manager):
    """The container runs; the engine answers, and its stop and kill fail with an error of their own."""

    def stop(self, cid: str, timeout_s: float = 30.0) -> StopResult:
        raise RuntimeError("docker stop: cannot stop container: permission denied")

    def kill(self, cid: str) -> bool:
        raise RuntimeError("docker kill: cannot kill container: permission denied")


def _states(d: Daemon) -> list[tuple[str, str | None]]:
    """The ``container_<state>`` events with their reasons, oldest first."""
    said = [e for e in d.recent_events if e["kind"].startswith("container_")]
    return [(e["kind"], (e["details"] or {}).get("reason")) for e in reversed(said)]


async def test_a_refused_emergency_stop_leaves_the_model_read_as_running_not_stopping(tmp_path: Path) -> None:
    """The engine refuses the stop: the model runs on. Its state stayed ``stopping`` (``core.lifecycle`` keeps it for
    as long as the run is up), so the dashboard and `sparkd status` said "stopping" for a running model. Docker's
    state is read at once: ready again, said why; the critical ``stop_not_executed`` stays."""
    sup, d, _resets = await _sup(tmp_path, RefusingManager())
    try:
        await sup.emergency_stop(RULE, "usable 1.2 GiB < 3 GiB")
        assert sup.state is S.READY and sup.lifecycle_state() == "ready", (sup.state, _states(d))
        kinds = _states(d)
        assert [k for k, _ in kinds] == ["container_stopping", "container_ready"], kinds
        assert "the stop was not executed" in (kinds[-1][1] or ""), kinds  # the state's reason says why
        [ev] = _not_executed(d)
        assert ev["severity"] == "critical", ev
    finally:
        await d.shutdown("test")


async def test_a_failed_stop_through_docker_leaves_the_model_read_as_docker_has_it(tmp_path: Path) -> None:
    """The engine answers but its stop and kill fail (no refusal, no hang): ``_stop`` raises DockerUnavailable (an
    emergency goes on by the processes). Before that, the state is read from Docker: the run is up, so ready."""
    sup, d, _resets = await _sup(tmp_path, FailingManager())
    try:
        with pytest.raises(DockerUnavailable, match="not confirmed"):
            await sup._stop("usable 1.2 GiB < 3 GiB", RULE)
        assert sup.state is S.READY, _states(d)
    finally:
        await d.shutdown("test")


async def test_a_refused_stop_of_a_run_that_exited_meanwhile_reads_stopped(tmp_path: Path) -> None:
    """The engine refuses the stop, and by the look after it Docker says the run has exited: the state follows Docker
    (``stopped``: the transition from ``stopping``), not the state before the stop."""

    class ExitsAfterRefusal(RefusingManager):
        reads_left: int | None = None  # Docker's reads until the run has exited (None: it runs)

        def kill(self, cid: str) -> bool:
            if self.reads_left is None:  # the stop's own read-back still finds it running, the look after it exited
                self.reads_left = 1
            return super().kill(cid)

        def state(self, cid: str) -> Any:
            if self.reads_left is not None:
                self.running, self.finished_at = self.reads_left > 0, time.time()
                self.reads_left -= 1
            return super().state(cid)

    sup, d, _resets = await _sup(tmp_path, ExitsAfterRefusal())
    try:
        with pytest.raises(Refused):
            await sup._stop("usable 1.2 GiB < 3 GiB", RULE)
        assert sup.state is S.STOPPED, _states(d)
    finally:
        await d.shutdown("test")


@pytest.mark.parametrize("refusing", [True, False], ids=["engine-refuses", "not-running"])
async def test_a_failed_launchs_stop_the_engine_refuses_is_critical(tmp_path: Path, refusing: bool) -> None:
    """``_stop_quietly`` (a launch never ready, stopped by sparkd) said every refusal as a warning
    ``stop_not_executed``: a stop the engine refused (the failed launch runs on, holding its memory) read as a model
    already down. Only
    ``reason="not_running"`` is a warning, marked nothing running; any other refusal is critical."""
    manager = RefusingManager() if refusing else Manager()
    manager.running = refusing
    sup, d, _resets = await _sup(tmp_path, manager)
    try:
        sup.state = S.FAILED  # not ready within container.startup_timeout_s
        await sup._stop_quietly("not ready within 600 s")
        [ev] = _not_executed(d)
        assert ev["message"].startswith("sparkd (failed launch): not ready within 600 s: "), ev
        if refusing:
            assert ev["severity"] == "critical" and NOT_OURS in ev["message"], ev
            assert not (ev["details"] or {}).get("nothing_running"), ev  # the next trip acts again
        else:
            assert ev["severity"] == "warning" and ev["details"] == {"nothing_running": True}, ev
    finally:
        await d.shutdown("test")


@pytest.mark.parametrize("refusing", [True, False], ids=["engine-refuses", "not-running"])
async def test_an_interrupted_stop_the_engine_refuses_when_resumed_is_critical(tmp_path: Path, refusing: bool) -> None:
    """An emergency stop begun before sparkd's last exit is finished at its start (``_finish_interrupted_stop``). Its
    refusal by the engine was a warning: the model ran on after an emergency, said as if nothing had failed. It is
    critical now, as ``emergency_stop`` says it; a model found not running stays a warning, marked nothing running."""
    manager = RefusingManager() if refusing else Manager()
    manager.running = refusing
    sup, d, _resets = await _sup(tmp_path, manager)
    try:
        rec = IntentRecord(StopIntent.EMERGENCY, time.time() - 5, RULE, "usable 1.2 GiB < 3 GiB")
        await sup._finish_interrupted_stop(rec)
        [ev] = _not_executed(d)
        assert ev["message"].startswith(f"{RULE} (resumed): "), ev
        if refusing:
            assert ev["severity"] == "critical" and NOT_OURS in ev["message"], ev
            assert not (ev["details"] or {}).get("nothing_running"), ev
        else:
            assert ev["severity"] == "warning" and ev["details"] == {"nothing_running": True}, ev
    finally:
        await d.shutdown("test")


@pytest.mark.parametrize("refusing", [True, False])
async def test_a_stop_at_sparkds_exit_the_engine_refuses_is_critical(tmp_path: Path, refusing: bool) -> None:
    """``container.stop_on_exit``: sparkd stops the model as it exits (``Supervisor.close``). A refusal by the engine
    was a warning, though the model then runs on with no guard at all: critical now, as every other stop says it; a
    model found exited meanwhile is no stop not executed at all."""
    manager = RefusingManager() if refusing else Manager()
    manager.running = refusing
    sup, d, _resets = await _sup(tmp_path, manager)
    sup.settings.container.stop_on_exit = True
    await d.shutdown("test")
    if not refusing:
        assert _not_executed(d) == []
        return
    [ev] = _not_executed(d)
    assert ev["message"].startswith("daemon (sparkd is stopping (container.stop_on_exit)): "), ev
    assert ev["severity"] == "critical" and NOT_OURS in ev["message"], ev
    assert not (ev["details"] or {}).get("nothing_running"), ev
