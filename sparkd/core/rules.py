"""Stop rules — pure functions over samples (no I/O, no clock reads).

A rule counts consecutive samples on which all its ``when`` conditions hold
(and, if it has an ``evidence`` clause, at least one evidence condition holds).
The counter resets to zero as soon as a sample does not count; the rule trips
when the counter reaches ``samples`` (CONTEXT.md "The watchdog": 5 consecutive
samples, "sustained low water", not an exact timer).

Gated rules: a sample where ``when`` holds but no evidence does is a *near
miss* — recorded with its values, not counted (operators' change log: an
ungated MemFree rule stopped healthy servers).

Predictive rules (``kind = "predictive"``): a robust (Theil–Sen) slope of
MemAvailable over the last ``window_s`` seconds projects the time until
MemAvailable reaches ``floor``; the sample counts when that projection is
within ``within_s`` and the ``when`` gate holds.

Shapes:
    ``compile_rules(configs, mem_total_bytes, interval_s) -> list[Rule]``
    ``evaluate(sample, rules, states, now) -> list[Decision]`` (mutates ``states``)
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from sparkd.core.choices import RuleAction, RuleKind
from sparkd.core.conditions import parse_condition
from sparkd.core.sample import FIELD_ALIASES, SIZE_ATTRS, Sample
from sparkd.units import GiB, fmt_gib, parse_size

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


@dataclass(frozen=True, slots=True)
class Condition:
    """``attr op threshold``; ``threshold`` in bytes for size fields."""

    name: str  # as written (e.g. "MemAvailable")
    attr: str  # Sample attribute
    op: str
    threshold: float
    is_size: bool
    text: str = ""  # the condition as configured ("MemAvailable < 6GiB")

    def holds(self, sample: Sample) -> bool | None:
        """True/False, or ``None`` when the sample lacks the field."""
        v = getattr(sample, self.attr)
        if v is None:
            return None
        return _OPS[self.op](v, self.threshold)

    def describe(self, sample: Sample) -> str:
        v = getattr(sample, self.attr)
        if self.is_size:
            return f"{self.name} {fmt_gib(v)} {self.op} {fmt_gib(self.threshold)}"
        return f"{self.name} {_num(v)} {self.op} {_num(self.threshold)}"


def _fmt(c: Condition, v: float | int | None) -> str:
    return fmt_gib(v) if c.is_size else _num(v)


def _num(v: float | int | None) -> str:
    if v is None:
        return "n/a"
    return str(int(v)) if float(v).is_integer() else f"{v:.2f}"


def compile_condition(text: str, mem_total_bytes: int | None) -> Condition:
    """Resolve a condition string against MemTotal (for ``%`` thresholds).

    Raises:
        ValueError: bad condition text, or a percentage with MemTotal unknown.
    """
    name, op, value = parse_condition(text)
    attr = FIELD_ALIASES[name]
    is_size = attr in SIZE_ATTRS
    if value.endswith("%"):
        if mem_total_bytes is None:
            raise ValueError(f"{text!r}: a percentage needs MemTotal, which is unknown")
        threshold: float = float(value[:-1]) / 100.0 * mem_total_bytes
    elif is_size:
        threshold = float(parse_size(value))
    else:
        threshold = float(value)
    return Condition(name, attr, op, threshold, is_size, text.strip())


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    when: tuple[Condition, ...]
    evidence: tuple[Condition, ...]
    samples: int
    action: RuleAction
    kind: RuleKind = "threshold"
    floor_bytes: int | None = None
    within_s: float = 3.0
    window_s: float = 3.0
    for_s: float | None = None

    @property
    def gated(self) -> bool:
        return bool(self.evidence)

    def to_json(self) -> dict[str, Any]:
        """The rule as configured and compiled (thresholds in bytes for size fields)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "action": self.action,
            "samples": self.samples,
            "for_s": self.for_s,
            "when": [c.text for c in self.when],
            "evidence": [c.text for c in self.evidence],
            "thresholds": [
                {"field": c.attr, "name": c.name, "op": c.op, "value": c.threshold, "is_size": c.is_size}
                for c in self.when
            ],
            "floor_bytes": self.floor_bytes,
        }

    def floors(self) -> list[tuple[str, float]]:
        """The size thresholds of ``<``/``<=`` conditions (what "near a floor" means)."""
        out = [(c.attr, c.threshold) for c in self.when if c.is_size and c.op in ("<", "<=")]
        if self.floor_bytes is not None:
            out.append(("mem_available", float(self.floor_bytes)))
        return out


class RuleSpec(Protocol):
    """What ``compile_rules`` reads of a rule's configuration (``sparkd.config.RuleConfig``
    satisfies it; core never imports config)."""

    @property
    def name(self) -> str: ...
    @property
    def when(self) -> Sequence[str]: ...
    @property
    def evidence(self) -> Sequence[str]: ...
    @property
    def samples(self) -> int: ...
    @property
    def action(self) -> Any: ...
    @property
    def kind(self) -> Any: ...
    @property
    def floor(self) -> str | None: ...
    @property
    def within_s(self) -> float: ...
    @property
    def window_s(self) -> float: ...
    @property
    def for_s(self) -> float | None: ...


def compile_rules(
    configs: Iterable[RuleSpec], mem_total_bytes: int | None, fast_interval_s: float = 0.25
) -> list[Rule]:
    """Compile rule configs. A rule written as a duration (``for_s``) counts
    ``ceil(for_s / fast_interval_s)`` samples: while a counter is above zero the
    guard samples at the fast interval (see ``daemon``).
    """
    out = []
    for c in configs:
        n = c.samples
        if c.for_s is not None:
            n = max(1, math.ceil(c.for_s / fast_interval_s - 1e-9))
        out.append(
            Rule(
                name=c.name,
                when=tuple(compile_condition(t, mem_total_bytes) for t in c.when),
                evidence=tuple(compile_condition(t, mem_total_bytes) for t in c.evidence),
                samples=n,
                action=c.action,
                kind=c.kind,
                floor_bytes=parse_size(c.floor) if c.floor else None,
                within_s=c.within_s,
                window_s=c.window_s,
                for_s=c.for_s,
            )
        )
    return out


@dataclass(slots=True)
class RuleState:
    """Per-rule counters. ``started_mono``: monotonic time of the first counted sample."""

    counter: int = 0
    started_mono: float | None = None
    near_misses: int = 0
    trips: int = 0
    last_trip_mono: float | None = None
    last_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "counter": self.counter,
            "near_misses": self.near_misses,
            "trips": self.trips,
            "last_reason": self.last_reason,
        }


@dataclass(slots=True)
class Decision:
    """What a rule decided on one sample.

    ``kind``: ``"trip"`` (counter reached, action due), ``"near_miss"`` (gated and
    suppressed), ``"cooldown"`` (would trip but the rule is cooling down).
    """

    rule: str
    kind: Literal["trip", "near_miss", "cooldown"]
    action: RuleAction
    reason: str
    counter: int
    samples: int
    values: dict[str, Any] = field(default_factory=dict)


class SlopeWindow:
    """Recent ``(mono, MemAvailable)`` points for the predictive rules' robust slope."""

    def __init__(self, max_window_s: float = 10.0, max_points: int = 200) -> None:
        self.max_window_s = max_window_s
        self.points: deque[tuple[float, int]] = deque(maxlen=max_points)

    def add(self, mono: float, mem_available: int | None) -> None:
        if mem_available is None:
            return
        self.points.append((mono, mem_available))
        while self.points and mono - self.points[0][0] > self.max_window_s:
            self.points.popleft()

    def slope(self, now: float, window_s: float, min_points: int = 4) -> float | None:
        """Theil–Sen slope in bytes/s over the last ``window_s`` (median of pairwise slopes).

        Robust to a single outlier (one-sample dip); ``None`` with fewer than ``min_points``.
        """
        pts = [p for p in self.points if now - p[0] <= window_s + 1e-9]
        if len(pts) < min_points:
            return None
        slopes = [
            (pts[j][1] - pts[i][1]) / (pts[j][0] - pts[i][0])
            for i in range(len(pts))
            for j in range(i + 1, len(pts))
            if pts[j][0] > pts[i][0]
        ]
        if not slopes:
            return None
        slopes.sort()
        mid = len(slopes) // 2
        return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


def _projection(rule: Rule, sample: Sample, window: SlopeWindow | None, now: float) -> tuple[bool, str, dict[str, Any]]:
    assert rule.floor_bytes is not None
    avail = sample.mem_available
    if window is None or avail is None:
        return False, "", {}
    slope = window.slope(now, rule.window_s)
    if slope is None or slope >= 0:
        return False, "", {"slope_bytes_per_s": slope}
    eta = (avail - rule.floor_bytes) / -slope
    ok = eta <= rule.within_s
    named = any(c.attr == "mem_available" for c in rule.when)  # else the reason must still give the value
    text = (
        ("" if named else f"MemAvailable {fmt_gib(avail)} ") + f"falling {(-slope) / GiB:.2f} GiB/s "
        f"(robust fit over {rule.window_s:g} s), projected to cross {fmt_gib(rule.floor_bytes)} "
        f"in {max(eta, 0):.1f} s <= {rule.within_s:g} s"
    )
    return ok, text, {"slope_bytes_per_s": slope, "eta_s": eta}


def evaluate(
    sample: Sample,
    rules: Sequence[Rule],
    states: dict[str, RuleState],
    now: float,
    *,
    cooldown_s: float = 0.0,
    slope: SlopeWindow | None = None,
) -> list[Decision]:
    """Advance each rule's counter on one sample; return trips, near misses, cooldowns.

    ``now`` is the monotonic time of the sample (injected; never read here).
    ``slope`` must already contain this sample (the caller adds it first).
    """
    out: list[Decision] = []
    for rule in rules:
        st = states.setdefault(rule.name, RuleState())
        held = [c.holds(sample) for c in rule.when]
        if not all(h is True for h in held):
            st.counter, st.started_mono = 0, None
            continue
        parts = [c.describe(sample) for c in rule.when]
        values: dict[str, Any] = {c.name: getattr(sample, c.attr) for c in rule.when}
        if rule.kind == "predictive":
            ok, text, extra = _projection(rule, sample, slope, now)
            values.update(extra)
            if not ok:
                st.counter, st.started_mono = 0, None
                continue
            parts.append(text)
        if rule.evidence:
            seen = [c for c in rule.evidence if c.holds(sample) is True]
            values.update({c.name: getattr(sample, c.attr) for c in rule.evidence})
            if not seen:
                st.counter, st.started_mono = 0, None
                st.near_misses += 1
                needs = " or ".join(f"{c.name} {c.op} {_fmt(c, c.threshold)}" for c in rule.evidence)
                now_vals = ", ".join(f"{c.name} {_fmt(c, getattr(sample, c.attr))}" for c in rule.evidence)
                reason = (
                    f"{rule.name}: near miss (suppressed, not counted): {', '.join(parts)}; "
                    f"no evidence (needs {needs}; now {now_vals})"
                )
                st.last_reason = reason
                out.append(Decision(rule.name, "near_miss", rule.action, reason, 0, rule.samples, values))
                continue
            parts.append("evidence: " + " or ".join(c.describe(sample) for c in seen))
        if st.counter == 0:
            st.started_mono = now
        st.counter += 1
        if st.counter < rule.samples:
            continue
        held_s = now - (st.started_mono if st.started_mono is not None else now)
        dur = f"{held_s:.2f} s" if rule.for_s is None else f"{held_s:.2f} s, rule: for {rule.for_s:g} s"
        reason = f"{rule.name}: {', '.join(parts)} for {st.counter}/{rule.samples} samples ({dur})"
        count = st.counter
        st.counter, st.started_mono = 0, None
        if cooldown_s and st.last_trip_mono is not None and now - st.last_trip_mono < cooldown_s:
            out.append(
                Decision(
                    rule.name,
                    "cooldown",
                    rule.action,
                    reason + " [cooldown]",
                    count,
                    rule.samples,
                    values,
                )
            )
            continue
        st.trips += 1
        st.last_trip_mono = now
        st.last_reason = reason
        out.append(Decision(rule.name, "trip", rule.action, reason, count, rule.samples, values))
    return out


def still_holds(rule: Rule, sample: Sample, slope: SlopeWindow | None, now: float) -> bool:
    """Re-check before acting: does the rule's condition hold on a fresh sample?

    For predictive rules the projection must still hold (issue: re-check before acting);
    a gated rule — predictive or not — also needs its evidence, as in ``evaluate``.
    """
    if not all(c.holds(sample) is True for c in rule.when):
        return False
    if rule.kind == "predictive" and not _projection(rule, sample, slope, now)[0]:
        return False
    return not rule.evidence or any(c.holds(sample) is True for c in rule.evidence)
