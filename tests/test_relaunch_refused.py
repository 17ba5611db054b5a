"""An automatic relaunch (``Unattended._relaunch_after``) read every ``Refused`` from its start as a failed launch: a
critical ``restart_failed`` ("auto-relaunch failed") and ``after_down(FAILED_LAUNCH)``, which doubled the back-off
and counted toward holding the model down. A start refused because the model runs already
(``reason="already_running"``), or because an action holds the supervisor (a stop under way: Conflict naming the
action), launched nothing and failed nothing: ``relaunch_skipped``, no back-off counted. A launch that failed (its
preflight refused, no reason) still counts.

A real managed ``Supervisor`` and its real ``Unattended``; the Docker engine is stubbed at the edge
(``test_stop_not_kept.Manager``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_api import _daemon
from test_stop_not_kept import Manager

from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState as S
from sparkd.core.supervision import BackoffState, Relaunch, StopIntent
from sparkd.errors import Conflict, Refused
from sparkd.loop.daemon import Daemon
from sparkd.loop.supervisor import Supervisor
from sparkd.loop.unattended import not_a_launch_failure

pytestmark = pytest.mark.anyio
CID = "e" * 64
DUE = Relaunch("relaunch", 0.0, StopIntent.EXITED, "exited: back-off 0 s")


async def _managed(tmp_path: Path, manager: Manager, state: S) -> tuple[Supervisor, Daemon]:
    """The supervisor of sparkd's own container (managed: container.image), in ``state``, with a real daemon."""
    (tmp_path / "shm").mkdir(parents=True)
    overrides: dict[str, Any] = {"shm_dir": str(tmp_path / "shm"), "container": {"image": "x:1", "name": "vllm"}}
    settings = load_settings(overrides={"state_dir": str(tmp_path / "state"), **overrides})
    sup = Supervisor(settings, manager=manager)  # type: ignore[arg-type]
    sup._loop = lambda: asyncio.sleep(0)  # type: ignore[method-assign]  # no steps of its own
    d = await _daemon(tmp_path, actions=sup, **overrides)
    sup.container_id, sup.state, sup.engine_up, sup.name = CID, state, True, "vllm"
    sup.seen_started_at = sup.container_started_at = manager.started_at
    return sup, d


def _kinds(d: Daemon) -> list[str]:
    return [e["kind"] for e in d.recent_events]


async def test_a_relaunch_of_a_model_already_running_is_skipped_not_a_failed_launch(tmp_path: Path) -> None:
    sup, d = await _managed(tmp_path, Manager(), S.READY)  # the operator started it again meanwhile
    try:
        await sup.unattended._relaunch_after(DUE)
        [ev] = [e for e in d.recent_events if e["kind"] == "relaunch_skipped"]
        assert ev["severity"] == "info" and "already running" in ev["message"], ev
        assert ev["details"]["why"] == "already_running", ev
        assert "restart_failed" not in _kinds(d) and "relaunch_decision" not in _kinds(d), _kinds(d)
        assert sup.unattended.state.backoff == BackoffState()  # no failed launch counted: the back-off as it was
        assert sup.unattended._relaunch is None  # and no new relaunch scheduled
    finally:
        await d.shutdown("test")


async def test_a_relaunch_while_a_stop_holds_the_supervisor_is_skipped_not_a_failed_launch(tmp_path: Path) -> None:
    sup, d = await _managed(tmp_path, Manager(), S.STOPPING)
    try:
        async with sup.lock:  # a stop under way (an operator's, a peer's)
            sup.action = "stopping"
            await sup.unattended._relaunch_after(DUE)
        [ev] = [e for e in d.recent_events if e["kind"] == "relaunch_skipped"]
        assert ev["severity"] == "warning" and "already stopping" in ev["message"], ev
        assert "restart_failed" not in _kinds(d) and sup.unattended.state.backoff == BackoffState(), _kinds(d)
    finally:
        await d.shutdown("test")


async def test_a_relaunch_whose_preflight_refuses_still_counts_as_a_failed_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch itself refused (its preflight: the real one has its tests in test_preflight_refusal): critical
    ``restart_failed`` and one failed launch counted, the next relaunch decided with the longer back-off."""
    m = Manager()
    m.running = False  # the model exited; the relaunch is due
    sup, d = await _managed(tmp_path, m, S.EXITED)

    async def preflight_refuses(source: str, *, force: bool = False) -> str:
        raise Refused("preflight failed: usable memory 20.0 GiB < 95.7 GiB needed (--force overrides)")

    monkeypatch.setattr(sup, "_launch", preflight_refuses)
    try:
        await sup.unattended._relaunch_after(DUE)
        [ev] = [e for e in d.recent_events if e["kind"] == "restart_failed"]
        assert ev["severity"] == "critical" and "preflight failed" in ev["message"], ev
        assert "relaunch_skipped" not in _kinds(d)
        assert sup.unattended.state.backoff.failed_launches == 1, sup.unattended.state.backoff
    finally:
        sup.unattended.cancel_relaunch("test")
        await d.shutdown("test")


@pytest.mark.parametrize(
    ("error", "severity"),
    [
        (Refused("vllm is already running (state ready); use restart", reason="already_running"), "info"),
        (Refused("vllm is guarded, not launched by sparkd", reason="guarded"), "warning"),
        (Conflict("already stopping", detail={"action": "stopping"}), "warning"),
        (Refused("preflight failed: usable memory short"), None),  # the launch refused: a failed launch
        (Conflict("Docker engine: the container name /vllm is already in use"), None),  # Docker's own 409
        (Refused("nothing runs", reason="not_running"), None),  # no start refuses so; if one did, not skipped
    ],
)
def test_it_tells_a_refused_start_from_a_failed_launch_by_its_code(
    error: Refused | Conflict, severity: str | None
) -> None:
    assert not_a_launch_failure(error) == severity
