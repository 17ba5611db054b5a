"""Budget, launch records, resize and rollback against the real engine and the fakevllm image."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sparkdapi import SparkdUnderTest
from sparkdproc import db_query, wait_for

from sparkd.units import GiB

pytest_plugins = ["dockerkit"]

# A budget that fits this 24 GiB machine (the worked example's shape, scaled down).
BUDGET = {
    "enabled": True,
    "weights_gib": 0.5,
    "overhead_gib": 0.5,
    "mtp": False,
    "kv_target_gib": 1.0,
    "host_reserve_gib": 12.0,
    "max_model_len": 4096,
    "kv_bytes_per_token": 29482,
    "kv_cache_dtype": "fp8",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 2048,
    "docker_headroom_gib": 2.0,
    "preflight_margin_gib": 1.0,
}


@pytest.fixture
def managed(tmp_path: Path, image: str, case_labels: dict[str, str], launcher: Any):
    made: list[SparkdUnderTest] = []

    def make(env: dict[str, str] | None = None, **container: Any) -> SparkdUnderTest:
        d = tmp_path / f"s{len(made)}"
        d.mkdir()
        s = SparkdUnderTest(
            d,
            image,
            case_labels,
            budget=BUDGET,
            container={
                "memory": None,
                "startup_timeout_s": 8,
                "env": {"FAKEVLLM_STARTUP_S": "0.5", **(env or {})},
                **container,
            },
        )
        made.append(s)
        return s.start()

    yield make
    for s in made:
        s.stop()


def _args(docker_client: Any, cid: str) -> list[str]:
    return list(docker_client.api.inspect_container(cid)["Args"])


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_a_launch_records_plan_actual_figures_and_the_startup_trough(managed: Any) -> None:
    s = managed()
    c = s.wait_state("ready", 60)
    assert wait_for(lambda: (s.status()["container"]["plan"] or {}).get("gmu"), 5)
    rows = wait_for(
        lambda: db_query(
            s.db,
            "SELECT plan, actual, trough_bytes, ready_at, started_at FROM launches WHERE id=? AND ready_at IS NOT NULL",
            (c["launch_id"],),
        ),
        10,
    )
    import json

    plan, actual, trough, ready_at, started_at = rows[0]
    plan, actual = json.loads(plan), json.loads(actual)
    assert plan["gmu"] == c["gmu"] and plan["gmu"] > 0
    assert 0 < trough < 64 * GiB and ready_at > started_at
    # the vLLM start-up lines (fixture figures) parsed into the record
    assert wait_for(
        lambda: json.loads(db_query(s.db, "SELECT actual FROM launches WHERE id=?", (c["launch_id"],))[0][0]).get(
            "startup_complete"
        ),
        10,
    )
    actual = json.loads(db_query(s.db, "SELECT actual FROM launches WHERE id=?", (c["launch_id"],))[0][0])
    assert actual["model_load_gib"] == 63.71 and actual["kv_cache_tokens"] == 42656
    assert actual["max_concurrency"] == 1.30 and actual["graph_capture_gib"] == 0.26
    out = subprocess.run(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(s.config), "launches"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert c["launch_id"] in out and "estimate: GMU" in out and "weights 63.71 GiB" in out


def test_resize_dry_run_changes_nothing_and_apply_relaunches_with_new_limits(managed: Any, docker_client: Any) -> None:
    s = managed()
    c = s.wait_state("ready", 60)
    old_args = _args(docker_client, c["container_id"])
    old_gmu = float(_arg(old_args, "--gpu-memory-utilization"))
    old_mem = docker_client.api.inspect_container(c["container_id"])["HostConfig"]["Memory"]
    r = s.api("POST", "/api/resize", json={"kv_target_gib": 2.0, "dry_run": True})
    assert r.status_code == 200, r.text
    dry = r.json()
    assert dry["applied"] is False and dry["plan"]["gmu"] > old_gmu and "gmu" in dry["diff"]
    assert s.container()["container_id"] == c["container_id"]  # untouched
    # the CLI's dry run: figures for people (it printed "wish_gib 25.60195320416242 -> ...", note 11)
    out = s.cli("resize", "--kv-target-gib", "2", "--dry-run")
    assert out.returncode == 0, out.stderr
    gmu_line = next(line for line in out.stdout.splitlines() if line.strip().startswith("gmu "))
    assert f"{old_gmu:.4g} -> {dry['plan']['gmu']:.4g}" in gmu_line, out.stdout
    assert all(
        re.fullmatch(r"\s+\w+_gib\s+\d+\.\d\d GiB -> \d+\.\d\d GiB", line)
        for line in out.stdout.splitlines()
        if "_gib " in line
    ), out.stdout
    revs_before = db_query(s.db, "SELECT count(*) FROM config_revisions")[0][0]
    r = s.api("POST", "/api/resize", json={"kv_target_gib": 2.0, "dry_run": False}, timeout=180)
    assert r.status_code == 200, r.text
    applied = r.json()
    assert applied["applied"] is True
    c2 = s.wait_state("ready", 60)
    assert c2["container_id"] != c["container_id"]
    # the old run's stop is archived, as a restart's is: its container (and log) went at the launch (note 10, C3)
    (stop,) = [e for e in s.events("stopped") if e["details"]["reason"].startswith("resize to revision")]
    assert stop["details"]["archive"] and (s.tmp / "archives" / stop["details"]["archive"]).exists(), stop
    new_args = _args(docker_client, c2["container_id"])
    new_mem = docker_client.api.inspect_container(c2["container_id"])["HostConfig"]["Memory"]
    assert float(_arg(new_args, "--gpu-memory-utilization")) == dry["plan"]["gmu"] > old_gmu
    assert new_mem > old_mem
    assert new_mem == docker_client.api.inspect_container(c2["container_id"])["HostConfig"]["MemorySwap"]
    revs = db_query(s.db, "SELECT id, who, reason, data FROM config_revisions ORDER BY id")
    assert len(revs) == revs_before + 1
    import json

    assert json.loads(revs[-2][3])["kv_target_gib"] == 1.0 and json.loads(revs[-1][3])["kv_target_gib"] == 2.0
    assert revs[-1][1].startswith("api:")


def test_an_impossible_resize_is_refused_and_the_container_is_untouched(managed: Any) -> None:
    s = managed()
    c = s.wait_state("ready", 60)
    r = s.api("POST", "/api/resize", json={"max_model_len": 10_000_000, "dry_run": False})
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "refused" and "max_model_len" in str(body["detail"])
    c2 = s.container()
    assert c2["container_id"] == c["container_id"] and c2["state"] == "ready"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparkd.face.cli",
            "--config",
            str(s.config),
            "resize",
            "--max-model-len",
            "10000000",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 1 and "refused" in cli.stderr


def test_a_launch_that_never_becomes_ready_rolls_back(managed: Any, docker_client: Any) -> None:
    s = managed(env={"FAKEVLLM_NEVER_READY_WHEN": "--max-num-seqs=7"})
    c = s.wait_state("ready", 60)
    r = s.api("POST", "/api/resize", json={"max_num_seqs": 7, "dry_run": False}, timeout=180)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["applied"] is False and out["rolled_back"] is True and out["rollback_ok"] is True
    c2 = s.wait_state("ready", 30)
    assert c2["container_id"] != c["container_id"]
    assert _arg(_args(docker_client, c2["container_id"]), "--max-num-seqs") == "4"
    assert s.wait_event("rollback")["message"].startswith("revision ")
    revs = db_query(s.db, "SELECT who, reason FROM config_revisions ORDER BY id")
    assert revs[-1][0] == "sparkd" and revs[-1][1].startswith("rollback from revision")


def test_a_stopped_model_keeps_its_plan_shown_across_a_restart_of_sparkd(managed: Any) -> None:
    """After a restart of sparkd with the model stopped, ``/api/status`` had ``plan: null`` (the dashboard's plan card
    empty) though the stopped container's name and image were shown (note 10, B6). The plan it ran with is shown."""
    s = managed()
    s.wait_state("ready", 60)
    plan = s.status()["plan"]
    assert plan is not None and plan["gmu"] > 0
    assert s.api("POST", "/api/container/stop").status_code == 200
    s.wait_state("stopped", 60)
    s.kill9()
    s.start()
    s.wait_event("staying_stopped", 20)
    assert s.container()["state"] == "stopped"
    assert s.status()["plan"] == plan
