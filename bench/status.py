"""Cost of the status contract: build ``Daemon.status_json()`` and serialise it (the ``/api/status``
body), on a real daemon sampling this host's /proc (monitor-only: no container side).

Prints µs per call (median of 5 rounds of N calls). ``status_json`` runs on the event loop
at most ~10×/s (the API's body cache) plus once per stored snapshot (≤ 1 Hz), so a few
hundred µs are a small fraction of the loop's time.

Usage: ``.venv/bin/python bench/status.py [--calls 2000]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time

from sparkd.config import load_settings
from sparkd.loop.daemon import Daemon


def body(status: object) -> bytes:
    dump = getattr(status, "model_dump_json", None)  # typed Status; a plain dict before it
    return dump().encode() if dump else json.dumps(status, separators=(",", ":")).encode()


async def main(calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(overrides={"state_dir": tmp, "kernlog_source": "off", "interval_s": 0.25})
        d = Daemon(settings, serve_api=False)
        await d.startup()
        for _ in range(5):
            r = d._tick_once()
            assert r is not None
            await d._handle(r)
        for i in range(20):
            d.event("bench", f"event {i}", details={"i": i})
        build, ser = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                st = d.status_json()
            t1 = time.perf_counter()
            for _ in range(calls):
                b = body(st)
            t2 = time.perf_counter()
            build.append((t1 - t0) / calls * 1e6)
            ser.append((t2 - t1) / calls * 1e6)
        print(f"status_json(): {statistics.median(build):.1f} µs/call")
        print(f"serialise:     {statistics.median(ser):.1f} µs/call ({len(b)} bytes)")
        await d.shutdown("bench")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    asyncio.run(main(ap.parse_args().calls))
