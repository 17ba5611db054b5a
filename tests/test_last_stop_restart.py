"""``ContainerStatus.last_stop`` (whether the last stop's postmortem archive was written, else why) lived only in
memory: after a restart of sparkd the stopped card said nothing of an archive missing for a stop made before it. It is
kept in ``supervision.json`` (``last_stop``, saved as the archive's fate changes) and read back at the start; a file
written before the field loads without it. And `sparkd status`'s "last stop's postmortem archive" line read the stop
event alone: an archive written after the event (late) was not named; it reads ``last_stop`` as the dashboard does.

A real ``Daemon`` and a real ``Supervisor`` running the real stop procedure, twice over one state directory (the
restart); only the Docker engine is stubbed at the edge (``test_stop_not_kept.Manager``). The archive's write fails
for real: its directory lies under a regular file."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_api import _daemon
from test_status import status_cli_output
from test_stop_not_kept import ARCHIVE_LINE, Manager, _stop_event, _stopped_card

from sparkd.act import stop as act_stop
from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState as S
from sparkd.loop.daemon import Daemon
from sparkd.loop.status import LastStopStatus
from sparkd.loop.supervisor import Supervisor
from sparkd.store.supervision_state import LastStopRecord, load, path_in

pytestmark = pytest.mark.anyio
CID = "c" * 64
RULE = "rule low_available"


async def _sparkd(tmp_path: Path, manager: Manager, blocker: Path) -> tuple[Supervisor, Daemon]:
    """One run of sparkd over ``tmp_path``'s state directory, guarding a running model; its archives under
    ``blocker`` (a regular file there: nothing can be written)."""
    overrides: dict[str, Any] = {
        "archive_dir": str(blocker / "archives"),
        "shm_dir": str(tmp_path / "shm"),
        "container": {"guard": "vllm"},
    }
    settings = load_settings(overrides={"state_dir": str(tmp_path / "state"), **overrides})
    sup = Supervisor(settings, manager=manager)  # type: ignore[arg-type]
    sup._loop = lambda: asyncio.sleep(0)  # type: ignore[method-assign]  # no steps of its own
    d = await _daemon(tmp_path, actions=sup, **overrides)
    sup.container_id, sup.state, sup.engine_up, sup.name = CID, S.READY, True, "vllm"
    sup.seen_started_at = sup.container_started_at = manager.started_at
    return sup, d


async def _saved(path: Path, check: Any, timeout_s: float = 5.0) -> dict[str, Any]:
    """supervision.json once ``check(its last_stop)`` holds (the save runs in the background)."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = json.loads(path.read_text()).get("last_stop") if path.exists() else None
        if check(last):
            return dict(last)
        assert time.monotonic() < deadline, f"supervision.json's last_stop: {last}"
        await asyncio.sleep(0.05)


async def test_a_stop_whose_archive_was_not_written_still_says_so_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(act_stop, "ARCHIVE_RETRY_S", 3600.0)  # no retry within the test: it stays not written
    (tmp_path / "shm").mkdir()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file: nothing can be made below it\n")
    manager = Manager()
    sup, d = await _sparkd(tmp_path, manager, blocker)
    state_file = sup.unattended.path
    try:
        await sup.emergency_stop(RULE, "low_available: usable 1.2 GiB < 3 GiB")
        assert sup.state is S.STOPPED
        before = d.status_json().container.last_stop
        assert before is not None and before.archive is None and before.archive_error, before
        # kept on disk with what became of the archive
        kept = await _saved(state_file, lambda last: bool(last and last["archive_error"]))
        assert kept["at"] == before.at and kept["source"] == RULE and kept["archive"] is None, kept
        assert str(blocker / "archives") in kept["archive_error"], kept
        stop_ev = _stop_event(d)
    finally:
        await d.shutdown("test")

    sup2, d2 = await _sparkd(tmp_path / "again", manager, blocker)  # a new daemon: its own db, its own state dir
    try:
        assert sup2.unattended.state.last_stop is None  # another state directory: nothing of that stop
    finally:
        await d2.shutdown("test")

    # the restart: a new sparkd over the same state directory, the model still stopped
    sup3, d3 = await _sparkd(tmp_path, manager, blocker)
    try:
        sup3.state = S.STOPPED
        after = d3.status_json().container.last_stop
        assert after is not None and after.at == before.at and after.source == RULE, after
        assert after.archive is None and after.archive_error is not None, after
        # its memory went with the exit: "held in memory, tried again" is not said as if still so
        # (or "lost", when the exit's last try failed and that was saved in time)
        said = ("not known to be written: sparkd restarted before saying it was", "lost: not written in")
        assert after.archive_error.startswith(said), after
        assert str(blocker / "archives") in after.archive_error, after
        assert after.intent_saved is True, after  # the emergency's intent was saved, and is read back
        card = await _stopped_card(d3)  # the stopped card of the stop made before the restart says it
        assert f"<strong>{ARCHIVE_LINE}</strong>" in card and str(blocker / "archives") in card, card
        out = status_cli_output(tmp_path / "cli", d3.status_json(), stop_ev)
        assert f"POSTMORTEM ARCHIVE NOT WRITTEN: {after.archive_error}" in out, out
    finally:
        await d3.shutdown("test")


async def test_an_archive_written_late_is_kept_and_named_after_a_restart_and_by_sparkd_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive's first write fails, its retry writes it after the stop event (which names none): supervision.json
    keeps its name; after a restart the status names it with no warning, and `sparkd status` names it too (it read
    the event alone: no archive line at all)."""
    monkeypatch.setattr(act_stop, "ARCHIVE_RETRY_S", 0.2)
    (tmp_path / "shm").mkdir()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file: nothing can be made below it\n")
    manager = Manager()
    sup, d = await _sparkd(tmp_path, manager, blocker)
    try:
        await sup.emergency_stop(RULE, "low_available: usable 1.2 GiB < 3 GiB")
        stop_ev = _stop_event(d)
        assert not (stop_ev["details"] or {}).get("archive"), stop_ev  # the event names none
        blocker.unlink()  # room again: the retry writes it
        kept = await _saved(sup.unattended.path, lambda last: bool(last and last["archive"]))
        assert kept["archive_error"] is None and (blocker / "archives" / kept["archive"]).is_file(), kept
    finally:
        await d.shutdown("test")

    sup2, d2 = await _sparkd(tmp_path, manager, blocker)
    try:
        sup2.state = S.STOPPED
        after = d2.status_json().container.last_stop
        assert after is not None and after.archive == kept["archive"] and after.archive_error is None, after
        assert ARCHIVE_LINE not in await _stopped_card(d2)
        out = status_cli_output(tmp_path / "cli", d2.status_json(), stop_ev)
        [line] = [ln for ln in out.splitlines() if ln.startswith("last stop's postmortem archive: ")]
        assert line.endswith(f"/archives/{kept['archive']}"), out  # under the archive dir of the CLI's settings
    finally:
        await d2.shutdown("test")


def test_sparkd_status_names_the_event_s_archive_for_a_stop_newer_than_the_daemon_s_last_stop(tmp_path: Path) -> None:
    """The daemon's last stop began after the newest stop event (a stop under way, its event not written yet): the
    event's stop is another; its own archive is named, not the newer stop's."""
    from sparkd.face.cli.observe import _archive_of
    from sparkd.loop.status import Status

    settings = load_settings(overrides={"state_dir": str(tmp_path / "state")})
    event = {"ts": 1000.0, "details": {"archive": "sparkd-old.tar.gz"}}
    st = Status.model_construct(container=_container(LastStopStatus(at=1001.0, source=RULE, archive="new.tar.gz")))
    assert _archive_of(settings, event, st) == str(settings.archives_path / "sparkd-old.tar.gz")
    st = Status.model_construct(container=_container(LastStopStatus(at=999.0, source=RULE, archive="late.tar.gz")))
    assert _archive_of(settings, event, st) == str(settings.archives_path / "late.tar.gz")
    assert _archive_of(settings, None, st) == str(settings.archives_path / "late.tar.gz")


def _container(last: LastStopStatus) -> Any:
    from sparkd.loop.status import ContainerStatus

    return ContainerStatus.model_construct(last_stop=last)


def test_a_supervision_state_file_without_last_stop_loads_and_one_with_it_round_trips(tmp_path: Path) -> None:
    path = path_in(tmp_path)
    old = {"version": 1, "breaker": {}, "intent": None, "backoff": {"failures": 2, "failed_launches": 0}}
    path.write_text(json.dumps(old))  # written by a sparkd before last_stop
    st = load(path)
    assert st.last_stop is None and st.backoff.failures == 2
    st.last_stop = LastStopRecord(1000.5, RULE, None, "[Errno 28] No space left on device")
    assert load_after_save(path, st).last_stop == st.last_stop


def load_after_save(path: Path, st: Any) -> Any:
    from sparkd.store.supervision_state import save

    save(path, st)
    return load(path)
