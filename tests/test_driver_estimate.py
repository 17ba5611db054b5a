"""The driver-memory estimate (MemTotal − MemFree − Buffers − Cached − AnonPages − Slab − PageTables − KernelStack,
CONTEXT.md) on a host without the NVIDIA driver: a remainder of the kernel's other allocations (0.05–0.28 GiB on the
build host), which the Now card showed as "driver (est.) 0.25 GiB" and the leak line trended as driver memory.
Where sparkd knows there is no driver (/proc/driver/nvidia absent: ``GpuReading.no_driver``) the card says so; on a
host with the driver the figure stays. The database keeps the figure either way."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from sparkd.config import load_settings
from sparkd.face.app import create_app
from sparkd.face.presenters import leak_line
from sparkd.loop.daemon import Daemon
from sparkd.loop.status import GpuStatus, LeakStatus
from sparkd.sense.gpu import GpuReading
from sparkd.sense.gpu_helper import GpuHelper

GiB = 2**30


# 16 GiB host; the parts add up to 15.75 GiB: the estimate leaves 0.25 GiB
MEMINFO = (
    "MemTotal: 16777216 kB\nMemFree: 4194304 kB\nMemAvailable: 10485760 kB\nBuffers: 262144 kB\n"
    "Cached: 6291456 kB\nAnonPages: 4194304 kB\nSlab: 1048576 kB\nPageTables: 262144 kB\nKernelStack: 262144 kB\n"
)
NO_DRIVER = GpuReading.unavailable("no NVIDIA driver is loaded (/proc/driver/nvidia is absent)", no_driver=True)
GB10 = GpuReading(index=0, name="NVIDIA GB10", utilization_pct=3.0, memory_supported=False)


def test_the_helper_says_no_driver_where_proc_driver_nvidia_is_absent(tmp_path: Path) -> None:
    helper = GpuHelper(driver_proc=tmp_path / "driver" / "nvidia")  # absent: no helper process is started
    try:
        [reading] = helper.read()
    finally:
        helper.close()
    assert reading.no_driver and not reading.available
    # it survives the trip to the status (the daemon keeps to_json's shape)
    assert GpuStatus.model_validate(reading.to_json()).no_driver
    assert GpuReading.from_json(reading.to_json()) == reading
    # a reading from a driver, or a failure that is not "no driver", says nothing of the kind
    assert not GpuStatus.model_validate(GB10.to_json()).no_driver
    assert not GpuReading.unavailable("NVML init failed").no_driver


async def _sampled_daemon(tmp_path: Path) -> Daemon:
    """A real daemon on ``MEMINFO`` (``tmp_path/proc``) that has taken and handled one sample. Its GPU loop reads
    every 600 s: it does not overwrite within a test the readings a test sets (``Daemon.gpu``)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text(MEMINFO)
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "kernlog_source": "off",
            "proc_root": str(proc),
            "gpu_interval_s": 600.0,
            "gpu_quiet_interval_s": 600.0,
        }
    )
    d = Daemon(settings, serve_api=False)
    await d.startup()
    result = d._tick_once()
    assert result is not None
    await d._handle(result)
    return d


def _driver_row(html: str) -> str:
    m = re.search(r'<tr data-row="driver_bytes"><th>driver \(est\.\)</th><td class="num">(.*?)</td></tr>', html)
    assert m, html
    return re.sub(r"<[^>]+>", "", m.group(1)).strip()


@pytest.mark.anyio
async def test_the_now_card_says_no_nvidia_driver_instead_of_the_estimates_remainder(tmp_path: Path) -> None:
    d = await _sampled_daemon(tmp_path)
    try:
        assert d.status_json().sample.driver_bytes == GiB // 4  # type: ignore[union-attr]  # the data keeps it
        app = create_app(d)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8741") as c:
            await asyncio.sleep(0.2)  # the GPU loop's first reading (this host's own) lands before ours
            d.gpu = [NO_DRIVER.to_json()]
            no_driver = _driver_row((await c.get("/ui/summary")).text)
            summary = (await c.get("/ui/summary.json")).json()
            d.gpu = [GB10.to_json()]
            spark = _driver_row((await c.get("/ui/summary")).text)
            d.gpu = []  # not known (no reading yet): the figure, as before
            unknown = _driver_row((await c.get("/ui/summary")).text)
    finally:
        await d.shutdown("test")
    assert no_driver == "no NVIDIA driver"
    assert spark == unknown == "0.25 GiB"
    [row] = [r for r in summary["summary"]["memory"] if r["key"] == "driver_bytes"]
    assert row["bytes"] == GiB // 4 and row["text"] == "no NVIDIA driver"  # the JSON twin keeps the figure


def test_the_leak_line_reads_no_driver_memory_trend_on_a_host_without_the_driver() -> None:
    leak = LeakStatus(
        state="tracking",
        launch_id="L1",
        baseline_bytes=GiB // 10,
        baseline_late=False,
        current_bytes=GiB // 4,
        peak_bytes=GiB // 4,
        growth_bytes=GiB // 8,
        threshold_bytes=2 * GiB,
        window_s=(120.0, 600.0),
        elapsed_s=700.0,
        alerts=0,
        last_alert_t=None,
    )

    class S:  # only the leak and gpu fields are read
        def __init__(self, gpu: list[GpuReading]) -> None:
            self.leak = leak
            self.gpu = [GpuStatus.model_validate(g.to_json()) for g in gpu]

    assert leak_line(S([NO_DRIVER])) == {  # type: ignore[arg-type]
        "level": "ok",
        "text": "n/a (no NVIDIA driver: the estimate is no driver memory here)",
    }
    assert leak_line(S([GB10]))["text"] == "driver memory +0.12 GiB since warm-up (alert at +2.0 GiB)"  # type: ignore[arg-type,index]


@pytest.mark.anyio
@pytest.mark.parametrize(("gpu", "said"), [(NO_DRIVER, "no NVIDIA driver"), (GB10, "0.25 GiB")])
async def test_sparkd_status_says_no_nvidia_driver_as_the_now_card_does(
    tmp_path: Path, gpu: GpuReading, said: str
) -> None:
    """``sparkd status`` printed the estimate's remainder as ``driver (est.) 0.25 GiB`` on a host without the driver;
    it says so now, from the stored snapshot's GPU reading, and keeps the figure where there is a driver."""
    from click.testing import CliRunner

    from sparkd.face.cli import main

    d = await _sampled_daemon(tmp_path)
    try:
        await asyncio.sleep(0.2)  # the GPU loop's first reading (this host's own) lands before ours
        d.gpu = [gpu.to_json()]
    finally:
        await d.shutdown("test")  # writes the last status snapshot, with that reading
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\nproc_root = "{tmp_path / "proc"}"\n')
    out = CliRunner().invoke(main, ["--config", str(cfg), "status"]).output
    [line] = [ln for ln in out.splitlines() if ln.strip().startswith("driver (est.)")]
    assert line.split("driver (est.)")[1].strip() == said, out
