"""The wheel carries web/, migrations/ and systemd/: install it in a fresh venv and render a page."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
from conftest import REPO
from sparkdproc import free_port, wait_for


def test_the_wheel_installs_in_a_fresh_venv_and_serves_the_dashboard(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("sparkd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for part in (
        "sparkd/web/templates/index.html",
        "sparkd/web/static/vendor/htmx-2.0.11.min.js",
        "sparkd/migrations/env.py",
        "sparkd/migrations/versions/0001_initial.py",
        "sparkd/systemd/sparkd.service",
    ):
        assert part in names, part
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300
    )
    # dependencies come from the test environment's site-packages, after the venv's own (no network needed)
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run(
        [
            str(py),
            "-c",
            "import sparkd, sparkd.resources as r; print(sparkd.__file__); "
            "print(r.web_dir()); print(r.migrations_dir())",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.split()
    assert all(w.startswith(str(venv)) for w in where), where
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_")}
    env.update(
        SPARKD_STATE_DIR=str(tmp_path / "state"),
        SPARKD_LOG_DIR=str(tmp_path / "logs"),
        SPARKD_API__PORT=str(port),
        SPARKD_KERNLOG_SOURCE="off",
    )
    p = subprocess.Popen(
        [str(venv / "bin" / "sparkd"), "run"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def page() -> httpx.Response | None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
                return r if r.status_code == 200 else None
            except httpx.HTTPError:
                return None

        r = wait_for(page, 20)
        assert r is not None, p.stdout.read() if p.poll() is not None and p.stdout else "no page"
        assert "sparkd" in r.text and "MemAvailable" in r.text
        css = httpx.get(f"http://127.0.0.1:{port}/static/sparkd.css", timeout=5)
        assert css.status_code == 200 and len(css.text) > 100
        time.sleep(0.5)
    finally:
        p.terminate()
        p.wait(20)
    import sqlite3

    rev = sqlite3.connect(tmp_path / "state" / "sparkd.db").execute("SELECT version_num FROM alembic_version")
    assert rev.fetchone()[0] == "0006"
