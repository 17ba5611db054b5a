"""Start-up peaks learned from past launches: how far below plan MemAvailable dipped.

Source: CONTEXT.md "What the operators learned later": start-up peaks (graph capture,
torch.compile) exceed the steady budget — MAX_NUM_SEQS 8 reached ~103 GiB at a 26 GiB
host reserve and booted clean at 28. Every launch record holds the plan (the budget vLLM
was given), MemAvailable when the launch began and the start-up trough (lowest
MemAvailable before ready). From those:

    plan_floor  = MemAvailable at launch − budget          # where MemAvailable should bottom out
    overshoot   = plan_floor − trough                      # how much further the start-up went
    learned     = max(overshoot) over the launches of the same configuration
    extra       = max(0, stop_line + margin − (plan_floor − learned))
    recommended host reserve = host reserve + extra        # a larger reserve lowers the budget 1:1

Only launches of the same configuration count (image, model, max_num_seqs, max_model_len,
KV cache dtype, graph settings: ``config_key``). Pure: bytes in, bytes out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


def config_key(parts: Mapping[str, Any]) -> str:
    """A short stable key for the launch configuration that shapes the start-up peak.

    ``parts``: e.g. ``{"image": …, "model": …, "max_num_seqs": 4, "max_model_len": 262144,
    "kv_cache_dtype": "fp8", "graph": "…"}``; key order does not matter.
    """
    text = json.dumps({k: parts[k] for k in sorted(parts)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class LaunchPeak:
    """One past launch: ids and the three figures the overshoot needs (bytes)."""

    launch_id: str
    started_at: float
    budget_bytes: int
    mem_available_at_launch_bytes: int
    trough_bytes: int

    @property
    def plan_floor_bytes(self) -> int:
        return self.mem_available_at_launch_bytes - self.budget_bytes

    @property
    def overshoot_bytes(self) -> int:
        """How far the start-up dipped below the plan's floor (negative: it stayed above)."""
        return self.plan_floor_bytes - self.trough_bytes


@dataclass(frozen=True, slots=True)
class LearnedPeak:
    """``overshoot_bytes``: the largest overshoot seen (never below 0); ``evidence``: the launches used."""

    overshoot_bytes: int
    evidence: tuple[LaunchPeak, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {
            "overshoot_bytes": self.overshoot_bytes,
            "launches": [
                {
                    "launch_id": e.launch_id,
                    "started_at": e.started_at,
                    "plan_floor_bytes": e.plan_floor_bytes,
                    "trough_bytes": e.trough_bytes,
                    "overshoot_bytes": e.overshoot_bytes,
                }
                for e in self.evidence
            ],
        }


def learn(peaks: Iterable[LaunchPeak], *, last: int = 10) -> LearnedPeak | None:
    """The learned overshoot over the ``last`` launches given (newest by ``started_at``); None if none."""
    use = sorted(peaks, key=lambda p: p.started_at, reverse=True)[:last]
    if not use:
        return None
    return LearnedPeak(overshoot_bytes=max(0, max(p.overshoot_bytes for p in use)), evidence=tuple(use))


def recommended_reserve_bytes(
    *,
    host_reserve_bytes: int,
    plan_floor_bytes: int,
    learned_overshoot_bytes: int,
    stop_line_bytes: int,
    margin_bytes: int,
) -> int:
    """The host reserve that keeps the start-up trough ≥ ``stop_line + margin`` (formula in the module doc)."""
    expected_trough = plan_floor_bytes - learned_overshoot_bytes
    extra = max(0, stop_line_bytes + margin_bytes - expected_trough)
    return host_reserve_bytes + extra


def peak_from_record(rec: Mapping[str, Any]) -> LaunchPeak | None:
    """A ``LaunchPeak`` from a stored launch record, or None when a figure is missing.

    Reads ``trough_bytes``, ``plan.budget_bytes`` (or ``plan.budget_gib``) and
    ``actual.mem_available_at_launch_bytes``.
    """
    plan, actual = rec.get("plan") or {}, rec.get("actual") or {}
    budget = plan.get("budget_bytes")
    if budget is None and plan.get("budget_gib") is not None:
        budget = int(float(plan["budget_gib"]) * 1024**3)
    avail, trough = actual.get("mem_available_at_launch_bytes"), rec.get("trough_bytes")
    if budget is None or avail is None or trough is None:
        return None
    return LaunchPeak(str(rec.get("id")), float(rec.get("started_at") or 0.0), int(budget), int(avail), int(trough))
