"""Stop rules — pure functions over samples (no I/O, no clock reads).

A rule counts consecutive samples on which all its ``when`` conditions hold
(and, if it has an ``evidence`` clause, at least one evidence condition holds).
The counter resets to zero as soon as a sample does not count. A *count* rule
trips when the counter reaches ``samples`` (CONTEXT.md "The watchdog": 5
consecutive samples). A *duration* rule (``for_s``) trips when the condition has
held for ``for_s`` seconds (first counted sample to now) **and** over at least
``samples`` samples — so it means the same time at 1 s and at 0.25 s sampling,
and a single excursion can never trip it however coarse the sampling.

A duration rule with ``in_last_s`` (W) counts the time its condition held *in total* within the
last W seconds, consecutive or not: each counted sample holds the interval to the next sample (so a
run of consecutive samples measures as a plain duration rule does), and the rule trips on the sample at
which that total reaches ``for_s`` over at least ``samples`` counted samples in the window, a good
sample too (``_missed``: no wait for the next dip). A
signal flapping across its line at the sampling rate never trips a consecutive rule (helper-33), and
a single short excursion cannot trip this one at any sampling rate. Its trip is not re-checked on a
fresh sample (``RuleEngine.recheck``): the interval up to that sample counts as held all the same.

Gated rules: a sample where ``when`` holds but no evidence does is a *near
miss* — recorded with its values, not counted (operators' change log: an
ungated MemFree rule stopped healthy servers).

Predictive rules (``kind = "predictive"``): robust (Theil–Sen) slopes of usable
memory (MemAvailable − CmaFree; MemAvailable where the kernel reports no CMA)
project the time until it reaches ``floor``; the sample counts when a projection
is within its horizon and the ``when`` gate holds. The horizon is ``within_s``, or
(``within_s = None``, the default) the time a stop takes (``horizon_s``: the
configured grace or measured stop durations, handed in by the engine), because a
fall that reaches the floor before a stop could finish must trip now. Fits run
over doubling windows ``window_s, 2·window_s, …`` up to twice the horizon; a window
``w`` may project at most ``min(horizon, 1.5·w)`` ahead (``HORIZON_PER_WINDOW``), so
a short window only sees a short way (a fast collapse is caught by a short fit)
and a long projection needs a long, robust fit (a single ~1 GiB excursion, as
measured on healthy servers, moves the median of a long fit's pairwise slopes
by nothing).

Shapes:
    ``compile_rules(configs, mem_total_bytes) -> list[Rule]``
    ``evaluate(sample, rules, states, now, horizon_s=...) -> list[Decision]`` (mutates ``states``)
    ``core.engine.RuleEngine`` wraps these; the guard, replay and the re-check use it.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from sparkd.core.choices import RuleAction, RuleKind
from sparkd.core.conditions import PSI_ATTRS, parse_condition
from sparkd.core.sample import FIELD_ALIASES, SIZE_ATTRS, Sample
from sparkd.core.slope import WINDOW_EDGE_S, SlopeWindow
from sparkd.units import GiB, MiB, fmt_gib, parse_size

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
    #: ``_OPS[op]``, looked up once: ``evaluate`` compares inline every tick (issue 18)
    compare: Callable[[Any, Any], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compare", _OPS[self.op])

    def holds(self, sample: Sample) -> bool | None:
        """True/False, or ``None`` when the sample lacks the field."""
        v = getattr(sample, self.attr)
        if v is None:
            return None
        return self.compare(v, self.threshold)

    def describe(self, sample: Sample) -> str:
        v = getattr(sample, self.attr)
        if self.is_size:
            return f"{self.name} {fmt_gib(v)} {self.op} {fmt_gib(self.threshold)}"
        return f"{self.name} {_num(v)} {self.op} {_num(self.threshold)}"


def _fmt(c: Condition, v: float | int | None) -> str:
    if c.is_size and v is not None and 0 < abs(v) < GiB / 100:  # "MemFree < 2MiB" read "< 0.00 GiB"
        return f"{v / MiB:.1f} MiB"
    return fmt_gib(v) if c.is_size else _num(v)


def _num(v: float | int | None) -> str:
    if v is None:
        return "n/a"
    return str(int(v)) if float(v).is_integer() else f"{v:.2f}"


class MemTotalUnknown(ValueError):
    """A ``%`` threshold compiled while MemTotal is unknown (``compile_condition``)."""


def compile_condition(text: str, mem_total_bytes: int | None) -> Condition:
    """Resolve a condition string against MemTotal (for ``%`` thresholds).

    Raises:
        ValueError: bad condition text; ``MemTotalUnknown`` (a ValueError): a percentage with MemTotal unknown.
    """
    name, op, value = parse_condition(text)
    attr = FIELD_ALIASES[name]
    is_size = attr in SIZE_ATTRS
    if value.endswith("%") and attr in PSI_ATTRS:  # PSI is a percentage itself
        threshold: float = float(value[:-1])
    elif value.endswith("%"):
        if mem_total_bytes is None:
            raise MemTotalUnknown(f"{text!r}: a percentage needs MemTotal, which is unknown")
        threshold = float(value[:-1]) / 100.0 * mem_total_bytes
    elif is_size:
        threshold = float(parse_size(value))
    else:
        threshold = float(value)
    return Condition(name, attr, op, threshold, is_size, text.strip())


#: Minimum consecutive samples of a duration rule (``for_s``) when ``samples`` is not given:
#: one sample is an excursion, two may be the same excursion seen twice; three are a trend.
DURATION_MIN_SAMPLES = 3

#: How far ahead a fit over ``w`` seconds may project: ``1.5·w`` (the seed predictive rule
#: projected 3 s from a 2 s fit; a 30 s stop horizon therefore needs a fit of at least 20 s).
HORIZON_PER_WINDOW = 1.5

#: The stop horizon when none is handed in: ``container.stop_timeout_s``'s default (30 s).
DEFAULT_HORIZON_S = 30.0


@dataclass(frozen=True, slots=True)
class Rule:
    """A compiled rule. ``samples``: the consecutive samples needed (a count rule) or the
    minimum (a duration rule, ``for_s`` set). ``within_s``: a predictive rule's fixed
    horizon, or ``None`` for the stop horizon the engine hands in. Sizes in bytes."""

    name: str
    when: tuple[Condition, ...]
    evidence: tuple[Condition, ...]
    samples: int
    action: RuleAction
    kind: RuleKind = "threshold"
    floor_bytes: int | None = None
    within_s: float | None = None
    window_s: float = 2.0
    for_s: float | None = None
    #: a duration rule's window (s): ``for_s`` held in total within the last ``in_last_s`` (None: consecutive)
    in_last_s: float | None = None
    #: ``inputs()`` as a tuple, computed once (``blind_reason`` reads it every tick)
    input_attrs: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_attrs", tuple(self.inputs()))

    @property
    def gated(self) -> bool:
        return bool(self.evidence)

    @property
    def duration_based(self) -> bool:
        return self.for_s is not None

    def horizon(self, horizon_s: float) -> float:
        """The longest projection this predictive rule makes (s)."""
        return self.within_s if self.within_s is not None else horizon_s

    def fit_windows(self, horizon_s: float) -> list[tuple[float, float]]:
        """``[(window_s, horizon_s), ...]``: doubling fit windows from ``window_s`` until one
        covers twice the horizon, each with the projection it may make."""
        h = self.horizon(horizon_s)
        out = []
        w = self.window_s
        while True:
            out.append((w, min(h, HORIZON_PER_WINDOW * w)))
            if w >= 2 * h or len(out) >= 12:
                return out
            w *= 2

    def inputs(self) -> list[str]:
        """The sample attributes this rule reads (``when``, ``evidence``, the projection)."""
        out = [c.attr for c in (*self.when, *self.evidence)]
        if self.kind == "predictive":
            out.append("mem_available_minus_cma")
        return list(dict.fromkeys(out))

    def to_json(self) -> dict[str, Any]:
        """The rule as configured and compiled (thresholds in bytes for size fields)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "action": self.action,
            "samples": self.samples,
            "for_s": self.for_s,
            "duration_based": self.duration_based,
            "when": [c.text for c in self.when],
            "evidence": [c.text for c in self.evidence],
            "thresholds": [
                {"field": c.attr, "name": c.name, "op": c.op, "value": c.threshold, "is_size": c.is_size}
                for c in self.when
            ],
            "floor_bytes": self.floor_bytes,
            "within_s": self.within_s,
            "window_s": self.window_s,
            "in_last_s": self.in_last_s,
        }

    def _size_limits(self) -> list[tuple[str, float]]:
        return [(c.attr, c.threshold) for c in self.when if c.is_size and c.op in ("<", "<=")]

    def watch_levels(self) -> list[tuple[str, float]]:
        """A predictive rule's size gates (where it starts projecting; e.g. usable < 16 GiB), else none.

        Below one the guard samples fast, so the projection has points to fit; it is no stop line.
        """
        return self._size_limits() if self.kind == "predictive" else []

    def floors(self) -> list[tuple[str, float]]:
        """The size thresholds of ``<``/``<=`` conditions (what "near a floor" means).

        A predictive rule's ``when`` is only where it starts watching (the arming gate, e.g. 16 GiB):
        its floor is ``floor_bytes`` alone; the gate is never a stop line.
        """
        out = [] if self.kind == "predictive" else self._size_limits()
        if self.floor_bytes is not None:
            out.append(("mem_available_minus_cma", float(self.floor_bytes)))
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
    def samples(self) -> int | None: ...
    @property
    def action(self) -> Any: ...
    @property
    def kind(self) -> Any: ...
    @property
    def floor(self) -> str | None: ...
    @property
    def within_s(self) -> float | None: ...
    @property
    def window_s(self) -> float: ...
    @property
    def for_s(self) -> float | None: ...
    @property
    def in_last_s(self) -> float | None: ...


def default_samples(c: RuleSpec) -> int:
    """The samples a rule needs: as configured, else 5 for a count rule (the seed) and ``DURATION_MIN_SAMPLES``
    for a duration rule (``for_s``)."""
    return c.samples if c.samples is not None else (5 if c.for_s is None else DURATION_MIN_SAMPLES)


def compile_rules(configs: Iterable[RuleSpec], mem_total_bytes: int | None) -> list[Rule]:
    """Compile rule configs. ``samples`` unset: 5 for a count rule (the seed), and
    ``DURATION_MIN_SAMPLES`` for a duration rule (``for_s``).

    Raises:
        ValueError: a bad condition, or a ``%`` threshold with MemTotal unknown.
    """
    out = []
    for c in configs:
        n = default_samples(c)
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
                in_last_s=c.in_last_s,
            )
        )
    return out


@dataclass(slots=True)
class RuleState:
    """Per-rule counters. ``started_mono``: monotonic time of the first counted sample.

    ``blind``: why the rule could not evaluate on the last sample (an input it needs was
    not read), or ``None``. ``idle_trips``: of ``trips``, those with the model down (``RuleEngine.note_idle_trip``).
    ``holds``: the rule's conditions (its projection, its evidence) held on the last sample, whatever its counter
    (0 right after a trip, which starts it again).
    A rule with ``in_last_s``: ``recent`` holds ``(start, seconds)`` of each
    interval it held in its window, ``held_total_s`` their sum, ``prev_mono`` / ``prev_held`` the last
    sample; ``counter`` is then the counted samples in the window."""

    counter: int = 0
    started_mono: float | None = None
    near_misses: int = 0
    trips: int = 0
    idle_trips: int = 0
    holds: bool = False
    last_trip_mono: float | None = None
    last_reason: str | None = None
    blind: str | None = None
    recent: collections.deque[tuple[float, float]] | None = None
    held_total_s: float = 0.0
    prev_mono: float | None = None
    prev_held: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "counter": self.counter,
            "near_misses": self.near_misses,
            "trips": self.trips,
            "idle_trips": self.idle_trips,
            "holds": self.holds,
            "last_reason": self.last_reason,
            "blind": self.blind,
        }


@dataclass(slots=True)
class Decision:
    """What a rule decided on one sample.

    ``kind``: ``"trip"`` (counter reached, action due), ``"near_miss"`` (gated and
    suppressed), ``"cooldown"`` (would trip but the rule is cooling down).
    ``mono``: the sample's monotonic time (``None`` for decisions made outside the rules).
    """

    rule: str
    kind: Literal["trip", "near_miss", "cooldown"]
    action: RuleAction
    reason: str
    counter: int
    samples: int
    values: dict[str, Any] = field(default_factory=dict)
    mono: float | None = None


def stop_lines(rule: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A rule's stop lines for a chart, from ``Rule.to_json()``'s shape (or the status's rule, which has it):
    ``[{"field": sample attribute, "label": its name, "value": bytes}]``.

    A threshold rule: each size condition of ``when`` (``usable < 6GiB`` → field
    ``mem_available_minus_cma``, label ``usable``). A predictive rule: its projected ``floor_bytes`` on
    usable memory, labelled ``usable (projected)``; its ``when`` only arms the projection (issue 14).
    """
    if rule["kind"] == "predictive":
        floor = rule.get("floor_bytes")
        return (
            []
            if floor is None
            else [{"field": "mem_available_minus_cma", "label": "usable (projected)", "value": floor}]
        )
    return [{"field": t["field"], "label": t["name"], "value": t["value"]} for t in rule["thresholds"] if t["is_size"]]


def usable_bytes(sample: Sample) -> int | None:
    """Usable memory: MemAvailable − CmaFree (MemAvailable where no CMA is reported)."""
    return sample.mem_available_minus_cma


#: A projected crossing nearer than this (s) is said as "at or below the floor already" (it printed "in 0.0 s").
ETA_SAID_S = 0.05


def _projection(
    rule: Rule, sample: Sample, window: SlopeWindow | None, now: float, horizon_s: float
) -> tuple[bool, str, dict[str, Any]]:
    assert rule.floor_bytes is not None
    avail = usable_bytes(sample)
    if window is None or avail is None:
        return False, "", {}
    best: tuple[float, float, float, float] | None = None  # (eta, slope, window, horizon)
    first_slope: float | None = None
    for w, h in rule.fit_windows(horizon_s):
        slope = window.slope(now, w)
        if slope is None:
            continue
        if first_slope is None:
            first_slope = slope
        if slope >= 0:
            continue
        # the projection reaches as far as the points reach back, not as far as the window could
        h = min(h, HORIZON_PER_WINDOW * window.span(now, w))
        eta = (avail - rule.floor_bytes) / -slope
        if eta <= h:
            best = (eta, slope, w, h)
            break
    if best is None:
        return False, "", {"slope_bytes_per_s": first_slope}
    eta, slope, w, h = best
    named = any(c.attr in ("mem_available", "mem_available_minus_cma") for c in rule.when)
    cma = sample.cma_free is not None and sample.cma_total
    label = "usable (MemAvailable-CmaFree)" if cma else "MemAvailable"
    # helper-37 read "projected to cross 4.00 GiB in 0.0 s" when usable was below it already, and "<= 5.6 s (a stop
    # takes up to 30 s)" as a contradiction: the first is the projection's reach (the fit's points), not the stop's
    stop = "" if rule.within_s is not None else f"; a stop takes up to {horizon_s:g} s"
    crossing = (
        f"projected to cross {fmt_gib(rule.floor_bytes)} in {eta:.1f} s (it looks {_secs(h)} s ahead{stop})"
        if eta >= ETA_SAID_S
        else f"at or below the projection's floor {fmt_gib(rule.floor_bytes)} already"
    )
    text = (
        "" if named else f"{label} {fmt_gib(avail)} "
    ) + f"falling {(-slope) / GiB:.2f} GiB/s (robust fit over {w:g} s), {crossing}"
    return True, text, {"slope_bytes_per_s": slope, "eta_s": eta, "fit_window_s": w}


def _secs(v: float) -> str:
    """Seconds to a tenth, without a trailing ``.0``: 24 → "24", 5.62621 → "5.6" (a horizon cut to the
    points' reach, which ``:g`` printed as 5.62621)."""
    return f"{v:.1f}".removesuffix(".0")


_INPUT_NAMES = {
    "mem_available": "MemAvailable",
    "mem_free": "MemFree",
    "mem_available_minus_cma": "MemAvailable",
    "psi_some_avg10": "PSI",
    "psi_full_avg10": "PSI",
    "shm_bytes": "/dev/shm",
}


def missing_inputs(rule: Rule, sample: Sample) -> list[str]:
    """The inputs ``rule`` needs that ``sample`` lacks (``None``), by name (``MemAvailable``, ``PSI``…); ``[]`` when
    it can evaluate. A ``when`` input missing, every ``evidence`` input missing, or (predictive) no usable memory
    figure."""
    for attr in rule.input_attrs:  # the common case, every input read: nothing to explain
        if getattr(sample, attr) is None:
            break
    else:
        return []
    missing = [c for c in rule.when if getattr(sample, c.attr) is None]
    if rule.evidence and all(getattr(sample, c.attr) is None for c in rule.evidence):
        missing += list(rule.evidence)
    names = list(dict.fromkeys(_INPUT_NAMES.get(c.attr, c.name) for c in missing))
    if rule.kind == "predictive" and usable_bytes(sample) is None and "MemAvailable" not in names:
        names.append("MemAvailable")
    return names


def blind_reason(rule: Rule, sample: Sample) -> str | None:
    """Why ``rule`` cannot evaluate on ``sample`` (``missing_inputs``), or ``None``: it can never count, which must
    not read as a quiet 0/N."""
    names = missing_inputs(rule, sample)
    return f"cannot evaluate: {', '.join(names)} not read" if names else None


def evaluate(
    sample: Sample,
    rules: Sequence[Rule],
    states: dict[str, RuleState],
    now: float,
    *,
    cooldown_s: float = 0.0,
    slope: SlopeWindow | None = None,
    horizon_s: float = DEFAULT_HORIZON_S,
) -> list[Decision]:
    """Advance each rule's counter on one sample; return trips, near misses, cooldowns.

    ``now`` is the monotonic time of the sample (injected; never read here).
    ``slope`` must already contain this sample (the caller adds it first).
    ``horizon_s``: the time a stop takes (predictive rules without ``within_s``).
    Each rule's ``RuleState.blind`` is set when one of its inputs is missing.
    """
    out: list[Decision] = []
    for rule in rules:
        st = states.get(rule.name)
        if st is None:  # (not setdefault: that builds a RuleState every tick, issue 18)
            st = states[rule.name] = RuleState()
        # an idle tick runs this loop for every rule: the common cases are inline, without a frame per rule and
        # condition (a cold tick pays for each one, issue 18); ``blind_reason``, ``Condition.holds`` and ``_missed``
        # say the same in full
        for attr in rule.input_attrs:
            if getattr(sample, attr) is None:
                st.blind = blind_reason(rule, sample)
                break
        else:  # every input read: not blind
            st.blind = None
        st.holds = False  # until _held finds every condition and the evidence hold
        for c in rule.when:  # the first condition that does not hold (False, or None: not read) ends it
            v = getattr(sample, c.attr)
            if v is None or not c.compare(v, c.threshold):
                if rule.in_last_s is None:  # a consecutive rule starts again (``_missed``)
                    st.counter, st.started_mono = 0, None
                elif not st.prev_held and not st.recent:  # a windowed rule with nothing held in its window
                    st.prev_mono = now  # (``_window`` with held=False: the window stays empty, nothing can trip)
                    st.held_total_s, st.counter, st.started_mono = 0.0, 0, None
                elif (d := _missed(rule, st, sample, now, cooldown_s)) is not None:
                    out.append(d)
                break
        else:
            d = _held(rule, st, sample, now, cooldown_s, slope, horizon_s)
            if d is not None:
                out.append(d)
    return out


def _held(
    rule: Rule,
    st: RuleState,
    sample: Sample,
    now: float,
    cooldown_s: float,
    slope: SlopeWindow | None,
    horizon_s: float,
) -> Decision | None:
    """``evaluate`` for a rule whose every ``when`` holds on ``sample``: projection, evidence, counter;
    the rule's decision on it, if any."""
    parts = [c.describe(sample) for c in rule.when]
    values: dict[str, Any] = {c.name: getattr(sample, c.attr) for c in rule.when}
    if rule.kind == "predictive":
        ok, text, extra = _projection(rule, sample, slope, now, horizon_s)
        values.update(extra)
        if not ok:
            st.counter, st.started_mono = 0, None
            return None
        parts.append(text)
    if rule.evidence:
        seen = [c for c in rule.evidence if c.holds(sample) is True]
        values.update({c.name: getattr(sample, c.attr) for c in rule.evidence})
        if not seen:
            if (d := _missed(rule, st, sample, now, cooldown_s)) is not None:
                return d  # the window's total reached for_s with the interval up to this sample: that decides
            st.near_misses += 1
            needs = " or ".join(f"{c.name} {c.op} {_fmt(c, c.threshold)}" for c in rule.evidence)
            now_vals = ", ".join(f"{c.name} {_fmt(c, getattr(sample, c.attr))}" for c in rule.evidence)
            reason = (
                f"{rule.name}: near miss (suppressed, not counted): {', '.join(parts)}; "
                f"no evidence (needs {needs}; now {now_vals})"
            )
            st.last_reason = reason
            return Decision(rule.name, "near_miss", rule.action, reason, 0, rule.samples, values, now)
        parts.append("evidence: " + " or ".join(c.describe(sample) for c in seen))
    st.holds = True
    if rule.in_last_s is not None:
        _window(rule, st, now, held=True)
        held_s = st.held_total_s
    else:
        if st.counter == 0:
            st.started_mono = now
        st.counter += 1
        held_s = now - (st.started_mono if st.started_mono is not None else now)
    return _judge(rule, st, now, held_s, parts, values, cooldown_s)


def _judge(
    rule: Rule,
    st: RuleState,
    now: float,
    held_s: float,
    parts: list[str],
    values: dict[str, Any],
    cooldown_s: float,
) -> Decision | None:
    """The rule's decision once its counter and held time are up to date: a trip (or a cooldown) when both are
    reached, else None."""
    # a duration ends on the sample at for_s, however its time was measured (see WINDOW_EDGE_S)
    if st.counter < rule.samples or (rule.for_s is not None and held_s < rule.for_s - WINDOW_EDGE_S):
        return None
    if rule.in_last_s is not None:
        dur = (
            f"for {held_s:.2f} s in total within the last {rule.in_last_s:g} s over {st.counter} samples "
            f"(rule: {rule.for_s:g} s, at least {rule.samples})"
        )
    elif rule.for_s is None:
        dur = f"for {st.counter}/{rule.samples} samples ({held_s:.2f} s)"
    else:
        dur = f"for {held_s:.2f} s over {st.counter} samples (rule: {rule.for_s:g} s, at least {rule.samples})"
    reason = f"{rule.name}: {', '.join(parts)} {dur}"
    count = st.counter
    start_again(st)
    if cooldown_s and st.last_trip_mono is not None and now - st.last_trip_mono < cooldown_s:
        return Decision(rule.name, "cooldown", rule.action, reason + " [cooldown]", count, rule.samples, values, now)
    st.trips += 1
    st.last_trip_mono = now
    st.last_reason = reason
    return Decision(rule.name, "trip", rule.action, reason, count, rule.samples, values, now)


def _missed(rule: Rule, st: RuleState, sample: Sample, now: float, cooldown_s: float) -> Decision | None:
    """``rule`` on a sample where it does not count. A consecutive rule starts again (None). A windowed rule keeps
    its window, and the interval up to this sample counts as held when the previous one did, so the window's total
    may reach ``for_s`` here: the rule trips now, not at the next dip (a flapping signal's good phase is no reason
    to wait; helper-35 measured one whole phase of delay)."""
    if rule.in_last_s is None:
        st.counter, st.started_mono = 0, None
        return None
    _window(rule, st, now, held=False)
    if st.counter < rule.samples:
        return None
    now_vals = ", ".join(f"{c.name} {_fmt(c, getattr(sample, c.attr))}" for c in rule.when)
    parts = [f"{' and '.join(c.text for c in rule.when)} (now {now_vals})"]
    values = {c.name: getattr(sample, c.attr) for c in rule.when}
    return _judge(rule, st, now, st.held_total_s, parts, values, cooldown_s)


def _window(rule: Rule, st: RuleState, now: float, *, held: bool) -> None:
    """One sample at ``now`` into a windowed rule's state: the interval since the previous sample counts as held when
    that sample was counted; intervals that began before ``now - in_last_s`` leave the window."""
    assert rule.in_last_s is not None
    recent = st.recent
    if recent is None:
        recent = st.recent = collections.deque()
    if st.prev_held and st.prev_mono is not None and now > st.prev_mono:
        recent.append((st.prev_mono, now - st.prev_mono))
    edge = now - rule.in_last_s
    while recent and recent[0][0] < edge:
        recent.popleft()
    st.prev_mono, st.prev_held = now, held
    st.held_total_s = sum(d for _t, d in recent)
    st.counter = len(recent) + held
    st.started_mono = recent[0][0] if recent else (now if held else None)


def start_again(st: RuleState) -> None:
    """A rule's counter starts again from nothing, a windowed rule's window too (after its trip, a relief)."""
    if st.recent is not None:
        st.recent.clear()
    st.held_total_s, st.prev_held, st.counter, st.started_mono = 0.0, False, 0, None


def still_holds(
    rule: Rule, sample: Sample, slope: SlopeWindow | None, now: float, horizon_s: float = DEFAULT_HORIZON_S
) -> bool:
    """Re-check before acting: does the rule's condition hold on a fresh sample?

    For predictive rules the projection must still hold (issue: re-check before acting);
    a gated rule — predictive or not — also needs its evidence, as in ``evaluate``.
    """
    if not all(c.holds(sample) is True for c in rule.when):
        return False
    if rule.kind == "predictive" and not _projection(rule, sample, slope, now, horizon_s)[0]:
        return False
    return not rule.evidence or any(c.holds(sample) is True for c in rule.evidence)
