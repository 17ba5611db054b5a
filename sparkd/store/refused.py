"""Starts of ``sparkd run`` its configuration refused (a file edited into an error while the daemon ran, then a
restart): under systemd's ``Restart=always`` each start exits 2 five seconds after the last, the host is unguarded
all the while, and the next good start's history showed only ``daemon_stopped`` then ``daemon_started`` (helper-45).

``record(state_dir, error, now)`` keeps one small JSON file in the state directory (first and last refusal, UTC epoch
s; their count; the last error); ``take(state_dir)`` reads and removes it at the next start, which says it
(``Daemon``: a critical ``start_refused`` event). ``state_dir_hint`` finds the state directory of a configuration
that does not load. No database: the refusal comes before one is opened."""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from pathlib import Path
from typing import Any

from sparkd.store.supervision_state import write_atomic

FILE_NAME = "start_refused.json"


def state_dir_hint(config_path: str | Path | None, overrides: dict[str, Any] | None, default: str) -> Path:
    """The state directory a configuration that does not load would use: ``SPARKD_STATE_DIR`` (the environment wins,
    as in ``config.Settings``), the overrides', the file's own ``state_dir`` when it reads as TOML, else
    ``default``."""
    env = os.environ.get("SPARKD_STATE_DIR")
    if env:
        return Path(env)
    if overrides and isinstance(overrides.get("state_dir"), str):
        return Path(overrides["state_dir"])
    if config_path is not None:
        with contextlib.suppress(OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            found = tomllib.loads(Path(config_path).read_text()).get("state_dir")
            if isinstance(found, str):
                return Path(found)
    return Path(default)


def record(state_dir: Path, error: str, now: float) -> None:
    """Count one refused start. Never raises: a state directory that cannot be written keeps nothing (stderr, the
    journal, still has the refusal)."""
    path = state_dir / FILE_NAME
    with contextlib.suppress(Exception):
        prev = json.loads(path.read_text()) if path.exists() else {}
        rec = {
            "first_ts": prev.get("first_ts", now),
            "last_ts": now,
            "count": int(prev.get("count", 0)) + 1,
            "error": error[:600],
        }
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(path, json.dumps(rec).encode())


def take(state_dir: Path) -> dict[str, Any] | None:
    """The refused starts since the last good one (``record``'s fields), removed; None when there were none or the
    file does not read (then removed too)."""
    path = state_dir / FILE_NAME
    try:
        raw = path.read_text()
    except OSError:
        return None
    with contextlib.suppress(OSError):
        path.unlink()
    with contextlib.suppress(ValueError, TypeError):
        rec = json.loads(raw)
        numbers = isinstance(rec, dict) and all(
            isinstance(rec.get(k), int | float) and not isinstance(rec.get(k), bool) for k in ("first_ts", "last_ts")
        )
        typed = numbers and isinstance(rec.get("count"), int) and isinstance(rec.get("error"), str)
        if typed and 0 <= rec["first_ts"] <= rec["last_ts"] < 2**33:  # a start-up must not crash on a hand-edited file
            return dict(rec)
    return None
