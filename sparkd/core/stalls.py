"""Short stalls of the guard loop, summed over a sliding window — pure: no I/O, no clock reads.

A tick that comes far too late (``max(3 × interval, 2 s)``) is a ``guard_gap`` event of its own. Short
stalls below that threshold are not, yet many of them leave the guard blind just the same: a process
stopped 1.9 s out of every 2 s (SIGSTOP/SIGCONT, a cgroup freezer, a host thrashing its page cache under
memory pressure, a starved vCPU) takes one sample where it should take two, for as long as it lasts,
and the rules' "N consecutive samples" take N times longer to act. This module adds up the time each
late tick missed (its gap since the previous tick minus one interval) over ``STALL_WINDOW_S`` and says
so once, when the sum reaches ``STALL_REPORT_S``: a third of the window without the samples it should
have had. It is armed again when the sum falls below half of that.

Times are seconds on one monotonic clock.
"""

from __future__ import annotations

import collections
import dataclasses

STALL_WINDOW_S = 30.0  # the sliding window the missed time is summed over, s
STALL_REPORT_S = 10.0  # missed time in the window that is reported: a third of it, s
LATE_FACTOR = 1.5  # a tick is late when its gap since the previous tick exceeds this many intervals


@dataclasses.dataclass(frozen=True)
class StallReport:
    """What the window held when it reached ``STALL_REPORT_S``: seconds missed, late ticks, the longest gap."""

    missed_s: float
    late_ticks: int
    longest_gap_s: float
    window_s: float

    def message(self) -> str:
        return (
            f"the guard ran late: {self.missed_s:.1f} s of the last {self.window_s:g} s without the samples it "
            f"should have taken ({self.late_ticks} late ticks, the longest gap {self.longest_gap_s:.1f} s); "
            "the process is being stopped or starved of CPU, and the rules see the host that much later"
        )

    def details(self) -> dict[str, float | int]:
        return {
            "missed_s": round(self.missed_s, 3),
            "late_ticks": self.late_ticks,
            "longest_gap_s": round(self.longest_gap_s, 3),
            "window_s": self.window_s,
        }


class StallWindow:
    """The late ticks of the last ``window_s`` seconds (only late ones are kept: nothing at idle)."""

    def __init__(self, window_s: float = STALL_WINDOW_S, report_s: float = STALL_REPORT_S) -> None:
        if not 0 < report_s <= window_s:
            raise ValueError(f"report_s = {report_s!r}: must be > 0 and <= window_s ({window_s!r}), seconds")
        self.window_s = window_s
        self.report_s = report_s
        self._late: collections.deque[tuple[float, float, float]] = collections.deque()  # (at, gap_s, missed_s)
        self._missed_s = 0.0
        self.reported = False  # said for this episode; armed again below report_s / 2
        self.episodes = 0

    def late(self, now: float, gap_s: float, interval_s: float) -> StallReport | None:
        """One tick whose gap since the previous tick was ``gap_s`` (> ``LATE_FACTOR`` intervals: the caller
        checks, so an on-time tick costs nothing). Returns the report when the missed time in the window
        first reaches ``report_s`` in an episode, else None."""
        missed = max(0.0, gap_s - interval_s)
        self._late.append((now, gap_s, missed))
        self._missed_s += missed
        while self._late and self._late[0][0] < now - self.window_s:
            self._missed_s -= self._late.popleft()[2]
        if self._missed_s < self.report_s / 2:
            self.reported = False
        if self.reported or self._missed_s < self.report_s:
            return None
        self.reported = True
        self.episodes += 1
        return StallReport(
            missed_s=self._missed_s,
            late_ticks=len(self._late),
            longest_gap_s=max(g for _, g, _ in self._late),
            window_s=self.window_s,
        )
