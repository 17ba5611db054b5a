"""Benchmark: the idle daemon's cost, side by side with earlyoom, in one window.

Starts two real ``sparkd run`` daemons (monitor-only, API on, own state directories and
ports): one sampling at 1 Hz, one at 4 Hz (``interval_s = fast_interval_s``), and
``earlyoom`` (the distribution's, if installed; absent: said so, sparkd's figures alone).
Each sparkd gets a ``NOTIFY_SOCKET`` datagram socket of this script: time to ``READY=1``
is measured from ``Popen``: first for ``--ready-reps`` lone starts (one daemon at a time, after
sparkd's bytecode is compiled, as an installed daemon's later starts find it), then for the two
daemons started at once (on a 2-CPU host they contend). After ``--warmup`` seconds, CPU is read over ``--window``
seconds for all three processes in the same window.

CPU per process: utime+stime from ``/proc/PID/stat`` (clock ticks; includes threads that
ended) and, finer, the sum of ``/proc/PID/task/*/schedstat`` run time (ns, live threads).
DB growth: bytes in use in every table and index (``dbstat``: page size minus unused bytes,
read through SQLite, so pages still in the WAL count) at window start and end, scaled to
an hour. Samples lag: the largest ``now - max(samples.ts)`` seen while polling
(how late the newest sample reaches the database).

Three references in the same window: ``python sleep(1)``, a Python process that does nothing but
wake once a second (the floor of any Python daemon on this host); ``asyncio 1 Hz``, an asyncio loop
with a 1 s timer and no work (the event loop's own wake-up); and ``minimal guard`` (``MINIMAL_GUARD``),
the least any Python guard must do each second: read /proc/meminfo, PSI and /dev/kmsg, parse and keep
the figures, and write them to SQLite in a thread every 5 s. sparkd's figure minus the minimal guard's is
what its rules, events, status snapshots, API and the rest cost. On a virtual machine whose idle vCPU
loses its caches, work done once a second runs cold: a sparkd tick measured ~70 µs warm costs several
times that here, and the figures move by up to 2x from run to run; compare rows of one window, not
figures of two runs. The table prints wake-ups per second (timeslices, ``schedstat``) beside the CPU.

On a GPU host each sparkd reads NVML through a helper process (``sparkd.sense.gpu_helper``): its CPU and RSS
are on rows of their own ("helper"), and summed with its daemon's below the table.

Goals (issue 18): 1 Hz ≤ 500 µs CPU per second (0.05 % of a core), 4 Hz ≤ 0.3 %;
≤ 10 MB/day of history at 1 Hz; RSS ≤ 80 MiB after an hour idle; READY=1 ≤ 1.5 s.
The window starts after the first retention pass (60 s after start, then hourly; ~14 ms of CPU):
a 60 s window holding it would charge an hourly cost to one minute.
Run: .venv/bin/python bench/idle.py [--window 60] [--warmup 70] [--ready-reps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_stat_s(pid: int) -> float:
    """utime+stime of ``pid`` (all threads, including ended ones), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_sched_s(pid: int) -> float:
    """Sum of run time of the live threads of ``pid`` (``/proc/PID/task/*/schedstat``), seconds."""
    return sched(pid)[0]


def sched(pid: int) -> tuple[float, int]:
    """(run time in s, timeslices) summed over the live threads of ``pid`` (``schedstat``: ns run,
    ns waiting, timeslices run). Timeslices per second is how often the process is woken."""
    total = slices = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            f = (t / "schedstat").read_text().split()
            total, slices = total + int(f[0]), slices + int(f[2])
    return total / 1e9, slices


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def children(pid: int) -> list[int]:
    """``pid``'s child processes (``/proc/PID/task/*/children``): sparkd's NVML helper on a GPU host."""
    out: list[int] = []
    for t in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (t / "children").read_text().split()]
    return out


def db_bytes(db: Path) -> int:
    """Bytes in use in all tables and indexes: the page bytes minus each page's unused bytes
    (SQLite's ``dbstat``), so growth is seen to the byte, not to the 4 KiB page."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return int(con.execute("SELECT sum(pgsize - unused) FROM dbstat").fetchone()[0])
    finally:
        con.close()


def table_bytes(db: Path) -> dict[str, int]:
    """Bytes in use per table or index (``dbstat``), and ``samples/row``: the samples table's bytes per row."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        out = {n: int(b) for n, b in con.execute("SELECT name, sum(pgsize - unused) FROM dbstat GROUP BY name")}
        rows = con.execute("SELECT count(*) FROM samples").fetchone()[0]
        out["samples/row"] = out.get("samples", 0) // max(rows, 1)
        return out
    finally:
        con.close()


def newest_sample_ts(db: Path) -> float | None:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return con.execute("SELECT max(ts) FROM samples").fetchone()[0]
    finally:
        con.close()


def max_gap_s(db: Path, since: float) -> float:
    """Largest gap between consecutive samples after ``since``: a stalled daemon (or host), not the writer."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        ts = [r[0] for r in con.execute("SELECT ts FROM samples WHERE ts >= ? ORDER BY ts", (since,))]
    finally:
        con.close()
    return max((b - a for a, b in itertools.pairwise(ts)), default=0.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """One ``sparkd run`` (monitor-only, API on) in its own state directory under ``root``. ``cmd``: what
    runs instead of ``python -m sparkd.face.cli`` (``bench/phases.py`` runs sparkd through a wrapper);
    the ``--config`` and ``run`` arguments follow it. ``env``: variables added to the daemon's environment
    and ``cwd`` its working directory (``bench/ab.py`` runs another tree's sparkd with ``PYTHONPATH``; a
    ``python -m`` puts the working directory first on ``sys.path``, so it must not be a checkout)."""

    def __init__(
        self,
        root: Path,
        interval_s: float,
        cmd: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.dir = root / f"sparkd-{interval_s:g}s"
        self.dir.mkdir()
        self.interval_s = interval_s
        self.db = self.dir / "sparkd.db"
        self.notify_path = str(self.dir / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.notify_path)
        cfg = self.dir / "sparkd.toml"
        cfg.write_text(
            f'state_dir = "{self.dir}"\nlog_dir = "{self.dir / "logs"}"\n'
            f"interval_s = {interval_s}\nfast_interval_s = {interval_s}\n"
            f'[api]\nhost = "127.0.0.1"\nport = {free_port()}\n'
        )
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_")}
        full_env.update(env or {})
        full_env["NOTIFY_SOCKET"] = self.notify_path
        full_env.pop("WATCHDOG_USEC", None)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [*(cmd or [sys.executable, "-m", "sparkd.face.cli"]), "--config", str(cfg), "run"],
            env=full_env,
            cwd=cwd,
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "stderr.log", "wb"),  # noqa: SIM115 - lives as long as the daemon
        )
        self.ready_s: float | None = None

    def wait_ready(self, timeout_s: float = 30.0) -> float:
        self.sock.settimeout(0.1)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"sparkd exited early: {(self.dir / 'stderr.log').read_text()[-2000:]}")
            try:
                msg = self.sock.recv(4096)
            except TimeoutError:
                continue
            if b"READY=1" in msg.split(b"\n"):
                self.ready_s = time.monotonic() - self.t0
                # keep reading, as systemd does: a full datagram queue blocks the daemon's sendto
                threading.Thread(target=self._drain, daemon=True).start()
                return self.ready_s
        raise SystemExit(f"no READY=1 within {timeout_s} s")

    def _drain(self) -> None:
        self.sock.settimeout(None)
        with contextlib.suppress(OSError):
            while self.sock.recv(4096):
                pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()


# The least any Python guard must do each second, as its own process: read /proc/meminfo, PSI and the
# kernel log (non-blocking), parse the figures, keep them, and write them to SQLite (WAL) in a thread
# every 5 s. sparkd does all of this and its rules, events, status and API besides: this is the floor
# a Python implementation of the goal stands on, on this host, in the same window.
MINIMAL_GUARD = r"""
import asyncio, os, queue, sqlite3, sys, threading, time
KEEP = {b"MemTotal:", b"MemFree:", b"MemAvailable:", b"Buffers:", b"Cached:", b"Shmem:", b"Slab:",
        b"AnonPages:", b"PageTables:", b"CmaFree:", b"SwapFree:"}
mfd = os.open("/proc/meminfo", os.O_RDONLY)
pfd = os.open("/proc/pressure/memory", os.O_RDONLY) if os.path.exists("/proc/pressure/memory") else None
kfd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK) if os.access("/dev/kmsg", os.R_OK) else None
if kfd is not None:
    os.lseek(kfd, 0, os.SEEK_END)
rows = queue.SimpleQueue()
def writer():
    con = sqlite3.connect(sys.argv[1])
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("CREATE TABLE s (ts REAL, avail INTEGER, free INTEGER, cached INTEGER, psi TEXT)")
    while True:
        time.sleep(5)
        batch = []
        while not rows.empty():
            batch.append(rows.get())
        with con:
            con.executemany("INSERT INTO s VALUES (?, ?, ?, ?, ?)", batch)
threading.Thread(target=writer, daemon=True).start()
history = []
def tick(loop):
    mi = {}
    for line in os.pread(mfd, 8192, 0).split(b"\n"):
        f = line.split()
        if f and f[0] in KEEP:
            mi[f[0]] = int(f[1]) * 1024
    psi = os.pread(pfd, 512, 0) if pfd is not None else b""
    if kfd is not None:
        try:
            while os.read(kfd, 8192):
                pass
        except BlockingIOError:
            pass
    history.append(mi[b"MemAvailable:"])
    del history[:-1800]
    rows.put((time.time(), mi[b"MemAvailable:"], mi[b"MemFree:"], mi[b"Cached:"], psi.decode()))
    loop.call_later(1.0, tick, loop)
async def main():
    loop = asyncio.get_running_loop()
    loop.call_later(1.0, tick, loop)
    await asyncio.Event().wait()
asyncio.run(main())
"""

# An asyncio event loop that only wakes once a second (a timer, no work): what the loop's wake-up costs.
EMPTY_ASYNCIO = r"""
import asyncio
def tick(loop):
    loop.call_later(1.0, tick, loop)
async def main():
    loop = asyncio.get_running_loop()
    loop.call_later(1.0, tick, loop)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def find_earlyoom() -> str | None:
    path = shutil.which("earlyoom")
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "earlyoom"], check=False, capture_output=True)
        path = shutil.which("earlyoom")
    return path


def compile_sparkd() -> str:
    """Write sparkd's bytecode (``__pycache__``) before the starts are timed, as the first start of an
    installed daemon leaves it for the next ones (``pip install`` compiles a wheel's at install). Under
    ``PYTHONDONTWRITEBYTECODE`` (set in some shells and CI) every start would otherwise compile all of
    sparkd's modules again: about 0.35 s of READY=1 on this VM. Returns what was done, for the report."""
    import compileall

    import sparkd

    pkg = Path(sparkd.__file__).parent
    ok = compileall.compile_dir(pkg, quiet=1)
    return f"sparkd's bytecode compiled in {pkg}" if ok else f"could not compile all of {pkg}"


def ready_alone(root: Path, reps: int) -> list[float]:
    """Time to READY=1 of ``reps`` lone starts (one daemon at a time, its own state directory), s."""
    out = []
    for i in range(reps):
        sub = root / f"ready-{i}"
        sub.mkdir()
        d = Daemon(sub, 1.0)
        try:
            out.append(d.wait_ready())
        finally:
            d.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=60.0, help="measuring window, s")
    ap.add_argument(
        "--warmup",
        type=float,
        default=70.0,
        help="after READY=1, before the window, s (default: past the first retention pass, 60 s after start; "
        "then it runs hourly: a window of the steady state)",
    )
    ap.add_argument("--ready-reps", type=int, default=3, help="lone starts timed to READY=1 before the window")
    args = ap.parse_args()

    eo_path = find_earlyoom()
    compiled = compile_sparkd()
    procs: dict[str, Any] = {}
    eo = None
    with tempfile.TemporaryDirectory(prefix="sparkd-idle-") as tmp:
        root = Path(tmp)
        alone = ready_alone(root, args.ready_reps) if args.ready_reps > 0 else []
        d1, d4 = Daemon(root, 1.0), Daemon(root, 0.25)
        try:
            r1, r4 = d1.wait_ready(), d4.wait_ready()
            if eo_path:
                # -r 0: no periodic memory report (earlyoom's own idle cost, as run by its unit)
                eo = subprocess.Popen([eo_path, "-r", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # the floors of a Python daemon on this host: a process that only wakes once a second, an
            # asyncio loop that only wakes once a second, and the least a Python guard must do each second
            floor = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
            refs = {
                "asyncio 1 Hz": subprocess.Popen([sys.executable, "-c", EMPTY_ASYNCIO]),
                "minimal guard": subprocess.Popen([sys.executable, "-c", MINIMAL_GUARD, str(root / "minimal.db")]),
            }
            time.sleep(args.warmup)
            procs = {"sparkd 1 Hz": d1.proc.pid, "sparkd 4 Hz": d4.proc.pid}
            for name, d in (("1 Hz", d1), ("4 Hz", d4)):  # the NVML helper, where there is a driver
                for i, child in enumerate(children(d.proc.pid)):
                    procs[f" helper{i or ''} {name}"] = child
            if eo is not None:
                procs["earlyoom"] = eo.pid
            procs["python sleep(1)"] = floor.pid
            for k, p in refs.items():
                if p.poll() is not None:
                    raise SystemExit(f"reference process {k!r} exited with {p.returncode}")
                procs[k] = p.pid
            db0 = {d1.proc.pid: db_bytes(d1.db), d4.proc.pid: db_bytes(d4.db)}
            tb0 = {d1.proc.pid: table_bytes(d1.db), d4.proc.pid: table_bytes(d4.db)}
            c0 = {k: (cpu_stat_s(p), cpu_sched_s(p)) for k, p in procs.items()}
            s0 = {k: sched(p)[1] for k, p in procs.items()}
            w0, w0_wall = time.monotonic(), time.time()
            lag = {d1.proc.pid: 0.0, d4.proc.pid: 0.0}
            lag_at = {d1.proc.pid: 0.0, d4.proc.pid: 0.0}
            while time.monotonic() - w0 < args.window:
                time.sleep(0.5)
                for d in (d1, d4):
                    ts = newest_sample_ts(d.db)
                    if ts is not None and time.time() - ts > lag[d.proc.pid]:
                        lag[d.proc.pid], lag_at[d.proc.pid] = time.time() - ts, time.monotonic() - w0
            win = time.monotonic() - w0
            c1 = {k: (cpu_stat_s(p), cpu_sched_s(p)) for k, p in procs.items()}
            s1 = {k: sched(p)[1] for k, p in procs.items()}
            db1 = {d1.proc.pid: db_bytes(d1.db), d4.proc.pid: db_bytes(d4.db)}
            tb1 = {d1.proc.pid: table_bytes(d1.db), d4.proc.pid: table_bytes(d4.db)}
            rss = {k: rss_bytes(p) for k, p in procs.items()}
            time.sleep(3)  # the last gathered batch lands
            gaps = {d.proc.pid: max_gap_s(d.db, w0_wall) for d in (d1, d4)}
        finally:
            d1.stop()
            d4.stop()
            for d in (d1, d4):
                for line in (d.dir / "stderr.log").read_text(errors="replace").splitlines():
                    if "database" in line or "retention" in line or "Traceback" in line:
                        print(f"sparkd {d.interval_s:g} s log: {line[:200]}")
            if eo is not None:
                eo.terminate()
                eo.wait(5)
            started = [locals().get("floor"), *locals().get("refs", {}).values()]
            for ref in [r for r in started if r is not None]:  # what was started, also when a later one failed
                ref.terminate()
                ref.wait(5)

    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; window {win:.1f} s after {args.warmup:g} s")
    per_s = {k: ((c1[k][0] - c0[k][0]) / win, (c1[k][1] - c0[k][1]) / win) for k in procs}
    head = ("process", "CPU µs/s (stat)", "CPU µs/s (sched)", "% core", "wakes/s", "RSS MiB")
    print(f"{head[0]:<16} {head[1]:>16} {head[2]:>17} {head[3]:>8} {head[4]:>8} {head[5]:>8}")
    for k in procs:
        st, sc = per_s[k]
        wakes = (s1[k] - s0[k]) / win
        print(f"{k:<16} {st * 1e6:16.0f} {sc * 1e6:17.0f} {sc * 100:8.3f} {wakes:8.1f} {rss[k] / 2**20:8.1f}")
    for name in ("1 Hz", "4 Hz"):
        helpers = [k for k in procs if k.startswith(" helper") and k.endswith(name)]
        if helpers:
            both = sum(per_s[k][1] for k in [f"sparkd {name}", *helpers])
            mem = sum(rss[k] for k in [f"sparkd {name}", *helpers])
            print(f"sparkd {name} with its NVML helper: {both * 1e6:.0f} µs/s, RSS {mem / 2**20:.1f} MiB")
        else:
            print(
                f"sparkd {name}: no NVML helper (no NVIDIA driver here: the GPU loop asked once, "
                "then looks for the driver every gpu_quiet_interval_s)"
            )
    fl = per_s["python sleep(1)"][1]
    print(
        f"floor: a Python process that only sleeps 1 s at a time costs {fl * 1e6:.0f} µs/s here "
        f"(sparkd 1 Hz = {per_s['sparkd 1 Hz'][1] / max(fl, 1e-9):.1f}x that): on a VM whose idle vCPU "
        "loses its caches each wake-up costs far more than the work it does"
    )
    mg, s1hz = per_s["minimal guard"][1], per_s["sparkd 1 Hz"][1]
    print(
        f"floor of a Python guard: an asyncio loop waking at 1 Hz costs {per_s['asyncio 1 Hz'][1] * 1e6:.0f} µs/s; "
        f"the minimal guard (read meminfo, PSI and the kernel log, parse, write SQLite every 5 s) "
        f"{mg * 1e6:.0f} µs/s; sparkd 1 Hz costs {(s1hz - mg) * 1e6:+.0f} µs/s more than that "
        f"(its rules, events, status, API and the rest); the 500 µs/s goal leaves "
        f"{(500e-6 - mg) * 1e6:.0f} µs/s for them"
    )
    if "earlyoom" in per_s:
        eo_sc = max(per_s["earlyoom"][1], 1e-9)
        print(
            f"ratio sparkd/earlyoom (sched): 1 Hz {per_s['sparkd 1 Hz'][1] / eo_sc:.1f}x, "
            f"4 Hz {per_s['sparkd 4 Hz'][1] / eo_sc:.1f}x"
        )
    else:
        print("earlyoom: absent (not installed, and could not be installed here): sparkd's figures alone")
    for name, d in (("1 Hz", d1), ("4 Hz", d4)):
        grow_h = (db1[d.proc.pid] - db0[d.proc.pid]) / win * 3600
        print(
            f"sparkd {name}: READY=1 after {d.ready_s:.2f} s; DB +{grow_h / 1e6:.2f} MB/h "
            f"({grow_h * 24 / 1e6:.1f} MB/day, all tables and indexes); newest sample reached the DB "
            f"within {lag[d.proc.pid]:.1f} s (at {lag_at[d.proc.pid]:.0f} s; poll 0.5 s)"
            f"; largest gap between samples {gaps[d.proc.pid]:.1f} s)"
        )
    for name, d in (("1 Hz", d1), ("4 Hz", d4)):
        a, b = tb0[d.proc.pid], tb1[d.proc.pid]
        grew = {t: b[t] - a.get(t, 0) for t in b if t != "samples/row" and b[t] != a.get(t, 0)}
        print(
            f"sparkd {name}: samples table {b['samples/row']} B/row; grew in the window (bytes): "
            + ", ".join(f"{t} {n:+d}" for t, n in sorted(grew.items(), key=lambda x: -abs(x[1])))
        )
    if alone:
        print(
            f"READY=1, lone starts ({compiled}): "
            + ", ".join(f"{x:.2f}" for x in alone)
            + f" s; median {statistics.median(alone):.2f} s (the two daemons above started at once, on 2 CPUs)"
        )
    print("goals: 1 Hz <= 500 µs/s; 4 Hz <= 3000 µs/s; <= 10 MB/day at 1 Hz; RSS <= 80 MiB; READY <= 1.5 s")
    _ = (r1, r4)


if __name__ == "__main__":
    main()
