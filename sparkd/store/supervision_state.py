"""The supervision state that must survive restarts of sparkd: breaker, stop intent, back-off counts,
the last heartbeat. One small JSON file in the state dir (``<state_dir>/supervision.json``), written
atomically (a temporary file in the same directory, ``fsync``, ``rename``, ``fsync`` of the directory),
so a crash or power loss leaves either the old or the new file, never half of one.

Shape (version 1)::

    {"version": 1,
     "breaker": {"emergencies": [[epoch_s, key], ...], "open_since": epoch_s|null, "last_alert_at": ...,
                 "rearmed_by": str|null, "rearmed_at": epoch_s|null},
     "intent": {"intent": "operator", "since": epoch_s, "who": str, "reason": str,
                "expired_alerted": bool} | null,
     "backoff": {"failures": int, "failed_launches": int},
     "heartbeat_sent_at": epoch_s | null,
     "last_stop": {"at": epoch_s, "source": str, "archive": str|null, "archive_error": str|null} | null}

``last_stop`` (``LastStopRecord``) came later: a file without it loads with none (the version is unchanged; an older
sparkd ignores the key).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkd.core.supervision import BackoffState, Breaker, IntentRecord
from sparkd.errors import StoreError

FILE_NAME = "supervision.json"
VERSION = 1


@dataclass
class LastStopRecord:
    """The last stop sparkd made (``RunBook._stop``) as it stood when last saved: when it began (``at``, epoch s),
    who asked (``source``), its postmortem archive's file name once written (``archive``), else why not
    (``archive_error``; both None while the stop was writing it). What ``ContainerStatus.last_stop`` says after a
    restart of sparkd, which holds no stop of its own then."""

    at: float
    source: str
    archive: str | None = None
    archive_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "source": self.source, "archive": self.archive, "archive_error": self.archive_error}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LastStopRecord:
        """Raises KeyError (``at`` or ``source`` missing), TypeError or ValueError (``at`` not a number)."""
        archive, error = d.get("archive"), d.get("archive_error")
        return cls(
            at=float(d["at"]),
            source=str(d["source"]),
            archive=str(archive) if archive is not None else None,
            archive_error=str(error) if error is not None else None,
        )


@dataclass
class SupervisionState:
    """What ``load`` returns and ``save`` writes (see the module docstring for the JSON)."""

    breaker: Breaker = field(default_factory=Breaker)
    intent: IntentRecord | None = None
    backoff: BackoffState = field(default_factory=BackoffState)
    heartbeat_sent_at: float | None = None
    last_stop: LastStopRecord | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "breaker": self.breaker.to_json(),
            "intent": self.intent.to_json() if self.intent else None,
            "backoff": {"failures": self.backoff.failures, "failed_launches": self.backoff.failed_launches},
            "heartbeat_sent_at": self.heartbeat_sent_at,
            "last_stop": self.last_stop.to_json() if self.last_stop else None,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SupervisionState:
        b = d.get("backoff") or {}
        return cls(
            breaker=Breaker.from_json(d.get("breaker") or {}),
            intent=IntentRecord.from_json(d["intent"]) if d.get("intent") else None,
            backoff=BackoffState(int(b.get("failures", 0)), int(b.get("failed_launches", 0))),
            heartbeat_sent_at=d.get("heartbeat_sent_at"),
            last_stop=LastStopRecord.from_json(d["last_stop"]) if d.get("last_stop") else None,
        )


def path_in(state_dir: str | Path) -> Path:
    """``<state_dir>/supervision.json``."""
    return Path(state_dir) / FILE_NAME


def load(path: Path) -> SupervisionState:
    """Read the state; a missing file is the default state (breaker closed, no intent).

    Raises:
        StoreError: the file exists but is not readable, not JSON of this shape, or of another version —
            the message names the file and what to do (sparkd refuses to guess a breaker state).
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return SupervisionState()
    except OSError as e:
        raise StoreError(f"{path}: cannot read the supervision state: {e}") from e
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise ValueError(f"version {d.get('version') if isinstance(d, dict) else None!r}, allowed: {VERSION}")
        return SupervisionState.from_json(d)
    except (ValueError, KeyError, TypeError) as e:
        raise StoreError(
            f"{path}: not a supervision state file ({type(e).__name__}: {e}); move it aside to start with a "
            "closed breaker and no stop intent"
        ) from e


def save(path: Path, state: SupervisionState) -> None:
    """Write ``state`` atomically (``write_atomic``), mode 0600.

    Raises:
        StoreError: the directory is not writable or the disk is full; the old file is left as it was.
    """
    try:
        write_atomic(path, json.dumps(state.to_json(), indent=1, sort_keys=True).encode())
    except OSError as e:
        raise StoreError(f"{path}: cannot write the supervision state: {e}") from e


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file in its directory (mode 0600), fsync, rename over
    ``path``, fsync of the directory. Raises ``OSError``; the old file, if any, is then left as it was.

    An error of the temporary file's steps names no file (``[Errno 21] Is a directory``; the caller names ``path``),
    never the temporary: its name is new at each try, so a failure that repeats read differently each time and was
    said again at each retry (``supervision_state_not_saved``, about one a minute)."""
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            if e.errno is None:
                raise
            raise OSError(e.errno, e.strerror) from e  # its subclass kept (IsADirectoryError, PermissionError…)
        tmp = None
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
