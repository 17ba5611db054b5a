"""The guard's synchronous fast path: sample → derived signals → rules.

No database, no HTTP, no asyncio here: ``Guard.tick()`` is what the benchmark
times and what the daemon calls once per interval. Kernel-log polling is a
non-blocking read of new records (``kernlog`` sources).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkd.config import Settings
from sparkd.core.floors import demote
from sparkd.core.rules import Decision, Rule, RuleState, SlopeWindow, compile_rules, evaluate
from sparkd.core.sample import Sample, build_sample
from sparkd.sense import procfs
from sparkd.sense.kernlog import KernRecord, NvrmWindows, classify
from sparkd.units import parse_size

log = logging.getLogger("sparkd.loop.guard")


@dataclass(slots=True)
class TickResult:
    sample: Sample
    decisions: list[Decision]
    kernel: list[KernRecord] = field(default_factory=list)
    read_error: str | None = None


class Guard:
    """Holds the rule states and reads the machine.

    Args:
        settings: validated settings (``proc_root``, ``shm_dir``, rules, intervals).
        kern_source: an object with ``poll() -> list[str]`` (see ``kernlog``), or ``None``.
        mono, wall: injectable clocks (``time.monotonic``, ``time.time``).
    """

    def __init__(
        self,
        settings: Settings,
        kern_source: Any = None,
        *,
        mono: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.kern_source = kern_source
        self.mono = mono
        self.wall = wall
        self.rules: list[Rule] = []
        self.states: dict[str, RuleState] = {}
        self.slope = SlopeWindow(max_window_s=30.0)
        self.nvrm = NvrmWindows(settings.nvrm_window_s)
        self.mem_total: int | None = None
        self.proc = procfs.ProcReader(settings.proc_root)
        self.low_watermark: int | None = procfs.read_zoneinfo_low_watermark_bytes(settings.proc_root)
        self._bad_lines_logged: set[str] = set()
        self._psi_missing_logged = False
        self.last: Sample | None = None
        self.nvrm_lines_total = 0
        self.kern_lines_total = 0  # kernel-log lines read (all kinds)
        self.demoted: dict[str, str] = {}  # rule -> why it cannot protect this host (watermark.LoopGuard)
        self._fast_margin = parse_size(settings.fast_margin)
        self._fast_fall = parse_size(settings.fast_fall_rate)

    # ------------------------------------------------------------------ reading
    def read_sample(self) -> Sample:
        """Read /proc/meminfo, PSI and /dev/shm now.

        Raises:
            OSError: /proc/meminfo cannot be read (the caller reports and retries).
        """
        now_m, now_w = self.mono(), self.wall()
        mi = self.proc.meminfo()
        if mi.bad_lines:
            for line in mi.bad_lines:
                if line not in self._bad_lines_logged and len(self._bad_lines_logged) < 20:
                    self._bad_lines_logged.add(line)
                    log.warning("ignoring unparsable /proc/meminfo line: %r", line)
        psi = self.proc.psi()
        if psi is None and not self._psi_missing_logged:
            self._psi_missing_logged = True
            log.warning(
                "no PSI: %s/pressure/memory is absent or unreadable; PSI fields stay empty", self.settings.proc_root
            )
        shm = procfs.read_shm(self.settings.shm_dir)
        return build_sample(
            now_w,
            now_m,
            mi,
            psi,
            shm,
            nvrm_recent=self.nvrm.recent(now_m),  # monotonic: a wall-clock step must not move the window
            low_watermark_bytes=self.low_watermark,
        )

    def poll_kernel(self) -> list[KernRecord]:
        """New classified kernel-log records since the last poll (non-blocking)."""
        if self.kern_source is None:
            return []
        out = []
        now_m, now_w = self.mono(), self.wall()  # windows run on the monotonic clock; wall time labels them
        lines = self.kern_source.poll()
        self.kern_lines_total += len(lines)
        for line in lines:
            rec = classify(line)
            if rec is None:
                continue
            if rec.kind == "nvrm_no_memory":
                self.nvrm.count_line(now_m, now_w)
                self.nvrm_lines_total += 1
            out.append(rec)
        return out

    def ensure_rules(self, sample: Sample) -> None:
        """Compile the rules once MemTotal is known (``%`` thresholds need it)."""
        if self.rules and self.mem_total == sample.mem_total:
            return
        self.mem_total = sample.mem_total
        self.rules = demote(
            compile_rules(self.settings.rules, sample.mem_total, self.settings.fast_interval_s), self.demoted
        )
        for r in self.rules:
            self.states.setdefault(r.name, RuleState())

    def evaluate(self, sample: Sample) -> list[Decision]:
        self.ensure_rules(sample)
        self.slope.add(sample.mono, sample.mem_available)
        return evaluate(
            sample, self.rules, self.states, sample.mono, cooldown_s=self.settings.cooldown_s, slope=self.slope
        )

    def tick(self) -> TickResult:
        """One guard step: kernel log, sample, rules. Never touches the database."""
        kernel = self.poll_kernel()
        sample = self.read_sample()
        decisions = self.evaluate(sample)
        self.last = sample
        return TickResult(sample, decisions, kernel)

    def rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    def rules_json(self) -> list[dict[str, Any]]:
        """Each rule as configured, with its counters and whether it was demoted."""
        return [
            {**r.to_json(), "demoted": self.demoted.get(r.name), **self.states.get(r.name, RuleState()).to_json()}
            for r in self.rules
        ]

    def fast_reason(self, sample: Sample) -> str | None:
        """Why the next sample should come at the fast interval, or ``None``.

        Fast when a stop rule's counter is above zero, when MemAvailable is within
        ``fast_margin`` of a floor, or falling faster than ``fast_fall_rate`` per second.
        """
        for r in self.rules:
            if self.states.get(r.name, RuleState()).counter > 0:
                return f"rule {r.name} counting"
        avail = sample.mem_available
        if avail is None:
            return None
        margin = self._fast_margin
        for r in self.rules:
            for attr, floor in r.floors():
                v = getattr(sample, attr)
                if v is not None and v - floor < margin:
                    return f"{attr} within {self.settings.fast_margin} of {r.name}'s floor"
        # three points over at least 2 s; at the normal interval the third point is 2 intervals old, so
        # a window of exactly 2 s would keep it only when the loop's jitter happens to fall the right way
        s = self.slope.slope(sample.mono, max(2.0, 2.5 * self.settings.interval_s), min_points=3)
        if s is not None and -s > self._fast_fall:
            return f"MemAvailable falling {-s / 2**30:.2f} GiB/s"
        return None
