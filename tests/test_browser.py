"""Headless Chromium against a real ``sparkd run`` subprocess (monitor-only).

Needs Debian's /usr/bin/chromium and the ``playwright`` package (never
``playwright install``): skipped on a developer machine without them, failed in
CI. Screenshots go to ``test-artifacts/`` (gitignored).
"""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sparkdproc import free_port, wait_for

from tests.conftest import REPO, need

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
ARTIFACTS = REPO / "test-artifacts"


def _mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    raise AssertionError("no MemAvailable in /proc/meminfo")


@pytest.fixture(scope="module")
def sparkd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real daemon sampling at 4 Hz, with a rule whose counter climbs on this machine."""
    tmp = tmp_path_factory.mktemp("sparkd")
    climbing = _mem_available_gib() + 10  # holds on every sample here
    cfg = tmp / "sparkd.toml"
    cfg.write_text(
        "[[rules]]\n"
        'name = "low_available"\nwhen = ["MemAvailable < 6GiB"]\nsamples = 5\n\n'
        "[[rules]]\n"
        f'name = "climbing"\nwhen = ["MemAvailable < {climbing:.1f}GiB"]\nsamples = 1000\naction = "warn"\n\n'
        "[[rules]]\n"  # its condition holds, its evidence never: a near miss every 10th sample, 2.5 s apart
        f'name = "gated"\nwhen = ["MemAvailable < {climbing:.1f}GiB"]\nevidence = ["MemFree < 2MiB"]\n'
        'samples = 4\naction = "warn"\n'
    )
    port = free_port()
    env = {
        **os.environ,
        "SPARKD_STATE_DIR": str(tmp / "state"),
        "SPARKD_API__PORT": str(port),
        "SPARKD_KERNLOG_SOURCE": "off",
        "SPARKD_INTERVAL_S": "0.25",
        "SPARKD_FAST_INTERVAL_S": "0.25",
    }
    log = open(tmp / "sparkd.out", "w")  # noqa: SIM115 — closed after the process
    proc = subprocess.Popen(
        [sys.executable, "-c", "from sparkd.face.cli import main; main()", "--config", str(cfg), "run"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
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
                log.flush()
                raise AssertionError(f"sparkd did not come up: {(tmp / 'sparkd.out').read_text()[-2000:]}")
            time.sleep(0.1)
        token = (tmp / "state" / "token").read_text().strip()
        yield {"base": base, "token": token, "port": port}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    need(os.path.exists(CHROMIUM), f"{CHROMIUM} (Debian's chromium) is not installed")
    need(shutil.which("chromium") is not None or os.path.exists(CHROMIUM), "chromium on PATH")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        need(False, "the playwright Python package is not installed")
        raise
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def until(page: Any, js: str, timeout_s: float) -> None:
    """Poll ``js`` in the page until it is truthy (page.evaluate, which the page's CSP allows;
    wait_for_function may compile its predicate inside the page, which 'script-src self' refuses)."""
    assert wait_for(lambda: bool(page.evaluate(js)), timeout_s, 0.1), f"not true within {timeout_s} s: {js}"


def _login(page: Any, sparkd: dict[str, Any]) -> None:
    page.goto(f"{sparkd['base']}/login")
    page.fill("#token", sparkd["token"])
    page.click("button[type=submit]")
    page.wait_for_url(f"{sparkd['base']}/")
    assert page.locator("meta[name=csrf-token]").count() == 1


def test_it_logs_in_and_shows_live_data(browser: Any, sparkd: dict[str, Any]) -> None:
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    _login(page, sparkd)

    # the chart has data points (uPlot's own data arrays)
    until(page, "window.sparkdChart && window.sparkdChart.points() > 0", 15)
    n_points = page.evaluate("window.sparkdChart.plot().data[0].length")
    n_series = page.evaluate("window.sparkdChart.plot().series.length")
    assert n_points > 0 and n_series == 7

    # the climbing rule's counter rises on the page without a reload
    counter = page.locator('.rule-counter[data-rule="climbing"]')
    first = int(counter.inner_text())
    page.wait_for_timeout(3000)
    second = int(counter.inner_text())
    assert second > first, (first, second)

    # monitor-only: there is nothing to resize, start or stop; each control says so instead of failing later
    # no resize form at all (it showed the configuration's defaults and a dead button): the card says why
    assert page.locator("#resize-form").count() == 0
    assert "Monitor-only: sparkd runs no container here" in page.inner_text("#resize-monitor-only")
    for action in ("start", "restart", "stop"):
        assert page.locator(f"form[action='/ui/container/{action}'] button").is_disabled(), action
    assert "Monitor-only: there is no container" in page.inner_text("#part-buttons")

    ARTIFACTS.mkdir(exist_ok=True)
    page.wait_for_timeout(2500)  # a few more chart updates
    assert page.evaluate("window.sparkdChart.points()") >= n_points
    page.screenshot(path=str(ARTIFACTS / "dashboard-1280x800.png"))
    page.screenshot(path=str(ARTIFACTS / "dashboard-1280-full.png"), full_page=True)
    assert not errors, errors
    ctx.close()


def test_logged_out_in_monitor_only_the_controls_say_monitor_only_not_log_in(
    browser: Any, sparkd: dict[str, Any]
) -> None:
    """With no container to act on, a login changes nothing: the controls said "Log in with the API token" to a
    visitor logged out, as if logging in would make them work. They say monitor-only first, whatever the login."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    page.goto(f"{sparkd['base']}/")
    why = page.inner_text("#controls-why")
    assert why == "Monitor-only: there is no container to start or stop.", why
    assert page.locator("#controls-why a[href='/login']").count() == 0  # no "Log in" link in the controls
    for action in ("start", "restart", "stop"):
        button = page.locator(f"form[action='/ui/container/{action}'] button")
        assert button.is_disabled(), action
        assert button.get_attribute("title") == "monitor-only: there is no container to start or stop", action
    # no resize form to fill in: the card says why
    assert page.locator("#resize-form").count() == 0
    assert "Monitor-only: sparkd runs no container here" in page.inner_text("#resize-monitor-only")
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#controls").screenshot(path=str(ARTIFACTS / "controls-monitor-only-logged-out.png"))
    ctx.close()


def test_a_session_that_expires_in_monitor_only_leaves_the_controls_saying_monitor_only(
    browser: Any, sparkd: dict[str, Any]
) -> None:
    """A session that ran out said "log in again to use the controls" and titled every button "session expired: log
    in again", in monitor-only too, where no login gives a control back. The banner says the session expired; the
    buttons keep saying monitor-only."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    _login(page, sparkd)
    ctx.clear_cookies()  # the session ends; the page polls on
    until(page, "!document.getElementById('conn-banner').hidden", 15)
    assert page.inner_text("#conn-banner") == "Your session expired: log in again."
    for action in ("start", "restart", "stop"):
        button = page.locator(f"form[action='/ui/container/{action}'] button")
        assert button.is_disabled(), action
        assert button.get_attribute("title") == "monitor-only: there is no container to start or stop", action
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "session-expired-monitor-only.png"))
    ctx.close()


def test_a_run_of_near_misses_is_one_row_that_grows(browser: Any, sparkd: dict[str, Any]) -> None:
    """Near misses every 2.5 s fill no rows of the events panel: the top row's count grows in place
    (a storm of them pushed the trip and the stop off the panel: note 19 §7)."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    page.goto(f"{sparkd['base']}/")
    rows = "document.querySelectorAll('#event-list li')"
    top = "document.querySelector('#event-list li')"
    burst = f"{top}.querySelector('.burst')"
    # the first near miss comes 10 gated samples (2.5 s) after the start; wait for a run of three on top
    until(page, f"{top}.textContent.includes('near_miss') && {burst} && +{burst}.textContent.split(' ')[0] >= 3", 30)
    n_rows = page.evaluate(f"{rows}.length")
    count = int(page.evaluate(f"{burst}.textContent.split(' ')[0]"))
    until(page, f"+{burst}.textContent.split(' ')[0] > {count}", 10)
    assert page.evaluate(f"{rows}.length") == n_rows
    assert "near_miss" in page.evaluate(f"{top}.textContent")
    page.locator("#part-events").screenshot(path=str(ARTIFACTS / "events-near-miss-run.png"))
    ctx.close()


def test_it_reads_on_a_phone(browser: Any, sparkd: dict[str, Any]) -> None:
    ctx = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True)
    page = ctx.new_page()
    page.goto(f"{sparkd['base']}/")
    until(page, "window.sparkdChart && window.sparkdChart.points() > 0", 15)
    # single column: nothing wider than the viewport
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    boxes = [page.locator(sel).bounding_box() for sel in ("#part-summary", "#part-rules", "#part-container")]
    assert all(b is not None and b["width"] > 300 for b in boxes), boxes
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-390x844.png"))
    page.screenshot(path=str(ARTIFACTS / "dashboard-390-full.png"), full_page=True)
    ctx.close()


def test_it_reads_with_javascript_off(browser: Any, sparkd: dict[str, Any]) -> None:
    ctx = browser.new_context(viewport={"width": 1280, "height": 800}, java_script_enabled=False)
    page = ctx.new_page()
    page.goto(f"{sparkd['base']}/")
    assert "MemAvailable" in page.inner_text("#part-summary")
    assert "GiB" in page.inner_text("#mem-available")
    assert page.locator('.rule-counter[data-rule="climbing"]').count() == 1
    assert "needs JavaScript" in page.content()
    ctx.close()


class _EvilPage(http.server.BaseHTTPRequestHandler):
    target = ""

    def do_GET(self) -> None:
        body = f"""<!doctype html><html><body>
<form id="f" method="post" action="{self.target}/api/container/stop"><button>win a prize</button></form>
</body></html>""".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return None


def test_it_refuses_a_page_on_another_origin(browser: Any, sparkd: dict[str, Any]) -> None:
    handler = type("Evil", (_EvilPage,), {"target": sparkd["base"]})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    evil = f"http://127.0.0.1:{server.server_address[1]}/"
    ctx = browser.new_context()
    page = ctx.new_page()
    try:
        _login(page, sparkd)  # the victim is logged in: the cookie would ride along (same site, other port)
        page.goto(evil)
        # a script on that page cannot read the answer (no CORS), and the request is refused anyway
        fetched = page.evaluate(
            """async (url) => {
                try {
                    const r = await fetch(url, {method: "POST", credentials: "include",
                                                headers: {"Content-Type": "application/json"}, body: "{}"});
                    return "status " + r.status;
                } catch (e) { return "blocked"; }
            }""",
            f"{sparkd['base']}/api/container/stop",
        )
        assert fetched == "blocked"
        with page.expect_navigation():
            page.click("#f button")
        text = page.inner_text("body")
        assert '"error":"forbidden"' in text.replace(" ", ""), text
        assert "Sec-Fetch-Site" in text or "Origin" in text
        events = httpx.get(f"{sparkd['base']}/api/events", params={"limit": 500}).json()["events"]
        assert not [e for e in events if e["kind"] in ("stopped", "stop_requested")]
    finally:
        ctx.close()
        server.shutdown()


def test_the_api_docs_work_offline(browser: Any, sparkd: dict[str, Any]) -> None:
    """/docs is Swagger UI from the vendored bundle: it renders with no request leaving this host and
    no Content-Security-Policy violation (FastAPI's own page needs a CDN and an inline script)."""
    page = browser.new_page()
    errors: list[str] = []
    foreign: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: foreign.append(r.url) if not r.url.startswith(sparkd["base"]) else None)
    try:
        page.goto(sparkd["base"] + "/docs")
        page.wait_for_selector("#swagger-ui .opblock", timeout=20000)
        text = page.inner_text("#swagger-ui")
        assert "/api/status" in text and "sparkd" in text
        assert foreign == [] and errors == [], (foreign, errors)
    finally:
        page.close()


def test_the_redoc_reference_works_offline(browser: Any, sparkd: dict[str, Any]) -> None:
    """/redoc is ReDoc from the vendored bundle: it renders the operations with no request leaving
    this host (FastAPI's own page loads ReDoc from a CDN)."""
    page = browser.new_page()
    errors: list[str] = []
    foreign: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    # its search index runs in a worker from a blob: URL, made in the page itself (not a request off the host)
    local = (sparkd["base"], f"blob:{sparkd['base']}")
    page.on("request", lambda r: foreign.append(r.url) if not r.url.startswith(local) else None)
    try:
        page.goto(sparkd["base"] + "/redoc")
        page.wait_for_selector("[data-section-id^='tag/']", timeout=20000)
        text = page.inner_text("body")
        assert "/api/status" in text and "sparkd" in text
        assert foreign == [] and errors == [], (foreign, errors)
    finally:
        page.close()
