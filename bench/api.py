"""API benchmark against a real ``sparkd run`` subprocess sampling at 4 Hz.

1. ``/api/status`` latency (p50/p99) with 50 concurrent clients — goal p99 ≤ 20 ms.
2. Time to serve a 24 h chart (``/api/samples`` over 86,400 stored samples) — goal ≤ 150 ms.
3. The guard's own tick time while under that load (``/metrics`` quantiles).

Usage: ``.venv/bin/python bench/api.py [--clients 50] [--requests 40]``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from sparkd.store.schema import SAMPLE_COLUMNS
from sparkd.store.store import Store

GiB = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def seed_samples(db: Path, n: int, now: float) -> float:
    """Insert ``n`` synthetic 1 Hz samples ending ``now``; returns seconds taken."""
    t0 = time.perf_counter()
    store = Store.open(db)
    rows = []
    for i in range(n):
        ts = now - n + i
        wave = (i % 3600) / 3600
        row = dict.fromkeys(SAMPLE_COLUMNS)
        row.update(
            ts=ts,
            mem_total=int(121.69 * GiB),
            mem_available=int((20 + 8 * wave) * GiB),
            mem_free=int((4 + 2 * wave) * GiB),
            cached=int(10 * GiB),
            anon_pages=int(6 * GiB),
            slab=int(1.5 * GiB),
            driver_bytes=int(80 * GiB),
            psi_some_avg10=0.1,
        )
        rows.append(("sample", row))
    for k in range(0, n, 10000):
        store.write_batch(rows[k : k + 10000])
    store.close()
    return time.perf_counter() - t0


def sample_gaps(db: Path, since: float, until: float) -> list[float]:
    """Seconds between consecutive stored samples in [since, until] (read-only)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        ts = [r[0] for r in con.execute("SELECT ts FROM samples WHERE ts BETWEEN ? AND ? ORDER BY ts", (since, until))]
    finally:
        con.close()
    return [b - a for a, b in itertools.pairwise(ts)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def status_load(port: int, clients: int, per_client: int) -> list[float]:
    """``clients`` keep-alive connections, each sending ``per_client`` sequential GETs.

    A minimal HTTP/1.1 client on asyncio streams: httpx's own overhead (~1 ms per
    request in Python) would otherwise dominate what is measured on a small machine.
    """
    lat: list[float] = []
    req = f"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: application/json\r\n\r\n".encode()

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(per_client):
                t0 = time.perf_counter()
                writer.write(req)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                lat.append(time.perf_counter() - t0)
                if status != 200:
                    raise RuntimeError(f"/api/status answered {status}")
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(clients)))
    return lat


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--requests", type=int, default=200, help="per client")
    ap.add_argument("--samples", type=int, default=86400)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="sparkd-bench-"))
    state = tmp / "state"
    now = time.time()
    took = seed_samples(state / "sparkd.db", args.samples, now)
    print(f"seeded {args.samples} samples in {took:.1f} s")

    port = free_port()
    env = {
        **os.environ,
        "SPARKD_STATE_DIR": str(state),
        "SPARKD_API__PORT": str(port),
        "SPARKD_KERNLOG_SOURCE": "off",
        "SPARKD_INTERVAL_S": "0.25",
        "SPARKD_FAST_INTERVAL_S": "0.25",
    }
    out = open(tmp / "sparkd.out", "w")  # noqa: SIM115 — closed below
    proc = subprocess.Popen(
        [sys.executable, "-c", "from sparkd.face.cli import main; main()", "run"], env=env, stdout=out, stderr=out
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print((tmp / "sparkd.out").read_text()[-2000:])
                return 1
            time.sleep(0.1)
        time.sleep(1.0)

        load_start = time.time()
        lat = asyncio.run(status_load(port, args.clients, args.requests))
        load_end = time.time()
        ms = [x * 1000 for x in lat]
        print(
            f"/api/status, {args.clients} concurrent clients, {len(ms)} requests: "
            f"p50 {pct(ms, 0.5):.1f} ms, p99 {pct(ms, 0.99):.1f} ms, max {max(ms):.1f} ms (goal p99 ≤ 20 ms)"
        )

        with httpx.Client(base_url=base, timeout=30) as c:
            metrics = c.get("/metrics").text
            ticks = {
                line.split('"')[1]: float(line.rsplit(" ", 1)[1]) * 1000
                for line in metrics.splitlines()
                if line.startswith("sparkd_tick_seconds{")
            }
            print("guard tick during/after the load (ms): " + ", ".join(f"q{k} {v:.2f}" for k, v in ticks.items()))
            cases = [("5 min", 300, True), ("1 h", 3600, True), ("24 h", 86400, True), ("7 d", 7 * 86400, True)]
            cases.append(("24 h, all 7 chart fields", 86400, False))
            for label, window, chart_fields in cases:
                times, points = [], 0
                for _ in range(7):
                    t = time.time()
                    t0 = time.perf_counter()
                    params = {"since": t - window, "until": t}
                    if chart_fields:
                        params["fields"] = "mem_available,mem_free,cached,anon_pages,slab"
                    r = c.get("/api/samples", params=params)
                    times.append((time.perf_counter() - t0) * 1000)
                    r.raise_for_status()
                    points = r.json()["points"]
                goal = " (goal ≤ 150 ms)" if window == 86400 else ""
                what = f"{label} (dashboard fields)" if chart_fields else label
                print(
                    f"/api/samples {what}: {points} points, median {statistics.median(times):.1f} ms, "
                    f"max {max(times):.1f} ms{goal}"
                )
            time.sleep(1.0)  # let the writer flush
            gaps = sample_gaps(state / "sparkd.db", load_start, load_end)
            if gaps:
                print(
                    f"guard sampling during the status load: {len(gaps) + 1} samples in {load_end - load_start:.1f} s, "
                    f"interval median {statistics.median(gaps) * 1000:.0f} ms, max {max(gaps) * 1000:.0f} ms "
                    "(configured 250 ms)"
                )
            h = c.get("/healthz").json()
            print(f"healthz after the run: ok={h['ok']}, samples_taken={h['samples_taken']}")
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
