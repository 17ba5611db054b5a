"""The predictive rules' robust slope: recent ``(mono, usable bytes)`` points and a
Theil–Sen fit over any trailing window (pure; times are handed in).

Theil–Sen (the median of pairwise slopes) ignores a single outlier, such as the ~1 GiB
single-sample excursions measured on healthy servers (CONTEXT.md, operators' change log);
least squares would be pulled by it.
"""

from __future__ import annotations

from collections import deque

#: The fewest points a fit uses, and the most (evenly thinned, newest always kept): Theil–Sen
#: is O(n²) in the points, 32 points are 496 pairs (bench/engine.py).
FIT_MIN_POINTS = 4
FIT_MAX_POINTS = 32
#: A window of ``w`` seconds holds the points up to ``w + WINDOW_EDGE_S`` old. Samples come at a
#: regular cadence (≥ 0.1 s), so the point ``k`` intervals back sits on a window's edge; its age as
#: the live guard measures it (the monotonic clock) and as a replay measures it (the stored wall
#: time) differ by microseconds, and an edge at exactly ``w`` let that decide whether it counts
#: (a predictive trip one sample apart between a live run and its replay). Half the shortest
#: interval puts the edge between two samples.
WINDOW_EDGE_S = 0.05


class SlopeWindow:
    """Recent ``(mono, usable bytes)`` points for the predictive rules' robust slopes.

    Adding a point at a time not after the newest is ignored, so the re-check and the next
    step may both add one sample without counting it twice."""

    def __init__(self, max_window_s: float = 64.0, max_points: int = 1024) -> None:
        self.max_window_s = max_window_s
        self.points: deque[tuple[float, int]] = deque(maxlen=max_points)

    def add(self, mono: float, value: int | None) -> None:
        if value is None or (self.points and mono <= self.points[-1][0]):
            return
        self.points.append((mono, value))
        while self.points and mono - self.points[0][0] > self.max_window_s + WINDOW_EDGE_S:
            self.points.popleft()

    def recent(self, now: float, window_s: float) -> list[tuple[float, int]]:
        """The points within ``window_s`` of ``now``, oldest first. Points are in time order (``add``),
        so the walk starts at the newest and stops at the first one outside: a 2 s window looks at
        ~3 points, not the whole 64 s history (issue 18)."""
        out = []
        for p in reversed(self.points):
            if now - p[0] > window_s + WINDOW_EDGE_S:
                break
            out.append(p)
        out.reverse()
        return out

    def span(self, now: float, window_s: float) -> float:
        """Seconds between the oldest point within ``window_s`` of ``now`` and the newest."""
        pts = self.recent(now, window_s)
        return pts[-1][0] - pts[0][0] if pts else 0.0

    def slope(
        self, now: float, window_s: float, min_points: int = FIT_MIN_POINTS, max_points: int = FIT_MAX_POINTS
    ) -> float | None:
        """Theil–Sen slope in bytes/s over the last ``window_s`` (median of pairwise slopes).

        Robust to a single outlier (one-sample dip); ``None`` with fewer than ``min_points``.
        More than ``max_points`` are thinned evenly (the newest kept) before fitting.
        """
        pts = self.recent(now, window_s)
        if len(pts) < min_points:
            return None
        if len(pts) > max_points:
            n = len(pts)
            pts = [pts[n - 1 - round(i * (n - 1) / (max_points - 1))] for i in range(max_points - 1, -1, -1)]
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
