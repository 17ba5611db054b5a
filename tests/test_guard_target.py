"""Guard mode with a ``container.guard`` that names no container (a typo, or docker compose's ``<project>-<service>-1``
naming): sparkd guarded nothing and said nothing. ``/api/status`` read state ``none`` with no event, the headline and
the tab's title "ok", ``sparkd status`` "sparkd stops it on a trip", and each trip only "nothing to stop".

A real ``Supervisor`` (its real step, ``_attach``, status and presenters, the real templates and CLI) with the Docker
manager stubbed at the edge: ``docker inspect`` of the guarded name answers "no such container" on cue. The real
engine's lookup is ``ContainerManager.guard`` → ``get`` (NotFound), as ``test_api``'s absent guarded container uses."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_status import status_cli_output

from sparkd.act.containerspec import ContainerInfo
from sparkd.act.docker import guard_matches
from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState
from sparkd.errors import DockerUnavailable, NotFound
from sparkd.face import presenters as views
from sparkd.face.live import live_parts, page_context
from sparkd.face.web import templates
from sparkd.loop import daemon_view
from sparkd.loop.daemon import Daemon
from sparkd.loop.status import Status
from sparkd.loop.supervisor import Supervisor
from sparkd.ops.doctor import DoctorContext, check_guard_target, format_report

pytestmark = pytest.mark.anyio

NAME = "h40-vllm-typo"
CID = "e" * 64


def _info(status: str) -> ContainerInfo:
    return ContainerInfo(CID, NAME, "vllm/vllm-openai:v1", status, {}, False, None, None, None, time.time(), None)


class Manager:
    """The engine answers; ``docker inspect NAME`` finds ``self.found`` (None: no such container)."""

    def __init__(self) -> None:
        self.found: ContainerInfo | None = None
        self.guard_calls = 0
        self.running: list[tuple[str, str, str]] = []
        self.listed = 0

    def ping(self) -> bool:
        return True

    def guard(self, name: str) -> ContainerInfo | None:
        assert name == NAME
        self.guard_calls += 1
        return self.found

    def adopt(self) -> ContainerInfo | None:  # managed mode: none of sparkd's runs
        return None

    def get(self, name: str) -> ContainerInfo:
        raise NotFound(f"no container {name}")

    def running_managed(self) -> list[tuple[str, str, str]]:
        return []

    def running_containers(self) -> list[tuple[str, str, str]]:  # ``docker ps``: what runs under other names
        self.listed += 1
        return self.running


class Events(list[dict[str, Any]]):
    """What the supervisor hands its daemon (``Daemon.event``), kept in order."""

    def __bool__(self) -> bool:  # the supervisor says events only with a daemon
        return True

    def event(self, kind: str, message: str, **kw: Any) -> None:
        self.append({"kind": kind, "message": message, **kw})


def _sup(tmp_path: Path, container: dict[str, Any]) -> tuple[Supervisor, Manager, Events]:
    m = Manager()
    sup = Supervisor(load_settings(overrides={"state_dir": str(tmp_path), "container": container}), manager=m)  # type: ignore[arg-type]
    events = Events()
    sup.daemon = events  # type: ignore[assignment]
    return sup, m, events


async def _base(tmp_path: Path) -> Status:
    """A host's status (a real daemon sampling this machine's /proc), monitor-only; the container side is put in."""
    settings = load_settings(overrides={"state_dir": str(tmp_path / "state"), "kernlog_source": "off"})
    d = Daemon(settings, serve_api=False)
    await d.startup()
    try:
        for _ in range(2):
            result = d._tick_once()
            assert result is not None
            await d._handle(result)
        return d.status_json()
    finally:
        await d.shutdown("test")


def _calm(st: Status) -> Status:
    """The headline as on a host far above every stop line (this machine's memory may be anything)."""
    ns = st.nearest_stop
    return st if ns is None else st.model_copy(update={"nearest_stop": ns.model_copy(update={"level": "ok"})})


def _card(st: Status) -> str:
    ctx = page_context(live_parts(st, None, True, 30.0))
    return templates().env.get_template("partials/_container.html").render(**ctx, csrf="x", logged_in=True)


async def test_a_guard_name_that_matches_no_container_is_said_everywhere_and_its_appearance_too(
    tmp_path: Path,
) -> None:
    sup, m, events = _sup(tmp_path / "sup", {"guard": NAME})
    await sup._step()
    await sup._step()
    assert m.guard_calls >= 2
    missing = [e for e in events if e["kind"] == "guard_target_missing"]
    assert len(missing) == 1, events  # once, not at every step
    assert missing[0]["severity"] == "critical"  # sent by notify.severities' default ["critical"]
    assert f"no container named {NAME!r}" in missing[0]["message"] and "docker ps -a" in missing[0]["message"]
    assert "nothing is guarded" in missing[0]["message"]
    cs = sup.status_json()
    assert cs.state is ContainerState.NONE and cs.guard_missing_since is not None

    base = _calm(await _base(tmp_path))
    st = base.model_copy(update={"container": cs, "ts": time.time()})
    h = views.headline(st.model_dump(mode="json"), None)
    # critical, as its event and managed mode's "not guarded" are: it read amber under a calm headroom (helper-44)
    assert h["level"] == "critical" and h["label"] == f"guard mode: no container named {NAME} — nothing guarded", h
    assert views.container_from_status(st)["level"] == "critical"
    html = _card(st)
    assert "<strong>Nothing guarded.</strong> No container is named" in html and NAME in html
    # Start's title said "start it yourself (docker start NAME)": a command that fails, there is no such container
    start_why = views.buttons_view(st.model_dump(mode="json"), True)["start_why"]
    assert (
        start_why == f"guard mode: no container named {NAME}; set container.guard to the model's container (docker ps)"
    )

    # the engine down: what was last seen of the name is not told as news; the engine's trouble is
    down = st.model_copy(update={"container": cs.model_copy(update={"engine": "down"})})
    assert views.headline(down.model_dump(mode="json"), None)["label"] == views.ENGINE_DOWN_LABEL
    assert "Nothing guarded" not in _card(down)

    # `sparkd status` from the stored snapshot, as an operator runs it
    out = status_cli_output(tmp_path, st)
    assert "NOTHING GUARDED since " in out and f"no container named {NAME} (`docker ps -a`" in out, out
    assert f"container: not found: {NAME}" in out, out  # "container: none NAME" read as a name (helper-44)

    # the container appears (created, not started): said, and no longer a fault
    m.found = _info("exited")
    await sup._step()
    assert [e["kind"] for e in events if e["kind"].startswith("guard_target")] == [
        "guard_target_missing",
        "guard_target_found",
    ]
    assert sup.status_json().guard_missing_since is None
    st = base.model_copy(update={"container": sup.status_json()})
    assert "nothing guarded" not in views.headline(st.model_dump(mode="json"), None)["label"]
    assert "Nothing guarded" not in _card(st)

    # removed again (docker rm, --rm, compose down): said once more, a warning (container_gone says the removal)
    m.found = None
    await sup._step()
    again = [e for e in events if e["kind"] == "guard_target_missing"]
    assert len(again) == 2 and again[1]["severity"] == "warning" and "removed" in again[1]["message"]


async def test_the_running_containers_that_may_be_the_model_meant_are_named_and_the_mode_row_says_nothing_is_guarded(
    tmp_path: Path,
) -> None:
    """Note 18 §7: beside "NOTHING GUARDED" the mode row still read "sparkd stops it on a trip", and nothing named the
    container that runs the model under another name (docker compose's ``<project>-<service>-1``)."""
    sup, m, events = _sup(tmp_path / "sup", {"guard": NAME})
    compose = f"proj-{NAME}-1"
    m.running = [("f" * 64, compose, "vllm/vllm-openai:v1"), ("a" * 64, "postgres", "postgres:16")]
    await sup._step()
    await sup._step()
    assert m.listed == 1  # one `docker ps` per GUARD_CANDIDATES_EVERY_S, not one a step
    [missing] = [e for e in events if e["kind"] == "guard_target_missing"]
    assert missing["message"].endswith(f"; running now: {compose} (vllm/vllm-openai:v1)"), missing
    assert missing["details"]["candidates"] == [f"{compose} (vllm/vllm-openai:v1)"]
    cs = sup.status_json()
    assert cs.guard_candidates == [f"{compose} (vllm/vllm-openai:v1)"]

    st = _calm(await _base(tmp_path)).model_copy(update={"container": cs, "ts": time.time()})
    h = views.headline(st.model_dump(mode="json"), None)
    assert h["label"] == f"guard mode: no container named {NAME} — nothing guarded; running: {compose}", h
    card = views.container_from_status(st)
    assert card["mode_text"].startswith(f"guard: no container named {NAME} to guard, so a trip has nothing to stop")
    html = _card(st)
    assert f"<code>{compose} (vllm/vllm-openai:v1)</code>" in html and "stops it on a trip" not in html
    out = status_cli_output(tmp_path, st)
    assert f"mode: guard: no container named {NAME} to guard" in out and "stops it on a trip" not in out, out
    assert f"running now: {compose} (vllm/vllm-openai:v1)" in out
    assert f"guard mode: no container named {NAME}" == daemon_view._idle_why(cs)

    # found (created, not started): the candidates are no longer said, and the mode row is guard mode's own again
    m.found = _info("exited")
    await sup._step()
    cs = sup.status_json()
    assert cs.guard_candidates == [] and cs.guard_missing_since is None
    st = st.model_copy(update={"container": cs})
    assert views.container_from_status(st)["mode_text"] == views.MODE_TEXT["guard"]
    assert daemon_view._idle_why(cs) == "the model is not running"


async def test_a_guarded_container_that_exists_stopped_and_managed_mode_before_its_launch_are_no_fault(
    tmp_path: Path,
) -> None:
    sup, m, events = _sup(tmp_path / "g", {"guard": NAME})
    m.found = _info("exited")  # guard mode: a container stopped by hand is normal
    await sup._step()
    assert not [e for e in events if e["kind"].startswith("guard_target")] and sup.guard_missing_since is None
    # a renamed container still watched by its id: the name matches nothing, and it is still guarded
    sup.container_id, sup.state = CID, ContainerState.READY
    m.found = None
    sup._note_guard_target(False)
    assert sup.guard_missing_since is None
    managed, _, mevents = _sup(tmp_path / "m", {"image": "img:1", "name": NAME, "autostart": False})
    await managed._step()
    assert managed.status_json().guard_missing_since is None and not [
        e for e in mevents if e["kind"].startswith("guard_target")
    ]


def test_doctor_fails_when_the_guard_name_matches_no_container_and_only_when_docker_answers() -> None:
    def lookup(status: str | None, policy: str | None = "no") -> Any:
        return lambda name: None if status is None else (status, policy)

    def running() -> list[tuple[str, str, str]]:
        return [("f" * 64, f"proj-{NAME}-1", "vllm/vllm-openai:v1")]

    [c] = check_guard_target(DoctorContext(guard_name=NAME, container_status=lookup(None), running_containers=running))
    assert c.status == "FAIL" and c.title == "Guarded container" and "matches no container" in c.detail
    assert c.detail.endswith(f"sparkd guards nothing; running now: proj-{NAME}-1 (vllm/vllm-openai:v1)"), c.detail
    assert "docker ps -a" in c.detail and "<project>-<service>-1" in c.action
    assert "→ set container.guard" in format_report([c])
    [ok] = check_guard_target(DoctorContext(guard_name=NAME, container_status=lookup("exited")))
    assert ok.status == "OK" and ok.detail == f"{NAME}: exited (restart policy no)"
    # `always` starts it again after sparkd's stop when dockerd restarts (helper-43); unless-stopped keeps the stop
    [w] = check_guard_target(DoctorContext(guard_name=NAME, container_status=lookup("running", "always")))
    assert w.status == "WARN" and "restart policy is 'always'" in w.detail and "unless-stopped" in w.action
    for kept in ("unless-stopped", "on-failure", None):
        [k] = check_guard_target(DoctorContext(guard_name=NAME, container_status=lookup("running", kept)))
        assert k.status == "OK", (kept, k)

    def down(name: str) -> tuple[str, str | None] | None:
        raise DockerUnavailable("no engine")

    assert check_guard_target(DoctorContext(guard_name=NAME, container_status=down)) == []
    assert check_guard_target(DoctorContext(guard_name=None, container_status=lookup(None))) == []


@pytest.mark.parametrize(
    ("guard", "name", "cid", "meant"),
    [
        ("vllm", "vllm", "b200" + "f" * 60, True),
        ("/vllm", "vllm", "b200" + "f" * 60, True),
        ("b200", "postgres", "b200" + "f" * 60, False),  # Docker's id-prefix fallback: not the container meant
        ("cafe", "db", "cafe" * 16, False),
        ("b200ffffffff", "postgres", "b200" + "f" * 60, True),  # 12 hex digits: an id, as `docker ps` prints it
        ("b200ffffffff", "postgres", "c" * 64, False),
    ],
)
def test_a_guard_name_takes_only_the_container_it_names(guard: str, name: str, cid: str, meant: bool) -> None:
    """``ContainerManager.guard`` asks the engine for ``/containers/{guard}/json``, which falls back to a unique id
    prefix: ``container.guard = "b200"`` with its container gone adopted, and permitted the stop of, an unrelated
    container whose id began so (helper-43). The real engine's lookup: ``test_container.py``."""
    assert guard_matches(guard, name, cid) is meant


async def test_a_trip_with_nothing_guarded_is_critical_and_names_the_running_candidate(tmp_path: Path) -> None:
    """Guard mode with a wrong name while the model runs under compose's name: a trip read "the model is none:
    nothing to stop unless Docker says otherwise", a warning (collapsed notifications, a thin dashed mark, counted
    "with the model down"), naming nothing (helper-44). The container side is the supervisor's status as
    ``test_the_running_containers…`` shows it built; the daemon's trip path is real."""
    from test_daemon import _scripted, _serving, _started_then_tripped

    low = "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 2097152 kB\n"
    high = "MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n"
    rules = [{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 1}]
    proc, settings = _scripted(tmp_path, high, cooldown_s=0, rules=rules, recheck=False)
    actions = _serving("none")
    sup, m, _ = _sup(tmp_path / "sup", {"guard": NAME})
    m.running = [("f" * 64, f"proj-{NAME}-1", "vllm/vllm-openai:v1")]
    await sup._step()
    sup_status = sup.status_json()
    assert sup_status.guard_candidates
    actions.status_json = lambda: sup_status
    d, r = await _started_then_tripped(settings, actions, proc / "meminfo", low)
    try:
        await d._handle(r)
        [trip] = [e for e in d.recent_events if e["kind"] == "trip"]
        cs = d.status_json()
    finally:
        d.should_exit.set()
        await d.shutdown("test")
    assert trip["severity"] == "critical", trip
    assert (
        f"NOT stopped: nothing is guarded (guard mode: no container named {NAME}; running now: proj-{NAME}-1"
        in (trip["message"])
    ), trip["message"]
    assert "nothing to stop unless Docker" not in trip["message"] and trip["details"].get("nothing_guarded") is True
    assert "collapse_as" not in trip["details"]  # each one notified as the critical it is
    assert [r.idle_trips for r in cs.rules if r.name == "low_available"] == [0]


async def test_monitor_only_with_a_guarded_container_configured_says_that_container_is_not_guarded(
    tmp_path: Path,
) -> None:
    """``monitor_only = true`` beside ``container.guard`` (or a leftover ``SPARKD_MONITOR_ONLY``): the named container
    ran unguarded, the status said only "monitor-only — monitor_only = true" and named no container, the card was
    amber and no event said so (helper-45)."""
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "kernlog_source": "off",
            "monitor_only": True,
            "container": {"guard": NAME},
        }
    )
    from sparkd.loop.daemon import make_actions

    d = Daemon(settings, actions=make_actions(settings), serve_api=False)  # as `sparkd run` makes it
    await d.startup()
    try:
        result = d._tick_once()
        assert result is not None
        await d._handle(result)
        said = [e for e in d.recent_events if e["kind"] == "monitor_only_ignores_container"]
        st = _calm(d.status_json())
    finally:
        await d.shutdown("test")
    assert [e["severity"] for e in said] == ["critical"]
    assert f"monitor_only = true: {NAME}, which the configuration names" in said[0]["message"]
    assert "is NOT guarded: sparkd never stops it on a trip" in said[0]["message"]
    assert st.container.mode == "monitor-only" and st.container.ignored == NAME
    h = views.headline(st.model_dump(mode="json"), None)
    assert h["label"] == f"monitor-only: {NAME} is NOT guarded (monitor_only = true)" and h["level"] == "critical", h
    assert views.container_from_status(st)["level"] == "critical"
    assert f"<strong>{NAME} is NOT guarded.</strong>" in _card(st)
    out = status_cli_output(tmp_path, st)
    assert f"container: monitor-only — monitor_only = true — {NAME} is NOT GUARDED: sparkd never stops it" in out, out
    # monitor-only with no container configured names none, as before
    bare = load_settings(overrides={"state_dir": str(tmp_path / "b"), "monitor_only": True})
    plain = make_actions(bare)
    assert plain.status_json().ignored is None
