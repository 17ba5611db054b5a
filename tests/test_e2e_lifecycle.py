"""The container lifecycle reconciled with Docker's truth, on the real engine (issue 11, item 2):
a container started by hand after sparkd stopped it is guarded again (guard and managed mode),
and a Docker restart loop is state ``restarting``, counted and warned about.

Each test runs a real ``sparkd run`` subprocess; containers carry this test's case label and
are removed by the dockerkit finalizer. Memory trips come from a scripted /proc tree
(``proc_root``).
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from sparkdapi import SparkdUnderTest
from sparkdproc import db_query, free_port, wait_for

from sparkd.act.containerspec import epoch_from_docker

pytest_plugins = ["dockerkit"]

RUNNING = ("starting", "ready", "unhealthy")


def _started_at(docker_client: Any, cid: str) -> float:
    t = epoch_from_docker(docker_client.api.inspect_container(cid)["State"]["StartedAt"])
    assert t is not None
    return t


def _start_by_hand_and_time_until_running(s: SparkdUnderTest, docker_client: Any, cid: str) -> float:
    """``docker start`` as an operator does it; seconds until sparkd's status says running."""
    docker_client.containers.get(cid).start()
    t0 = time.monotonic()
    assert wait_for(lambda: s.container()["state"] in RUNNING, 10, 0.02), s.container()
    return time.monotonic() - t0


HIGH = "MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n"
LOW = "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 2097152 kB\n"


def _guard_on_scripted_proc(
    make: Any,
    launcher: Any,
    tmp_path: Path,
    *,
    cooldown_s: float,
    by_id: bool = False,
    docker_client: Any = None,
    restart_policy: str | None = None,
) -> tuple[Any, SparkdUnderTest, Path]:
    """A hand-started fake vLLM guarded by sparkd (``container.guard``: its name, or its id with ``by_id``; Docker's
    ``restart_policy`` set on it first when given), whose
    low_available rule (< 6 GiB, 2 samples) reads a scripted /proc (``proc/meminfo``: ``HIGH`` now) and whose
    /dev/shm cleanup gets a private directory; returns (container, sparkd, proc)."""
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()
    (proc / "meminfo").write_text(HIGH)
    fv = launcher(managed=False, startup_s=0.3)
    if restart_policy:  # `docker update --restart POLICY`, before sparkd first sees it
        docker_client.containers.get(fv.id).update(restart_policy={"Name": restart_policy})
    s = make(
        container={"image": None, "guard": fv.id[:12] if by_id else fv.name, "port": fv.port, "hard_floor": "1GiB"},
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        top={"cooldown_s": cooldown_s, "proc_root": str(proc), "shm_dir": str(shm)},
    )
    return fv, s, proc


def test_a_guarded_container_whose_restart_policy_undoes_a_stop_is_said_at_adoption_by_doctor_and_on_its_return(
    make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    """``--restart always`` starts a container again when dockerd restarts, after sparkd's ``docker stop``; sparkd said
    nothing at adoption, and its return was an info ``restarted_outside`` (helper-43). The return is made here by a
    ``docker start`` (restarting this host's dockerd would take every other test's containers with it): the same
    observation, a new StartedAt after sparkd's stop."""
    from sparkd.ops.doctor import docker_container_status

    fv, s, proc = _guard_on_scripted_proc(
        make, launcher, tmp_path, cooldown_s=0.5, docker_client=docker_client, restart_policy="always"
    )
    ev = s.wait_event("restart_policy_undoes_stop", 30)
    assert ev["severity"] == "warning" and f"{fv.name}'s Docker restart policy is 'always'" in ev["message"]
    assert f"docker update --restart unless-stopped {fv.name}" in ev["message"]
    assert docker_container_status(fv.name) == ("running", "always")  # sparkd doctor's lookup, on the engine
    s.wait_state("ready", 60)
    (proc / "meminfo").write_text(LOW)
    s.wait_event("stopped", 60)
    (proc / "meminfo").write_text(HIGH)
    assert s.wait_state("stopped", 10)["container_id"] == fv.id
    docker_client.containers.get(fv.id).start()
    back = s.wait_event("restarted_outside", 10)
    assert back["severity"] == "warning" and "by its restart policy 'always' when dockerd restarted" in back["message"]
    assert len(s.events("restart_policy_undoes_stop")) == 1  # said once per container, not on each run


def test_a_guarded_container_started_by_hand_after_a_stop_is_guarded_again(
    make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    # a scripted /proc tree drives the rule (the shared host's MemAvailable moves by a GiB under other
    # tests, and the loop guard rightly demotes a rule whose floor sits within that noise); /dev/shm
    # cleanup gets a private directory, since this /proc shows no live holders
    fv, s, proc = _guard_on_scripted_proc(make, launcher, tmp_path, cooldown_s=0.5)
    s.wait_state("ready", 60)
    (proc / "meminfo").write_text(LOW)  # the rule trips; sparkd stops the container
    s.wait_event("stopped", 60)
    (proc / "meminfo").write_text(HIGH)
    assert s.wait_state("stopped", 10)["container_id"] == fv.id
    first_start = _started_at(docker_client, fv.id)

    # it reports the container running again within 2 s, with an event and the new start time
    took_s = _start_by_hand_and_time_until_running(s, docker_client, fv.id)
    assert took_s <= 2.0, f"sparkd took {took_s:.2f} s to see the container running"
    ev = s.wait_event("restarted_outside", 5)
    assert fv.name in ev["message"] and "was stopped" in ev["message"]
    assert ev["severity"] == "info" and "started again" in ev["message"]  # guard mode: how it runs, no warning
    new_start = _started_at(docker_client, fv.id)
    assert new_start > first_start
    assert s.container()["started_at"] == pytest.approx(new_start, abs=1e-3)
    # the guard stop's intent is released by the start (guard mode: the operator starts it); /api/status kept
    # "emergency" for the running model while the dashboard showed "–" (helper-48)
    assert wait_for(lambda: s.container()["supervision"]["intent"] is None, 5), s.container()["supervision"]
    assert s.events("stop_intent_released")

    # the rules apply again: the next trip stops it again (no "not running" refusal)
    s.wait_state("ready", 30)
    (proc / "meminfo").write_text(LOW)
    assert wait_for(lambda: len(s.events("stopped")) == 2, 60), s.output()[-3000:]
    (proc / "meminfo").write_text(HIGH)
    assert s.wait_state("stopped", 10)["container_id"] == fv.id
    assert docker_client.api.inspect_container(fv.id)["State"]["Running"] is False
    # no "not running" refusal from the start by hand up to that stop (after each stop, memory held low until HIGH
    # is written may trip again with nothing left to stop: that refusal is right, and on a loaded host it can come
    # before the test writes HIGH: the CI run at 87adc70 saw one after the first stop)
    second_stop = max(e["ts"] for e in s.events("stopped"))
    refused = [e for e in s.events("stop_not_executed") if ev["ts"] <= e["ts"] <= second_stop]
    assert refused == [], (ev["ts"], refused)
    assert s.events("watermark") == []


def test_a_guard_name_that_matches_no_container_is_said_and_the_container_that_takes_it_is_guarded(
    make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    """Guard mode with ``container.guard`` naming no container (a typo, compose's ``proj-vllm-1``) guarded nothing and
    read "ok" (helper-40). On the real engine: a critical ``guard_target_missing``, the headline says it; a container
    started under that name is found, adopted, and a trip stops it."""
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()
    (proc / "meminfo").write_text(HIGH)
    name = f"sparkd-test-typo-{uuid.uuid4().hex[:8]}"
    port = free_port()
    # the model under compose's <project>-<service>-1 name: named as the likely target, never touched
    compose = launcher(managed=False, startup_s=0.3, name=f"proj-{name}-1")
    s = make(
        container={"image": None, "guard": name, "port": port, "hard_floor": "1GiB"},
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        top={"proc_root": str(proc), "shm_dir": str(shm)},
    )
    missing = s.wait_event("guard_target_missing", 30)
    assert missing["severity"] == "critical" and f"no container named {name!r}" in missing["message"], missing
    assert f"running now: {compose.name} (" in missing["message"], missing  # docker ps, labelled or not
    st = s.status()
    assert st["container"]["guard_missing_since"] is not None and st["container"]["state"] == "none", st["container"]
    assert [c.split(" (")[0] for c in st["container"]["guard_candidates"]] == [compose.name], st["container"]
    fv = launcher(managed=False, startup_s=0.3, name=name, port=port)
    assert s.wait_event("guard_target_found", 30)
    assert s.wait_state("ready", 60)["container_id"] == fv.id
    assert s.status()["container"]["guard_missing_since"] is None
    (proc / "meminfo").write_text(LOW)
    s.wait_event("stopped", 60)
    (proc / "meminfo").write_text(HIGH)
    assert docker_client.api.inspect_container(fv.id)["State"]["Running"] is False
    assert docker_client.api.inspect_container(compose.id)["State"]["Running"] is True  # not the guarded one


def test_a_managed_container_started_by_hand_can_be_stopped_through_the_api(make: Any, docker_client: Any) -> None:
    s = make()
    c = s.wait_state("ready", 60)
    assert s.api("POST", "/api/container/stop").status_code == 200
    s.wait_state("stopped", 10)

    took_s = _start_by_hand_and_time_until_running(s, docker_client, c["container_id"])
    assert took_s <= 2.0, f"sparkd took {took_s:.2f} s to see the container running"
    assert s.wait_event("restarted_outside", 5)["details"]["container_id"] == c["container_id"]
    # a start request sees Docker's truth: it runs already (not "another container is running")
    r = s.api("POST", "/api/container/start")
    assert r.status_code == 422 and "already running" in r.text, r.text
    r = s.api("POST", "/api/container/stop")
    assert r.status_code == 200, r.text
    assert r.json()["stop"]["exit_code"] == 0
    assert docker_client.api.inspect_container(c["container_id"])["State"]["Running"] is False
    assert s.wait_state("stopped", 10)["container_id"] == c["container_id"]


def test_a_docker_restart_loop_is_restarting_counted_and_warned_about(
    make: Any, image: str, docker_client: Any, case_labels: dict[str, str]
) -> None:
    # vLLM that fails its start-up after ~1 s, under `--restart unless-stopped`, started by the operator
    fail = "import sys, time; print('ERROR EngineCore failed to start', flush=True); time.sleep(1); sys.exit(3)"
    name = f"sparkd-test-loop-{uuid.uuid4().hex[:8]}"
    c = docker_client.containers.run(
        image,
        name=name,
        entrypoint=["/usr/bin/python3", "-c", fail],
        labels=case_labels,
        network_mode="host",
        restart_policy={"Name": "unless-stopped"},
        detach=True,
    )
    s = make(container={"image": None, "guard": name})
    s.wait_state("restarting", 30)
    assert wait_for(lambda: docker_client.api.inspect_container(c.id)["RestartCount"] >= 4, 60)
    # sparkd's count against Docker's, read side by side
    for _ in range(5):
        seen = s.container()
        docker_count = docker_client.api.inspect_container(c.id)["RestartCount"]
        assert abs(seen["restart_count"] - docker_count) <= 1, (seen, docker_count)
        assert abs(seen["docker_restarts_seen"] - docker_count) <= 1, (seen, docker_count)
        assert seen["state"] == "restarting" and seen["restart_policy"] == "unless-stopped"
        assert seen["uptime_s"] is None  # not a running server
        time.sleep(0.7)
    assert s.container()["restarts_in_window"] >= 4
    warnings = s.events("restart_loop")
    assert len(warnings) == 1, warnings  # one warning, however many restarts
    msg = warnings[0]["message"]
    assert "'unless-stopped'" in msg and "will stop it if a rule trips" in msg and name in msg
    assert db_query(s.db, "SELECT severity FROM events WHERE kind='restart_loop'") == [("warning",)]
    assert s.events("adopted")[0]["details"]["container_id"] == c.id
    out = s.cli("status")
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"container: restarting .*Docker restarted it \d+ times \(restart policy unless-stopped\)", out.stdout
    )
    # a stop (as a trip makes it) acts on the restarting container, and Docker leaves it stopped
    r = s.api("POST", "/api/container/stop")
    assert r.status_code == 200, r.text
    st = docker_client.api.inspect_container(c.id)["State"]
    assert st["Running"] is False and st["Restarting"] is False
    assert s.wait_state("stopped", 10)["container_id"] == c.id


def test_a_container_started_by_hand_is_stopped_again_within_the_cooldown(
    make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    # a rule's cooldown (60 s here, the default) is for a stop that happened; a container the
    # operator starts again while memory is still low must be stopped at the next trip, not 60 s later.
    # The scripted /proc carries this host's real zoneinfo: with small watermarks, a ready at 2 GiB is
    # memory taken, not a tuned host, so the loop guard never demotes the rule (whichever of ready and
    # the trip comes first on a loaded machine)
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()
    (proc / "zoneinfo").write_text(Path("/proc/zoneinfo").read_text())
    (proc / "meminfo").write_text(HIGH)
    fv = launcher(managed=False, startup_s=0.3)
    s = make(
        container={"image": None, "guard": fv.name, "port": fv.port, "hard_floor": "1GiB"},
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        top={"cooldown_s": 60.0, "proc_root": str(proc), "shm_dir": str(shm)},
    )
    s.wait_state("ready", 60)
    (proc / "meminfo").write_text(LOW)
    s.wait_event("stopped", 60)
    docker_client.containers.get(fv.id).start()  # by hand, memory still low
    s.wait_event("restarted_outside", 10)
    t0 = time.time()
    assert wait_for(lambda: len(s.events("stopped")) == 2, 30), s.output()[-3000:]
    assert s.events("stopped")[-1]["ts"] - t0 < 20  # not held back by the first trip's 60 s cooldown
    (proc / "meminfo").write_text(HIGH)
    assert not [e for e in s.events("watermark") if "demoted" in e["message"]]


def test_a_model_a_rule_stopped_stays_stopped_when_the_database_is_lost(make: Any, tmp_path: Path) -> None:
    # the launch record is gone (disk full, file removed): the persisted stop intent still holds
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(HIGH)
    s = make(
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        top={"proc_root": str(proc), "shm_dir": str(tmp_path)},
    )
    s.wait_state("ready", 60)
    (proc / "meminfo").write_text(LOW)  # below the 3 GiB hard floor too: killed at once
    s.wait_event("container_stopped", 60)
    (proc / "meminfo").write_text(HIGH)
    s.stop()
    for f in s.tmp.glob("sparkd.db*"):
        f.unlink()
    s.start()
    ev = s.wait_event("staying_stopped", 20)
    assert "emergency" in ev["message"], ev
    time.sleep(2.0)
    assert s.events("launched") == []  # the new database has no launch: none happened
    assert s.container()["stay_stopped"] is True


@pytest.mark.parametrize("how", ["by_id", "renamed"])
def test_a_guarded_container_named_by_id_or_renamed_is_stopped_not_refused(
    how: str, make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    """``container.guard`` set to the container's id, or the guarded container renamed while it ran: the guard
    adopted it, then every trip's stop was refused ("lacks the label sparkd.managed=true and is not guarded": the
    permission was checked against the configured string and the name now), yet a ``stopped`` event was written
    and ``sparkd stop`` answered "stopped" with the model up. The permission follows the container found."""
    fv, s, proc = _guard_on_scripted_proc(make, launcher, tmp_path, cooldown_s=60.0, by_id=how == "by_id")
    assert s.wait_state("ready", 60)["container_id"] == fv.id
    if how == "renamed":
        docker_client.containers.get(fv.id).rename(f"{fv.name}-renamed")
    (proc / "meminfo").write_text(LOW)
    assert wait_for(lambda: s.events("stopped") + s.events("stop_unconfirmed"), 60), s.output()[-3000:]
    assert not s.events("stop_unconfirmed"), s.events("stop_unconfirmed")
    assert docker_client.api.inspect_container(fv.id)["State"]["Running"] is False
    assert s.wait_state("stopped", 10)["container_id"] == fv.id


@pytest.mark.parametrize("action", ["restart", "start"])
def test_a_restart_or_start_of_a_guarded_container_is_refused_before_anything_is_stopped(
    action: str, make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    """Guard mode: ``sparkd restart`` stopped the model, then refused to start it ("guarded, not launched by sparkd:
    start it yourself") and exited 1 with the model down (a new user, note 11). Refused before anything is done."""
    fv, s, _proc = _guard_on_scripted_proc(make, launcher, tmp_path, cooldown_s=60.0)
    assert s.wait_state("ready", 60)["container_id"] == fv.id
    out = s.cli(action)
    assert out.returncode != 0 and "guarded, not launched by sparkd" in out.stderr, (out.stdout, out.stderr)
    assert f"docker {action} {fv.name}" in out.stderr, out.stderr
    time.sleep(1.0)
    assert docker_client.api.inspect_container(fv.id)["State"]["Running"] is True
    assert s.events("stopping") == [] and s.events("stopped") == []


def test_a_new_container_under_the_guarded_name_is_followed_and_stopped(
    make: Any, launcher: Any, docker_client: Any, image: str, case_labels: dict[str, str], tmp_path: Path
) -> None:
    """After a trip stopped the guarded container, the operator kept it for forensics (renamed) and ran a new one
    by the guarded name: sparkd went on watching the old, stopped one, and each trip said "not running" while the
    new model ran unguarded. It now follows the running container of that name, and says so."""
    from sparkdproc import free_port

    fv, s, proc = _guard_on_scripted_proc(make, launcher, tmp_path, cooldown_s=2.0)
    s.wait_state("ready", 60)
    (proc / "meminfo").write_text(LOW)
    s.wait_event("stopped", 60)
    (proc / "meminfo").write_text(HIGH)
    docker_client.containers.get(fv.id).rename(f"{fv.name}-kept")
    new = docker_client.containers.run(
        image,
        ["serve", "/models/fake", "--port", str(free_port())],
        name=fv.name,
        environment={"FAKEVLLM_STARTUP_S": "0.3"},
        labels=case_labels,
        network_mode="host",
        ipc_mode="host",
        detach=True,
    )
    changed = s.wait_event("guarded_container_changed", 30)
    assert changed["details"]["container_id"] == new.id and changed["details"]["previous_id"] == fv.id
    assert changed["details"]["previous_running"] is False
    assert wait_for(lambda: s.container()["container_id"] == new.id and s.container()["state"] in RUNNING, 30)
    (proc / "meminfo").write_text(LOW)
    assert wait_for(lambda: len(s.events("stopped")) == 2, 60), s.output()[-3000:]
    assert docker_client.api.inspect_container(new.id)["State"]["Running"] is False


def test_a_guarded_model_whose_port_answers_nothing_is_never_stopped_for_its_health(
    make: Any, launcher: Any, docker_client: Any
) -> None:
    """Guard mode with a wrong ``container.port``: /health answers nothing. sparkd never starts a guarded container,
    so this is no failed launch of its own; it stopped the model once the run was older than
    ``startup_timeout_s`` ("not ready within …", a critical stop of a healthy model). Now it is said (``health``)
    and the model runs on. (The managed launch that never becomes ready is still stopped:
    ``test_e2e_unattended.py``; the stubbed cases: ``test_startup_expiry.py``.)"""
    fv = launcher(managed=False, startup_s=0.3)
    dead = free_port()  # nothing listens there
    c = {"image": None, "guard": fv.name, "port": dead, "startup_timeout_s": 5, "health_interval_s": 0.5}
    s = make(container=c)
    # guard mode has no launch record, ever: its adoption says "guarding it", not "no launch record" (helper-39)
    assert "guarding it (guard mode, started outside sparkd)" in s.wait_event("adopted", 20)["message"]
    assert wait_for(lambda: (s.container().get("health") or "") not in ("", "ok"), 30), s.container()
    time.sleep(8.0)  # past startup_timeout_s, several probes
    c = s.container()
    assert c["state"] == "starting" and c["state"] != "failed", c
    assert s.events("stopping") == [] and s.events("stopped") == [], s.events("stopping")
    assert docker_client.api.inspect_container(fv.id)["State"]["Running"] is True
    assert httpx.get(fv.url("/health"), timeout=5).status_code == 200  # the model itself was fine all along


def test_a_guarded_model_stopped_by_hand_after_its_guard_stop_is_not_called_a_guard_stop(
    make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    """helper-37: a guarded model stopped by the guard, started by hand, then stopped with `docker stop`: a critical
    "exited unexpectedly" alert, summary.txt "requested by: sparkd", the dashboard "STOPPED by the guard" with the
    earlier incident's card, and `sparkd status` that earlier stop's intent. Each now says what happened."""
    import tarfile

    fv, s, proc = _guard_on_scripted_proc(make, launcher, tmp_path, cooldown_s=0.5)
    s.wait_state("ready", 60)
    (proc / "meminfo").write_text(LOW)
    s.wait_event("stopped", 60)
    (proc / "meminfo").write_text(HIGH)
    s.wait_state("stopped", 10)
    assert s.api("GET", "/ui/live.json").json()["label"] == "stopped by the guard"  # the guard's stop: said
    _start_by_hand_and_time_until_running(s, docker_client, fv.id)
    s.wait_state("ready", 30)
    docker_client.containers.get(fv.id).stop(timeout=10)  # the operator's, outside sparkd: exit code 0
    ev = s.wait_event("exited", 30)
    assert ev["severity"] == "warning" and "a clean exit" in ev["message"], ev
    with tarfile.open(s.tmp / "archives" / ev["details"]["archive"]) as tf:
        summary = tf.extractfile("summary.txt").read().decode()  # type: ignore[union-attr]
    assert "requested by: nobody: the container exited on its own, or was stopped outside sparkd" in summary, summary
    assert "launch id:    none (guard mode: not launched by sparkd)" in summary, summary  # not "None" (helper-39)
    from sparkd.act.archive import is_incident_archive, list_archives

    bundle = next(a for a in list_archives(s.tmp / "archives") if a.path.name == ev["details"]["archive"])
    assert is_incident_archive(bundle)  # an exit's postmortem is kept as an incident's, not pruned as routine
    live = s.api("GET", "/ui/live.json").json()
    assert live["label"] != "stopped by the guard", live["label"]
    c = s.container()
    assert c["state"] == "exited" and c["stay_stopped"] is False, c
    out = s.cli("status").stdout
    assert "stopped by: emergency" not in out, out  # the earlier run's intent is not this run's


def test_a_ready_managed_model_whose_health_fails_after_a_restart_of_sparkd_is_unhealthy_not_stopped(
    sparkd_factory: Any, docker_client: Any
) -> None:
    """Managed mode: a model sparkd launched and saw ready, sparkd restarted (an upgrade) at a moment the model's
    /health failed (busy, a hiccup). The adopted run was ``starting``, its launch's start older than
    ``startup_timeout_s``, so the first failing probe stopped a model that had served for hours as "not ready
    within …" (note 16; the stubbed cases: ``test_startup_expiry.py``). It is ``unhealthy`` now (its launch record
    says it was ready), and ``ready`` again once /health answers; nothing stops it for its /health alone."""
    # (the completion probe, which stops a dead engine after 5 failures, waits out its 300 s adoption grace here)
    s = sparkd_factory(container={"startup_timeout_s": 5, "health_interval_s": 0.3}).start()
    c = s.wait_state("ready", 60)
    time.sleep(max(0.0, c["started_at"] + 6.0 - time.time()))  # the launch is older than startup_timeout_s
    assert s.stop() == 0  # a normal stop of sparkd leaves the model serving
    s.vllm("POST", "/serve?mode=unhealthy")
    restarted_at = time.time()
    s.start()
    assert wait_for(lambda: s.container()["state"] == "unhealthy", 30), (s.container(), s.output()[-3000:])
    time.sleep(4.0)  # several failing probes, each past startup_timeout_s from the launch's start
    after = [e for k in ("stopping", "stopped", "killed") for e in s.events(k) if e["ts"] >= restarted_at]
    assert after == [], after
    c2 = s.container()
    assert c2["state"] == "unhealthy" and c2["container_id"] == c["container_id"], c2
    assert docker_client.api.inspect_container(c["container_id"])["State"]["Running"] is True
    s.vllm("POST", "/serve?mode=normal")
    assert s.wait_state("ready", 30)["container_id"] == c["container_id"]


def test_a_guarded_container_removed_by_hand_is_said_removed_not_crashed(
    make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    """`docker rm -f` of the guarded container raised a critical "exited unexpectedly (exit code 137)", paged as a
    crash, with a postmortem whose container log was "marked for removal" (helper-48). Its removal killed it: a
    warning that says so, then ``guard_target_missing``."""
    fv, s, _proc = _guard_on_scripted_proc(make, launcher, tmp_path, cooldown_s=2.0)
    s.wait_state("ready", 60)
    docker_client.containers.get(fv.id).remove(force=True)
    s.wait_event("guard_target_missing", 30)
    # seen exited on its way out (Docker: "removing"), or already gone (container_gone): never a crash
    for exited in s.events("exited"):
        assert exited["severity"] == "warning", exited
        assert "was removed" in exited["message"] and "not a crash" in exited["message"], exited["message"]
        assert exited["details"]["removed"] is True


def test_a_paused_guarded_container_is_said_paused_and_still_stopped_by_a_trip(
    make: Any, launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    """`docker pause` read "unhealthy — /health: ReadTimeout", and the operator went debugging the model
    (helper-48). It is said paused, with how to unpause it; it holds its memory, and a trip still stops it."""
    fv, s, proc = _guard_on_scripted_proc(make, launcher, tmp_path, cooldown_s=2.0)
    s.wait_state("ready", 60)
    box = docker_client.containers.get(fv.id)
    box.pause()
    try:
        c = s.wait_state("unhealthy", 30)
        assert "paused (docker pause)" in c["state_reason"] and f"docker unpause {fv.name}" in c["state_reason"], c
        (proc / "meminfo").write_text(LOW)
        s.wait_event("stopped", 60)
        box.reload()
        assert box.status == "exited", box.status
    finally:
        box.reload()
        if box.status == "paused":
            box.unpause()


def _crash_of_a_docker_run_rm_container(
    make: Any, docker_client: Any, image: str, case_labels: dict[str, str], tmp_path: Path
) -> tuple[SparkdUnderTest, dict[str, Any]]:
    """A guarded fake vLLM started with `docker run --rm` that crashes (exit 1) 4 s after it is ready; returns sparkd
    and its ``exited`` event."""
    name = f"sparkd-test-rm-{uuid.uuid4().hex[:8]}"
    port = free_port()
    s = make(
        container={"image": None, "guard": name, "port": port},
        top={"shm_dir": str(tmp_path)},
    )
    docker_client.containers.run(
        image,
        ["serve", "/models/fake", "--port", str(port)],
        name=name,
        environment={"FAKEVLLM_STARTUP_S": "0.3", "FAKEVLLM_MODE": "crash", "FAKEVLLM_CRASH_AFTER_S": "4"},
        labels=case_labels,
        network_mode="host",
        auto_remove=True,
        detach=True,
    )
    s.wait_state("ready", 30)
    return s, s.wait_event("exited", 30)


def test_a_crash_of_a_docker_run_rm_container_stays_a_crash(
    make: Any, docker_client: Any, image: str, case_labels: dict[str, str], tmp_path: Path
) -> None:
    """`docker run --rm` (vLLM's usual way) has Docker remove the container after any exit: a crash (exit 1) read as
    "removed outside sparkd … not a crash", a warning (helper-49). Only the SIGKILL of a removal by hand is one."""
    s, exited = _crash_of_a_docker_run_rm_container(make, docker_client, image, case_labels, tmp_path)
    assert exited["severity"] == "critical" and exited["details"]["removed"] is False, exited
    # read before Docker removed it: its exit code; removed first (a look a second apart races the removal; it read
    # "removed outside sparkd", a warning, one run in two): an unexpected exit all the same, its code lost
    assert "exited unexpectedly (exit code 1" in exited["message"] or (
        "exited unexpectedly and Docker removed it at once (docker run --rm)" in exited["message"]
    ), exited["message"]
    assert not s.events("container_gone"), s.events("container_gone")


def test_a_crash_of_a_docker_run_rm_container_leaves_a_postmortem_without_its_log(
    make: Any, docker_client: Any, image: str, case_labels: dict[str, str], tmp_path: Path
) -> None:
    """A `docker run --rm` container that crashed left no postmortem when Docker removed it before sparkd read its
    exit: its log was gone with it, and nothing else was archived. Either way it has one now: read before the removal,
    with its exit code (``exit code:    1``) and its log; removed first, with the samples, events and kernel lines
    and a summary that says the container's own log went with it (the stubbed engine: test_exit_postmortem.py)."""
    import tarfile

    from sparkd.act.archive import is_incident_archive, list_archives

    s, exited = _crash_of_a_docker_run_rm_container(make, docker_client, image, case_labels, tmp_path)
    name = exited["details"]["archive"]
    assert name and f"archive {name}" in exited["message"], exited
    with tarfile.open(s.tmp / "archives" / name) as tf:
        assert tf.getmembers()[0].name == "summary.txt"
        members = set(tf.getnames())
        summary = tf.extractfile("summary.txt").read().decode()  # type: ignore[union-attr]
    assert "requested by: nobody: the container exited on its own, or was stopped outside sparkd" in summary, summary
    assert {"samples.csv", "events.json", "kernel.log"} <= members, members
    if exited["details"]["exit_code"] is None:  # Docker removed it first
        assert "container log: MISSING: Docker removed the container at its exit (docker run --rm)" in summary
        assert "exit code:    not known (Docker removed the container" in summary, summary
        assert "container.log.missing" in members and "container.log" not in members, members
    else:
        assert "exit code:    1\n" in summary and "OOMKilled:    false\n" in summary, summary
    bundle = next(a for a in list_archives(s.tmp / "archives") if a.name == name)
    assert is_incident_archive(bundle)
