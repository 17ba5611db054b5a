"""Scan the processes that hold memory (psutil), attributed to the serving container or the host.

``ConsumerScanner.scan(container_ids)`` → ``sparkd.core.consumers.ConsumerSummary``.
Processes come from ``psutil.process_iter`` (its process cache makes repeated scans
cheap); a process's cgroup (``/proc/<pid>/cgroup``, which psutil does not expose) is read
once per process lifetime and cached by ``(pid, create_time)``. USS (memory unique to a
process, from ``smaps_rollup``) is read for the top processes only, where the kernel lets
us: it costs a page-table walk per process. Processes that vanish or deny access during
the scan are skipped (counted in ``notes``); the scan never raises for them.

Cost (``bench/consumers.py``): measured per scan at ~1,000 processes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from sparkd.core.consumers import ConsumerSummary, Group, ProcessMem, group_of, summarize


class ConsumerScanner:
    """Scans processes; ``top_n`` kept; ``uss_top``: how many of the top get a USS reading (0 = none).

    ``proc_root``: where ``<pid>/cgroup`` is read (``/proc``; tests may point elsewhere).
    """

    def __init__(self, *, top_n: int = 10, uss_top: int = 5, proc_root: str | os.PathLike[str] = "/proc") -> None:
        if top_n < 1:
            raise ValueError(f"top_n = {top_n}: must be at least 1")
        self.top_n = top_n
        self.uss_top = max(0, uss_top)
        self.proc_root = Path(proc_root)
        self._known: dict[tuple[int, float], tuple[str, str]] = {}
        self._groups: dict[tuple[int, float], Group] = {}
        self._ids: list[str] = []
        self._own_pid = os.getpid()

    def _identity(self, p: psutil.Process) -> tuple[str, str]:
        """(cgroup text, command name) of a process, read once per process lifetime."""
        key = (p.pid, p.create_time())  # cached by psutil: no read
        known = self._known.get(key)
        if known is None:
            try:
                cg = (self.proc_root / str(p.pid) / "cgroup").read_text()
            except OSError:
                cg = ""
            try:
                name = p.name()
            except psutil.Error:
                name = "?"
            known = self._known[key] = (cg, name)
        return known

    def scan(self, container_ids: Iterable[str] = ()) -> ConsumerSummary:
        """One scan now. ``container_ids``: full ids of the serving/guarded container(s).

        Reads one small file per process (``statm``, through psutil's ``memory_info``);
        cgroup and name once per process lifetime; names of the top processes again
        (a process may have exec'd since).
        """
        cpu0 = time.process_time()
        ids = [c for c in container_ids if c]
        procs: list[ProcessMem] = []
        live: set[tuple[int, float]] = set()
        denied = 0
        if ids != self._ids:  # another container: every group is decided again
            self._ids, self._groups = ids, {}
        for p in psutil.process_iter():
            try:
                rss = p.memory_info().rss
                key = (p.pid, p.create_time())
                group = self._groups.get(key)
                if group is None:
                    cg, _ = self._identity(p)
                    # sparkd itself is the guard, a system service wherever it was started from: run from a shell it
                    # was listed among the "host co-tenants" of a trip's "who grew" (helper-48)
                    group = self._groups[key] = "system" if p.pid == self._own_pid else group_of(cg, ids)
                name = self._known[key][1]
            except psutil.AccessDenied:
                denied += 1
                continue
            except psutil.Error:
                continue  # ignoring: it ended during the scan
            if rss == 0:  # kernel threads hold no user memory
                continue
            live.add(key)
            procs.append(ProcessMem(pid=p.pid, name=name, rss_bytes=rss, group=group))
        for key in [k for k in self._known if k not in live]:
            del self._known[key]
            self._groups.pop(key, None)
        procs = self._refresh_top(procs)
        summary = summarize(
            procs, at=time.time(), top_n=self.top_n, cpu_s=time.process_time() - cpu0, watched=bool(ids)
        )
        if denied:
            summary = dataclasses.replace(summary, notes=(f"{denied} processes unreadable (no access)",))
        return summary

    def _refresh_top(self, procs: list[ProcessMem]) -> list[ProcessMem]:
        """Fresh names for the top ``top_n`` and USS for the top ``uss_top``."""
        top = sorted(procs, key=lambda p: p.rss_bytes, reverse=True)[: self.top_n]
        fresh: dict[int, ProcessMem] = {}
        for rank, p in enumerate(top):
            try:
                proc = psutil.Process(p.pid)
                name = proc.name()
                uss = proc.memory_full_info().uss if rank < self.uss_top else None
            except (psutil.Error, OSError):
                continue  # ignoring: ended, or its smaps are not ours to read
            fresh[p.pid] = ProcessMem(p.pid, name, p.rss_bytes, p.group, uss)
        return [fresh.get(p.pid, p) for p in procs]
