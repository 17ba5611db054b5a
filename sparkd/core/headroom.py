"""How far the host is from the nearest stop line — the dashboard's headline. Pure: no I/O, no clock reads.

A *stop line* is what a stop rule (``action = "stop"``) must cross to count:

* a threshold rule: its size conditions with ``<``/``<=`` (``MemAvailable < 6GiB``). A rule with
  several conditions counts only when all hold, so its distance is the *largest* of their
  headrooms (the condition furthest from holding binds); a gated rule whose evidence does not
  hold now must also cross the nearest size line of its evidence (``MemAvailable < 3GiB``);
* a predictive rule: its ``floor`` on usable memory (MemAvailable − CmaFree, the line the projection is about),
  never its ``when`` gate — the gate (``MemAvailable < 16GiB``) only arms the projection, and
  using it as a floor made the page say "critical at 8.5 GiB while every rule was 0/N"
  (issue 14).

The nearest line is the smallest headroom among the stop rules (ties: the higher counter).

Fall rate: the Theil–Sen slope of usable memory (``SlopeWindow``) over ``window_s``; "falling"
only when it falls faster than ``min_fall_bytes_per_s`` (default 32 MiB/s: CONTEXT.md gives
MemAvailable noise as ~107 MiB per 5 s ≈ 21 MiB/s, so a slower fall is not told apart from
noise), and only while the newest half of the window falls that fast too (a window that still
holds a fall just after a stop, memory rising again, is no fall). Time to floor = headroom /
fall rate, for a line on usable memory or MemAvailable only (the window holds usable memory alone).

Level (``ok`` / ``warn`` / ``critical``):

* ``critical``: a stop line already crossed, a stop rule's counter at half its samples or
  more, or the floor projected within ``stop_time_s`` (30 s: CONTEXT.md "Stops take time" —
  a graceful stop takes up to 30 s, so a fall reaching the floor sooner is already late);
* ``warn``: any stop rule counting, headroom under ``warn_margin_bytes`` (4 GiB, the default
  ``fast_margin``), or the floor projected within 4 × ``stop_time_s``;
* ``ok`` otherwise.

With nothing for a rule to stop (``can_stop=False``: the model is stopped, exited or failed), the two
``critical`` grounds that are about the stop's timing (a counter at half its samples, a floor reached
sooner than a stop takes) are ``warn``: no stop can be late. A line already crossed stays ``critical``
(the host itself is short of memory), and the reason says that nothing runs to be stopped.

Shape: ``nearest_stop(sample, rules, states, slope, now) -> NearestStop | None`` (None before
the first sample, or with no stop rule that has a size line).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from sparkd.core.rules import Condition, Rule, RuleState, SlopeWindow, usable_bytes
from sparkd.core.sample import Sample
from sparkd.units import GiB, MiB

Level = Literal["ok", "warn", "critical"]

MIN_FALL_BYTES_PER_S = 32 * MiB
WARN_MARGIN_BYTES = 4 * GiB
STOP_TIME_S = 30.0
FALL_WINDOW_S = 10.0
# the slope window holds usable memory (MemAvailable − CmaFree); CmaFree barely moves, so its fall is
# MemAvailable's too
SLOPE_ATTRS = ("mem_available_minus_cma", "mem_available")


@dataclass(frozen=True, slots=True)
class NearestStop:
    """The nearest stop line now. Sizes in bytes, rates in bytes/s, times in s.

    ``headroom_bytes`` = ``value_bytes`` − ``threshold_bytes`` (negative: already below the line).
    ``fall_rate_bytes_per_s`` and ``time_to_floor_s`` are None when the field is not falling
    (or is not MemAvailable, whose slope is the only one kept).
    """

    rule: str
    kind: str
    field: str  # Sample attribute, e.g. "mem_available"
    label: str  # as configured, e.g. "MemAvailable"
    value_bytes: int
    threshold_bytes: int
    headroom_bytes: int
    counter: int
    samples: int
    fall_rate_bytes_per_s: float | None
    time_to_floor_s: float | None
    level: Level
    reason: str

    def to_json(self) -> dict[str, Any]:
        """Every field by name (all are plain values: ``dataclasses.asdict``'s deep copy, 13 recursive calls
        per snapshot, was half the cost of ``nearest_stop`` in the status snapshot; issue 18)."""
        return {name: getattr(self, name) for name in _NEAREST_STOP_FIELDS}


_NEAREST_STOP_FIELDS = tuple(f.name for f in fields(NearestStop))


def _lines(rule: Rule, sample: Sample) -> list[tuple[str, str, int, int]]:
    """(attr, label, value, threshold) of each stop line of ``rule`` that the sample has a value for."""
    if rule.kind == "predictive":
        usable = usable_bytes(sample)
        if rule.floor_bytes is None or usable is None:
            return []
        return [("mem_available_minus_cma", "usable", usable, int(rule.floor_bytes))]
    out = _size_lines(rule.when, sample)
    if rule.evidence and not any(c.holds(sample) is True for c in rule.evidence):
        # no evidence now: the nearest size line among the evidence must be crossed too
        ev = _size_lines(rule.evidence, sample)
        if ev:
            out.append(min(ev, key=lambda x: x[2] - x[3]))
    return out


def _size_lines(conds: Sequence[Condition], sample: Sample) -> list[tuple[str, str, int, int]]:
    out = []
    for c in conds:
        if c.is_size and c.op in ("<", "<="):
            v = getattr(sample, c.attr)
            if v is not None:
                out.append((c.attr, c.name, int(v), int(c.threshold)))
    return out


def nearest_stop(
    sample: Sample | None,
    rules: Sequence[Rule],
    states: dict[str, RuleState],
    slope: SlopeWindow | None,
    now: float,
    *,
    window_s: float = FALL_WINDOW_S,
    min_fall_bytes_per_s: float = MIN_FALL_BYTES_PER_S,
    warn_margin_bytes: int = WARN_MARGIN_BYTES,
    stop_time_s: float = STOP_TIME_S,
    can_stop: bool = True,
    idle_why: str = "the model is not running",
) -> NearestStop | None:
    """The nearest stop line for ``sample`` (see the module docstring for every formula).

    ``now`` is the monotonic time of the sample (the slope window's clock); nothing is read here.
    ``can_stop``: whether a model runs that a rule would stop (False: no level about the stop's timing);
    ``idle_why``: why none does, said after a level that is not ok ("the model is not running"; guard mode with no
    container by its name says that).
    Returns None when there is no sample or no stop rule with a size line.
    """
    if sample is None:
        return None
    best: tuple[int, int, Rule, tuple[str, str, int, int]] | None = None
    max_ratio = 0.0
    for r in rules:
        if r.action != "stop":
            continue
        st = states.get(r.name) or RuleState()
        max_ratio = max(max_ratio, st.counter / max(1, r.samples))
        lines = _lines(r, sample)
        if not lines:
            continue
        binding = max(lines, key=lambda x: x[2] - x[3])
        head = binding[2] - binding[3]
        key = (head, -st.counter)
        if best is None or key < (best[0], -best[1]):
            best = (head, st.counter, r, binding)
    if best is None:
        return None
    head, counter, rule, (attr, label, value, threshold) = best
    fall: float | None = None
    ttf: float | None = None
    if attr in SLOPE_ATTRS and slope is not None:
        s = slope.slope(now, window_s)
        recent = slope.slope(now, window_s / 2, min_points=3)  # 2 s samples: 3 points in 5 s (not one pair)
        # the newest half of the window must fall too: just after a stop the window still held the fall while
        # memory was rising ("falling 0.13 GiB/s, reaches the line in 3 s", helper-48), and noise rarely
        # falls faster than min_fall_bytes_per_s over both
        if s is not None and -s > min_fall_bytes_per_s and (recent is None or -recent > min_fall_bytes_per_s):
            fall = -s
            ttf = max(0.0, head / fall)
    level: Level = "ok"
    why = f"{head / GiB:.1f} GiB above {rule.name}'s line"
    if head <= 0:
        level, why = "critical", f"{label} is below {rule.name}'s line"
    elif can_stop and max_ratio >= 0.5:
        level, why = "critical", "a stop rule's counter is at half its samples or more"
    elif can_stop and ttf is not None and ttf < stop_time_s:
        level, why = "critical", f"projected to reach the line in {ttf:.0f} s, sooner than a {stop_time_s:g} s stop"
    elif max_ratio > 0:
        level, why = "warn", "a stop rule is counting"
    elif head < warn_margin_bytes:
        level, why = "warn", f"within {warn_margin_bytes / GiB:g} GiB of {rule.name}'s line"
    elif ttf is not None and ttf < 4 * stop_time_s:
        level, why = "warn", f"projected to reach the line in {ttf:.0f} s"
    if not can_stop and level != "ok":
        why += f"; {idle_why}: nothing for a rule to stop"
    return NearestStop(
        rule=rule.name,
        kind=rule.kind,
        field=attr,
        label=label,
        value_bytes=value,
        threshold_bytes=threshold,
        headroom_bytes=head,
        counter=counter,
        samples=rule.samples,
        fall_rate_bytes_per_s=fall,
        time_to_floor_s=ttf,
        level=level,
        reason=why,
    )
