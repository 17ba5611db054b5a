"""``act.stop.run_stop`` with its dependencies handed in (no supervisor), on the real engine.

The MemAvailable reading during the grace is injected here (a reading below the hard floor on
demand); the real reading from /proc during a real grace period is covered by
``test_e2e_supervision.test_below_the_hard_floor_during_the_grace_period_it_kills_at_once``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sparkd.act import shm
from sparkd.act.docker import ContainerManager
from sparkd.act.stop import StopReport, StopTarget, run_stop
from sparkd.units import GiB

pytestmark = pytest.mark.docker
pytest_plugins = ["dockerkit"]  # fixtures: mgr, launcher, image, docker_client


def _run(
    mgr: ContainerManager,
    target: StopTarget,
    avail: list[int],
    grace_s: float,
    archive_after: bool = False,
    archived_while: list[bool] | None = None,
    removed: bool = False,
) -> tuple[StopReport, list]:
    events: list[tuple[str, str, str]] = []
    started: list[float | None] = []

    def emit(kind: str, message: str, *, severity: str = "info", details: dict[str, Any] | None = None) -> None:
        events.append((kind, severity, message))

    before: list[str] = []

    async def before_stop(rep: StopReport) -> None:
        before.append(mgr.state(target.container_id).status)  # still running when it is called

    def cleanup(started_at: float | None, stopped_at: float) -> shm.CleanupResult:
        started.append(started_at)
        assert stopped_at >= (started_at or 0)
        return shm.CleanupResult()

    signalled: list[tuple[int, bool]] = []  # (before_stop calls so far, running) when run_stop said the SIGTERM is next

    async def postmortem(rep: StopReport) -> str | None:
        if archived_while is not None:  # was the container still running when its archive was written?
            archived_while.append(mgr.state(target.container_id).running)
        return "pm.tar.gz"

    rep = asyncio.run(
        run_stop(
            target,
            mgr,
            reason="test",
            source="pytest",
            grace_s=grace_s,
            hard_floor_bytes=GiB,
            read_usable=lambda: avail[0],
            emit=emit,
            postmortem=postmortem,
            before_stop=before_stop,
            cleanup_shm=cleanup,
            archive_after=archive_after,
            signalled=lambda: signalled.append((len(before), mgr.state(target.container_id).running)),
        )
    )
    assert signalled == [(1, True)]  # once, after the last witness scan, before the SIGTERM (the API reads again)
    assert started == [target.started_at]  # the /dev/shm age test gets this run's start time
    assert before == ["running"]
    if not removed:  # a removed container has no FinishedAt to read
        assert rep.stopped_at is not None and rep.stopped_at >= (target.started_at or 0)  # Docker's FinishedAt
    return rep, events


def test_it_stops_gracefully_with_events_in_order(mgr: ContainerManager, launcher: Any) -> None:
    fv = launcher(mode="graceful", startup_s=0.2)
    assert fv.wait_healthy()  # its SIGTERM handler is in place (PID 1 ignores SIGTERM until then)
    info = mgr.get(fv.id)
    rep, events = _run(mgr, StopTarget(fv.id, fv.name, info.started_at), [8 * GiB], grace_s=10)
    assert rep.outcome == "exited" and rep.exit_code == 0 and rep.killed is False
    assert rep.archive == "pm.tar.gz" and rep.errors == []
    assert [k for k, _s, _m in events] == ["stopping", "stopped"]
    assert mgr.state(fv.id).running is False


def test_the_archive_is_written_first_or_after_the_stop_with_archive_after(
    mgr: ContainerManager, launcher: Any
) -> None:
    """The archive comes first (it reads the running container's logs); a stop made by the container's processes
    while the engine hangs writes it last (``archive_after``: nothing of the engine is in it, and its I/O under
    memory pressure must not delay the SIGTERM). Either way the final event names it."""
    for after in (False, True):
        fv = launcher(mode="graceful", startup_s=0.2)
        assert fv.wait_healthy()
        info = mgr.get(fv.id)
        running: list[bool] = []
        rep, events = _run(mgr, StopTarget(fv.id, fv.name, info.started_at), [8 * GiB], 10, after, running)
        assert running == [not after], (after, running)
        assert rep.archive == "pm.tar.gz" and "archive" in rep.durations_s
        assert [k for k, _s, _m in events] == ["stopping", "stopped"]
        assert events[-1][2].endswith("archive pm.tar.gz"), events[-1]


def test_below_the_hard_floor_during_the_grace_it_kills_at_once(mgr: ContainerManager, launcher: Any) -> None:
    fv = launcher(mode="ignore-term", startup_s=0.2)
    assert fv.wait_healthy()
    info = mgr.get(fv.id)
    rep, events = _run(mgr, StopTarget(fv.id, fv.name, info.started_at), [GiB // 2], grace_s=20)
    assert rep.hard_floor_kill is True and rep.exit_code == 137 and rep.killed is True
    assert rep.durations_s["stop"] < 10  # not the 20 s grace
    assert [k for k, _s, _m in events] == ["stopping", "hard_floor_kill", "killed"]
    assert "usable memory 0.50 GiB (MemAvailable − CmaFree) < hard floor 1.00 GiB" in events[1][2]


def test_a_container_removed_right_after_its_stop_is_stopped_not_unconfirmed(
    mgr: ContainerManager, launcher: Any
) -> None:
    """``docker run --rm`` (or ``docker rm -f`` during the stop): the inspect after the stop answers "no such
    container". Read as an unconfirmed stop, it was a critical ``stop_unconfirmed`` and a search for processes,
    though the container runs no more."""
    from sparkd.errors import NotFound

    fv = launcher(mode="graceful", startup_s=0.2)
    assert fv.wait_healthy()
    info = mgr.get(fv.id)

    class RemovedOnStop:  # the real engine; the container is removed right after its stop, as --rm does
        def __getattr__(self, name: str) -> Any:
            return getattr(mgr, name)

        def stop(self, cid: str, timeout_s: float = 30.0) -> Any:
            result = mgr.stop(cid, timeout_s)
            mgr.remove(cid)
            return result

    rep, events = _run(RemovedOnStop(), StopTarget(fv.id, fv.name, info.started_at), [8 * GiB], 10, removed=True)  # type: ignore[arg-type]
    assert rep.confirmed and rep.outcome == "exited", rep
    assert [k for k, _s, _m in events] == ["stopping", "stopped"], events
    with pytest.raises(NotFound):
        mgr.state(fv.id)


@pytest.mark.parametrize(
    ("grace_s", "spent_s", "expected"),
    [
        (30.0, 0.0, 30.0),  # nothing spent through Docker: the whole grace
        (30.0, 2.5, 27.5),  # the ping failed (engine down): the rest of the grace
        (30.0, 40.0, 5.0),  # the engine hung in docker stop for grace + margin: FALLBACK_MIN_GRACE_S, not 30 s more
        (2.0, 12.0, 2.0),  # a grace shorter than the minimum is not lengthened
        (0.0, 5.0, 0.0),
    ],
)
def test_a_stop_by_the_processes_after_docker_gets_what_is_left_of_the_grace(
    grace_s: float, spent_s: float, expected: float
) -> None:
    from sparkd.act.stop import fallback_grace_s

    assert fallback_grace_s(grace_s, spent_s) == pytest.approx(expected)


@pytest.mark.parametrize(("grace_s", "spent_s"), [(-1.0, 0.0), (30.0, -0.1)])
def test_a_negative_grace_or_time_spent_is_refused(grace_s: float, spent_s: float) -> None:
    from sparkd.act.stop import fallback_grace_s

    with pytest.raises(ValueError, match="must be >= 0"):
        fallback_grace_s(grace_s, spent_s)
