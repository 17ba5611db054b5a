"""Locate the data directories that ship inside the wheel.

``web/`` and ``migrations/`` live at the repository's top level. A wheel carries
them as ``sparkd/web`` and ``sparkd/migrations`` (see pyproject's
``force-include``); an editable install or a checkout finds them one level up.
"""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def _find(name: str) -> Path:
    for candidate in (_PKG / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"sparkd data directory {name!r} not found next to {_PKG}")


def web_dir() -> Path:
    """Directory holding ``templates/`` and ``static/``."""
    return _find("web")


def migrations_dir() -> Path:
    """Alembic script directory (``env.py`` + ``versions/``)."""
    return _find("migrations")


def systemd_dir() -> Path:
    """Directory holding ``sparkd.service``."""
    return _find("systemd")
