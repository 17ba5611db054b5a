"""Benchmark: a real ``sparkd run`` under the faults of issue 13 ("Never unguarded"), in figures.

kill    ``kill -9`` ×N (default 20) at a random moment 0.5–2 s after start, each followed by a
        restart on the same state dir: corrupt databases (``PRAGMA integrity_check`` after each kill,
        and files moved aside by sparkd) and samples lost per kill (samples the killed process should
        have taken by the interval, from its first stored sample to the kill, minus those stored).
kmsg    a flood of 50,000 lines into /dev/kmsg (root; a new descriptor every 10 lines, because each
        open file is rate-limited to 10 lines per 5 s under ``printk_devkmsg=ratelimit``): lines
        sparkd read and lines it counted as lost (the ring buffer overwrote them: EPIPE and the
        sequence gap; ``/api/status`` kernel_log.lost, ``sparkd_kernel_log_lost``), max gap between
        stored samples during the flood, peak CPU of the daemon (utime+stime over 0.5 s windows).
conn    1,100 idle TCP connections to the API of a daemon started under ``ulimit -n 1024``: max gap
        between stored samples, log lines the daemon wrote meanwhile, and the stop duration — from
        MemAvailable (a /proc tree the bench owns) falling below the rule's floor to the stop the
        daemon carried out (monitor-only: its ``stop_not_executed`` event).

Run: .venv/bin/python bench/faults.py [--kills 20] [--kmsg-lines 50000] [--conns 1100] [--only kill,kmsg,conn]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from sparkdproc import free_port, wait_for  # noqa: E402

INTERVAL_S = 0.2
HEALTHY = "MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n"
LOW = "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 2097152 kB\n"


def q(db: Path, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def start(
    tmp: Path, extra: str = "", *, api: bool = False, nofile: int | None = None, tail: str = ""
) -> tuple[Any, int]:
    port = free_port()
    cfg = tmp / "sparkd.toml"
    cfg.write_text(
        f'state_dir = "{tmp / "state"}"\nlog_dir = "{tmp / "logs"}"\ninterval_s = {INTERVAL_S}\n'
        f"fast_interval_s = {INTERVAL_S}\n{extra}[api]\nport = {port}\n{tail}"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_") and k != "NOTIFY_SOCKET"}
    p = subprocess.Popen(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(cfg), "run", *([] if api else ["--no-api"])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None,
    )
    return p, port


def status(port: int) -> dict[str, Any]:
    import httpx

    try:
        return dict(httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=5).json())
    except httpx.HTTPError as e:
        raise OSError(str(e)) from None  # "not yet" for wait_for


def max_gap(db: Path, since: float, until: float) -> tuple[int, float]:
    ts = [r[0] for r in q(db, "SELECT ts FROM samples WHERE ts BETWEEN ? AND ? ORDER BY ts", (since, until))]
    return len(ts), max((b - a for a, b in itertools.pairwise([since, *ts, until])), default=until - since)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------ kill -9
def bench_kill(kills: int) -> None:
    with tempfile.TemporaryDirectory(prefix="sparkd-bench-kill-") as d:
        tmp = Path(d)
        db = tmp / "state" / "sparkd.db"
        corrupt, lost = 0, []
        for i in range(kills):
            p, _port = start(tmp, 'kernlog_source = "off"\n')
            assert wait_for(lambda i=i: db.exists() and q(db, "SELECT count(*) FROM daemon_runs")[0][0] > i, 20.0)
            started = q(db, "SELECT max(started_at) FROM daemon_runs")[0][0]
            time.sleep(random.uniform(0.5, 2.0))
            killed_at = time.time()
            p.send_signal(signal.SIGKILL)
            p.wait()
            check = q(db, "PRAGMA integrity_check")[0][0]
            corrupt += check != "ok"
            mine = q(db, "SELECT ts FROM samples WHERE ts BETWEEN ? AND ? ORDER BY ts", (started - 1.0, killed_at))
            if mine:  # this run's samples: from its first stored one to the kill, one per interval expected
                expected = int((killed_at - mine[0][0]) / INTERVAL_S) + 1
                lost.append(max(0, expected - len(mine)))
        aside = list((tmp / "state").glob("sparkd.db.corrupt-*"))
        print(f"kill -9 ×{kills} with restarts:")
        print(f"  corrupt databases after a kill:   {corrupt} (integrity_check), {len(aside)} moved aside by sparkd")
        if lost:
            print(
                f"  samples lost per kill:           mean {sum(lost) / len(lost):.1f}, max {max(lost)} "
                f"(at {INTERVAL_S} s; the writer's batch in flight)"
            )


# ------------------------------------------------------------------------------------------ kmsg flood
def bench_kmsg(lines: int) -> None:
    if not os.access("/dev/kmsg", os.W_OK):
        print("kmsg flood: skipped (/dev/kmsg is not writable: needs root)")
        return
    with tempfile.TemporaryDirectory(prefix="sparkd-bench-kmsg-") as d:
        tmp = Path(d)
        db = tmp / "state" / "sparkd.db"
        p, port = start(tmp, 'kernlog_source = "kmsg"\n', api=True)
        try:
            assert wait_for(lambda: status(port)["samples_taken"] > 3, 20.0, 0.2)
            before = status(port)["kernel_log"]
            t0 = time.time()
            peak, last_cpu, last_t = 0.0, cpu_s(p.pid), time.monotonic()
            sent = 0
            tag = f"sparkd-bench-flood-{os.getpid()}"
            while sent < lines:
                with open("/dev/kmsg", "w") as f:  # 10 lines per open file pass printk_devkmsg=ratelimit
                    for _ in range(min(10, lines - sent)):
                        f.write(f"{tag} line {sent}\n")
                        f.flush()
                        sent += 1
                now = time.monotonic()
                if now - last_t >= 0.5:
                    c = cpu_s(p.pid)
                    peak = max(peak, (c - last_cpu) / (now - last_t))
                    last_cpu, last_t = c, now
            t_sent = time.time()
            time.sleep(5.0)  # let the guard drain what is still in the ring
            c = cpu_s(p.pid)
            peak = max(peak, (c - last_cpu) / (time.monotonic() - last_t))
            after = status(port)["kernel_log"]
            t1 = time.time()
            n, gap = max_gap(db, t0, t1)
        finally:
            p.terminate()
            p.wait(30)
        read = after["lines_read"] - before["lines_read"]
        lost = after["lost"] - before["lost"]
        print(f"kmsg flood of {lines} lines (written in {t_sent - t0:.1f} s):")
        print(f"  lines read by sparkd:            {read} (other writers' lines included)")
        print(f"  lines lost, as counted by sparkd: {lost} (ring buffer overwrote them)")
        print(f"  read + lost:                     {read + lost}")
        print(f"  max gap between samples:         {gap:.3f} s ({n} samples, interval {INTERVAL_S} s)")
        print(f"  peak CPU of the daemon:          {100 * peak:.0f} % of one core (0.5 s windows)")


# ------------------------------------------------------------------------------------------ idle connections
def bench_conn(conns: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, conns + 512)), hard))
    with tempfile.TemporaryDirectory(prefix="sparkd-bench-conn-") as d:
        tmp = Path(d)
        proc = tmp / "proc"
        proc.mkdir()
        (proc / "meminfo").write_text(HEALTHY)
        db = tmp / "state" / "sparkd.db"
        rules = '[[rules]]\nname = "low_available"\nwhen = ["MemAvailable < 6GiB"]\nsamples = 2\n'
        extra = f'kernlog_source = "off"\nproc_root = "{proc}"\n'
        p, port = start(tmp, extra, api=True, nofile=1024, tail=rules)
        socks: list[socket.socket] = []
        try:
            assert wait_for(lambda: status(port)["samples_taken"] > 3, 20.0, 0.2)
            t0 = time.time()
            for _ in range(conns):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            opened = time.time()
            (proc / "meminfo").write_text(LOW)
            low_at = time.time()
            got = wait_for(
                lambda: q(db, "SELECT ts FROM events WHERE kind='stop_not_executed' AND ts >= ?", (low_at,)), 20.0
            )
            (proc / "meminfo").write_text(HEALTHY)
            time.sleep(1.0)
            t1 = time.time()
            n, gap = max_gap(db, t0, t1)
        finally:
            for s in socks:
                s.close()
            p.terminate()
            out, _ = p.communicate(timeout=30)
        during = [ln for ln in out.splitlines() if ln[:19] >= time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0))]
        print(f"{conns} idle connections (daemon under ulimit -n 1024):")
        print(f"  opened in:                       {opened - t0:.1f} s")
        print(f"  max gap between samples:         {gap:.3f} s ({n} samples, interval {INTERVAL_S} s)")
        emfile = sum("Too many open files" in ln for ln in during)
        print(f"  log lines written meanwhile:     {len(during)} ({emfile} EMFILE)")
        if got:
            print(
                f"  stop duration:                   {got[0][0] - low_at:.3f} s (MemAvailable low → stop carried out)"
            )
        else:
            print("  stop duration:                   NO STOP within 20 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--kmsg-lines", type=int, default=50000)
    ap.add_argument("--conns", type=int, default=1100)
    ap.add_argument("--only", default="kill,kmsg,conn")
    a = ap.parse_args()
    only = set(a.only.split(","))
    if "kill" in only:
        bench_kill(a.kills)
    if "kmsg" in only:
        bench_kmsg(a.kmsg_lines)
    if "conn" in only:
        bench_conn(a.conns)


if __name__ == "__main__":
    main()
