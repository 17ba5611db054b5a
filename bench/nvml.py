"""What one NVML reading costs: ``read_gpu`` (nvmlInit, the readings, nvmlShutdown each time), one NVML
session kept open (nvmlInit once), and the daemon's way: that session in a helper process
(``sparkd.sense.gpu_helper``), asked over a pipe, whose CPU is this process's and the helper's together.

The idle bench (``bench/idle.py``) runs where there is no NVIDIA driver: there the GPU loop asks
once, gets "unavailable" and ends, so its cost on a Spark never shows. This bench needs a driver.

Prints, for each way: CPU (process time, µs) and wall time (ms) per reading, median and max over
``--reps``, and the CPU that costs per second of the daemon at ``gpu_interval_s`` (default 5 s).
Then, in a bare Python child (``MEMORY_CHILD``), what an NVML session holds in memory: ``smaps_rollup``
(resident, anonymous, file-backed; KiB) and the thread count at each step (pynvml imported,
``nvmlInit``, one reading, ``nvmlShutdown``, glibc's ``malloc_trim(0)``), and the mappings whose
resident size grew most with ``nvmlInit`` and the reading (issue 18: RSS on a GPU host).

    python bench/nvml.py [--reps 40] [--interval 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import idle  # the bench's own helper, next to this file

from sparkd.sense.gpu import GpuSession, read_gpu


def measure(fn: Callable[[], object], reps: int) -> tuple[list[float], list[float]]:
    """(CPU µs, wall ms) of each of ``reps`` calls, after one warm-up call."""
    fn()
    cpu: list[float] = []
    wall: list[float] = []
    for _ in range(reps):
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        fn()
        cpu.append((time.process_time_ns() - c0) / 1e3)
        wall.append((time.perf_counter_ns() - w0) / 1e6)
        time.sleep(0.05)
    return cpu, wall


MEMORY_CHILD = r"""
import ctypes, os, sys
sys.path.insert(0, sys.argv[1])

def rollup():
    out = {}
    for line in open("/proc/self/smaps_rollup"):
        f = line.split()
        if len(f) == 3 and f[2] == "kB":
            out[f[0].rstrip(":")] = int(f[1])
    return out

def maps():
    out, name = {}, "?"
    for line in open("/proc/self/smaps"):
        f = line.split()
        if "-" in f[0] and len(f) >= 5 and ":" in f[3]:
            name = f[5] if len(f) > 5 else "[anon]"
        elif f[0] == "Rss:":
            out[name] = out.get(name, 0) + int(f[1])
    return out

def step(what):
    r = rollup()
    n = len(os.listdir("/proc/self/task"))
    print(f"{what:<34} {r['Rss']:>8} {r['Anonymous']:>8} {r['Rss'] - r['Anonymous']:>8} {n:>7}")

print(f"{'step (KiB)':<34} {'Rss':>8} {'Anon':>8} {'File':>8} {'threads':>7}")
step("bare Python")
import pynvml
step("pynvml imported")
before = maps()
from sparkd.sense.gpu import GpuSession
step("sparkd.sense.gpu imported")
s = GpuSession()
s.read()
step("GpuSession: nvmlInit + one reading")
for _ in range(20):
    s.read()
step("after 20 more readings")
after = maps()
grown = sorted(((after.get(k, 0) - before.get(k, 0), k) for k in after), reverse=True)[:10]
s.close()
step("session closed (nvmlShutdown)")
ctypes.CDLL("libc.so.6").malloc_trim(0)
step("malloc_trim(0)")
print("mappings that grew most with the session (KiB):")
for kib, name in grown:
    print(f"  {kib:>8}  {name}")
"""


def memory() -> None:
    """Run ``MEMORY_CHILD`` in a bare Python and print what it reports."""
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", MEMORY_CHILD, root], check=False)


def helper_way(reps: int, interval: float) -> None:
    """The daemon's way (``sparkd.sense.gpu_helper.GpuHelper``): NVML in a child process. Prints the CPU per
    reading of this process (the request, the pipe, the JSON) and of the helper, and the RSS of each."""
    from sparkd.sense.gpu_helper import GpuHelper

    before = idle.rss_bytes(os.getpid()) // 1024
    h = GpuHelper()
    t0 = time.perf_counter()
    first = h.read()
    start_ms = (time.perf_counter() - t0) * 1e3
    if h.proc is None or not any(r.available for r in first):
        print(f"helper: no readings: {first[0].reason if first else '?'}")
        return
    pid = h.proc.pid
    mine: list[float] = []
    theirs: list[float] = []
    wall: list[float] = []
    for _ in range(reps):
        c0, h0, w0 = time.process_time_ns(), idle.sched(pid)[0], time.perf_counter_ns()
        h.read()
        wall.append((time.perf_counter_ns() - w0) / 1e6)
        mine.append((time.process_time_ns() - c0) / 1e3)
        theirs.append((idle.sched(pid)[0] - h0) * 1e6)
        time.sleep(0.05)
    both = [a + b for a, b in zip(mine, theirs, strict=True)]
    med = statistics.median(both)
    print(
        f"{'helper process (GpuHelper.read)':<38} {med:>10.0f} {max(both):>10.0f} "
        f"{statistics.median(wall):>11.2f} {med / interval:>16.1f}"
    )
    print(
        f"  of which this process {statistics.median(mine):.0f} µs and the helper {statistics.median(theirs):.0f} µs"
        f" (median); the helper's start and first reading took {start_ms:.0f} ms"
    )
    after = idle.rss_bytes(os.getpid()) // 1024
    print(
        f"  RSS: this process {before} KiB before the helper, {after} KiB after {reps + 1} readings "
        f"(NVML is not loaded here); the helper {idle.rss_bytes(pid) // 1024} KiB"
    )
    h.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--interval", type=float, default=5.0, help="gpu_interval_s (s)")
    a = ap.parse_args()
    first = read_gpu()
    if not any(r.available for r in first):
        print(f"no NVML here: {first[0].reason}")
        return 1
    print(f"{len(first)} device(s): {', '.join(str(r.name) for r in first)}; driver {first[0].driver_version}")
    session = GpuSession()
    ways: dict[str, Callable[[], object]] = {
        "init + read + shutdown (read_gpu)": read_gpu,
        "session kept open (GpuSession.read)": session.read,
    }
    print(f"{'way':<38} {'CPU µs med':>10} {'CPU µs max':>10} {'wall ms med':>11} {'µs/s at interval':>16}")
    for name, fn in ways.items():
        cpu, wall = measure(fn, a.reps)
        med = statistics.median(cpu)
        print(f"{name:<38} {med:>10.0f} {max(cpu):>10.0f} {statistics.median(wall):>11.2f} {med / a.interval:>16.1f}")
    session.close()
    helper_way(a.reps, a.interval)
    memory()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
