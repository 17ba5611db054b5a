"""Launch preflight: refuse launches that cannot work, before anything is started.

Checks (issue "Memory budget, launch preflight"):
* MemAvailable ≥ GMU × MemTotal + margin — vLLM itself refuses otherwise on GB10
  ("Free memory on device ... is less than desired GPU memory utilization",
  fixtures/vllm/startup-fail-free-memory.log); the margin is the start-up overshoot
  learned from past launches of the same configuration when there is one
  (``core.learned``; CONTEXT.md: start-up peaks exceed the budget), else the configured one;
* how much of the model directory sits in the page cache (reported; the launch evicts it);
* no other sparkd-labelled container running;
* the checkpoint in ``container.model_dir`` is complete: every shard its index names
  exists and is whole (``sparkd.sense.checkpoint.check_checkpoint``; vLLM fails on a
  missing shard only after loading the others — issue 19);
* leftover /dev/shm entries of earlier runs: reported, removed when provably dead;
* swap state: reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sparkd.act import shm
from sparkd.core.sample import usable_bytes
from sparkd.errors import InvalidInput
from sparkd.sense import procfs
from sparkd.sense.checkpoint import check_checkpoint
from sparkd.sense.pagecache import cached_bytes
from sparkd.units import GiB, fmt_gib


@dataclass
class Preflight:
    ok: bool = True
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cached_model_bytes: int | None = None

    def fail(self, msg: str) -> None:
        self.ok = False
        self.failures.append(msg)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "failures": self.failures,
            "notes": self.notes,
            "cached_model_bytes": self.cached_model_bytes,
        }

    def describe(self) -> str:
        return "; ".join(self.failures + self.notes) or "ok"


def run_preflight(
    *,
    gmu: float | None,
    margin_bytes: int,
    running_managed: list[str],
    proc_root: str = "/proc",
    shm_dir: str = "/dev/shm",
    clean_shm: bool = True,
    ignore_unreadable_pids: list[int] | None = None,
    model_dir: str | None = None,
    learned_overshoot_bytes: int | None = None,
) -> Preflight:
    """Run the checks. ``gmu`` None (no budget): the memory check is skipped.
    ``running_managed``: names of sparkd-labelled containers running now.
    ``model_dir``: the checkpoint directory to check for completeness and page-cache residency (None: not checked).
    ``learned_overshoot_bytes``: the learned start-up overshoot; replaces ``margin_bytes`` when given."""
    pf = Preflight()
    if model_dir:
        try:
            cached, model_bytes = cached_bytes(model_dir)
        except OSError as e:
            pf.notes.append(f"page cache of {model_dir} not measured: {e}")
        else:
            pf.cached_model_bytes = cached
            pf.notes.append(f"model directory in the page cache: {fmt_gib(cached)} of {fmt_gib(model_bytes)}")
    if model_dir:
        try:
            check = check_checkpoint(model_dir)
        except InvalidInput as e:
            pf.fail(f"checkpoint not readable: {e.message}")
        else:
            if check.ok:
                pf.notes.append(check.describe())
            else:
                pf.fail(check.describe() + ": vLLM would fail on it after loading the rest")
    m = procfs.read_meminfo(proc_root).fields
    # usable memory, the stop lines' measure: free CMA counts in MemAvailable, yet the driver cannot allocate from
    # it (a launch needing 97.65 GiB passed at MemAvailable 100 GiB with 40 GiB of it free CMA: helper-47)
    total, avail, cma = m.get("MemTotal"), usable_bytes(m.get("MemAvailable"), m.get("CmaFree")), m.get("CmaFree")
    said = f"usable memory (MemAvailable − CmaFree {fmt_gib(cma)})" if cma else "MemAvailable"
    if gmu is not None and total and avail is not None:
        learned = learned_overshoot_bytes is not None
        extra = learned_overshoot_bytes if learned_overshoot_bytes is not None else margin_bytes
        what = "learned start-up overshoot" if learned else "margin"
        need = gmu * total + extra
        if avail < need:
            pf.fail(
                f"{said} {fmt_gib(avail)} < GMU {gmu:.3f} x MemTotal {fmt_gib(total)} + {what} "
                f"{fmt_gib(extra)} = {fmt_gib(need)}: "
                + (
                    "past launches of this configuration dipped that far below plan at start-up"
                    if learned
                    else "vLLM would refuse to start (free memory below gpu_memory_utilization)"
                )
                + "; free memory or lower the KV target / GMU"
            )
        else:
            pf.notes.append(f"{said} {fmt_gib(avail)} >= {fmt_gib(need)} needed")
    if running_managed:
        pf.fail(f"another sparkd-managed container is running: {', '.join(running_managed)}; stop it first")
    try:
        if clean_shm:

            def clean() -> shm.CleanupResult:
                return shm.cleanup(
                    container_started_at=None,
                    shm_dir=shm_dir,
                    proc_root=proc_root,
                    allow_unknown_age=True,
                    ignore_unreadable_pids=ignore_unreadable_pids or (),
                )

            res = clean()
            young = shm.young_leftovers(res)
            if young:  # a crash's leftovers a moment ago, or another job's segment about to be mapped: look again
                time.sleep(shm.LEFTOVER_MIN_AGE_S)
                first, res = res, clean()
                res.removed[:0] = first.removed
                pf.notes.append(
                    f"{len(young)} new unheld /dev/shm entries looked at again after {shm.LEFTOVER_MIN_AGE_S:g} s"
                )
            if res.removed:
                pf.notes.append(
                    f"removed {len(res.removed)} dead /dev/shm leftovers ({fmt_gib(sum(b for _n, b in res.removed))})"
                )
            kept = [k for k in res.kept if shm.classify(k.name) != shm.ShmKind.OTHER]
            if kept:
                pf.notes.append(
                    f"{len(kept)} /dev/shm entries of known runtimes kept: "
                    + "; ".join(f"{k.name}: {k.reason}" for k in kept[:5])
                )
    except OSError as e:
        pf.notes.append(f"/dev/shm not checked: {e}")
    swap = m.get("SwapTotal") or 0
    pf.notes.append(f"swap {'on (' + fmt_gib(swap) + ')' if swap else 'off'}")
    if swap > 0 and swap < GiB:
        pf.notes.append("a small swap delays nothing on a unified-memory host")
    return pf
