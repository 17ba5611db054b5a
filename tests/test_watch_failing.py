"""An engine that answers its ping and refuses ``docker inspect`` (HTTP 500: containerd stuck) made every supervisor
step fail, said only in sparkd's log: the container's state stayed "ready" while exits, OOM kills, /health and the
completion probe went unobserved; and each trip's stop failed in its first look at the container, said as
``stop_not_executed`` while the model ran on below its line (helper-51).

Now the failing looks are said (``watch_failing``, critical, once; ``watch_recovered``), the status, headline, card
and ``sparkd status`` say the container is not watched, and an emergency stop goes on by the container's processes
(``act.procstop``), as with an engine that does not answer. A real ``Supervisor`` (its real loop and step) with the
Docker manager stubbed at the edge; the SDK's own 500 is translated by the real ``ContainerManager._call``. The real
stop by processes runs against real containers in ``test_e2e_supervision.py``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_guard_target import Events, _base, _calm, _card
from test_status import status_cli_output

from sparkd.act.containerspec import ContainerState as DockerState
from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState as S
from sparkd.errors import EngineRefused, Refused
from sparkd.face import presenters as views
from sparkd.loop.supervisor import WATCH_FAILURES_SAID, Supervisor

pytestmark = pytest.mark.anyio
CID = "e" * 64
REFUSED = "inspect container: Docker engine refused: 500 Server Error (containerd: context deadline exceeded)"


class Manager:
    """Answers its ping; ``docker inspect`` refuses while ``refusing``, else says the container runs."""

    def __init__(self) -> None:
        self.refusing = True
        self.inspects = 0
        self.started_at = time.time() - 3600

    def ping(self) -> bool:
        return True

    def state(self, cid: str) -> DockerState:
        self.inspects += 1
        if self.refusing:
            raise EngineRefused(REFUSED)
        return DockerState("running", True, None, False, self.started_at, None, 4242, None)


def _sup(tmp_path: Path) -> tuple[Supervisor, Manager, Events]:
    m = Manager()
    s = load_settings(overrides={"state_dir": str(tmp_path), "container": {"guard": "vllm", "health_interval_s": 0.2}})
    sup = Supervisor(s, manager=m)  # type: ignore[arg-type]
    events = Events()
    sup.daemon = events  # type: ignore[assignment]
    sup.container_id, sup.state, sup.engine_up, sup.first_steps_done = CID, S.READY, True, True
    sup.name = "vllm"
    sup.seen_started_at = sup.container_started_at = m.started_at
    sup._unguarded_checked = time.monotonic() + 3600  # no guarded-name lookups: the look at the container only
    sup.unattended.periodic = lambda: asyncio.sleep(0)  # type: ignore[method-assign]
    return sup, m, events


async def _until(pred: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_the_sdks_http_500_is_an_engine_refusal() -> None:
    """The real translation of docker-py's APIError (500) by ``ContainerManager._call``; a 409 stays a Conflict."""
    import docker.errors
    import requests

    from sparkd.act.docker import ContainerManager
    from sparkd.errors import Conflict

    def api_error(code: int) -> docker.errors.APIError:
        r = requests.Response()
        r.status_code = code
        return docker.errors.APIError("boom", response=r, explanation="containerd: context deadline exceeded")

    cm = ContainerManager()
    with pytest.raises(EngineRefused, match="inspect: Docker engine refused: containerd"), cm._call("inspect"):
        raise api_error(500)
    with pytest.raises(Conflict), cm._call("stop container"):
        raise api_error(409)


async def test_failing_looks_at_the_container_are_said_once_and_everywhere_and_their_end_too(tmp_path: Path) -> None:
    sup, m, events = _sup(tmp_path / "sup")
    task = asyncio.create_task(sup._loop())
    try:
        await _until(lambda: any(e["kind"] == "watch_failing" for e in events))
        n = m.inspects
        assert n >= WATCH_FAILURES_SAID
        await _until(lambda: m.inspects >= n + 5)  # more failing looks: said once, not at every step
        [failing] = [e for e in events if e["kind"] == "watch_failing"]
        assert failing["severity"] == "critical"
        assert failing["message"].startswith(
            f"sparkd cannot watch vllm: its last {WATCH_FAILURES_SAID} looks at the container failed"
        )
        assert REFUSED in failing["message"] and "the state shown (ready) may be stale" in failing["message"]
        cs = sup.status_json()
        assert cs.watch_error is not None and REFUSED in cs.watch_error

        base = _calm(await _base(tmp_path))
        st = base.model_copy(update={"container": cs, "ts": time.time()})
        h = views.headline(st.model_dump(mode="json"), None)
        assert (h["level"], h["label"]) == ("critical", views.WATCH_ERROR_LABEL), h  # it read "ok"
        assert views.container_from_status(st)["level"] == "critical"
        assert "<strong>Container not watched.</strong>" in _card(st) and REFUSED in _card(st)
        out = status_cli_output(tmp_path, st)
        assert f"CONTAINER NOT WATCHED: sparkd's looks at the container fail (EngineRefused: {REFUSED})" in out, out

        m.refusing = False  # the engine answers again
        await _until(lambda: any(e["kind"] == "watch_recovered" for e in events))
        assert sup.status_json().watch_error is None
        assert [e["kind"] for e in events].count("watch_failing") == 1
        st = base.model_copy(update={"container": sup.status_json(), "ts": time.time()})
        assert "Container not watched" not in _card(st)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_an_emergency_stop_the_engine_refuses_goes_on_by_the_containers_processes(tmp_path: Path) -> None:
    sup, _m, _events = _sup(tmp_path)
    sup.daemon = None
    said: list[tuple[str, str]] = []
    sup._event = lambda kind, message, **kw: said.append((kind, message))  # type: ignore[method-assign]
    by_processes: list[str] = []

    async def stop_without_docker(source: str, reason: str, why: str, **kw: Any) -> str:
        by_processes.append(why)  # the real one signals real pids: test_e2e_supervision.py runs it
        return "no process of vllm runs"

    sup._stop_without_docker = stop_without_docker  # type: ignore[method-assign]
    await sup.emergency_stop("rule low_available", "usable 2.00 GiB < 6.00 GiB")
    assert by_processes == [REFUSED], (by_processes, said)
    assert said[-1][0] == "stop_not_executed" and "no process of vllm runs" in said[-1][1], said


async def test_the_metrics_say_the_container_is_not_watched(tmp_path: Path) -> None:
    """``sparkd_docker_engine_up`` stays 1 while the engine answers its ping and refuses docker inspect: an alert on
    it never fires. ``sparkd_container_watched`` is 0 then."""
    from fakes import FakeActions
    from test_api import _client, _daemon

    actions = FakeActions()
    d = await _daemon(tmp_path, actions=actions)
    try:
        async with _client(d) as c:
            before = (await c.get("/metrics")).text
            actions.watch_error = f"EngineRefused: {REFUSED}"
            after = (await c.get("/metrics")).text
            live = (await c.get("/ui/live.json", params={"ev": 0})).json()
    finally:
        await d.shutdown("test")
    assert "sparkd_container_watched 1.0" in before and "sparkd_container_watched 0.0" in after
    assert "sparkd_docker_engine_up 1.0" in after
    assert live["label"] == views.WATCH_ERROR_LABEL, live


async def test_a_stop_asked_of_sparkd_that_the_engine_refuses_goes_on_by_the_processes_too(tmp_path: Path) -> None:
    """Only the guard's own trips fell back to the container's processes: a peer's stop, an operator's or
    Alertmanager's ended "not executed" with the engine refusing docker inspect (helper-52). The engine is not said
    down (it answers): the words are "refuses"."""
    sup, _m, events = _sup(tmp_path)
    by_processes: list[tuple[str, bool]] = []

    async def stop_without_docker(source: str, reason: str, why: str, **kw: Any) -> str:
        by_processes.append((source, kw.get("refused", False)))
        return "no process of vllm runs"

    sup._stop_without_docker = stop_without_docker  # type: ignore[method-assign]
    with pytest.raises(Exception) as e:
        await sup.request("stop", source="peer:b", reason="peer_emergency from b")
    assert by_processes == [("peer:b", True)], by_processes
    assert str(e.value) == f"no process of vllm runs (the Docker engine refuses ({REFUSED}))", e.value
    assert isinstance(e.value, Refused) and e.value.reason == "not_running", e.value
    assert sup.engine_up is True and not any(ev["kind"] == "docker_down" for ev in events)


async def test_only_a_look_that_succeeds_ends_the_failing_watch_and_only_failed_looks_count(tmp_path: Path) -> None:
    """``watch_recovered`` came after ``docker_down`` (a step that returned at its failed ping counted as a good
    one), and a database error of the supervision's periodic work was said as "looks at Docker failed", the headline
    "not watched" while inspect answered (helper-52). A guard mode headline with no container by its name stays
    critical, "nothing guarded" (the not-watched label hid it under amber)."""
    from sparkd.errors import StoreError

    sup, m, events = _sup(tmp_path / "sup")
    pings = [True]
    sup.manager.ping = lambda: pings[0]  # type: ignore[method-assign]
    task = asyncio.create_task(sup._loop())
    try:
        await _until(lambda: any(e["kind"] == "watch_failing" for e in events))
        pings[0] = False  # the engine stops answering altogether: no look at the container succeeds
        await _until(lambda: any(e["kind"] == "docker_down" for e in events))
        await asyncio.sleep(0.6)  # steps that return at their ping
        assert not any(e["kind"] == "watch_recovered" for e in events), [e["kind"] for e in events]
        pings[0], m.refusing = True, False  # it answers, and inspect does
        await _until(lambda: any(e["kind"] == "watch_recovered" for e in events))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    sup2, m2, events2 = _sup(tmp_path / "sup2")
    m2.refusing = False

    async def periodic() -> None:
        raise StoreError("database is locked")

    sup2.unattended.periodic = periodic  # type: ignore[method-assign]
    task = asyncio.create_task(sup2._loop())
    try:
        await _until(lambda: m2.inspects >= 2 * WATCH_FAILURES_SAID)
        assert not any(e["kind"] == "watch_failing" for e in events2), events2
        assert sup2.status_json().watch_error is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    base = _calm(await _base(tmp_path))
    missing = sup2.status_json().model_copy(
        update={"watch_error": "EngineRefused: x", "guard_missing_since": time.time(), "container_id": None}
    )
    h = views.headline(base.model_copy(update={"container": missing}).model_dump(mode="json"), None)
    assert h["level"] == "critical" and "nothing guarded" in h["label"], h


def test_the_metrics_leave_out_a_memory_reading_sparkd_can_no_longer_take(tmp_path: Path) -> None:
    """/proc/meminfo unreadable, every rule blind: /metrics served the last MemAvailable as current, and a
    Prometheus alert on it could never fire (helper-53). The memory gauges are left out; the sample's age is given."""
    from prometheus_client import generate_latest

    from sparkd.face.exporter import build_registry
    from sparkd.loop.daemon import Daemon

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n")

    async def go() -> tuple[str, str]:
        s = load_settings(
            overrides={"state_dir": str(tmp_path / "st"), "kernlog_source": "off", "proc_root": str(proc)}
        )
        d = Daemon(s, serve_api=False)
        await d.startup()
        try:
            r = d._tick_once()
            assert r is not None
            await d._handle(r)
            good = generate_latest(build_registry(d)).decode()
            assert d.guard is not None

            def eio() -> Any:  # the kernel's read error (the reader holds its file open: unlinking it changes nothing)
                raise OSError(5, "Input/output error")

            d.guard.read_sample = eio  # type: ignore[method-assign]
            assert d._tick_once() is None and d.guard is not None and d.guard.read_error is not None
            return good, generate_latest(build_registry(d)).decode()
        finally:
            await d.shutdown("test")

    good, blind = asyncio.run(go())
    assert "sparkd_memory_MemAvailable_bytes 1.2884901888e+10" in good and "sparkd_sample_age_seconds " in good
    assert "sparkd_memory_MemAvailable_bytes" not in blind and "sparkd_memory_usable_bytes" not in blind, blind
    assert "sparkd_sample_age_seconds " in blind


async def test_a_database_write_that_hangs_is_said_not_shown_as_ok(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that blocks without failing (a hung disk or mount, an fsync stuck under memory pressure) read
    "database ok" and sparkd_db_up 1 while nothing was recorded, until the queue filled 40 min to hours later
    (helper-53). A real daemon and writer; the store's write blocks on cue (the hung disk)."""
    import threading

    from prometheus_client import generate_latest

    import sparkd.loop.daemon_db as daemon_db
    import sparkd.store.store as store_module
    from sparkd.face.exporter import build_registry
    from sparkd.loop.daemon import Daemon

    monkeypatch.setattr(store_module, "FAILING_REPORT_S", 0.3)
    monkeypatch.setattr(daemon_db, "FAILING_REPORT_S", 0.3)
    settings = load_settings(overrides={"state_dir": str(tmp_path / "st"), "kernlog_source": "off"})
    d = Daemon(settings, serve_api=False)
    await d.startup()
    release = threading.Event()

    class HungStore:
        def write_batch(self, items: Any, *, durable: bool = False) -> None:
            release.wait(30)

    try:
        await asyncio.wait_for(d._db_opened.wait(), 60)
        assert d.writer is not None
        real = d.writer.store
        d.writer.attach(HungStore())  # type: ignore[arg-type]
        d.writer.submit("event", {"ts": time.time(), "kind": "x", "message": "m", "severity": "info"}, urgent=True)
        await _until(lambda: d.writer is not None and d.writer.hung_for() > 0.4)
        await daemon_db.db_step(d)
        [ev] = [e for e in d.recent_events if e["kind"] == "database_write_hung"]
        assert ev["severity"] == "critical" and "nothing is recorded meanwhile" in ev["message"], ev
        st = d.status_json()
        assert st.database.state == "ok" and (st.database.write_hung_s or 0) > 0.3
        assert "sparkd_db_up 0.0" in generate_latest(build_registry(d)).decode()
        await daemon_db.db_step(d)  # said once
        assert [e["kind"] for e in d.recent_events].count("database_write_hung") == 1
        d.writer.attach(real)
        release.set()
        await _until(lambda: d.writer is not None and d.writer.hung_for() == 0.0)
        await daemon_db.db_step(d)
        assert any(e["kind"] == "database_write_returned" for e in d.recent_events)
        assert d.status_json().database.write_hung_s is None
    finally:
        release.set()
        await d.shutdown("test")


async def test_the_finish_of_a_stop_made_by_the_processes_survives_a_refused_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a stop by the processes (the engine refusing), finishing it through Docker at the next step met the
    same refusal and was dropped for good: a restart policy bringing the run back later read as a start by hand
    (helper-54). It waits for the next step, and is finished once the engine answers."""
    from sparkd.loop import supervisor as supmod

    sup, m, _events = _sup(tmp_path)
    monkeypatch.setattr(supmod, "_processes_of", lambda cid: [])  # the SIGKILL took them (the edge: /proc)
    sup.stopped_without_docker = ("peer:b", "peer_emergency from b")
    with pytest.raises(EngineRefused):
        await sup._step()
    assert sup.stopped_without_docker == ("peer:b", "peer_emergency from b")
    m.refusing = False  # it answers: the run is still up as Docker says (its processes gone, Docker not caught up)
    await sup._step()
    assert sup.stopped_without_docker == ("peer:b", "peer_emergency from b")  # read again at the next step


async def test_the_supervisions_periodic_work_waits_while_the_looks_at_the_container_fail(tmp_path: Path) -> None:
    """A scheduled maintenance could begin while the engine refused docker inspect, on the stale state "ready"
    (helper-54): it waits for a step whose look succeeded; the rest of the periodic work goes on."""
    sup, m, _events = _sup(tmp_path)
    ran: list[bool] = []

    async def periodic(*, watched: bool = True) -> None:
        ran.append(watched)

    sup.unattended.periodic = periodic  # type: ignore[method-assign]
    task = asyncio.create_task(sup._loop())
    try:
        await _until(lambda: m.inspects >= 3)
        # the heartbeat, the breaker's re-alerts and the maintenance window's expiry go on (helper-57); only a
        # scheduled maintenance waits for a look that succeeded
        assert ran and set(ran) == {False}, ran
        m.refusing = False
        await _until(lambda: ran[-2:] == [True, True])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("was", ["ready", "stopped"])
async def test_a_docker_run_rm_container_gone_before_its_exit_was_read_is_an_exit(
    tmp_path: Path, was: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`docker run --rm`: Docker removes the container right after its exit, and a look a second apart read it as
    "removed outside sparkd" (a warning) about one time in two, a crash unpaged (test_e2e_lifecycle's --rm test,
    flaky since helper-49). A running --rm container that is gone ended on its own: a critical "exited", its code
    lost, its postmortem written with what is left (its contents: ``test_exit_postmortem.py``). One sparkd stopped
    is only gone."""
    from sparkd.errors import NotFound
    from sparkd.loop import runbook

    archived: list[Any] = []

    async def postmortem(sup: Any, rep: Any, cid: str, **kw: Any) -> str:
        archived.append(kw.get("exited"))
        return "sparkd-20261204T000000Z-vllm.tar.gz"

    monkeypatch.setattr(runbook, "write_postmortem", postmortem)
    sup, m, events = _sup(tmp_path)
    sup.auto_remove = True
    sup.state = S.READY if was == "ready" else S.STOPPED

    def gone(cid: str) -> Any:
        raise NotFound(f"no such container: {cid}")

    m.state = gone  # type: ignore[method-assign]
    from types import SimpleNamespace

    sup._oom_record = SimpleNamespace(pid=4242, comm="python3")  # type: ignore[assignment]  # the kernel's OOM line
    await sup.reconcile(probe=False)
    assert sup.auto_remove is False  # the next run's own flag is read when it is taken (helper-57)
    kinds = [(e["kind"], e["severity"]) for e in events]
    if was == "ready":
        assert ("exited", "critical") in kinds and not any(k == "container_gone" for k, _ in kinds), kinds
        [ev] = [e for e in events if e["kind"] == "exited"]
        assert "exited unexpectedly and Docker removed it at once (docker run --rm)" in ev["message"]
        # the kernel's OOM attribution is said, not "a crash cannot be told from a clean exit" (helper-57)
        assert "the kernel log shows an OOM kill of pid 4242 (python3)" in ev["message"], ev["message"]
        assert sup.state_reason == "exited and removed by Docker (docker run --rm)"
        # its postmortem, without the log Docker removed with it (it had none at all)
        [seen] = archived
        assert seen.auto_removed and seen.exit_code is None and seen.kernel_oom == "pid 4242 (python3)", seen
        assert ev["details"]["archive"] == "sparkd-20261204T000000Z-vllm.tar.gz", ev
        assert "its log went with it: archive sparkd-20261204T000000Z-vllm.tar.gz" in ev["message"], ev["message"]
    else:  # its exit said before (or sparkd's stop): Docker's own removal, not "removed outside sparkd" (helper-55)
        assert ("container_gone", "info") in kinds and not any(k == "exited" for k, _ in kinds), kinds
        [ev] = [e for e in events if e["kind"] == "container_gone"]
        assert "was removed by Docker after its exit (docker run --rm)" in ev["message"], ev
        assert sup.state_reason == "removed by Docker after its exit (docker run --rm)"
        assert archived == []  # its exit had its archive (or sparkd's stop did)
    assert sup.container_id is None


def test_an_accept_that_fails_on_the_state_socket_waits_a_second_instead_of_spinning(tmp_path: Path) -> None:
    """Out of descriptors, accept() failed, the connection stayed queued and the socket readable: the reader ran on
    every pass of the loop, a warning each, 40,000 a second from one `sparkd status` (helper-57). It waits 1 s."""
    from sparkd.loop.statelock import StateLock, daemon_pid

    async def go() -> tuple[int, int | None]:
        lock = StateLock.acquire(tmp_path)
        real = lock._sock
        assert real is not None
        calls = [0]

        class Once:  # the real socket; its first accept() fails as the kernel's EMFILE does
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            def accept(self) -> Any:
                calls[0] += 1
                if calls[0] <= 1:
                    raise OSError(24, "Too many open files")
                return real.accept()

        lock._sock = Once()  # type: ignore[assignment]
        try:
            lock.answer_on(asyncio.get_running_loop())
            pid = await asyncio.to_thread(daemon_pid, tmp_path)  # queued; answered once accept works again
            await asyncio.sleep(0.5)
            spun = calls[0]
            await asyncio.sleep(1.0)
            return spun, pid
        finally:
            lock._sock = real
            lock.release()

    spun, pid = asyncio.run(go())
    assert spun <= 2, spun
    assert pid is not None
