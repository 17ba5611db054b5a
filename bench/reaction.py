"""Benchmark: reaction time of a stop rule under a real hog, and the daemon's CPU use.

Reaction: a ``sparkd run`` subprocess (dry run, so nothing is acted on) guards a
rule ``MemAvailable < start − 768 MiB`` with N consecutive samples; a watcher
thread here polls /proc/meminfo every 5 ms and records the first moment
MemAvailable is below the threshold; a 2 GiB hog then takes the memory.
reaction = ts of the daemon's ``trip`` event (the stop decision) − that moment.
The hog starts at a random phase of the sampling interval.

Modes:
    normal    interval_s = fast_interval_s = 1.0 (fast mode cannot change anything)
    fast      interval_s = fast_interval_s = 0.25
    adaptive  interval_s = 1.0, fast_interval_s = 0.25, fast_margin = 0B and an
              unreachable fast_fall_rate: only the counting rule switches to fast

Goal (issue "React in time"): reaction ≤ N × interval + 100 ms for normal and fast;
the adaptive row is compared to 1 × 1 s + (N − 1) × 0.25 s + 100 ms.

CPU: ``sparkd run --no-api`` (default rules, kernel log auto) for --cpu-s seconds
at 1 Hz and at 4 Hz; utime + stime from /proc/PID/stat over that window → % of one
core (and, in ns, the live threads' schedstat). Goals: ≤ 0.2 % at 1 Hz, ≤ 1 % at 4 Hz.

Run: .venv/bin/python bench/reaction.py [--reps 5] [--n 3] [--cpu-s 30]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from hog import Hog  # noqa: E402
from sparkdproc import db_query, sparkd_run, wait_for  # noqa: E402

from sparkd.sense import procfs  # noqa: E402
from sparkd.units import GiB  # noqa: E402

HOG_MIB = 2048  # 1 GiB below the line: other processes move MemAvailable by hundreds of MiB
WATCH_STEP_S = 0.005
TICK = os.sysconf("SC_CLK_TCK")


def avail() -> int:
    return procfs.read_meminfo().fields["MemAvailable"]


@dataclass
class Mode:
    name: str
    interval_s: float
    fast_interval_s: float
    extra: str = ""
    results: list[float] = field(default_factory=list)  # reaction s
    detect: list[float] = field(default_factory=list)  # first sample below threshold − crossing

    def goal_s(self, n: int) -> float:
        if self.interval_s == self.fast_interval_s:
            return n * self.interval_s + 0.1
        return self.interval_s + (n - 1) * self.fast_interval_s + 0.1

    def config(self, threshold: int, n: int) -> str:
        return (
            f"interval_s = {self.interval_s}\nfast_interval_s = {self.fast_interval_s}\n"
            f'kernlog_source = "off"\ndry_run = true\ncooldown_s = 0\n{self.extra}'
            f'[[rules]]\nname = "bench_low"\nwhen = ["MemAvailable < {threshold}B"]\nsamples = {n}\n'
        )


class Watcher(threading.Thread):
    """Polls /proc/meminfo; records the first wall time MemAvailable < threshold."""

    def __init__(self, threshold: int) -> None:
        super().__init__(daemon=True)
        self.threshold = threshold
        self.crossed: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            with open("/proc/meminfo", "rb") as f:
                data = f.read()
            t = time.time()
            i = data.index(b"MemAvailable:")
            kb = int(data[i + 13 : data.index(b"kB", i)])
            if kb * 1024 < self.threshold:
                self.crossed = t
                return
            time.sleep(WATCH_STEP_S)


def reaction_once(mode: Mode, n: int) -> tuple[float, float]:
    """One hog against a fresh daemon; returns (reaction, detection) in seconds."""
    with tempfile.TemporaryDirectory(prefix="sparkd-reaction-") as d:
        tmp = Path(d)
        db = tmp / "sparkd.db"
        start = avail()
        threshold = start - 3 * GiB // 4  # the 2 GiB hog ends 1.25 GiB below: MemAvailable here moves by ~1 GiB
        with sparkd_run(tmp, config=mode.config(threshold, n)) as proc:
            if not wait_for(lambda: db_query(db, "SELECT count(*) FROM samples")[0][0] >= 3, 20.0, 0.05):
                out = proc.stdout.read() if proc.poll() is not None and proc.stdout else ""
                raise RuntimeError(f"daemon produced no samples: {out}")
            if avail() < threshold + GiB // 2:
                raise RuntimeError("MemAvailable fell by itself before the hog started (host busy)")
            time.sleep(random.uniform(0.0, mode.interval_s))  # random phase against the sampling grid
            w = Watcher(threshold)
            w.start()
            t_hog = time.time()
            with Hog(HOG_MIB) as hog:
                hog.wait_ready()
                trips = wait_for(
                    lambda: db_query(db, "SELECT ts FROM events WHERE kind = 'trip' AND ts >= ? ORDER BY ts", (t_hog,)),
                    n * mode.interval_s + 10.0,
                    0.02,
                )
                w.stop.set()
                w.join(2)
                first_below = db_query(
                    db,
                    "SELECT min(ts) FROM samples WHERE ts >= ? AND mem_available * 1024 < ?",  # stored in KiB
                    (t_hog, threshold),
                )[0][0]
                hog.free()
            if not trips:
                raise RuntimeError(f"{mode.name}: no trip within {n * mode.interval_s + 10:.0f} s")
            if w.crossed is None:
                raise RuntimeError(f"{mode.name}: the watcher never saw MemAvailable below the threshold")
            return trips[0][0] - w.crossed, first_below - w.crossed


def _stat_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5)), clock ticks


def _sched_ns(pid: int) -> dict[str, int]:
    """Run time in ns of each live thread (/proc/PID/task/TID/schedstat, first field)."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[t.name] = int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def cpu_use(interval_s: float, seconds: float) -> tuple[float, float, int, float]:
    """(% of a core from schedstat, % from stat ticks, samples taken, load average) for ``sparkd run --no-api``.

    schedstat (ns) sums the live threads: a thread that ends within the window loses its time there,
    so the stat figure (every thread, 1/CLK_TCK resolution) is printed beside it.
    """
    with tempfile.TemporaryDirectory(prefix="sparkd-cpu-") as d:
        tmp = Path(d)
        db = tmp / "sparkd.db"
        load = os.getloadavg()[0]
        with sparkd_run(tmp, config=f"interval_s = {interval_s}\nfast_interval_s = {interval_s}\n") as proc:
            assert wait_for(lambda: db_query(db, "SELECT 1 FROM status"), 20.0), "daemon did not start"
            time.sleep(3.0)  # past start-up (imports, migrations, first writes)
            n0 = db_query(db, "SELECT count(*) FROM samples")[0][0]
            c0, s0, t0 = _stat_ticks(proc.pid), _sched_ns(proc.pid), time.monotonic()
            time.sleep(seconds)
            c1, s1, t1 = _stat_ticks(proc.pid), _sched_ns(proc.pid), time.monotonic()
            time.sleep(min(1.0, 2 * interval_s))  # let the writer store the last samples
            n1 = db_query(db, "SELECT count(*) FROM samples")[0][0]
        ns = sum(v - s0.get(k, 0) for k, v in s1.items())
        wall = t1 - t0
        return ns / 1e9 / wall * 100.0, (c1 - c0) / TICK / wall * 100.0, n1 - n0, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="hogs per mode")
    ap.add_argument("--n", type=int, default=3, help="samples the rule needs (N)")
    ap.add_argument("--cpu-s", type=float, default=30.0, help="seconds of each CPU measurement")
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--skip-reaction", action="store_true")
    args = ap.parse_args()
    n = args.n
    modes = [
        Mode("normal 1 s", 1.0, 1.0),
        Mode("fast 0.25 s", 0.25, 0.25),
        Mode("adaptive 1→0.25 s", 1.0, 0.25, 'fast_margin = "0B"\nfast_fall_rate = "1TiB"\n'),
    ]
    mt = procfs.read_meminfo().fields["MemTotal"]
    print(f"host: {os.cpu_count()} CPUs, MemTotal {mt / GiB:.1f} GiB, MemAvailable {avail() / GiB:.1f} GiB")
    print(f"rule: MemAvailable < (MemAvailable at start − 1 GiB) for N = {n} samples; hog {HOG_MIB} MiB; dry run")
    if not args.skip_reaction:
        for m in modes:
            for _ in range(args.reps):
                r, det = reaction_once(m, n)
                m.results.append(r)
                m.detect.append(det)
        print()
        print("reaction = trip event ts − first /proc/meminfo read below the threshold (watcher every 5 ms)")
        hdr = f"{'mode':<20}{'runs':>5}{'median':>9}{'max':>9}{'min':>9}{'goal ≤':>9}  {'met':<5}{'detect med':>11}"
        print(hdr)
        print("-" * len(hdr))
        for m in modes:
            med, mx, mn = statistics.median(m.results), max(m.results), min(m.results)
            goal = m.goal_s(n)
            print(
                f"{m.name:<20}{len(m.results):>5}{med:>8.3f}s{mx:>8.3f}s{mn:>8.3f}s{goal:>8.3f}s  "
                f"{'yes' if mx <= goal else 'NO':<5}{statistics.median(m.detect):>10.3f}s"
            )
        print("detect = first stored sample below the threshold − crossing (the sampling phase)")
        print("goal: N × interval + 100 ms; adaptive: interval + (N − 1) × fast_interval + 100 ms")
    if not args.skip_cpu:
        print()
        print(f"daemon CPU (sparkd run --no-api, default rules, kernel log auto, {args.cpu_s:g} s each)")
        hdr = (
            f"{'rate':<8}{'CPU % of a core':>16}{'(stat ticks)':>13}{'samples':>9}{'CPU/sample':>12}"
            f"{'goal ≤':>8}  {'met':<4}{'load1':>7}"
        )
        print(hdr)
        print("-" * len(hdr))
        for hz, goal in ((1, 0.2), (4, 1.0)):
            pct, pct_ticks, samples, load = cpu_use(1.0 / hz, args.cpu_s)
            per = pct / 100 * args.cpu_s / max(samples, 1) * 1e3
            print(
                f"{hz} Hz{'':<4}{pct:>15.3f}%{pct_ticks:>12.3f}%{samples:>9}{per:>10.2f}ms{goal:>7.1f}%  "
                f"{'yes' if pct <= goal else 'NO':<4}{load:>7.2f}"
            )
        print(f"(schedstat: ns run time of the live threads, judged; stat ticks: utime+stime, 1/{TICK} s)")


if __name__ == "__main__":
    main()
