"""What one open dashboard tab costs, against a real ``sparkd run`` (monitor-only, 1 Hz sampling).

1. Daemon CPU with no tab open, over ``--seconds`` (utime + stime from /proc/<pid>/stat).
2. One tab in headless Chromium over the same time: requests and bytes on the wire (bodies as
   sent, gzip included, plus headers) after the page has loaded, and the daemon's CPU meanwhile.

Figures are per minute. Goals (issue 14): ≤ 60 KB and ≤ 40 requests a minute per idle tab, and
the tab adds ≤ 0.2 % of a core. ``--seconds 300`` is the issue's 5 minutes; shorter runs are
extrapolated to a minute (the page does the same thing every 2 s).

Usage: ``.venv/bin/python bench/ui.py [--seconds 60]``
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

CHROMIUM = "/usr/bin/chromium"
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (fields 14, 15 of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def measure_idle(pid: int, seconds: float) -> float:
    c0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (cpu_s(pid) - c0) / (time.monotonic() - t0)


def measure_tab(base: str, pid: int, seconds: float) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"], headless=True)
        page = b.new_page(viewport={"width": 1440, "height": 900})
        finished: list[Any] = []
        page.on("requestfinished", lambda r: finished.append(r))
        t_load = time.monotonic()
        page.goto(f"{base}/")
        page.wait_for_load_state("networkidle")
        load_s = time.monotonic() - t_load
        load_bytes = sum(r.sizes()["responseBodySize"] + r.sizes()["responseHeadersSize"] for r in finished)
        load_requests = len(finished)
        finished.clear()
        c0, t0 = cpu_s(pid), time.monotonic()
        page.wait_for_timeout(seconds * 1000)
        elapsed = time.monotonic() - t0
        cpu = 100.0 * (cpu_s(pid) - c0) / elapsed
        sizes = [r.sizes() for r in finished]
        body = sum(s["responseBodySize"] for s in sizes)
        headers = sum(s["responseHeadersSize"] + s["requestHeadersSize"] for s in sizes)
        b.close()
    per_min = 60.0 / elapsed
    return {
        "load_s": load_s,
        "load_requests": load_requests,
        "load_kib": load_bytes / 1024,
        "requests_per_min": len(sizes) * per_min,
        "body_kib_per_min": body / 1024 * per_min,
        "wire_kib_per_min": (body + headers) / 1024 * per_min,
        "cpu_pct": cpu,
        "seconds": elapsed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="each phase (the issue asks for 300)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SPARKD_")},
            "SPARKD_STATE_DIR": tmp,
            "SPARKD_API__PORT": str(port),
            "SPARKD_KERNLOG_SOURCE": "off",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparkd.face.cli", "run"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            time.sleep(5)  # past start-up
            idle = measure_idle(proc.pid, args.seconds)
            tab = measure_tab(base, proc.pid, args.seconds)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    print(f"phase length: {args.seconds:g} s each (figures per minute; extrapolated when < 60 s)")
    print(f"page load: {tab['load_requests']} requests, {tab['load_kib']:.0f} KiB on the wire, {tab['load_s']:.2f} s")
    print(
        f"one idle tab: {tab['requests_per_min']:.1f} requests/min (goal <= 40), "
        f"{tab['body_kib_per_min']:.1f} KiB/min bodies, {tab['wire_kib_per_min']:.1f} KiB/min with headers "
        "(goal <= 60 KB)"
    )
    print(
        f"daemon CPU: {idle:.2f} % of a core with no tab, {tab['cpu_pct']:.2f} % with one tab "
        f"(adds {tab['cpu_pct'] - idle:+.2f} %; goal <= +0.2 %)"
    )


if __name__ == "__main__":
    main()
