"""A partial postmortem beats none (issue 12, kind 10): when one Docker call fails during the stop, the
archive is still written with everything else (samples, sparkd log, events, kernel lines) and a note of
what is missing.

The failing edge: ``docker logs`` failing while the engine works (a manager whose ``logs`` raises, beside a
real container) and a whole engine that cannot be reached (a real ContainerManager on a socket with no
dockerd). The path where every call works is covered end to end in
``test_e2e_docker.py::test_end_to_end_a_real_memory_trip_archives_stops_gracefully_and_cleans_shm``."""

from __future__ import annotations

import asyncio
import json
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from sparkd.act.docker import ContainerManager
from sparkd.act.stop import StopReport, write_postmortem
from sparkd.config import Settings
from sparkd.core.sample import Sample
from sparkd.errors import DockerUnavailable
from sparkd.loop.daemon import Daemon
from sparkd.loop.supervisor import Supervisor
from sparkd.sense.procfs import read_meminfo
from sparkd.store.store import Store

KERNEL_LINE = "NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)"


class LogsFailDuringShutdown(ContainerManager):
    """The real manager, except that reading the logs fails as it does while dockerd shuts down."""

    def logs(self, *a: Any, **kw: Any) -> bytes:
        raise DockerUnavailable("docker logs: dockerd is shutting down (connection reset)")


def _daemon(tmp_path: Path) -> Daemon:
    settings = Settings(
        state_dir=str(tmp_path), log_dir=str(tmp_path / "logs"), container={"image": "sparkd-test-vllm:latest"}
    )
    settings.logs_path.mkdir(parents=True, exist_ok=True)
    (settings.logs_path / "sparkd.log").write_text("2026-11-30 21:00:00 INFO sparkd: tripped low_available\n")
    store = Store.open(settings.db_file, migrate=True)
    now = time.time()
    mi = read_meminfo().fields
    rows = [
        Sample(ts=now - 3 + i, mono=0.0, mem_available=mi["MemAvailable"], mem_free=mi["MemFree"]).to_row()
        for i in range(3)
    ]
    store.write_batch([("sample", r) for r in rows])
    store.add_event(kind="nvrm_no_memory", message="driver error", details={"line": KERNEL_LINE}, ts=now - 2)
    store.add_event(kind="trip", message="low_available: MemAvailable below the floor", ts=now - 1)
    d = Daemon(settings, serve_api=False)
    d.store = store
    return d


def _members(path: Path) -> dict[str, str]:
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read().decode() for m in tf.getmembers()}  # type: ignore[union-attr]


def _postmortem(d: Daemon, manager: ContainerManager, cid: str) -> tuple[str | None, StopReport]:
    sup = Supervisor(d.settings, manager=manager)
    sup.daemon = d
    sup.container_id = cid
    sup.launch_started_at = time.time() - 60
    rep = StopReport("low_available: MemAvailable below the floor", "rule")
    return asyncio.run(write_postmortem(sup, rep, cid)), rep


def _assert_everything_else_is_there(parts: dict[str, str]) -> None:
    assert next(iter(parts)) == "summary.txt"
    assert "tripped low_available" in parts["sparkd.log"]
    assert parts["samples.csv"].startswith("ts,") and len(parts["samples.csv"].splitlines()) == 4
    assert KERNEL_LINE in parts["kernel.log"]
    assert any(e["kind"] == "trip" for e in json.loads(parts["events.json"]))
    assert json.loads(parts["config.json"])["state_dir"]


pytest_plugins = ["dockerkit"]


@pytest.mark.docker
def test_docker_logs_failing_still_writes_the_archive(
    tmp_path: Path, launcher: Any, case_labels: dict[str, str]
) -> None:
    fv = launcher()
    d = _daemon(tmp_path)
    name, rep = _postmortem(d, LogsFailDuringShutdown(selector=case_labels), fv.id)
    assert name is not None, rep.errors
    parts = _members(d.settings.archives_path / name)
    _assert_everything_else_is_there(parts)
    assert "container.log" not in parts
    assert "dockerd is shutting down" in parts["container.log.missing"]
    assert json.loads(parts["inspect.json"])["Id"] == fv.id  # the calls that worked are in
    summary = parts["summary.txt"]
    assert "MISSING" in summary and "container.log: docker logs failed: " in summary
    assert any(e.startswith("archive partial: container.log missing") for e in rep.errors)


def test_an_unreachable_engine_still_writes_the_archive(tmp_path: Path) -> None:
    d = _daemon(tmp_path)
    gone = ContainerManager(f"unix://{tmp_path}/no-dockerd.sock", api_timeout_s=2)
    name, rep = _postmortem(d, gone, "0" * 64)
    assert name is not None, rep.errors
    assert name.startswith("sparkd-") and "vllm" in name  # named after the container (settings), not inspect
    parts = _members(d.settings.archives_path / name)
    _assert_everything_else_is_there(parts)
    assert "container.log.missing" in parts and "inspect.json.missing" in parts
    assert "docker logs failed" in parts["container.log.missing"]
    assert "docker inspect failed" in parts["inspect.json.missing"]
    assert "inspect.json: docker inspect failed" in parts["summary.txt"]


def test_a_database_read_failing_is_missing_too(tmp_path: Path) -> None:
    d = _daemon(tmp_path)
    assert d.store is not None
    d.store.close()  # the database is gone (e.g. the disk failed): its parts are missing, the rest is there
    d.store.engine.dispose()
    (d.settings.db_file).unlink()
    d.settings.db_file.mkdir()  # a directory where the file was: every read fails
    gone = ContainerManager(f"unix://{tmp_path}/no-dockerd.sock", api_timeout_s=2)
    name, rep = _postmortem(d, gone, "0" * 64)
    assert name is not None, rep.errors
    parts = _members(d.settings.archives_path / name)
    for p in ("samples.csv", "kernel.log", "events.json"):
        assert f"{p}.missing" in parts, p
    assert "tripped low_available" in parts["sparkd.log"]
