"""Reads that never return, in the stop path: ``/proc/PID/maps`` waits on that process's memory-map lock, and a
process stuck in the driver, as one may be when a rule trips, holds it. The /dev/shm witness before the SIGTERM, the
supervisor's periodic witness scan (under the lock a trip's stop takes next) and the cleanup after the stop held the
stop for ever, unsaid; a stop decision that never ends queued every later trip behind it, unsaid (helper-43).

A FIFO in a scripted proc root stands for the blocked read (a real one needs a process stuck in a driver). The real
scans (``ShmWitness.observe``, ``shm.cleanup``) run against it; Docker is stubbed at the edge."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from sparkd.act.containerspec import ContainerState as DockerState
from sparkd.act.containerspec import StopResult


def _fake_proc(tmp_path: Path, pid: int, comm: str, state: str = "S") -> tuple[str, str, str]:
    """A proc root whose ``PID/maps`` blocks on read (a FIFO: the stand-in for a /proc/PID/maps read that waits on
    the process's mmap_lock, held by a thread stuck in the driver), and a shm dir with one entry."""
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    (proc / str(pid) / "fd").mkdir(parents=True)
    shm.mkdir()
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1\n")
    maps = proc / str(pid) / "maps"
    os.mkfifo(maps)
    (shm / "vllm_offload_1.mmap").write_text("x")
    return str(proc), str(shm), str(maps)


def _release(fifo: str) -> None:
    """Unblock the reader of ``fifo`` and put a plain empty file in its place, so later reads do not block: the
    write end is held open while the path is replaced, then closed (a reader blocked on the old FIFO sees EOF)."""
    if not os.path.exists(fifo) or not stat.S_ISFIFO(os.stat(fifo).st_mode):
        return
    try:
        fd: int | None = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader blocked on it now
        fd = None
    tmp = fifo + ".plain"
    open(tmp, "w").close()
    os.replace(tmp, fifo)
    if fd is not None:
        os.close(fd)


class _Docker:
    def __init__(self, running: bool = True) -> None:
        self.calls: list[str] = []
        self.running = running

    def state(self, cid: str) -> DockerState:
        if self.running and "stop" not in self.calls:
            return DockerState("running", True, None, False, time.time() - 60, None, 4242, None)
        return DockerState("exited", False, 0, False, time.time() - 60, time.time(), None, None)

    def stop(self, cid: str, timeout_s: float = 30.0) -> StopResult:
        self.calls.append("stop")
        return StopResult("exited", 0, 0.1, timeout_s)

    def kill(self, cid: str) -> bool:
        self.calls.append("kill")
        return True


async def _run_stop(docker: Any, mem_available: int, events: list[str], **steps: Any) -> Any:
    """``act.stop.run_stop`` of a trip, the hard floor 3 GiB, MemAvailable ``mem_available``; events' kinds kept."""
    from sparkd.act.stop import StopTarget, run_stop

    return await run_stop(
        StopTarget("c" * 64, "vllm", time.time() - 60),
        docker,
        reason="trip",
        source="rule",
        grace_s=30,
        hard_floor_bytes=3 << 30,
        read_usable=lambda: mem_available,
        emit=lambda k, m, severity="info", details=None: events.append(k),
        postmortem=None,
        **steps,
    )


def test_the_stop_is_asked_of_docker_within_a_bound_when_the_witness_read_blocks(tmp_path: Path) -> None:
    """The /dev/shm witness scan right before the SIGTERM read ``/proc/PID/maps`` of the container's processes with no
    bound: a process stuck in the driver (its memory-map lock held) held the stop for ever, below the hard floor too
    (helper-43). Now the SIGTERM waits ``WITNESS_WAIT_S`` at most. A FIFO stands for the blocked read."""
    from sparkd.act.stop import WITNESS_WAIT_S, witness_before_stop

    proc, shm, fifo = _fake_proc(tmp_path, 4242, "python3")
    docker = _Docker()
    asked_at: list[float] = []
    orig_stop = docker.stop

    def stop(cid: str, timeout_s: float = 30.0) -> StopResult:
        asked_at.append(time.monotonic())
        return orig_stop(cid, timeout_s)

    docker.stop = stop  # type: ignore[method-assign]

    async def before_stop(rep: Any) -> None:
        await witness_before_stop(None, docker, "c" * 64, shm_dir=shm, proc_root=proc, rep=rep)

    async def go() -> float:
        t0 = time.monotonic()
        task = asyncio.create_task(_run_stop(docker, 1 << 30, [], before_stop=before_stop, cleanup_shm=None))
        await asyncio.sleep(6.0)
        _release(fifo)
        await asyncio.wait_for(task, 10.0)
        return t0

    try:
        t0 = asyncio.run(go())
    finally:
        _release(fifo)
    assert asked_at and asked_at[0] - t0 < WITNESS_WAIT_S + 3.0, (
        f"docker stop asked {asked_at[0] - t0:.1f} s after the stop began"
    )


def test_the_shm_cleanup_after_the_stop_cannot_hold_the_stop_forever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cleanup after the stop reads /proc/PID/maps of EVERY process: one unrelated process whose read blocks
    and run_stop never returns (no ``stopped`` event; the supervisor's action lock, held around it, never frees)."""
    from sparkd.act import shm as shm_mod
    from sparkd.act import stop as stop_mod

    monkeypatch.setattr(stop_mod, "SHM_CLEANUP_WAIT_S", 2.0)

    proc, shm, fifo = _fake_proc(tmp_path, 999, "other-job", "D")
    docker = _Docker(running=False)
    events: list[str] = []

    def cleanup(started_at: float | None, stopped_at: float) -> Any:
        return shm_mod.cleanup(
            container_started_at=started_at, shm_dir=shm, proc_root=proc, container_stopped_at=stopped_at
        )

    async def go() -> bool:
        task = asyncio.create_task(_run_stop(docker, 8 << 30, events, before_stop=None, cleanup_shm=cleanup))
        done, _ = await asyncio.wait({task}, timeout=6.0)
        _release(fifo)
        await asyncio.wait_for(task, 10.0)
        return bool(done)

    try:
        finished = asyncio.run(go())
    finally:
        _release(fifo)
    assert finished, f"run_stop had not returned 6 s after a confirmed stop; events {events}"
    assert events[-2:] == ["shm_cleanup", "stopped"], events  # the cleanup's end said (a warning), then the stop


def test_a_trip_is_not_held_behind_the_supervisors_witness_scan(tmp_path: Path) -> None:
    """The supervisor's look (reconcile → observe_docker → _observe_shm) holds _obs_lock while it reads /proc/PID/maps;
    a trip's emergency_stop → request → reconcile waits on that lock: docker stop never asked, nothing said. Now the
    scan runs in a thread of its own, waited on ``WITNESS_WAIT_S`` at most."""
    from sparkd.config import load_settings
    from sparkd.core.lifecycle import ContainerState
    from sparkd.loop.supervisor import Supervisor

    proc, shm, fifo = _fake_proc(tmp_path, 4242, "python3")
    state = tmp_path / "state"
    state.mkdir()
    started = time.time() - 600
    docker = _Docker()

    class Manager:
        def ping(self) -> bool:
            return True

        def state(self, cid: str) -> DockerState:
            return DockerState("running", True, None, False, started, None, 4242, None)

        def stop(self, cid: str, timeout_s: float = 30.0) -> StopResult:
            return docker.stop(cid, timeout_s)

        def kill(self, cid: str) -> bool:
            return docker.kill(cid)

        def stream_logs(self, cid: str, on_line: Any, stop: Any) -> None:
            return None

    settings = load_settings(
        overrides={"state_dir": str(state), "proc_root": proc, "shm_dir": shm, "container": {"guard": "vllm"}}
    )
    sup = Supervisor(settings, manager=Manager())  # type: ignore[arg-type]
    said: list[str] = []
    sup._event = lambda kind, message, severity="info", details=None: said.append(kind)  # type: ignore[method-assign]
    sup.container_id, sup.state = "c" * 64, ContainerState.READY
    sup.seen_started_at, sup.seen_restart_count, sup.container_started_at = started, 0, started

    async def go() -> None:
        look = asyncio.create_task(sup.reconcile(probe=False))  # the periodic look, a witness scan due
        await asyncio.sleep(0.3)
        trip = asyncio.create_task(sup.emergency_stop("rule low_available", "usable 1.2 GiB < 3 GiB"))
        await asyncio.sleep(6.0)
        _release(fifo)
        for t in (look, trip):
            t.cancel()
        await asyncio.gather(look, trip, return_exceptions=True)

    try:
        asyncio.run(go())
    finally:
        _release(fifo)
    # past the lock, the stop's own steps (each bounded: test_the_stop_is_asked_of_docker_within_a_bound…) begin
    assert "stopping" in said, f"6 s after the trip: events {said}"


def test_a_stop_that_never_returns_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decider awaits each stop to its end with no deadline (daemon._run_decisions). A stop stuck in any
    unbounded await (above: a /proc read) leaves every later trip queued: no ``trip`` event, no stop, no word --
    while the rule card reads "holds now" and the container "stopping"."""
    from test_daemon import _scripted, _serving

    import sparkd.loop.daemon as daemon_mod
    from sparkd.loop.daemon import Daemon

    monkeypatch.setattr(daemon_mod, "DECISION_MARGIN_S", 2.0)  # said 1 + 2 s after the stop began

    low = "MemTotal: 16777216 kB\nMemFree: 1048576 kB\nMemAvailable: 2097152 kB\n"
    high = "MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n"
    rules = [{"name": "low_available", "when": ["MemAvailable < 6GiB"], "samples": 1}]
    proc, settings = _scripted(
        tmp_path, high, cooldown_s=0, rules=rules, recheck=False, interval_s=0.5, container={"stop_timeout_s": 1}
    )
    actions = _serving("ready")
    hung = asyncio.Event()

    async def on_stop(decision: Any) -> None:
        actions.stops.append(decision.rule)
        await hung.wait()  # a stop that never returns (a blocked /proc read, an engine call with no bound)

    actions.on_stop = on_stop

    async def go() -> list[dict[str, Any]]:
        d = Daemon(settings, actions=actions)
        await d.startup()
        loop_task = asyncio.create_task(d.main_loop())
        try:
            (proc / "meminfo").write_text(low)
            await asyncio.sleep(8.0)
            return list(d.recent_events)
        finally:
            hung.set()
            d.should_exit.set()
            await asyncio.wait_for(loop_task, 10)
            await d.shutdown("test")

    events = asyncio.run(go())
    kinds = [e["kind"] for e in events]
    trips = kinds.count("trip")
    said = [e for e in events if e["kind"] == "stop_stuck"]
    assert actions.stops == ["low_available"]
    assert len(said) == 1 and said[0]["severity"] == "critical", f"{trips} trip event(s); kinds {kinds}"
    assert "the stop for low_available has not ended 3 s after it began" in said[0]["message"], said
