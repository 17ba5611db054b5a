"""The dashboard's events table in headless Chromium, against a real ``sparkd run``: a long event kind is shown
whole. The kind column cut ``config_changed_not_applied`` to ``config_changed_not_…`` (note 21); the kind breaks
after an underscore instead (``<wbr>``), at the desktop width and on a phone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_browser import ARTIFACTS, browser, until  # noqa: F401 - fixtures
from test_browser_chart import _sparkd

pytestmark = pytest.mark.browser
KIND = "config_changed_not_applied"


def test_a_long_event_kind_is_shown_whole_in_the_events_table(browser: Any, tmp_path: Path) -> None:  # noqa: F811
    config = '[[rules]]\nname = "low"\nwhen = ["MemAvailable < 2GiB"]\n'
    with _sparkd(tmp_path, config) as (base, _):
        # a valid edit the running daemon does not apply: its config watch says so within CONFIG_CHECK_S (30 s)
        (tmp_path / "sparkd.toml").write_text("cooldown_s = 600\n" + config)
        for width, height in ((1280, 800), (390, 844)):
            ctx = browser.new_context(viewport={"width": width, "height": height})
            page = ctx.new_page()
            page.goto(f"{base}/")
            until(page, f"[...document.querySelectorAll('#event-list .kind')].some((k) => k.title === '{KIND}')", 45)
            page.reload()  # the row as the page renders it, not only as the live update added it
            until(page, f"document.querySelector('#event-list .kind[title={KIND}]') !== null", 10)
            seen = page.evaluate(
                f"""(() => {{ const k = document.querySelector('#event-list .kind[title={KIND}]');
                const text = k.parentElement.querySelector('.text'); const kb = k.getBoundingClientRect();
                const tb = text.getBoundingClientRect();
                return {{ shown: k.innerText.replace(/\\s/g, ''), overflows: k.scrollWidth > k.clientWidth,
                  ellipsis: getComputedStyle(k).textOverflow,
                  overlap: kb.right > tb.left && tb.right > kb.left
                    && kb.bottom > tb.top && tb.bottom > kb.top }}; }})()"""
            )
            assert seen["shown"] == KIND, (width, seen)  # every letter on the page, none cut
            assert not seen["overflows"] and seen["ellipsis"] != "ellipsis", (width, seen)
            assert not seen["overlap"], (width, seen)  # beside the message or above it, not under it
            ARTIFACTS.mkdir(exist_ok=True)
            page.locator("#part-events").screenshot(path=str(ARTIFACTS / f"events-long-kind-{width}.png"))
            ctx.close()
