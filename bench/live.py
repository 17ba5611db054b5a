"""CPU per dashboard live update (``GET /ui/live.json``), in process, without the HTTP server.

A real ``Daemon`` samples this machine's /proc (monitor-only, 4 Hz for ~3 s so the chart tail has
buckets); requests go through the whole ASGI app (middleware, auth, gzip) with httpx's ASGI
transport, as one open tab sends them every 2 s: what the page has (``have`` hashes), the newest
event id (``ev``) and the chart's last bucket (``since``, ``step``). ``/healthz`` is the floor of
the app's own overhead. Figures: CPU ms per request (``time.process_time``), averaged.

Goal it serves (issue 14): one idle tab adds ≤ 0.2 % of a core, i.e. ≤ 4 ms per 2 s poll
including the HTTP server (``bench/ui.py`` measures that end to end).

Usage: ``.venv/bin/python bench/live.py [--requests 300]``
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time

import httpx

from sparkd.config import load_settings
from sparkd.face.app import create_app
from sparkd.loop.daemon import Daemon


async def run(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(load_settings(overrides={"state_dir": tmp, "kernlog_source": "off"}), serve_api=False)
        await d.startup()
        for _ in range(12):  # 3 s of samples at 4 Hz
            r = d._tick_once()
            if r is not None:
                await d._handle(r)
            await asyncio.sleep(0.25)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(d)), base_url="http://127.0.0.1"
        ) as c:
            page = (await c.get("/")).text
            have_m, ev_m = re.search(r'data-have="([^"]*)"', page), re.search(r'data-ev="([^"]*)"', page)
            assert have_m and ev_m
            have, ev = have_m.group(1), ev_m.group(1)
            since = int(d.live_samples[0].ts) + 1  # a bucket the in-memory samples reach back to
            shapes = {
                "/healthz (the app's floor)": "/healthz",
                "live.json, parts only": f"/ui/live.json?have={have}",
                "live.json, parts + events": f"/ui/live.json?have={have}&ev={ev}",
                "live.json, as a tab polls (parts + events + chart tail)": (
                    f"/ui/live.json?have={have}&ev={ev}&since={since}&step=1"
                ),
            }
            print(f"{n} requests each, CPU per request (in process, no HTTP server):")
            for name, url in shapes.items():
                await c.get(url)
                t0 = time.process_time()
                for _ in range(n):
                    await c.get(url, headers={"accept-encoding": "gzip"})
                print(f"  {name:58s} {(time.process_time() - t0) / n * 1000:6.2f} ms")
        await d.shutdown("bench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    asyncio.run(run(ap.parse_args().requests))


if __name__ == "__main__":
    main()
