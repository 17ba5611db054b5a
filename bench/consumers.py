"""Cost of the top-consumer scan (issue 16): CPU per scan with ~1,000 processes.

Starts sleeping processes until the host has about ``--processes`` of them (default
1,000), scans ``--scans`` times with ``sparkd.sense.consumers.ConsumerScanner`` and prints
the CPU time per scan (process time, so other load on the machine matters little),
the first (cold: every cgroup read) and the steady (cached) figures, and what one scan
every 10 s costs as a share of a core. Then (``--daemon-s`` > 0) the whole daemon: a real
``sparkd run`` (monitor-only, API off, sampling at 1 Hz) with the scan every 10 s and with
``consumers.enabled = false``, its CPU (user + system, from psutil) over the same window.
Cleans up what it started.

    .venv/bin/python bench/consumers.py [--processes 1000] [--scans 30] [--daemon-s 45]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from sparkd.sense.consumers import ConsumerScanner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=1000)
    ap.add_argument("--scans", type=int, default=30)
    ap.add_argument("--interval-s", type=float, default=10.0, help="scan interval the share of a core is given for")
    ap.add_argument("--daemon-s", type=float, default=45.0, help="seconds each daemon run is measured (0: skip)")
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
        if a.daemon_s > 0:
            on = daemon_cpu_s(True, a.daemon_s)
            off = daemon_cpu_s(False, a.daemon_s)
            print(f"daemon at 1 Hz over {a.daemon_s:g} s ({len(psutil.pids())} processes on the host):")
            print(f"  scans every 10 s: {on:.2f} s CPU = {on / a.daemon_s * 100:.2f} % of a core")
            print(f"  scans off:        {off:.2f} s CPU = {off / a.daemon_s * 100:.2f} % of a core")
    finally:
        for p in started:
            p.kill()
        for p in started:
            p.wait()


def daemon_cpu_s(scans: bool, seconds: float) -> float:
    """CPU seconds (user + system) of a real ``sparkd run`` over ``seconds``, after 5 s of start-up."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "sparkd.toml"
        cfg.write_text(
            f'state_dir = "{tmp}"\ninterval_s = 1.0\nkernlog_source = "off"\n'
            f"[api]\nenabled = false\n[consumers]\nenabled = {'true' if scans else 'false'}\ninterval_s = 10\n"
            "quiet_interval_s = 10\n"  # the fast cadence all the time: the scan's worst case
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_") and k != "NOTIFY_SOCKET"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparkd.face.cli", "--config", str(cfg), "run"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(5)
            p = psutil.Process(proc.pid)
            t0 = p.cpu_times()
            time.sleep(seconds)
            t1 = p.cpu_times()
            return (t1.user - t0.user) + (t1.system - t0.system)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
