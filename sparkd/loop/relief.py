"""Relief before stopping, in the running daemon: drop clean page cache once while a MemFree rule counts.

Source: CONTEXT.md "Relief" (the source project's watchdog). Each guard tick the daemon calls
``ReliefRunner.consider(rules, states)``. When ``relief.enabled``, no relief is running, a rule
whose conditions read MemFree is counting, and the page cache that can be dropped at once
(``core.relief.reclaimable_page_cache_bytes``) is ≥ ``relief.min_reclaimable`` (1 GiB), and the
last relief was ≥ ``relief.min_interval_s`` (60 s) ago, it starts one relief in the background:
``act.pagecache.drop_clean_cache`` in a worker thread, limited to ``relief.timeout_s``. Rules that
read only MemAvailable never start one (MemAvailable already counts reclaimable cache).

After the drop it reads MemFree again. A rule's counter is reset only when MemFree rose by
at least 256 MiB (``core.relief.relief_helped``); otherwise the rule goes on counting and
stops the model as it would have. Every relief is a ``relief`` event with the bytes freed;
a drop that fails (not root) or does not return in time is a ``relief_failed`` event and turns
relief off for the rest of the run (a blocked write cannot be taken back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sparkd.act.pagecache import drop_clean_cache
from sparkd.config import ReliefSettings
from sparkd.core.relief import ReliefPolicy, reclaimable_page_cache_bytes, relief_helped, uses_mem_free
from sparkd.core.rules import Rule, RuleState
from sparkd.sense import procfs
from sparkd.units import fmt_gib, parse_size

log = logging.getLogger("sparkd.loop.relief")


class ReliefRunner:
    """``emit(kind, message, severity, details)``: the daemon's event; ``relieved(rule)``: start the
    rule's counter again (``core.engine.RuleEngine.relieved``, the one place counters change; the
    ``relief`` event is how a replay applies it too); ``drop(proc_root)``: the drop
    (``act.pagecache.drop_clean_cache``); ``read_meminfo()``: /proc/meminfo fields in bytes."""

    def __init__(
        self,
        settings: ReliefSettings,
        *,
        proc_root: str,
        emit: Callable[[str, str, str, dict[str, Any]], Any],
        relieved: Callable[[str], None],
        drop: Callable[[str], None] = drop_clean_cache,
        read_meminfo: Callable[[], Mapping[str, int]] | None = None,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.proc_root = proc_root
        self.emit = emit
        self.relieved = relieved
        self.drop = drop
        self.read_meminfo = read_meminfo or (lambda: procfs.read_meminfo(proc_root).fields)
        self.mono = mono
        self.policy = ReliefPolicy(
            enabled=settings.enabled,
            min_reclaimable_bytes=parse_size(settings.min_reclaimable),
            min_interval_s=settings.min_interval_s,
        )
        self.task: asyncio.Task[None] | None = None
        self.reliefs = 0

    def consider(self, rules: Sequence[Rule], states: Mapping[str, RuleState]) -> bool:
        """Start a relief now if the policy allows (see the module doc); True when one was started."""
        if not self.policy.enabled or self.policy.disabled_reason is not None:
            return False
        if self.task is not None and not self.task.done():
            return False
        counting = [
            r.name
            for r in rules
            if states.get(r.name, RuleState()).counter > 0 and uses_mem_free(c.attr for c in r.when)
        ]
        if not counting:
            return False
        now = self.mono()
        if self.policy.last_mono is not None and now - self.policy.last_mono < self.policy.min_interval_s:
            return False  # rate-limited: do not even read meminfo
        try:
            fields = self.read_meminfo()
        except OSError as e:
            log.warning("relief: cannot read meminfo (ignoring this tick): %s", e)
            return False
        reclaimable = reclaimable_page_cache_bytes(fields)
        if not self.policy.should_relieve(counting, reclaimable, now):
            return False
        self.policy.started(now)
        self.task = asyncio.get_running_loop().create_task(
            self._relieve(counting, fields.get("MemFree"), reclaimable), name="sparkd-relief"
        )
        return True

    async def _relieve(self, rules: list[str], mem_free_before: int | None, reclaimable: int | None) -> None:
        t0 = self.mono()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.drop, self.proc_root), self.settings.timeout_s)
        except TimeoutError:
            self._failed(f"dropping page cache did not finish within {self.settings.timeout_s:g} s", rules)
            return
        except OSError as e:
            self._failed(f"dropping page cache failed: {e.strerror or e} ({e.filename or 'drop_caches'})", rules)
            return
        took_s = self.mono() - t0
        try:
            mem_free_after: int | None = self.read_meminfo().get("MemFree")
        except OSError:
            mem_free_after = None
        helped = relief_helped(mem_free_before, mem_free_after)
        if helped:
            for name in rules:
                self.relieved(name)
        freed = (mem_free_after - mem_free_before) if mem_free_after is not None and mem_free_before else None
        self.reliefs += 1
        self.emit(
            "relief",
            f"dropped clean page cache for {', '.join(rules)}: MemFree {fmt_gib(mem_free_before)} → "
            f"{fmt_gib(mem_free_after)} ({fmt_gib(freed)} freed of {fmt_gib(reclaimable)} reclaimable) in "
            f"{took_s:.2f} s; " + ("counters reset" if helped else "MemFree did not rise enough: counters go on"),
            "warning",
            {
                "rules": rules,
                "freed_bytes": freed,
                "reclaimable_bytes": reclaimable,
                "mem_free_before_bytes": mem_free_before,
                "mem_free_after_bytes": mem_free_after,
                "counters_reset": helped,
                "took_s": took_s,
            },
        )

    def _failed(self, why: str, rules: list[str]) -> None:
        self.policy.failed(why)
        self.emit(
            "relief_failed",
            f"relief for {', '.join(rules)}: {why}; relief is off for the rest of this run",
            "warning",
            {"rules": rules, "reason": why},
        )

    def status(self) -> dict[str, Any]:
        return {
            "enabled": self.policy.enabled,
            "disabled_reason": self.policy.disabled_reason,
            "reliefs": self.reliefs,
            "running": self.task is not None and not self.task.done(),
        }
