"""The persisted supervision state on a real filesystem: round trip, atomic replace, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkd.core.supervision import BackoffState, Breaker, IntentRecord, StopIntent
from sparkd.errors import StoreError
from sparkd.store.supervision_state import SupervisionState, load, path_in, save


def test_it_starts_closed_with_no_intent_when_there_is_no_file(tmp_path: Path) -> None:
    st = load(path_in(tmp_path))
    assert not st.breaker.is_open and st.intent is None and st.backoff == BackoffState()


def test_it_round_trips_every_field(tmp_path: Path) -> None:
    p = path_in(tmp_path / "new")  # the directory is made
    st = SupervisionState(
        breaker=Breaker(emergencies=((1.0, "a"), (2.0, "b")), open_since=2.0, last_alert_at=3.0),
        intent=IntentRecord(StopIntent.OPERATOR, 5.0, "token", "stop requested"),
        backoff=BackoffState(2, 1),
        heartbeat_sent_at=9.0,
    )
    save(p, st)
    assert load(p) == st
    assert p.stat().st_mode & 0o777 == 0o600
    assert [x.name for x in p.parent.iterdir()] == ["supervision.json"]  # no temporary left behind


def test_it_replaces_the_file_by_rename(tmp_path: Path) -> None:
    p = path_in(tmp_path)
    save(p, SupervisionState())
    ino = p.stat().st_ino
    save(p, SupervisionState(backoff=BackoffState(1, 0)))
    assert p.stat().st_ino != ino and load(p).backoff.failures == 1  # a new inode: never written in place


@pytest.mark.parametrize(
    ("text", "says"), [("{", "JSONDecodeError"), ('{"version": 7}', "version 7"), ("[]", "version None")]
)
def test_it_refuses_a_file_it_cannot_read_and_names_it(tmp_path: Path, text: str, says: str) -> None:
    p = path_in(tmp_path)
    p.write_text(text)
    with pytest.raises(StoreError, match=says) as e:
        load(p)
    assert str(p) in e.value.message


def test_it_raises_naming_the_file_and_leaves_no_temporary_when_the_rename_fails(tmp_path: Path) -> None:
    p = path_in(tmp_path)
    p.mkdir()  # a directory where the file should be: rename() fails (runs as root too)
    with pytest.raises(StoreError, match="cannot write") as e:
        save(p, SupervisionState())
    assert str(p) in e.value.message
    assert [x.name for x in tmp_path.iterdir()] == ["supervision.json"] and p.is_dir()


@pytest.mark.anyio
async def test_a_deleted_file_is_written_again_from_memory_and_the_default_needs_none(tmp_path: Path) -> None:
    """``rm -rf`` of the state dir while sparkd runs deleted the stop intent and the breaker: a restart read "no
    file" as no intent and a closed breaker, and launched a model the guard had stopped. The supervisor's keeper
    (``Unattended.restore_file``, run by ``daemon_db.keep_files``) writes the state it holds again."""
    from sparkd.config import load_settings
    from sparkd.loop.supervisor import Supervisor

    state_dir = tmp_path / "state"
    settings = load_settings(overrides={"state_dir": str(state_dir), "container": {"guard": "sparkd-keep-test"}})
    u = Supervisor(settings, manager=object()).unattended  # type: ignore[arg-type]
    assert await u.restore_file() is None and not u.path.exists()  # the default state: no file is its meaning
    await u.set_intent(StopIntent.EMERGENCY, "rule low_available", "usable 1 GiB < 6 GiB")
    u.state.breaker = Breaker(emergencies=((1.0, "a"),), open_since=1.0)
    await u.save()
    written = load(u.path)
    assert await u.restore_file() is None  # the file is there: nothing to do
    u.path.unlink()
    state_dir.rmdir()
    said = await u.restore_file()
    assert said is not None and str(u.path) in said
    assert load(u.path) == written and load(u.path).intent is not None
    u.path.unlink()
    state_dir.rmdir()
    state_dir.write_text("not a directory")  # refused (as a full disk would be): raised for the keeper to log
    with pytest.raises(StoreError, match=r"supervision\.json"):
        await u.restore_file()


@pytest.mark.anyio
async def test_a_first_save_still_under_way_is_not_a_deleted_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A brand-new state dir: the first heartbeat time is set and its save is in flight (a worker thread) when the
    keeper looks: the file is not there yet, and "state_files_restored: missing while sparkd ran (deleted, …)" sent
    the operator checking disks for nothing (helper-48). A save under way is left to finish."""
    import asyncio
    import threading

    from sparkd.config import load_settings
    from sparkd.loop import unattended
    from sparkd.loop.supervisor import Supervisor

    settings = load_settings(overrides={"state_dir": str(tmp_path / "state"), "container": {"guard": "sparkd-kt"}})
    u = Supervisor(settings, manager=object()).unattended  # type: ignore[arg-type]
    gate = threading.Event()
    real = unattended.save

    def slow_save(path: Path, state: SupervisionState) -> None:
        gate.wait(5)
        real(path, state)

    monkeypatch.setattr(unattended, "save", slow_save)
    u.state.heartbeat_sent_at = 1000.0
    saving = asyncio.ensure_future(u.save())
    await asyncio.sleep(0.05)
    assert not u.path.exists()
    assert await u.restore_file() is None  # the save under way writes it: nothing was deleted
    gate.set()
    await saving
    assert load(u.path).heartbeat_sent_at == 1000.0


@pytest.mark.anyio
async def test_a_save_that_keeps_failing_is_said_once_naming_the_state_file_and_again_when_its_error_changes(
    tmp_path: Path,
) -> None:
    """The error said named the atomic write's temporary file, new at each try: the "said once per distinct error"
    check never matched, and each retry (the next save, the keeper's wake, about one a minute) raised another
    critical ``supervision_state_not_saved``, each message different, so notifications did not collapse them."""
    from sparkd.config import load_settings
    from sparkd.loop.supervisor import Supervisor

    state_dir = tmp_path / "state"
    settings = load_settings(overrides={"state_dir": str(state_dir), "container": {"guard": "sparkd-flood-test"}})
    sup = Supervisor(settings, manager=object())  # type: ignore[arg-type]
    said: list[tuple[str, str, str]] = []

    def event(kind: str, message: str, *, severity: str = "info", details: object = None) -> None:
        said.append((kind, message, severity))

    sup._event = event  # type: ignore[method-assign]
    u = sup.unattended
    u.path.mkdir(parents=True)  # supervision.json a directory: its rename fails at every try (runs as root too)
    await u.set_intent(StopIntent.EMERGENCY, "rule low_available", "usable 1 GiB < 6 GiB")
    for _ in range(3):
        await u.save()
        assert await u.restore_file() is None  # the keeper's wake tries again, and fails again
    not_saved = [(m, sev) for k, m, sev in said if k == "supervision_state_not_saved"]
    assert not_saved == [(f"{u.path}: cannot write the supervision state: [Errno 21] Is a directory", "critical")]
    assert ".supervision.json." not in not_saved[0][0] and u.unsaved() == not_saved[0][0]
    assert [x.name for x in state_dir.iterdir()] == ["supervision.json"]  # no temporary left behind

    u.path.rmdir()
    state_dir.rmdir()
    state_dir.write_text("a regular file where the state dir should be")  # another error: said again, once
    for _ in range(2):
        await u.save()
    messages = [m for k, m, _ in said if k == "supervision_state_not_saved"]
    assert len(messages) == 2 and messages[1].startswith(f"{u.path}: cannot write the supervision state: ")
    assert "File exists" in messages[1] and u.unsaved() == messages[1]

    state_dir.unlink()
    await u.save()
    assert u.unsaved() is None and load(u.path).intent is not None
    assert len([k for k, _, _ in said if k == "supervision_state_not_saved"]) == 2
