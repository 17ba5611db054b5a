"""sparkd owns the vLLM container on a real Docker engine (the fakevllm test image).

Each test runs a real ``sparkd run`` subprocess with its API, a private state
dir, and this test's labels as the container selector; the dockerkit finalizer
removes exactly the containers carrying this test's case label.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from fvhelpers import free_port, wait_for
from privateengine import PrivateEngine
from sparkdapi import SparkdUnderTest
from sparkdproc import db_query

from sparkd.sense import procfs
from sparkd.units import GiB, MiB

pytest_plugins = ["dockerkit"]


def _inspect(docker_client: Any, cid: str) -> dict[str, Any]:
    return docker_client.api.inspect_container(cid)  # type: ignore[no-any-return]


def test_it_launches_the_container_and_it_becomes_ready(sparkd_factory: Any, docker_client: Any) -> None:
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    launched = s.wait_event("launched")
    d = launched["details"]
    assert d["image"].startswith("sparkd-test-vllm")
    assert "--port" in d["args"] and str(s.vllm_port) in d["args"]
    assert d["args"][d["args"].index("--shutdown-timeout") + 1] == "25"
    assert d["mem_limit_bytes"] == 3 * GiB == d["memswap_limit_bytes"]
    ins = _inspect(docker_client, c["container_id"])
    assert ins["Config"]["Labels"]["sparkd.managed"] == "true"
    assert ins["Config"]["Labels"]["sparkd.launch_id"] == c["launch_id"]
    assert ins["HostConfig"]["IpcMode"] == "host" and ins["HostConfig"]["NetworkMode"] == "host"
    assert ins["HostConfig"]["RestartPolicy"]["Name"] == "no"
    assert ins["HostConfig"]["Memory"] == 3 * GiB
    # the launch flags from the field: --init and a positive --oom-score-adj (settings' defaults)
    assert ins["HostConfig"]["Init"] is True and ins["HostConfig"]["OomScoreAdj"] == 500
    # PID 1 is Docker's init; exec form: its child is the server itself, not a shell
    cont = docker_client.containers.get(c["container_id"])
    rc, out = cont.exec_run(["cat", "/proc/1/cmdline"])
    assert rc == 0 and out.startswith(b"/sbin/docker-init")
    rc, out = cont.exec_run(["sh", "-c", "cat /proc/$(cut -d' ' -f1 /proc/1/task/1/children)/cmdline"])
    assert rc == 0 and out.startswith(b"/usr/bin/python3") and not out.startswith(b"/bin/sh")
    ready = s.wait_event("ready")["details"]
    assert ready["time_to_ready_s"] > 0 and ready["adopted"] is False  # sparkd saw it start: a healthy reading


def test_end_to_end_a_real_memory_trip_archives_stops_gracefully_and_cleans_shm(
    sparkd_factory: Any, docker_client: Any
) -> None:
    avail = procfs.read_meminfo().fields["MemAvailable"]
    threshold = avail - GiB
    s = sparkd_factory(
        rules=[{"name": "low_available", "when": [f"MemAvailable < {threshold}B"], "samples": 3}],
        container={"env": {"FAKEVLLM_STARTUP_S": "0.5", "HF_TOKEN": "hf_SECRET_DO_NOT_ARCHIVE"}},
    )
    s.start()
    c = s.wait_state("ready", 60)
    started = c["started_at"]
    names = s.vllm("POST", "/shm?n=5&kib=64")["names"]
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
    # a /dev/shm entry that a live host process (this test) holds open, created after the container started
    mine = f"/dev/shm/sparkd-test-held-{uuid.uuid4().hex[:8]}"
    fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    # an unrelated, unheld NCCL entry made by someone else (this test) after the container started (field)
    unrelated = f"/dev/shm/nccl-{uuid.uuid4().hex[:6]}"
    os.close(os.open(unrelated, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    try:
        assert os.stat(mine).st_mtime >= started
        # 2 GiB against a line 1 GiB down: MemAvailable here falls by as little as half of what is
        # allocated when the kernel reclaims page cache that MemAvailable did not count (CI saw no trip)
        s.vllm("POST", "/alloc?mib=2048")
        trip = s.wait_event("trip", 30)
        assert trip["message"].startswith("low_available: MemAvailable ")
        assert "for 3/3 samples" in trip["message"]
        stopped = s.wait_event("stopped", 60)
        rep = stopped["details"]
        assert rep["exit_code"] == 0 and rep["outcome"] == "exited"
        assert rep["durations_s"]["stop"] < 30
        # the archive holds every part, summary first
        arch = Path(s.tmp) / "archives" / rep["archive"]
        with tarfile.open(arch) as tf:
            members = tf.getnames()
            assert members[0] == "summary.txt"
            for part in (
                "container.log",
                "sparkd.log",
                "samples.csv",
                "kernel.log",
                "inspect.json",
                "config.json",
                "plan.json",
                "events.json",
            ):
                assert part in members, part
            summary = tf.extractfile("summary.txt").read().decode()  # type: ignore[union-attr]
            assert "low_available" in summary
            assert "NVRM errors in window: n/a (kernel log off)" in summary  # never a measured-looking 0
            clog = tf.extractfile("container.log").read().decode()  # type: ignore[union-attr]
            assert "Application startup complete" in clog
            samples = tf.extractfile("samples.csv").read().decode()  # type: ignore[union-attr]
            assert samples.startswith("ts,") and len(samples.splitlines()) > 3
            ins = json.loads(tf.extractfile("inspect.json").read())  # type: ignore[union-attr]
            assert ins["Id"] == c["container_id"]
            # secrets in the container's environment are not archived (names are)
            for member in tf.getmembers():
                data = tf.extractfile(member).read()  # type: ignore[union-attr]
                assert b"hf_SECRET_DO_NOT_ARCHIVE" not in data, member.name
            assert "HF_TOKEN=<redacted>" in ins["Config"]["Env"]
        # the container's /dev/shm entries are gone; the one this test holds open is kept
        for n in names:
            assert not os.path.exists(f"/dev/shm/{n}"), n
        assert os.path.exists(mine)
        kept = rep["shm_kept"]
        assert any(os.path.basename(mine) in k and "in use by pid" in k for k in kept)
        # sparkd's own decision (the file itself may be removed meanwhile by another tester's older sparkd
        # on this shared host: the very fault this fixes)
        assert os.path.basename(unrelated) not in rep["shm_removed"], rep["shm_removed"]
        assert any(k.startswith(os.path.basename(unrelated) + ": not tied to the container") for k in kept), kept
        assert s.container()["state"] == "stopped"
    finally:
        os.close(fd)
        os.unlink(mine)
        with contextlib.suppress(FileNotFoundError):  # (the assertion above says if it was removed)
            os.unlink(unrelated)


def test_a_container_that_ignores_sigterm_is_killed_after_30_s(sparkd_factory: Any) -> None:
    s = sparkd_factory(container={"env": {"FAKEVLLM_MODE": "ignore-term", "FAKEVLLM_STARTUP_S": "0.3"}}).start()
    s.wait_state("ready", 60)
    t0 = time.monotonic()
    r = s.api("POST", "/api/container/stop")
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    rep = r.json()["stop"]
    assert rep["exit_code"] == 137
    assert 28.0 <= rep["durations_s"]["stop"] <= 32.0
    assert 28.0 <= elapsed <= 40.0
    ev = s.wait_event("killed")
    assert "no exit within 30 s of SIGTERM" in ev["message"]


def test_kill_9_of_sparkd_then_restart_adopts_the_container(
    sparkd_factory: Any, docker_client: Any, case_labels: dict[str, str]
) -> None:
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    # a normal stop of sparkd (an upgrade) leaves the model serving (container.stop_on_exit = false)
    assert s.stop() == 0
    assert docker_client.containers.get(c["container_id"]).status == "running"
    s.start()
    assert s.wait_state("ready", 60)["container_id"] == c["container_id"]
    s.kill9()
    # the model keeps serving without sparkd
    assert docker_client.containers.get(c["container_id"]).status == "running"
    s.start()
    c2 = s.wait_state("ready", 60)
    assert c2["container_id"] == c["container_id"]
    assert s.wait_event("adopted")["details"]["container_id"] == c["container_id"]
    labelled = docker_client.containers.list(
        all=True, filters={"label": ["sparkd.managed=true", f"sparkd.test.case={case_labels['sparkd.test.case']}"]}
    )
    assert len(labelled) == 1


def test_stop_requested_twice_at_once_stops_once(sparkd_factory: Any) -> None:
    s = sparkd_factory(container={"env": {"FAKEVLLM_EXIT_DELAY_S": "2", "FAKEVLLM_STARTUP_S": "0.3"}}).start()
    s.wait_state("ready", 60)

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s.token}"}, timeout=120) as cl:
            url = f"http://127.0.0.1:{s.api_port}/api/container/stop"
            return list(await asyncio.gather(cl.post(url), cl.post(url)))

    responses = asyncio.run(both())
    assert sorted(r.status_code for r in responses) == [200, 409]
    refused = next(r for r in responses if r.status_code == 409).json()
    assert refused["error"] == "conflict" and "already stopping" in json.dumps(refused)
    assert len(s.events("stopped")) + len(s.events("killed")) == 1


def test_the_stop_path_also_works_from_the_cli(sparkd_factory: Any) -> None:

    s = sparkd_factory().start()
    s.wait_state("ready", 60)
    out = s.cli("stop", timeout_s=120)
    assert out.returncode == 0, out.stderr
    assert "stopped: exited (exit 0)" in out.stdout
    # the CLI is named as the source (was "api:token", as any script holding the token), archive name included
    assert "api:cli" in s.wait_event("stopped")["message"] + json.dumps(s.events("stopping"))
    assert list((Path(s.tmp) / "archives").glob("*api-cli*.tar.gz")), os.listdir(Path(s.tmp) / "archives")
    again = s.cli("stop")
    assert again.returncode == 1 and "is not running" in again.stderr


def test_docker_engine_down_and_back(tmp_path: Path, image: str, case_labels: dict[str, str]) -> None:
    """A private dockerd (its own data root and socket: the shared engine is never touched) is stopped while
    sparkd runs: sampling and rules go on, the engine is reported down, and sparkd reconnects."""
    engine = PrivateEngine().start()
    try:
        work = tmp_path / "s"
        work.mkdir()
        s = SparkdUnderTest(
            work,
            image,
            case_labels,
            container={"image": None, "guard": "no-such-container", "docker_url": engine.url},
        )
        s.start()
        try:
            assert wait_for(lambda: s.container()["engine"] == "up", 20)
            engine.stop()
            assert wait_for(lambda: s.container()["engine"] == "down", 20)
            down = s.wait_event("docker_down")
            n0 = s.status()["samples_taken"]
            time.sleep(1.5)
            st = s.status()
            assert st["samples_taken"] >= n0 + 4  # sampling goes on at 4 Hz
            assert st["container"]["state"] == "unknown" and st["container"]["engine"] == "down"
            assert all("counter" in r for r in st["rules"])
            engine.start()
            assert wait_for(lambda: s.container()["engine"] == "up", 30)
            up = s.wait_event("docker_up")
            assert up["ts"] > down["ts"]
        finally:
            s.stop()
    finally:
        engine.close(case_labels)


HIGH = "MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n"
LOW = "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 2097152 kB\n"


@contextlib.contextmanager
def _on_private_engine(
    tmp_path: Path, image: str, case_labels: dict[str, str], **container: Any
) -> Iterator[tuple[PrivateEngine, SparkdUnderTest, Path]]:
    """A private dockerd (a test may hang it) with the test image, and a sparkd managing a container on it whose
    low_available rule (< 6 GiB, 2 samples) reads a scripted /proc (``proc/meminfo``: ``HIGH`` at first); yields
    (engine, sparkd, proc). Both are stopped, and what the test left in the engine removed, on exit."""
    engine = PrivateEngine().start()
    try:
        engine.load(image)
        proc, shm = tmp_path / "proc", tmp_path / "shm"
        proc.mkdir()
        shm.mkdir()
        (proc / "meminfo").write_text(HIGH)
        work = tmp_path / "s"
        work.mkdir()
        s = SparkdUnderTest(
            work,
            image,
            case_labels,
            container={"docker_url": engine.url, "hard_floor": "1GiB", **container},
            rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
            top={"cooldown_s": 60.0, "proc_root": str(proc), "shm_dir": str(shm)},
        )
        s.start()
        try:
            yield engine, s, proc
        finally:
            s.stop()
    finally:
        engine.close(case_labels)


def test_a_trip_while_the_docker_engine_hangs_stops_the_model_by_its_processes(
    tmp_path: Path, image: str, case_labels: dict[str, str]
) -> None:
    """dockerd stopped (SIGSTOP: a daemon starved under memory pressure) while the model runs, then the rule
    trips. Before, each stop attempt waited out the API timeout (30-56 s) and failed, and the model ran on
    until the engine came back. Now the emergency stop pings first (3 s), says ``stop_without_docker``
    (critical), stops the container by its processes (SIGTERM to its init, through a pidfd), and the model is
    gone within seconds; when the engine answers again the container reads ``stopped``, not "exited
    unexpectedly"."""
    import signal

    from sparkd.act.procstop import ProcessStopper

    with _on_private_engine(tmp_path, image, case_labels) as (engine, s, proc):
        c = s.wait_state("ready", 60)
        stopper = ProcessStopper(c["container_id"])
        before = stopper.pids()
        assert before, "no process of the container found by its cgroup"
        assert engine.proc is not None
        os.kill(engine.proc.pid, signal.SIGSTOP)  # hung: connections are accepted, nothing answers
        try:
            t0 = time.monotonic()
            (proc / "meminfo").write_text(LOW)  # the rule trips
            said = s.wait_event("stop_without_docker", 20)
            assert "the Docker engine does not answer" in said["message"]
            assert sorted(said["details"]["pids"]) == before
            severity = db_query(s.db, "SELECT severity FROM events WHERE kind='stop_without_docker'")
            assert severity == [("critical",)]
            assert wait_for(lambda: stopper.pids() == [], 30, 0.1), f"still running: {stopper.pids()}"
            took_s = time.monotonic() - t0
            assert "stopped by its processes" in s.wait_event("stopping", 5)["message"]
            done = wait_for(lambda: s.events("stopped") + s.events("killed"), 10)
            assert done and "(exit code not known)" in done[0]["message"], done
            assert not s.events("stop_not_executed")
            # the archive, without what only the engine has (it would wait out the API timeout first)
            arch = Path(s.tmp) / "archives" / done[0]["details"]["archive"]
            with tarfile.open(arch) as tf:
                members = tf.getnames()
                assert members[0] == "summary.txt"
                for part in ("sparkd.log", "samples.csv", "kernel.log", "config.json", "events.json"):
                    assert part in members, (part, members)
                for part in ("container.log", "inspect.json"):
                    assert part not in members and f"{part}.missing" in members, members
                    why = tf.extractfile(f"{part}.missing").read().decode()  # type: ignore[union-attr]
                    assert "the Docker engine does not answer" in why, why
                samples = tf.extractfile("samples.csv").read().decode()  # type: ignore[union-attr]
                assert len(samples.splitlines()) > 2, samples  # the samples that led to the trip
        finally:
            os.kill(engine.proc.pid, signal.SIGCONT)
        assert took_s < 15.0, f"the model ran {took_s:.1f} s after the trip with the engine hung"
        (proc / "meminfo").write_text(HIGH)
        # the engine answers again: sparkd's stop, not an unexpected exit
        assert s.wait_state("stopped", 60)["container_id"] == c["container_id"]
        assert not s.events("exited")


def test_a_trip_while_containerd_hangs_under_an_answering_dockerd_stops_the_model_by_its_processes(
    tmp_path: Path, image: str, case_labels: dict[str, str]
) -> None:
    """containerd stopped while dockerd still answers its ping (and inspect): the stop went through Docker, and the
    stop, the kill and the inspect each waited out the API timeout. A hostile test measured 245 s from the trip to
    the stop by the processes, with a ``stopped`` event written at 185 s while the model still served. Now the stop
    is given the grace plus ``ENGINE_MARGIN_S`` (10 s); then ``stop_unconfirmed`` (critical) says the model may still
    run, and the processes are stopped."""
    import signal

    from sparkd.act.procstop import ProcessStopper
    from sparkd.act.stop import ENGINE_MARGIN_S

    with _on_private_engine(tmp_path, image, case_labels, stop_timeout_s=2.0) as (engine, s, proc):
        c = s.wait_state("ready", 60)
        stopper = ProcessStopper(c["container_id"])
        assert stopper.pids(), "no process of the container found by its cgroup"
        assert engine.proc is not None
        containerd = [_containerd_of(engine)]
        os.kill(containerd[0], signal.SIGSTOP)
        try:
            assert engine.ping()  # dockerd answers: the emergency's ping says "up"
            t0 = time.monotonic()
            (proc / "meminfo").write_text(LOW)
            said = s.wait_event("stop_unconfirmed", 2.0 + ENGINE_MARGIN_S + 20)
            assert "NOT confirmed" in said["message"] and "did not return within" in said["message"], said
            assert s.wait_event("stop_without_docker", 20)
            assert wait_for(lambda: stopper.pids() == [], 30, 0.1), f"still running: {stopper.pids()}"
            took_s = time.monotonic() - t0
            done = wait_for(lambda: s.events("stopped") + s.events("killed"), 15)  # after its archive
            assert done and all(
                "by its processes" in e["message"] or "exit code not known" in e["message"] for e in done
            ), done
            sev = db_query(s.db, "SELECT severity FROM events WHERE kind='stop_unconfirmed'")
            assert sev == [("critical",)]
            # containerd still hung, the processes gone: the stop is not taken through the engine again (it did, every
            # step: a new archive, "stopping" and a critical stop_unconfirmed every ~15 s for as long as it hung)
            time.sleep(2.0 + ENGINE_MARGIN_S + 5)
            assert len(s.events("stop_unconfirmed")) == 1 and len(s.events("stopping")) == 2, s.events("stopping")
            # the archive before the stop through Docker, and the stop by the processes' own: no more
            assert len(list((Path(s.tmp) / "archives").glob("*.tar.gz"))) == 2
        finally:
            os.kill(containerd[0], signal.SIGCONT)
        print(f"containerd hung: the model was gone {took_s:.1f} s after the trip")
        assert took_s < 2.0 + ENGINE_MARGIN_S + 15, f"the model ran {took_s:.1f} s after the trip"
        (proc / "meminfo").write_text(HIGH)


def test_an_operators_stop_while_containerd_hangs_is_made_by_the_processes_not_said_done(
    tmp_path: Path, image: str, case_labels: dict[str, str]
) -> None:
    """``sparkd stop`` with containerd hung under an answering dockerd: it answered "stopped: None (exit None)" and
    exited 0 while the model still ran. The unconfirmed stop now falls back to the processes, and says so."""
    import signal

    from sparkd.act.procstop import ProcessStopper

    with _on_private_engine(tmp_path, image, case_labels, stop_timeout_s=2.0) as (engine, s, _proc):
        c = s.wait_state("ready", 60)
        stopper = ProcessStopper(c["container_id"])
        assert stopper.pids() and engine.proc is not None
        containerd = _containerd_of(engine)
        os.kill(containerd, signal.SIGSTOP)
        try:
            out = s.cli("stop", timeout_s=120)
            assert out.returncode == 0, out.stderr
            assert "by its processes" in out.stdout and "not confirmed" in out.stdout, out.stdout
            assert stopper.pids() == []
            assert s.events("stop_unconfirmed")
        finally:
            os.kill(containerd, signal.SIGCONT)


def test_after_an_engine_hung_in_the_stop_the_processes_get_what_is_left_of_the_grace_not_a_second_one(
    tmp_path: Path, image: str, case_labels: dict[str, str]
) -> None:
    """containerd hung under an answering dockerd, a model that ignores SIGTERM, a 12 s grace: the stop through
    Docker takes the grace + ``ENGINE_MARGIN_S`` (22 s), then the processes were given a second full grace (12 s
    more; ~70 s to SIGKILL at the default 30 s). Now they get what is left of it, at least
    ``FALLBACK_MIN_GRACE_S`` (5 s): SIGKILL ~5 s after ``stop_without_docker``."""
    import signal

    from sparkd.act.procstop import ProcessStopper
    from sparkd.act.stop import ENGINE_MARGIN_S, FALLBACK_MIN_GRACE_S

    grace_s = 12.0
    with _on_private_engine(
        tmp_path, image, case_labels, stop_timeout_s=grace_s, env={"FAKEVLLM_MODE": "ignore-term"}
    ) as (engine, s, proc):
        c = s.wait_state("ready", 60)
        stopper = ProcessStopper(c["container_id"])
        assert stopper.pids()
        containerd = _containerd_of(engine)
        os.kill(containerd, signal.SIGSTOP)
        try:
            (proc / "meminfo").write_text(LOW)
            said = s.wait_event("stop_without_docker", grace_s + ENGINE_MARGIN_S + 20)
            seen = time.monotonic()
            d = said["details"]
            assert d["grace_s"] == FALLBACK_MIN_GRACE_S and d["stop_began_s_ago"] >= grace_s, d
            left = f"SIGKILL after {FALLBACK_MIN_GRACE_S:g} s (what is left of the {grace_s:g} s grace"
            assert left in said["message"], said["message"]
            assert wait_for(lambda: stopper.pids() == [], grace_s + 10, 0.1), f"still running: {stopper.pids()}"
            took_s = time.monotonic() - seen
        finally:
            os.kill(containerd, signal.SIGCONT)
        print(f"SIGTERM ignored: the processes were killed {took_s:.1f} s after stop_without_docker")
        assert FALLBACK_MIN_GRACE_S - 1.0 <= took_s < grace_s - 2.0, took_s
        (proc / "meminfo").write_text(HIGH)


def _containerd_of(engine: PrivateEngine) -> int:
    """The pid of the containerd a private dockerd started (its child)."""
    assert engine.proc is not None
    kids = subprocess.run(["pgrep", "-P", str(engine.proc.pid), "-x", "containerd"], capture_output=True, text=True)
    pids = [int(x) for x in kids.stdout.split()]
    assert len(pids) == 1, kids
    return pids[0]


def test_an_operators_stop_while_the_docker_engine_hangs_stops_the_model_by_its_processes(
    tmp_path: Path, image: str, case_labels: dict[str, str]
) -> None:
    """An operator presses stop (``POST /api/container/stop``) while dockerd hangs: memory runs short, the
    engine is starved with the rest, and that is when the model must go. Before, the call waited out the
    engine's API timeout (30 s) and was refused (503) with the model still running. Now the stop is made by
    the container's processes after a 3 s ping, the answer says so, and the model stays stopped when the
    engine answers again (the operator's intent holds: no relaunch)."""
    import signal

    from sparkd.act.procstop import ProcessStopper

    engine = PrivateEngine().start()
    try:
        engine.load(image)
        work = tmp_path / "s"
        work.mkdir()
        s = SparkdUnderTest(work, image, case_labels, container={"docker_url": engine.url})
        s.start()
        try:
            c = s.wait_state("ready", 60)
            stopper = ProcessStopper(c["container_id"])
            assert stopper.pids(), "no process of the container found by its cgroup"
            assert engine.proc is not None
            os.kill(engine.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                r = s.api("POST", "/api/container/stop", timeout=60)
                took_s = time.monotonic() - t0
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["stopped_by"] == "processes", body
                assert "ping" in body["engine_error"], body
                assert body["message"].startswith("stopped ") and "by its processes" in body["message"], body
                assert body["left_pids"] == [] and stopper.pids() == [], f"still running: {stopper.pids()}"
                # the archive, written after the stop, without the engine's parts
                arch = Path(s.tmp) / "archives" / body["stop"]["archive"]
                with tarfile.open(arch) as tf:
                    assert {"summary.txt", "samples.csv", "container.log.missing"} <= set(tf.getnames())
                said = s.wait_event("stop_without_docker", 5)
                assert said["message"].startswith("api:"), said
                assert s.container()["engine"] == "down"
            finally:
                os.kill(engine.proc.pid, signal.SIGCONT)
            assert took_s < 15.0, f"the stop took {took_s:.1f} s with the engine hung"
            after = s.wait_state("stopped", 60)
            assert after["container_id"] == c["container_id"]
            # the operator's intent holds the model down: no relaunch is scheduled
            sup = after["supervision"]
            assert sup["intent"]["intent"] == "operator" and sup["intent"]["who"].startswith("api:"), sup
            assert sup["pending_relaunch"] is None, sup
            assert not s.events("exited"), s.output()[-2000:]
            assert len(s.events("launched")) == 1, s.events("launched")  # the first launch only
        finally:
            s.stop()
    finally:
        engine.close(case_labels)


def test_a_restart_policy_does_not_undo_a_stop_made_while_the_engine_hung(
    tmp_path: Path, image: str, case_labels: dict[str, str]
) -> None:
    """A guarded container started by hand with ``--restart unless-stopped``: killing its processes is not a
    ``docker stop``, so the engine, once it answers, restarts it. sparkd finishes the stop through Docker
    (``finish_stop_with_docker``): the model ends stopped, and sparkd says ``stopped``, not ``stopping``."""
    import signal
    import subprocess

    from sparkd.act.procstop import ProcessStopper

    engine = PrivateEngine().start()
    try:
        engine.load(image)
        port = free_port()
        name = f"sparkd-test-{case_labels['sparkd.test.case']}"
        labels = [x for k, v in case_labels.items() for x in ("--label", f"{k}={v}")]
        cid = subprocess.run(
            ["docker", "-H", engine.url, "run", "-d", "--name", name, *labels, "--network", "host",
             "--restart", "unless-stopped", "-e", "FAKEVLLM_STARTUP_S=0.3", image,
             "serve", "/models/fake", "--port", str(port), "--shutdown-timeout", "25"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        proc, shm = tmp_path / "proc", tmp_path / "shm"
        proc.mkdir()
        shm.mkdir()
        (proc / "meminfo").write_text(HIGH)
        work = tmp_path / "s"
        work.mkdir()
        s = SparkdUnderTest(
            work,
            image,
            case_labels,
            container={"image": None, "guard": name, "port": port, "docker_url": engine.url, "hard_floor": "1GiB"},
            rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
            top={"cooldown_s": 60.0, "proc_root": str(proc), "shm_dir": str(shm)},
        )
        s.start()
        try:
            assert s.wait_state("ready", 60)["container_id"] == cid
            assert engine.proc is not None
            os.kill(engine.proc.pid, signal.SIGSTOP)
            try:
                (proc / "meminfo").write_text(LOW)
                s.wait_event("stop_without_docker", 20)
                assert wait_for(lambda: ProcessStopper(cid).pids() == [], 30, 0.1)
            finally:
                os.kill(engine.proc.pid, signal.SIGCONT)
            (proc / "meminfo").write_text(HIGH)

            def running() -> bool:
                cmd = ["docker", "-H", engine.url, "inspect", "-f", "{{.State.Running}}", cid]
                out = subprocess.run(cmd, capture_output=True, text=True)
                return out.stdout.strip() == "true"

            # the engine may restart it (its policy never saw a docker stop): sparkd stops it through Docker
            assert s.wait_state("stopped", 60)["container_id"] == cid
            assert wait_for(lambda: not running(), 60, 0.2)
            time.sleep(3.0)  # and it stays stopped
            assert not running() and s.container()["state"] == "stopped"
        finally:
            s.stop()
    finally:
        engine.close(case_labels)


def test_a_stopped_model_stays_stopped_across_restarts_of_sparkd(sparkd_factory: Any, docker_client: Any) -> None:
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    r = s.api("POST", "/api/container/start")
    assert r.status_code == 422 and "already running" in r.text
    assert s.api("POST", "/api/container/stop").status_code == 200
    s.kill9()
    s.start()
    ev = s.wait_event("staying_stopped", 20)
    assert "ended 'stopped'" in ev["message"] and "sparkd start" in ev["message"]
    time.sleep(2.0)
    assert len(s.events("launched")) == 1
    after = s.container()
    assert after["stay_stopped"] is True
    # says what it is: the stopped container, not "none"
    assert after["state"] == "stopped", after
    assert after["name"] == c["name"] and after["image"] == c["image"]
    assert "sparkd start" in (after["state_reason"] or "")

    out = s.cli("status").stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("container:"))
    assert line.startswith(f"container: stopped {c['name']}") and "stays stopped until `sparkd start`" in line, out
    assert s.api("POST", "/api/container/start").status_code == 200
    c2 = s.wait_state("ready", 60)
    assert c2["container_id"] != c["container_id"]


def test_a_container_removed_outside_sparkd_is_not_relaunched(sparkd_factory: Any, docker_client: Any) -> None:
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    docker_client.containers.get(c["container_id"]).remove(force=True)
    ev = s.wait_event("container_gone", 20)
    assert "removed outside sparkd" in ev["message"]
    time.sleep(2.0)
    assert len(s.events("launched")) == 1 and s.container()["state"] == "none"


def test_a_container_run_by_hand_with_sparkds_labels_is_adopted_at_once_not_at_the_next_trip(
    sparkd_factory: Any, docker_client: Any
) -> None:
    """``docker rm -f`` of sparkd's container, then ``docker run`` of the same image with sparkd's own labels: a
    container sparkd would adopt at start-up, so it is sparkd's to guard now. It showed "none" (and no
    ``unguarded`` either: it carries the label) until the next trip found and stopped it (note 11). The run is a new
    one: none of the removed run's figures (ready time) are shown as its own."""
    from sparkd.act.containerspec import LABEL_LAUNCH_ID

    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    old = docker_client.containers.get(c["container_id"])
    cfg = old.attrs["Config"]
    old.remove(force=True)
    s.wait_event("container_gone", 20)
    by_hand = docker_client.containers.run(
        cfg["Image"],
        cfg["Cmd"],
        name=c["name"],
        environment=cfg["Env"],
        # sparkd.managed=true and this sparkd's selector (the test's case labels); no launch of sparkd's
        labels={k: v for k, v in cfg["Labels"].items() if k != LABEL_LAUNCH_ID},
        mem_limit=c["memory_bytes"] + 128 * MiB,  # its own --memory, not the removed run's
        memswap_limit=c["memory_bytes"] + 128 * MiB,
        network_mode="host",
        detach=True,
    )
    ev = s.wait_event("adopted", 20)
    assert ev["details"]["container_id"] == by_hand.id and "no launch record" in ev["message"], ev
    c2 = s.wait_state("ready", 60)
    assert c2["container_id"] == by_hand.id and c2["ready_at"] > c["ready_at"], (c, c2)
    assert c2["memory_bytes"] == c["memory_bytes"] + 128 * MiB, (c, c2)
    assert wait_for(lambda: len(s.events("ready")) == 2, 10)  # its own readiness, said
    # first seen already running: its `ready` is no healthy figure for the loop guard (its load is unknown)
    assert [e["details"].get("adopted") for e in s.events("ready")] == [False, True]
    assert s.container()["unguarded"] is None and s.events("memory_limit_changed") == []
    assert s.api("POST", "/api/container/stop").status_code == 200  # and it is sparkd's to stop
    assert s.wait_state("stopped", 60)["container_id"] == by_hand.id
    by_hand.reload()
    assert by_hand.status == "exited"
    assert len(s.events("launched")) == 1  # adopted, never relaunched


def test_a_docker_update_of_the_memory_limit_by_hand_is_shown_and_said(sparkd_factory: Any, docker_client: Any) -> None:
    """``docker update --memory`` of sparkd's running container: the status kept the launch's figure (note 11).
    Now it shows Docker's limit from the next observation, and a warning says the plan assumed the old one."""
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    launched = c["memory_bytes"]
    assert launched, c  # the test launch passes a --memory
    new = launched + 64 * MiB
    docker_client.containers.get(c["container_id"]).update(mem_limit=new, memswap_limit=new)
    ev = s.wait_event("memory_limit_changed", 20)
    assert ev["severity"] == "warning" and ev["details"]["memory_bytes"] == new, ev
    assert ev["details"]["was_bytes"] == launched and "docker update" in ev["message"], ev
    assert s.container()["memory_bytes"] == new and ev["details"]["swap_bytes"] == 0, ev
    time.sleep(2.5)
    assert len(s.events("memory_limit_changed")) == 1  # said once (not at the launch, not at each observation)
    # `docker update --memory` back down alone: Docker keeps --memory-swap, and the difference is swap (note 12)
    docker_client.containers.get(c["container_id"]).update(mem_limit=launched)
    host = docker_client.containers.get(c["container_id"]).attrs["HostConfig"]
    # 64 MiB of swap (MemorySwap kept at the old figure); -1 where the kernel has no swap accounting
    assert (host["Memory"], host["MemorySwap"]) in ((launched, new), (launched, -1)), host
    ev = s.wait_event("memory_limit_changed", 20, nth=2)
    swap = 64 * MiB if host["MemorySwap"] == new else -1
    assert ev["details"]["memory_bytes"] == launched and ev["details"]["swap_bytes"] == swap, ev
    said = "0.06 GiB of swap beyond --memory" if swap > 0 else "unlimited swap"
    assert ev["severity"] == "warning" and said in ev["message"] and "--memory-swap M" in ev["message"], ev
    docker_client.containers.get(c["container_id"]).update(mem_limit=launched, memswap_limit=launched)
    ev = s.wait_event("memory_limit_changed", 20, nth=3)
    assert ev["details"]["swap_bytes"] == 0 and "may no longer swap" in ev["message"], ev
    assert len(s.events("memory_limit_changed")) == 3


def test_a_same_name_container_started_by_hand_is_said_to_be_unguarded(
    sparkd_factory: Any, docker_client: Any, image: str, case_labels: dict[str, str]
) -> None:
    """sparkd's container removed, then ``docker run --name <the same name>`` by hand: sparkd will not stop a
    container without its label, so it must say at once that no stop rule protects the host from this one
    (it said nothing: status read "none" while a model ran)."""
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    docker_client.containers.get(c["container_id"]).remove(force=True)
    s.wait_event("container_gone", 20)
    by_hand = docker_client.containers.run(
        image,
        name=c["name"],
        entrypoint=["/usr/bin/python3", "-c", "import time; time.sleep(600)"],
        labels=case_labels,  # the test's labels, not sparkd.managed
        network_mode="host",
        detach=True,
    )
    ev = s.wait_event("unguarded_container", 20)
    assert by_hand.id[:12] in ev["message"] and "will not stop it" in ev["message"], ev
    assert ev["details"]["container_id"] == by_hand.id
    u = s.container()["unguarded"]
    assert u["id"] == by_hand.id and u["name"] == c["name"]
    live = s.api("GET", "/ui/live.json").json()  # the dashboard's header: never "ok" while it runs
    assert live["level"] == "critical" and "not guarded" in live["label"], live
    card = s.api("GET", "/ui/container").text
    assert "Not guarded." in card and by_hand.id[:12] in card, card

    def cli_status() -> str:
        return s.cli("status").stdout

    # `sparkd status` reads the status snapshot, written within a second of a change (at the next tick): on a
    # loaded 2-CPU runner the first read can come before it (CI saw "status of 1 s ago" without the line)
    want = f"NOT GUARDED: container {c['name']} ({by_hand.id[:12]})"
    outs = [""]

    def shows_it() -> bool:
        outs.append(cli_status())
        return want in outs[-1]

    assert wait_for(shows_it, 15, 0.5), outs[-1]
    time.sleep(2.0)
    assert len(s.events("unguarded_container")) == 1  # said once per container, not once a second
    by_hand.remove(force=True)
    s.wait_event("unguarded_container_gone", 20)
    assert s.container()["unguarded"] is None
    assert len(s.events("launched")) == 1  # nothing was relaunched meanwhile


def test_a_hand_run_container_under_the_name_of_sparkds_stopped_and_renamed_one_is_said_to_be_unguarded(
    sparkd_factory: Any, docker_client: Any, image: str, case_labels: dict[str, str]
) -> None:
    """sparkd stops its model, someone renames that container and runs another by hand under the name: sparkd
    still tracked its own (stopped) one and said the name's model was "not running" (an adversarial helper's
    finding). A paused one still holds its memory: still unguarded."""
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    assert s.api("POST", "/api/container/stop").status_code == 200
    s.wait_state("stopped", 30)
    docker_client.containers.get(c["container_id"]).rename(f"{c['name']}-old")
    by_hand = docker_client.containers.run(
        image,
        name=c["name"],
        entrypoint=["/usr/bin/python3", "-c", "import time; time.sleep(600)"],
        labels=case_labels,
        network_mode="host",
        detach=True,
    )
    ev = s.wait_event("unguarded_container", 20)
    assert ev["details"]["container_id"] == by_hand.id
    assert s.container()["unguarded"]["id"] == by_hand.id
    by_hand.pause()
    time.sleep(2.5)
    assert s.events("unguarded_container_gone") == [] and s.container()["unguarded"]["id"] == by_hand.id
    by_hand.unpause()
    by_hand.remove(force=True)
    s.wait_event("unguarded_container_gone", 20)
    assert len(s.events("unguarded_container")) == 1


def test_a_second_container_with_sparkds_labels_beside_the_watched_run_is_said_to_be_unguarded(
    sparkd_factory: Any, docker_client: Any, image: str
) -> None:
    """A second model started by hand while sparkd's run is active, with the labels of the watched one (copied
    from ``docker inspect``, its launch id too): sparkd watches one run at a time and a trip stops that one only.
    It was neither adopted nor said (note 12); now it is ``unguarded_container`` (critical) until it ends, and
    sparkd keeps watching its own run."""
    s = sparkd_factory().start()
    c = s.wait_state("ready", 60)
    labels = docker_client.containers.get(c["container_id"]).labels
    assert labels.get("sparkd.managed") == "true" and labels.get("sparkd.launch_id"), labels
    second = docker_client.containers.run(
        image,
        name=f"{c['name']}-by-hand",
        entrypoint=["/usr/bin/python3", "-c", "import time; time.sleep(600)"],
        labels=labels,  # the case's labels among them: the fixture removes it if this test fails
        network_mode="host",
        detach=True,
    )
    try:
        ev = s.wait_event("unguarded_container", 25)  # the look comes every UNGUARDED_CHECK_S (10 s) while it runs
        assert ev["severity"] == "critical" and ev["details"]["container_id"] == second.id, ev
        assert ev["details"]["labelled"] is True and "beside the one sparkd watches" in ev["message"], ev
        now = s.container()
        assert now["container_id"] == c["container_id"] and now["state"] == "ready", now  # its own run, still
        assert now["unguarded"]["id"] == second.id and now["unguarded"]["labelled"] is True
        live = s.api("GET", "/ui/live.json").json()
        assert live["level"] == "critical" and "not guarded" in live["label"], live
        second.remove(force=True)
        s.wait_event("unguarded_container_gone", 25)
        assert s.container()["unguarded"] is None
        assert len(s.events("unguarded_container")) == 1  # said once, not at each look
        assert len(s.events("launched")) == 1
    finally:
        with contextlib.suppress(Exception):
            second.remove(force=True)


def _scripted_sparkd(
    tmp_path: Path, image: str, case_labels: dict[str, str], *, state_dir: Path | None = None, **top: Any
) -> tuple[SparkdUnderTest, Path]:
    """A started sparkd managing a container on the shared engine, whose low_available rule (< 6 GiB, 2 samples)
    reads a scripted /proc (``proc/meminfo``: ``HIGH`` at first), a 2 s grace; ``state_dir`` elsewhere than its
    work dir (its log stays in ``tmp_path/logs``). Returns (sparkd, proc)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(HIGH)
    work = tmp_path / "s"
    work.mkdir()
    where = {"state_dir": str(state_dir), "log_dir": str(tmp_path / "logs")} if state_dir is not None else {}
    s = SparkdUnderTest(
        work,
        image,
        case_labels,
        container={"hard_floor": "1GiB", "stop_timeout_s": 2.0},
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        top={"proc_root": str(proc), **where, **top},
    )
    if state_dir is not None:
        s.db = state_dir / "sparkd.db"
    return s.start(), proc


@contextlib.contextmanager
def _frozen_mount(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    """A small ext4 file system on a loop device, mounted at ``tmp_path/mnt``; yields (mount point, freeze(bool))
    (``fsfreeze``: every write to it blocks until thawed, as on storage that hung; ``freeze`` of the state it is in
    does nothing). Thawed and unmounted on exit; a test thaws it before it stops its sparkd, which may be blocked on
    it in uninterruptible sleep (SIGKILL waits for the thaw: a failed assertion hung the suite)."""
    from conftest import need

    need(os.geteuid() == 0 and shutil.which("fsfreeze") is not None, "root and fsfreeze (util-linux)")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    frozen = [False]

    def freeze(on: bool) -> None:
        if on != frozen[0]:
            subprocess.run(["fsfreeze", "-f" if on else "-u", str(mnt)], check=True, timeout=30)
            frozen[0] = on

    try:
        yield mnt, freeze
    finally:
        if frozen[0]:
            subprocess.run(["fsfreeze", "-u", str(mnt)], check=False, timeout=30)
        for _ in range(50):  # the daemon may still hold files there for a moment
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)


def test_a_trip_with_the_state_dir_on_hung_storage_stops_the_model_without_waiting_for_it(
    tmp_path: Path, image: str, case_labels: dict[str, str], launcher: Any
) -> None:
    """The state directory's storage hung (``fsfreeze``): the emergency stop waited on the stop intent's fsync and on
    its archive before the SIGTERM, until the thaw, while the status said "ready" (a hostile test: 40 s; a slow
    disk, 12 s; note 11). Each write is now waited for a bounded time (``SAVE_WAIT_S``, ``ARCHIVE_WAIT_S``), said
    (critical), and finished in the background."""
    from sparkd.act.procstop import ProcessStopper
    from sparkd.act.stop import ARCHIVE_WAIT_S
    from sparkd.loop.launchbook import LAUNCH_RECORD_WAIT_S
    from sparkd.loop.unattended import SAVE_WAIT_S

    with _frozen_mount(tmp_path) as (mnt, freeze):
        s, proc = _scripted_sparkd(tmp_path, image, case_labels, state_dir=mnt / "state")
        try:
            c = s.wait_state("ready", 60)
            stopper = ProcessStopper(c["container_id"])
            assert stopper.pids()
            freeze(True)
            t0 = time.monotonic()
            (proc / "meminfo").write_text(LOW)
            assert wait_for(lambda: stopper.pids() == [], 2 * SAVE_WAIT_S + ARCHIVE_WAIT_S + 20, 0.2), (
                "the model still runs with the state dir's storage hung"
            )
            took_s = time.monotonic() - t0
            print(f"state dir frozen: the model was gone {took_s:.1f} s after the trip")
            # the stop's end does not wait on the storage either: the action's lock is free (a start is not refused
            # as busy) while it is still frozen; it was held until the thaw by the launch record's write
            assert wait_for(lambda: not s.container()["busy"], LAUNCH_RECORD_WAIT_S + 15, 0.2), s.container()
            freeze(False)
            said = s.wait_event("archive_delayed", 30)
            assert said["severity"] == "critical" and "storage slow or hung" in said["message"], said
            assert s.wait_event("supervision_state_slow", 10)["severity"] == "critical"
            assert s.wait_event("archive_written_late", 30)
            assert s.wait_state("stopped", 30)["container_id"] == c["container_id"]
        finally:
            (proc / "meminfo").write_text(HIGH)
            freeze(False)  # before the stop: a process blocked on frozen storage cannot be killed (D state)
            s.stop()
    assert took_s < 2 * SAVE_WAIT_S + ARCHIVE_WAIT_S + 10, took_s


def test_a_trip_on_a_full_state_disk_is_remembered_once_there_is_room_again(
    tmp_path: Path, image: str, case_labels: dict[str, str], launcher: Any
) -> None:
    """The state dir's disk full at a trip: the stop worked, but the launch's end (no database) and the stop intent
    (``supervision.json``) were never written, not even once there was room again, and a restart relaunched the model
    the rule had stopped (note 11). Both are now written when the disk has room, and the restart keeps it stopped."""
    from conftest import need

    need(os.geteuid() == 0, "root, to mount a small tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], check=True)
    try:
        s, proc = _scripted_sparkd(tmp_path, image, case_labels, state_dir=mnt / "state")
        try:
            c = s.wait_state("ready", 60)
            filler = mnt / "filler"
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)  # until ENOSPC
            (proc / "meminfo").write_text(LOW)
            assert wait_for(lambda: s.container()["state"] == "stopped", 60), s.container()
            (proc / "meminfo").write_text(HIGH)
            time.sleep(1.0)
            filler.unlink()  # room again, sparkd still running
            state = mnt / "state" / "supervision.json"
            assert wait_for(
                lambda: (
                    state.exists()
                    and '"emergency"' in state.read_text()
                    and db_query(s.db, "SELECT status FROM launches WHERE id=?", (c["launch_id"],)) == [("stopped",)]
                ),
                90,
                0.5,
            ), (state.read_text() if state.exists() else "no file", db_query(s.db, "SELECT id, status FROM launches"))
            s.stop()
            s.start()
            kept = s.wait_event("staying_stopped", 30)["message"]
            assert "stop intent emergency" in kept and "`sparkd start` launches again" in kept, kept
            time.sleep(3.0)
            assert s.container()["state"] == "stopped" and s.container()["stay_stopped"] is True, s.container()
            assert len(s.events("launched")) == 1  # not relaunched at the restart
        finally:
            (proc / "meminfo").write_text(HIGH)
            s.stop()
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)


def test_a_container_paused_while_sparkd_was_down_is_adopted_and_a_trip_stops_it(
    tmp_path: Path, image: str, case_labels: dict[str, str], docker_client: Any, launcher: Any
) -> None:
    """``docker pause`` of the model while sparkd was not running: at its start sparkd found no running container
    (state ``none``), tried to remove the paused one to launch, and every trip said "not running" while the paused
    model held its memory (note 11). A paused container is adopted, and the trip stops it."""
    s, proc = _scripted_sparkd(tmp_path, image, case_labels, cooldown_s=5.0)
    try:
        c = s.wait_state("ready", 60)
        s.stop()  # sparkd down, the model left running (stop_on_exit is off by default)
        box = docker_client.containers.get(c["container_id"])
        box.pause()
        s.start()
        assert wait_for(lambda: s.container()["container_id"] == c["container_id"], 30), s.container()
        assert not s.events("launch_refused")
        (proc / "meminfo").write_text(LOW)
        assert wait_for(lambda: docker_client.api.inspect_container(box.id)["State"]["Running"] is False, 60), s.events(
            "stop_not_executed"
        )
    finally:
        (proc / "meminfo").write_text(HIGH)
        s.stop()


def test_a_flood_of_dashboard_requests_does_not_hold_up_the_emergency_stop(
    tmp_path: Path, image: str, case_labels: dict[str, str], launcher: Any
) -> None:
    """150 keep-alive connections asking for the dashboard as fast as it answers (no token needed on loopback): each
    step of the stop that waits in a worker thread (the archive's reads, the /dev/shm witness) waited behind the
    page renders on the one event loop, and the SIGTERM went out 6–10 s after the trip (helper-33; 0.4 s without
    the flood). From the stop's decision until its SIGTERM is out the API now reads no new request
    (``httpserver.ReadHold``): the requests under way are answered, then the stop has the loop."""
    import sys

    from sparkd.act.procstop import ProcessStopper

    s, proc = _scripted_sparkd(tmp_path, image, case_labels)
    flood: subprocess.Popen[str] | None = None
    try:
        c = s.wait_state("ready", 60)
        stopper = ProcessStopper(c["container_id"])
        assert stopper.pids()
        flood = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "flood.py"), str(s.api_port), "150"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(5)  # the flood at full speed
        (proc / "meminfo").write_text(LOW)
        t0 = time.monotonic()
        assert wait_for(lambda: stopper.pids() == [], 60, 0.1), "the model still runs"
        gone_s = time.monotonic() - t0
        trip = s.wait_event("trip", 10)
        stopping = s.wait_event("stopping", 10)
        stopped = s.wait_event("stopped", 30)
        flood.terminate()
        out, _ = flood.communicate(timeout=30)
        answered = int(out.split("answered=")[1].split()[0])
        print(
            f"flood of 150 connections ({answered} answers): model gone {gone_s:.1f} s after memory fell; "
            f"stop durations {stopped['details']['durations_s']}"
        )
        assert answered > 300, out  # the flood did load the API
        # 2 samples at 0.25 s to the trip, the archive, then the SIGTERM: the fake model exits at once
        assert stopping["ts"] - trip["ts"] < 1.0, (trip, stopping)
        assert stopped["details"]["durations_s"]["archive"] < 3.0, stopped["details"]
        assert gone_s < 6.0, gone_s
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
        (proc / "meminfo").write_text(HIGH)
        s.stop()
