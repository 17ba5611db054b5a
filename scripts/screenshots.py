"""Regenerate the README's dashboard screenshots (docs/screenshots/) against a real ``sparkd run``.

A monitor-only daemon with the default rules on this machine, 4 Hz; headless Debian Chromium
(never a downloaded browser). Dark 1440×900, light 1440×900 and a 390×844 phone. The stopped card
and the incident page come from ``tests/test_browser_managed.py`` (``test-artifacts/``), which
drives a real rule stop; copy them with ``--from-artifacts``.

Usage: ``.venv/bin/python scripts/screenshots.py [--from-artifacts]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
SHOTS = [
    ("dashboard-1440x900.png", 1440, 900, "dark"),
    ("dashboard-1440x900-light.png", 1440, 900, "light"),
    ("dashboard-390x844.png", 390, 844, "dark"),
]
FROM_ARTIFACTS = {"stopped-1440x900.png": "stopped-1440x900.png", "incident-1440x900.png": "incident-1440x900.png"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-artifacts", action="store_true", help="also copy the stopped card and incident page")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        port = 18000 + os.getpid() % 1000
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SPARKD_")},
            "SPARKD_STATE_DIR": tmp,
            "SPARKD_API__PORT": str(port),
            "SPARKD_KERNLOG_SOURCE": "off",
            "SPARKD_INTERVAL_S": "0.25",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparkd", "run"],
            env=env,
            cwd=REPO,
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
                    time.sleep(0.1)
            time.sleep(60)  # a minute of samples on the chart
            with sync_playwright() as p:
                b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
                for name, w, h, scheme in SHOTS:
                    ctx = b.new_context(viewport={"width": w, "height": h}, color_scheme=scheme)
                    page = ctx.new_page()
                    page.goto(f"{base}/")
                    page.wait_for_load_state("networkidle")
                    page.wait_for_timeout(1500)
                    page.screenshot(path=str(OUT / name))
                    ctx.close()
                    print(OUT / name)
                b.close()
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    if args.from_artifacts:
        for src, dst in FROM_ARTIFACTS.items():
            shutil.copy(REPO / "test-artifacts" / src, OUT / dst)
            print(OUT / dst)


if __name__ == "__main__":
    main()
