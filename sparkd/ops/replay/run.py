"""The replay run: a trace through ``core.engine.RuleEngine`` (the guard's own engine) and its result."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparkd.config import RuleConfig
from sparkd.core.engine import EngineChange, RuleEngine
from sparkd.core.rules import DEFAULT_HORIZON_S, Decision, Rule
from sparkd.core.sample import Sample, derive
from sparkd.core.slope import FIT_MIN_POINTS
from sparkd.ops.replay.interpolate import _round_down
from sparkd.ops.replay.traces import Trace
from sparkd.units import fmt_gib

# The predictive rules' robust slope, as the guard runs it: the fewest points it fits
# (``SlopeWindow.slope``'s ``min_points``) and the longest window the guard keeps.
SLOPE_MIN_POINTS: int = FIT_MIN_POINTS

# --------------------------------------------------------------------------- replay


@dataclass(slots=True)
class ReplayDecision:
    """One rule decision on one sample. ``t``: seconds from the trace start.

    ``recheck``: for a stop trip, whether ``rules.still_holds`` is true on the next
    recorded sample (the daemon re-checks on a fresh sample before stopping);
    ``None`` when the trace ended first or for other decisions.
    """

    t: float
    ts: float
    rule: str
    kind: str  # trip | near_miss | cooldown
    action: str
    reason: str
    counter: int
    samples: int
    mem_available: int | None
    mem_free: int | None
    synthetic: bool
    usable: int | None = None
    recheck: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class ReplayStep:
    """One sample of the replay: its values, every rule's counter after it, its decisions."""

    t: float
    ts: float
    mem_available: int | None
    mem_free: int | None
    nvrm_recent: int
    synthetic: bool
    label: str | None
    counters: dict[str, int]
    decisions: list[ReplayDecision] = field(default_factory=list)
    usable: int | None = None
    held_s: dict[str, float] = field(default_factory=dict)  # duration rules (for_s) counting: how long they held

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["decisions"] = [x.to_json() for x in self.decisions]
        return d


@dataclass(slots=True)
class ReplayResult:
    rules: list[Rule]
    steps: list[ReplayStep]
    first_trip: dict[str, ReplayDecision | None]
    max_counter: dict[str, int]
    near_misses: dict[str, int]
    cooldown_s: float
    fast_interval_s: float
    mem_total_bytes: int | None
    # predictive rules: the most MemAvailable points their fit window ever held on this trace
    fit_points: dict[str, int] = field(default_factory=dict)
    trace_interval_s: float | None = None
    horizon_s: float = DEFAULT_HORIZON_S

    def why_no_trip(self, rule: Rule) -> str | None:
        """For a predictive rule whose fit window never held the points the robust slope
        needs (``SLOPE_MIN_POINTS``): why it could never evaluate, and what to try."""
        held = self.fit_points.get(rule.name)
        if rule.kind != "predictive" or held is None or held >= SLOPE_MIN_POINTS:
            return None
        iv = self.trace_interval_s
        spacing = f" at {iv:g} s spacing" if iv is not None else ""
        window = max(w for w, _ in rule.fit_windows(self.horizon_s))
        coarsest = window / (SLOPE_MIN_POINTS - 1)  # floor(window / iv) + 1 >= min points
        suggest = self.fast_interval_s if self.fast_interval_s <= coarsest else _round_down(coarsest)
        return (
            f"its {window:g} s fit window holds at most {held} sample{'s' if held != 1 else ''}{spacing} — "
            f"needs {SLOPE_MIN_POINTS}; try --interpolate --interval {suggest:g}"
        )

    @property
    def decisions(self) -> list[ReplayDecision]:
        return [d for s in self.steps for d in s.decisions]

    def trips(self, rule: str | None = None) -> list[ReplayDecision]:
        return [d for d in self.decisions if d.kind == "trip" and (rule is None or d.rule == rule)]

    @property
    def first_stop(self) -> ReplayDecision | None:
        return next((d for d in self.decisions if d.kind == "trip" and d.action == "stop"), None)

    @property
    def last(self) -> ReplayStep | None:
        return self.steps[-1] if self.steps else None

    def summary(self) -> str:
        """``first stop: collapse_projected at t=3.50 s, MemAvailable 13.90 GiB`` or why none."""
        stop = self.first_stop
        if stop is not None:
            syn = " (synthetic point)" if stop.synthetic else ""
            cma = "" if stop.usable in (None, stop.mem_available) else f" (usable {fmt_gib(stop.usable)})"
            return f"first stop: {stop.rule} at t={stop.t:.2f} s, MemAvailable {fmt_gib(stop.mem_available)}{cma}{syn}"
        last = self.last
        if last is None:
            return "no stop: the trace is empty"
        return (
            f"no stop: no stop rule tripped before the trace ended "
            f"(t={last.t:.2f} s, MemAvailable {fmt_gib(last.mem_available)})"
        )

    def to_json(self) -> dict[str, Any]:
        stop = self.first_stop
        return {
            "summary": self.summary(),
            "first_stop": stop.to_json() if stop else None,
            "first_trip": {k: (v.to_json() if v else None) for k, v in self.first_trip.items()},
            "max_counter": self.max_counter,
            "near_misses": self.near_misses,
            "rules": [r.to_json() for r in self.rules],
            "cooldown_s": self.cooldown_s,
            "fast_interval_s": self.fast_interval_s,
            "mem_total_bytes": self.mem_total_bytes,
            "fit_points": self.fit_points,
            "no_trip_reasons": {r.name: w for r in self.rules if (w := self.why_no_trip(r)) is not None},
            "decisions": [d.to_json() for d in self.decisions],
        }


def rule_configs(rules: Iterable[RuleConfig | Mapping[str, Any]]) -> list[RuleConfig]:
    """Validate rule dicts (``SEED_RULES``, TOML tables) into ``RuleConfig``s."""
    return [r if isinstance(r, RuleConfig) else RuleConfig(**r) for r in rules]


def replay(
    samples: Trace | Sequence[Sample],
    rule_configs_: Iterable[RuleConfig | Mapping[str, Any]],
    *,
    mem_total_bytes: int | None = None,
    fast_interval_s: float = 0.25,
    cooldown_s: float = 60.0,
    horizon_s: float = DEFAULT_HORIZON_S,
    changes: Sequence[EngineChange] = (),
) -> ReplayResult:
    """Run the rules over the samples through ``core.engine.RuleEngine`` — the guard's own
    engine: one ``step`` per sample, and each stop trip re-checked (``recheck``) on the next
    recorded sample as the daemon re-checks on a fresh one.

    ``mem_total_bytes``: for ``%`` thresholds; ``None`` takes MemTotal from the trace.
    ``fast_interval_s``: the guard's fast interval (only for the suggestions printed).
    ``horizon_s``: the time a stop takes (``container.stop_timeout_s``), the predictive horizon.
    ``changes``: what the daemon told its engine between samples (``core.engine.engine_changes``
    of the stored events: measured stops, demotions, restarts), applied before the first sample
    after each (sample ``ts`` and change ``ts`` on one clock: a database trace's epoch seconds).
    A stop trip whose re-check finds memory recovered forgets its rule's cooldown, as the live guard does
    while a model runs; with ``changes`` the daemon's own record of that is applied instead.

    Raises:
        ValueError: a ``%`` threshold with MemTotal unknown, or an invalid rule.
    """
    trace = samples if isinstance(samples, Trace) else Trace(list(samples), "samples")
    fixed = mem_total_bytes is not None
    if mem_total_bytes is None:
        mem_total_bytes = trace.mem_total
    engine = RuleEngine(rule_configs(rule_configs_), cooldown_s=cooldown_s, horizon_s=horizon_s)
    engine.compile(mem_total_bytes, fixed=fixed)
    rules = engine.rules
    steps: list[ReplayStep] = []
    first: dict[str, ReplayDecision | None] = {r.name: None for r in rules}
    max_counter = {r.name: 0 for r in rules}
    pending: list[ReplayDecision] = []
    todo = sorted(changes, key=lambda c: c.ts)
    k = 0
    for i, s in enumerate(trace.samples):
        while k < len(todo) and todo[k].ts < s.ts:
            engine.apply(todo[k])
            k += 1
        if s.mem_available_minus_cma is None:
            derive(s)  # samples built by hand: usable as build_sample derives it (the loaders already did)
        for p in pending:  # re-check the previous sample's stop trips on this one
            p.recheck = engine.recheck(p.rule, s)
            if p.recheck is False and not changes:
                # the live guard forgets the cooldown of a trip that stopped nothing while a model runs, as a
                # replay assumes; a database trace has the daemon's own record of it (engine_changes)
                engine.reset_cooldowns(p.rule)
        pending = []
        decisions = engine.step(s)
        step = _record(s, trace.synthetic[i], trace.labels[i], decisions, first, max_counter, pending)
        for r in rules:
            st = engine.states[r.name]
            step.counters[r.name] = st.counter
            max_counter[r.name] = max(max_counter[r.name], st.counter)
            if r.for_s is not None and (held := engine.held_s(r, st)) is not None:
                step.held_s[r.name] = held
        steps.append(step)
    return ReplayResult(
        rules=rules,
        steps=steps,
        first_trip=first,
        max_counter=max_counter,
        near_misses={r.name: engine.states[r.name].near_misses for r in rules},
        cooldown_s=cooldown_s,
        fast_interval_s=fast_interval_s,
        mem_total_bytes=mem_total_bytes,
        fit_points={
            r.name: _most_in_window(trace.samples, max(w for w, _ in r.fit_windows(engine.horizon_s)))
            for r in rules
            if r.kind == "predictive"
        },
        trace_interval_s=trace.interval_s,
        horizon_s=engine.horizon_s,
    )


def _record(
    s: Sample,
    synthetic: bool,
    label: str | None,
    decisions: Sequence[Decision],
    first: dict[str, ReplayDecision | None],
    max_counter: dict[str, int],
    pending: list[ReplayDecision],
) -> ReplayStep:
    """One replayed sample's step; notes first trips, highest counts and stop trips to re-check."""
    step = ReplayStep(
        t=s.mono,
        ts=s.ts,
        mem_available=s.mem_available,
        mem_free=s.mem_free,
        nvrm_recent=s.nvrm_recent or 0,
        synthetic=synthetic,
        label=label,
        counters={},
        usable=s.mem_available_minus_cma,
    )
    for d in decisions:
        rd = ReplayDecision(
            t=s.mono,
            ts=s.ts,
            rule=d.rule,
            kind=d.kind,
            action=d.action,
            reason=d.reason,
            counter=d.counter,
            samples=d.samples,
            mem_available=s.mem_available,
            mem_free=s.mem_free,
            synthetic=synthetic,
            usable=s.mem_available_minus_cma,
        )
        step.decisions.append(rd)
        if d.kind == "trip":
            if first[d.rule] is None:
                first[d.rule] = rd
            if d.action == "stop":
                pending.append(rd)
        if d.kind in ("trip", "cooldown"):
            max_counter[d.rule] = max(max_counter[d.rule], d.counter)
    return step


def _most_in_window(samples: Sequence[Sample], window_s: float) -> int:
    """The most usable-memory points a ``SlopeWindow.slope`` over ``window_s`` ever sees here."""
    monos = [s.mono for s in samples if s.mem_available_minus_cma is not None]
    best = lo = 0
    for hi, t in enumerate(monos):
        while t - monos[lo] > window_s + 1e-9:
            lo += 1
        best = max(best, hi - lo + 1)
    return best
