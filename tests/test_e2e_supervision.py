"""Supervision on the real engine: kernel OOM attribution, auto-restart cap, preflight and --force,
and 'answers /health but makes no progress'."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from checkpoints import make_checkpoint
from conftest import need
from sparkdproc import db_query, wait_for
from test_e2e_budget import BUDGET
from test_kvcache import LLAMA_31_8B

pytest_plugins = ["dockerkit"]


def test_a_kernel_oom_kill_of_the_container_is_attributed_archived_and_corrected(make: Any, docker_client: Any) -> None:
    need(os.access("/dev/kmsg", os.W_OK), "/dev/kmsg is not writable (needs root)")
    s = make(top={"kernlog_source": "kmsg"})
    c = s.wait_state("ready", 60)
    cid = c["container_id"]
    pid = docker_client.api.inspect_container(cid)["State"]["Pid"]
    # what the kernel prints for a global OOM kill of a process in this container (fixtures/kernlog format)
    line = (
        f"oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=docker-{cid[:12]}.scope,mems_allowed=0,"
        f"global_oom,task_memcg=/system.slice/docker-{cid}.scope,task=python3,pid={pid},uid=0\n"
    )
    with open("/dev/kmsg", "w") as f:
        f.write(line)
    assert wait_for(lambda: s.events("oom_kill"), 10)
    docker_client.containers.get(cid).kill()  # the kill itself (Docker will say OOMKilled=false)
    ev = s.wait_event("oom_kill_attributed", 30)
    assert str(pid) in json.dumps(ev["details"])
    assert docker_client.api.inspect_container(cid)["State"]["OOMKilled"] is False
    st = s.wait_state("exited", 10)
    assert "OOM kill" in st["state_reason"] and "OOMKilled=False" in st["state_reason"]
    exited = s.wait_event("exited", 30)
    assert exited["details"]["kernel_oom_kill"] is True and exited["details"]["archive"]
    assert (s.tmp / "archives" / exited["details"]["archive"]).exists()
    assert db_query(s.db, "SELECT status FROM launches WHERE id=?", (c["launch_id"],))[0][0] == "oom_killed"


def test_auto_restart_stops_at_the_cap(make: Any, docker_client: Any, case_labels: dict[str, str]) -> None:
    s = make(
        container={
            "env": {"FAKEVLLM_MODE": "crash", "FAKEVLLM_CRASH_AFTER_S": "1.5", "FAKEVLLM_STARTUP_S": "0.3"},
            "auto_restart": True,
            "restart_cap": 2,
            "restart_window_s": 3600,
            "restart_cooldown_s": 0.5,
        }
    )
    cap = s.wait_event("restart_cap", 90)
    assert "cap reached (2 per 3600 s)" in cap["message"]
    assert len(s.events("launched")) == 3  # the first launch and two restarts
    assert len(s.events("exited")) >= 3
    page = s.container()
    assert page["stay_stopped"] is True and page["state"] == "exited"


def test_a_failed_preflight_refuses_the_launch_and_force_overrides_it(make: Any) -> None:
    s = make(budget={**BUDGET, "preflight_margin_gib": 1000.0}, container={"memory": None})
    refused = s.wait_event("launch_refused", 30)
    assert "MemAvailable" in refused["message"] and "vLLM would refuse to start" in refused["message"]
    assert s.container()["container_id"] is None
    r = s.api("POST", "/api/container/start")
    assert r.status_code == 422 and "preflight failed" in r.text and "--force overrides" in r.text
    r = s.api("POST", "/api/container/start?force=true")
    assert r.status_code == 200, r.text
    c = s.wait_state("ready", 60)
    assert db_query(s.db, "SELECT forced FROM launches WHERE id=?", (c["launch_id"],))[0][0] == 1
    assert "preflight overridden with --force" in s.events("launched")[-1]["message"]


def test_answers_health_but_no_progress_is_unhealthy(make: Any) -> None:
    s = make()
    s.wait_state("ready", 60)
    s.vllm("POST", "/requests?running=2&waiting=3")
    s.vllm("POST", "/stall?on=1")
    st = s.wait_state("unhealthy", 20)
    assert "no token progress" in st["state_reason"] and "3 waiting" in st["state_reason"]
    s.vllm("POST", "/stall?on=0")
    assert s.wait_state("ready", 20)["state_reason"] == "recovered: /health answers and tokens progress"


def test_below_the_hard_floor_during_the_grace_period_it_kills_at_once(make: Any) -> None:
    import threading
    import time

    from sparkd.sense import procfs
    from sparkd.units import GiB

    floor = procfs.read_meminfo().fields["MemAvailable"] - GiB
    s = make(
        container={"env": {"FAKEVLLM_MODE": "ignore-term", "FAKEVLLM_STARTUP_S": "0.3"}, "hard_floor": f"{floor}B"}
    )
    s.wait_state("ready", 60)
    result: dict[str, Any] = {}

    def stop() -> None:
        result["r"] = s.api("POST", "/api/container/stop")

    t0 = time.monotonic()
    th = threading.Thread(target=stop)
    th.start()
    assert wait_for(lambda: s.container()["state"] == "stopping", 10)
    import httpx

    # the container ignores SIGTERM and takes memory during the grace; sparkd may kill it before it answers
    with contextlib.suppress(httpx.HTTPError):
        s.vllm("POST", "/alloc?mib=2048")  # 2 GiB against a floor 1 GiB down (see test_e2e_docker)
    th.join(60)
    elapsed = time.monotonic() - t0
    rep = result["r"].json()["stop"]
    assert rep["hard_floor_kill"] is True and rep["exit_code"] == 137
    assert elapsed < 15  # not the 30 s grace
    ev = s.wait_event("hard_floor_kill", 5)
    assert "during the grace period: killing" in ev["message"]


def test_usable_memory_below_the_hard_floor_kills_at_once_where_free_cma_fills_memavailable(
    make: Any, tmp_path: Path
) -> None:
    """The field's CMA case (field-2/homelab-kill7-cma.csv): MemAvailable 10.45 GiB of which 8.81 GiB free CMA,
    usable 1.64 GiB. The rules trip on usable memory; the hard floor judged raw MemAvailable, and the model got the
    whole grace (and the archive's 10 s) at 1.64 GiB usable, with no ``hard_floor_kill`` (helper-47)."""
    import re
    import time

    from sparkdproc import rewrite_in_place

    idle = (Path(__file__).parent / "fixtures" / "meminfo" / "gb10-idle.meminfo").read_text()

    def meminfo(avail_gib: float, cma_free_gib: float) -> None:
        t = re.sub(r"MemAvailable:\s+\d+ kB", f"MemAvailable: {int(avail_gib * 2**20):>15} kB", idle)
        t = re.sub(r"CmaTotal:\s+\d+ kB", f"CmaTotal: {16 * 2**20:>15} kB", t)
        rewrite_in_place(
            proc / "meminfo", re.sub(r"CmaFree:\s+\d+ kB", f"CmaFree: {int(cma_free_gib * 2**20):>15} kB", t)
        )

    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()
    meminfo(100, 8)  # usable 92 GiB
    grace_s = 20.0
    s = make(
        top={"proc_root": str(proc), "shm_dir": str(shm)},
        container={
            "env": {"FAKEVLLM_MODE": "ignore-term", "FAKEVLLM_STARTUP_S": "0.3"},
            "stop_timeout_s": grace_s,
            "hard_floor": "3GiB",
        },
    )
    s.wait_state("ready", 60)
    meminfo(10.45, 8.81)
    t0 = time.monotonic()
    ev = s.wait_event("hard_floor_kill", 30)
    assert "usable memory 1.64 GiB (MemAvailable − CmaFree) < hard floor 3.00 GiB" in ev["message"], ev["message"]
    killed = s.wait_event("killed", 30)
    assert time.monotonic() - t0 < grace_s, killed["message"]  # not the grace


def test_an_incomplete_checkpoint_fails_the_launch_preflight(make: Any, tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "ckpt", LLAMA_31_8B, [4096, 4096])
    (d / "model-00002-of-00002.safetensors").unlink()  # the download stopped after shard 1
    s = make(budget=BUDGET, container={"memory": None, "model_dir": str(d)})
    refused = s.wait_event("launch_refused", 30)
    # the preflight names the missing shard; nothing was started
    assert "missing: model-00002-of-00002.safetensors" in refused["message"]
    assert s.container()["container_id"] is None
    r = s.api("POST", "/api/container/start")
    assert r.status_code == 422 and "preflight failed" in r.text and "incomplete" in r.text


def test_a_labelled_container_run_by_hand_during_a_relaunch_back_off_is_adopted_and_the_relaunch_cancelled(
    make: Any, docker_client: Any
) -> None:
    """The model exited, a relaunch waits out its back-off, and the operator runs it by hand with sparkd's labels:
    it is adopted, and the relaunch is cancelled. Left scheduled, it was refused ("already running") and made a
    critical ``restart_failed``, then another, longer back-off, for as long as the adopted model ran (a review)."""
    s = make(container={"auto_restart": True, "restart_cooldown_s": 60.0})
    c = s.wait_state("ready", 60)
    old = docker_client.containers.get(c["container_id"])
    cfg = old.attrs["Config"]
    old.kill()  # an exit nobody asked for
    decision = s.wait_event("relaunch_decision", 30)
    assert decision["details"]["action"] == "relaunch" and decision["details"]["delay_s"] >= 60, decision
    by_hand = docker_client.containers.run(
        cfg["Image"],
        cfg["Cmd"],
        name=f"{c['name']}-by-hand",
        environment=cfg["Env"],
        labels=cfg["Labels"],  # sparkd.managed=true and this sparkd's selector (the test's case labels)
        network_mode="host",
        detach=True,
    )
    ev = s.wait_event("adopted", 20)
    assert ev["details"]["container_id"] == by_hand.id, ev
    cancelled = s.wait_event("relaunch_cancelled", 10)
    assert "adopted" in cancelled["message"] and by_hand.id[:12] in cancelled["message"], cancelled
    assert s.wait_state("ready", 60)["container_id"] == by_hand.id
    assert s.events("restart_failed") == [] and len(s.events("launched")) == 1


def test_a_paused_container_is_thawed_and_stopped_without_the_engine(launcher: Any, docker_client: Any) -> None:
    """The engine-less stop (``act.procstop``) of a container frozen by ``docker pause``: the SIGTERM never ran and,
    under cgroup v1, even the SIGKILL waited for a thaw; "killed" was reported with the processes still there
    (helper-47). The stopper thaws its cgroup first, and the container ends on its SIGTERM."""
    from sparkd.act.procstop import ProcessStopper

    fv = launcher(managed=False, startup_s=0.3)
    box = docker_client.containers.get(fv.id)
    # its SIGTERM handler in place first (a PID 1 without one ignores SIGTERM, paused or not)
    assert wait_for(lambda: b"Application startup complete" in box.logs(), 30)
    box.pause()
    try:
        st = ProcessStopper(fv.id)
        assert st.pids()
        r = st.stop(fv.id, timeout_s=10.0)
        assert r.outcome == "exited" and not r.fallback_kill, (r, st.errors, st.thawed, st.signalled)
        assert st.thawed and st.pids() == [], (st.thawed, st.errors)
        assert wait_for(lambda: docker_client.api.inspect_container(fv.id)["State"]["Status"] == "exited", 10)
    finally:
        box.reload()
        if box.status == "paused":
            box.unpause()


def test_a_stop_by_the_processes_that_leaves_them_running_is_not_called_killed(
    launcher: Any, docker_client: Any, tmp_path: Path
) -> None:
    """SIGKILL sent, the processes still there (a freezer it cannot thaw: here a cgroup root with none, on this
    host's cgroup v1 where a frozen task takes its SIGKILL only when thawed): it read "killed" (helper-47)."""
    from sparkd.act.procstop import ProcessStopper

    fv = launcher(managed=False, startup_s=0.3)
    box = docker_client.containers.get(fv.id)
    assert wait_for(lambda: b"Application startup complete" in box.logs(), 30)
    box.pause()
    try:
        st = ProcessStopper(fv.id, cgroup_root=tmp_path)  # no freezer to write: it stays frozen
        r = st.stop(fv.id, timeout_s=0.5)
        if not st.pids():  # cgroup v2 delivers SIGKILL to a frozen task: nothing remains, and "killed" is true
            assert r.outcome == "killed"
        else:
            assert r.outcome == "killed: processes remain", r
    finally:
        box.reload()
        if box.status == "paused":
            box.unpause()
