"""The readable replay report: a table of active samples, decisions, and a summary."""

from __future__ import annotations

from sparkd.core.rules import Rule
from sparkd.ops.replay.run import ReplayResult
from sparkd.ops.replay.traces import Trace, _utc
from sparkd.units import fmt_gib

# --------------------------------------------------------------------------- rendering

MAX_TABLE_ROWS = 200


def _needs(r: Rule) -> str:
    """``low_available (4 s, >= 3 samples, stop)`` or ``x (5 samples, stop)``."""
    if r.for_s is not None:
        return f"{r.name} ({r.for_s:g} s, >= {r.samples} samples, {r.action})"
    return f"{r.name} ({r.samples} samples, {r.action})"


def _counting(r: Rule, counter: int, held_s: float | None) -> str:
    """A counting rule in the table: ``low_available 2/3``; a duration rule by how long it held, of ``for_s``
    (``low_for held 2.5/4 s (3 samples)``; "5/3" read as an overrun, as ``sparkd status`` said before note 10)."""
    if r.for_s is None:
        return f"{r.name} {counter}/{r.samples}"
    within = f" in the last {r.in_last_s:g} s" if r.in_last_s else ""
    return f"{r.name} held {held_s or 0:.1f}/{r.for_s:g} s{within} ({counter} sample{'' if counter == 1 else 's'})"


def render(result: ReplayResult, trace: Trace, *, title: str, show_all: bool = False) -> str:
    """The readable table and summary printed by ``sparkd replay``."""
    lines = [f"rules: {title} — " + ", ".join(f"{_needs(r)}" for r in result.rules)]
    quiet = 0
    cma = any(st.usable is not None and st.usable != st.mem_available for st in result.steps)
    rows: list[str] = [
        f"  {'t (s)':>9}  {'MemAvailable':>12}  "
        + (f"{'usable':>10}  " if cma else "")
        + f"{'MemFree':>10}  {'nvrm':>4}  counting",
    ]
    for st in result.steps:
        active = {k: v for k, v in st.counters.items() if v}
        if not show_all and len(result.steps) > MAX_TABLE_ROWS and not active and not st.decisions:
            quiet += 1
            continue
        mark = "*" if st.synthetic else " "
        counting = ", ".join(
            _counting(next(r for r in result.rules if r.name == k), v, st.held_s.get(k)) for k, v in active.items()
        )
        label = f"  [{st.label}]" if st.label else ""
        rows.append(
            f"{mark} {st.t:>9.2f}  {fmt_gib(st.mem_available):>12}  "
            + (f"{fmt_gib(st.usable):>10}  " if cma else "")
            + f"{fmt_gib(st.mem_free):>10}  "
            f"{st.nvrm_recent:>4}  {counting}{label}"
        )
        for d in st.decisions:
            tag = {"trip": f"TRIP ({d.action})", "near_miss": "near miss", "cooldown": "cooldown"}[d.kind]
            extra = ""
            if d.kind == "trip" and d.action == "stop" and d.recheck is not None:
                extra = (
                    "  [re-check on the next sample: still holds]"
                    if d.recheck
                    else "  [re-check on the next sample: recovered — the daemon would not stop]"
                )
            rows.append(f"{'':>13}→ {tag}: {d.reason}{extra}")
    lines += rows
    if quiet:
        lines.append(f"  ({quiet} quiet samples not shown; --all shows every sample)")
    lines.append(result.summary())
    stop = result.first_stop
    if stop is not None:
        lines.append(f"  reason: {stop.reason}")
        if trace.epoch:
            lines.append(f"  at {_utc(stop.ts)} UTC")
    for r in result.rules:
        ft = result.first_trip[r.name]
        nm = result.near_misses[r.name]
        nm_text = f", {nm} near misses (suppressed)" if nm else ""
        if ft is None and (why := result.why_no_trip(r)) is not None:
            lines.append(f"  {r.name}: no trip; {why}{nm_text}")
        elif ft is None:
            lines.append(f"  {r.name}: no trip (highest count {result.max_counter[r.name]}/{r.samples}){nm_text}")
        else:
            lines.append(
                f"  {r.name}: first trip at t={ft.t:.2f} s, MemAvailable {fmt_gib(ft.mem_available)}, "
                f"{len(result.trips(r.name))} trip(s){nm_text}"
            )
    return "\n".join(lines)


def compare_text(a: ReplayResult, a_name: str, b: ReplayResult, b_name: str) -> str:
    """One line: which rule set stops first, and by how much."""
    sa, sb = a.first_stop, b.first_stop
    if sa is None and sb is None:
        return f"compare: neither {a_name} nor {b_name} stops before the trace ends"
    if sb is None:
        assert sa is not None and a.last is not None
        return (
            f"compare: {a_name} stops at t={sa.t:.2f} s (MemAvailable {fmt_gib(sa.mem_available)}); "
            f"{b_name} does not stop before the trace ends (t={a.last.t:.2f} s, "
            f"MemAvailable {fmt_gib(a.last.mem_available)})"
        )
    if sa is None:
        return (
            f"compare: {b_name} stops at t={sb.t:.2f} s (MemAvailable {fmt_gib(sb.mem_available)}); "
            f"{a_name} does not stop before the trace ends"
        )
    delta = sb.t - sa.t
    if abs(delta) < 1e-9:
        rel = "at the same time"
    else:
        rel = f"{abs(delta):.2f} s {'earlier' if delta > 0 else 'later'} than {b_name}"
    return (
        f"compare: {a_name} stops at t={sa.t:.2f} s (MemAvailable {fmt_gib(sa.mem_available)}), {rel} "
        f"(t={sb.t:.2f} s, MemAvailable {fmt_gib(sb.mem_available)})"
    )
