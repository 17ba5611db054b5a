"""Benchmark: CPU time of one guard tick vs a bash memwatch-style loop.

One guard tick = poll the kernel log, read /proc/meminfo + /proc/pressure/memory
+ /dev/shm, evaluate the rules, enqueue the sample for the writer (as the
daemon does). The bash loop does what the seed watchdog does per sample:
read MemAvailable and MemFree with awk/grep and compare them to the floors.

Goals (issue 2): median <= 100 µs per tick; >= 25x cheaper than the bash loop.
Run: .venv/bin/python bench/tick.py [--ticks 5000] [--bash-samples 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import time

from sparkd.config import load_settings
from sparkd.loop.guard import Guard
from sparkd.sense.kernlog import open_source
from sparkd.store.store import Writer

BASH_LOOP = r"""
n=$1
i=0
while [ $i -lt $n ]; do
  avail=$(grep MemAvailable /proc/meminfo | awk '{print $2}')
  free=$(awk '/^MemFree:/ {print $2}' /proc/meminfo)
  if [ "$avail" -lt 6291456 ]; then low1=$((low1+1)); else low1=0; fi
  if [ "$avail" -lt 10485760 ] && [ "$free" -lt 2097152 ]; then low2=$((low2+1)); else low2=0; fi
  i=$((i+1))
done
"""


def bench_ticks(n: int) -> list[float]:
    settings = load_settings(overrides={"state_dir": "/tmp/sparkd-bench"})
    guard = Guard(settings, open_source("auto"))
    writer = Writer(None, maxsize=n + 10)
    out = []
    for _ in range(50):  # warm-up
        guard.tick()
    for _ in range(n):
        t0 = time.process_time_ns()
        r = guard.tick()
        writer.submit("sample", r.sample.to_row())
        out.append((time.process_time_ns() - t0) / 1000)
    guard.kern_source.close()
    return out


def bench_bash(n: int) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["bash", "-c", BASH_LOOP, "bash", str(n)], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu_s / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ticks", type=int, default=5000)
    ap.add_argument("--bash-samples", type=int, default=200)
    args = ap.parse_args()
    asyncio.set_event_loop(asyncio.new_event_loop())  # Writer's queue wants a loop on older Pythons
    t_read = []
    for _ in range(2000):
        t0 = time.process_time_ns()
        with open("/proc/meminfo", "rb") as f:
            f.read()
        t_read.append((time.process_time_ns() - t0) / 1000)
    ticks = bench_ticks(args.ticks)
    bash_us = bench_bash(args.bash_samples)
    med = statistics.median(ticks)
    p99 = sorted(ticks)[int(len(ticks) * 0.99)]
    print(f"host: {os.cpu_count()} CPUs, python {'.'.join(map(str, __import__('sys').version_info[:3]))}")
    print(f"read /proc/meminfo alone     median {statistics.median(t_read):8.1f} µs CPU")
    print(f"guard tick (sparkd)          median {med:8.1f} µs CPU   p99 {p99:8.1f} µs   ({len(ticks)} ticks)")
    print(f"bash memwatch loop (awk)     mean   {bash_us:8.1f} µs CPU per sample ({args.bash_samples} samples)")
    print(f"ratio bash / sparkd          {bash_us / med:8.1f}x")
    print(
        f"goal: median <= 100 µs: {'met' if med <= 100 else 'NOT met'};"
        f" >= 25x cheaper: {'met' if bash_us / med >= 25 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
