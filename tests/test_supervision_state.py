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
