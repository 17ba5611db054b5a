"""The chart's stop lines and its usable series in headless Chromium, against a real ``sparkd run``
with the default rules over a /proc the test owns: a host with a CMA region (CmaFree 2 GiB), so usable
memory (MemAvailable − CmaFree, the default rules' field) is a line of its own, 2 GiB under MemAvailable."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sparkdproc import free_port
from test_browser import ARTIFACTS, browser, until  # noqa: F401 - fixtures

from tests.conftest import REPO

pytestmark = pytest.mark.browser
GiB = 2**30
MEMINFO = (
    "MemTotal: 16777216 kB\nMemFree: 4194304 kB\nMemAvailable: 12582912 kB\nCached: 2097152 kB\n"
    "CmaTotal: 4194304 kB\nCmaFree: 2097152 kB\n"
)


@contextlib.contextmanager
def _sparkd(
    tmp: Path, config: str = "", interval_s: float = 0.25, meminfo: str = MEMINFO
) -> Iterator[tuple[str, Path]]:
    """A real ``sparkd run`` (monitor-only, 4 Hz unless ``interval_s``) over a /proc in ``tmp`` that starts as
    ``meminfo``, with ``config`` (TOML; empty: the default rules). Yields (base URL, the /proc directory)."""
    proc = tmp / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(meminfo)
    port = free_port()
    env = {
        **os.environ,
        "SPARKD_STATE_DIR": str(tmp / "state"),
        "SPARKD_API__PORT": str(port),
        "SPARKD_KERNLOG_SOURCE": "off",
        "SPARKD_INTERVAL_S": str(interval_s),
        "SPARKD_FAST_INTERVAL_S": "0.25",
        "SPARKD_PROC_ROOT": str(proc),
    }
    env.pop("SPARKD_CONFIG", None)
    cfg = tmp / "sparkd.toml"
    cfg.write_text(config)
    log = open(tmp / "sparkd.out", "w")  # noqa: SIM115 — closed after the process
    p = subprocess.Popen(
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
            if p.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise AssertionError(f"sparkd did not come up: {(tmp / 'sparkd.out').read_text()[-2000:]}")
            time.sleep(0.1)
        yield base, proc
    finally:
        p.terminate()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
        log.close()


@pytest.fixture(scope="module")
def cma_sparkd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _sparkd(tmp_path_factory.mktemp("cma")) as (base, _):
        yield base


def test_the_default_rules_stop_lines_and_the_usable_line_are_drawn(browser: Any, cma_sparkd: str) -> None:  # noqa: F811
    ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{cma_sparkd}/")
    until(page, "window.sparkdChart && window.sparkdChart.points() > 2", 15)
    labels = [s["label"] for s in page.evaluate("window.sparkdChart.plot().series.map((s) => ({label: s.label}))")]
    assert "usable (MemAvailable − CmaFree)" in labels, labels
    idx = labels.index("usable (MemAvailable − CmaFree)")
    avail_idx = labels.index("MemAvailable")
    usable, avail = page.evaluate(
        f"(() => {{ const d = window.sparkdChart.plot().data; const i = d[0].length - 1; "
        f"return [d[{idx}][i], d[{avail_idx}][i]]; }})()"
    )
    assert (usable, avail) == (10.0, 12.0)  # GiB: MemAvailable 12 − CmaFree 2
    page.wait_for_timeout(2500)  # live updates carry the usable column too
    assert page.evaluate(f"window.sparkdChart.plot().data[{idx}].slice(-3)") == [10.0, 10.0, 10.0]
    drawn = page.evaluate("window.sparkdChart.lines()")
    assert sorted(drawn) == sorted(
        [
            "low_available: usable < 6.0 GiB",
            # it stops only with MemFree low and evidence as well: no "stops at 10 GiB"
            "low_free_with_evidence: usable < 10.0 GiB, stops only with MemFree < 2 GiB and evidence",
            "low_free_with_evidence: MemFree < 2.0 GiB, stops only with usable < 10 GiB and evidence",
            "collapse_projected: usable (projected) < 4.0 GiB",
            "repeated_dips: usable < 3.0 GiB",
        ]
    ), drawn
    styles = {p["text"].split(",")[0]: p["style"] for p in page.evaluate("window.sparkdChart.labels()")}
    assert styles == {
        "low_available: usable < 6.0 GiB": "stop",
        "low_free_with_evidence: usable < 10.0 GiB": "gated",
        "low_free_with_evidence: MemFree < 2.0 GiB": "gated",
        "collapse_projected: usable (projected) < 4.0 GiB": "stop",
        "repeated_dips: usable < 3.0 GiB": "stop",
    }, styles
    # the pixels: the gated 10 GiB line is dotted magenta, the 6 GiB stop line dashed red (scanned along the line)
    runs = page.evaluate(
        """(() => { const u = window.sparkdChart.plot(); const c = u.ctx;
        const at = (gib) => { const y = Math.round(u.valToPos(gib, "y", true)); let best = null;
          for (const dy of [0, 1, -1]) {
            const row = c.getImageData(Math.round(u.bbox.left), y + dy, Math.round(u.bbox.width), 1).data;
            const on = []; // a coloured pixel, not the background's or the grid's grey
            for (let i = 0; i < row.length; i += 4) {
              const px = [row[i], row[i + 1], row[i + 2]]; on.push(Math.max(...px) - Math.min(...px) > 60); }
            const lens = []; let n = 0; for (const v of on) { if (v) n++; else if (n) { lens.push(n); n = 0; } }
            const i = on.indexOf(true) * 4; const colour = i < 0 ? null : [row[i], row[i + 1], row[i + 2]];
            if (!best || lens.length > best.lens.length) best = { lens, colour }; }
          return best; };
        return { gated: at(10), stop: at(6) }; })()"""
    )
    gated, stop = runs["gated"], runs["stop"]
    # a dotted line: many short runs (2 css px on, 4 off); a dashed one: longer runs (6 on, 4 off)
    median = lambda lens: sorted(lens)[len(lens) // 2]  # noqa: E731
    assert gated["lens"] and stop["lens"], runs
    assert median(gated["lens"]) < median(stop["lens"]), runs

    # magenta (--gated: #d873b8 dark, #9b3fa8 light) is bluer against its red than the stop lines' red (240,97,109)
    def blue_over_red(c: list[int]) -> int:
        return c[2] - c[0]

    assert blue_over_red(gated["colour"]) > blue_over_red(stop["colour"]) + 40, runs
    assert "dotted and magenta" in page.inner_text(".legend-note")
    # the labels end within the plot: none runs past its right edge (the evidence listed in them did)
    right = page.evaluate("(() => { const b = window.sparkdChart.plot().bbox; return b.left + b.width; })()")
    assert all(p["x1"] <= right for p in page.evaluate("window.sparkdChart.labels()")), right
    # every time on the page is UTC, the sample's age line too (it said "local time" beside a UTC axis)
    until(page, "/taken \\d\\d:\\d\\d:\\d\\d UTC\\)/.test(document.getElementById('sample-age').textContent)", 5)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chart-cma-default-rules.png"))
    assert not errors, errors
    ctx.close()


def test_a_trip_that_asked_for_no_stop_is_a_thin_dashed_mark_and_one_that_did_a_thick_one(
    browser: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An operator read 15-30 thick red marks on the chart for one stop: a rule that holds after the guard stopped
    the model trips once per ``cooldown_s`` with nothing to stop (helper-39). A trip that asked for no stop (a warn
    rule's, one with the model down: severity warning) is drawn thin and dashed; one that asked for a stop thick.
    Here a real monitor-only daemon (whose stop rules' trips are "would stop", critical) trips a warn rule and a
    stop rule; the chart's marks come from the daemon's events, and the style is the one the chart draws with."""
    config = """
cooldown_s = 600
[[rules]]
name = "early_warning"
when = ["MemAvailable < 11GiB"]
action = "warn"
samples = 1
[[rules]]
name = "low_available"
when = ["MemAvailable < 6GiB"]
samples = 1
"""
    with _sparkd(tmp_path, config) as (base, proc):
        ctx = browser.new_context(viewport={"width": 1280, "height": 800})
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{base}/")
        trips = "window.sparkdChart.markers().filter((m) => m.kind === 'trip')"
        # the warn rule first, the stop rule 6 s later: two marks apart on the chart (a screenshot to look at)
        (proc / "meminfo").write_text(MEMINFO.replace("MemAvailable: 12582912 kB", "MemAvailable: 8388608 kB"))
        until(page, f"window.sparkdChart && {trips}.length >= 1", 20)
        time.sleep(6)
        (proc / "meminfo").write_text(MEMINFO.replace("MemAvailable: 12582912 kB", "MemAvailable: 4194304 kB"))
        until(page, f"{trips}.length >= 2", 20)
        styles = page.evaluate(f"{trips}.map((m) => [m.message.split(':')[0], m.severity, window.sparkdMarkStyle(m)])")
        by_rule = {rule: (sev, style) for rule, sev, style in styles}
        assert by_rule["low_available"] == ("critical", {"width": 3, "dash": []}), styles
        assert by_rule["early_warning"] == ("warning", {"width": 1.5, "dash": [3, 3]}), styles
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(".chart-card").screenshot(path=str(ARTIFACTS / "chart-trip-marks.png"))
        assert not errors, errors
        ctx.close()


def test_samples_taken_far_apart_are_one_line_and_a_hole_still_breaks_it(browser: Any, tmp_path: Path) -> None:  # noqa: F811
    """At ``interval_s = 40`` the chart broke the line between every two samples (a 10 s gap limit): the 5-minute
    view was empty until a fall (helper-44). The limit is 3 intervals now; a hole of 4 intervals still breaks it.
    The history is written into the database before the daemon starts (40 s apart, with one 160 s hole)."""
    from sparkd.core.sample import Sample
    from sparkd.store.store import Store

    store = Store.open(tmp_path / "state" / "sparkd.db", migrate=True)
    now = time.time()
    times = [now - 280 + 40 * i for i in range(8) if i not in (4, 5, 6)]  # -280 … -160, then now: a 160 s hole
    rows = [Sample(ts=t, mono=0.0, mem_available=12 * GiB, mem_free=4 * GiB).to_row() for t in times]
    store.write_batch([("sample", r) for r in rows])
    store.close()
    with _sparkd(tmp_path, interval_s=40.0) as (base, _):
        ctx = browser.new_context(viewport={"width": 1280, "height": 800})
        page = ctx.new_page()
        page.goto(f"{base}/")
        until(page, f"window.sparkdChart && window.sparkdChart.points() >= {len(times)}", 15)
        avail = page.evaluate(
            "(() => { const p = window.sparkdChart.plot(); const i = p.series.findIndex((s) => s.label === "
            "'MemAvailable'); return p.data[i]; })()"
        )
        assert avail.count(None) == 1, avail  # the hole alone
        gap_at = avail.index(None)
        assert avail[:gap_at] == [12.0] * 4 and all(v is not None for v in avail[gap_at + 1 :]), avail
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(".chart-card").screenshot(path=str(ARTIFACTS / "chart-interval-40s.png"))
        ctx.close()


def test_a_warn_rules_line_is_labelled_warn_and_drawn_amber_not_as_a_stop_line(
    browser: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The legend said "Dashed lines: stop thresholds" and a warn rule's line was drawn in the stop lines' red,
    unlabelled (note 21): it reads as a line the model is stopped at. It is amber and labelled "(warn)" now; a line
    a stop rule shares keeps the red."""
    config = (
        '[[rules]]\nname = "early"\nwhen = ["MemAvailable < 9GiB"]\naction = "warn"\n'
        '[[rules]]\nname = "floor"\nwhen = ["MemAvailable < 6GiB"]\n'
        '[[rules]]\nname = "shared_warn"\nwhen = ["MemAvailable < 6GiB"]\naction = "warn"\n'
    )
    with _sparkd(tmp_path, config) as (base, _):
        ctx = browser.new_context(viewport={"width": 1280, "height": 800})
        page = ctx.new_page()
        page.goto(f"{base}/")
        until(page, "window.sparkdChart && window.sparkdChart.points() > 2 && window.sparkdChart.lines().length", 15)
        drawn = page.evaluate("window.sparkdChart.lines()")
        assert sorted(drawn) == [
            "early (warn): MemAvailable < 9.0 GiB",
            "floor, shared_warn (warn): MemAvailable < 6.0 GiB",
        ], drawn
        legend = page.inner_text(".legend-note")
        assert 'red for a stop rule\'s, amber and labelled "(warn)" for a line only warn rules hold' in legend
        # the pixels: the 9 GiB line amber, the 6 GiB line red (at the plot's left edge, on the dash)
        colors = page.evaluate(
            """(() => { const u = window.sparkdChart.plot(); const c = u.ctx; const x = Math.round(u.bbox.left) + 2;
            const px = (gib) => { const y = Math.round(u.valToPos(gib, "y", true));
              for (const dy of [0, 1, -1]) { const d = c.getImageData(x, y + dy, 1, 1).data;
                if (d[3] > 0 && d[0] > 150) return [d[0], d[1], d[2]]; } return null; };
            return [px(9), px(6)]; })()"""
        )
        amber, red = colors
        assert amber is not None and amber[2] < 90 and amber[1] > amber[2] + 60, colors  # rgb(184,128,16): no blue
        assert red is not None and red[2] > 100, colors  # rgb(240,97,109), blended with the background
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "chart-warn-rule-line.png"))
        ctx.close()


def test_labels_of_lines_close_together_are_drawn_side_by_side_not_on_top_of_each_other(
    browser: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Lines 1 GiB apart on a 128 GiB axis printed their labels on top of each other, unreadable (helper-56): a
    label within a text line's height of another starts after it."""
    config = "".join(
        f'[[rules]]\nname = "r{i}"\nwhen = ["MemAvailable < {g}GiB"]\n' for i, g in enumerate(("4", "4.5", "5"))
    )
    with _sparkd(tmp_path, config) as (base, _):
        ctx = browser.new_context(viewport={"width": 1280, "height": 800})
        page = ctx.new_page()
        page.goto(f"{base}/")
        until(
            page, "window.sparkdChart && window.sparkdChart.points() > 2 && window.sparkdChart.labels().length == 3", 15
        )
        labels = page.evaluate("window.sparkdChart.labels()")
        close = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :] if abs(a["y"] - b["y"]) < 13]
        assert close, labels  # the lines are close enough that their labels would collide
        for a, b in close:
            assert a["x1"] <= b["x"] or b["x1"] <= a["x"], (a, b)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "chart-close-labels.png"))
        ctx.close()


def test_on_a_spark_the_stop_lines_labels_are_whole_and_the_gated_ones_come_after_them(
    browser: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """On a Spark's axis (MemTotal 121.69 GiB, usable 30 GiB) the default rules' lines at 2, 3, 4, 6 GiB are a few px
    apart, so their labels chain side by side and the last ones run past the plot's edge. The gated lines' labels
    (low_free_with_evidence: "stops only with ...", the longest) come last: each line a rule stops at alone keeps its
    whole label inside the plot."""
    meminfo = (
        "MemTotal: 127601664 kB\nMemFree: 20971520 kB\nMemAvailable: 31457280 kB\nCached: 10485760 kB\n"
        "Buffers: 1048576 kB\nAnonPages: 4194304 kB\nSlab: 2097152 kB\nPageTables: 262144 kB\nKernelStack: 65536 kB\n"
    )
    with _sparkd(tmp_path, meminfo=meminfo) as (base, _):
        ctx = browser.new_context(viewport={"width": 1280, "height": 800})
        page = ctx.new_page()
        page.goto(f"{base}/")
        until(page, "window.sparkdChart && window.sparkdChart.labels().length == 5", 15)
        labels = page.evaluate("window.sparkdChart.labels()")
        right = page.evaluate("(() => { const b = window.sparkdChart.plot().bbox; return b.left + b.width; })()")
        stops = [p for p in labels if p["style"] == "stop"]
        assert [p["text"] for p in stops] == [
            "low_available: usable < 6.0 GiB",
            "collapse_projected: usable (projected) < 4.0 GiB",
            "repeated_dips: usable < 3.0 GiB",
        ], labels
        assert all(p["x1"] <= right for p in stops), (right, stops)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "chart-spark-scale-default-rules.png"))
        ctx.close()
