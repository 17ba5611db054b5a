"""Benchmark: CPU time of one ``RuleEngine.step`` with the default rules, by situation.

The predictive rule fits robust (Theil–Sen) slopes over windows of 2 … 64 s (each thinned
to at most 32 points, 496 pairs) only while its gate holds (usable < 16 GiB), and stops at
the first window whose projection trips; these rows show what a step costs outside the gate,
on a flat plateau inside it (every window is fitted, none trips) and during a fall.
Samples at 0.25 s (the fast interval, the worst case: 256 points in the 64 s history).

Goal: a step stays well under the guard's 100 µs tick budget outside the gate, and under
1 ms inside it (the tick budget of bench/tick.py is for the common case, far from a floor).
Run: .venv/bin/python bench/engine.py [--steps 4000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from sparkd.config import DEFAULT_RULES, RuleConfig
from sparkd.core.engine import RuleEngine
from sparkd.core.sample import Sample, derive
from sparkd.units import GiB, MiB

MEM_TOTAL = round(121.69 * GiB)


def trace(kind: str, n: int, interval: float = 0.25) -> list[Sample]:
    rng = random.Random(1)
    out = []
    for i in range(n):
        t = i * interval
        if kind == "above the gate (30 GiB)":
            v = 30.0
        elif kind == "noisy plateau inside the gate (10 GiB)":
            v = 10.0
        else:  # a slow fall inside the gate that never reaches the horizon's reach
            v = 15.0 - 0.001 * t
        g = v + rng.gauss(0, 50) * MiB / GiB
        s = Sample(ts=t, mono=t, mem_total=MEM_TOTAL, mem_available=round(g * GiB), mem_free=round(20 * GiB))
        derive(s)
        out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4000)
    a = ap.parse_args()
    print(f"default rules, 0.25 s samples, {a.steps} steps per row (CPU time per step)")
    for kind in (
        "above the gate (30 GiB)",
        "noisy plateau inside the gate (10 GiB)",
        "slow fall inside the gate (15 GiB, -1 MiB/s)",
    ):
        engine = RuleEngine([RuleConfig(**r) for r in DEFAULT_RULES], cooldown_s=60.0)
        samples = trace(kind, a.steps)
        for s in samples[:300]:  # fill the 64 s history first
            engine.step(s)
        times = []
        for s in samples[300:]:
            t0 = time.process_time_ns()
            engine.step(s)
            times.append((time.process_time_ns() - t0) / 1000)
        times.sort()
        print(f"{kind:<48} median {statistics.median(times):8.1f} µs   p99 {times[int(0.99 * len(times))]:8.1f} µs")


if __name__ == "__main__":
    main()
