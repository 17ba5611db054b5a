"""The REST API, dashboard routes, metrics and security, over ASGI (no server).

A real ``Daemon`` with a real SQLite store in ``tmp_path`` samples this machine's
/proc; only the container side is a fake (``FakeActions``, the slow and
dangerous edge), whose resize runs the real budget formula.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import FakeActions
from prometheus_client.parser import text_string_to_metric_families

from sparkd.act.archive import write_archive
from sparkd.config import load_settings
from sparkd.errors import ConfigError
from sparkd.face.app import create_app
from sparkd.face.auth import SESSION_COOKIE, Auth, ensure_token
from sparkd.loop.daemon import Daemon
from tests.conftest import fixture

BASE = "http://127.0.0.1:8741"


async def _daemon(tmp_path: Path, actions: Any = None, **overrides: Any) -> Daemon:
    settings = load_settings(
        overrides={"state_dir": str(tmp_path / "state"), "kernlog_source": "off", "interval_s": 0.25, **overrides}
    )
    d = Daemon(settings, actions=actions, serve_api=False)
    await d.startup()
    # the first open of the database runs beside the start-up (at most DB_FIRST_WAIT_S of it): on a loaded host it
    # came later, the flush below dropped the samples, and /api/samples had none (two runs beside a CI run)
    await asyncio.wait_for(d._db_opened.wait(), 60)
    for _ in range(4):
        result = d._tick_once()
        assert result is not None
        await d._handle(result)
    assert d.writer is not None
    await asyncio.to_thread(d.writer.flush)
    return d


@pytest.fixture
async def daemon(tmp_path: Path) -> Any:
    d = await _daemon(tmp_path)
    yield d
    await d.shutdown("test")


@pytest.fixture
async def managed(tmp_path: Path) -> Any:
    d = await _daemon(tmp_path, actions=FakeActions())
    yield d
    await d.shutdown("test")


def _client(d: Daemon) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(d)), base_url=BASE)


def _token(d: Daemon) -> str:
    return ensure_token(d.settings.token_file)  # what create_app does; the file may not exist yet


def _bearer(d: Daemon) -> dict[str, str]:
    return {"Authorization": f"Bearer {_token(d)}"}


async def _login(c: httpx.AsyncClient, d: Daemon) -> str:
    r = await c.post("/login", data={"token": _token(d)})
    assert r.status_code == 303
    page = await c.get("/")
    m = re.search(r'<meta name="csrf-token" content="([^"]+)"', page.text)
    assert m, "logged-in page carries the CSRF token"
    return m.group(1)


def _err(r: httpx.Response, status: int, error: str) -> Any:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "detail"}
    assert body["error"] == error
    return body["detail"]


pytestmark = pytest.mark.anyio


# --------------------------------------------------------------------------- read side
async def test_it_reports_health_when_the_guard_ticks(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        r = await c.get("/healthz")
        assert r.status_code == 200 and r.json()["ok"] is True
        assert daemon.guard is not None and daemon.guard.last is not None
        last_mono = daemon.guard.last.mono
        daemon.guard.mono = lambda: last_mono + 60.0  # the guard has not sampled for a minute
        r = await c.get("/healthz")
        assert r.status_code == 503 and r.json()["ok"] is False and r.json()["last_sample_age_s"] >= 60


async def test_it_reports_unhealthy_while_stopping(daemon: Daemon) -> None:
    daemon.should_exit.set()
    async with _client(daemon) as c:
        assert (await c.get("/healthz")).status_code == 503


async def test_it_serves_status_with_the_real_sample(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        body = (await c.get("/api/status")).json()
    assert body["sample"]["mem_total"] > 0 and body["sample"]["mem_available"] > 0
    assert {r["name"] for r in body["rules"]} >= {"low_available"}
    assert body["container"]["mode"] == "monitor-only"
    assert body["plan"] is None


async def test_it_includes_the_current_plan(managed: Daemon) -> None:
    async with _client(managed) as c:
        body = (await c.get("/api/status")).json()
    assert body["plan"]["gmu"] == pytest.approx(0.786)


async def test_it_downsamples_samples_columnar(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        body = (await c.get("/api/samples")).json()
        assert body["step"] == 1.0 and body["points"] >= 1
        assert len(body["ts"]) == len(body["mem_available_avg"]) == body["points"]
        assert sum(body["n"]) >= 5  # the startup sample and four ticks
        assert body["mem_available_min"][0] <= body["mem_available_avg"][0] <= body["mem_available_max"][0]
        now = time.time()
        body = (await c.get("/api/samples", params={"since": now - 86400, "until": now})).json()
        assert body["step"] == 44.0 and body["since"] % 44 == 0  # ≤ 2000 points, on a fixed grid
        body = (await c.get("/api/samples", params={"since": now - 60, "step": 7, "fields": "mem_free"})).json()
        assert body["fields"] == ["mem_free"] and "mem_available_avg" not in body and body["since"] % 7 == 0


async def test_samples_the_writer_has_not_stored_yet_come_from_memory(daemon: Daemon) -> None:
    """The writer gathers samples for WRITE_EVERY_S before it writes them: /api/samples must not end
    that much early (the stored buckets from the database, the rest from memory)."""
    assert daemon.store is not None and daemon.writer is not None
    stored = daemon.store.count_samples()
    for _ in range(3):
        result = daemon._tick_once()
        assert result is not None
        await daemon._handle(result)
    assert daemon.store.count_samples() == stored  # still gathered, not written
    taken = [r.ts for r in daemon.live_samples]
    assert len(taken) == stored + 3
    since = taken[0] - 1
    async with _client(daemon) as c:
        body = (await c.get("/api/samples", params={"since": since, "until": time.time() + 1, "step": 0.001})).json()
    # every sample counted once (ticks this close share buckets), the newest one included
    assert sum(body["n"]) == len(taken), (body["step"], body["n"])
    assert body["ts"][-1] <= taken[-1] < body["ts"][-1] + body["step"]
    await asyncio.to_thread(daemon.writer.flush)
    assert daemon.store.count_samples() == stored + 3 and daemon.writer.safe_until == pytest.approx(taken[-1])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"since": 200, "until": 100}, "since"),
        ({"since": 100, "until": 100}, "since"),
        ({"since": 0, "until": 40 * 86400}, "since"),
        ({"step": 0}, "step"),
        ({"step": -5}, "step"),
        ({"step": "abc"}, "step"),
        ({"since": "yesterday"}, "since"),
        ({"until": "later"}, "until"),
        ({"since": 0, "until": 31 * 86400, "step": 1}, "step"),
        ({"fields": "mem_available,passwords"}, "fields"),
    ],
)
async def test_it_refuses_bad_sample_queries_naming_the_field(
    daemon: Daemon, params: dict[str, Any], field: str
) -> None:
    async with _client(daemon) as c:
        detail = _err(await c.get("/api/samples", params=params), 422, "invalid_input")
    assert detail["field"] == field
    assert field in detail["message"]


async def test_it_filters_events(daemon: Daemon) -> None:
    assert daemon.store is not None
    now = time.time()
    daemon.store.add_event(kind="trip", message="low_available tripped", severity="critical", ts=now)
    daemon.store.add_event(kind="nvrm_no_memory", message="NVRM: NV_ERR_NO_MEMORY", ts=now)
    daemon.store.add_event(kind="trip", message="old trip", ts=now - 7200)
    async with _client(daemon) as c:
        kinds = {e["kind"] for e in (await c.get("/api/events")).json()["events"]}
        assert {"daemon_started", "trip", "nvrm_no_memory"} <= kinds
        body = (await c.get("/api/events", params={"kind": "trip,nvrm_no_memory", "since": now - 60})).json()
        assert sorted(e["message"] for e in body["events"]) == ["NVRM: NV_ERR_NO_MEMORY", "low_available tripped"]
        body = (await c.get("/api/events?kind=trip&kind=nvrm_no_memory&limit=1")).json()
        assert len(body["events"]) == 1
        detail = _err(await c.get("/api/events", params={"limit": 0}), 422, "invalid_input")
        assert detail["field"] == "limit" and "greater than or equal to 1" in detail["message"]


async def test_an_event_not_yet_written_is_answered_from_memory_once(daemon: Daemon) -> None:
    """After the keeper reopened the database, the events recorded while it was down wait in the
    writer's queue: /api/events answered them from memory a moment before and must not lose them until
    the write (CI: ``database_unavailable`` seen, then gone). Written, each is listed once, with its id."""
    assert daemon.store is not None and daemon.writer is not None
    store = daemon.store
    daemon.writer.attach(None)  # the writer holds records back; the database still answers reads
    daemon.event("database_recovered", "usable again", severity="warning")
    daemon.event("trip", "low_available tripped", severity="critical")
    async with _client(daemon) as c:
        body = (await c.get("/api/events", params={"kind": "database_recovered,trip"})).json()
        assert [(e["kind"], e["id"]) for e in body["events"]] == [("trip", None), ("database_recovered", None)]
        body = (await c.get("/api/events", params={"kind": "trip"})).json()
        assert [e["message"] for e in body["events"]] == ["low_available tripped"]
        body = (await c.get("/api/events", params={"limit": 1})).json()
        assert [e["kind"] for e in body["events"]] == ["trip"]
        assert not store.events(kinds=["trip"])  # not in the database yet
        daemon.writer.attach(store)
        await asyncio.to_thread(daemon.writer.flush)
        body = (await c.get("/api/events", params={"kind": "database_recovered,trip"})).json()
    assert [e["kind"] for e in body["events"]] == ["trip", "database_recovered"]
    assert all(isinstance(e["id"], int) for e in body["events"])


async def test_it_lists_launches_with_estimate_and_actual(daemon: Daemon) -> None:
    assert daemon.store is not None
    plan = FakeActions().plan.to_json()
    daemon.store.save_launch(
        {
            "id": "L1",
            "started_at": time.time() - 600,
            "ready_at": time.time() - 300,
            "status": "ready",
            "plan": plan,
            "actual": {"kv_cache_available_gib": 16.2, "graph_capture_gib": 0.9},
        }
    )
    async with _client(daemon) as c:
        [la] = (await c.get("/api/launches")).json()["launches"]
        html = (await c.get("/ui/launches")).text
    assert la["kv_exp_gib"] == pytest.approx(plan["kv_exp_gib"])
    assert la["kv_delta_gib"] == pytest.approx(16.2 - plan["kv_exp_gib"])
    assert 299 <= la["ready_s"] <= 301
    assert "16.20" in html and "0.786" in html


# --------------------------------------------------------------------------- archives
def _archive(d: Daemon) -> str:
    info = write_archive(
        d.settings.archives_path, "stop low_available", {"memwatch.log": b"MemAvailable 5.1 GiB\n"}, "s"
    )
    return info.name


async def test_it_lists_and_downloads_archives(daemon: Daemon) -> None:
    name = _archive(daemon)
    async with _client(daemon) as c:
        [a] = (await c.get("/api/archives", headers=_bearer(daemon))).json()["archives"]
        assert a["name"] == name and a["url"] == f"/api/archives/{name}"
        r = await c.get(a["url"], headers=_bearer(daemon))
        assert r.status_code == 200
        assert r.content == (daemon.settings.archives_path / name).read_bytes()
        assert r.headers["content-disposition"] == f'attachment; filename="{name}"'
        assert "no-store" in r.headers["cache-control"]


async def test_it_requires_auth_to_list_or_download_archives(daemon: Daemon) -> None:
    name = _archive(daemon)
    async with _client(daemon) as c:
        for path in ("/api/archives", f"/api/archives/{name}"):
            _err(await c.get(path), 401, "unauthorized")
            _err(await c.get(path, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
        html = (await c.get("/ui/archives")).text
        assert "Log in to download" in html and name not in html and "/api/archives" not in html
        assert (await c.get("/ui/archives.json")).json() == {"archives": None}
        assert (await c.get("/dashboard.json")).json()["archives"] is None
        assert name not in (await c.get("/")).text
        [a] = (await c.get("/ui/archives.json", headers=_bearer(daemon))).json()["archives"]
        assert a["name"] == name


async def test_it_lets_a_dashboard_session_download_archives(daemon: Daemon) -> None:
    name = _archive(daemon)
    async with _client(daemon) as c:
        await _login(c, daemon)  # a plain GET with the session cookie: no CSRF token needed
        html = (await c.get("/ui/archives")).text
        assert f'href="/api/archives/{name}"' in html and "Log in to download" not in html
        assert name in (await c.get("/")).text
        [a] = (await c.get("/api/archives")).json()["archives"]
        r = await c.get(a["url"])
        assert r.status_code == 200 and r.content == (daemon.settings.archives_path / name).read_bytes()


@pytest.mark.parametrize(
    "path",
    [
        "/api/archives/..%2f..%2fetc%2fpasswd",
        "/api/archives/..%2ftoken",
        "/api/archives/%2fetc%2fpasswd",
        "/api/archives//etc/passwd",
        "/api/archives/../token",
        "/api/archives/outside.tar.gz",
        "/api/archives/missing.tar.gz",
        "/api/archives/sub.tar.gz",
    ],
)
async def test_it_never_serves_files_outside_the_archive_dir(daemon: Daemon, tmp_path: Path, path: str) -> None:
    adir = daemon.settings.archives_path
    adir.mkdir(parents=True, exist_ok=True)
    secret = tmp_path / "secret.tar.gz"
    secret.write_bytes(b"not yours")
    (adir / "outside.tar.gz").symlink_to(secret)  # a symlink out of the directory
    (adir / "sub.tar.gz").mkdir()
    async with _client(daemon) as c:
        unauth = await c.get(path)  # auth comes first: no probing without the token
        assert unauth.status_code in (401, 404) and b"not yours" not in unauth.content  # 404: normalized away
        if "/../" not in path:
            _err(unauth, 401, "unauthorized")
        r = await c.get(path, headers=_bearer(daemon))
    _err(r, 404, "not_found")
    assert b"not yours" not in r.content and b"root:" not in r.content


# --------------------------------------------------------------------------- metrics
async def test_it_exports_prometheus_metrics(managed: Daemon) -> None:
    _archive(managed)
    async with _client(managed) as c:
        r = await c.get("/metrics")
        status = (await c.get("/api/status")).json()
    assert r.headers["content-type"].startswith("text/plain")
    samples = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    sample = status["sample"]
    assert samples[("sparkd_memory_MemTotal_bytes", ())] == sample["mem_total"]
    assert ("sparkd_memory_MemAvailable_bytes", ()) in samples
    for name in ("MemFree", "Cached", "Buffers", "AnonPages", "Slab", "PageTables", "Shmem", "SwapFree"):
        assert (f"sparkd_memory_{name}_bytes", ()) in samples, name
    assert ("sparkd_driver_memory_bytes", ()) in samples
    if sample.get("psi_some_avg10") is not None:
        assert ("sparkd_pressure_memory_some_avg10", ()) in samples
    assert samples[("sparkd_rule_counter", (("rule", "low_available"),))] == 0
    assert samples[("sparkd_rule_samples_required", (("rule", "low_available"),))] == 3
    # usable memory beside MemAvailable (MemAvailable - CmaFree; equal without CMA)
    assert samples[("sparkd_memory_usable_bytes", ())] == sample["mem_available_minus_cma"]
    assert status["usable_bytes"] == sample["mem_available_minus_cma"]
    assert samples[("sparkd_rule_blind", (("reason", ""), ("rule", "low_available")))] == 0
    assert samples[("sparkd_kernel_log_lost_total", ())] == status["kernel_log"]["lost"] == 0
    assert samples[("sparkd_nvrm_bursts_total", ())] == 0
    assert samples[("sparkd_rule_trips_total", (("rule", "low_available"),))] == 0
    assert ("sparkd_rule_near_misses_total", (("rule", "low_free_with_evidence"),)) in samples
    assert samples[("sparkd_nvrm_errors_total", ())] == 0
    assert samples[("sparkd_container_state", (("state", "ready"),))] == 1
    assert samples[("sparkd_container_state", (("state", "exited"),))] == 0
    assert samples[("sparkd_container_stops_total", (("how", "stop"),))] == 2
    assert samples[("sparkd_archives", ())] == 1
    assert samples[("sparkd_samples_total", ())] >= 5
    assert samples[("sparkd_tick_seconds", (("quantile", "0.5"),))] > 0


async def test_a_blind_guard_names_each_rule_that_cannot_evaluate(tmp_path: Path) -> None:
    # a container-virtualised /proc whose meminfo has no MemAvailable (field-2/proc-no-memavailable)
    d = await _daemon(tmp_path, proc_root=str(fixture("field-2", "proc-no-memavailable")))
    try:
        async with _client(d) as c:
            text = (await c.get("/metrics")).text
            status = (await c.get("/api/status")).json()
            rules_html = (await c.get("/ui/rules")).text
    finally:
        await d.shutdown("test")
    why = "cannot evaluate: MemAvailable not read"
    for rule in ("low_available", "low_free_with_evidence", "collapse_projected", "repeated_dips"):
        assert f'sparkd_rule_blind{{reason="{why}",rule="{rule}"}} 1.0' in text
    assert status["blind"]["rules"] == {
        r: why for r in ("low_available", "low_free_with_evidence", "collapse_projected", "repeated_dips")
    }
    assert [r["blind"] for r in status["rules"]] == [why] * 4  # never a quiet 0/N
    sensor = status["blind"]["sensors"]["MemAvailable"]
    assert sensor.startswith("no MemAvailable line in ") and "needed by low_available" in sensor
    assert 'sparkd_input_blind{input="MemAvailable"' in text
    # the dashboard's rule cards say BLIND and why, with no counter
    assert rules_html.count(">BLIND</span>") == 4
    assert rules_html.count(f'<p class="reason small critical-text rule-blind">{why}</p>') == 4
    assert '<span class="of">' not in rules_html
    # one event at start, not one per sample
    blind_events = [e for e in d.recent_events if e["kind"] == "sensor_blind"]
    assert len(blind_events) == 1 and blind_events[0]["severity"] == "critical"
    assert "rule low_available cannot evaluate: MemAvailable not read" in blind_events[0]["message"]


async def test_it_marks_monitor_only_in_metrics(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        text = (await c.get("/metrics")).text
    # the same words as /api/status: state "none", mode "monitor-only"
    assert 'sparkd_container_state{state="none"} 1.0' in text
    assert 'sparkd_container_mode{mode="monitor-only"} 1.0' in text
    assert 'state="monitor-only"' not in text


# --------------------------------------------------------------------------- control
async def test_it_requires_a_token_for_control(managed: Daemon) -> None:
    async with _client(managed) as c:
        _err(await c.post("/api/container/stop"), 401, "unauthorized")
        _err(await c.post("/api/container/stop", headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
        _err(
            await c.post("/api/container/stop", headers={"Authorization": f"Basic {_token(managed)}"}),
            401,
            "unauthorized",
        )
    assert managed.actions.calls == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("action", ["start", "stop", "restart"])
async def test_it_hands_actions_to_the_supervisor(managed: Daemon, action: str) -> None:
    async with _client(managed) as c:
        r = await c.post(f"/api/container/{action}", headers=_bearer(managed))
    assert r.status_code == 200 and r.json()["action"] == action
    assert managed.actions.calls == [(action, "api:token")]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("client", "who"), [("cli", "api:cli"), ("someone-else", "api:token"), ("", "api:token")])
async def test_sparkds_cli_is_named_in_the_actions_source_and_nothing_else_is_taken(
    managed: Daemon, client: str, who: str
) -> None:
    """Every CLI action was recorded as ``api:token``, like any script holding the token (note 11). The CLI says
    ``x-sparkd-client: cli``; no other value reaches a source (archive names are made from it)."""
    from sparkd.face.auth import CLIENT_HEADER

    async with _client(managed) as c:
        r = await c.post("/api/container/stop", headers={**_bearer(managed), CLIENT_HEADER: client})
    assert r.status_code == 200
    assert managed.actions.calls == [("stop", who)]  # type: ignore[attr-defined]


async def test_the_client_header_grants_nothing_without_the_token(managed: Daemon) -> None:
    from sparkd.face.auth import CLIENT_HEADER

    async with _client(managed) as c:
        r = await c.post("/api/container/stop", headers={CLIENT_HEADER: "cli"})
    assert r.status_code == 401
    assert managed.actions.calls == []  # type: ignore[attr-defined]


async def test_it_answers_409_while_an_action_runs(managed: Daemon) -> None:
    managed.actions.busy = "stopping"  # type: ignore[attr-defined]
    async with _client(managed) as c:
        detail = _err(await c.post("/api/container/restart", headers=_bearer(managed)), 409, "conflict")
    assert detail == "already stopping"


async def test_it_refuses_control_in_monitor_only_mode(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        detail = _err(await c.post("/api/container/stop", headers=_bearer(daemon)), 422, "refused")
        assert detail.startswith("monitor-only: no container configured")
        detail = _err(await c.post("/api/resize", json={"kv_target_gib": 10}, headers=_bearer(daemon)), 422, "refused")
        assert "monitor-only" in detail


async def test_it_dry_runs_a_resize(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.post("/api/resize", json={"host_reserve_gib": 28}, headers=_bearer(managed))
    body = r.json()
    assert r.status_code == 200 and body["applied"] is False  # dry_run defaults to true
    assert body["previous"]["gmu"] == pytest.approx(0.786)
    assert body["plan"]["gmu"] < body["previous"]["gmu"]
    assert body["diff"]["gmu"]["old"] == pytest.approx(0.786)


async def test_it_applies_a_resize_when_asked(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.post("/api/resize", json={"max_num_seqs": 8, "dry_run": False}, headers=_bearer(managed))
    assert r.status_code == 200 and r.json()["applied"] is True


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"kv_target_gib": -1}, "kv_target_gib"),
        ({"gmu_override": 1.5}, "gmu_override"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
        ({"max_num_seqs": "many"}, "max_num_seqs"),
        ({"memory": "200g"}, "memory"),
        ({}, "body"),
        ({"dry_run": True}, "body"),
        ({"max_model_len": True}, "max_model_len"),
        ({"max_num_seqs": False}, "max_num_seqs"),
        ({"kv_target_gib": True}, "kv_target_gib"),
        ({"gmu_override": True}, "gmu_override"),
        ({"max_num_seqs": "8"}, "max_num_seqs"),
        ({"max_model_len": 4096.5}, "max_model_len"),
    ],
)
async def test_it_refuses_bad_resize_input_naming_the_field(managed: Daemon, body: dict[str, Any], field: str) -> None:
    async with _client(managed) as c:
        detail = _err(await c.post("/api/resize", json=body, headers=_bearer(managed)), 422, "invalid_input")
    assert detail["field"] == field
    if isinstance(next(iter(body.values()), None), bool) and field != "body":
        assert "not true/false" in detail["message"]
    assert managed.actions.calls == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("field", ["kv_target_gib", "host_reserve_gib", "gmu_override", "docker_headroom_gib"])
async def test_it_refuses_non_finite_resize_numbers(managed: Daemon, field: str, raw: str) -> None:
    body = f'{{"{field}": {raw}}}'.encode()  # what Python's json (and so FastAPI) parses to nan/inf
    async with _client(managed) as c:
        r = await c.post("/api/resize", content=body, headers={**_bearer(managed), "Content-Type": "application/json"})
    detail = _err(r, 422, "invalid_input")
    assert detail["field"] == field and "finite number" in detail["message"]
    assert managed.actions.calls == []  # type: ignore[attr-defined]


async def test_it_accepts_a_json_integer_for_a_float_field(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.post("/api/resize", json={"kv_target_gib": 20}, headers=_bearer(managed))
    assert r.status_code == 200, r.text
    assert managed.actions.last_changes == {"kv_target_gib": 20.0}  # type: ignore[attr-defined]
    assert isinstance(managed.actions.last_changes["kv_target_gib"], float)  # type: ignore[attr-defined]
    assert managed.actions.calls == [("resize", "api:token")]  # type: ignore[attr-defined]


@pytest.mark.parametrize("content", [b"{not json", b"max_model_len=5", b"[1, 2]", b"5", b'"x"', b"null"])
async def test_it_says_the_resize_body_must_be_a_json_object(managed: Daemon, content: bytes) -> None:
    headers = {**_bearer(managed), "Content-Type": "application/json"}
    async with _client(managed) as c:
        detail = _err(await c.post("/api/resize", content=content, headers=headers), 422, "invalid_input")
    assert detail["field"] == "body" and "JSON object" in detail["message"], detail


@pytest.mark.parametrize("param", ["since", "until", "step"])
@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1e999"])
async def test_it_refuses_non_finite_sample_queries(daemon: Daemon, param: str, raw: str) -> None:
    async with _client(daemon) as c:
        r = await c.get("/api/samples", params={param: raw})
    detail = _err(r, 422, "invalid_input")
    assert detail["field"] == param and "finite number" in detail["message"], detail


@pytest.mark.parametrize("raw", ["nan", "inf", "1e999"])
async def test_it_refuses_non_finite_event_queries(daemon: Daemon, raw: str) -> None:
    async with _client(daemon) as c:
        detail = _err(await c.get("/api/events", params={"since": raw}), 422, "invalid_input")
    assert detail["field"] == "since" and "finite number" in detail["message"]


async def test_it_serializes_non_finite_values_in_error_bodies(daemon: Daemon) -> None:
    from sparkd.errors import InvalidInput

    app = create_app(daemon)

    @app.get("/boom")
    async def boom() -> None:
        raise InvalidInput("x", {"v": [float("nan"), float("inf")]}, "anything")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        detail = _err(await c.get("/boom"), 422, "invalid_input")
        assert detail["value"] == {"v": ["nan", "inf"]}
        page = await c.get("/boom", headers={"Accept": "text/html"})
    assert page.status_code == 422 and "<html" in page.text


async def test_it_passes_the_budget_refusal_through(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.post("/api/resize", json={"gmu_override": 0.95}, headers=_bearer(managed))
    assert "above the host cap" in _err(r, 422, "refused")


# --------------------------------------------------------------------------- sessions & CSRF
async def test_it_never_takes_the_token_from_the_url(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.get("/login", params={"token": _token(managed)})
        # refused even with the right token: a token in a URL stays in history and logs
        assert r.status_code == 400 and "not taken from the address" in r.text
        assert SESSION_COOKIE not in r.headers.get("set-cookie", "")
        r = await c.post("/login", data={"token": _token(managed)})
        assert r.status_code == 303 and r.headers["location"] == "/"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and SESSION_COOKIE in cookie
        assert "Log out" in (await c.get("/")).text
    # a successful login is an event
    assert any(e["kind"] == "login" for e in managed.recent_events)


async def test_it_logs_in_with_the_form(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.post("/login", data={"token": _token(managed)})
        assert r.status_code == 303
        assert "csrf-token" in (await c.get("/")).text
        kept = dict(c.cookies)
        r = await c.post("/logout")
        assert r.status_code == 303
        c.cookies.clear()
        assert "csrf-token" not in (await c.get("/")).text
        # the old cookie, replayed after logout, is worth nothing: the session ended server-side
        c.cookies.update(kept)
        assert "csrf-token" not in (await c.get("/")).text
        _err(await c.get("/api/archives"), 401, "unauthorized")


async def test_it_refuses_a_wrong_login_and_backs_off_per_client(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.post("/login", data={"token": "guess"})
        assert r.status_code == 401 and "not valid" in r.text and SESSION_COOKIE not in r.headers.get("set-cookie", "")
        for _ in range(4):  # five failures are free
            assert (await c.post("/login", data={"token": "guess"})).status_code == 401
        assert (await c.post("/login", data={"token": "guess"})).status_code == 401  # the 6th: back-off starts
        r = await c.post("/login", data={"token": _token(managed)})  # even the right token waits now
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1


async def test_it_requires_csrf_with_a_session(managed: Daemon) -> None:
    async with _client(managed) as c:
        csrf = await _login(c, managed)
        _err(await c.post("/api/container/stop"), 403, "forbidden")
        _err(await c.post("/api/container/stop", headers={"X-CSRF-Token": "x" + csrf}), 403, "forbidden")
        r = await c.post("/api/container/stop", headers={"X-CSRF-Token": csrf})
        assert r.status_code == 200
        r = await c.post("/ui/container/restart", data={"csrf_token": csrf}, headers={"HX-Request": "true"})
        assert r.status_code == 200 and "restart queued" in r.text
    assert managed.actions.calls == [("stop", "api:session"), ("restart", "web:session")]  # type: ignore[attr-defined]


async def test_it_binds_csrf_to_the_session(managed: Daemon) -> None:
    async with _client(managed) as a, _client(managed) as b:
        csrf_a = await _login(a, managed)
        await _login(b, managed)
        _err(await b.post("/api/container/stop", headers={"X-CSRF-Token": csrf_a}), 403, "forbidden")


async def test_it_refuses_forged_and_expired_sessions(managed: Daemon) -> None:
    auth = Auth(_token(managed))
    other = Auth("another-token-entirely-0123456789")
    assert auth.session_id(other.new_session()) is None
    issued, nonce, sig = auth.new_session().split(".")
    assert auth.session_id(f"{int(issued) + 1}.{nonce}.{sig}") is None
    old = Auth(_token(managed), clock=lambda: time.time() - 8 * 86400).new_session()
    assert auth.session_id(old) is None
    async with _client(managed) as c:
        c.cookies.set(SESSION_COOKIE, old)
        sid = old.rsplit(".", 1)[0]
        r = await c.post("/api/container/stop", headers={"X-CSRF-Token": auth.csrf_for(sid)})
        _err(r, 401, "unauthorized")


# --------------------------------------------------------------------------- origin & host
@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example"},
        {"Origin": "http://127.0.0.1:9999"},
        {"Origin": "null"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
    ],
)
async def test_it_refuses_cross_origin_mutations_even_with_the_token(managed: Daemon, headers: dict[str, str]) -> None:
    async with _client(managed) as c:
        _err(await c.post("/api/container/stop", headers={**_bearer(managed), **headers}), 403, "forbidden")
        _err(await c.post("/login", data={"token": _token(managed)}, headers=headers), 403, "forbidden")
    assert managed.actions.calls == []  # type: ignore[attr-defined]


async def test_it_accepts_same_origin_mutations(managed: Daemon) -> None:
    headers = {**_bearer(managed), "Origin": BASE, "Sec-Fetch-Site": "same-origin"}
    async with _client(managed) as c:
        assert (await c.post("/api/container/stop", headers=headers)).status_code == 200
        assert (await c.get("/api/status", headers={"Origin": "http://evil.example"})).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8741", "127.0.0.1.nip.io", "localhost.evil"])
async def test_it_refuses_foreign_host_headers(daemon: Daemon, host: str) -> None:
    async with _client(daemon) as c:
        detail = _err(await c.get("/api/status", headers={"Host": host}), 400, "bad_host")
    assert "allowed_hosts" in detail


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "127.0.0.1:8741", "localhost:8741", "[::1]:8741", "[::1]", "LOCALHOST", "LocalHost:8741"],
)
async def test_it_accepts_allowed_hosts(daemon: Daemon, host: str) -> None:
    async with _client(daemon) as c:
        assert (await c.get("/api/status", headers={"Host": host})).status_code == 200


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:8751@evil",
        "a@b",
        "127.0.0.1@evil.example",
        "127.0.0.1:80x",
        "127.0.0.1:8741/evil",
        "127.0.0.1:",
        "127.0.0.1:99999",
        "127.0.0.1:+80",
        "127.0.0.1:8741:1",
        "[::1]x",
        "[::1]:80x",
        "[::1",
        "::1",
        "127.0.0.1 evil",
        "",
    ],
)
async def test_it_refuses_malformed_host_headers(managed: Daemon, host: str) -> None:
    async with _client(managed) as c:
        r = await c.post("/api/container/stop", headers={**_bearer(managed), "Host": host})
        _err(r, 400, "bad_host")
        _err(await c.get("/api/status", headers={"Host": host}), 400, "bad_host")
    assert managed.actions.calls == []  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- error shape
async def test_it_answers_every_error_in_one_shape(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        assert "/nope" in _err(await c.get("/nope"), 404, "not_found")
        assert "GET" in _err(await c.get("/api/container/stop"), 405, "method_not_allowed")
        detail = _err(await c.post("/api/resize", content=b"{not json", headers=_bearer(daemon)), 422, "invalid_input")
        assert detail["field"] == "body"
        detail = _err(await c.get("/ui/bogus.json"), 422, "invalid_input")
        assert detail["field"] == "name" and "summary" in detail["message"]


async def test_it_renders_errors_as_a_page_for_browsers(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        r = await c.get("/nope", headers={"Accept": "text/html"})
    assert r.status_code == 404 and "<html" in r.text and "no such path" in r.text


# --------------------------------------------------------------------------- token file
def test_it_creates_the_token_file_private_and_once(tmp_path: Path) -> None:
    p = tmp_path / "state" / "token"
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_token(p))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results[0]) >= 40
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert ensure_token(p) == results[0]
    assert [f.name for f in p.parent.iterdir()] == ["token"]  # no temp files left


def test_a_token_that_cannot_be_written_leaves_no_temporary_file(tmp_path: Path) -> None:
    """A full disk at start (the write of the new token fails): a clear error, and no empty temporary file
    left in the state dir at each of systemd's restarts. The write really fails: a child process with a
    file-size limit of 0 (``RLIMIT_FSIZE``: ``write`` gets EFBIG, as ``ENOSPC`` on a full file system)."""
    import subprocess
    import sys

    state = tmp_path / "state"
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))\n"
        "from sparkd.errors import ConfigError\n"
        "from sparkd.face.auth import ensure_token\n"
        "try:\n"
        f"    ensure_token({str(state / 'token')!r})\n"
        "except ConfigError as e:\n"
        "    print(e.message)\n"
        "    sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, (r.stdout, r.stderr[-2000:])
    assert "cannot create or read the API token file" in r.stdout and "token" in r.stdout
    assert list(state.iterdir()) == []  # neither the token nor a temporary file


def test_it_tightens_a_readable_token_file(tmp_path: Path) -> None:
    p = tmp_path / "token"
    p.write_text("x" * 43 + "\n")
    os.chmod(p, 0o644)
    assert ensure_token(p) == "x" * 43
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_it_refuses_an_unusable_token_file(tmp_path: Path) -> None:
    p = tmp_path / "token"
    p.write_text("short")
    with pytest.raises(ConfigError, match="no usable token"):
        ensure_token(p)
    (tmp_path / "link").symlink_to(p)
    with pytest.raises(ConfigError, match="link"):
        ensure_token(tmp_path / "link")


# --------------------------------------------------------------------------- dashboard
async def test_it_renders_the_dashboard_server_side(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.get("/")
    assert r.status_code == 200
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    async with _client(managed) as c:  # not a page: the short set, still never sniffed nor framed
        j = await c.get("/ui/live.json")
    assert j.headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"
    assert j.headers["x-content-type-options"] == "nosniff" and "x-frame-options" not in j.headers
    for text in ("low_available", "MemAvailable", "vllm/vllm-openai:v0.9.2", "Memory budget", "daemon_started"):
        assert text in r.text, text
    assert "Log in to control" in r.text and "disabled" in r.text  # buttons disabled until login
    assert "<noscript>" in r.text


async def test_it_says_monitor_only_clearly(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        html = (await c.get("/ui/container")).text
        page = (await c.get("/")).text
    assert "Monitor-only." in html and "no container configured" in html.lower()
    assert 'id="part-budget"' in page and "hidden" in page.split('id="part-budget"')[1].split(">")[0]


def _demote_stop_rules(d: Daemon) -> None:
    """Every stop rule demoted to warn, as the loop guard does."""
    assert d.guard is not None
    for r in list(d.guard.rules):
        if r.action == "stop":
            d.guard.engine.demote(r.name, "a test demoted it")


async def test_a_host_no_rule_would_stop_for_reads_not_guarded_never_waiting(tmp_path: Path) -> None:
    """A warn-only rule set (monitor-only), or every stop rule demoted to warn: after the first sample the
    headline, badge and tab title say the model is not guarded and why ("Waiting for the first sample"
    and "unknown" told an operator the guard was only starting)."""
    rule = {"name": "watch_only", "when": ["usable < 6GiB"], "samples": 5, "action": "warn"}
    d = await _daemon(tmp_path, monitor_only=True, rules=[rule])
    try:
        async with _client(d) as c:
            page = (await c.get("/")).text
            live = (await c.get("/ui/live.json", params={"ev": 0})).json()
        assert "No stop rule is armed: the model is not guarded" in page and "Waiting for the first" not in page
        assert "every rule only warns (watch_only)" in page
        assert (live["level"], live["label"], live["title"]) == ("warn", "not guarded", "sparkd · not guarded")
    finally:
        await d.shutdown("test")
    d = await _daemon(tmp_path / "demoted")
    try:
        _demote_stop_rules(d)
        async with _client(d) as c:
            page = (await c.get("/")).text
            summary = (await c.get("/ui/summary.json")).json()["summary"]
        assert "No stop rule is armed" in page and "demoted to warn: low_available (a test demoted it)" in page
        assert summary["level"] == "warn"
    finally:
        await d.shutdown("test")
    # the same with a model running: nothing stops it now; amber read as "mind it" (helper-48)
    from click.testing import CliRunner

    from sparkd.face.cli import main

    d = await _daemon(tmp_path / "demoted-running", actions=FakeActions())
    try:
        _demote_stop_rules(d)
        async with _client(d) as c:
            live = (await c.get("/ui/live.json", params={"ev": 0})).json()
        assert (live["level"], live["label"]) == ("critical", "not guarded")
    finally:
        await d.shutdown("test")  # the last snapshot, every stop rule demoted
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{d.settings.state_dir}"\n')
    out = CliRunner().invoke(main, ["--config", str(cfg), "status"]).output
    assert "NOT GUARDED: no rule would stop the model: demoted to warn: low_available (a test demoted it)" in out, out
    # one stop rule demoted, others still stop: the header says so instead of "ok" (an operator's walk-through)
    d = await _daemon(tmp_path / "one")
    try:
        assert d.guard is not None
        d.guard.engine.demote("low_available", "a test demoted it")
        async with _client(d) as c:
            live = (await c.get("/ui/live.json", params={"ev": 0})).json()
        assert (live["level"], live["label"]) == ("warn", "low_available demoted to warn (cannot protect this host)")
    finally:
        await d.shutdown("test")


async def test_a_docker_engine_that_does_not_answer_is_never_ok_on_the_page_or_in_sparkd_status(tmp_path: Path) -> None:
    """Rules quiet, model ready as last seen, but Docker does not answer: a stop acts on the model's processes
    only (its archive without the container's log), and start, restart and resize wait. The header, the container
    card and `sparkd status` say so (the page read "ok")."""
    from click.testing import CliRunner

    from sparkd.face.cli import main
    from sparkd.face.presenters import ENGINE_DOWN_LABEL

    actions = FakeActions()
    d = await _daemon(tmp_path, actions=actions)
    try:
        async with _client(d) as c:
            up = (await c.get("/ui/live.json", params={"ev": 0})).json()
            metrics_up = (await c.get("/metrics")).text
            actions.engine, actions.engine_error = "down", "ping failed"
            live = (await c.get("/ui/live.json", params={"ev": 0})).json()
            page = (await c.get("/")).text
            metrics = (await c.get("/metrics")).text
        assert "sparkd_docker_engine_up 1.0" in metrics_up and "sparkd_docker_engine_up 0.0" in metrics
        assert up["level"] == "ok" and up["label"] != ENGINE_DOWN_LABEL  # the same host with Docker answering
        assert (live["level"], live["label"]) == ("warn", ENGINE_DOWN_LABEL)
        assert "Docker engine unreachable.</strong>" in page and "a trip stops the model by its processes" in page
        assert "answers again: ping failed." in page
    finally:
        await d.shutdown("test")  # writes the last status snapshot, engine down
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{d.settings.state_dir}"\n')
    out = CliRunner().invoke(main, ["--config", str(cfg), "status"]).output
    assert "DOCKER ENGINE UNREACHABLE: ping failed — a stop acts on the model's processes (its archive" in out, out


@pytest.mark.parametrize("part", ["summary", "rules", "container", "budget", "events", "launches", "archives"])
async def test_it_serves_each_part_with_a_json_twin(managed: Daemon, part: str) -> None:
    async with _client(managed) as c:
        html = await c.get(f"/ui/{part}")
        data = await c.get(f"/ui/{part}.json")
        whole = (await c.get("/dashboard.json")).json()
    # no part polls by itself any more: /ui/live.json carries what changed (test_it_sends_only_what_changed)
    assert html.status_code == 200 and f'id="part-{part}"' in html.text and 'hx-trigger="every' not in html.text
    assert html.text.lstrip().startswith("<section")  # the fragment alone, no page around it
    assert data.status_code == 200 and list(data.json()) == [part]
    assert part in whole


async def test_it_sends_only_what_changed(managed: Daemon) -> None:
    async with _client(managed) as c:
        first = (await c.get("/ui/live.json", params={"ev": 0})).json()
        hashes = first["hashes"]
        assert set(hashes) == {"headline", "stopped", "summary", "rules", "container", "buttons", "budget"}
        # the headline figures always come; parts only when the page's hash differs from the server's
        assert first["nearest_stop"] == (await c.get("/api/status")).json()["nearest_stop"]
        have = ",".join(f"{k}:{v}" for k, v in hashes.items())
        same = (await c.get("/ui/live.json", params={"have": have})).json()
        changed = set(same["parts"])
        assert changed == {k for k, v in same["hashes"].items() if hashes[k] != v}
        stale = (await c.get("/ui/live.json", params={"have": "rules:stale,container:stale"})).json()
        assert set(stale["parts"]) == {"rules", "container"}
        assert 'id="part-rules"' in stale["parts"]["rules"]
        # events: only those newer than the id the page has
        newest = first["last_event_id"]
        assert (await c.get("/ui/live.json", params={"ev": newest})).json().get("event_rows") is None
        assert first["event_rows"].count("<li") >= 1


async def test_a_part_is_re_sent_only_when_what_it_shows_changes(managed: Daemon) -> None:
    d = managed
    async with _client(d) as c:
        await _login(c, d)
        page = (await c.get("/")).text
        have = re.search(r'data-have="([^"]*)"', page)
        assert have
        # nothing sampled since the page: the page's hashes are the live ones, and nothing comes back
        # (the sample's age ticks in the page; it is not a change of the headline)
        r = (await c.get("/ui/live.json", params={"have": have.group(1)})).json()
        assert ",".join(f"{k}:{v}" for k, v in r["hashes"].items()) == have.group(1)
        assert r["parts"] == {}
        # memory moves by 1 MiB: the headline shows 0.1 GiB, so it is not re-sent for that
        assert d.guard is not None and d.guard.last is not None
        sample = d.guard.last

        def headline_at(ts: float, mem_available: int) -> Any:
            assert d.guard is not None
            # every field a stop line may be on (MemAvailable, usable = MemAvailable − CmaFree, MemFree)
            d.guard.last = dataclasses.replace(
                sample,
                ts=ts,
                mem_available=mem_available,
                mem_available_minus_cma=mem_available,
                mem_free=mem_available,
                cma_free=0,
            )
            return c.get("/ui/live.json", params={"have": have.group(1)})

        a = (await headline_at(sample.ts + 1, 20 * 2**30 + 10 * 2**20)).json()["hashes"]["headline"]
        b = (await headline_at(sample.ts + 2, 20 * 2**30 + 11 * 2**20)).json()["hashes"]["headline"]
        assert a == b
        # 3 GiB less: it is
        r = (await headline_at(sample.ts + 3, 17 * 2**30)).json()
        assert r["hashes"]["headline"] != a and "headline" in r["parts"] and "17.0 GiB" in r["parts"]["headline"]
        d.guard.last = sample


async def test_an_idle_poll_reads_no_events_from_the_database_yet_misses_none(managed: Daemon) -> None:
    d = managed
    assert d.store is not None and d.writer is not None
    calls: list[Any] = []
    real = d.store.events

    def spy(**kw: Any) -> Any:
        if "after_id" in kw:  # the live list's "newer than" read (the stopped card asks for stops apart)
            calls.append(kw)
        return real(**kw)

    d.store.events = spy  # type: ignore[method-assign]
    async with _client(d) as c:
        newest = (await c.get("/ui/live.json", params={"ev": 0})).json()["last_event_id"]
        calls.clear()
        for _ in range(3):
            assert (await c.get("/ui/live.json", params={"ev": newest})).json().get("event_rows") is None
        assert len(calls) == 1  # the first poll asked; nothing was recorded or written since: no more reads
        # an event is in memory at once and in the database after the writer's batch: polls before the
        # write ask again (and find nothing yet), the one after it shows the event
        d.event("login", "a marker for this test")
        r = (await c.get("/ui/live.json", params={"ev": newest})).json()
        assert len(calls) == 2
        await asyncio.to_thread(d.writer.flush)
        rows = []
        for _ in range(2):
            r = (await c.get("/ui/live.json", params={"ev": newest})).json()
            if r.get("event_rows"):
                rows.append(r)
                break
        assert rows and "a marker for this test" in rows[0]["event_rows"]
        assert rows[0]["last_event_id"] > newest


async def test_the_live_poll_replaces_the_top_row_with_the_longer_run(managed: Daemon) -> None:
    """A near miss after a near miss: the page's top row becomes "2 × …" (test_event_rows.py)."""
    d = managed
    assert d.writer is not None and d.store is not None
    async with _client(d) as c:
        d.event("near_miss", "near miss A")
        await asyncio.to_thread(d.writer.flush)
        first = (await c.get("/ui/live.json", params={"ev": 0})).json()
        ev = first["last_event_id"]
        d.event("near_miss", "near miss B")
        await asyncio.to_thread(d.writer.flush)
        r = (await c.get("/ui/live.json", params={"ev": ev})).json()
        assert r["event_rows_replace"] == ev
        assert r["event_rows"].count("<li") == 1
        assert re.search(r"2 × in [\d.]+ s</strong> — latest: near miss B", r["event_rows"])
        # the page itself shows the same row
        page = (await c.get("/")).text
        assert "latest: near miss B" in page and "near miss A" not in page


async def test_the_live_chart_tail_comes_from_memory_on_the_databases_grid(managed: Daemon) -> None:
    from sparkd.face import presenters as views
    from sparkd.face.live import CHART_LIVE_COLUMNS, CHART_LIVE_FIELDS

    d = managed
    assert d.store is not None and d.writer is not None
    for _ in range(8):  # two seconds of samples at 4 Hz
        await asyncio.sleep(0.25)
        result = d._tick_once()
        assert result is not None
        await d._handle(result)
    await asyncio.to_thread(d.writer.flush)
    since = float(int(d.live_samples[0].ts) + 1)  # a bucket start the memory reaches back to
    assert d.reads.covers(since)
    calls: list[Any] = []
    real = d.store.downsampled
    d.store.downsampled = lambda **kw: calls.append(kw) or real(**kw)  # type: ignore[method-assign]
    async with _client(d) as c:
        tail = (await c.get("/ui/live.json", params={"since": since, "step": 1})).json()["samples"]
    assert calls == []  # answered from memory
    db = views.samples_columns(d.reads, since, tail["until"], 1.0, list(CHART_LIVE_FIELDS))
    assert len(calls) == 1  # that one from the database
    assert tail["ts"] == db["ts"] and tail["points"] >= 2
    for k in CHART_LIVE_COLUMNS:
        assert tail[k] == [None if v is None else round(v) for v in db[k]], k
    # before the memory's first sample: the database answers
    async with _client(d) as c:
        (await c.get("/ui/live.json", params={"since": since - 3600, "step": 1})).json()
    assert len(calls) == 2


async def test_it_shows_a_dry_run_plan_with_an_apply_button(managed: Daemon) -> None:
    async with _client(managed) as c:
        csrf = await _login(c, managed)
        r = await c.post(
            "/ui/resize",
            data={"csrf_token": csrf, "dry_run": "true", "host_reserve_gib": "28", "kv_target_gib": ""},
            headers={"HX-Request": "true"},
        )
        assert r.status_code == 200
        assert "Dry run." in r.text and "0.786" in r.text and ">Apply</button>" in r.text
        assert 'name="host_reserve_gib" value="28"' in r.text and 'name="dry_run" value="false"' in r.text
        bad = await c.post("/ui/resize", data={"csrf_token": csrf, "gmu_override": "7"}, headers={"HX-Request": "true"})
        assert bad.status_code == 422 and "gmu_override" in bad.text
        applied = await c.post(
            "/ui/resize",
            data={"csrf_token": csrf, "max_num_seqs": "8", "dry_run": "false"},
            headers={"HX-Request": "1"},
        )
        assert "Applied." in applied.text and ">Apply</button>" not in applied.text


async def test_it_says_so_when_there_is_no_current_plan(managed: Daemon) -> None:
    managed.actions.plan_json_missing = True  # type: ignore[attr-defined]
    async with _client(managed) as c:
        csrf = await _login(c, managed)
        r = await c.post("/ui/resize", data={"csrf_token": csrf, "kv_target_gib": "20"}, headers={"HX-Request": "true"})
    assert r.status_code == 200, r.text
    assert "no current plan (the running container was launched without the budget)" in r.text
    assert "None" not in r.text and "–" not in r.text.split("no current plan")[1]
    assert "Dry run." in r.text and ">Apply</button>" in r.text


async def test_it_refuses_non_finite_numbers_in_the_resize_form(managed: Daemon) -> None:
    async with _client(managed) as c:
        csrf = await _login(c, managed)
        for raw in ("nan", "inf", "1e999"):
            r = await c.post(
                "/ui/resize", data={"csrf_token": csrf, "kv_target_gib": raw}, headers={"HX-Request": "true"}
            )
            assert r.status_code == 422 and "kv_target_gib" in r.text and "finite number" in r.text, raw
        r = await c.post("/ui/resize", data={"csrf_token": csrf, "max_num_seqs": "8.5"}, headers={"HX-Request": "1"})
        assert r.status_code == 422 and "max_num_seqs" in r.text
    assert managed.actions.calls == []  # type: ignore[attr-defined]


async def test_it_shows_the_monitor_only_refusal_in_the_resize_form(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        csrf = await _login(c, daemon)
        r = await c.post("/ui/resize", data={"csrf_token": csrf, "kv_target_gib": "10"}, headers={"HX-Request": "1"})
    assert r.status_code == 422 and "monitor-only: no container configured" in r.text


async def test_it_refreshes_the_cached_status_on_each_sample(daemon: Daemon) -> None:
    async with _client(daemon) as c:
        first = (await c.get("/api/status")).json()
        assert (await c.get("/api/status")).json()["samples_taken"] == first["samples_taken"]
        result = daemon._tick_once()
        assert result is not None
        await daemon._handle(result)
        assert (await c.get("/api/status")).json()["samples_taken"] == first["samples_taken"] + 1
        daemon.event("test_event", "a new event without a new sample")
        assert (await c.get("/api/status")).json()["events"][0]["kind"] == "test_event"


# --------------------------------------------------------------------------- limits and odd input (issue 13)
async def test_it_refuses_two_host_headers_whatever_the_http_parser(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.get("/api/status", headers=[("Host", "attacker.example"), ("Host", "127.0.0.1:8741")])
    assert "2 Host headers; send exactly one" in str(_err(r, 400, "bad_host"))


async def test_it_refuses_a_body_over_the_cap_before_reading_it(managed: Daemon) -> None:
    cap = managed.settings.api.max_body_bytes
    async with _client(managed) as c:
        r = await c.post("/api/resize", content=b"{}", headers={"Content-Length": str(cap + 1), **_bearer(managed)})
        assert "api.max_body_bytes" in str(_err(r, 413, "too_large"))

        async def chunked() -> Any:  # no Content-Length: cut while reading, at the cap
            for _ in range(cap // 1024 + 2):
                yield b" " * 1024

        r = await c.post(
            "/api/resize", content=chunked(), headers={**_bearer(managed), "Content-Type": "application/json"}
        )
        assert r.status_code != 200
        r = await c.post("/api/resize", json={"kv_target_gib": 8}, headers=_bearer(managed))  # a small one is fine
        assert r.status_code == 200, r.text


async def test_it_answers_a_lone_surrogate_with_422_naming_the_field(managed: Daemon) -> None:
    async with _client(managed) as c:
        r = await c.post(
            "/api/resize",
            content=b'{"kv_cache_dtype":"\\ud800"}',
            headers={**_bearer(managed), "Content-Type": "application/json"},
        )
    detail = _err(r, 422, "invalid_input")
    assert r.json()["detail"]["field"] == "kv_cache_dtype", detail


def _chart_config(page: str) -> dict[str, Any]:
    import html
    import json

    m = re.search(r'id="chart" class="chart" data-config="([^"]*)"', page)
    assert m, page[:2000]
    result: dict[str, Any] = json.loads(html.unescape(m.group(1)))
    return result


@pytest.mark.parametrize("cma", [True, False])
async def test_the_chart_draws_the_default_rules_stop_lines_and_usable_where_there_is_cma(
    tmp_path: Path, cma: bool
) -> None:
    """The default rules judge usable memory (MemAvailable − CmaFree): their stop lines are on the chart
    (they were not: only MemFree < 2 GiB was), and where the host has CMA usable is a series of its own."""
    proc = tmp_path / "proc"
    proc.mkdir()
    extra = "CmaTotal: 4194304 kB\nCmaFree: 2097152 kB\n" if cma else ""
    (proc / "meminfo").write_text(f"MemTotal: 16777216 kB\nMemFree: 4194304 kB\nMemAvailable: 12582912 kB\n{extra}")
    d = await _daemon(tmp_path, proc_root=str(proc))  # the default rules
    try:
        async with _client(d) as c:
            cfg = _chart_config((await c.get("/")).text)
            body = (await c.get("/api/samples", params={"fields": "mem_available,mem_available_minus_cma"})).json()
    finally:
        await d.shutdown("test")
    lines = {(t["rule"], t["label"], t["value"] / 2**30) for t in cfg["thresholds"]}
    assert lines == {
        ("low_available", "usable", 6.0),
        ("low_free_with_evidence", "MemFree", 2.0),
        ("low_free_with_evidence", "usable", 10.0),
        ("collapse_projected", "usable (projected)", 4.0),  # the floor, not the 16 GiB arming gate
        ("repeated_dips", "usable", 3.0),
    }
    assert {t["action"] for t in cfg["thresholds"]} == {"stop"}  # a warn rule's would say "warn": drawn amber
    # what else a line's rule needs before it stops: low_free_with_evidence's 10 GiB line is no "stops at 10 GiB"
    needs = {(t["rule"], t["label"]): t["needs"] for t in cfg["thresholds"]}
    assert needs == {
        ("low_available", "usable"): None,
        ("low_free_with_evidence", "MemFree"): "usable < 10 GiB and evidence",
        ("low_free_with_evidence", "usable"): "MemFree < 2 GiB and evidence",
        ("collapse_projected", "usable (projected)"): None,
        ("repeated_dips", "usable"): None,
    }
    assert cfg["cma"] is cma
    usable = 10 * 2**30 if cma else 12 * 2**30
    assert body["mem_available_avg"][-1] == 12 * 2**30
    assert body["mem_available_minus_cma_avg"][-1] == body["mem_available_minus_cma_min"][-1] == usable


async def test_the_rules_card_shows_a_predictive_rules_floor_not_its_arming_gate_as_the_condition(
    daemon: Daemon,
) -> None:
    """The default predictive rule's ``when`` (usable < 16GiB) only arms the projection; shown alone it read as
    a stop at 16 GiB. The card says what stops: the projected crossing of its floor."""
    async with _client(daemon) as c:
        card = (await c.get("/ui/rules")).text
    assert (
        "usable projected to cross 4.0 GiB within the time a stop takes (watching while usable &lt; 16GiB)" in card
    ), card
    assert "usable &lt; 6GiB</p>" in card or "usable &lt; 6GiB<" in card  # a threshold rule: its condition as is


async def test_a_trip_keeps_its_rules_stop_lines_and_the_incident_chart_draws_them(tmp_path: Path) -> None:
    """The incident page's chart shows the lines the tripped rule had at the trip (the configuration may
    have changed since): the trip event records them; the incident JSON and the page's chart carry them."""
    import html
    import json

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n")
    rule = {"name": "low", "when": ["usable < 6GiB", "MemFree < 2GiB"], "samples": 1}
    d = await _daemon(tmp_path, proc_root=str(proc), rules=[rule])
    try:
        (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 4194304 kB\n")
        result = d._tick_once()
        assert result is not None
        await d._handle(result)
        [trip] = [e for e in d.recent_events if e["kind"] == "trip"]
        lines = [
            {"field": "mem_available_minus_cma", "label": "usable", "value": 6 * 2**30},
            {"field": "mem_free", "label": "MemFree", "value": 2 * 2**30},
        ]
        assert trip["details"]["stop_lines"] == lines
        assert d.store is not None and d.writer is not None
        await asyncio.to_thread(d.writer.flush)
        # the stop that followed (monitor-only stops nothing: the stop event is written as the supervisor would)
        d.store.add_event(kind="stopped", message="stopped", details={"source": "rule low"}, ts=time.time())
        for i in range(12):  # a near miss every 2 s before the trip: one row on the incident's timeline (helper-48)
            d.store.add_event(kind="near_miss", message=f"near miss {i}", ts=trip["ts"] - 30 + 2 * i)
        [stop] = d.store.events(kinds=["stopped"])
        async with _client(d) as c:
            data = (await c.get(f"/incidents/{stop['id']}.json")).json()
            page = (await c.get(f"/incidents/{stop['id']}")).text
            events = (await c.get("/events.json", params={"kind": "trip"})).json()
            events_page = (await c.get("/events", params={"kind": "trip"})).text
    finally:
        await d.shutdown("test")
    # the trip row links to the incident of the stop it led to, as the stop row does (note 10, B7)
    [trip_row] = [e for e in events["rows"] if e["kind"] == "trip"]
    assert trip_row["incident_id"] == stop["id"]
    assert f'<a href="/incidents/{stop["id"]}">incident</a>' in events_page
    assert data["rule"] == "low" and data["stop_lines"] == lines
    assert "stop_lines" not in data["values"] and data["values"]["usable"] == 4 * 2**30  # the card's figures
    m = re.search(r'id="incident-chart" class="chart" data-config="([^"]*)"', page)
    assert m and json.loads(html.unescape(m.group(1)))["lines"] == lines
    # the timeline folds the run and marks the trip's row (the page opens its box there: incident.js)
    tl = page.split('id="incident-timeline"')[1].split("</ol>")[0]
    assert tl.count("near_miss") == 1 and "12 × in 22 s</strong> — latest: near miss 11" in tl, tl
    trip_row = r'<li class="sev-critical" id="timeline-trip">.*?<span class="kind" title="trip">trip</span>'
    assert re.search(trip_row, tl), tl
    assert len([e for e in data["timeline"] if e["kind"] == "near_miss"]) == 12  # the JSON keeps every event


async def test_the_now_card_tells_usable_memory_gpu_and_watermark_truths(tmp_path: Path) -> None:
    """Truth in small things (issue 14 #9): usable memory beside MemAvailable where CMA exists, GPU
    readings or why there are none, watermark warnings; nothing unmeasured shows as 0."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(
        "MemTotal: 16777216 kB\nMemFree: 4194304 kB\nMemAvailable: 12582912 kB\nCmaFree: 2097152 kB\n"
    )
    d = await _daemon(
        tmp_path,
        proc_root=str(proc),
        # a floor above what this (scripted) host has when healthy: the loop guard warns at start
        rules=[
            {"name": "low_available", "when": ["MemAvailable < 13GiB"], "samples": 50},
            {"name": "early", "when": ["MemAvailable < 14GiB"], "action": "warn", "samples": 50},
        ],
    )
    try:
        async with _client(d) as c:
            for _ in range(100):  # the first NVML attempt runs in the GPU task
                if d.gpu:
                    break
                await asyncio.sleep(0.05)
            page = (await c.get("/")).text
        # usable = MemAvailable − CmaFree = 12 − 2 GiB
        assert re.search(r"usable \(MemAvailable − CmaFree\)</th><td class=\"num\">10\.00 GiB", page), page
        st = d.status_json()
        assert st.usable_bytes == 10 * 2**30
        # no NVML on this machine: the card says n/a and why, never a 0 % / 0 GiB reading
        assert st.gpu and not st.gpu[0].available
        assert f'GPU: <span class="muted">n/a ({st.gpu[0].reason})</span>' in page
        # healthy MemAvailable 12 GiB is below the rule's 13 GiB floor: the watermark warning is on the card
        assert st.watermark.warnings
        assert "Watermark: " in page and "cannot protect this host" in page
        # the warn rule's line already holds: a note, not a warning (doctor says the same as an OK line, helper-50)
        assert not [w for w in st.watermark.warnings if "rule early" in w]
        [note] = st.watermark.notes
        assert note.startswith("rule early: MemAvailable < 14GiB already holds on this healthy host"), note
        assert '<p class="small muted watermark-note">Floors: rule early: ' in page
    finally:
        await d.shutdown("test")  # writes the last status snapshot, which `sparkd status` reads
    from click.testing import CliRunner

    from sparkd.face.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    out = CliRunner().invoke(main, ["--config", str(cfg), "status"]).output
    assert "WATERMARK WARNING: rule low_available cannot protect this host" in out, out
    assert "floors: rule early: MemAvailable < 14GiB already holds" in out and "WARNING: rule early" not in out, out


def test_gpu_and_leak_lines_say_what_is_measured() -> None:
    from sparkd.face.presenters import gpu_line, leak_line
    from sparkd.loop.status import GpuStatus, LeakStatus

    gb10 = GpuStatus(
        index=0, name="NVIDIA GB10", utilization_pct=87.0, temperature_c=61.0, power_w=42.4, memory_supported=False
    )
    assert gpu_line(gb10) == {
        "level": "ok",
        "text": "NVIDIA GB10 · 87 % · 61 °C · 42 W · memory n/a (unified memory: not reported by NVML)",
    }
    h200 = GpuStatus(
        index=0,
        name="H200",
        utilization_pct=0.0,
        memory_used_bytes=2**30 * 3 // 5,
        memory_total_bytes=int(140.4 * 2**30),
        memory_supported=True,
    )
    assert gpu_line(h200)["text"] == "H200 · 0 % · 0.6 of 140.4 GiB"
    assert gpu_line(GpuStatus(index=None, available=False, reason="NVML init failed")) == {
        "level": "na",
        "text": "n/a (NVML init failed)",
    }

    base = dict(
        state="tracking",
        launch_id="L1",
        baseline_bytes=2**30,
        baseline_late=False,
        current_bytes=None,
        peak_bytes=None,
        growth_bytes=None,
        threshold_bytes=2 * 2**30,
        window_s=(120.0, 600.0),
        elapsed_s=700.0,
        alerts=0,
        last_alert_t=None,
    )

    class S:  # only the leak and gpu fields are read (no GPU reading: not known to lack the driver)
        def __init__(self, **kw: Any) -> None:
            self.leak = LeakStatus(**{**base, **kw})
            self.gpu: list[GpuStatus] = []

    assert leak_line(S()) is None  # type: ignore[arg-type]  # no growth figure yet: nothing to say
    assert leak_line(S(growth_bytes=2**29)) == {  # type: ignore[arg-type]
        "level": "ok",
        "text": "driver memory +0.50 GiB since warm-up (alert at +2.0 GiB)",
    }
    assert leak_line(S(growth_bytes=3 * 2**30, alerts=1)) == {  # type: ignore[arg-type]
        "level": "warn",
        "text": "driver memory +3.00 GiB since warm-up (alert at +2.0 GiB); 1 alert",
    }


async def test_a_rule_that_can_never_fire_is_said_at_start(tmp_path: Path) -> None:
    d = await _daemon(
        tmp_path,
        rules=[
            {"name": "never", "when": ["MemAvailable < 0GiB"]},
            {"name": "band", "when": ["MemAvailable < 2GiB", "MemAvailable > 6GiB"]},
            {"name": "fine", "when": ["MemAvailable < 6GiB"]},
        ],
    )
    try:
        said = {e["details"]["rule"]: e["message"] for e in d.recent_events if e["kind"] == "rule_never_fires"}
        assert set(said) == {"never", "band"}  # the guard runs; the two rules that guard nothing are named
        assert said["never"] == (
            "rule never can never fire: 'MemAvailable < 0GiB' can never hold: MemAvailable is never below 0; "
            "it guards nothing"
        )
        assert "never hold together" in said["band"]
        assert d.guard is not None and [r.name for r in d.guard.rules] == ["never", "band", "fine"]
    finally:
        await d.shutdown("test")


async def test_rules_on_the_kernel_log_are_said_when_it_is_off(tmp_path: Path) -> None:
    """``kernlog_source = "off"``: a rule on nvrm_recent read 0/1 and "no driver errors", with no event, blind
    sensor or doctor word (helper-45). The rule that needs it alone never fires, and is said to; one with other
    evidence fires on that (an "off" kernel log is the operator's setting, not a sensor lost: no ``sensor_blind``)."""
    d = await _daemon(
        tmp_path,
        rules=[
            {"name": "nvrm_only", "when": ["nvrm_recent > 5"]},
            {"name": "either", "when": ["MemFree < 2GiB"], "evidence": ["nvrm_recent > 0", "usable < 3GiB"]},
        ],
    )
    try:
        said = {e["details"]["rule"]: e["message"] for e in d.recent_events if e["kind"] == "rule_never_fires"}
        assert set(said) == {"nvrm_only"} and "nvrm_recent is not read" in said["nvrm_only"], said
    finally:
        await d.shutdown("test")


def test_jinja2_and_prometheus_client_are_imported_at_the_first_page_and_scrape_only(tmp_path: Path) -> None:
    """A daemon whose dashboard nobody opens and nobody scrapes does not hold them (issue 18: ~2.7 MiB)."""
    import subprocess
    import sys

    code = f"""
import asyncio, sys, httpx
from sparkd.config import load_settings
from sparkd.face.app import create_app
from sparkd.face.auth import ensure_token
from sparkd.loop.daemon import Daemon

async def main():
    s = load_settings(overrides={{"state_dir": {str(tmp_path / "state")!r}, "kernlog_source": "off"}})
    d = Daemon(s, serve_api=False, app_factory=create_app)
    await d.startup()
    app = create_app(d)
    mods = lambda: ("jinja2" in sys.modules, "prometheus_client" in sys.modules)
    out = [mods()]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8741") as c:
        auth = {{"Authorization": "Bearer " + ensure_token(s.token_file)}}
        assert (await c.get("/api/status", headers=auth)).status_code == 200
        out.append(mods())
        assert (await c.get("/login")).status_code == 200
        out.append(mods())
        r = await c.get("/metrics", headers=auth)
        assert r.status_code == 200 and "sparkd_memory_MemAvailable_bytes" in r.text
        out.append(mods())
    await d.shutdown("test")
    print(out)

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str([(False, False), (False, False), (True, False), (True, True)]), (
        out.stdout
    )


def test_a_write_that_lands_during_an_empty_events_read_is_read_at_the_next_poll() -> None:
    """The live list skips "events after N" while nothing can have arrived; the key is taken before the
    read, so an event the writer stores while the read runs is not marked as seen (CI saw it missed)."""
    from types import SimpleNamespace

    from sparkd.face.live import EventsSeen

    writer = SimpleNamespace(written=5)
    daemon: Any = SimpleNamespace(recent_events=[{"id": None}], writer=writer)
    seen = EventsSeen(daemon)
    asked = seen.key(7)
    writer.written += 1  # the writer stores a batch (with the new event) while the read runs
    seen.answered(asked, [])  # that read found nothing
    assert not seen.nothing_after(7)  # so the next poll reads again
    seen.answered(seen.key(7), [])
    assert seen.nothing_after(7)  # nothing since: skipped


async def test_the_stop_and_restart_confirmations_say_the_configured_grace(tmp_path: Path) -> None:
    """The confirmations said "gets 30 s to exit" whatever ``container.stop_timeout_s`` was (helper-35: 2 s)."""
    d = await _daemon(tmp_path, actions=FakeActions(), container={"image": "x", "stop_timeout_s": 2.0})
    try:
        async with _client(d) as c:
            page = (await c.get("/")).text
    finally:
        await d.shutdown("test")
    assert "Stop the model container? It gets 2 s to exit, then it is killed" in page
    assert "It drains, gets 2 s to exit, and relaunches" in page
    assert "30 s to exit" not in page


async def test_in_guard_mode_the_page_shows_no_resize_form_with_the_configs_defaults(tmp_path: Path) -> None:
    """Guard mode: the resize form showed max_model_len 262144 and max_num_seqs 4 (the config's defaults) for a
    container started with 32768, only its button disabled (helper-39). The page says why there is nothing to
    resize instead; a managed page keeps the form. A real supervisor in guard mode on a container that is absent."""
    from sparkd.loop.supervisor import Supervisor

    guard = {"guard": "sparkd-test-absent-guarded"}
    sup = Supervisor(load_settings(overrides={"state_dir": str(tmp_path / "state"), "container": guard}))
    d = await _daemon(tmp_path, actions=sup, container=guard)
    try:
        assert d.status_json().container.mode == "guard"
        async with _client(d) as c:
            await _login(c, d)
            page = (await c.get("/")).text
    finally:
        await d.shutdown("test")
    assert 'id="resize-guard"' in page and "Guard mode: sparkd did not launch this container" in page
    assert 'id="resize-form"' not in page and "262144" not in page
    page = await _logged_in_page(await _daemon(tmp_path / "m", actions=FakeActions()))
    assert 'id="resize-form"' in page and 'id="resize-guard"' not in page
    # monitor-only: no container and no plan, and the form with the config's defaults and a dead button was shown
    page = await _logged_in_page(await _daemon(tmp_path / "mo", monitor_only=True))
    assert 'id="resize-monitor-only"' in page and "Monitor-only: sparkd runs no container here" in page
    assert 'id="resize-form"' not in page and "262144" not in page


async def _logged_in_page(d: Daemon) -> str:
    """The dashboard page a logged-in operator gets from ``d``; the daemon is shut down after."""
    try:
        async with _client(d) as c:
            await _login(c, d)
            return (await c.get("/")).text
    finally:
        await d.shutdown("test")


def test_a_hard_floor_kill_reads_once_in_the_stopped_card() -> None:
    """``outcome`` already says "killed (hard floor)"; the card added " (hard floor)" again (helper-35)."""
    from sparkd.face.web import templates

    tpl = templates().env.get_template("partials/_stopped.html")
    stopped = {
        "outcome": "killed (hard floor)",
        "hard_floor_kill": True,
        "rule": "repeated_dips",
        "kind": "rule",
        "ts": 1_796_000_000.0,
        "values": {},
        "url": "/incidents/1",
    }
    html = tpl.render(stopped=stopped, btn={"start": True}, csrf="", logged_in=True)
    assert "killed (hard floor)" in html and "(hard floor) (hard floor)" not in html


async def test_the_monitor_only_card_keeps_a_settings_name_as_written(tmp_path: Path) -> None:
    """The card read "Monitor-only. Monitor_only = true.", the setting's name capitalised (helper-50)."""
    from sparkd.loop.daemon import MonitorOnly

    d = await _daemon(tmp_path, actions=MonitorOnly("monitor_only = true"), monitor_only=True)
    try:
        async with _client(d) as c:
            card = (await c.get("/ui/container")).text
    finally:
        await d.shutdown("test")
    assert "Monitor_only" not in card and "monitor_only = true" in card, card


async def test_a_blind_guard_and_a_database_that_records_nothing_are_never_ok_on_the_page(tmp_path: Path) -> None:
    """/proc/meminfo read empty: the headline read grey "unknown", "No memory stop line — no stop rule has a memory
    size line", while no rule could stop anything; and a full disk left it green "ok", the only word two events
    deep (helper-55). A real daemon over a /proc the test owns; the keeper told the store failed, as on a full disk."""
    from sparkd.face import presenters as views

    proc = tmp_path / "proc"
    proc.mkdir()
    meminfo = proc / "meminfo"
    meminfo.write_text("MemTotal: 134217728 kB\nMemFree: 100663296 kB\nMemAvailable: 117440512 kB\n")
    d = await _daemon(tmp_path, proc_root=str(proc))
    try:
        async with _client(d) as c:
            ok = (await c.get("/ui/live.json", params={"ev": 0})).json()
            assert ok["level"] == "ok", ok["label"]
            d.db.lost("database or disk is full", d.mono(), at_once=False)  # the store failed in use
            full = (await c.get("/ui/live.json", params={"ev": 0})).json()
            assert (full["level"], full["label"]) == ("warn", views.NOT_RECORDING_LABEL), full
            with open(meminfo, "r+") as f:  # emptied in place: the reader's open file reads nothing
                f.truncate(0)
            result = d._tick_once()
            if result is not None:
                await d._handle(result)
            blind = (await c.get("/ui/live.json", params={"ev": 0})).json()
            page = (await c.get("/")).text
        assert blind["level"] == "critical" and blind["label"].startswith("BLIND: no stop rule can evaluate ("), blind
        assert "Blind: no stop rule can read what it judges" in page and "No memory stop line" not in page
    finally:
        await d.shutdown("test")
