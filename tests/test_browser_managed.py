"""Headless Chromium against a real ``sparkd run`` that manages a fakevllm container on the real engine:
restart with confirmation changes the container, the resize form shows a dry-run plan, and a page on
another origin cannot stop the container."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sparkdapi import SparkdUnderTest
from sparkdproc import wait_for
from test_browser import ARTIFACTS, _EvilPage, browser  # noqa: F401 - the browser fixture
from test_e2e_budget import BUDGET

pytest_plugins = ["dockerkit"]
pytestmark = pytest.mark.browser


@pytest.fixture
def managed(tmp_path: Path, image: str, case_labels: dict[str, str], launcher: Any) -> Iterator[SparkdUnderTest]:
    s = SparkdUnderTest(
        tmp_path, image, case_labels, budget=BUDGET, container={"memory": None, "env": {"FAKEVLLM_STARTUP_S": "0.5"}}
    )
    s.start()
    s.wait_state("ready", 60)
    yield s
    s.stop()


def _login(page: Any, s: SparkdUnderTest) -> str:
    base = f"http://127.0.0.1:{s.api_port}"
    page.goto(f"{base}/login")
    page.fill("#token", s.token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/")
    return base


def test_restart_with_confirmation_and_a_dry_run_resize_in_the_browser(
    browser: Any,  # noqa: F811
    managed: SparkdUnderTest,
) -> None:
    s = managed
    before = s.container()
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    dialogs: list[str] = []

    def accept(d: Any) -> None:
        dialogs.append(d.message)
        d.accept()

    page.on("dialog", accept)
    _login(page, s)
    state_cell = page.locator("#part-container table.kv tr:nth-child(2) td")
    assert wait_for(lambda: "ready" in state_cell.inner_text(), 10)
    page.click("form[action='/ui/container/restart'] button")
    assert dialogs and "Restart the model container?" in dialogs[0]
    # the page shows the container going through the restart, then ready with a new container
    assert wait_for(lambda: s.container()["container_id"] != before["container_id"], 60)
    c2 = s.wait_state("ready", 60)
    assert c2["launch_id"] != before["launch_id"]
    page.wait_for_timeout(2500)  # one htmx refresh of the container card
    assert "ready" in state_cell.inner_text()
    assert page.locator("#action-result").inner_text().strip() != ""

    # the resize form shows the dry-run plan and an Apply button; nothing changes
    page.fill("input[name=kv_target_gib]", "2")
    page.click("#resize-form button[type=submit]")
    result = page.locator("#resize-result .resize-result")
    result.wait_for(timeout=10000)
    text = result.inner_text()
    expected = s.api("POST", "/api/resize", json={"kv_target_gib": 2.0, "dry_run": True}).json()["plan"]["gmu"]
    assert "Dry run." in text and "--gpu-memory-utilization" in text
    assert f"{c2['gmu']:.3f}" in text and f"{expected:.3f}" in text and expected > c2["gmu"]
    assert page.locator("#resize-result button").count() >= 1
    assert s.container()["container_id"] == c2["container_id"]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "managed-restart-resize-1280.png"), full_page=True)
    ctx.close()


def test_a_page_on_another_origin_cannot_stop_the_container(
    browser: Any,  # noqa: F811
    managed: SparkdUnderTest,
) -> None:
    s = managed
    before = s.container()
    base = f"http://127.0.0.1:{s.api_port}"
    handler = type("Evil", (_EvilPage,), {"target": base})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ctx = browser.new_context()
    page = ctx.new_page()
    try:
        _login(page, s)
        page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        with page.expect_navigation():
            page.click("#f button")
        assert '"error":"forbidden"' in page.inner_text("body").replace(" ", "")
        page.wait_for_timeout(1000)
        after = s.container()
        assert after["container_id"] == before["container_id"] and after["state"] == "ready"
        assert not s.events("stopping")
    finally:
        ctx.close()
        server.shutdown()
