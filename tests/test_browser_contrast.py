"""Text contrast on every page, measured in Chromium (issue 14: ≥ 4.5:1 everywhere, WCAG 2 AA for
normal text), in the dark theme and the light one (``prefers-color-scheme``), logged in and out.

``tests/contrast.js`` walks every visible text run and every placeholder, finds the background it is
drawn on (opaque backgrounds up the tree, blended), and reports the pairs below the minimum."""

from __future__ import annotations

from typing import Any

import pytest
from test_browser import _login, browser, sparkd  # noqa: F401 - fixtures

from tests.conftest import REPO

pytestmark = pytest.mark.browser
MIN_RATIO = 4.5
CONTRAST_JS = (REPO / "tests" / "contrast.js").read_text()
PAGES = ("/", "/events", "/launches", "/cluster")


def low_contrast(page: Any) -> list[dict[str, Any]]:
    """The text on ``page`` below 4.5:1 (``[{text, selector, ratio, fg, bg}]``)."""
    return list(page.evaluate(CONTRAST_JS, MIN_RATIO))


def test_the_measure_finds_low_contrast_text(browser: Any) -> None:  # noqa: F811
    # the measure itself: grey on grey fails, black on white passes, a faded button fails
    ctx = browser.new_context()
    page = ctx.new_page()
    page.set_content(
        '<style>::placeholder { color: #bbb }</style><body style="background:#fff">'
        '<p id="ok" style="color:#000">readable</p>'
        '<p id="grey" style="color:#aaa">too faint</p><button id="faded" style="opacity:.45;color:#222;'
        'background:#eee">Stop</button><input placeholder="hint" style="color:#000"></body>'
    )
    found = {f["selector"]: f["ratio"] for f in low_contrast(page)}
    ctx.close()
    assert "#ok" not in found
    assert 2.0 < found["#grey"] < 2.5  # #aaa on white is 2.32:1
    assert "#faded" in found and found["#faded"] < MIN_RATIO
    assert 1.5 < found["input"] < 2.0  # a #bbb placeholder on white is 1.92:1


@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_every_page_has_at_least_4_5_to_1(browser: Any, sparkd: dict[str, Any], scheme: str) -> None:  # noqa: F811
    ctx = browser.new_context(viewport={"width": 1440, "height": 900}, color_scheme=scheme)
    page = ctx.new_page()
    failures: dict[str, list[dict[str, Any]]] = {}
    page.goto(f"{sparkd['base']}/login")
    failures["/login"] = low_contrast(page)
    for path in PAGES:  # logged out: the read-only view
        page.goto(f"{sparkd['base']}{path}")
        page.wait_for_load_state("networkidle")
        failures[f"{path} (logged out)"] = low_contrast(page)
    _login(page, sparkd)
    for path in PAGES:  # logged in: controls and the resize form (placeholders, unit hints, disabled buttons)
        page.goto(f"{sparkd['base']}{path}")
        page.wait_for_load_state("networkidle")
        failures[path] = low_contrast(page)
    ctx.close()
    bad = {k: v for k, v in failures.items() if v}
    assert not bad, bad
