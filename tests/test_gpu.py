"""sparkd.sense.gpu: NVML readings through an injected fake pynvml, and nvidia-smi text parsers."""

from __future__ import annotations

import collections
import itertools
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sparkd.sense.gpu import (
    GpuReading,
    GpuSampler,
    GpuSession,
    parse_nvidia_smi_query_csv,
    parse_nvidia_smi_table,
    read_gpu,
)
from sparkd.units import GiB, MiB
from tests.conftest import REPO, fixture

GB10_MEMTOTAL = 127600748 * 1024  # gb10-idle.meminfo


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__({3: "Not Supported", 9: "Driver Not Loaded"}.get(value, f"code {value}"))
        self.value = value


class FakeNvml:
    """The slice of pynvml's API that read_gpu uses."""

    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, *, init_error: int | None = None, memory: Any = None) -> None:
        self.init_error = init_error
        self.memory = memory  # an int error code, or (total, used)
        self.handle_error: int | None = None  # e.g. 15, NVML_ERROR_GPU_IS_LOST: every call on a handle fails too
        self.calls: list[str] = []
        self.asked: collections.Counter[str] = collections.Counter()  # each NVML function called, how often

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name not in ("nvmlInit", "nvmlShutdown"):
            object.__getattribute__(self, "asked")[name] += 1
        return object.__getattribute__(self, name)

    def _on_handle(self) -> None:
        if self.handle_error is not None:  # a handle of a GPU that fell off the bus
            raise FakeNVMLError(self.handle_error)

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.126.09"

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        if self.handle_error is not None:
            raise FakeNVMLError(self.handle_error)
        return f"h{i}"

    def nvmlDeviceGetName(self, h: str) -> bytes:
        return b"NVIDIA GB10"  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, h: str) -> SimpleNamespace:
        self._on_handle()
        return SimpleNamespace(gpu=7, memory=0)

    def nvmlDeviceGetTemperature(self, h: str, kind: int) -> int:
        self._on_handle()
        assert kind == self.NVML_TEMPERATURE_GPU
        return 36

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        self._on_handle()
        return 11170  # mW

    def nvmlDeviceGetMemoryInfo(self, h: str) -> SimpleNamespace:
        self._on_handle()
        if isinstance(self.memory, int):
            raise FakeNVMLError(self.memory)
        total, used = self.memory
        return SimpleNamespace(total=total, used=used, free=total - used)


def test_it_reads_every_field_when_nvml_reports_memory() -> None:
    nvml = FakeNvml(memory=(GB10_MEMTOTAL, 3 * GiB))
    [r] = read_gpu(nvml)
    assert r == GpuReading(
        index=0,
        name="NVIDIA GB10",
        driver_version="580.126.09",
        utilization_pct=7.0,
        temperature_c=36.0,
        power_w=11.17,
        memory_total_bytes=GB10_MEMTOTAL,  # some drivers: total == MemTotal; kept as is
        memory_used_bytes=3 * GiB,
        memory_supported=True,
    )
    assert nvml.calls == ["init", "shutdown"]


def test_it_keeps_the_rest_when_memory_is_not_supported() -> None:
    [r] = read_gpu(FakeNvml(memory=3))
    assert r.available and r.memory_supported is False
    assert r.memory_total_bytes is None and r.memory_used_bytes is None
    assert (r.name, r.temperature_c, r.power_w) == ("NVIDIA GB10", 36.0, 11.17)
    assert r.notes == ()


def test_it_notes_other_memory_errors_without_calling_them_unsupported() -> None:
    [r] = read_gpu(FakeNvml(memory=999))
    assert r.memory_supported is None
    assert r.notes == ("memory: code 999",)


def test_it_reports_unavailable_without_a_driver() -> None:
    nvml = FakeNvml(init_error=9)
    assert read_gpu(nvml) == [GpuReading.unavailable("NVML init failed: Driver Not Loaded")]
    assert "shutdown" not in nvml.calls


def test_it_reports_unavailable_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one global patch: make `import pynvml` fail even where it is installed.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    [r] = read_gpu()
    assert not r.available and "nvidia-ml-py" in (r.reason or "")


def test_a_session_initializes_nvml_once_across_readings() -> None:
    """The daemon reads every gpu_interval_s (5 s): one nvmlInit for its life, not 17,280 a day."""
    nvml = FakeNvml(memory=3)
    s = GpuSession(nvml)
    readings = [s.read() for _ in range(3)]
    assert nvml.calls == ["init"]
    assert readings == [read_gpu(FakeNvml(memory=3))] * 3  # the same readings as one-off reads
    s.close()
    assert nvml.calls == ["init", "shutdown"]
    s.read()
    assert nvml.calls == ["init", "shutdown", "init"]


def test_a_session_starts_afresh_after_a_lost_handle_or_a_failed_init() -> None:
    now = [0.0]
    nvml = FakeNvml(memory=3)
    s = GpuSession(nvml, clock=lambda: now[0])
    s.read()
    nvml.handle_error = 15  # the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST), the driver reloaded
    [r] = s.read()
    assert r.name == "NVIDIA GB10"  # as the session found it
    assert r.notes == ("utilization: code 15", "temperature: code 15", "power: code 15", "memory: code 15")
    assert nvml.calls == ["init", "shutdown"]  # closed: the next reading opens a new session
    [r] = s.read()  # a new session: the handle itself is refused now; kept for the back-off, not reopened
    assert r.name is None and r.notes == ("handle: code 15",)
    assert nvml.calls == ["init", "shutdown", "init"]
    now[0] += GpuSession.REOPEN_BACKOFF_S
    s.read()  # the back-off is over: closed again
    nvml.handle_error, nvml.init_error = None, 9
    assert s.read() == [GpuReading.unavailable("NVML init failed: Driver Not Loaded")]
    nvml.init_error = None
    [r] = s.read()
    assert r.name == "NVIDIA GB10" and r.notes == ()
    assert nvml.calls == ["init", "shutdown", "init", "shutdown", "init", "init"]


def test_a_session_asks_what_does_not_change_once_and_what_moves_at_every_reading() -> None:
    """The driver's version, the device count, each handle and name: once per session (bench/nvml.py: a
    reading made 8 NVML calls, 4 of them for these); utilization, temperature, power, memory: every time.
    A call that fails for another reason than a stale session (power: no permission) does not reopen it."""
    nvml = FakeNvml(memory=3)
    s = GpuSession(nvml)
    for _ in range(5):
        [r] = s.read()
        assert (r.name, r.driver_version, r.power_w) == ("NVIDIA GB10", "580.126.09", 11.17)
    once = ("nvmlSystemGetDriverVersion", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName")
    assert {k: nvml.asked[k] for k in once} == dict.fromkeys(once, 1)
    moving = ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage")
    assert {k: nvml.asked[k] for k in moving} == dict.fromkeys(moving, 5)

    def no_permission(h: str) -> int:
        raise FakeNVMLError(4)  # NVML_ERROR_NO_PERMISSION

    nvml.nvmlDeviceGetPowerUsage = no_permission  # type: ignore[method-assign]
    for _ in range(3):
        [r] = s.read()
        assert r.power_w is None and r.notes == ("power: code 4",)
    assert nvml.calls == ["init"] and nvml.asked["nvmlDeviceGetHandleByIndex"] == 1


def test_the_sampler_keeps_one_session_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(memory=3)
    monkeypatch.setattr("sparkd.sense.gpu._import_pynvml", lambda: nvml)
    now = [0.0]
    s = GpuSampler(5.0, clock=lambda: now[0])
    for t in range(0, 30):
        now[0] = float(t)
        [r] = s.sample()
        assert r.name == "NVIDIA GB10"
    assert nvml.calls == ["init"]


def test_the_sampler_calls_nvml_at_most_every_interval_and_logs_not_supported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    calls = []

    def reader() -> list[GpuReading]:
        calls.append(now[0])
        return read_gpu(FakeNvml(memory=3))

    s = GpuSampler(10.0, reader=reader, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="sparkd.sense.gpu"):
        for t in range(0, 35):
            now[0] = float(t)
            [r] = s.sample()
            assert r.memory_supported is False
    assert calls == [0.0, 10.0, 20.0, 30.0]
    assert [m for m in caplog.messages if "Not Supported" in m] == [
        "GPU 0 (NVIDIA GB10): NVML memory is Not Supported (unified memory); /proc/meminfo is the ground truth"
    ]


def test_the_sampler_logs_unavailable_again_after_it_cleared(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = [
        [GpuReading.unavailable("x")],
        [GpuReading.unavailable("x")],
        read_gpu(FakeNvml(memory=(1, 1))),
        [GpuReading.unavailable("x")],
    ]
    s = GpuSampler(0.0, reader=lambda: answers.pop(0), clock=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="sparkd.sense.gpu"):
        for _ in range(4):
            s.sample()
    assert caplog.messages == ["GPU readings unavailable: x"] * 2


def test_it_parses_the_gb10_query_csv() -> None:
    text = fixture("nvidia-smi", "gb10-query.csv").read_text()
    assert parse_nvidia_smi_query_csv(text) == [
        {
            "memory.total": None,
            "memory.used": None,
            "memory.free": None,
            "utilization.gpu": 0.0,
            "power.draw": 11.17,
            "temperature.gpu": 35.0,
        }
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name, memory.total [MiB], memory.used [MiB]\nNVIDIA H200, 143771 MiB, 0 MiB\n",
            {"name": "NVIDIA H200", "memory.total": 143771 * MiB, "memory.used": 0},
        ),
        (  # --format=csv,nounits
            "memory.total [MiB], power.draw [W]\n143771, 74.50\n",
            {"memory.total": 143771 * MiB, "power.draw": 74.5},
        ),
        ("power.draw [W]\n[Not Supported]\n", {"power.draw": None}),
    ],
)
def test_it_parses_query_csv_variants(text: str, expected: dict[str, Any]) -> None:
    assert parse_nvidia_smi_query_csv(text) == [expected]


def test_it_parses_the_gb10_table() -> None:
    t = parse_nvidia_smi_table(fixture("nvidia-smi", "gb10.txt").read_text())
    assert (t.driver_version, t.cuda_version) == ("580.126.09", "13.0")
    assert [g.name for g in t.gpus] == ["NVIDIA GB10"]
    assert t.memory_not_supported is True
    assert t.gpus[0].memory_total_bytes is None


def test_it_parses_a_discrete_gpu_table() -> None:
    text = (REPO / "tests" / "fixtures" / "nvidia-smi" / "h200.txt").read_text()
    t = parse_nvidia_smi_table(text)
    assert t.memory_not_supported is False
    assert t.gpus and t.gpus[0].name.startswith("NVIDIA H200")
    assert t.gpus[0].memory_total_bytes and t.gpus[0].memory_total_bytes > 100 * GiB
    assert t.driver_version and t.cuda_version


def test_it_parses_nothing_from_an_empty_text() -> None:
    t = parse_nvidia_smi_table("")
    assert (t.driver_version, t.cuda_version, t.gpus) == (None, None, ())
    assert parse_nvidia_smi_query_csv("") == []


def test_python_m_sparkd_gpu_prints_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sparkd.sense.gpu"],
        capture_output=True,
        text=True,
        cwd=Path(REPO),
        timeout=60,
    )
    import json

    data = json.loads(proc.stdout)
    assert isinstance(data, list) and data
    assert proc.returncode == (0 if all(d["available"] for d in data) else 1)


def test_it_parses_a_discrete_gpu_query_csv() -> None:
    text = (REPO / "tests" / "fixtures" / "nvidia-smi" / "h200-query.csv").read_text()
    [row] = parse_nvidia_smi_query_csv(text)
    assert row["name"] == "NVIDIA H200"
    assert row["driver_version"] == "580.159.04"
    assert row["memory.total"] == 143771 * MiB
    assert row["memory.used"] == 0
    assert row["utilization.gpu"] == 0.0
    assert row["power.draw"] == 112.74


def test_the_daemon_reads_the_gpu_at_the_quiet_cadence_unless_someone_reads_the_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readings are context, never a stop trigger: a real daemon reads NVML every ``gpu_quiet_interval_s`` while
    nothing asks, every ``gpu_interval_s`` while a reader looks (``presenters.status_view``: the dashboard,
    /api/status, a peer) or while it samples fast (asked at the switch). Its own status snapshot does not ask.
    A driver that goes away after a first answer is asked again, not given up on. On an H200 host each reading
    cost ~0.8 ms of CPU in all: 166 µs/s at 5 s (bench/ab.py). NVML itself is replaced here (no driver on this
    machine); ``bench/nvml.py`` reads the real one."""
    import asyncio
    import time

    from sparkd.config import load_settings
    from sparkd.face import presenters
    from sparkd.loop import daemon_decide
    from sparkd.loop.daemon import Daemon
    from sparkd.sense.gpu_helper import GpuHelper

    reads: list[float] = []
    whole = answer = read_gpu(FakeNvml(memory=3))  # before GpuHelper.read is replaced below

    def read(self: GpuHelper) -> list[GpuReading]:
        reads.append(time.monotonic())
        return answer

    monkeypatch.setattr(GpuHelper, "read", read)  # the helper process itself: tests/test_gpu_helper.py

    def since(t: float) -> int:
        return sum(1 for x in reads if x >= t)

    async def scenario() -> dict[str, int]:
        nonlocal answer
        settings = load_settings(
            overrides={
                "state_dir": str(tmp_path / "state"),
                "kernlog_source": "off",
                "gpu_interval_s": 0.5,
                "gpu_quiet_interval_s": 2.5,
            }
        )
        d = Daemon(settings, serve_api=False)
        await d.startup()
        out: dict[str, int] = {}
        try:  # the daemon's ticks are not run here: only this test builds a status
            await asyncio.sleep(0.3)
            t = time.monotonic()
            end = t + 4.0
            while time.monotonic() < end:  # its own snapshot (and /metrics) build the status: they do not ask
                d.status_json()
                await asyncio.sleep(0.1)
            out["quiet"] = since(t)
            t = time.monotonic()
            end = t + 4.0
            while time.monotonic() < end:  # a dashboard polling
                presenters.status_view(d)
                await asyncio.sleep(0.1)
            out["asked"] = since(t)
            await asyncio.sleep(2.6)  # back to the quiet cadence
            monkeypatch.setattr(d.actions, "fast_reason", lambda: "test: sampling fast")
            t = time.monotonic()
            daemon_decide.update_mode(d, None)  # the switch asks at once: no quiet wait to sit out
            assert d.mode == "fast"
            await asyncio.sleep(0.9)
            out["fast_first"] = since(t)
            await asyncio.sleep(3.1)
            out["fast"] = since(t)
            answer = [GpuReading.unavailable("NVML init failed: Driver Not Loaded")]  # the driver goes away
            await asyncio.sleep(1.2)
            answer = whole  # and comes back
            t = time.monotonic()
            await asyncio.sleep(1.2)
            out["after_driver_back"] = since(t)
        finally:
            await d.shutdown("test")
        return out

    got = asyncio.run(scenario())
    assert _spaced(reads), [round(b - a, 3) for a, b in itertools.pairwise(reads)]
    assert 1 <= got["quiet"] <= 2, f"{got}: readings in 4 s with nobody asking (quiet cadence 2.5 s)"
    assert got["asked"] >= 4, f"{got}: readings in 4 s while the status was read (gpu_interval_s 0.5 s)"
    assert got["fast_first"] >= 1, f"{got}: no reading within 0.9 s of the switch to fast sampling"
    assert got["fast"] >= 5, f"{got}: readings in 4 s while sampling fast"
    assert got["after_driver_back"] >= 1, f"{got}: the loop gave up after the driver went away"


def test_a_session_whose_device_stays_gone_reopens_at_most_every_backoff() -> None:
    """The first stale answer reopens at once (a driver reloaded is found at the next reading); a device gone for
    good would otherwise cost an nvmlInit (~13 ms of CPU on an H200 host) at every reading."""
    now = [0.0]
    nvml = FakeNvml(memory=3)
    s = GpuSession(nvml, clock=lambda: now[0])
    s.read()
    nvml.handle_error = 15  # NVML_ERROR_GPU_IS_LOST, and it stays lost
    for _ in range(6):
        now[0] += 30.0
        [r] = s.read()
        assert r.notes, r
    # lost at the first of those readings: closed at once; the new session lost again: kept until the back-off
    assert nvml.calls == ["init", "shutdown", "init"], nvml.calls
    now[0] += GpuSession.REOPEN_BACKOFF_S
    s.read()
    s.read()
    assert nvml.calls == ["init", "shutdown", "init", "shutdown", "init"], nvml.calls
    nvml.handle_error = None  # it came back: readings are whole again, and the next stale answer reopens at once
    now[0] += GpuSession.REOPEN_BACKOFF_S
    s.read()
    [r] = s.read()
    assert r.notes == () and r.name == "NVIDIA GB10"
    nvml.handle_error = 15
    s.read()
    assert nvml.calls[-1] == "shutdown"


def _spaced(reads: list[float]) -> bool:
    """No two readings closer than gpu_interval_s (0.5 s), whoever asked."""
    return all(b - a >= 0.45 for a, b in itertools.pairwise(reads))
