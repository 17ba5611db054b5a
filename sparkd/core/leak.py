"""Leak trend of driver memory — pure: no I/O, no clock reads (times are passed in).

Driver memory (``Sample.driver_bytes`` = MemTotal − MemFree − Buffers − Cached −
AnonPages − Slab − PageTables − KernelStack) steps up with new request shapes and
does not come back: the CUDA caching allocator keeps its segments and every new
execution shape adds CUDA graphs (+0.8 GiB for a first 90k-token prompt, ~3 GiB
over 13 h; CONTEXT.md "What the operators learned later"). The answer is a
planned relaunch, not a stop, so this module only raises an *alert*.

Per launch:

1. ``start_launch(launch_id, t0)``; until ``t0 + warmup_start_s`` the figures
   are ignored (weights, profiling and graph capture move them):
   state ``"waiting for warm-up window"``.
2. From ``t0 + warmup_start_s`` to ``t0 + warmup_end_s`` the baseline is the
   MINIMUM driver figure seen (a request in flight only adds):
   state ``"measuring baseline"``.
3. After the window: state ``"tracking"``; ``observe`` returns a ``LeakAlert``
   when driver ≥ baseline + ``threshold_bytes``, at most once per ``repeat_s``.
   If no figure arrived inside the window (daemon started late, reads failed),
   the first figure after it becomes the baseline (``baseline_late`` in status).

Defaults (``config.Settings``): window 15–25 min after launch start
(``leak_warmup_start_s`` 900, ``leak_warmup_end_s`` 1500), threshold 4 GiB
(``leak_threshold``: above the ~3 GiB the operators saw over 13 h of normal
service), repeat once a day (``leak_repeat_s`` 86400).

Times are seconds on any one clock (monotonic or epoch), the same for
``start_launch`` and ``observe``; sizes are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparkd.units import GiB

STATE_IDLE = "no launch"
STATE_WAITING = "waiting for warm-up window"
STATE_MEASURING = "measuring baseline"
STATE_TRACKING = "tracking"


def _g1(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


@dataclass(frozen=True, slots=True)
class LeakAlert:
    """One ``leak_trend`` alert. Sizes in bytes, ``t`` on the caller's clock."""

    launch_id: str | None
    t: float
    driver_bytes: int
    baseline_bytes: int
    growth_bytes: int
    threshold_bytes: int
    reason: str

    def details(self) -> dict[str, Any]:
        """JSON-able details for the event (bytes)."""
        return {
            "launch_id": self.launch_id,
            "driver_bytes": self.driver_bytes,
            "baseline_bytes": self.baseline_bytes,
            "growth_bytes": self.growth_bytes,
            "threshold_bytes": self.threshold_bytes,
        }


class LeakTracker:
    """Baseline-after-warm-up and growth alert for one launch at a time.

    Args:
        warmup_start_s: seconds after launch start when the baseline window opens (default 900).
        warmup_end_s: seconds after launch start when it closes (default 1500; ≥ ``warmup_start_s``).
        threshold_bytes: growth over the baseline that raises an alert (default 4 GiB).
        repeat_s: least time between two alerts of one launch (default 86400).

    Raises:
        ValueError: a negative value, ``warmup_end_s < warmup_start_s``, or a
            non-positive threshold.
    """

    def __init__(
        self,
        warmup_start_s: float = 900.0,
        warmup_end_s: float = 1500.0,
        threshold_bytes: int = 4 * GiB,
        repeat_s: float = 86400.0,
    ) -> None:
        if warmup_start_s < 0 or repeat_s < 0:
            raise ValueError("warmup_start_s and repeat_s must be >= 0")
        if warmup_end_s < warmup_start_s:
            raise ValueError(f"warmup_end_s ({warmup_end_s:g}) must be >= warmup_start_s ({warmup_start_s:g})")
        if threshold_bytes <= 0:
            raise ValueError("threshold_bytes must be > 0")
        self.warmup_start_s = warmup_start_s
        self.warmup_end_s = warmup_end_s
        self.threshold_bytes = int(threshold_bytes)
        self.repeat_s = repeat_s
        self.launch_id: str | None = None
        self.t0: float | None = None
        self.baseline: int | None = None
        self.baseline_late = False
        self.current: int | None = None
        self.current_t: float | None = None
        self.peak: int | None = None
        self.last_alert_t: float | None = None
        self.alerts = 0

    def start_launch(self, launch_id: str | None, t0: float) -> None:
        """A new launch began at ``t0``: forget the previous baseline and alerts."""
        self.launch_id = launch_id
        self.t0 = t0
        self.baseline = None
        self.baseline_late = False
        self.current = self.current_t = self.peak = None
        self.last_alert_t = None
        self.alerts = 0

    def state(self, t: float | None = None) -> str:
        """One of ``STATE_*`` at time ``t`` (default: the last observation)."""
        if self.t0 is None:
            return STATE_IDLE
        t = self.current_t if t is None else t
        if t is None:
            return STATE_WAITING
        elapsed = t - self.t0
        if elapsed < self.warmup_start_s:
            return STATE_WAITING
        if elapsed < self.warmup_end_s:
            return STATE_MEASURING
        return STATE_TRACKING

    def observe(self, t: float, driver_bytes: int | None) -> LeakAlert | None:
        """Feed one driver figure (bytes) at time ``t``; return an alert when one is due.

        ``None`` figures (a missing meminfo field) and figures before any
        ``start_launch`` are ignored.
        """
        if self.t0 is None or driver_bytes is None:
            return None
        self.current, self.current_t = driver_bytes, t
        st = self.state(t)
        if st == STATE_WAITING:
            return None
        if st == STATE_MEASURING:
            self.baseline = driver_bytes if self.baseline is None else min(self.baseline, driver_bytes)
            return None
        if self.baseline is None:
            self.baseline, self.baseline_late = driver_bytes, True
        self.peak = driver_bytes if self.peak is None else max(self.peak, driver_bytes)
        growth = driver_bytes - self.baseline
        if growth < self.threshold_bytes:
            return None
        if self.last_alert_t is not None and t - self.last_alert_t < self.repeat_s:
            return None
        self.last_alert_t = t
        self.alerts += 1
        reason = (
            f"driver memory {_g1(driver_bytes)} is {_g1(growth)} above the post-warm-up baseline "
            f"{_g1(self.baseline)} (threshold {_g1(self.threshold_bytes)}): plan a relaunch"
        )
        return LeakAlert(self.launch_id, t, driver_bytes, self.baseline, growth, self.threshold_bytes, reason)

    def status(self) -> dict[str, Any]:
        """For ``sparkd status``. Bytes; ``None`` where not known yet.

        Shape: ``{"state", "launch_id", "baseline_bytes", "baseline_late",
        "current_bytes", "peak_bytes", "growth_bytes", "threshold_bytes",
        "window_s": [start, end], "elapsed_s", "alerts", "last_alert_t"}``.
        """
        growth = None
        if self.baseline is not None and self.current is not None and self.state() == STATE_TRACKING:
            growth = self.current - self.baseline
        elapsed = None
        if self.t0 is not None and self.current_t is not None:
            elapsed = self.current_t - self.t0
        return {
            "state": self.state(),
            "launch_id": self.launch_id,
            "baseline_bytes": self.baseline,
            "baseline_late": self.baseline_late,
            "current_bytes": self.current,
            "peak_bytes": self.peak,
            "growth_bytes": growth,
            "threshold_bytes": self.threshold_bytes,
            "window_s": [self.warmup_start_s, self.warmup_end_s],
            "elapsed_s": elapsed,
            "alerts": self.alerts,
            "last_alert_t": self.last_alert_t,
        }
