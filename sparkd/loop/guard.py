"""The guard's synchronous fast path: sample → derived signals → rules.

No database, no HTTP, no asyncio here: ``Guard.tick()`` is what the benchmark
times and what the daemon calls once per interval. Kernel-log polling is a
non-blocking read of new records (``kernlog`` sources).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkd.config import Settings
from sparkd.core.bursts import BurstDetector
from sparkd.core.engine import RuleEngine
from sparkd.core.rules import Decision, Rule, RuleState, SlopeWindow
from sparkd.core.sample import Sample, build_sample
from sparkd.sense import procfs
from sparkd.sense.kernlog import KernRecord, NvrmWindows, classify
from sparkd.units import fmt_gib, parse_size

log = logging.getLogger("sparkd.loop.guard")
_BLIND = operator.attrgetter("blind")

HELD_KERNEL_MAX = 1000  # kernel records kept across ticks whose /proc/meminfo read failed


# sample attribute -> the input that feeds it (for "which rule is blind because of what")
_SENSOR_OF = {
    "mem_available": "MemAvailable",
    "mem_available_minus_cma": "MemAvailable",
    "mem_free": "MemFree",
    "psi_some_avg10": "PSI",
    "psi_full_avg10": "PSI",
    "shm_bytes": "/dev/shm",
    "nvrm_recent": "kernel log",
}


@dataclass(slots=True)
class TickResult:
    sample: Sample
    decisions: list[Decision]
    kernel: list[KernRecord] = field(default_factory=list)
    read_error: str | None = None
    nvrm_burst: int | None = None  # NV_ERR_NO_MEMORY lines within the window when a burst crossed


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
        self.kern_gate: Callable[[], bool] | None = None  # "may the kernel log have records?" (set by the daemon)
        self.mono = mono
        self.wall = wall
        # the one rule engine (core.engine): the same object answers step, re-check and demotion
        self.engine = RuleEngine(
            settings.rules,
            cooldown_s=settings.cooldown_s,
            horizon_s=settings.container.stop_timeout_s,
            unresolved_ok=True,  # a /proc/meminfo without MemTotal makes % rules blind, never ends the guard
        )
        self.nvrm = NvrmWindows(settings.nvrm_window_s)
        self.bursts = BurstDetector(settings.nvrm_window_s, settings.nvrm_burst)
        self._burst: int | None = None
        self.proc = procfs.ProcReader(settings.proc_root)
        self.low_watermark: int | None = procfs.read_zoneinfo_low_watermark_bytes(settings.proc_root)
        self._bad_lines_logged: set[str] = set()
        self._psi_missing_logged = False
        self.last: Sample | None = None
        # why the last tick could not read /proc/meminfo (every rule is blind then), else None
        self.read_error: str | None = None
        self._held_kernel: list[KernRecord] = []  # records polled on a tick whose read failed
        self._kern_poll_error: str | None = None  # what _poll_source set as the reader's error
        self.nvrm_lines_total = 0
        self.psi_missing: str | None = None
        self.shm_missing: str | None = None
        self.kern_lines_total = 0  # kernel-log lines read (all kinds)
        self._fast_margin = parse_size(settings.fast_margin)
        self._fast_fall = parse_size(settings.fast_fall_rate)
        self._shm = procfs.ShmReader(settings.shm_dir)
        self._shm_rules_of: list[Rule] | None = None  # the rule list _shm_rules_exact was found for
        self._shm_rules_len = 0
        self._shm_rules_exact = True
        self._levels: list[tuple[str, float, Rule, bool]] = []
        self._levels_of: list[Rule] | None = None

    # ------------------------------------------------------------------ reading
    def read_sample(self) -> Sample:
        """Read /proc/meminfo, PSI and /dev/shm now.

        Raises:
            OSError: /proc/meminfo cannot be read (the caller reports and retries).
        """
        now_m, now_w = self.mono(), self.wall()
        mi = self.proc.named_meminfo()
        if mi.bad_lines:
            for line in mi.bad_lines:
                if line not in self._bad_lines_logged and len(self._bad_lines_logged) < 20:
                    self._bad_lines_logged.add(line)
                    log.warning("ignoring unparsable /proc/meminfo line: %r", line)
        psi = self.proc.psi()
        self.psi_missing = (
            None if psi is not None else f"{self.settings.proc_root}/pressure/memory absent or unreadable"
        )
        if psi is None and not self._psi_missing_logged:
            self._psi_missing_logged = True
            log.warning(
                "no PSI: %s/pressure/memory is absent or unreadable; PSI fields stay empty", self.settings.proc_root
            )
        # with no rule on shm_bytes, an unchanged Shmem answers /dev/shm again (ShmReader.read, issue 18)
        shm = self._shm.read(None if self._shm_exact() else mi.fields.get("Shmem"), now_m)
        self.shm_missing = None if shm[0] is not None else f"cannot read {self.settings.shm_dir}"
        return build_sample(
            now_w,
            now_m,
            mi,
            psi,
            shm,
            nvrm_recent=self.nvrm.recent(now_m),  # monotonic: a wall-clock step must not move the window
            low_watermark_bytes=self.low_watermark,
        )

    def _shm_exact(self) -> bool:
        """Does a rule read ``shm_bytes`` (then /dev/shm is read every tick)? Cached per rule list."""
        rules = self.engine.rules
        if rules is not self._shm_rules_of or len(rules) != self._shm_rules_len:
            self._shm_rules_of, self._shm_rules_len = rules, len(rules)
            self._shm_rules_exact = any("shm_bytes" in r.inputs() for r in rules)
        return self._shm_rules_exact

    def poll_kernel(self) -> list[KernRecord]:
        """New classified kernel-log records since the last poll (non-blocking)."""
        if self.kern_source is None:
            return []
        # kern_gate (loop.readable.ReadableGate): the event loop saw the source readable; None: poll always
        polled = self.kern_gate is None or self.kern_gate()
        if not polled and self.bursts.idle:
            return []  # nothing new and no line in the burst window: counting 0 lines changes nothing
        out = []
        now_m, now_w = self.mono(), self.wall()  # windows run on the monotonic clock; wall time labels them
        lines = self._poll_source(self.kern_source) if polled else []
        self.kern_lines_total += len(lines)
        n = 0
        for line in lines:
            rec = classify(line)
            if rec is None:
                continue
            if rec.kind == "nvrm_no_memory":
                self.nvrm.count_line(now_m, now_w)
                self.nvrm_lines_total += 1
                n += 1
            out.append(rec)
        # the whole poll counts at once: a threshold crossing is one burst however the lines were split
        self._burst = self.bursts.add(n, now_m)
        return out

    def _poll_source(self, src: Any) -> list[str]:
        """``src.poll()``; a reader that raises (an OSError a reader does not expect) blinds the kernel log, said as
        its ``error``, and this poll reads nothing: it was raised out of the tick, which then read no memory either
        (the rules stopped, "cannot read memory state", nothing blind: helper-40). Cleared by the next good poll."""
        try:
            lines: list[str] = src.poll()
        except (OSError, ValueError) as e:
            said = f"reading the kernel log failed: {type(e).__name__}: {e}"
            if self._kern_poll_error != said:
                log.error("%s (the guard goes on without it; tried again each tick)", said)
            self._kern_poll_error = src.error = said
            return []
        if self._kern_poll_error is not None and src.error == self._kern_poll_error:
            src.error = None
        self._kern_poll_error = None
        return lines

    # the engine's state, under the names the daemon and the tests read
    @property
    def rules(self) -> list[Rule]:
        return self.engine.rules

    @property
    def states(self) -> dict[str, RuleState]:
        return self.engine.states

    @property
    def slope(self) -> SlopeWindow:
        return self.engine.slope

    @property
    def demoted(self) -> dict[str, str]:
        return self.engine.demoted

    def ensure_rules(self, sample: Sample) -> None:
        """Compile the rules once MemTotal is known (``%`` thresholds need it)."""
        self.engine.ensure(sample)

    def evaluate(self, sample: Sample) -> list[Decision]:
        return self.engine.step(sample)

    def tick(self) -> TickResult:
        """One guard step: kernel log, sample, rules. Never touches the database.

        Raises:
            OSError: /proc/meminfo could not be read. ``read_error`` says why and every rule is marked
                blind (``RuleState.blind``) until a read succeeds; the kernel records polled on this
                tick are handed out with the next sample (at most ``HELD_KERNEL_MAX``).
        """
        self._burst = None
        kernel = self._held_kernel + self.poll_kernel()
        self._held_kernel = []
        try:
            sample = self.read_sample()
        except OSError as e:
            self._held_kernel = kernel[-HELD_KERNEL_MAX:]
            self.read_error = f"cannot read {self.settings.proc_root}/meminfo: {e.strerror or e}"
            for st in self.engine.states.values():
                st.blind = f"cannot evaluate: {self.read_error}"
            raise
        self.read_error = None
        decisions = self.evaluate(sample)
        self.last = sample
        return TickResult(sample, decisions, kernel, nvrm_burst=self._burst)

    def rule(self, name: str) -> Rule | None:
        return self.engine.rule(name)

    def rules_json(self) -> list[dict[str, Any]]:
        """Each rule as configured, with its counters, whether it was demoted and why it is blind."""
        return self.engine.rules_json()

    def blind_sensors(self) -> dict[str, str]:
        """``{input: why}`` for each input a rule may need that could not be read on the last tick:
        MemAvailable, MemFree (absent from meminfo), PSI, /dev/shm, the kernel log."""
        out: dict[str, str] = {}
        if self.read_error is not None:  # nothing was read: every memory figure is missing
            return {"MemAvailable": self.read_error, "MemFree": self.read_error}
        last = self.last
        if last is not None:
            for name, attr in (("MemAvailable", "mem_available"), ("MemFree", "mem_free")):
                if getattr(last, attr) is None:
                    out[name] = f"no {name} line in {self.settings.proc_root}/meminfo"
        if self.psi_missing:
            out["PSI"] = self.psi_missing
        if self.shm_missing:
            out["/dev/shm"] = self.shm_missing
        if self.settings.kernlog_source != "off":
            src = self.kern_source
            err = getattr(src, "error", None) if src is not None else "no kernel-log reader is open"
            if err:
                out["kernel log"] = str(err)
        return out

    def blind_key(self) -> tuple[Any, ...]:
        """Everything ``blind_sensors``, ``sensor_users`` and ``engine.blind`` depend on, cheap to compare
        every tick: the daemon builds the blind report again only when this changes (issue 18)."""
        last = self.last
        src = self.kern_source
        return (
            self.read_error,
            last is None or last.mem_available is None,
            last is None or last.mem_free is None,
            self.psi_missing,
            self.shm_missing,
            src is None,
            getattr(src, "error", None),
            id(self.engine.rules),
            len(self.engine.rules),
            tuple(map(_BLIND, self.engine.states.values())),  # in C: no generator frame per rule (issue 18)
        )

    def sensor_users(self) -> dict[str, list[str]]:
        """``{input: [rules that read it]}`` for the inputs ``blind_sensors`` names."""
        out: dict[str, list[str]] = {}
        for r in self.rules:
            for attr in r.inputs():
                name = _SENSOR_OF.get(attr)
                if name is not None:
                    out.setdefault(name, []).append(r.name)
        return out

    def _near_levels(self) -> list[tuple[str, float, Rule, bool]]:
        """``[(attr, level, rule, is_floor)]``: each rule's floors then its watch levels, in rule order,
        built again only when the engine's rule list is replaced (a compile, a demotion): the fast
        check reads it every tick (issue 18)."""
        rules = self.engine.rules
        if self._levels_of is not rules:  # the list itself is kept, so its identity cannot be reused
            levels: list[tuple[str, float, Rule, bool]] = []
            for r in rules:
                levels += [(attr, floor, r, True) for attr, floor in r.floors()]
                levels += [(attr, level, r, False) for attr, level in r.watch_levels()]
            self._levels, self._levels_of = levels, rules
        return self._levels

    def fast_reason(self, sample: Sample) -> str | None:
        """Why the next sample should come at the fast interval, or ``None``.

        Fast when a stop rule's counter is above zero, when MemAvailable is within
        ``fast_margin`` of a floor, or falling faster than ``fast_fall_rate`` per second.
        """
        engine = self.engine  # (not the properties: a frame each, every tick)
        states = engine.states
        for r in engine.rules:
            st = states.get(r.name)
            if st is not None and st.counter > 0:
                return f"rule {r.name} counting"
        avail = sample.mem_available
        if avail is None:
            return None
        margin = self._fast_margin
        for attr, level, r, is_floor in self._near_levels():
            v = getattr(sample, attr)
            if v is not None and v - level < margin:
                name = "usable" if attr == "mem_available_minus_cma" else attr
                if is_floor:  # "within 4GiB of" read wrong 10 GiB below it (helper-50)
                    where = "below" if v < level else f"within {self.settings.fast_margin} of"
                    return f"{name} {where} {r.name}'s floor"
                return f"{name} near or below {r.name}'s watch level {fmt_gib(level)} (projecting; not a stop line)"
        # three points over at least 2 s; at the normal interval the third point is 2 intervals old, so
        # a window of exactly 2 s would keep it only when the loop's jitter happens to fall the right way
        s = engine.slope.slope(sample.mono, max(2.0, 2.5 * self.settings.interval_s), min_points=3)
        if s is not None and -s > self._fast_fall:
            return f"MemAvailable falling {-s / 2**30:.2f} GiB/s"
        return None
