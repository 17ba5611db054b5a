"""Rule condition text: ``"MemAvailable < 6GiB"`` → ``(field, op, value)``.

Used by the configuration (validation) and the rule compiler alike, so the two can
never disagree about what a condition means.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from sparkd.core.sample import FIELD_ALIASES, SIZE_ATTRS
from sparkd.units import fmt_gib, parse_size

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
        attr = FIELD_ALIASES[fld]
        if attr not in SIZE_ATTRS and attr not in PSI_ATTRS:
            # "of MemTotal" on a count compiled to billions: a rule that never fired, unsaid (helper-43)
            raise ValueError(
                f"{fld} in {text!r} is a count: a percentage (of MemTotal) applies to memory sizes and PSI only; "
                f"write the number (e.g. '{fld} > 3')"
            )
    else:
        parse_size(value)
    return fld, op, value


#: PSI fields: percentages of time themselves (0..100). ``psi_full_avg10 > 20%`` means PSI 20 %, as ``> 20`` does: it
#: compiled to 20 % of MemTotal (27.5e9 on a 128 GiB host), a rule that never fired, unsaid (helper-43).
PSI_ATTRS = frozenset({"psi_some_avg10", "psi_full_avg10"})
PSI_MAX = 100.0


# fields that are part of MemTotal: a threshold above MemTotal is never crossed upward
_MEMORY_ATTRS = frozenset(
    FIELD_ALIASES[n]
    for n in ("MemAvailable", "MemFree", "Cached", "Buffers", "AnonPages", "Slab", "PageTables", "usable", "CmaFree")
)


def _bound(value: str, mem_total_bytes: int | None, attr: str = "") -> tuple[str, float]:
    """``("abs", number)`` (bytes for a size; a percentage of MemTotal when it is known; PSI's own percentage), or
    ``("%", pct)`` for a percentage of a size while MemTotal is unknown."""
    if value.endswith("%"):
        pct = float(value[:-1])
        if attr in PSI_ATTRS:
            return "abs", pct
        return ("abs", mem_total_bytes * pct / 100) if mem_total_bytes else ("%", pct)
    try:
        return "abs", float(value)
    except ValueError:
        return "abs", float(parse_size(value))


#: A memory field below this many bytes is a host that no longer answers: a line under it is a size written without
#: its unit (``MemAvailable < 6``: 6 bytes, the rule never fired and nothing said so, helper-45). 1 MiB is far below
#: any kernel's min watermark (``vm.min_free_kbytes`` is at least 128 KiB and scales with memory).
BARE_SIZE_FLOOR_BYTES = 1 << 20
#: The fields the min-watermark argument covers: CmaFree, usable, Buffers or Slab may be below 1 MiB on a host that
#: answers (``CmaFree <= 0``: the CMA region used up) (helper-46).
_FLOOR_ATTRS = frozenset({"mem_available", "mem_free"})


def condition_never_holds(
    text: str, mem_total_bytes: int | None = None, unread: Mapping[str, str] | None = None
) -> str | None:
    """Why the condition ``text`` can never hold, or None. Every field a rule reads is ≥ 0 (sizes,
    counts, PSI); a memory field never exceeds MemTotal (checked when ``mem_total_bytes`` is given) and is never below
    ``BARE_SIZE_FLOOR_BYTES`` while the host answers; a field in ``unread`` (``{attr: why}``: never read on this host,
    ``nvrm_recent`` with ``kernlog_source = "off"``) never moves."""
    fld, op, value = parse_condition(text)
    attr = FIELD_ALIASES[fld]
    if unread and attr in unread:
        return f"{fld} is not read ({unread[attr]})"
    unit, x = _bound(value, mem_total_bytes, attr)
    if (op == "<" and x <= 0) or (op == "<=" and x < 0):
        return f"{fld} is never below 0"
    if attr in _FLOOR_ATTRS and op in ("<", "<=") and unit == "abs" and x < BARE_SIZE_FLOOR_BYTES:
        bare = re.fullmatch(r"[0-9.]+", value) is not None
        return f"{fld} is never below {BARE_SIZE_FLOOR_BYTES >> 20} MiB while the host answers" + (
            f" (a size without a unit is bytes: write e.g. '{fld} {op} {value}GiB')" if bare else ""
        )
    if (
        FIELD_ALIASES[fld] in PSI_ATTRS
        and unit == "abs"
        and ((op == ">" and x >= PSI_MAX) or (op == ">=" and x > PSI_MAX))
    ):
        return f"{fld} (a share of time, %) never exceeds {PSI_MAX:g}"
    total = mem_total_bytes or 0
    memory = total > 0 and unit == "abs" and FIELD_ALIASES[fld] in _MEMORY_ATTRS
    if memory and ((op == ">" and x >= total) or (op == ">=" and x > total)):
        return f"{fld} never exceeds MemTotal ({fmt_gib(total)})"
    return None


def never_fires(
    when: Sequence[str],
    evidence: Sequence[str] = (),
    mem_total_bytes: int | None = None,
    floor: str | None = None,
    unread: Mapping[str, str] | None = None,
) -> list[str]:
    """Why a rule with these conditions can never fire (empty: it can). Pure; texts already valid.

    A ``when`` condition that never holds (``condition_never_holds``); two ``when`` conditions
    on one field that exclude each other (``MemAvailable < 4GiB`` and ``MemAvailable > 8GiB``: all
    must hold); an evidence clause none of whose conditions can hold. A predictive rule's ``floor``
    (a size) counts as one more ``when`` condition, ``MemAvailable < floor``. Percentages are
    compared as bytes when ``mem_total_bytes`` is given, else only with percentages. ``unread``: fields never read on
    this host (``unread_fields``), whose conditions never hold."""
    when = [*when, *([f"MemAvailable < {floor}"] if floor else [])]
    out = []
    for text in when:
        why = condition_never_holds(text, mem_total_bytes, unread)
        if why:
            out.append(f"{text!r} can never hold: {why}")
    if evidence and all(condition_never_holds(t, mem_total_bytes, unread) for t in evidence):
        out.append("no evidence condition can ever hold: " + ", ".join(repr(t) for t in evidence))
    # per field: the tightest upper and lower bound of the when-conditions
    upper: dict[tuple[str, str], tuple[float, bool, str]] = {}
    lower: dict[tuple[str, str], tuple[float, bool, str]] = {}
    for text in when:
        fld, op, value = parse_condition(text)
        unit, x = _bound(value, mem_total_bytes, FIELD_ALIASES[fld])
        key, strict = (FIELD_ALIASES[fld], unit), op in ("<", ">")
        bounds, tighter = (upper, x.__lt__) if op in ("<", "<=") else (lower, x.__gt__)
        cur = bounds.get(key)
        if cur is None or tighter(cur[0]) or (x == cur[0] and strict):
            bounds[key] = (x, strict, text)
    for key, (hi, hi_strict, hi_text) in upper.items():
        if key in lower:
            lo, lo_strict, lo_text = lower[key]
            if lo > hi or (lo == hi and (lo_strict or hi_strict)):
                out.append(f"{lo_text!r} and {hi_text!r} never hold together")
    return out


def unread_fields(kernlog_source: str) -> dict[str, str]:
    """``{attr: why}`` of rule fields this configuration never reads (``never_fires``' ``unread``): ``nvrm_recent``
    with ``kernlog_source = "off"`` stays 0, which read as "no driver errors" (helper-45)."""
    return {"nvrm_recent": 'kernlog_source = "off": no kernel log is read'} if kernlog_source == "off" else {}
