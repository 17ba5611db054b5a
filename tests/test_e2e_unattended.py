"""Running unattended, on the real Docker engine with the test image (fake vLLM), short timings by
configuration: back-off, circuit breaker and re-arm, the completion probe (congestion vs emergency),
stop intents across restarts of sparkd, maintenance drain-and-relaunch with its smoke test, heartbeat."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sparkdapi import SparkdUnderTest
from sparkdproc import wait_for

pytest_plugins = ["dockerkit"]


def sup(s: SparkdUnderTest) -> dict[str, Any]:
    return s.container()["supervision"]  # type: ignore[no-any-return]


def test_it_backs_off_3_6_12_s_after_exits_and_never_delays_the_first_launch(make: Any) -> None:
    base_s = 3.0  # long enough that a back-off charged before the first launch would show
    s = make(
        container={
            "env": {"FAKEVLLM_MODE": "crash", "FAKEVLLM_CRASH_AFTER_S": "1.5", "FAKEVLLM_STARTUP_S": "0.3"},
            "health_interval_s": 0.2,
            "auto_restart": True,
            "restart_cap": 20,
            "restart_cooldown_s": base_s,  # the back-off base
            "max_failed_launches": 20,
        },
        sections={"supervision": {"probe": False}},
    )
    assert wait_for(lambda: len(s.events("launched")) >= 4, 120), s.output()[-3000:]
    started = s.events("daemon_started")[0]
    launched = s.events("launched")
    exited = s.events("exited")
    decisions = s.events("relaunch_decision")
    # the first launch: no back-off charged. Its own Docker create + start (vfs copies the image) took
    # 2.7-3.2 s from sparkd's start on this 2-core VM, with the previous release's code and this one alike
    # (it was 1.3 s when this was written); a charged back-off would add base_s on top of that.
    assert launched[0]["ts"] - started["ts"] < 2 * base_s - 0.5
    assert not [d for d in decisions if d["ts"] < launched[0]["ts"]]
    # each relaunch waited base × 2^(n−1), measured from the exit event to the next launch
    gaps = [launched[i + 1]["ts"] - exited[i]["ts"] for i in range(3)]
    for gap, want in zip(gaps, (base_s, 2 * base_s, 4 * base_s), strict=True):
        # + the relaunch itself (reconcile, preflight, Docker create/start): 0.9–1.5 s idle, up to 3.2 s
        # measured with 7 other test runs on this 2-core host
        assert want <= gap < want + 5.0, gaps
    assert [d["details"]["delay_s"] for d in decisions[:3]] == [base_s, 2 * base_s, 4 * base_s]
    assert all(d["details"]["intent"] == "exited" and "intent exited" in d["message"] for d in decisions[:3])


def _status_with(s: Any, needle: str) -> str | None:
    """``sparkd status`` as an operator runs it, when it says ``needle`` (the stored snapshot, written within a
    second of a change), else None."""
    out = s.cli("status")
    assert out.returncode == 0, out.stderr
    return out.stdout if needle in out.stdout else None


def test_three_emergency_stops_open_the_breaker_and_a_rearm_relaunches_recording_who(make: Any) -> None:
    # every launch breaks 1 s after ready (/health and completions 500): the probe stops it in an emergency
    s = make(
        container={
            "env": {"FAKEVLLM_STARTUP_S": "0.3", "FAKEVLLM_SERVE": "unhealthy", "FAKEVLLM_SERVE_AFTER_S": "1"},
            "health_interval_s": 0.2,
            "auto_restart": True,
            "restart_cap": 20,
            "restart_cooldown_s": 0.5,
        },
        sections={
            "supervision": {
                "probe_interval_s": 0.2,
                "probe_failures": 5,
                "breaker_threshold": 3,
                "breaker_window_s": 3600,
            }
        },
    )
    ev = s.wait_event("breaker_open", 120)
    assert "3 emergency stops" in ev["message"]
    b = sup(s)["breaker"]
    assert b["open"] is True and b["count"] == 3
    # no relaunch while open: the launches stay at 3 for several back-off periods
    n = len(s.events("launched"))
    assert n == 3
    time.sleep(5)
    assert len(s.events("launched")) == n and s.container()["state"] == "stopped"
    assert sup(s)["last_decision"]["action"] == "hold" and "breaker open" in sup(s)["last_decision"]["reason"]
    # each stop counted once, although the rule kept tripping during the stop
    assert len(s.events("stopped")) == 3
    card = s.api("GET", "/ui/container").text  # the dashboard's container card
    assert "<strong>OPEN</strong>" in card and "stop intent" in card and "emergency" in card
    out = wait_for(lambda: _status_with(s, "CIRCUIT BREAKER OPEN"), 20)
    assert out and "3 emergency stops (threshold 3" in out and "until `sparkd rearm`" in out, out
    # an operator's start is allowed with the breaker open, and says that it stays open (it was silent)
    r = s.api("POST", "/api/container/start")
    assert r.status_code == 200, r.text
    assert "circuit breaker is still open" in r.json()["warning"] and "sparkd rearm" in r.json()["warning"]
    assert wait_for(lambda: s.events("started_with_breaker_open"), 10) and sup(s)["breaker"]["open"] is True
    assert wait_for(lambda: len(s.events("stopped")) == 4 and s.container()["state"] == "stopped", 60)
    r = s.api("POST", "/api/breaker/rearm")
    assert r.status_code == 200, r.text
    assert r.json()["rearmed_by"].startswith("api:") and r.json()["launch_id"]
    assert wait_for(lambda: len(s.events("launched")) == n + 2, 30)
    assert "<strong>OPEN</strong>" not in s.api("GET", "/ui/container").text
    rearmed = s.events("breaker_rearmed")[-1]
    assert rearmed["details"]["who"].startswith("api:") and rearmed["details"]["was_open"] is True
    state = json.loads((s.tmp / "supervision.json").read_text())
    assert state["breaker"]["rearmed_by"].startswith("api:") and state["breaker"]["rearmed_at"]


def test_empty_completions_with_health_200_are_congestion_not_a_stop(make: Any, tmp_path: Path) -> None:
    sent = tmp_path / "notified.txt"
    s = make(
        container={"env": {"FAKEVLLM_STARTUP_S": "0.3", "FAKEVLLM_SERVE": "empty"}, "health_interval_s": 0.2},
        sections={
            "supervision": {"probe_interval_s": 0.3, "probe_failures": 5},
            "notify": {
                "kinds": ["probe_congestion"],
                "command": ["sh", "-c", f'echo "$SPARKD_EVENT_KIND" >> {sent}'],
                "min_interval_s": 0,
            },
        },
    )
    s.wait_state("ready", 60)
    assert wait_for(lambda: len(s.events("probe_congestion")) >= 3, 60), s.output()[-3000:]
    fails = s.events("probe_failed")
    assert len(fails) >= 15 and all("completion_tokens is 0" in f["message"] for f in fails)
    assert s.events("stopped") == [] and s.container()["state"] == "ready"
    assert sup(s)["breaker"]["count"] == 0
    # identical alerts: one notification per 15 min (the first, once delivered)
    assert sent.read_text().splitlines() == ["probe_congestion"]


def test_failing_completions_and_health_give_one_emergency_stop_after_five_probes(make: Any) -> None:
    s = make(
        container={"env": {"FAKEVLLM_STARTUP_S": "0.3"}, "health_interval_s": 0.2},
        sections={"supervision": {"probe_interval_s": 0.3, "probe_failures": 5}},
    )
    s.wait_state("ready", 60)
    s.vllm("POST", "/serve?mode=unhealthy")
    stopped = s.wait_event("stopped", 60)
    time.sleep(3)  # nothing more follows
    assert len(s.events("stopped")) == 1
    fails = s.events("probe_failed")
    assert len(fails) == 5 and all("HTTP 500" in f["message"] for f in fails)
    assert fails[-1]["ts"] <= stopped["ts"]
    st = sup(s)
    assert st["intent"]["intent"] == "emergency" and st["breaker"]["count"] == 1
    assert s.events("relaunch_decision")[-1]["details"]["action"] == "hold"  # auto_restart is off


def test_an_operator_stop_survives_a_restart_of_sparkd(make: Any, image: str, case_labels: dict[str, str]) -> None:
    s = make(sections={"supervision": {"probe": False}})
    s.wait_state("ready", 60)
    assert s.api("POST", "/api/container/stop").status_code == 200
    assert sup(s)["intent"]["intent"] == "operator"
    s.stop()
    s.start()  # the same state dir and configuration
    ev = s.wait_event("staying_stopped", 30)
    assert "stop intent operator" in ev["message"]
    time.sleep(2)
    assert sup(s)["intent"]["intent"] == "operator"
    assert len(s.events("launched")) == 1  # not launched again
    assert s.api("POST", "/api/container/start").status_code == 200  # the operator releases it
    assert wait_for(lambda: sup(s)["intent"] is None, 10)


def cli(s: SparkdUnderTest, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(s.config), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_maintenance_run_drains_a_held_request_relaunches_and_releases(make: Any) -> None:
    s = make(sections={"supervision": {"probe": False, "drain_limit_s": 30}})
    first = s.wait_state("ready", 60)["launch_id"]
    held: dict[str, Any] = {}

    def request() -> None:
        body = {"model": "/models/fake", "prompt": "x", "max_tokens": 4, "fake_hold_s": 4}
        r = httpx.post(f"http://127.0.0.1:{s.vllm_port}/v1/completions", json=body, timeout=30)
        held["code"], held["done"] = r.status_code, time.time()

    t = threading.Thread(target=request)
    t.start()
    assert wait_for(lambda: s.vllm("GET", "/state")["held"] == 1, 10)
    t0 = time.time()
    p = cli(s, "maintenance", "run", "--json")
    t.join(10)
    assert p.returncode == 0, p.stderr + p.stdout
    out = json.loads(p.stdout)
    assert out["drain"]["drained"] is True and out["drain"]["waited_s"] > 0.5  # it waited for the request
    # the stop came only after the held request finished, and it finished with its answer
    assert held["code"] == 200
    stopped = [e for e in s.events("stopped") if e["ts"] >= t0]
    assert stopped and stopped[0]["ts"] >= held["done"]
    assert out["relaunched"] and out["launch_id"] != first and out["smoke"]["ok"] and out["released"]
    assert set(out["smoke"]["checks"]) == {"health", "models", "completion", "metrics", "decode"}
    assert sup(s)["intent"] is None and s.events("maintenance_done")


def test_a_failing_smoke_test_alerts_holds_and_the_window_expires_with_an_alert(make: Any) -> None:
    s = make(
        sections={"supervision": {"probe": False, "smoke_min_tok_s": 1e9, "maintenance_max_s": 4, "drain_limit_s": 5}}
    )
    s.wait_state("ready", 60)
    r = s.api("POST", "/api/maintenance/run")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["relaunched"] and not out["smoke"]["ok"] and not out["released"]
    assert out["smoke"]["checks"]["decode"]["ok"] is False and out["smoke"]["checks"]["completion"]["ok"] is True
    ev = s.wait_event("smoke_failed", 5)
    assert "decode" in ev["message"]
    assert sup(s)["intent"]["intent"] == "maintenance"
    exp = s.wait_event("maintenance_expired", 15)
    assert "not released" in exp["message"]
    assert len(s.events("maintenance_expired")) == 1  # once, not every tick


def test_a_heartbeat_goes_out_when_all_is_fine(make: Any) -> None:
    s = make(sections={"supervision": {"probe": False, "heartbeat_interval_s": 2}})
    ev = s.wait_event("heartbeat", 20)
    for part in ("up ", "restarts in 24 h", "breaker closed", "min MemAvailable", "state dir"):
        assert part in ev["message"]
    assert ev["details"]["min_mem_available_bytes"] > 0 and ev["details"]["state_dir_bytes"] > 0


def meminfo(free_kib: int) -> str:
    """A scripted meminfo: driver memory (MemTotal − MemFree − Buffers − Cached − AnonPages − Slab −
    PageTables − KernelStack) = 16 GiB − 2 GiB − MemFree; MemAvailable stays at 12 GiB (no rule trips)."""
    return (
        f"MemTotal: 16777216 kB\nMemFree: {free_kib} kB\nMemAvailable: 12582912 kB\nBuffers: 0 kB\n"
        "Cached: 1048576 kB\nAnonPages: 1048576 kB\nSlab: 0 kB\nPageTables: 0 kB\nKernelStack: 0 kB\n"
    )


def test_a_leak_trend_starts_the_drain_and_relaunch_when_asked(make: Any, tmp_path: Path) -> None:
    # driver memory grows over hours on a GPU host; here a scripted /proc moves it by 3 GiB at once
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(meminfo(8388608))
    s = make(
        top={"proc_root": str(proc), "leak_threshold": "1GiB", "leak_warmup_start_s": 0, "leak_warmup_end_s": 1},
        sections={"supervision": {"probe": False, "maintenance_on_leak": True}},
    )
    first = s.wait_state("ready", 60)["launch_id"]
    time.sleep(2)  # past the baseline window
    (proc / "meminfo").write_text(meminfo(8388608 - 3 * 1048576))  # in place: sparkd keeps the file open
    s.wait_event("leak_trend", 20)
    done = s.wait_event("maintenance_done", 60)
    assert done["details"]["launch_id"] != first and done["details"]["smoke"]["ok"]
    assert s.events("stop_intent")[-1]["details"]["who"] == "leak trend"


def test_three_failed_launches_in_a_row_hold_and_alert(make: Any) -> None:
    s = make(
        container={
            "env": {"FAKEVLLM_MODE": "never-ready", "FAKEVLLM_STARTUP_S": "0.3"},
            "startup_timeout_s": 5,
            "auto_restart": True,
            "restart_cap": 20,
            "restart_cooldown_s": 0.5,
        },
        sections={"supervision": {"probe": False}},
    )
    hold = s.wait_event("launch_hold", 90)
    assert "3 consecutive failed launches" in hold["message"] and hold["details"]["intent"] == "failed_launch"
    time.sleep(3)
    assert len(s.events("launched")) == 3  # the first launch and two relaunches, then nothing
    decisions = s.events("relaunch_decision")
    assert [d["details"]["delay_s"] for d in decisions] == [0.5, 1.0]
    assert sup(s)["backoff"]["failed_launches"] == 3


def test_sparkd_killed_in_the_middle_of_an_emergency_stop_does_not_relaunch_that_model(
    make: Any, tmp_path: Path, docker_client: Any
) -> None:
    """The emergency intent is persisted before the stop begins (archive + up to 30 s of grace + kill): a
    kill -9 or a crash of sparkd in the middle of it used to leave no intent and a launch recorded as
    "ready", so the next start relaunched at once the model a rule was stopping for memory exhaustion."""
    from sparkdproc import rewrite_in_place

    real = Path("/proc/meminfo").read_text()
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()

    def meminfo(available_gib: int) -> None:
        text = re.sub(r"(?m)^MemAvailable:.*$", f"MemAvailable:   {available_gib * 2**20:>12} kB", real)
        rewrite_in_place(proc / "meminfo", text)

    meminfo(12)
    s = make(
        container={"env": {"FAKEVLLM_MODE": "ignore-term", "FAKEVLLM_STARTUP_S": "0.3"}, "auto_restart": True},
        top={"proc_root": str(proc), "shm_dir": str(shm)},
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
    )
    c = s.wait_state("ready", 60)
    meminfo(4)
    assert wait_for(lambda: s.container()["state"] == "stopping", 30), s.container()
    held = json.loads((s.tmp / "supervision.json").read_text())["intent"]
    assert held["intent"] == "emergency" and held["who"] == "rule low_available", held
    s.kill9()  # in the middle of the 30 s grace the model takes (it ignores SIGTERM)
    meminfo(12)
    docker_client.containers.get(c["container_id"]).kill()  # what Docker does at the end of the grace
    s.start()
    ev = s.wait_event("staying_stopped", 30)
    assert "stop intent emergency (rule low_available" in ev["message"], ev
    time.sleep(3.0)
    assert len(s.events("launched")) == 1, s.output()[-3000:]
    assert s.container()["stay_stopped"] is True
    assert s.container()["state"] == "stopped"  # that run ended while sparkd was away
    assert sup(s)["breaker"]["count"] == 1  # counted before the stop began: the kill -9 did not lose it
    # an operator's start relaunches it, and releases the intent
    assert s.api("POST", "/api/container/start").status_code == 200
    assert wait_for(lambda: len(s.events("launched")) == 2, 30)
    assert wait_for(lambda: s.events("stop_intent_released"), 10)  # said right after the launch


def test_memory_held_low_after_the_guard_stopped_the_model_trips_once_per_cooldown(make: Any, tmp_path: Path) -> None:
    """With nothing left to stop, a trip's refused stop ("not running") used to reset the cooldown: a critical
    trip and a stop_not_executed every `samples` ticks for as long as memory stayed low (24 trips in 2 min in
    an operator's walk-through), each counted by the loop guard toward demoting the rule."""
    from sparkdproc import rewrite_in_place

    real = Path("/proc/meminfo").read_text()
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()

    def meminfo(available_gib: int) -> None:  # a host with a CMA region: 1 GiB of MemAvailable is CmaFree
        text = re.sub(r"(?m)^MemAvailable:.*$", f"MemAvailable:   {available_gib * 2**20:>12} kB", real)
        text = re.sub(r"(?m)^Cma(Total|Free):.*\n", "", text)
        text += "CmaTotal:        2097152 kB\nCmaFree:         1048576 kB\n"
        rewrite_in_place(proc / "meminfo", text)

    meminfo(12)
    s = make(
        top={"proc_root": str(proc), "shm_dir": str(shm), "cooldown_s": 4.0},
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
    )
    s.wait_state("ready", 60)
    meminfo(4)
    stop = s.wait_event("stopped", 60)
    stopped_at = time.time()
    with tarfile.open(s.tmp / "archives" / stop["details"]["archive"]) as tf:
        summary = tf.extractfile("summary.txt").read().decode()  # type: ignore[union-attr]
    # the postmortem gives the CMA view the default rules judge by (MemAvailable alone argues against the stop)
    assert "MemAvailable: 4.00 GiB" in summary and "CmaFree: 1.00 GiB   usable: 3.00 GiB" in summary, summary
    # `sparkd status` says why the model is down, that it stays down, and where the postmortem is (it said none)
    out = wait_for(lambda: _status_with(s, "stopped by: emergency"), 20)
    assert out and "stays stopped until `sparkd start`" in out, out
    # and how that stop ended (a hard-floor kill read only in the events and on the dashboard: helper-35)
    assert re.search(r"stopped by: emergency \(rule low_available\) at [0-9:-]+ [0-9:]+ UTC, (exited|killed)", out), out
    assert s.status()["container"]["stay_stopped"] is True  # the API says it too (it read false: helper-35)
    assert f"last stop's postmortem archive: {s.tmp / 'archives' / stop['details']['archive']}" in out, out
    time.sleep(13.0)  # three cooldowns with memory held low and nothing running
    # a start now would launch into the shortage the guard just stopped it for: refused, unless forced
    r = s.api("POST", "/api/container/start")
    assert r.status_code == 422, r.text
    msg = r.json()["detail"]["message"]
    assert "stop rule low_available (MemAvailable 4.00 GiB < 6.00 GiB) holds now" in msg, msg
    forced = "A forced start (`sparkd start --force`, force=true in the API) launches it anyway, and the guard stops"
    assert f"{forced} it again as soon as this rule trips" in msg, msg
    assert wait_for(lambda: len(s.events("preflight_failed")) == 1, 5)
    meminfo(12)
    after = [t for t in s.events("trip") if t["ts"] > stopped_at]
    assert 2 <= len(after) <= 4, [(round(t["ts"] - stopped_at, 1), t["message"][:60]) for t in after]
    refused = [e for e in s.events("stop_not_executed") if e["ts"] > stopped_at]
    assert len(refused) == len(after) and all(e["details"]["nothing_running"] for e in refused)
    # each says the model is stopped: a warning, not a critical stop (an operator's walk-through read them as
    # failed stops, paged by a "critical trip" with nothing to stop); the first, the real stop, stays critical
    assert all(t["severity"] == "warning" and t["details"]["model_state"] == "stopped" for t in after), after
    assert all("the model is stopped: nothing to stop unless Docker says otherwise" in t["message"] for t in after)
    # and they are one alert for notify, whatever their figures: not a page a cooldown (helper-39)
    assert {t["details"]["collapse_as"] for t in after} == {"low_available holds while the model is stopped"}
    first = [t for t in s.events("trip") if t["ts"] <= stopped_at]
    assert first and first[0]["severity"] == "critical" and "model_state" not in first[0]["details"]
    assert "collapse_as" not in first[0]["details"]
    assert s.events("watermark") == []  # the loop guard was fed none of them: the rule still stops
    assert next(r for r in s.status()["rules"] if r["name"] == "low_available")["demoted"] is None
    assert wait_for(lambda: s.status()["nearest_stop"]["headroom_bytes"] > 0, 10)  # the guard saw it recover
    assert s.api("POST", "/api/container/start").status_code == 200  # memory back: it launches


def test_an_emergency_stop_interrupted_by_a_kill_9_is_finished_when_sparkd_comes_back(
    make: Any, tmp_path: Path
) -> None:
    """sparkd killed 1 s into an emergency stop of a model that ignores SIGTERM, back at once: the run is still
    up (Docker within its grace). It was adopted as "started outside sparkd", and when Docker's grace ended, the
    exit read "exited unexpectedly", the intent became `exited` and auto_restart relaunched the model (an
    adversarial helper's finding). Now the stop is finished (`stop_resumed`), and the model stays stopped."""
    from sparkdproc import rewrite_in_place

    real = Path("/proc/meminfo").read_text()
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()

    def meminfo(available_gib: int) -> None:
        text = re.sub(r"(?m)^MemAvailable:.*$", f"MemAvailable:   {available_gib * 2**20:>12} kB", real)
        rewrite_in_place(proc / "meminfo", text)

    meminfo(12)
    s = make(
        container={
            "env": {"FAKEVLLM_MODE": "ignore-term", "FAKEVLLM_STARTUP_S": "0.3"},
            "auto_restart": True,
            "restart_cooldown_s": 1.0,
        },
        top={"proc_root": str(proc), "shm_dir": str(shm)},
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
    )
    c = s.wait_state("ready", 60)
    meminfo(4)
    assert wait_for(lambda: s.container()["state"] == "stopping", 30), s.container()
    time.sleep(1.0)
    s.kill9()
    meminfo(12)  # memory is back: still, the stop the guard decided is finished
    s.start()
    ev = s.wait_event("stop_resumed", 30)
    assert "finishing the emergency stop begun before sparkd's last exit (rule low_available" in ev["message"]
    assert s.events("restarted_outside") == []
    stop = s.wait_event("killed", 60)  # it ignores SIGTERM: killed after the grace
    assert stop["details"]["source"] == "rule low_available"
    time.sleep(3.0)
    assert len(s.events("launched")) == 1, s.output()[-3000:]
    st = s.container()
    assert st["state"] in ("stopped", "exited") and st["stay_stopped"] is True, st
    assert st["container_id"] == c["container_id"]
    assert sup(s)["intent"]["intent"] == "emergency" and sup(s)["breaker"]["count"] == 1


def test_a_trip_during_a_maintenance_relaunchs_start_up_stops_the_new_run_at_once(make: Any, tmp_path: Path) -> None:
    """A relaunch holds the supervisor until its new run is ready, minutes of start-up when memory peaks: a trip
    then was "already relaunching" (not executed) until ready, and the maintenance passed its smoke test with
    memory below the line (an adversarial helper's finding). The stop is now handed over and done at once."""
    from sparkdproc import rewrite_in_place

    real = Path("/proc/meminfo").read_text()
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()

    def meminfo(available_gib: int) -> None:
        text = re.sub(r"(?m)^MemAvailable:.*$", f"MemAvailable:   {available_gib * 2**20:>12} kB", real)
        rewrite_in_place(proc / "meminfo", text)

    meminfo(12)
    s = make(
        container={"env": {"FAKEVLLM_STARTUP_S": "4"}},
        top={"proc_root": str(proc), "shm_dir": str(shm)},
        rules=[{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 2}],
        sections={"supervision": {"probe": False, "drain_limit_s": 5}},
    )
    s.wait_state("ready", 60)
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(r=s.api("POST", "/api/maintenance/run")))
    t.start()
    try:
        assert wait_for(lambda: len(s.events("launched")) == 2, 60), s.output()[-3000:]
        meminfo(4)  # the new run is starting (4 s): memory falls below the line
        ev = s.wait_event("stop_handed_over", 20)
        assert "relaunching under way stops the model now" in ev["message"], ev
        t0 = ev["ts"]
        ours = wait_for(lambda: [e for e in s.events("stopped") if e["ts"] >= t0], 30)
        assert ours, s.output()[-3000:]
        assert ours[0]["details"]["source"] == "rule low_available" and ours[0]["ts"] - t0 < 10, (ours, t0)
    finally:
        t.join(60)
        meminfo(12)
    body = result["r"].json()
    assert body["relaunched"] is False and body["released"] is False, body
    assert "stopped by rule low_available" in body["smoke"]["checks"]["launch"]["error"]
    # the rule's stop holds the model now, not the maintenance ("holding the maintenance intent": helper-54); no
    # smoke test ran: no critical smoke_failed (an operator's own stop paged them, helper-55)
    # said just before the API answered: its record reaches the database a moment later (read at once, it raced)
    cut = s.wait_event("maintenance_interrupted", 10)
    assert cut["severity"] == "warning" and "the model stays stopped: " in cut["message"], cut
    assert not s.events("smoke_failed"), s.events("smoke_failed")
    assert "emergency" in body["held_by"] or "low_available" in body["held_by"], body
    time.sleep(2.0)
    assert s.events("maintenance_done") == [] and len(s.events("launched")) == 2
    st = s.container()
    assert st["state"] == "stopped" and st["stay_stopped"] is True, st
    assert sup(s)["intent"]["intent"] == "emergency" and sup(s)["breaker"]["count"] == 1
