"""An exit nobody asked for (a crash, an OOM kill) and its postmortem archive, found in operators' tests:

* ``summary.txt`` said what happened but not the container's exit code nor Docker's OOMKilled, the first thing an
  operator looks for. It says them now: ``exit code:    137 (SIGKILL)`` (128 + N named as signal N), ``OOMKilled:``,
  "not known" when Docker gave none.
* a ``docker run --rm`` container that crashed left no archive at all: Docker removed it at its exit, sparkd found it
  gone (a critical ``exited``) and wrote nothing, its log being gone with it. The samples, events and kernel lines are
  archived now, and the summary says plainly that the container's own log is missing because Docker removed it.

A real ``Daemon`` (its store, writer, events) and a real ``Supervisor`` reconciling Docker's state through its real
lifecycle; only the Docker engine is stubbed at the edge. The real engine's --rm crash:
``test_e2e_lifecycle.py::test_a_crash_of_a_docker_run_rm_container_leaves_a_postmortem_without_its_log``."""

from __future__ import annotations

import asyncio
import json
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_api import _daemon
from test_stop_not_kept import Manager

from sparkd.act.archive import is_incident_archive, list_archives, requested_by
from sparkd.act.containerspec import ContainerState as DockerState
from sparkd.act.stop import REMOVED_WITH_IT, exit_code_text
from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState as S
from sparkd.core.supervision import EXITED_SOURCE
from sparkd.errors import NotFound
from sparkd.loop.daemon import Daemon
from sparkd.loop.supervisor import Supervisor

pytestmark = pytest.mark.anyio
CID = "c" * 64
OOM_LINE = "Memory cgroup out of memory: Killed process 4242 (python3) total-vm:123456kB, anon-rss:120000000kB"


class Exited(Manager):
    """The guarded container has exited on its own: Docker's ``ExitCode`` and ``OOMKilled`` as given (``code`` None:
    Docker gave none). ``gone``: Docker removed it at its exit (``docker run --rm``): every call says no such
    container."""

    def __init__(self, code: int | None, oom: bool, *, gone: bool = False) -> None:
        super().__init__()
        self.running, self.code, self.oom, self.gone = False, code, oom, gone
        self.finished_at = time.time()

    def _there(self, cid: str) -> None:
        if self.gone:
            raise NotFound(f"no such container: {cid}")

    def state(self, cid: str) -> DockerState:
        self._there(cid)
        return DockerState("exited", False, self.code, self.oom, self.started_at, self.finished_at, None, None)

    def inspect(self, cid: str) -> dict[str, Any]:
        self._there(cid)
        ins = super().inspect(cid)
        ins["State"] = {"Status": "exited", "ExitCode": self.code, "OOMKilled": self.oom}
        return ins

    def logs(self, cid: str, since: float | None = None, tail: int | None = None, max_bytes: int = 0) -> bytes:
        self._there(cid)
        return b"INFO: vLLM serving\nRuntimeError: CUDA error: out of memory\n"


async def _exit(tmp_path: Path, manager: Exited, *, auto_remove: bool = False) -> tuple[Daemon, dict[str, Any]]:
    """A guarded model seen ready, then Docker's word that it ended (``manager``); returns the daemon and the
    ``exited`` event sparkd said."""
    (tmp_path / "shm").mkdir(parents=True)
    overrides: dict[str, Any] = {"shm_dir": str(tmp_path / "shm"), "container": {"guard": "vllm"}}
    settings = load_settings(overrides={"state_dir": str(tmp_path / "state"), **overrides})
    sup = Supervisor(settings, manager=manager)  # type: ignore[arg-type]
    sup._loop = lambda: asyncio.sleep(0)  # type: ignore[method-assign]  # no steps of its own: the look below only
    d = await _daemon(tmp_path, actions=sup, **overrides)
    sup.container_id, sup.state, sup.engine_up, sup.name = CID, S.READY, True, "vllm"
    sup.seen_started_at = sup.container_started_at = manager.started_at
    sup.auto_remove = auto_remove
    if manager.oom:  # the kernel's OOM kill line in this container (``on_kernel_record``), in the events too
        sup._oom_record = SimpleNamespace(pid=4242, comm="python3", message=OOM_LINE, raw=OOM_LINE)  # type: ignore[assignment]
        d.event("oom_kill", OOM_LINE, severity="critical", details={"line": OOM_LINE})
    await sup.reconcile(probe=False)
    [ev] = [e for e in d.recent_events if e["kind"] == "exited"]
    assert sup.container_id is None if auto_remove else sup.state is S.EXITED
    return d, ev


def _members(d: Daemon, ev: dict[str, Any]) -> dict[str, str]:
    name = ev["details"]["archive"]
    assert name and (f"; archive {name}" in ev["message"] or f": archive {name} " in ev["message"]), ev
    with tarfile.open(d.settings.archives_path / name) as tf:
        assert tf.getmembers()[0].name == "summary.txt"
        return {m.name: tf.extractfile(m).read().decode() for m in tf.getmembers()}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("code", "oom", "lines"),
    [
        (137, True, ["exit code:    137 (SIGKILL)", "OOMKilled:    true"]),
        (1, False, ["exit code:    1", "OOMKilled:    false"]),
        (None, False, ["exit code:    not known (Docker gave none)", "OOMKilled:    false"]),
    ],
)
async def test_an_exits_summary_says_its_exit_code_and_oomkilled(
    tmp_path: Path, code: int | None, oom: bool, lines: list[str]
) -> None:
    d, ev = await _exit(tmp_path, Exited(code, oom))
    try:
        assert ev["severity"] == "critical" and ev["details"]["exit_code"] == code, ev
        parts = _members(d, ev)
        summary = parts["summary.txt"].splitlines()
        for line in lines:
            assert line in summary, parts["summary.txt"]
        assert (code is not None and code > 128) == ("(SIGKILL)" in parts["summary.txt"])
        # the lines read before stay as they were: who asked (archive pruning reads it), the reason
        assert f"requested by: {EXITED_SOURCE}" in summary
        assert any(x.startswith("reason:       container exited unexpectedly: exit code ") for x in summary)
        if oom:
            assert "kernel OOM:   the kernel log shows an OOM kill of pid 4242 (python3) in this container" in summary
        assert "CUDA error: out of memory" in parts["container.log"]  # the container was still there: its log
        [bundle] = list_archives(d.settings.archives_path)
        assert requested_by(bundle.path) == EXITED_SOURCE and is_incident_archive(bundle)
    finally:
        await d.shutdown("test")


async def test_a_docker_run_rm_crash_leaves_a_postmortem_that_says_its_log_went_with_it(tmp_path: Path) -> None:
    d, ev = await _exit(tmp_path, Exited(137, True, gone=True), auto_remove=True)
    try:
        assert ev["severity"] == "critical" and ev["details"]["auto_remove"] is True, ev
        assert "exited unexpectedly and Docker removed it at once (docker run --rm)" in ev["message"], ev
        assert ev["details"]["archive"] is not None, ev  # it was None: nothing was archived
        parts = _members(d, ev)
        summary = parts["summary.txt"]
        assert summary.startswith("sparkd postmortem\n")
        assert f"requested by: {EXITED_SOURCE}\n" in summary
        assert "container log: MISSING: Docker removed the container at its exit (docker run --rm)" in summary
        assert "exit code:    not known (Docker removed the container before sparkd read it: docker run --rm)" in (
            summary
        )
        assert "OOMKilled:    not known" in summary
        assert "kernel OOM:   the kernel log shows an OOM kill of pid 4242 (python3)" in summary
        # its log and inspect are not asked of an engine that has no such container: said missing, and why
        assert "container.log" not in parts and "inspect.json" not in parts
        assert REMOVED_WITH_IT in parts["container.log.missing"] and REMOVED_WITH_IT in parts["inspect.json.missing"]
        assert f"container.log: {REMOVED_WITH_IT}" in summary
        # what is left: the samples, the events, the kernel's OOM line
        assert parts["samples.csv"].startswith("ts,") and len(parts["samples.csv"].splitlines()) > 1
        assert OOM_LINE in parts["kernel.log"]
        assert any(e["kind"] == "oom_kill" for e in json.loads(parts["events.json"]))
        [bundle] = list_archives(d.settings.archives_path)
        assert is_incident_archive(bundle)  # kept as an incident's, not pruned as routine
    finally:
        await d.shutdown("test")


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (None, "not known"),
        (0, "0"),
        (1, "1"),
        (128, "128"),
        (137, "137 (SIGKILL)"),
        (139, "139 (SIGSEGV)"),
        (143, "143 (SIGTERM)"),
        (255, "255"),
    ],
)
def test_an_exit_code_above_128_names_its_signal(code: int | None, text: str) -> None:
    assert exit_code_text(code) == text
