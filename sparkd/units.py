"""Size and time units.

Inside sparkd every size is an ``int`` of bytes; GiB appear only at the edges
(configuration, CLI, display). ``parse_size`` is the one way a human size
string becomes bytes.
"""

from __future__ import annotations

import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": KiB,
    "kib": KiB,
    "m": MiB,
    "mb": MiB,
    "mib": MiB,
    "g": GiB,
    "gb": GiB,
    "gib": GiB,
    "t": 1024 * GiB,
    "tb": 1024 * GiB,
    "tib": 1024 * GiB,
}
# "GB" is read as GiB on purpose: operators write "6GB" and mean what free -g shows.
_SIZE_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Parse ``"6GiB"``, ``"512 MiB"``, ``"1.5g"`` or a plain number of bytes into bytes.

    Units are binary (KiB, MiB, GiB, TiB); ``kB``/``GB`` are read as binary too,
    as /proc/meminfo does for ``kB``.

    Raises:
        ValueError: the text is not a number followed by one of
            B, KiB, MiB, GiB, TiB (case-insensitive).
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int | float):
        return int(text)
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. '6GiB', '512MiB', '1.5GiB')")
    number, unit = m.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (allowed: B, KiB, MiB, GiB, TiB)")
    return int(float(number) * factor)


def gib(n_bytes: int | float | None) -> float | None:
    """Bytes → GiB as a float (``None`` stays ``None``)."""
    return None if n_bytes is None else n_bytes / GiB


def fmt_gib(n_bytes: int | float | None, digits: int = 2) -> str:
    """Bytes → ``"5.21 GiB"`` for reasons and display; ``None`` → ``"n/a"``."""
    if n_bytes is None:
        return "n/a"
    return f"{n_bytes / GiB:.{digits}f} GiB"


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration_s(text: str | int | float) -> float:
    """Parse ``"10m"``, ``"1.25s"``, ``"250ms"``, ``"2h"``, ``"7d"`` or seconds into seconds.

    Raises:
        ValueError: not a number with one of the units ms, s, m, h, d.
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    m = _DURATION_RE.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (expected e.g. '250ms', '10s', '10m', '2h', '7d')")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]
