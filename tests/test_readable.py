"""The kernel log is read when the event loop saw its descriptor readable (loop.readable, issue 18)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest
from conftest import need

from sparkd.config import load_settings
from sparkd.loop.daemon import Daemon, MonitorOnly
from sparkd.loop.readable import ReadableGate
from sparkd.sense.kernlog_readers import KmsgSource

pytestmark = pytest.mark.anyio


class PipeSource:
    """A reader over a pipe that counts its polls."""

    name = "pipe"
    error: str | None = None

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.polls = 0
        self.closed = False

    def fileno(self) -> int | None:
        return None if self.closed else self.r

    def poll(self) -> list[str]:
        self.polls += 1
        try:
            return os.read(self.r, 65536).decode().splitlines()
        except BlockingIOError:
            return []

    def close(self) -> None:
        if not self.closed:
            os.close(self.r)
            os.close(self.w)
            self.closed = True


async def _spin() -> None:
    for _ in range(3):  # let the loop run its selector
        await asyncio.sleep(0.01)


async def test_the_gate_opens_once_at_start_then_only_when_something_arrived() -> None:
    src = PipeSource()
    gate = ReadableGate(asyncio.get_running_loop(), src)
    try:
        assert gate() is True  # the first poll always
        await _spin()
        assert [gate() for _ in range(5)] == [False] * 5  # nothing arrived: no read
        os.write(src.w, b"NVRM: one\n")
        await _spin()
        assert gate.wakeups == 1 and gate() is True
        assert src.poll() == ["NVRM: one"]
        await _spin()
        assert gate() is False
    finally:
        gate.close()
        src.close()


async def test_a_flood_wakes_the_loop_once_until_the_next_poll() -> None:
    src = PipeSource()
    gate = ReadableGate(asyncio.get_running_loop(), src)
    try:
        assert gate() is True
        for i in range(50):
            os.write(src.w, f"line {i}\n".encode())
            await asyncio.sleep(0)
        await _spin()
        assert gate.wakeups == 1  # disarmed after the first readable event
        assert gate() is True
        # a poll that leaves records behind: the re-armed reader fires again at once
        os.read(src.r, 10)
        await _spin()
        assert gate.wakeups == 2 and gate() is True
    finally:
        gate.close()
        src.close()


async def test_a_source_without_a_descriptor_or_closed_is_polled_every_tick() -> None:
    class NoFd:
        def poll(self) -> list[str]:
            return []

    gate = ReadableGate(asyncio.get_running_loop(), NoFd())
    assert [gate() for _ in range(3)] == [True] * 3
    src = PipeSource()
    gate = ReadableGate(asyncio.get_running_loop(), src)
    assert gate() is True
    await _spin()
    assert gate() is False
    src.close()  # the reader ended (journalctl exited): read every tick, never silently skipped
    assert [gate() for _ in range(3)] == [True] * 3


async def test_real_kmsg_records_open_the_gate() -> None:
    need(os.access("/dev/kmsg", os.R_OK | os.W_OK), "root with read/write /dev/kmsg")
    marker = f"sparkd-test-gate-{uuid.uuid4()}"
    with KmsgSource() as src:
        gate = ReadableGate(asyncio.get_running_loop(), src)
        try:
            assert gate() is True
            src.poll()  # whatever arrived since the open
            await _spin()
            with open("/dev/kmsg", "w") as f:
                f.write(f"NVRM: {marker}: NV_ERR_NO_MEMORY\n")
            deadline = time.monotonic() + 3.0
            while not gate.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert gate() is True
            assert any(marker in ln for ln in src.poll())
        finally:
            gate.close()


async def test_the_daemon_reads_the_kernel_log_only_when_it_has_records(tmp_path: Path) -> None:
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "kernlog_source": "off",
            "interval_s": 0.1,
            "fast_interval_s": 0.1,
            "api": {"enabled": False},
            "consumers": {"enabled": False},
        }
    )
    src = PipeSource()
    d = Daemon(settings, actions=MonitorOnly(), serve_api=False)
    from sparkd.loop.guard import Guard

    d.guard = Guard(settings, src)
    await d.startup()
    task = asyncio.create_task(d.main_loop())
    try:
        await asyncio.sleep(1.0)
        ticks0, polls0 = d.samples_taken, src.polls
        assert ticks0 >= 6 and polls0 <= 2, (ticks0, polls0)  # the first poll, nothing since
        os.write(src.w, b"NVRM: Xid (PCI:0000:01:00): 31, NV_ERR_NO_MEMORY test\n")
        deadline = time.monotonic() + 3.0
        while d.guard.kern_lines_total == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert d.guard.kern_lines_total == 1 and src.polls == polls0 + 1
    finally:
        d.request_exit()
        await task
        await d.shutdown("test")
        src.close()
    assert [e for e in d.recent_events if e["kind"] == "nvrm_no_memory"]
