"""``RuleEngine``: the one place a sample becomes decisions.

The live guard (``loop.guard``), ``sparkd replay`` (``ops.replay``) and the re-check
before a stop (``loop.daemon``) all call it, so one trace gives the same decisions
everywhere (``tests/test_same_decisions.py`` records a live run and replays it).

Pure: no I/O, no clock reads — every sample carries its own monotonic time (``mono``).

Shapes:
    ``RuleEngine(specs, cooldown_s=, horizon_s=)``; ``specs`` are ``RuleSpec``s
    (``config.RuleConfig`` or anything with the same attributes).
    ``step(sample) -> list[Decision]`` — compile on first use (``%`` thresholds need MemTotal),
    feed the slope window, advance every rule.
    ``recheck(rule, sample) -> bool`` — before acting: does the rule still hold on a fresh sample?
    ``demote(rule, reason)`` — the rule keeps counting but acts as ``warn`` from now on;
    ``undemote(rule)`` — it stops again (the loop guard withdrew its verdict).
    ``blind() -> {rule: why}`` — rules that could not evaluate on the last sample.
    ``horizon_s`` — the time a stop takes: the longest of the last ``STOP_MEMORY`` measured stops
    (``note_stop_duration``), never below ``MIN_LEARNED_HORIZON_S`` (10 s; the grace when shorter), or the
    configured grace (``container.stop_timeout_s``) before any.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sparkd.core.floors import demote as demote_rules
from sparkd.core.rules import (
    DEFAULT_HORIZON_S,
    Decision,
    MemTotalUnknown,
    Rule,
    RuleSpec,
    RuleState,
    SlopeWindow,
    compile_rules,
    default_samples,
    evaluate,
    start_again,
    still_holds,
    usable_bytes,
)
from sparkd.core.sample import Sample
from sparkd.units import parse_size


@dataclass(frozen=True, slots=True)
class EngineChange:
    """Something the daemon tells the engine between samples, at ``ts`` (UTC epoch s): a measured
    stop (``stop_duration``, ``seconds``), a demotion (``demote``, ``rule``, ``reason``) or its end
    (``rearm``, ``rule``), a relief
    that raised MemFree (``relief``, ``rule``: its counter starts again) or a restart (``reset``).
    The daemon records each as an event; ``engine_changes`` reads them back so a replay of stored
    samples applies them where the guard did."""

    ts: float
    kind: Literal["stop_duration", "demote", "rearm", "relief", "reset", "cooldown_reset"]
    seconds: float | None = None
    rule: str | None = None
    reason: str | None = None


def engine_changes(events: Iterable[Mapping[str, Any]], run_starts: Iterable[float] = ()) -> list[EngineChange]:
    """``EngineChange``s, oldest first, from stored events (``ts``, ``kind``, ``details``) and the
    start times of daemon runs (UTC epoch s, taken before a run's first sample): a run start →
    reset, ``stopped``/``killed`` with ``durations_s.stop`` → a measured stop, ``watermark``
    with ``action = "demoted to warn"`` → a demotion, ``watermark`` with ``action = "re-armed"`` → its
    end, ``relief`` with ``counters_reset`` → one
    ``relief`` change per rule it names, ``recovered_before_stop`` with ``cooldown_reset`` → that rule's
    cooldown forgotten (the trip stopped nothing)."""
    out = [EngineChange(float(t), "reset") for t in run_starts]
    for e in events:
        d = e.get("details") or {}
        kind = e.get("kind")
        if kind in ("stopped", "killed"):
            took = (d.get("durations_s") or {}).get("stop")
            if isinstance(took, int | float):
                out.append(EngineChange(float(e["ts"]), "stop_duration", seconds=float(took)))
        elif kind == "watermark" and d.get("action") == "demoted to warn" and d.get("rule"):
            out.append(EngineChange(float(e["ts"]), "demote", rule=str(d["rule"]), reason=str(e.get("message"))))
        elif kind == "watermark" and d.get("action") == "re-armed" and d.get("rule"):
            out.append(EngineChange(float(e["ts"]), "rearm", rule=str(d["rule"])))
        elif kind == "relief" and d.get("counters_reset"):
            out += [EngineChange(float(e["ts"]), "relief", rule=str(r)) for r in d.get("rules") or []]
        elif kind == "recovered_before_stop" and d.get("cooldown_reset") and d.get("rule"):
            out.append(EngineChange(float(e["ts"]), "cooldown_reset", rule=str(d["rule"])))
    return sorted(out, key=lambda c: c.ts)


#: How many measured stop durations the horizon remembers.
STOP_MEMORY = 5

#: The learned horizon never goes below this (s), nor below the configured grace when that is shorter. One quick
#: stop (an idle model, 0.3 s) made it 0.3 s, and the predictive rule then let the README's hang case (a steady
#: 0.5 GiB/s fall to a hang at ~7 GiB) through (helper-31). The field's floor: a 7.1 → 5.7 GiB collapse in 9 s
#: under a 10 s grace still ended in SIGKILL (README "30 s grace"): a stop under pressure takes at least that.
MIN_LEARNED_HORIZON_S = 10.0

#: The slope window always keeps at least this much history (s), whatever the rules ask.
MIN_SLOPE_HISTORY_S = 64.0


class RuleEngine:
    """Rule states, the slope window and the demotions of one guard or one replay.

    Args:
        specs: rule configurations (``RuleSpec``); compiled against MemTotal on the first step.
        cooldown_s: a rule that tripped is reported as ``cooldown`` for this long.
        horizon_s: the configured stop grace (s), the predictive rules' default horizon.

    Raises (from ``step``/``compile``):
        ValueError: a rule cannot be compiled (a ``%`` threshold with MemTotal unknown).
    """

    def __init__(
        self,
        specs: Iterable[RuleSpec],
        *,
        cooldown_s: float = 0.0,
        horizon_s: float = DEFAULT_HORIZON_S,
        unresolved_ok: bool = False,
    ) -> None:
        # unresolved_ok (the live guard): a % rule compiled while MemTotal is not read is left out and blind
        # (``unresolved``) until it is read; it raised out of the daemon's first tick (helper-31): a restart loop
        # under systemd while an adopted model ran unguarded. Replay keeps the error (it names --mem-total-gib)
        self.unresolved_ok = unresolved_ok
        self.unresolved: dict[str, str] = {}
        self.specs = list(specs)
        self.cooldown_s = cooldown_s
        self.configured_horizon_s = horizon_s
        self.stop_durations: deque[float] = deque(maxlen=STOP_MEMORY)
        self.rules: list[Rule] = []
        self.states: dict[str, RuleState] = {}
        self.demoted: dict[str, str] = {}
        self.slope = SlopeWindow(max_window_s=MIN_SLOPE_HISTORY_S)
        self.mem_total: int | None = None
        self.last_mono: float | None = None  # the monotonic time of the last sample stepped (a duration's "now")
        self._compiled = False
        self._fixed = False
        self._base: list[Rule] = []

    @classmethod
    def of(cls, rules: Sequence[Rule], *, cooldown_s: float = 0.0, horizon_s: float = DEFAULT_HORIZON_S) -> RuleEngine:
        """An engine over rules already compiled (tests, tools); MemTotal changes do not recompile."""
        engine = cls([], cooldown_s=cooldown_s, horizon_s=horizon_s)
        engine.rules = list(rules)
        engine._base = list(rules)
        engine.states = {r.name: RuleState() for r in rules}
        engine._compiled = engine._fixed = True
        engine._size_slope()
        return engine

    # ------------------------------------------------------------------ set-up
    @property
    def horizon_s(self) -> float:
        """The time a stop takes (s): the longest recent measured stop, but never less than
        ``MIN_LEARNED_HORIZON_S`` (or the configured grace, when shorter); else the configured grace."""
        if not self.stop_durations:
            return self.configured_horizon_s
        return max(max(self.stop_durations), min(self.configured_horizon_s, MIN_LEARNED_HORIZON_S))

    def note_stop_duration(self, seconds: float) -> None:
        """Remember how long a stop took (SIGTERM to exit, s); ignored unless finite and > 0."""
        if seconds > 0 and seconds == seconds and seconds != float("inf"):
            self.stop_durations.append(float(seconds))
            self._size_slope()

    def compile(self, mem_total_bytes: int | None, *, fixed: bool = False) -> None:
        """(Re)compile the rules against MemTotal; counters of rules that remain are kept.
        ``fixed``: keep this MemTotal whatever the samples say (replay's ``--mem-total-gib``)."""
        self._fixed = fixed
        self.unresolved = {}
        if self.unresolved_ok and mem_total_bytes is None:
            self._base = []
            for spec in self.specs:  # each on its own: one % rule left out, the others compiled once
                try:
                    self._base += compile_rules([spec], None)
                except MemTotalUnknown as e:
                    self.unresolved[spec.name] = f"cannot evaluate: MemTotal not read ({e})"
        else:
            self._base = compile_rules(self.specs, mem_total_bytes)
        self.rules = demote_rules(self._base, self.demoted)
        self.mem_total = mem_total_bytes
        self._compiled = True
        for r in self.rules:
            self.states.setdefault(r.name, RuleState())
        self._size_slope()

    def _size_slope(self) -> None:
        longest = max(
            (w for r in self.rules if r.kind == "predictive" for w, _ in r.fit_windows(self.horizon_s)),
            default=0.0,
        )
        self.slope.max_window_s = max(MIN_SLOPE_HISTORY_S, longest)

    def ensure(self, sample: Sample) -> None:
        """Compile once MemTotal is known, and again if it changes."""
        changed = sample.mem_total is not None and sample.mem_total != self.mem_total
        if not self._compiled or (changed and not self._fixed):
            self.compile(sample.mem_total if sample.mem_total is not None else self.mem_total)

    # ------------------------------------------------------------------ decisions
    def step(self, sample: Sample) -> list[Decision]:
        """Advance every rule on ``sample`` (its ``mono`` is "now"); trips, near misses, cooldowns."""
        if not self._compiled or sample.mem_total != self.mem_total:  # (``ensure`` only then: a frame less per tick)
            self.ensure(sample)
        self.last_mono = sample.mono
        self.slope.add(sample.mono, sample.mem_available_minus_cma)  # ``rules.usable_bytes`` (set by ``sample.derive``)
        return evaluate(
            sample,
            self.rules,
            self.states,
            sample.mono,
            cooldown_s=self.cooldown_s,
            slope=self.slope,
            horizon_s=self.horizon_s,
        )

    def reset_cooldowns(self, rule_name: str | None = None) -> None:
        """Forget every rule's last trip (``rule_name``: that rule's only): a new run of the container (launched,
        adopted, started by hand) or a trip that stopped nothing must not leave the rules silent for
        ``cooldown_s``. An unknown rule name changes nothing."""
        for name, st in self.states.items():
            if rule_name is None or name == rule_name:
                st.last_trip_mono = None

    def note_idle_trip(self, rule_name: str) -> None:
        """Count a trip of ``rule_name`` that had nothing to stop (the model was down as the daemon last saw it:
        ``loop.daemon_decide.IDLE_STATES``) among its ``trips``: ``idle_trips``, so that "trips since start" can
        tell the trips that acted from those a host short of memory without its model repeats once per
        ``cooldown_s``. An unknown rule name changes nothing."""
        st = self.states.get(rule_name)
        if st is not None:
            st.idle_trips += 1

    def holds_now(self, rule_name: str, sample: Sample) -> bool:
        """Would ``rule_name`` trip on ``sample`` were its counter full: its ``when``, evidence and (predictive)
        projection, on the engine's own slope window, which holds ``sample`` when it is the last one stepped
        (the preflight's question before an operator's start). Changes nothing; an unknown rule does not."""
        rule = self.rule(rule_name)
        return rule is not None and still_holds(rule, sample, self.slope, sample.mono, self.horizon_s)

    def recheck(self, rule_name: str, sample: Sample) -> bool:
        """Does ``rule_name`` still hold on ``sample`` (a fresh read before acting)? A rule with ``in_last_s`` always
        does (``core.rules``).

        Changes nothing: the sample is judged with a copy of the slope window that includes it,
        so the engine's state stays a function of the samples it stepped (which the daemon
        stores) — a replay of those samples reaches the same state. An unknown rule does not hold."""
        rule = self.rule(rule_name)
        if rule is None:
            return False
        if rule.in_last_s is not None:  # held in total within a window: the interval up to ``sample`` counts all the
            return True  # same, and one good reading is what a flapping signal shows every other sample
        window = SlopeWindow(self.slope.max_window_s, self.slope.points.maxlen or len(self.slope.points) + 1)
        window.points.extend(self.slope.points)
        window.add(sample.mono, usable_bytes(sample))
        return still_holds(rule, sample, window, sample.mono, self.horizon_s)

    def reset(self) -> None:
        """Forget counters, the slope window, demotions and measured stops (a daemon restart)."""
        self.demoted.clear()
        self.stop_durations.clear()
        self.rules = list(self._base)
        self.states = {r.name: RuleState() for r in self.rules}
        self.slope = SlopeWindow(max_window_s=MIN_SLOPE_HISTORY_S)
        self._size_slope()

    def apply(self, change: EngineChange) -> None:
        """Apply what the daemon told the engine between samples (a recorded ``EngineChange``)."""
        if change.kind == "stop_duration" and change.seconds is not None:
            self.note_stop_duration(change.seconds)
        elif change.kind == "demote" and change.rule is not None:
            self.demote(change.rule, change.reason or "demoted")
        elif change.kind == "rearm" and change.rule is not None:
            self.undemote(change.rule)
        elif change.kind == "relief" and change.rule is not None:
            self.relieved(change.rule)
        elif change.kind == "reset":
            self.reset()
        elif change.kind == "cooldown_reset" and change.rule is not None:
            self.reset_cooldowns(change.rule)

    def relieved(self, rule_name: str) -> None:
        """Relief before stopping raised MemFree (``loop.relief``): ``rule_name``'s counter starts again
        (CONTEXT.md "Relief"). Unknown names are ignored."""
        st = self.states.get(rule_name)
        if st is not None:
            start_again(st)

    def demote(self, rule_name: str, reason: str) -> None:
        """From now on ``rule_name`` warns instead of stopping (``floors.LoopGuard``'s verdict)."""
        self.demoted[rule_name] = reason
        self.rules = demote_rules(self.rules, self.demoted)

    def undemote(self, rule_name: str) -> None:
        """``rule_name`` acts as configured again (``floors.LoopGuard.rearm``). Not demoted: nothing changes."""
        if self.demoted.pop(rule_name, None) is not None:
            self.rules = demote_rules(self._base, self.demoted)

    @property
    def configured_rules(self) -> list[Rule]:
        """The rules as configured and compiled, before any demotion."""
        return self._base

    # ------------------------------------------------------------------ reading
    def rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    def blind(self) -> dict[str, str]:
        """``{rule: why}`` for each rule whose inputs were missing on the last sample."""
        return {
            **self.unresolved,
            **{r.name: why for r in self.rules if (why := self.states[r.name].blind) is not None},
        }

    def counting(self) -> bool:
        return any(st.counter > 0 for st in self.states.values())

    def held_s(self, rule: Rule, st: RuleState) -> float | None:
        """How long ``rule``'s condition has held (s): a windowed rule's total within its window, else from its first
        counted sample to the last sample stepped; None at counter 0. A duration rule (``for_s``) is measured by it."""
        if rule.in_last_s is not None:
            return st.held_total_s if st.counter > 0 else None
        if st.counter > 0 and st.started_mono is not None and self.last_mono is not None:
            return max(0.0, self.last_mono - st.started_mono)
        return None

    def rules_json(self) -> list[dict[str, Any]]:
        """Each rule as configured, with its counters, whether it was demoted, and why it is blind; ``held_s``: how
        long its condition has held (s, first counted sample to the last sample stepped; None at counter 0), which
        a duration rule (``for_s``) is measured by."""
        out = []
        for r in self.rules:
            st = self.states.get(r.name, RuleState())
            held = self.held_s(r, st)
            out.append({**r.to_json(), "demoted": self.demoted.get(r.name), **st.to_json(), "held_s": held})
        for spec in self.specs:  # left out until MemTotal is read: listed, blind, never missing from the table
            if spec.name in self.unresolved:
                out.append(_unresolved_json(spec, self.unresolved[spec.name]))
        return out


def _unresolved_json(spec: RuleSpec, why: str) -> dict[str, Any]:
    """A rule left out of the compiled set (``RuleEngine.unresolved``) in the shape of ``rules_json``: as configured,
    no thresholds, blind with ``why``; so ``sparkd status``, the dashboard's table and ``sparkd_rule_blind`` name it."""
    return {
        "name": spec.name,
        "kind": spec.kind,
        "action": spec.action,
        "samples": default_samples(spec),
        "for_s": spec.for_s,
        "duration_based": spec.for_s is not None,
        "when": list(spec.when),
        "evidence": list(spec.evidence),
        "thresholds": [],
        "floor_bytes": parse_size(spec.floor) if spec.floor else None,
        "within_s": spec.within_s,
        "window_s": spec.window_s,
        "in_last_s": spec.in_last_s,
        "demoted": None,
        "counter": 0,
        "near_misses": 0,
        "trips": 0,
        "idle_trips": 0,
        "holds": False,
        "last_reason": None,
        "blind": why,
        "held_s": None,
    }


def replay_samples(engine: RuleEngine, samples: Sequence[Sample]) -> list[list[Decision]]:
    """``engine.step`` over each sample in order (a convenience for tests and tools)."""
    return [engine.step(s) for s in samples]
