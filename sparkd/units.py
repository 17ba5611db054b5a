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
    "mib": MiB,
    "g": GiB,
    "gib": GiB,
    "t": 1024 * GiB,
    "tib": 1024 * GiB,
}
# Decimal names are refused, not guessed (issue 13: "4 GB" was read as 4 GiB, 7 % more than
# written). The message gives both exact readings. "kB" stays binary: /proc/meminfo's own unit.
_DECIMAL: dict[str, tuple[int, str]] = {"mb": (10**6, "MiB"), "gb": (10**9, "GiB"), "tb": (10**12, "TiB")}
_SIZE_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Parse ``"6GiB"``, ``"512 MiB"``, ``"1.5g"`` or a plain number of bytes into bytes.

    Units are binary (KiB, MiB, GiB, TiB; ``k``/``m``/``g``/``t`` alike); ``kB`` is
    read as KiB, as /proc/meminfo does. Decimal ``MB``/``GB``/``TB`` are refused with
    both exact readings in the message (``"4 GB"``: 4GiB, or 3.73GiB for 4×10⁹ bytes).

    Raises:
        ValueError: the text is not a number followed by one of B, KiB, MiB, GiB, TiB
            (case-insensitive), names a decimal unit, or is negative.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text!r} (allowed: 0 or more bytes)")
        return int(text)
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (expected e.g. '6GiB', '512MiB', '1.5GiB')")
    number, unit = m.groups()
    if number.startswith("-"):
        raise ValueError(f"a size cannot be negative: {text!r} (allowed: 0 or more, e.g. '6GiB')")
    if unit.lower() in _DECIMAL:
        scale, binary = _DECIMAL[unit.lower()]
        exact = float(number) * scale / _UNITS[binary.lower()]
        raise ValueError(
            f"{text!r}: decimal {unit} is ambiguous; write {number}{binary} (binary, what sparkd uses) "
            f"or {exact:.4g}{binary} for {number} × 10^{len(str(scale)) - 1} bytes"
        )
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
