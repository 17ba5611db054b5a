"""The supervisor's look for containers sparkd will not stop (``Supervisor._check_unguarded``) and its reading of
Docker's memory limits (``RunBook._follow_memory_limit``), at the edges a real engine cannot be made to hit on
cue: an action taking the lock during the ``docker ps``, no run watched, an engine error answer, a host without
swap accounting, a trip while another stop holds the lock. The Docker manager is a stub here (the edge); the
real engine's path has its own tests in ``test_e2e_docker.py`` (``…second_container_with_sparkds_labels…``,
``…docker_update_of_the_memory_limit…``) and ``test_cluster.py`` (a peer's stop)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkd.config import Settings
from sparkd.core.lifecycle import ContainerState as S
from sparkd.errors import DockerUnavailable, NotFound
from sparkd.loop.supervisor import Supervisor
from sparkd.units import GiB

WATCHED = "a" * 64
OTHER = "b" * 64


class Manager:
    """The calls ``_check_unguarded`` makes: ``get`` (by name) and ``running_managed`` (``docker ps``)."""

    def __init__(self, labelled: list[tuple[str, str, str]], during_ps: Callable[[], None] | None = None) -> None:
        self.labelled, self.during_ps, self.ps_calls = labelled, during_ps, 0
        self.fail: Exception | None = None

    def get(self, name: str) -> Any:
        raise NotFound(f"no container {name}")

    def running_managed(self) -> list[tuple[str, str, str]]:
        self.ps_calls += 1
        if self.during_ps is not None:
            self.during_ps()
        if self.fail is not None:
            raise self.fail
        return list(self.labelled)


class Events(list[dict[str, Any]]):
    """What the supervisor hands its daemon (``Daemon.event``), kept in order."""

    def __bool__(self) -> bool:  # the supervisor says events only with a daemon
        return True

    def event(self, kind: str, message: str, **kw: Any) -> None:
        self.append({"kind": kind, "message": message, **kw})


def _sup(tmp_path: Path, manager: Manager, *, watching: bool = True) -> tuple[Supervisor, Events]:
    settings = Settings(state_dir=str(tmp_path), container={"image": "sparkd-test-vllm:latest", "name": "vllm"})
    sup = Supervisor(settings, manager=manager)  # type: ignore[arg-type]
    events = Events()
    sup.daemon = events  # type: ignore[assignment]
    if watching:
        sup.container_id, sup.state = WATCHED, S.READY
    return sup, events


def _kinds(events: Events) -> list[str]:
    return [e["kind"] for e in events]


def test_a_labelled_container_beside_the_watched_run_is_said_once_and_its_end_once(tmp_path: Path) -> None:
    m = Manager([(WATCHED, "vllm", "img"), (OTHER, "vllm-copy", "img")])
    sup, events = _sup(tmp_path, m)
    asyncio.run(sup._check_unguarded())
    asyncio.run(sup._check_unguarded())
    assert _kinds(events) == ["unguarded_container"]
    assert events[0]["severity"] == "critical" and events[0]["details"]["labelled"] is True
    assert sup.unguarded is not None and sup.unguarded.id == OTHER
    m.labelled = [(WATCHED, "vllm", "img")]
    asyncio.run(sup._check_unguarded())
    assert _kinds(events) == ["unguarded_container", "unguarded_container_gone"] and sup.unguarded is None


def test_an_action_that_takes_the_lock_during_the_docker_ps_makes_the_answer_void(tmp_path: Path) -> None:
    """A relaunch's new container runs with the watched one's labels before it is watched: an answer that may hold
    it is not judged."""
    holder: dict[str, Any] = {}
    m = Manager([(WATCHED, "vllm", "img"), (OTHER, "vllm", "img")], during_ps=lambda: holder["take"]())
    sup, events = _sup(tmp_path, m)

    async def look() -> None:
        loop = asyncio.get_running_loop()
        holder["take"] = lambda: asyncio.run_coroutine_threadsafe(sup.lock.acquire(), loop).result()
        await sup._check_unguarded()

    asyncio.run(look())
    assert m.ps_calls == 1 and list(events) == [] and sup.unguarded is None


def test_no_look_while_an_action_holds_the_lock_and_what_was_said_stands(tmp_path: Path) -> None:
    m = Manager([(WATCHED, "vllm", "img"), (OTHER, "vllm-copy", "img")])
    sup, events = _sup(tmp_path, m)
    asyncio.run(sup._check_unguarded())
    m.labelled = []

    async def locked() -> None:
        async with sup.lock:
            await sup._check_unguarded()

    asyncio.run(locked())
    assert m.ps_calls == 1 and _kinds(events) == ["unguarded_container"] and sup.unguarded is not None


@pytest.mark.parametrize("state", [None, S.STOPPED, S.EXITED])
def test_no_labelled_look_while_no_run_is_watched(tmp_path: Path, state: S | None) -> None:
    """With no run watched the step adopts a labelled container first; a restarting one that cannot be adopted
    was called "beside the one sparkd watches, vllm ()" (review helper-30)."""
    m = Manager([(OTHER, "vllm-copy", "img")])
    sup, events = _sup(tmp_path, m, watching=False)
    if state is not None:
        sup.container_id, sup.state = WATCHED, state
    asyncio.run(sup._check_unguarded())
    assert m.ps_calls == 0 and list(events) == []


def test_an_engine_error_answer_to_the_docker_ps_is_logged_and_the_step_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = Manager([])
    m.fail = DockerUnavailable("list running managed containers: 500 Server Error")
    sup, events = _sup(tmp_path, m)
    asyncio.run(sup._check_unguarded())  # raised out of the step before, skipping reconcile and the probe
    assert list(events) == [] and "500 Server Error" in caplog.text


def test_adopting_the_labelled_one_said_to_be_unguarded_says_it_is_watched_now(tmp_path: Path) -> None:
    """A trip stopped the watched run; the next step adopts the labelled copy that ran beside it. Its critical
    ``unguarded_container`` had no end (``_attach`` cleared it silently)."""
    m = Manager([(WATCHED, "vllm", "img"), (OTHER, "vllm-copy", "img")])
    sup, events = _sup(tmp_path, m)
    asyncio.run(sup._check_unguarded())
    info = type("Info", (), {"id": OTHER, "image": "img", "name": "vllm-copy", "launch_id": "l2", "status": "running"})
    m.adopt = lambda: info  # type: ignore[attr-defined]
    sup.state = S.STOPPED

    async def attach() -> None:
        async def no_reconcile(**kw: Any) -> None:
            return None

        sup.reconcile = no_reconcile  # type: ignore[method-assign]
        await sup._attach(unless_busy=True)

    asyncio.run(attach())
    assert sup.container_id == OTHER and sup.unguarded is None
    gone = [e for e in events if e["kind"] == "unguarded_container_gone"]
    assert len(gone) == 1 and "is now the run sparkd watches" in gone[0]["message"], events


# --------------------------------------------------------------------------- Docker's memory limits


def _follow(sup: Supervisor, memory: int, memory_swap: int) -> None:
    sup._follow_memory_limit(memory, memory_swap)


def test_a_host_without_swap_accounting_is_not_a_change_by_hand(tmp_path: Path) -> None:
    """Docker stores MemorySwap -1 for the launch's "no swap" where the kernel has no swap accounting (moby
    verifyPlatformContainerResources): the first reading after a launch is taken without a word."""
    sup, events = _sup(tmp_path, Manager([]))
    sup.mem_limit_bytes, sup.mem_swap_bytes = 100 * GiB, None  # as _launch leaves them
    _follow(sup, 100 * GiB, -1)
    _follow(sup, 100 * GiB, -1)
    assert list(events) == [] and sup.mem_swap_bytes == -1


def test_a_memory_lowered_below_the_kept_swap_is_said_with_the_swap(tmp_path: Path) -> None:
    sup, events = _sup(tmp_path, Manager([]))
    sup.mem_limit_bytes, sup.mem_swap_bytes = 100 * GiB, None
    _follow(sup, 100 * GiB, 100 * GiB)
    _follow(sup, 90 * GiB, 100 * GiB)
    (ev,) = events
    assert ev["severity"] == "warning" and ev["details"]["swap_bytes"] == 10 * GiB, ev
    assert "--memory is 90.00 GiB now, was 100.00 GiB" in ev["message"] and "10.00 GiB of swap" in ev["message"]


def test_a_swap_only_change_names_the_swap_not_an_unchanged_memory(tmp_path: Path) -> None:
    sup, events = _sup(tmp_path, Manager([]))
    sup.mem_limit_bytes, sup.mem_swap_bytes = 100 * GiB, 0
    _follow(sup, 100 * GiB, -1)  # docker update --memory-swap -1
    (ev,) = events
    assert "--memory is" not in ev["message"] and "unlimited swap" in ev["message"], ev
    assert "plan's budget" not in ev["message"], ev


def test_memory_made_unlimited_does_not_say_the_container_may_no_longer_swap(tmp_path: Path) -> None:
    sup, events = _sup(tmp_path, Manager([]))
    sup.mem_limit_bytes, sup.mem_swap_bytes = 90 * GiB, 10 * GiB
    _follow(sup, 0, -1)
    (ev,) = events
    assert "--memory is unlimited now" in ev["message"] and "no longer swap" not in ev["message"], ev


# --------------------------------------------------------------------------- a trip while a stop is under way


def test_a_trip_while_another_stop_is_under_way_is_covered_by_it_and_keeps_its_cooldown(tmp_path: Path) -> None:
    """A peer's stop (or an operator's) held the lock when the local rule tripped: ``stop_not_executed`` reset the
    rules' cooldowns, so the rule tripped critically again every few samples through the grace, each trip
    broadcast to the peers again (helper-33). The trip is covered by the stop under way (``trip_during_stop``)."""
    m = Manager([])
    m.ping = lambda: True  # type: ignore[attr-defined]
    sup, events = _sup(tmp_path, m)

    async def trip_during_a_stop() -> None:
        async with sup.lock:  # the peer's stop
            sup.action = "stopping"
            await sup.emergency_stop("rule low_available", "MemAvailable 4.00 GiB < 6.00 GiB for 4.00 s")

    asyncio.run(trip_during_a_stop())
    assert _kinds(events) == ["trip_during_stop"], events
    assert "covers it" in events[0]["message"] and events[0]["details"]["source"] == "rule low_available"
    # the host's own emergency, though a peer's stop covers it: counted toward the breaker under the run's key
    assert [k for _t, k in sup.unattended.state.breaker.emergencies] == [WATCHED]


def test_an_emergency_stop_holds_the_apis_reading_and_lets_it_go_when_it_cannot_be_carried_out(tmp_path: Path) -> None:
    """``Supervisor.emergency_stop`` holds the API's reading from its first step (``ReadHold``; the SIGTERM's
    ``signalled`` ends it, ``test_stop``); a stop that ends before any SIGTERM (here: the engine does not answer
    and no process of the container is found) ends the hold too, or the dashboard would wait out MAX_HOLD_S."""
    from sparkd.loop.httpserver import ReadHold

    m = Manager([])
    m.ping = lambda: False  # type: ignore[attr-defined]
    sup, events = _sup(tmp_path, m)
    hold = events.read_hold = ReadHold()  # type: ignore[attr-defined]
    seen: list[bool] = []
    real = sup._stop_without_docker

    async def spy(*a: Any, **kw: Any) -> Any:
        seen.append(hold.held)  # held during the stop's steps
        return await real(*a, **kw)

    sup._stop_without_docker = spy  # type: ignore[method-assign]
    asyncio.run(sup.emergency_stop("rule low_available", "MemAvailable 4.00 GiB < 6.00 GiB for 4.00 s"))
    assert seen == [True] and hold.holds == 1
    assert not hold.held
    assert "stop_not_executed" in _kinds(events), events


def test_a_second_emergency_stop_covered_by_the_first_does_not_end_the_first_ones_api_hold(tmp_path: Path) -> None:
    """A probe failure and a memory trip in one incident: stop B begins while stop A waits on the engine's ping, ends
    with ``trip_during_stop``, and its clean-up released A's hold, so the flood of page requests held A's SIGTERM
    back again (helper-34). A hold is ended by its owner or by a SIGTERM only."""
    import time

    from sparkd.loop.httpserver import ReadHold

    m = Manager([])
    m.ping = lambda: (time.sleep(0.3), True)[1]  # type: ignore[attr-defined]  # an engine slow to answer under pressure
    sup, events = _sup(tmp_path, m)
    hold = events.read_hold = ReadHold()  # type: ignore[attr-defined]
    at_sigterm: list[tuple[str, bool]] = []

    async def request(action: str, *, source: str, reason: str | None = None, force: bool = False) -> dict[str, Any]:
        sup._refuse_if_busy()  # Conflict("already stopping") for the second stop
        async with sup.lock:
            sup.action = "stopping"
            try:
                await asyncio.sleep(0.5)  # the archive and the /dev/shm witness before the SIGTERM
                at_sigterm.append((source, hold.held))
                sup._signalled()  # run_stop's signalled: the SIGTERM goes out next
            finally:
                sup.action = None
        return {}

    sup._request = request  # type: ignore[assignment,method-assign]

    async def incident() -> None:
        a = asyncio.create_task(sup.emergency_stop("rule repeated_dips", "usable < 3 GiB"))
        await asyncio.sleep(0.05)
        b = asyncio.create_task(sup.emergency_stop("probe", "vLLM does not answer"))
        await asyncio.gather(a, b)

    asyncio.run(incident())
    assert at_sigterm == [("rule repeated_dips", True)], at_sigterm
    assert "trip_during_stop" in _kinds(events) and not hold.held and hold.holds == 1
