"""Cost of the top-consumer scan (issue 16): CPU per scan with ~1,000 processes.

Starts sleeping processes until the host has about ``--processes`` of them (default
1,000), scans ``--scans`` times with ``sparkd.sense.consumers.ConsumerScanner`` and prints
the CPU time per scan (process time, so other load on the machine matters little),
the first (cold: every cgroup read) and the steady (cached) figures, and what one scan
every 10 s costs as a share of a core. Cleans up what it started.

    .venv/bin/python bench/consumers.py [--processes 1000] [--scans 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import psutil

from sparkd.sense.consumers import ConsumerScanner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=1000)
    ap.add_argument("--scans", type=int, default=30)
    ap.add_argument("--interval-s", type=float, default=10.0, help="scan interval the share of a core is given for")
    a = ap.parse_args()
    have = len(psutil.pids())
    started: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(max(0, a.processes - have)):
            started.append(subprocess.Popen(["sleep", "600"]))
        time.sleep(0.5)
        n = len(psutil.pids())
        scanner = ConsumerScanner(top_n=10, uss_top=5)
        t0 = time.process_time()
        first = scanner.scan([])
        cold = time.process_time() - t0
        cpu = []
        for _ in range(a.scans):
            t0 = time.process_time()
            scanner.scan([])
            cpu.append(time.process_time() - t0)
        med = statistics.median(cpu)
        print(f"processes on the host:      {n}")
        print(f"first scan (cold cgroups):  {cold * 1e3:.1f} ms CPU")
        print(f"steady scan: median {med * 1e3:.1f} ms CPU, max {max(cpu) * 1e3:.1f} ms ({a.scans} scans)")
        print(f"one scan every {a.interval_s:g} s:    {med / a.interval_s * 100:.3f} % of a core")
        print(f"example line: {first.text()}")
    finally:
        for p in started:
            p.kill()
        for p in started:
            p.wait()


if __name__ == "__main__":
    main()
