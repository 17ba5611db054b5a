"""Driver-error bursts: a threshold crossing in a sliding window, however lines are split.

The guard reads the kernel log in polls; a burst arrives in one read in the field (16
NV_ERR_NO_MEMORY lines in one second in one report, ~200 per boot in another). Counting
the poll and comparing ``== threshold`` missed 25 lines read at once and reported exactly
20 lines 20 times (issue 12, kind 1). Here each poll's count joins a sliding window of
``window_s``; when the lines within the window reach ``threshold`` a burst is reported,
and then not again until ``window_s`` has passed since that report — exactly one burst
per window, whether the lines came 1 by 1, 8+8+9, 25 or 100 at once.

Pure: ``now`` is handed in (seconds on one caller-chosen clock, never going backwards).
"""

from __future__ import annotations

import math
from collections import deque


class BurstDetector:
    """Sliding-window threshold over line counts.

    Args:
        window_s: the window (s), > 0 (``nvrm_window_s``, default 10 s).
        threshold: lines within one window that make a burst, >= 1 (``nvrm_burst``, default 20).

    Raises:
        ValueError: ``window_s`` not a positive finite number, or ``threshold`` < 1.
    """

    def __init__(self, window_s: float, threshold: int) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1 line, got {threshold!r}")
        self.window_s = float(window_s)
        self.threshold = threshold
        self._arrivals: deque[tuple[float, int]] = deque()
        self._in_window = 0
        self._last_burst: float | None = None
        self.bursts = 0

    def add(self, n: int, now: float) -> int | None:
        """Count ``n`` lines that arrived at ``now``; the lines within the window when this
        crosses the threshold (a burst to report), else ``None``.

        Raises:
            ValueError: ``n`` < 0.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0 lines, got {n}")
        if n:
            self._arrivals.append((now, n))
            self._in_window += n
        while self._arrivals and now - self._arrivals[0][0] >= self.window_s:
            self._in_window -= self._arrivals.popleft()[1]
        if self._in_window < self.threshold:
            return None
        if self._last_burst is not None and now - self._last_burst < self.window_s:
            return None
        self._last_burst = now
        self.bursts += 1
        return self._in_window

    @property
    def idle(self) -> bool:
        """No line within the window: ``add(0, now)`` would change nothing and return ``None``."""
        return not self._arrivals

    @property
    def in_window(self) -> int:
        """Lines within the window as of the last ``add``."""
        return self._in_window
