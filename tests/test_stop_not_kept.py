"""A stop whose postmortem archive or stop intent could not be written (an operator's test with a read-only state
directory): sparkd said so only as critical events (``archive_failed``, ``supervision_state_not_saved``), soon pushed
down the dashboard's event list by near misses, while the stopped card and `sparkd status` kept saying the model was
stopped, with no word that the archive was missing or that the stop would not survive a restart of sparkd.

Now the status carries the last stop's archive and intent (``ContainerStatus.last_stop``), the stopped card and
`sparkd status` say what is missing, and a later write that succeeds (the held archive's retry, the state keeper's
next save) takes the warning away. A real ``Daemon`` (its store, writer, state keeper, dashboard and CLI) and a real
``Supervisor`` running the real stop procedure; only the Docker engine is stubbed at the edge. The writes fail for
real: the archive directory lies under a regular file, and ``supervision.json`` is a directory (root bypasses file
modes, so a read-only directory would not do)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_api import _client, _daemon
from test_guard_target import _card
from test_status import status_cli_output

from sparkd.act import stop as act_stop
from sparkd.act.containerspec import ContainerState as DockerState
from sparkd.act.containerspec import StopResult
from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState as S
from sparkd.face import presenters as views
from sparkd.loop.daemon import Daemon
from sparkd.loop.daemon_db import keep_files
from sparkd.loop.status import LastStopStatus
from sparkd.loop.supervisor import Supervisor

pytestmark = pytest.mark.anyio
CID = "d" * 64
RULE = "rule low_available"
ARCHIVE_LINE = "Postmortem archive NOT written:"
INTENT_LINE = "This stop is NOT saved:"


class Manager:
    """The Docker engine's side of one guarded container: it runs until ``docker stop``, then it has exited (0)."""

    def __init__(self) -> None:
        self.running = True
        self.started_at = time.time() - 600
        self.finished_at: float | None = None

    def ping(self) -> bool:
        return True

    def state(self, cid: str) -> DockerState:
        if self.running:
            return DockerState("running", True, None, False, self.started_at, None, None, None)
        return DockerState("exited", False, 0, False, self.started_at, self.finished_at, None, None)

    def stop(self, cid: str, timeout_s: float = 30.0) -> StopResult:
        self.running, self.finished_at = False, time.time()
        return StopResult("exited", 0, 0.1, timeout_s)

    def kill(self, cid: str) -> bool:
        self.running, self.finished_at = False, time.time()
        return True

    def inspect(self, cid: str) -> dict[str, Any]:
        return {"Name": "/vllm", "Config": {"Image": "vllm/vllm-openai:v1", "Env": ["HF_TOKEN=x"]}, "State": {}}

    def logs(self, cid: str, since: float | None = None, tail: int | None = None, max_bytes: int = 0) -> bytes:
        return b"INFO: vLLM serving\n"


async def _stopped_by_a_rule(
    tmp_path: Path, manager: Manager | None = None, *, blocked: bool = True
) -> tuple[Daemon, Path, Path]:
    """A guarded model stopped by a rule; ``blocked``: while neither its archive nor its stop intent can be written.
    Returns the daemon, the file the archive directory lies under, and supervision.json's path (a directory when
    ``blocked``)."""
    blocker = tmp_path / "not-a-dir"
    if blocked:
        blocker.write_text("a regular file: nothing can be made below it\n")
    manager = manager or Manager()
    (tmp_path / "shm").mkdir()
    settings = load_settings(overrides={"state_dir": str(tmp_path / "state"), **_overrides(tmp_path, blocker)})
    sup = Supervisor(settings, manager=manager)  # type: ignore[arg-type]
    sup._loop = lambda: asyncio.sleep(0)  # type: ignore[method-assign]  # no steps of its own: the stop only
    d = await _daemon(tmp_path, actions=sup, **_overrides(tmp_path, blocker))
    sup.container_id, sup.state, sup.engine_up, sup.name = CID, S.READY, True, "vllm"
    sup.seen_started_at = sup.container_started_at = manager.started_at
    state_file = sup.unattended.path
    if blocked:
        state_file.unlink(missing_ok=True)
        state_file.mkdir()  # supervision.json cannot be replaced: every save of the stop intent fails
    await sup.emergency_stop(RULE, "low_available: usable 1.2 GiB < 3 GiB")
    assert sup.state is S.STOPPED
    assert d.writer is not None
    await asyncio.to_thread(d.writer.flush)
    return d, blocker, state_file


def _overrides(tmp_path: Path, blocker: Path) -> dict[str, Any]:
    return {
        "archive_dir": str(blocker / "archives"),
        "shm_dir": str(tmp_path / "shm"),
        "container": {"guard": "vllm"},
    }


async def _stopped_card(d: Daemon) -> str:
    async with _client(d) as c:
        page = (await c.get("/")).text
    assert 'id="part-stopped"' in page
    return page.split('id="part-stopped"', 1)[1].split("</section>", 1)[0]


async def _said(d: Daemon, kind: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(e["kind"] == kind for e in d.recent_events):
        assert time.monotonic() < deadline, f"no {kind} within {timeout_s:g} s"
        await asyncio.sleep(0.05)


def _stop_event(d: Daemon) -> dict[str, Any]:
    [ev] = [e for e in d.recent_events if e["kind"] == "stopped"]
    return {k: ev[k] for k in ("kind", "message", "severity", "details", "ts")}


def _cli_json(tmp_path: Path) -> dict[str, Any]:
    """`sparkd status --json` on the database ``status_cli_output`` wrote in ``tmp_path``."""
    from click.testing import CliRunner

    from sparkd.face.cli import main

    out = CliRunner().invoke(main, ["--config", str(tmp_path / "sparkd.toml"), "status", "--json"]).output
    return dict(json.loads(out))


async def test_a_stop_whose_archive_and_intent_are_not_written_says_so_until_a_later_write_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(act_stop, "ARCHIVE_RETRY_S", 0.2)
    d, blocker, state_file = await _stopped_by_a_rule(tmp_path)
    try:
        kinds = [e["kind"] for e in d.recent_events]
        assert "archive_failed" in kinds and "supervision_state_not_saved" in kinds, kinds  # said, as before

        # the status: the last stop, its archive not written and why, its intent not on disk and why
        last = d.status_json().container.last_stop
        assert last is not None and last.source == RULE
        assert last.archive is None and last.archive_error is not None
        assert str(blocker / "archives") in last.archive_error and "tried again every 0.2 s" in last.archive_error
        assert last.intent_saved is False and last.intent_error is not None
        # the state file and the OS error, not the save's temporary file (new at each try: said again at each)
        assert last.intent_error == f"{state_file}: cannot write the supervision state: [Errno 21] Is a directory"

        # the stopped card
        card = await _stopped_card(d)
        assert f"<strong>{ARCHIVE_LINE}</strong>" in card and str(blocker / "archives") in card, card
        assert f"<strong>{INTENT_LINE}</strong> after a restart of sparkd it no longer knows" in card, card
        assert 'class="msg critical" role="alert"' in card and 'class="msg warn" role="alert"' in card
        async with _client(d) as c:  # said once on the page: the container card leaves it to the stopped card
            assert ARCHIVE_LINE not in (await c.get("/")).text.split('id="part-container"', 1)[1]

        # `sparkd status`, and its --json
        snap, stop_ev = d.status_json(), _stop_event(d)
        last = snap.container.last_stop
        assert last is not None and last.intent_error is not None
        out = status_cli_output(tmp_path / "cli", snap, stop_ev)
        assert "stopped by: emergency (rule low_available)" in out, out
        assert f"POSTMORTEM ARCHIVE NOT WRITTEN: {last.archive_error}" in out, out
        not_saved = "after a restart of sparkd it no longer knows that it stopped the model, nor why"
        assert f"THIS STOP IS NOT SAVED: {not_saved} ({last.intent_error})" in out, out
        said = _cli_json(tmp_path / "cli")["container"]["last_stop"]
        assert said["archive"] is None and said["archive_error"] == last.archive_error
        assert said["intent_saved"] is False and said["intent_error"] == last.intent_error

        # room again: the held archive's retry writes it, the state keeper's next wake saves the intent
        blocker.unlink()
        state_file.rmdir()
        await _said(d, "archive_written_late")
        await keep_files(d)
        last = d.status_json().container.last_stop
        assert last is not None and last.archive is not None and last.archive_error is None
        assert (blocker / "archives" / last.archive).is_file()
        assert last.intent_saved is True and last.intent_error is None
        assert json.loads(state_file.read_text())["intent"]["intent"] == "emergency"

        assert d.writer is not None
        await asyncio.to_thread(d.writer.flush)
        card = await _stopped_card(d)
        assert ARCHIVE_LINE not in card and INTENT_LINE not in card, card
        out = status_cli_output(tmp_path / "cli2", d.status_json(), stop_ev)
        assert "stopped by: emergency (rule low_available)" in out, out
        assert "NOT WRITTEN" not in out and "NOT SAVED" not in out, out
    finally:
        await d.shutdown("test")


async def test_an_archive_the_stop_did_not_wait_for_is_said_not_written_until_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop goes on without its archive after ``ARCHIVE_WAIT_S`` (storage slow or hung: ``archive_delayed``); the
    archive is finished in the background. Until then the last stop says it is not written, and why."""

    class SlowLogs(Manager):
        def logs(self, cid: str, since: float | None = None, tail: int | None = None, max_bytes: int = 0) -> bytes:
            time.sleep(1.0)  # the archive's slow part
            return super().logs(cid, since, tail, max_bytes)

    monkeypatch.setattr(act_stop, "ARCHIVE_WAIT_S", 0.2)
    d, blocker, _state = await _stopped_by_a_rule(tmp_path, SlowLogs(), blocked=False)
    try:
        last = d.status_json().container.last_stop
        assert last is not None and last.archive is None and last.intent_saved is True
        assert last.archive_error == (
            "the stop did not wait for it (the archive is not written within 0.2 s (its directory's storage slow or "
            "hung?)); still being written"
        )
        assert ARCHIVE_LINE in await _stopped_card(d)
        await _said(d, "archive_written_late")
        last = d.status_json().container.last_stop
        assert last is not None and last.archive_error is None and last.archive is not None
        assert (blocker / "archives" / last.archive).is_file()
        assert ARCHIVE_LINE not in await _stopped_card(d)
    finally:
        await d.shutdown("test")


async def test_an_operators_stop_says_it_on_the_container_card_and_a_managed_model_may_come_back(
    tmp_path: Path,
) -> None:
    """An operator's stop has no stopped card (the guard did not stop it): the container card says what it did not
    leave behind. In managed mode a restart of sparkd may start the model again; once written, nothing is said."""
    from test_status import _status_with_fake_actions

    base = await _status_with_fake_actions(tmp_path)
    stop = LastStopStatus(
        at=time.time() - 5,
        source="api (admin)",
        archive_error="[Errno 28] No space left on device",
        intent_saved=False,
        intent_error="supervision.json: cannot write the supervision state: [Errno 30] Read-only file system",
    )
    down = {"mode": "managed", "state": S.STOPPED, "started_at": time.time() - 600, "last_stop": stop}

    def card(**update: Any) -> list[dict[str, str]]:
        c = base.container.model_copy(update={**down, **update})
        return list(views.container_from_status(base.model_copy(update={"container": c}))["stop_not_kept"])

    said = card()
    html = _card(base.model_copy(update={"container": base.container.model_copy(update=down)}))
    assert f'<p class="msg critical" role="alert"><strong>{INTENT_LINE}</strong> after a restart of sparkd' in html
    assert f'<p class="msg warn" role="alert"><strong>{ARCHIVE_LINE}</strong> {stop.archive_error}.</p>' in html
    assert [(w["level"], w["head"]) for w in said] == [
        ("warn", "Postmortem archive NOT written"),
        ("critical", "This stop is NOT saved"),
    ]
    assert said[1]["text"] == f"after a restart of sparkd the model may be started again ({stop.intent_error})"
    assert card(state=S.READY) == []  # running: not said on a running model
    assert card(started_at=time.time()) == []  # started again since: that stop is not why this run is down
    kept = stop.model_copy(update={"archive": "a.tar.gz", "archive_error": None, "intent_saved": True})
    assert card(last_stop=kept.model_copy(update={"intent_error": None})) == []
    assert card(last_stop=kept.model_copy(update={"intent_saved": None, "intent_error": None})) == []  # no intent
