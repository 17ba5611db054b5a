"""The status contract (``sparkd.loop.status``): one typed ``Status`` from the daemon to every reader.

A real ``Daemon`` samples this machine's /proc into a real SQLite store; the app is
served over ASGI. The supervisor's resize runs for real (dry run: the budget formula
and /proc/meminfo, no Docker call). mypy runs on the typed fake.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import FakeActions
from pydantic import BaseModel, ValidationError

from sparkd.config import load_settings
from sparkd.core.budget import BudgetInputs, make_plan
from sparkd.core.lifecycle import ContainerState
from sparkd.core.sample import ROW_FIELDS
from sparkd.face import presenters as views
from sparkd.face.app import create_app
from sparkd.face.exporter import CONTAINER_STATES
from sparkd.loop.daemon import Daemon
from sparkd.loop.launch import plan_for
from sparkd.loop.status import (
    BudgetInputsFigures,
    ContainerStatus,
    PlanFigures,
    ResizeResult,
    RuleStatus,
    SampleRow,
    Status,
    diff_figures,
)
from sparkd.loop.supervisor import Supervisor
from sparkd.store.store import Store
from sparkd.units import GiB

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.anyio


async def _daemon(tmp_path: Path, actions: Any = None) -> Daemon:
    settings = load_settings(
        overrides={"state_dir": str(tmp_path / "state"), "kernlog_source": "off", "interval_s": 0.25}
    )
    d = Daemon(settings, actions=actions, serve_api=False)
    await d.startup()
    for _ in range(2):
        result = d._tick_once()
        assert result is not None
        await d._handle(result)
    return d


def _client(d: Daemon) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(d)), base_url="http://127.0.0.1:8741")


def _worked_example() -> BudgetInputs:
    # CONTEXT.md's worked example: GMU 0.786
    return BudgetInputs(
        mem_total_bytes=int(121.69 * GiB),
        max_model_len=262144,
        kv_bytes_per_token=29482,
        weights_gib=71.75,
        kv_cache_dtype="fp8",
        host_reserve_gib=26.0,
    )


# --------------------------------------------------------------------------- the API declares it
async def test_it_documents_every_status_field_in_openapi(tmp_path: Path) -> None:
    d = await _daemon(tmp_path)
    try:
        async with _client(d) as c:
            spec = (await c.get("/openapi.json")).json()
    finally:
        await d.shutdown("test")
    schemas = spec["components"]["schemas"]
    ok = spec["paths"]["/api/status"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/Status"}
    assert set(schemas["Status"]["properties"]) == set(Status.model_fields)
    assert set(schemas["ContainerStatus"]["properties"]) == set(ContainerStatus.model_fields)
    # the one set of container states, as an enum in the schema
    assert set(schemas["ContainerState"]["enum"]) == {s.value for s in ContainerState}
    assert set(schemas["RuleStatus"]["properties"]["kind"]["enum"]) == {"threshold", "predictive"}
    resize = spec["paths"]["/api/resize"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert resize == {"$ref": "#/components/schemas/ResizeResult"}
    req = spec["components"]["schemas"]["ResizeRequest"]["properties"]["kv_cache_dtype"]["anyOf"][0]
    assert set(req["enum"]) == {"auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"}


async def test_it_serves_exactly_the_contract(tmp_path: Path) -> None:
    d = await _daemon(tmp_path, actions=FakeActions())
    try:
        async with _client(d) as c:
            body = (await c.get("/api/status")).json()
    finally:
        await d.shutdown("test")
    st = Status.model_validate(body)  # extra keys or a wrong type would raise
    assert set(body) == set(Status.model_fields)
    assert st.container.state is ContainerState.READY
    assert st.plan is not None and st.plan.gmu == pytest.approx(0.786)
    assert st.sample is not None and st.sample.mem_total and st.sample.mem_total > 0


async def test_it_stores_the_same_contract_for_the_cli(tmp_path: Path) -> None:
    d = await _daemon(tmp_path)
    try:
        assert d.writer is not None
        taken = d.samples_taken
        d.writer.submit("status", d.status_json().model_dump(mode="json"))
        await asyncio.to_thread(d.writer.flush)
        assert d.store is not None
        stored = Status.model_validate(d.store.status_snapshot())
    finally:
        await d.shutdown("test")
    assert stored.container.mode == "monitor-only" and stored.container.state is ContainerState.NONE
    assert stored.samples_taken == taken > 0


# --------------------------------------------------------------------------- the models match their producers
def test_it_names_every_sample_column() -> None:
    assert tuple(SampleRow.model_fields) == ROW_FIELDS


def test_it_types_every_plan_figure() -> None:
    plan = make_plan(_worked_example())
    figures = PlanFigures.model_validate(plan.to_json())
    assert figures.gmu == pytest.approx(0.786)
    assert set(PlanFigures.model_fields) == set(plan.to_json())
    assert set(BudgetInputsFigures.model_fields) == set(plan.inputs.to_json())


def test_it_refuses_a_state_outside_the_one_set() -> None:
    # the exporter's old "running"/"created" and the supervisor's "unknown (engine down)" are gone
    for state in ("running", "created", "absent", "unknown (engine down)"):
        with pytest.raises(ValidationError, match="state"):
            ContainerStatus.model_validate({"mode": "guard", "state": state})
    with pytest.raises(ValidationError, match="restarts_total"):
        ContainerStatus.model_validate({"mode": "guard", "restarts_total": 3})  # a key nobody declared


def test_it_exports_a_label_for_every_state() -> None:
    # the same words as /api/status; how sparkd holds the container is sparkd_container_mode
    assert set(CONTAINER_STATES) == {s.value for s in ContainerState}


async def _status_with_fake_actions(tmp_path: Path) -> Status:
    """The status of a daemon whose container is ``FakeActions``' (ready), the daemon shut down."""
    d = await _daemon(tmp_path, actions=FakeActions())
    try:
        return d.status_json()
    finally:
        await d.shutdown("test")


def status_cli_output(tmp_path: Path, snap: Status, *events: dict[str, Any]) -> str:
    """``sparkd status``'s output as an operator runs it, from ``snap`` stored (and ``events``, ``Store.add_event``'s
    arguments, added) in the database of the state directory ``tmp_path / "state"``."""
    from click.testing import CliRunner

    from sparkd.face.cli import main

    store = Store.open(tmp_path / "state" / "sparkd.db")
    store.write_batch([("status", snap.model_dump(mode="json"))])
    for e in events:
        store.add_event(**e)
    store.close()
    cfg = tmp_path / "sparkd.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    return CliRunner().invoke(main, ["--config", str(cfg), "status"]).output


@pytest.mark.parametrize("state", list(ContainerState))
async def test_it_gives_every_state_a_level_on_the_container_card(tmp_path: Path, state: ContainerState) -> None:
    st = await _status_with_fake_actions(tmp_path)
    card = views.container_from_status(
        st.model_copy(update={"container": st.container.model_copy(update={"state": state})})
    )
    expected = {ContainerState.READY: "ok", ContainerState.EXITED: "critical", ContainerState.FAILED: "critical"}
    expected[ContainerState.UNKNOWN] = "critical"
    assert card["state"] == state.value
    assert card["level"] == expected.get(state, "warn")


async def test_a_stopped_model_is_not_critical_for_a_stop_that_cannot_come(tmp_path: Path) -> None:
    """The operator stopped the model; the tab read "sparkd · critical" and the headline "projected to reach the line
    in 16 s, sooner than a 30 s stop". With nothing running, the levels about a stop's timing are warn, the reason
    says why, and the headline's pill names the model's state."""
    from sparkd.core.rules import RuleState

    actions = FakeActions()
    d = await _daemon(tmp_path, actions=actions)
    try:
        assert d.guard is not None
        rule = next(r for r in d.guard.rules if r.action == "stop")
        d.guard.states[rule.name] = RuleState(counter=rule.samples)  # a stop rule about to trip
        running = d.status_json()
        actions.state = ContainerState.STOPPED
        stopped = d.status_json()
    finally:
        await d.shutdown("test")
    assert running.nearest_stop is not None and running.nearest_stop.level == "critical"
    assert stopped.nearest_stop is not None and stopped.nearest_stop.level == "warn"
    assert "nothing for a rule to stop" in stopped.nearest_stop.reason
    h = views.headline(stopped.model_dump(mode="json"), None)
    assert h["level"] == "warn" and h["label"] == "model stopped"
    assert views.headline(running.model_dump(mode="json"), None)["label"] == "critical"


async def test_a_guarded_run_that_never_answered_is_no_failed_launch_and_its_hold_says_guard_mode(
    tmp_path: Path,
) -> None:
    """Guard mode launches nothing: a guarded model stopped before it answered /health counted as a failed launch
    (status "failed_launches: 1" beside "No launches recorded"), and the decision read "container.auto_restart is
    off", as if turning it on would relaunch it (helper-39). The same end in managed mode still counts."""
    from sparkd.core.supervision import StopIntent

    guard = Supervisor(load_settings(overrides={"state_dir": str(tmp_path / "g"), "container": {"guard": "vllm"}}))
    for _ in range(3):
        d = await guard.unattended.after_down(StopIntent.EMERGENCY, uptime_s=2.0, reached_ready=False)
    assert (d.action, d.alert) == ("hold", False)
    assert d.reason == "intent emergency: guard mode, sparkd never starts the container", d.reason
    backoff = guard.status_json().supervision.backoff  # type: ignore[union-attr]
    assert backoff == {"failures": 0, "failed_launches": 0}, backoff
    managed = Supervisor(
        load_settings(overrides={"state_dir": str(tmp_path / "m"), "container": {"image": "x:1", "name": "vllm"}})
    )
    d = await managed.unattended.after_down(StopIntent.EMERGENCY, uptime_s=2.0, reached_ready=False)
    assert managed.status_json().supervision.backoff["failed_launches"] == 1  # type: ignore[union-attr]
    assert "auto_restart is off" in d.reason


async def test_an_unhealthy_model_is_never_ok_in_the_headline(tmp_path: Path) -> None:
    """/health failing (state ``unhealthy``): the container card said so, while the header's pill and the tab's
    title read "ok" (helper-39). Host memory calm: the headline is "warn", "model unhealthy"; ready again, "ok"."""
    actions = FakeActions()
    d = await _daemon(tmp_path, actions=actions)
    try:
        ready = d.status_json()
        actions.state = ContainerState.UNHEALTHY
        unhealthy = d.status_json()
    finally:
        await d.shutdown("test")
    h = views.headline(ready.model_dump(mode="json"), None)
    assert (h["level"], h["label"]) == ("ok", "ok"), h  # the same calm host, model ready
    h = views.headline(unhealthy.model_dump(mode="json"), None)
    assert (h["level"], h["label"]) == ("warn", "model unhealthy"), h


# --------------------------------------------------------------------------- one resize-diff shape
def test_it_diffs_figures_in_one_shape() -> None:
    old = make_plan(_worked_example()).to_json()
    new = make_plan(BudgetInputs(**{**_worked_example().__dict__, "host_reserve_gib": 28.0})).to_json()
    diff = diff_figures(old, new)
    assert diff["gmu"].old == pytest.approx(0.786) and diff["gmu"].new < 0.786
    assert "inputs" not in diff and "vllm_args" not in diff  # nested figures are left out
    assert "mem_total_gib" not in diff  # unchanged
    assert diff_figures(None, {"gmu": 0.5})["gmu"].model_dump() == {"old": None, "new": 0.5}


async def test_it_returns_the_typed_diff_from_the_real_supervisor(tmp_path: Path) -> None:
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "container": {"image": "sparkd-test-vllm:latest", "name": "sparkd-status-test"},
            # small enough for any test host: 1 GiB of weights, 4 GiB left to the host
            "budget": {
                "enabled": True,
                "weights_gib": 1.0,
                "overhead_gib": 0.5,
                "host_reserve_gib": 4.0,
                "kv_target_gib": 1.0,
                "max_model_len": 4096,
                "kv_bytes_per_token": 131072,  # a Llama-3.1-8B-shaped model (2 × 32 × 8 × 128 × 2 B)
            },
        }
    )
    sup = Supervisor(settings)
    mem_total = sup._mem_total()  # this host's MemTotal, read now
    plan = plan_for(settings, mem_total)
    assert plan is not None
    sup.plan_json = plan.to_json()
    out = await sup.resize({"host_reserve_gib": 5.0}, dry_run=True, source="test")
    assert isinstance(out, ResizeResult) and out.applied is False and out.dry_run is True
    assert out.previous is not None and out.previous.cap_gib == pytest.approx(plan.cap_gib)
    assert out.diff["cap_gib"].old == pytest.approx(plan.cap_gib)
    assert out.diff["cap_gib"].new == pytest.approx(plan.cap_gib - 1.0)
    assert sup.budget.host_reserve_gib == 4.0  # a dry run changes nothing


# --------------------------------------------------------------------------- a drifting fake is a type error
def _mypy(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-error-summary",
            "--cache-dir",
            str(REPO / ".mypy_cache"),
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def test_it_makes_a_drifting_fake_a_mypy_error(tmp_path: Path) -> None:
    good = _mypy(REPO / "tests" / "fakes.py")
    assert good.returncode == 0, good.stdout + good.stderr
    src = (REPO / "tests" / "fakes.py").read_text()
    assert "state=self.state," in src and 'health="ok",' in src
    drifts = {
        "old_state.py": src.replace("state=self.state,", 'state="running",'),
        "new_key.py": src.replace('health="ok",', 'health="ok",\n            healthy=True,'),
    }
    for name, text in drifts.items():
        (tmp_path / name).write_text(text)
        bad = _mypy(tmp_path / name)
        assert bad.returncode != 0, name
        assert f"{name}:" in bad.stdout, bad.stdout
    assert '"state"' in _mypy(tmp_path / "old_state.py").stdout
    assert '"healthy"' in _mypy(tmp_path / "new_key.py").stdout


# --------------------------------------------------------------------------- the CLI reads it typed
def test_it_ignores_a_snapshot_of_another_shape_saying_so(tmp_path: Path) -> None:
    cfg = tmp_path / "sparkd.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    store = Store.open(tmp_path / "sparkd.db")
    store.write_batch([("status", {"ts": 1.0, "container": {"state": "running"}})])
    store.close()
    out = subprocess.run(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(cfg), "status"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "ignoring the stored status snapshot" in out.stderr
    assert "no status snapshot yet" in out.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(cfg), "status", "--json"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        check=True,
    )
    assert json.loads(as_json.stdout)["container"] is None


def test_every_model_forbids_unknown_keys() -> None:
    import sparkd.loop.status as mod

    models = [v for v in vars(mod).values() if isinstance(v, type) and issubclass(v, BaseModel) and v is not BaseModel]
    assert len(models) > 10
    for m in models:
        assert m.model_config.get("extra") == "forbid", m.__name__


def test_the_cheap_lifecycle_state_is_the_status_state_in_every_state_and_with_the_engine_down(
    tmp_path: Path,
) -> None:
    # the daemon keys its stored snapshot on lifecycle_state() every second instead of building
    # status_json(): a state the cheap answer missed would leave `sparkd status` stale
    settings = load_settings(
        overrides={"state_dir": str(tmp_path), "container": {"image": "x:1", "name": "sparkd-lifecycle-key"}}
    )
    sup = Supervisor(settings)
    seen = set()
    for engine_up in (None, True, False):
        for state in ContainerState:
            sup.state, sup.engine_up = state, engine_up
            assert sup.lifecycle_state() == sup.status_json().state
            seen.add(sup.lifecycle_state())
    assert "unknown" in seen and len(seen) == len(ContainerState)
    from sparkd.loop.daemon import MonitorOnly

    mo = MonitorOnly()
    assert mo.lifecycle_state() == mo.status_json().mode == "monitor-only"


async def test_a_stop_handed_over_after_the_relaunchs_last_look_is_taken_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trip handed to a relaunch just after it last looked at the inbox (its new run ready): nothing took it,
    and the rule waited out its cooldown. The relaunch's end hands it to an ordinary emergency stop. (Docker at
    the edges is faked here; the handing over during a real start-up is tests/test_e2e_unattended.py's.)"""
    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": {"image": "x:1", "name": "s-inbox"}})
    sup = Supervisor(settings)
    stops: list[tuple[str, str]] = []

    async def emergency_stop(source: str, reason: str) -> None:
        stops.append((source, reason))

    async def launch_and_wait(source: str, *, since: float | None = None) -> tuple[bool, str | None]:
        sup.emergency_inbox = ("rule low_available", "usable 3.00 GiB < 6.00 GiB")  # after its last look
        return True, None

    monkeypatch.setattr(sup, "emergency_stop", emergency_stop)
    monkeypatch.setattr(sup, "_launch_and_wait", launch_and_wait)
    monkeypatch.setattr(sup, "running", lambda: False)
    assert await sup.relaunch_same_plan("maintenance by test") == (True, None)
    assert sup._bg is not None
    await sup._bg
    assert stops == [("rule low_available", "usable 3.00 GiB < 6.00 GiB")] and sup.emergency_inbox is None
    assert not sup.lock.locked()


async def test_the_cli_counts_the_containers_uptime_on_from_the_snapshots_time(tmp_path: Path) -> None:
    """The snapshot is written on a change or every STATUS_QUIET_S: ``sparkd status`` printed its uptime as stored,
    "up 12 s" three times over 15 s (note 11). It adds the snapshot's age."""
    import time

    snap = await _status_with_fake_actions(tmp_path)
    snap = snap.model_copy(
        update={"ts": time.time() - 600.0, "container": snap.container.model_copy(update={"uptime_s": 60.0})}
    )
    out = status_cli_output(tmp_path, snap)
    line = next(ln for ln in out.splitlines() if ln.startswith("container:"))
    assert ", up 11 min" in line, line  # 60 s at the snapshot + its 600 s of age


@pytest.mark.parametrize(
    ("result", "said"),
    [
        ({"rearmed_by": "api:cli", "was_open": True, "launch_id": "L1"}, "breaker re-armed by api:cli; launched L1"),
        (
            {"rearmed_by": "api:cli", "was_open": False},
            "the circuit breaker was not open: nothing to re-arm (relaunch back-off reset by api:cli)",
        ),
    ],
)
def test_a_rearm_says_whether_the_breaker_was_open(result: dict[str, Any], said: str) -> None:
    """``sparkd rearm`` on a closed breaker printed "breaker re-armed by api:token" (note 11)."""
    from sparkd.face.presenters import rearm_text

    assert rearm_text(result) == said


def test_samples_refuses_two_formats_and_events_says_when_there_is_none(tmp_path: Path) -> None:
    """``samples --json --csv`` gave JSON without a word; ``events --kind nonsense`` printed nothing (note 11)."""
    from click.testing import CliRunner

    from sparkd.face.cli import main

    cfg = tmp_path / "sparkd.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    Store.open(tmp_path / "sparkd.db", migrate=True).close()
    r = CliRunner().invoke(main, ["--config", str(cfg), "samples", "--json", "--csv"])
    assert r.exit_code == 2 and "--json and --csv: choose one" in r.output, r.output
    r = CliRunner().invoke(main, ["--config", str(cfg), "events", "--kind", "nonsense", "--since", "2h"])
    assert r.exit_code == 0 and r.stdout == "" and "no events of kind nonsense in the last 2h" in r.stderr, r.output


@pytest.mark.parametrize(
    ("name", "check", "line"),
    [
        ("decode", {"ok": True, "tok_s": 41.26, "min_tok_s": 5.0}, "  decode: ok 41.3 tok/s (at least 5)"),
        ("decode", {"ok": False, "tok_s": 0.0, "min_tok_s": 1e9}, "  decode: FAILED 0.0 tok/s (at least 1e+09)"),
        ("health", {"ok": False, "error": "HTTP 500"}, "  health: FAILED HTTP 500"),
        ("models", {"ok": True}, "  models: ok"),
    ],
)
def test_a_smoke_check_line_gives_the_decode_rate_and_the_error(name: str, check: dict[str, Any], line: str) -> None:
    from sparkd.face.cli.control import smoke_line

    assert smoke_line(name, check) == line


def test_a_duration_rule_is_shown_by_how_long_it_held_not_as_an_overrun_counter(tmp_path: Path) -> None:
    """A 15 s rule with at least 3 samples, counting 16 samples over 11 s: the card read "16/3" with a full bar,
    the CLI "16/3 (15 s)" (note 10, C1). Both say how long it held, and the bar is the lesser of the two."""
    from sparkd.face.presenters import rules_from_status

    base = {
        "kind": "threshold",
        "action": "stop",
        "when": ["MemAvailable < 8GiB"],
        "evidence": [],
        "thresholds": [],
        "floor_bytes": None,
    }
    rule = RuleStatus(name="held", samples=3, for_s=15.0, counter=16, held_s=11.0, **base)
    [card] = rules_from_status(Status.model_construct(rules=[rule]))
    assert card["progress_pct"] == pytest.approx(100 * 11 / 15) and card["held_s"] == 11.0
    assert card["level"] == "critical"  # past half of its time
    quiet = RuleStatus(name="n", samples=5, for_s=None, counter=1, **base)
    [card] = rules_from_status(Status.model_construct(rules=[quiet]))
    assert card["progress_pct"] == pytest.approx(20.0) and card["level"] == "warn"


@pytest.mark.parametrize("auto_restart", [False, True])
async def test_stay_stopped_says_whether_the_model_stays_down_after_an_emergency_stop(
    tmp_path: Path, auto_restart: bool
) -> None:
    """``container.stay_stopped`` read false after an emergency stop while the stop intent kept the model down
    (helper-35): the supervisor's own flag is cleared to give the relaunch decision its turn. It now says what an
    operator asks: down, and nothing of sparkd's brings it back (the decision was ``hold``); with auto_restart the
    decision schedules a relaunch, and it is false until that relaunch is cancelled."""
    from sparkd.core.supervision import StopIntent

    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "container": {"image": "x:1", "name": "s-stays", "auto_restart": auto_restart},
        }
    )
    sup = Supervisor(settings)
    sup.container_id, sup.state = "c" * 64, ContainerState.READY
    assert sup.status_json().stay_stopped is False  # running
    sup.state = ContainerState.STOPPED
    assert sup.status_json().stay_stopped is False  # stopped, but no intent holds it and nobody said "stay"
    d = await sup.unattended.after_down(StopIntent.EMERGENCY, uptime_s=600.0, reached_ready=True)
    try:
        assert d.action == ("relaunch" if auto_restart else "hold")
        assert sup.status_json().stay_stopped is (not auto_restart)
        for state in (ContainerState.UNKNOWN, ContainerState.RESTARTING):  # not known down (helper-36)
            sup.state = state
            assert sup.status_json().stay_stopped is False, state
        sup.state = ContainerState.STOPPED
        if auto_restart:
            sup.unattended.cancel_relaunch("an operator's stop")  # nothing brings it back now
            assert sup.status_json().stay_stopped is True
        async with sup.lock:  # an action under way (a start by hand): not "stays stopped"
            assert sup.status_json().stay_stopped is False
        await sup.unattended.clear_intent("api:cli")  # what an operator's start does: the intent is gone
        assert sup.status_json().stay_stopped is False
        sup.stay_stopped = True  # a stop by hand (`sparkd stop`)
        assert sup.status_json().stay_stopped is True
    finally:
        sup.unattended.cancel_relaunch("test end")


@pytest.mark.parametrize(
    ("kind", "details", "said"),
    [
        ("killed", {"outcome": "killed (hard floor)", "exit_code": 137}, ", killed (hard floor) (exit code 137) — "),
        ("stopped", {"outcome": "exited", "exit_code": 0}, ", exited (exit code 0) — "),
    ],
)
async def test_the_clis_stopped_by_line_says_how_the_stop_ended(
    tmp_path: Path, kind: str, details: dict[str, Any], said: str
) -> None:
    """``stopped by: emergency (rule …)`` hid that the hard floor killed the model (helper-35): the events and the
    dashboard's card said it. The line now ends with the stop's outcome, from the newest stop event when it is
    this stop's (at or after the intent); an older stop's outcome is not claimed for it."""
    import time

    from sparkd.core.supervision import StopIntent

    snap = await _status_with_fake_actions(tmp_path)
    settings = load_settings(overrides={"state_dir": str(tmp_path / "sup"), "container": {"image": "x:1", "name": "m"}})
    sup = Supervisor(settings)
    sup.container_id, sup.state = "c" * 64, ContainerState.STOPPED
    await sup.unattended.after_down(StopIntent.EMERGENCY, uptime_s=600.0, reached_ready=True)  # hold
    since = sup.unattended.state.intent.since  # type: ignore[union-attr]
    snap = snap.model_copy(update={"ts": time.time(), "container": sup.status_json()})
    stop = {"kind": kind, "message": "the stop", "details": details, "ts": since + 2.5}
    out = status_cli_output(tmp_path, snap, stop)
    line = next(ln for ln in out.splitlines() if ln.startswith("stopped by: "))
    assert said in line and line.endswith("stays stopped until `sparkd start`"), line
    snap.container.supervision.intent.since = since + 60.0  # type: ignore[union-attr]  # a newer intent: no outcome
    out = status_cli_output(tmp_path, snap)
    line = next(ln for ln in out.splitlines() if ln.startswith("stopped by: "))
    assert "exit code" not in line and " UTC — stays stopped" in line, line


def test_the_container_status_gives_the_ready_events_time_to_ready(tmp_path: Path) -> None:
    """``time_to_ready_s`` is the ``ready`` event's figure: from the launch's start to /health ready (the dashboard's
    restart confirmation says it; ready_at - started_at, Docker's start, read 0 s against the event's 1.5 s)."""
    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": {"image": "x:1", "name": "s-ready"}})
    sup = Supervisor(settings)
    sup.container_id, sup.state = "c" * 64, ContainerState.READY
    assert sup.status_json().time_to_ready_s is None  # not ready yet
    sup.launch_started_at, sup.container_started_at, sup.ready_at = 1000.0, 1001.1, 1001.5
    sup.ready_timed = True  # a launch of sparkd's (``_mark_ready``)
    assert sup.status_json().time_to_ready_s == pytest.approx(1.5)


async def test_the_clis_stopped_by_line_is_about_the_run_last_seen(tmp_path: Path) -> None:
    """helper-36: guard mode never clears a stop intent, so a guarded model started by hand after its emergency stop,
    then stopped again, showed the old intent with the old stop's "killed (hard floor)". An intent older than the run
    last seen is not shown; a stop event after the run's start is this run's, even before its intent (an operator's
    stop records its intent after its stop event, more than a second later on a loaded host)."""
    import time

    from click.testing import CliRunner

    from sparkd.core.supervision import StopIntent
    from sparkd.face.cli import main

    base = await _status_with_fake_actions(tmp_path)
    settings = load_settings(overrides={"state_dir": str(tmp_path / "sup"), "container": {"image": "x:1", "name": "m"}})
    sup = Supervisor(settings)
    sup.container_id, sup.state = "c" * 64, ContainerState.STOPPED
    await sup.unattended.set_intent(StopIntent.OPERATOR, "api:cli", "stop requested by api:cli")
    since = sup.unattended.state.intent.since  # type: ignore[union-attr]
    cfg = tmp_path / "sparkd.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    db = tmp_path / "state" / "sparkd.db"

    def status_line(run_started_at: float, stop_ts: float) -> str | None:
        sup.container_started_at = run_started_at
        snap = base.model_copy(update={"ts": time.time(), "container": sup.status_json()})
        store = Store.open(db)
        store.write_batch([("status", snap.model_dump(mode="json"))])
        store.add_event(kind="stopped", message="the stop", details={"outcome": "exited", "exit_code": 0}, ts=stop_ts)
        store.close()
        out = CliRunner().invoke(main, ["--config", str(cfg), "status"]).output
        return next((ln for ln in out.splitlines() if ln.startswith("stopped by: ")), None)

    # the operator's stop: its event 3 s before its intent, after the run's start: its outcome is said
    line = status_line(run_started_at=since - 600.0, stop_ts=since - 3.0)
    assert line is not None and ", exited (exit code 0) — stays stopped" in line, line
    assert sup.status_json().stay_stopped is True
    # the run last seen started after that intent (started by hand, then down again): neither the intent nor a stop
    # before it is this run's
    assert status_line(run_started_at=since + 60.0, stop_ts=since + 30.0) is None
    assert sup.status_json().stay_stopped is False


async def test_in_guard_mode_the_clis_stopped_by_line_points_to_docker_start(tmp_path: Path) -> None:
    """Guard mode: sparkd never starts the container and refuses `sparkd start`, yet the line said "stays stopped
    until `sparkd start`" (helper-37)."""
    import time

    from sparkd.core.supervision import StopIntent

    snap = await _status_with_fake_actions(tmp_path)
    settings = load_settings(overrides={"state_dir": str(tmp_path / "sup"), "container": {"guard": "vllm-prod"}})
    sup = Supervisor(settings)
    sup.container_id, sup.state, sup.name = "c" * 64, ContainerState.STOPPED, "vllm-prod"
    await sup.unattended.after_down(StopIntent.EMERGENCY, uptime_s=600.0, reached_ready=True)
    snap = snap.model_copy(update={"ts": time.time(), "container": sup.status_json()})
    assert snap.container.mode == "guard"
    out = status_cli_output(tmp_path, snap)
    line = next(ln for ln in out.splitlines() if ln.startswith("stopped by: "))
    assert line.endswith(
        "stays stopped until you start it (`docker start vllm-prod`: guard mode, sparkd does not start it)"
    )
    assert "sparkd start" not in line
    # which mode sparkd is in was said nowhere (helper-37)
    assert (
        "mode: guard: started outside sparkd (docker run, compose…); sparkd stops it on a trip or a failed "
        "completion probe and never starts it"
    ) in out


async def test_the_container_card_and_the_controls_say_which_mode_and_why_a_button_is_off_in_guard_mode(
    tmp_path: Path,
) -> None:
    """Guard mode: the dashboard showed Start, Restart and Resize disabled without a word, and said nowhere that
    sparkd does not launch this container (helper-37). The card's rows and the buttons' titles, rendered by the
    real templates from a real supervisor's status."""
    from sparkd.face.live import live_parts, page_context
    from sparkd.face.web import templates

    base = await _status_with_fake_actions(tmp_path)

    def rendered(sup: Supervisor, last_stop: dict[str, Any] | None = None, *, dry_run: bool = False) -> str:
        st = base.model_copy(update={"container": sup.status_json(), "dry_run": dry_run})
        ctx = page_context(live_parts(st, last_stop, True, 30.0))
        env = templates().env
        return "".join(
            env.get_template(f"partials/_{name}.html").render(**ctx, csrf="x", logged_in=True)
            for name in ("container", "buttons", "stopped")
        )

    guard = Supervisor(load_settings(overrides={"state_dir": str(tmp_path / "g"), "container": {"guard": "vllm"}}))
    guard.container_id, guard.state = "c" * 64, ContainerState.STOPPED
    html = rendered(guard)
    assert "<th>mode</th><td>guard: started outside sparkd (docker run, compose…); sparkd stops it on a trip" in html
    assert 'disabled title="guard mode: sparkd does not start it; start it yourself (docker start vllm)"' in html
    assert 'data-resize-why="guard mode: sparkd did not launch it, so it has no plan to resize"' in html
    assert "<th>breaker</th><td>– (guard mode: sparkd never relaunches it)</td>" in html  # helper-39
    assert 'title="guard mode: sparkd never relaunches it, there is no breaker to re-arm"' in html
    # the stopped card's "Start again" said title="None" in guard mode (helper-38)
    trip = {"by_guard": True, "kind": "stopped", "rule": "low_available", "ts": time.time(), "values": {}, "url": "/"}
    html = rendered(guard, trip)
    assert "Start again: guard mode: sparkd does not start it; start it yourself (docker start vllm)." in html
    assert 'title="None"' not in html
    # a dry run records a trip and stops nothing: the mode does not say "stops it on a trip" then (helper-38)
    html = rendered(guard, dry_run=True)
    assert "guard, dry run: started outside sparkd (docker run, compose…); a trip is recorded, not acted on" in html
    assert "stops it on a trip" not in html
    guard.state = ContainerState.READY
    html = rendered(guard)
    assert 'disabled title="guard mode: sparkd does not restart it; restart it yourself (docker restart vllm)"' in html
    assert 'disabled title="already running (ready)"' in html  # Start
    managed = Supervisor(
        load_settings(overrides={"state_dir": str(tmp_path / "m"), "container": {"image": "img:1", "name": "vllm"}})
    )
    managed.container_id, managed.state = "c" * 64, ContainerState.STOPPED
    html = rendered(managed)
    assert "<th>mode</th><td>managed: sparkd launches, restarts and resizes it" in html
    assert "guard mode" not in html and 'data-resize-why=""' in html
    assert "<th>breaker</th><td>closed (0/3 emergencies)</td>" in html


def test_a_run_first_seen_running_has_no_time_to_ready(tmp_path: Path) -> None:
    """A guarded model adopted after a restart of sparkd read "/health ready after 209.4 s" (its first answer after
    the adoption, counted from Docker's start; helper-37). Its start-up is not timed: the status says null, the
    restart confirmation says nothing of it; a launch record's figure is kept."""
    import time

    from sparkd.face.presenters import buttons_view

    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": {"guard": "vllm"}})
    sup = Supervisor(settings)
    sup.container_id, sup.state, sup.first_sight = "c" * 64, ContainerState.STARTING, True
    sup.launch_started_at = sup.container_started_at = time.time() - 209.0
    sup._mark_ready()
    st = sup.status_json()
    assert st.ready_at is not None and st.time_to_ready_s is None
    assert buttons_view({"container": st.model_dump(mode="json")}, True)["last_ready_s"] is None
    sup.first_sight = False  # a launch of sparkd's: timed
    sup.ready_at = None
    sup._mark_ready()
    assert sup.status_json().time_to_ready_s == pytest.approx(209.0, abs=1.0)


async def test_the_container_card_shows_the_intent_of_the_run_last_seen_only(tmp_path: Path) -> None:
    """The dashboard's container card showed "stop intent emergency [rule collapse_projected]" on a guarded model that
    ran again, started by hand after that stop (guard mode never clears the intent; helper-37)."""
    from sparkd.core.supervision import IntentRecord, StopIntent

    base = await _status_with_fake_actions(tmp_path)
    settings = load_settings(overrides={"state_dir": str(tmp_path / "sup"), "container": {"guard": "vllm"}})
    sup = Supervisor(settings)
    sup.container_id, sup.state, sup.container_started_at = "c" * 64, ContainerState.STOPPED, time.time() - 600.0
    await sup.unattended.after_down(StopIntent.EMERGENCY, uptime_s=600.0, reached_ready=True)
    sup.unattended.state.intent = IntentRecord(  # the trip's, a minute ago
        StopIntent.EMERGENCY, time.time() - 60.0, "rule collapse_projected", "collapse_projected: usable falling"
    )

    def card() -> dict[str, Any]:
        return views.container_from_status(base.model_copy(update={"container": sup.status_json()}))

    assert (card()["intent"], card()["intent_who"]) == ("emergency", "rule collapse_projected")  # why it is down
    sup.state, sup.container_started_at = ContainerState.READY, time.time() - 5.0  # started again by hand
    assert card()["intent"] is None and card()["intent_who"] is None
    sup.state = ContainerState.EXITED  # then `docker stop`: that stop is not the old intent's either
    assert card()["intent"] is None and sup.status_json().down_because() is None


async def test_sparkd_status_says_a_daemon_that_runs_and_records_nothing_is_running_not_gone(tmp_path: Path) -> None:
    """A daemon whose database records nothing (a full disk, a lock, a hung write) guards from memory: `sparkd
    status` read "sparkd NOT running (last snapshot 10 min ago)", and an operator restarted a working guard
    (helper-53). The state directory's lock names the live daemon."""
    import os

    from sparkd.loop.statelock import StateLock

    snap = await _status_with_fake_actions(tmp_path / "base")
    snap = snap.model_copy(update={"ts": time.time() - 600})  # the last snapshot the database took
    (tmp_path / "state").mkdir()
    lock = StateLock.acquire(tmp_path / "state")  # this process plays the live sparkd
    try:
        out = status_cli_output(tmp_path, snap)
    finally:
        lock.release()
    first = out.splitlines()[0]
    assert first.startswith(f"sparkd running (pid {os.getpid()}) but NOT RECORDING: its database shows nothing"), out
    assert "NOT running" not in first
    gone = status_cli_output(tmp_path, snap)  # no daemon holds it now
    assert gone.splitlines()[0].startswith("sparkd NOT running (last snapshot "), gone


def test_the_cli_reaches_the_daemon_on_the_address_it_listens_on() -> None:
    """`sparkd status --cluster` asked 127.0.0.1 whatever api.host said (helper-53); the control commands took an
    IPv6 address without brackets. One base for both."""
    from sparkd.config import load_settings
    from sparkd.face.cli.base import api_base

    def base(host: str) -> str:
        return api_base(load_settings(overrides={"api": {"host": host, "port": 8741, "allow_remote": True}}))

    assert base("127.0.0.1") == "http://127.0.0.1:8741"
    assert base("0.0.0.0") == "http://127.0.0.1:8741" and base("::") == "http://127.0.0.1:8741"
    assert base("192.168.100.2") == "http://192.168.100.2:8741"
    assert base("::1") == "http://[::1]:8741"


async def test_the_daemon_answers_every_look_at_its_state_directory_not_only_the_first_64(tmp_path: Path) -> None:
    """The state directory's socket was listened on and never accepted: from the 65th look of a daemon's lifetime
    its queue was full, and `sparkd stop` said "no sparkd runs", `sparkd status` "NOT running" (helper-54). A real
    daemon; the looks are the CLI's own (``daemon_pid``)."""
    import os

    from sparkd.loop.statelock import daemon_pid

    d = await _daemon(tmp_path, actions=FakeActions())
    try:
        state = Path(d.settings.state_dir)
        seen: list[int | None] = []
        for _ in range(4):  # 200 looks over the daemon's life, in bursts of 50 (the CLI's come seconds apart)
            seen += await asyncio.to_thread(lambda: [daemon_pid(state) for _ in range(50)])
            await asyncio.sleep(0.2)
        assert seen == [os.getpid()] * 200, [i for i, p in enumerate(seen) if p is None][:3]
    finally:
        await d.shutdown("test")
    assert daemon_pid(state) is None  # released at the exit


def test_sparkd_status_and_events_say_whether_a_daemon_runs_when_the_database_cannot_be_read(tmp_path: Path) -> None:
    """A database that cannot be read (a full disk, a corrupt file): `sparkd status` said only "cannot read the
    database" while the daemon guarded from memory, and `sparkd events` printed a traceback (helper-55)."""
    import os

    from click.testing import CliRunner

    from sparkd.face.cli import main
    from sparkd.loop.statelock import StateLock

    state = tmp_path / "state"
    state.mkdir()
    (state / "sparkd.db").write_bytes(b"this is not a database" * 100)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{state}"\n')
    lock = StateLock.acquire(state)  # this process plays the live sparkd
    try:
        for cmd in ("status", "events"):
            r = CliRunner().invoke(main, ["--config", str(cfg), cmd])
            assert r.exit_code != 0 and (r.exception is None or isinstance(r.exception, SystemExit)), r.exception
            assert "Traceback" not in r.output, r.output
            assert f"cannot read the database {state / 'sparkd.db'}: " in r.output, r.output
            assert f"sparkd runs (pid {os.getpid()}) and guards from memory" in r.output, r.output
    finally:
        lock.release()
    r = CliRunner().invoke(main, ["--config", str(cfg), "status"])
    assert "No sparkd runs with this state directory" in r.output, r.output
