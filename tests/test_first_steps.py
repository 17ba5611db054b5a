"""The supervisor's first steps (``Supervisor._first_steps``: the budget revision, how the last launch ended) ran
outside its loop's try: a database error there ("database is locked" when ``add_revision`` writes, the config's
budget having changed) ended the supervisor's task without a word. Docker was never asked (state ``none``, engine
``unknown``), the headline read "ok", and managed mode had no autostart, /health or relaunch for as long as sparkd ran.

A real ``Daemon`` (its real SQLite store; ``Store.revision_in_effect`` raises on cue, the edge) and a real
``Supervisor`` whose Docker manager is a stub: the engine answers, one container runs."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from sparkd.act.containerspec import ContainerInfo
from sparkd.act.containerspec import ContainerState as DockerState
from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState, Probe
from sparkd.errors import NotFound
from sparkd.face import presenters as views
from sparkd.face.cli.observe import _echo_snapshot
from sparkd.face.live import live_parts, page_context
from sparkd.face.web import templates
from sparkd.loop.daemon import Daemon
from sparkd.loop.supervisor import Supervisor
from sparkd.store.store import Store

pytestmark = pytest.mark.anyio

CID = "f" * 64


class Manager:
    """The engine answers; in guard mode the guarded ``vllm`` runs (started a minute ago)."""

    def __init__(self, running: bool) -> None:
        self.started_at = time.time() - 60.0
        self.running = running
        self.calls: list[str] = []

    def ping(self) -> bool:
        self.calls.append("ping")
        return True

    def _info(self) -> ContainerInfo:
        return ContainerInfo(CID, "vllm", "img:1", "running", {}, False, None, None, None, self.started_at, None)

    def guard(self, name: str) -> ContainerInfo | None:
        self.calls.append("guard")
        return self._info() if self.running else None

    def adopt(self) -> ContainerInfo | None:
        self.calls.append("adopt")
        return None

    def get(self, name: str) -> ContainerInfo:
        raise NotFound(name)

    def running_managed(self) -> list[tuple[str, str, str]]:
        return []

    def state(self, cid: str) -> DockerState:
        self.calls.append("state")
        return DockerState("running", True, None, False, self.started_at, None, None, None)

    def inspect(self, cid: str) -> dict[str, Any]:
        return {}

    def stream_logs(self, cid: str, on_line: Any, stop: Any) -> None:
        return None


def _locked_for(monkeypatch: pytest.MonkeyPatch, failures: int) -> dict[str, int]:
    """``revision_in_effect`` raises "database is locked" ``failures`` times, then answers."""
    lock = {"calls": 0, "failures": failures}
    real = Store.revision_in_effect

    def locked(self: Store, base: dict[str, Any]) -> dict[str, Any] | None:
        lock["calls"] += 1
        if lock["calls"] <= lock["failures"]:
            raise sqlite3.OperationalError("database is locked")
        return real(self, base)

    monkeypatch.setattr(Store, "revision_in_effect", locked)
    return lock


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    said: list[tuple[str, str, str]] = []
    real = Daemon.event

    def event(self: Daemon, kind: str, message: str, *, severity: str = "info", **kw: Any) -> Any:
        said.append((kind, severity, message))
        return real(self, kind, message, severity=severity, **kw)

    monkeypatch.setattr(Daemon, "event", event)
    return said


async def _until(check: Any, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.05)


def _settings(tmp_path: Path, container: dict[str, Any]) -> Any:
    return load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "kernlog_source": "off",
            "container": {**container, "health_interval_s": 0.2},
        }
    )


async def test_a_locked_database_in_the_first_steps_is_said_and_the_guard_still_watches_docker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = _locked_for(monkeypatch, 10**6)  # locked until the test says so
    said = _recorded(monkeypatch)
    m = Manager(running=True)
    settings = _settings(tmp_path, {"guard": "vllm"})
    sup = Supervisor(settings, manager=m)  # type: ignore[arg-type]

    async def healthy() -> tuple[Probe, str | None]:
        return Probe.OK, None

    sup.check_health = healthy  # type: ignore[method-assign]
    d = Daemon(settings, actions=sup, serve_api=False)
    await d.startup()
    try:
        await _until(lambda: lock["calls"] >= 2 and sup.state is ContainerState.READY)
        assert "guard" in m.calls and "state" in m.calls  # Docker was asked, with the first steps failing
        failed = [s for s in said if s[0] == "supervisor_start_failed"]
        assert len(failed) == 1 and "database is locked" in failed[0][2], said  # said once, tried again
        assert failed[0][1] == "warning"  # guard mode: guarded as ever
        st = d.status_json()
        c = st.container
        assert c.start_error == "OperationalError: database is locked" and c.engine == "up" and c.state.value == "ready"
        h = views.headline(st.model_dump(mode="json"), None)
        assert h["level"] in ("warn", "critical") and h["label"] != "ok", h
        lock["failures"] = 0  # the database answers again
        await _until(lambda: sup.first_steps_done, 70.0)  # tried again with back-off
        assert sup.start_error is None and sup.revision is not None
        assert [s[0] for s in said if s[0].startswith("supervisor_start")] == [
            "supervisor_start_failed",
            "supervisor_start_recovered",
        ]
        assert d.status_json().container.start_error is None
        assert sup._task is not None and not sup._task.done()
    finally:
        await d.shutdown("test")


async def test_managed_mode_launches_nothing_until_the_first_steps_succeed_and_then_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = _locked_for(monkeypatch, 10**6)  # stays locked
    said = _recorded(monkeypatch)
    m = Manager(running=False)
    settings = _settings(tmp_path, {"image": "img:1", "name": "vllm"})
    sup = Supervisor(settings, manager=m)  # type: ignore[arg-type]
    starts: list[str] = []

    async def request(action: str, *, source: str, **kw: Any) -> dict[str, Any]:
        starts.append(f"{action} by {source}")
        return {}

    sup.request = request  # type: ignore[method-assign]
    d = Daemon(settings, actions=sup, serve_api=False)
    await d.startup()
    try:
        await _until(lambda: sup.start_error is not None and m.calls.count("adopt") >= 3)
        assert starts == [] and not sup.first_steps_done  # how the last launch ended is unknown: no launch
        failed = [s for s in said if s[0] == "supervisor_start_failed"]
        assert len(failed) == 1 and failed[0][1] == "critical" and "no launch at start" in failed[0][2]
        st = d.status_json()
        assert st.container.start_error == "OperationalError: database is locked"
        h = views.headline(st.model_dump(mode="json"), None)
        assert h["level"] in ("warn", "critical") and h["label"] != "ok", h
        if h["level"] == "warn":  # a host above every stop line: the headline names the failure
            assert h["label"] == "sparkd's start-up steps failed (retrying): no launch until they succeed", h
        card = views.container_from_status(st)
        assert card["start_error"] and card["level"] != "ok"
        html = (
            templates()
            .env.get_template("partials/_container.html")
            .render(**page_context(live_parts(st, None, True, 30.0)), csrf="x", logged_in=True)
        )
        assert "<strong>sparkd&#39;s start-up steps failed (retrying): no launch until they succeed.</strong>" in html
        assert "could not be read or written: OperationalError: database is locked" in html, html
        _echo_snapshot(st)  # `sparkd status`
        out = capsys.readouterr().out
        assert "START-UP STEPS FAILED: OperationalError: database is locked" in out, out
        assert "nothing is launched at start until they succeed" in out
        lock["failures"] = 0  # the database answers again
        await _until(lambda: sup.first_steps_done and starts, 70.0)
        assert starts == ["start by sparkd start-up"]
    finally:
        await d.shutdown("test")
