"""Rule condition text: ``"MemAvailable < 6GiB"`` → ``(field, op, value)``.

Used by the configuration (validation) and the rule compiler alike, so the two can
never disagree about what a condition means.
"""

from __future__ import annotations

import re

from sparkd.core.sample import FIELD_ALIASES
from sparkd.units import parse_size

_COND_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_()\-]*)\s*(<=|>=|<|>)\s*(\S+)\s*$")


def parse_condition(text: str) -> tuple[str, str, str]:
    """Split ``"MemAvailable < 6GiB"`` into ``(field, op, value)``.

    Raises:
        ValueError: not ``<field> <op> <value>``, unknown field, or a bad value.
            Allowed fields: ``FIELD_ALIASES``; ops ``< <= > >=``; values a size
            (``6GiB``), a percentage of MemTotal (``5%``) or a plain number.
    """
    m = _COND_RE.match(text)
    if not m:
        raise ValueError(f"condition {text!r} is not '<field> <op> <value>' (e.g. 'MemAvailable < 6GiB')")
    fld, op, value = m.groups()
    if fld not in FIELD_ALIASES:
        raise ValueError(f"unknown field {fld!r} in {text!r}; allowed: {', '.join(sorted(FIELD_ALIASES))}")
    if value.endswith("%"):
        pct = float(value[:-1])
        if not 0 <= pct <= 100:
            raise ValueError(f"percentage {value!r} in {text!r} must be within 0%..100%")
    else:
        parse_size(value)
    return fld, op, value
