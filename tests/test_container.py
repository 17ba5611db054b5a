"""ContainerManager against the real Docker engine and the fakevllm image.

Short grace periods here; the real default (``stop(timeout_s=30)``) is asserted
on the signature, not waited for.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Any

import httpx
import pytest
from fvhelpers import Launched, wait_for

from sparkd.act.docker import (
    LABEL_LAUNCH_ID,
    LABEL_MANAGED,
    LABEL_PORT,
    LABEL_REVISION,
    ContainerManager,
    LaunchSpec,
)
from sparkd.core.supervision import guard_candidates
from sparkd.errors import Conflict, DockerUnavailable, InvalidInput, NotFound, Refused
from sparkd.sense.vllm_http import health_check, progress_stalled, read_vllm_metrics
from sparkd.units import MiB

pytestmark = pytest.mark.docker
pytest_plugins = ["dockerkit"]  # fixtures: mgr, launcher, image, docker_client


def test_it_launches_a_labelled_limited_container_that_becomes_healthy(mgr: ContainerManager, launcher: Any) -> None:
    fv: Launched = launcher(startup_s=1.5, mem_limit_bytes=200 * MiB)
    first = health_check(fv.port, timeout_s=1)
    assert not first.ok  # not ready yet: refused or 503
    assert first.status_code in (None, 503)
    assert fv.wait_healthy(), "fakevllm never answered /health 200"

    attrs = mgr.inspect(fv.id)
    labels = attrs["Config"]["Labels"]
    assert labels[LABEL_MANAGED] == "true"
    assert labels[LABEL_LAUNCH_ID].startswith("test-")
    assert labels[LABEL_REVISION] == "1"
    assert labels[LABEL_PORT] == str(fv.port)
    host = attrs["HostConfig"]
    assert host["Memory"] == 200 * MiB
    assert host["MemorySwap"] == 200 * MiB  # memswap None → same as memory: no swap
    assert host["NetworkMode"] == "host"
    assert host["IpcMode"] == "host"
    assert host["RestartPolicy"]["Name"] in ("no", "")
    assert not host.get("DeviceRequests")  # gpu=False

    info = mgr.get(fv.id)
    assert info.managed and info.port == fv.port and info.status == "running"
    st = mgr.state(fv.id)
    assert st.running and st.pid and st.exit_code is None and st.started_at

    # --init (the default): PID 1 is Docker's init; exec form, no shell: its child is the python
    # server with our argv verbatim
    code, out = mgr.exec(fv.id, ["cat", "/proc/1/cmdline"])
    assert code == 0
    assert out.split(b"\0")[0] == b"/sbin/docker-init"
    code, out = mgr.exec(fv.id, ["sh", "-c", "cat /proc/$(cat /proc/1/task/1/children | cut -d' ' -f1)/cmdline"])
    assert code == 0
    argv = out.decode().rstrip("\0").split("\0")
    assert argv[0] == "/usr/bin/python3"
    assert argv[2:] == [
        "/opt/fakevllm/fakevllm.py", "serve", "/models/fake", "--port", str(fv.port),
        "--gpu-memory-utilization", "0.786", "--max-model-len", "32768",
        "--shutdown-timeout", "25",
    ]  # fmt: skip
    assert b"Application startup complete." in mgr.logs(fv.id)


def test_it_launches_with_init_and_a_positive_oom_score_adj(mgr: ContainerManager, launcher: Any) -> None:
    fv = launcher()
    host = mgr.inspect(fv.id)["HostConfig"]
    assert host["Init"] is True
    assert host["OomScoreAdj"] == 500  # LaunchSpec's default (sparkd.act.containerspec.DEFAULT_OOM_SCORE_ADJ)
    st = mgr.state(fv.id)
    assert st.pid
    # the kernel sees it: the container's init and the server below it carry +500 in the host's real /proc
    with open(f"/proc/{st.pid}/oom_score_adj") as f:
        assert f.read().strip() == "500"
    with open(f"/proc/{st.pid}/comm") as f:
        assert f.read().strip() == "docker-init"
    with open(f"/proc/{st.pid}/task/{st.pid}/children") as f:
        child = int(f.read().split()[0])
    with open(f"/proc/{child}/oom_score_adj") as f:
        assert f.read().strip() == "500"


def test_launch_spec_refuses_a_non_positive_oom_score_adj() -> None:
    for bad in (0, -1000, 1001, True, 1.5):
        with pytest.raises(InvalidInput) as e:
            LaunchSpec(image="x", name="y", oom_score_adj=bad)  # type: ignore[arg-type]
        assert e.value.field == "oom_score_adj"


def test_it_stops_gracefully_with_exit_0(mgr: ContainerManager, launcher: Any) -> None:
    assert inspect.signature(mgr.stop).parameters["timeout_s"].default == 30.0
    fv = launcher()
    assert fv.wait_healthy()
    res = mgr.stop(fv.id, timeout_s=10)
    assert res.outcome == "exited", res.describe()
    assert res.exit_code == 0
    assert res.elapsed_s < 10
    assert not res.fallback_kill
    st = mgr.state(fv.id)
    assert not st.running and st.exit_code == 0 and st.finished_at and st.pid is None
    assert b"Shutting down" in mgr.logs(fv.id)
    again = mgr.stop(fv.id, timeout_s=10)
    assert again.outcome == "not_running" and again.exit_code == 0


def test_it_kills_after_the_grace_when_sigterm_is_ignored(mgr: ContainerManager, launcher: Any) -> None:
    fv = launcher(mode="ignore-term")
    assert fv.wait_healthy()
    res = mgr.stop(fv.id, timeout_s=3)
    assert res.outcome == "killed", res.describe()
    assert res.exit_code == 137
    assert 2.5 <= res.elapsed_s < 15
    assert "no exit within 3 s of SIGTERM" in res.describe()
    # PID 1 got the SIGTERM itself (no shell in between) and ignored it
    assert b"received SIGTERM; ignoring it" in mgr.logs(fv.id)


def test_it_reports_a_crash_exit_code(mgr: ContainerManager, launcher: Any) -> None:
    fv = launcher(mode="crash", env={"FAKEVLLM_CRASH_AFTER_S": "1"})
    assert wait_for(lambda: not mgr.state(fv.id).running, 20)
    st = mgr.state(fv.id)
    assert st.exit_code == 1 and not st.oom_killed
    assert b"EngineCore encountered a fatal error" in mgr.logs(fv.id)
    assert mgr.kill(fv.id) is False  # not running: nothing sent


def test_it_reports_an_oom_kill_at_the_memory_limit(mgr: ContainerManager, launcher: Any) -> None:
    fv = launcher(mem_limit_bytes=96 * MiB)
    assert fv.wait_healthy()
    with pytest.raises(httpx.HTTPError):  # the server dies while answering
        fv.post("/alloc?mib=256")
    assert wait_for(lambda: not mgr.state(fv.id).running, 20)
    st = mgr.state(fv.id)
    assert st.oom_killed and st.exit_code == 137


def test_it_adopts_the_one_running_managed_container(
    mgr: ContainerManager, launcher: Any, caplog: pytest.LogCaptureFixture
) -> None:
    assert mgr.adopt() is None
    older = launcher()
    hand_started = launcher(managed=False)  # same test labels, no sparkd.managed
    newer = launcher()
    assert wait_for(lambda: mgr.state(hand_started.id).running, 10)

    with caplog.at_level(logging.WARNING, logger="sparkd.act.docker"):
        adopted = mgr.adopt()
    assert adopted is not None and adopted.id == newer.id  # several: the newest ...
    assert "several managed containers" in caplog.text  # ... and the others reported
    assert older.id[:12] in caplog.text and hand_started.id[:12] not in caplog.text

    mgr.kill(newer.id)
    assert {i.id for i in mgr.find_managed()} == {older.id, newer.id}  # all=True, labelled only
    adopted = mgr.adopt()
    assert adopted is not None and adopted.id == older.id


def test_it_adopts_a_crash_looping_managed_container_while_docker_waits_to_restart_it(
    mgr: ContainerManager, docker_client: Any, image: str, case_labels: dict[str, str]
) -> None:
    """A labelled copy run by hand with ``--restart always`` that crash-loops is "restarting" most of the time
    (Docker's back-off doubles): it was not adopted, yet ``docker ps`` lists it, so sparkd called it unguarded
    "beside the one sparkd watches" with none watched (review helper-30). It holds memory each time it runs."""
    c = docker_client.containers.run(
        image,
        entrypoint=["/usr/bin/python3", "-c", "raise SystemExit(3)"],
        labels={**case_labels, LABEL_MANAGED: "true"},
        restart_policy={"Name": "always"},
        network_mode="host",
        detach=True,
    )
    try:
        # after 4 restarts Docker waits >= 1.6 s before the next: "restarting" long enough to look twice
        assert wait_for(lambda: mgr.state(c.id).restart_count >= 4 and mgr.get(c.id).status == "restarting", 30)
        assert [i[0] for i in mgr.running_managed()] == [c.id]
        adopted = mgr.adopt()
        assert adopted is not None and adopted.id == c.id and adopted.status == "restarting", adopted
    finally:
        c.remove(force=True)


def test_it_touches_an_unlabelled_container_only_when_guarded(mgr: ContainerManager, launcher: Any) -> None:
    other = launcher(managed=False)
    assert other.wait_healthy()  # PID 1 ignores SIGTERM until its handler is installed
    assert not mgr.get(other.id).managed  # reading is allowed
    with pytest.raises(Refused):
        mgr.stop(other.id, timeout_s=2)
    with pytest.raises(Refused):
        mgr.kill(other.id)
    assert mgr.guard(other.name) is not None
    assert mgr.find_managed() == [] and mgr.adopt() is None  # guarded ≠ managed
    res = mgr.stop(other.name, timeout_s=5)
    assert res.outcome == "exited" and res.exit_code == 0
    with pytest.raises(Refused):
        mgr.remove(other.id)  # never removed: not ours
    assert mgr.guard("sparkd-test-no-such-container") is None
    # Docker resolves an unknown name as an id prefix: a short hex name took a container it does not name (helper-43)
    assert mgr.guard(other.id[:4]) is None
    assert (found := mgr.guard(other.id[:12])) is not None and found.id == other.id  # an id, as docker ps prints it


def test_it_lists_running_containers_labelled_or_not_for_the_guard_mode_candidates(
    mgr: ContainerManager, launcher: Any, image: str, docker_client: Any
) -> None:
    unlabelled = launcher(managed=False)
    labelled = launcher()
    listed = {cid: (name, img) for cid, name, img in mgr.running_containers()}
    assert listed[unlabelled.id] == (unlabelled.name, image) and listed[labelled.id][0] == labelled.name
    assert [i[0] for i in mgr.running_managed()] == [labelled.id]  # the labelled one alone
    # guard mode with a name no container has: the running one whose name holds it ranks first (compose's
    # <project>-<service>-1 holds the service's name); this run's uuid is in that container's name alone
    short = unlabelled.name.rsplit("-", 1)[1]
    assert guard_candidates(short, mgr.running_containers())[0] == f"{unlabelled.name} ({image})"
    docker_client.containers.get(unlabelled.id).stop(timeout=5)
    assert unlabelled.id not in {i[0] for i in mgr.running_containers()}  # stopped: not running


def test_it_follows_log_lines_until_told_to_stop(mgr: ContainerManager, launcher: Any) -> None:
    fv = launcher(startup_s=1.0)
    lines: list[str] = []
    stop = threading.Event()
    t = threading.Thread(target=mgr.stream_logs, args=(fv.id, lines.append, stop), daemon=True)
    t.start()
    assert wait_for(lambda: any("Application startup complete." in ln for ln in lines), 20)
    assert any("Available KV cache memory: 6.51 GiB" in ln for ln in lines)
    assert all("\n" not in ln for ln in lines)
    stop.set()
    t.join(5)
    assert not t.is_alive(), "stream_logs did not return after stop_event"


def test_it_ends_log_following_when_the_container_exits(mgr: ContainerManager, launcher: Any) -> None:
    fv = launcher()
    assert fv.wait_healthy()
    lines: list[str] = []
    t = threading.Thread(target=mgr.stream_logs, args=(fv.id, lines.append, threading.Event()), daemon=True)
    t.start()
    mgr.stop(fv.id, timeout_s=5)
    t.join(10)
    assert not t.is_alive()
    assert lines[-1] == "INFO:     Application shutdown complete."


def test_it_sees_progress_and_stalls_in_real_metrics(launcher: Any) -> None:
    fv = launcher()
    assert fv.wait_healthy()
    fv.post("/requests?running=2&waiting=1")
    a = read_vllm_metrics(fv.port)
    time.sleep(0.5)
    b = read_vllm_metrics(fv.port)
    assert a["num_requests_running"] == 2 and a["num_requests_waiting"] == 1
    assert b["generation_tokens_total"] > a["generation_tokens_total"]
    assert b["generation_tokens_total"] < 1e6  # a _created timestamp would be ~1.7e9
    assert not progress_stalled(a, b)

    fv.post("/stall?on=1")
    c = read_vllm_metrics(fv.port)
    time.sleep(0.5)
    d = read_vllm_metrics(fv.port)
    assert health_check(fv.port).ok  # answers /health ...
    assert progress_stalled(c, d)  # ... but makes no progress


def test_it_refuses_a_taken_name_and_never_pulls(mgr: ContainerManager, launcher: Any, image: str) -> None:
    fv = launcher()
    with pytest.raises(Conflict):
        mgr.launch(LaunchSpec(image=image, name=fv.name, gpu=False), "x", 1)
    with pytest.raises(NotFound):
        mgr.launch(LaunchSpec(image="sparkd-test-no-such-image:0", name="x", gpu=False), "x", 1)
    with pytest.raises(NotFound):
        mgr.state("sparkd-test-no-such-container")


def test_it_raises_docker_unavailable_for_a_missing_socket(tmp_path: Any) -> None:
    m = ContainerManager(f"unix://{tmp_path}/no-docker.sock", api_timeout_s=2)
    assert m.ping() is False
    for call in (m.info, m.find_managed, m.adopt, lambda: m.get("x"), lambda: m.stop("x")):
        with pytest.raises(DockerUnavailable) as err:
            call()
        assert "no-docker.sock" in str(err.value)
