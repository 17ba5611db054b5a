"""Watermark sanity: can a rule's floor protect *this* host at all?

A host with raised ``vm.min_free_kbytes`` / ``vm.watermark_scale_factor``
reads a lower MemAvailable while healthy, because the kernel subtracts its
reserves (the zones' high watermarks and lowmem protection) from MemAvailable
(``si_mem_available``). The operators read 1.6 GiB on a healthy tuned host; a
fixed 6 GiB floor then stopped a healthy server over and over — a relaunch loop
(CONTEXT.md "What the operators learned later"). See docs/tuned-hosts.md.

Policy (what the daemon does with this module):

* A rule's *loop floor* (``loop_floor``) is the MemAvailable level below which
  every one of its conditions holds with no other signal: only rules made of
  ``MemAvailable``/``MemAvailable-CmaFree`` ``<``/``<=`` conditions have one
  (a rule that also needs MemFree, NVRM errors, PSI … does not loop on a
  healthy host, because a healthy host does not show those signals).
* ``check_floors`` (pure) runs whenever a healthy, idle MemAvailable is known
  (the model answers its health check and runs no request). A rule whose loop
  floor is above that figure *cannot protect*; within ``margin_bytes`` (1 GiB:
  MemAvailable excursions past 1 GiB, change log) it *may loop*. Both are
  ``warning``\\ s → ``watermark`` events (notified by default).
* ``LoopGuard`` decides at a trip: the **first** trip of a rule whose loop floor
  is above the last healthy MemAvailable is judged "cannot protect" — the
  daemon does not stop, demotes the rule to ``warn`` for the rest of its run
  (``demote``), flags it in status and reports a ``watermark`` event. A rule
  within the margin is demoted after ``quick_trips`` (2) consecutive trips each
  within ``relaunch_window_s`` (15 min) of a (re)launch. Demotion is not
  persisted: fix the floors (docs/tuned-hosts.md) and restart.

Sizes are bytes; times are seconds on one caller-chosen clock.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sparkd.core.rules import Condition, Rule
from sparkd.core.sample import DISPLAY_NAMES
from sparkd.units import GiB, fmt_gib

#: Sample attributes read as "MemAvailable" for loop floors (MemAvailable-CmaFree ≤ MemAvailable,
#: so a healthy MemAvailable below the floor means MemAvailable-CmaFree is below it too).
MEMAVAIL_ATTRS = frozenset({"mem_available", "mem_available_minus_cma"})

#: Margin under which a healthy MemAvailable is "near" a floor: MemAvailable is noisy,
#: ~107 MiB per 5 s with excursions past 1 GiB (CONTEXT.md, operators' change log).
DEFAULT_MARGIN_BYTES = 1 * GiB

#: A trip within this many seconds of a (re)launch counts as "quick" for the loop guard;
#: the supervisor's relaunch back-off starts at 30 s and doubles to 15 min (change log).
DEFAULT_RELAUNCH_WINDOW_S = 900.0

VM_TUNABLES = ("min_free_kbytes", "watermark_scale_factor", "watermark_boost_factor")

Problem = Literal["cannot_protect", "memory_taken", "near_floor", "always_holds", "at_watermark"]


@dataclass(frozen=True, slots=True)
class FloorWarning:
    """One finding of ``check_floors``.

    ``problem``: ``"cannot_protect"`` (healthy MemAvailable below the rule's loop
    floor, explained by the kernel's watermarks: stopping would loop), ``"memory_taken"``
    (below the floor, and the watermarks do not explain it: something holds the memory; the
    rule stops the model, as it should), ``"near_floor"`` (within the margin: noise can
    loop it), ``"always_holds"`` (one condition of a multi-signal rule already
    holds on the healthy host; the other signals decide alone — info),
    ``"at_watermark"`` (the floor is at or below the kernel's low-watermark total).
    Sizes in bytes.
    """

    rule: str
    attr: str
    floor_bytes: float
    problem: Problem
    severity: Literal["warning", "info"]
    message: str
    healthy_bytes: int | None
    low_watermark_bytes: int | None

    def details(self) -> dict[str, Any]:
        """JSON-able event details."""
        return {
            "rule": self.rule,
            "field": self.attr,
            "floor_bytes": self.floor_bytes,
            "problem": self.problem,
            "healthy_mem_available_bytes": self.healthy_bytes,
            "low_watermark_bytes": self.low_watermark_bytes,
        }


def _is_memavail_floor(c: Condition) -> bool:
    return c.is_size and c.attr in MEMAVAIL_ATTRS and c.op in ("<", "<=")


def _memavail_threshold(c: Condition, cma_free_bytes: int) -> float:
    # "MemAvailable-CmaFree < F" holds when MemAvailable < F + CmaFree
    return c.threshold + (cma_free_bytes if c.attr == "mem_available_minus_cma" else 0)


def loop_floor(rule: Rule, cma_free_bytes: int = 0) -> float | None:
    """The MemAvailable (bytes) below which ``rule`` trips on MemAvailable alone, or ``None``.

    ``MemAvailable-CmaFree`` thresholds are moved up by ``cma_free_bytes`` (the
    healthy CmaFree, default 0) so that every floor is on the MemAvailable scale.

    ``None`` when any ``when`` condition is on another signal, or when the rule
    has an evidence clause with no MemAvailable condition in it. Otherwise the
    smallest ``when`` threshold (all must hold), capped by the largest evidence
    threshold (any must hold) and, for a predictive rule, by its ``floor``
    (below the floor the projected crossing time is ≤ 0, so any falling noise
    counts).
    """
    if not rule.when or not all(_is_memavail_floor(c) for c in rule.when):
        return None
    f = min(_memavail_threshold(c, cma_free_bytes) for c in rule.when)
    if rule.evidence:
        ev = [_memavail_threshold(c, cma_free_bytes) for c in rule.evidence if _is_memavail_floor(c)]
        if not ev:
            return None
        f = min(f, max(ev))
    if rule.kind == "predictive" and rule.floor_bytes is not None:
        f = min(f, float(rule.floor_bytes))
    return f


def _tunables_text(min_free_kbytes: int | None, wsf: int | None, low: int | None) -> str:
    parts = []
    if min_free_kbytes is not None:
        parts.append(f"vm.min_free_kbytes={min_free_kbytes}")
    if wsf is not None:
        parts.append(f"vm.watermark_scale_factor={wsf}")
    if low is not None:
        parts.append(f"low watermarks {fmt_gib(low)} in total")
    return f" ({', '.join(parts)})" if parts else ""


def watermarks_explain(
    healthy_bytes: int, low_watermark_bytes: int | None, floor_bytes: float, margin_bytes: int
) -> bool:
    """Does the kernel's reserve explain a healthy MemAvailable below ``floor_bytes``? True when
    healthy + the zones' low watermarks + ``margin_bytes`` reach the floor (a tuned host: raised
    ``vm.min_free_kbytes`` lowers MemAvailable by the reserve, docs/tuned-hosts.md), or when the
    watermarks are unknown (``None``). False: something holds the memory."""
    return low_watermark_bytes is None or healthy_bytes + low_watermark_bytes + margin_bytes >= floor_bytes


def check_floors(
    rules: Iterable[Rule],
    *,
    healthy_mem_available_bytes: int | None,
    low_watermark_bytes: int | None,
    min_free_kbytes: int | None,
    watermark_scale_factor: int | None,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    healthy_cma_free_bytes: int | None = None,
) -> list[FloorWarning]:
    """Compare every rule floor with this host's healthy state and kernel watermarks (pure).

    Args:
        rules: compiled rules (``rules.compile_rules``); floors from ``Rule.floors()``
            and ``loop_floor``.
        healthy_mem_available_bytes: MemAvailable read while the model is
            loaded, healthy and idle; ``None`` skips the healthy checks.
        low_watermark_bytes: sum of the zones' ``low`` watermarks
            (``procfs.read_zoneinfo_low_watermark_bytes``); ``None`` skips that check.
        min_free_kbytes, watermark_scale_factor: ``read_vm_tunables`` values,
            quoted in the messages only (``None``: left out).
        margin_bytes: "near" margin, default 1 GiB (MemAvailable noise).
        healthy_cma_free_bytes: CmaFree at that moment, for ``MemAvailable-CmaFree``
            floors (default ``None``: 0, which can only under-report those).

    Returns:
        Warnings in rule order; for each rule at most one of
        cannot_protect / near_floor / always_holds, plus at_watermark per floor.
    """
    out: list[FloorWarning] = []
    ctx = _tunables_text(min_free_kbytes, watermark_scale_factor, low_watermark_bytes)
    healthy = healthy_mem_available_bytes
    cma = healthy_cma_free_bytes or 0
    for rule in rules:
        # only a stop can loop (stop → relaunch → the floor still holds → stop); a warn rule whose
        # floor this healthy host is below just always holds, which the last branch reports
        lf = loop_floor(rule, cma) if rule.action == "stop" else None
        attr = "mem_available"
        if (
            healthy is not None
            and lf is not None
            and not watermarks_explain(healthy, low_watermark_bytes, lf, margin_bytes)
        ):
            out.append(
                FloorWarning(
                    rule.name,
                    attr,
                    lf,
                    "memory_taken",
                    "warning",
                    f"rule {rule.name}: MemAvailable {fmt_gib(healthy)} at a healthy reading is below its floor "
                    f"{fmt_gib(lf)}, and the kernel's low watermarks ({fmt_gib(low_watermark_bytes)}) do not "
                    f"explain it: something holds the memory; the rule stops the model (not a tuned host){ctx}",
                    healthy,
                    low_watermark_bytes,
                )
            )
        elif healthy is not None and lf is not None and healthy < lf:
            out.append(
                FloorWarning(
                    rule.name,
                    attr,
                    lf,
                    "cannot_protect",
                    "warning",
                    f"rule {rule.name} cannot protect this host: healthy MemAvailable {fmt_gib(healthy)} "
                    f"is below its floor {fmt_gib(lf)}; stopping would loop{ctx}",
                    healthy,
                    low_watermark_bytes,
                )
            )
        elif healthy is not None and lf is not None and healthy - lf < margin_bytes:
            out.append(
                FloorWarning(
                    rule.name,
                    attr,
                    lf,
                    "near_floor",
                    "warning",
                    f"rule {rule.name} may loop on this host: healthy MemAvailable {fmt_gib(healthy)} is within "
                    f"{fmt_gib(margin_bytes)} of its floor {fmt_gib(lf)} (MemAvailable noise reaches 1 GiB){ctx}",
                    healthy,
                    low_watermark_bytes,
                )
            )
        elif healthy is not None:

            def holds(c: Condition) -> bool:
                return _is_memavail_floor(c) and healthy < _memavail_threshold(c, cma)

            held_when = [c for c in rule.when if holds(c)]
            held_ev = [c for c in rule.evidence if holds(c)]
            if held_when or held_ev:
                held = held_when + held_ev
                others = [c.text or c.name for c in rule.when if c not in held_when]
                if rule.kind == "predictive" and rule.floor_bytes is not None:
                    others.append(f"the projected crossing of {fmt_gib(rule.floor_bytes)}")
                if not held_ev:
                    others += [c.text or c.name for c in rule.evidence]
                gate = "; its evidence clause is always satisfied" if held_ev else ""
                verb = "decides" if len(others) == 1 else "decide"
                # nothing else to decide: it trips at every cooldown (doctor said "only its other signals decide" of
                # a rule that has none, and it warned every minute, helper-55)
                decides = (
                    f"only {' and '.join(others)} {verb}"
                    if others
                    else "nothing else is needed: it trips at every cooldown for as long as this host stays so"
                )
                out.append(
                    FloorWarning(
                        rule.name,
                        held[0].attr,
                        max(c.threshold for c in held),
                        "always_holds",
                        "info",
                        f"rule {rule.name}: {', '.join(c.text or c.name for c in held)} already "
                        f"{'hold' if len(held) > 1 else 'holds'} on this healthy host "
                        f"(MemAvailable {fmt_gib(healthy)}){gate}; {decides}{ctx}",
                        healthy,
                        low_watermark_bytes,
                    )
                )
        if low_watermark_bytes is None:
            continue
        seen: set[tuple[str, float]] = set()
        for fattr, thr in rule.floors():
            if (fattr, thr) in seen or thr > low_watermark_bytes:
                continue
            seen.add((fattr, thr))
            name = DISPLAY_NAMES.get(fattr, fattr)
            if fattr in MEMAVAIL_ATTRS:
                why = (
                    f"{name} is already net of the kernel's reserve, so on this host size the floor "
                    "from the healthy MemAvailable, not from a stock host's"
                )
                sev: Literal["warning", "info"] = "info"
            else:
                why = (
                    f"kswapd reclaims to keep {name} above them, so {name} under this floor means the "
                    "kernel's reclaim is already losing: the rule can only fire late"
                )
                sev = "warning"
            out.append(
                FloorWarning(
                    rule.name,
                    fattr,
                    thr,
                    "at_watermark",
                    sev,
                    f"rule {rule.name}: floor {name} {fmt_gib(thr)} is at or below the kernel's low watermarks "
                    f"({fmt_gib(low_watermark_bytes)} in total): {why}{ctx}",
                    healthy,
                    low_watermark_bytes,
                )
            )
    return out


def read_vm_tunables(proc_root: str | Path = "/proc") -> dict[str, int | None]:
    """Read ``<proc_root>/sys/vm/{min_free_kbytes,watermark_scale_factor,watermark_boost_factor}``.

    Returns ``{name: int}`` with ``None`` for a file that is absent, unreadable
    or not an integer (never raises). ``min_free_kbytes`` is in KiB;
    ``watermark_scale_factor`` in units of 0.01 % of a zone (kernel default 10).
    """
    out: dict[str, int | None] = {}
    for name in VM_TUNABLES:
        try:
            with open(os.path.join(proc_root, "sys", "vm", name)) as f:
                out[name] = int(f.read().strip())
        except (OSError, ValueError):
            out[name] = None
    return out


def demote(rules: Sequence[Rule], names: Iterable[str]) -> list[Rule]:
    """Copies of ``rules`` with ``action = "warn"`` for the named ones (others unchanged)."""
    names = set(names)
    return [dataclasses.replace(r, action="warn") if r.name in names and r.action != "warn" else r for r in rules]


@dataclass(frozen=True, slots=True)
class LoopVerdict:
    """``LoopGuard``'s conclusion that a rule cannot protect this host."""

    rule: str
    t: float
    floor_bytes: float
    healthy_bytes: int | None
    trips: int
    quick_trips: int
    reason: str

    def details(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "floor_bytes": self.floor_bytes,
            "healthy_mem_available_bytes": self.healthy_bytes,
            "trips": self.trips,
            "quick_trips": self.quick_trips,
            "action": "demoted to warn",
        }


@dataclass(frozen=True, slots=True)
class Rearm:
    """``LoopGuard``'s conclusion that a demoted rule can protect this host again: a run launched after
    the verdict became healthy with MemAvailable at least the margin above the rule's floor."""

    rule: str
    t: float
    floor_bytes: float
    healthy_bytes: int
    demoted_at: float
    reason: str

    def details(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "floor_bytes": self.floor_bytes,
            "healthy_mem_available_bytes": self.healthy_bytes,
            "demoted_at": self.demoted_at,
            "action": "re-armed",
        }


@dataclass(slots=True)
class _RuleTrips:
    trips: int = 0
    quick_streak: int = 0
    last_trip_t: float | None = None
    before: tuple[int, int, float | None] | None = None  # (trips, quick_streak, last_trip_t) before the last trip


class LoopGuard:
    """Tells, at a trip, whether stopping for this rule would only loop (pure; times passed in).

    Feed it ``note_launch(t)`` when a (re)launch starts and ``note_healthy(t,
    mem_available)`` when the model is healthy and idle (health check passes,
    no request running); call ``record_trip(rule, t)`` on every trip, *before*
    acting on it. A ``LoopVerdict`` means: do not stop, demote the rule to warn,
    report it. It is returned once per rule; ``verdicts`` keeps them until ``rearm`` withdraws one (a
    later run healthy well above the rule's floor: the operator fixed the budget).

    Args:
        margin_bytes: "near the floor" margin (default 1 GiB, MemAvailable noise).
        relaunch_window_s: a trip this soon after a launch is "quick" (default 900 s).
        quick_trips: consecutive quick trips that convict a rule whose floor is
            only within the margin (default 2).
    """

    def __init__(
        self,
        *,
        margin_bytes: int = DEFAULT_MARGIN_BYTES,
        relaunch_window_s: float = DEFAULT_RELAUNCH_WINDOW_S,
        quick_trips: int = 2,
    ) -> None:
        self.margin_bytes = margin_bytes
        self.relaunch_window_s = relaunch_window_s
        self.quick_trips = max(1, quick_trips)
        self.launch_t: float | None = None
        self.launches = 0
        self.healthy_bytes: int | None = None
        self.healthy_cma_free: int = 0
        self.healthy_t: float | None = None
        self.low_watermark_bytes: int | None = None  # the zones' low watermarks at the healthy reading
        self.healthy_at_start = False  # the healthy reading is sparkd's start-up one (``forget_start_reading``)
        self.trips: dict[str, _RuleTrips] = {}
        self.verdicts: dict[str, LoopVerdict] = {}

    def note_launch(self, t: float) -> None:
        """A launch (or relaunch) of the model started at ``t``."""
        self.launch_t = t
        self.launches += 1

    def note_healthy(
        self,
        t: float,
        mem_available_bytes: int | None,
        cma_free_bytes: int | None = None,
        low_watermark_bytes: int | None = None,
        *,
        at_start: bool = False,
    ) -> None:
        """MemAvailable (and CmaFree, and the zones' low watermarks) in bytes while the model is
        loaded, healthy and idle. A ``None`` MemAvailable is ignored. ``at_start``: the reading sparkd takes
        at its own start, before it knows whether a model runs (the host as it is then counts as healthy: a
        tuned host without a model); ``forget_start_reading`` withdraws it when a running model is found."""
        if mem_available_bytes is not None:
            self.healthy_bytes, self.healthy_t = mem_available_bytes, t
            self.healthy_cma_free = cma_free_bytes or 0
            self.low_watermark_bytes = low_watermark_bytes
            self.healthy_at_start = at_start

    def forget_start_reading(self) -> bool:
        """A running model was found after sparkd's start (adopted): the reading taken at the start is of a host
        under that model's load at an unknown moment (a restart of sparkd while memory was short: 5.5 GiB read
        as "healthy" convicted the 6 GiB rule at its first trip and left the model running below it; helper-31).
        It is withdrawn; the run's own ``ready`` gives the next one. True when one was withdrawn."""
        if not self.healthy_at_start or self.healthy_bytes is None:
            return False
        self.healthy_bytes = self.healthy_t = None
        self.healthy_at_start = False
        return True

    def cannot_protect(self, rule_name: str) -> LoopVerdict | None:
        """The verdict on ``rule_name``, if one was reached."""
        return self.verdicts.get(rule_name)

    def record_trip(self, rule: Rule, t: float) -> LoopVerdict | None:
        """Record a trip of ``rule`` at ``t``; return a verdict the first time it is convicted.

        Convicted when the rule has a loop floor (``loop_floor``) and either the
        last healthy MemAvailable is below it and the kernel's watermarks explain the
        shortfall (at the first such trip), or that figure is within ``margin_bytes``
        of it and this is the ``quick_trips``-th consecutive trip within
        ``relaunch_window_s`` of a launch.

        "Explained": healthy MemAvailable + the low watermarks + ``margin_bytes`` reach
        the floor — a tuned host (raised ``vm.min_free_kbytes``: MemAvailable is low by
        the reserve, docs/tuned-hosts.md). A healthy reading far below the floor on a host
        with small watermarks is memory taken by something (the model started by hand
        while a co-tenant holds the memory): the rule is right and keeps stopping. With
        the watermarks unknown (no zoneinfo) the shortfall counts as explained.
        """
        st = self.trips.setdefault(rule.name, _RuleTrips())
        st.before = (st.trips, st.quick_streak, st.last_trip_t)
        st.trips += 1
        st.last_trip_t = t
        quick = self.launch_t is not None and 0 <= t - self.launch_t <= self.relaunch_window_s
        st.quick_streak = st.quick_streak + 1 if quick else 0
        if rule.name in self.verdicts:
            return None
        lf = loop_floor(rule, self.healthy_cma_free)
        h = self.healthy_bytes
        if lf is None or h is None:
            return None
        since = ""
        if quick and self.launch_t is not None:
            since = f", {t - self.launch_t:.0f} s after the last launch"
        if h < lf and watermarks_explain(h, self.low_watermark_bytes, lf, self.margin_bytes):
            reason = (
                f"rule {rule.name} cannot protect this host: healthy MemAvailable {fmt_gib(h)} is below its floor "
                f"{fmt_gib(lf)}; stopping would loop (trip {st.trips}{since}); demoted to warn"
            )
        elif 0 <= h - lf < self.margin_bytes and st.quick_streak >= self.quick_trips:
            reason = (
                f"rule {rule.name} cannot protect this host: {st.quick_streak} trips in a row each within "
                f"{self.relaunch_window_s:g} s of a relaunch while healthy MemAvailable {fmt_gib(h)} sat within "
                f"{fmt_gib(self.margin_bytes)} of its floor {fmt_gib(lf)}; stopping would loop; demoted to warn"
            )
        else:
            return None
        v = LoopVerdict(rule.name, t, lf, h, st.trips, st.quick_streak, reason)
        self.verdicts[rule.name] = v
        return v

    def withdraw_trip(self, rule_name: str) -> None:
        """The last trip of ``rule_name`` stopped nothing: its re-check found memory recovered. It is taken back
        (its count and quick streak): a loop is stops that keep coming back, and a recovered trip followed by
        the real one convicted the rule as "stopping would loop" with nothing stopped (review helper-32).
        Nothing changes once a verdict was reached, or for a rule with no trip recorded."""
        st = self.trips.get(rule_name)
        if st is None or st.before is None or rule_name in self.verdicts:
            return
        st.trips, st.quick_streak, st.last_trip_t = st.before
        st.before = None

    def rearm(self, rules: Sequence[Rule]) -> list[Rearm]:
        """The verdicts that no longer hold, withdrawn: one ``Rearm`` per rule to arm again.

        A verdict is withdrawn when the last healthy reading comes from a run launched after it (the
        operator resized or restarted the model; the readings of the run it judged are what convicted
        it) and that healthy MemAvailable is at least ``margin_bytes`` above the rule's floor
        (``loop_floor`` of the rule in ``rules``, as configured, with the healthy CmaFree): the same
        test that lets a rule stop on a healthy host in ``record_trip``. The rule's quick-trip streak
        starts again; a later trip may convict it anew. Rules not in ``rules`` keep their verdicts.
        """
        h, ht, lt = self.healthy_bytes, self.healthy_t, self.launch_t
        if h is None or ht is None or lt is None or ht < lt:
            return []
        by_name = {r.name: r for r in rules}
        out: list[Rearm] = []
        for name, v in list(self.verdicts.items()):
            rule = by_name.get(name)
            lf = loop_floor(rule, self.healthy_cma_free) if rule is not None else None
            if lf is None or lt <= v.t or h - lf < self.margin_bytes:
                continue
            del self.verdicts[name]
            if name in self.trips:
                self.trips[name].quick_streak = 0
            out.append(
                Rearm(
                    name,
                    ht,
                    lf,
                    h,
                    v.t,
                    f"rule {name} stops again: a run launched after it was demoted is healthy with MemAvailable "
                    f"{fmt_gib(h)}, {fmt_gib(h - lf)} above its floor {fmt_gib(lf)} "
                    f"(margin {fmt_gib(self.margin_bytes)})",
                )
            )
        return out

    def status(self) -> dict[str, Any]:
        """``{"healthy_mem_available_bytes", "healthy_t", "launch_t", "launches",
        "rules": {name: {"trips", "quick_streak", "cannot_protect", "reason"}}}``."""
        return {
            "healthy_mem_available_bytes": self.healthy_bytes,
            "healthy_t": self.healthy_t,
            "launch_t": self.launch_t,
            "launches": self.launches,
            "rules": {
                name: {
                    "trips": st.trips,
                    "quick_streak": st.quick_streak,
                    "cannot_protect": name in self.verdicts,
                    "reason": self.verdicts[name].reason if name in self.verdicts else None,
                }
                for name, st in self.trips.items()
            },
        }
