"""sparkd.ops.doctor: on this real host, and on a fixture GB10 tree with exact statuses.

The fixture /dev tree uses symlinks to real character devices (/dev/null,
/dev/zero): ``nvidia_device_nodes`` follows links with ``os.stat``, so no
mknod is needed. /dev/char links are plain symlinks in the tmp tree.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from sparkd.ops.doctor import (
    Check,
    DoctorContext,
    LastTrip,
    UnitStatus,
    exit_code,
    format_report,
    nvidia_device_nodes,
    run_checks,
)
from sparkd.sense.procfs import read_meminfo
from sparkd.units import GiB
from tests.conftest import fixture

NOW = 1_800_000_000.0
TITLES = [
    "GPU",
    "GPU memory",
    "Docker",
    "NVIDIA runtime",
    "cgroup",
    "Swap",
    "Kernel watermarks",
    "MemTotal",
    "usable memory",
    "Sampling",
    "/dev/shm",
    "/proc visibility",
    "daemon-reload GPU risk",
    "sparkd unit",
    "Last trip",
]


def test_it_runs_on_this_host() -> None:
    checks = run_checks(DoctorContext())
    titles = [c.title for c in checks]
    assert {"Docker", "cgroup", "Swap", "MemTotal", "/dev/shm", "sparkd unit"} <= set(titles)
    assert all(c.status in ("OK", "WARN", "FAIL") for c in checks)
    assert all(c.action for c in checks if c.status != "OK")
    assert not [c for c in checks if "crashed" in c.detail]
    [mem] = [c for c in checks if c.title == "MemTotal"]
    total = read_meminfo("/proc").fields["MemTotal"]
    assert mem.detail == f"{total / GiB:.2f} GiB"
    report = format_report(checks)
    assert len([ln for ln in report.splitlines() if "—" in ln]) == len(checks)
    assert exit_code(checks) in (0, 1)


# --- a GB10 host as fixture files ---------------------------------------------

GB10_DOCKER_INFO = {
    "Runtimes": {"nvidia": {"path": "nvidia-container-runtime"}, "runc": {"path": "runc"}},
    "CgroupDriver": "systemd",
    "CgroupVersion": "2",
}


class FakeHost:
    """Answers the commands doctor runs, from fixtures; records what was asked."""

    def __init__(self, tmp: Path, *, nvidia_smi: str | None, docker_info: dict | None) -> None:
        self.nvidia_smi = nvidia_smi
        self.docker_info = docker_info
        self.calls: list[tuple[str, ...]] = []

    def run(self, argv: Sequence[str]) -> tuple[int, str]:
        argv = tuple(argv)
        self.calls.append(argv)
        if argv == ("nvidia-smi",):
            return (127, "") if self.nvidia_smi is None else (0, self.nvidia_smi)
        if argv[:2] == ("docker", "info"):
            if self.docker_info is None:
                return 1, "Cannot connect to the Docker daemon"
            return 0, json.dumps(self.docker_info)
        if argv[:2] == ("systemctl", "is-active"):
            return 0, "active\n"
        if argv[:2] == ("systemctl", "is-enabled"):
            return 0, "enabled\n"
        raise AssertionError(f"unexpected command {argv}")


def _gb10_ctx(tmp_path: Path, *, char_links: bool = True) -> tuple[DoctorContext, FakeHost]:
    proc = tmp_path / "proc"
    (proc / "sys" / "vm").mkdir(parents=True)
    shutil.copy(fixture("meminfo", "gb10-idle.meminfo"), proc / "meminfo")
    (proc / "sys" / "vm" / "min_free_kbytes").write_text("67584\n")
    (proc / "sys" / "vm" / "watermark_scale_factor").write_text("10\n")
    sys_root = tmp_path / "sys"
    (sys_root / "fs" / "cgroup").mkdir(parents=True)
    (sys_root / "fs" / "cgroup" / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    shm = tmp_path / "shm"
    shm.mkdir()
    dev = tmp_path / "dev"
    (dev / "char").mkdir(parents=True)
    # Real char devices stand in for the NVIDIA nodes: nvidia0 = 1:3, nvidiactl = 1:5.
    os.symlink("/dev/null", dev / "nvidia0")
    os.symlink("/dev/zero", dev / "nvidiactl")
    (dev / "nvidia-caps").mkdir()
    if char_links:
        os.symlink("../nvidia0", dev / "char" / "1:3")
        os.symlink("../nvidiactl", dev / "char" / "1:5")
    run_root = tmp_path / "run"
    (run_root / "systemd" / "system").mkdir(parents=True)
    host = FakeHost(
        tmp_path,
        nvidia_smi=fixture("nvidia-smi", "gb10.txt").read_text(),
        docker_info=GB10_DOCKER_INFO,
    )
    ctx = DoctorContext(
        proc_root=proc,
        sys_root=sys_root,
        shm_dir=shm,
        dev_root=dev,
        run_root=run_root,
        run=host.run,
        docker_ping=lambda: (True, "engine 28.2.2"),
        last_trip=lambda: None,
        now=lambda: NOW,
    )
    return ctx, host


def _statuses(checks: list[Check]) -> dict[str, str]:
    return {c.title: c.status for c in checks}


def test_it_passes_a_healthy_gb10(tmp_path: Path) -> None:
    ctx, host = _gb10_ctx(tmp_path)
    checks = run_checks(ctx)
    assert [c.title for c in checks] == TITLES
    assert all(c.status == "OK" for c in checks), format_report(checks)
    by = {c.title: c.detail for c in checks}
    assert by["GPU"] == "NVIDIA GB10, driver 580.126.09, CUDA 13.0"
    assert by["GPU memory"] == ("Not Supported (unified memory, GB10): /proc/meminfo is the ground truth")
    assert by["MemTotal"] == "121.69 GiB"
    assert by["usable memory"] == (
        "112.94 GiB = MemAvailable 113.07 GiB - CmaFree 0.13 GiB "
        "(free CMA is not usable by the driver; the rules judge usable)"
    )
    assert by["Swap"].startswith("off")
    assert by["daemon-reload GPU risk"] == "2 NVIDIA nodes linked in /dev/char"
    assert by["sparkd unit"] == "active, enabled"
    assert exit_code(checks) == 0
    # docker info is asked once and shared by the runtime and the GPU-risk checks.
    assert sum(1 for c in host.calls if c[:2] == ("docker", "info")) == 1


def test_it_warns_a_sampling_interval_that_sees_a_fall_late(tmp_path: Path) -> None:
    """``interval_s = 40`` was accepted without a word: a 12 s stop, the headline calm meanwhile (helper-48)."""
    ctx, _ = _gb10_ctx(tmp_path)
    [ok] = [c for c in run_checks(ctx) if c.title == "Sampling"]
    assert (ok.status, ok.detail) == ("OK", "every 1 s")
    ctx.interval_s = 40
    [slow] = [c for c in run_checks(ctx) if c.title == "Sampling"]
    assert slow.status == "WARN" and "a fall is first seen up to 40 s late" in slow.detail
    assert exit_code(run_checks(ctx)) == 0


def test_it_fails_missing_dev_char_links_with_the_systemd_cgroup_driver(tmp_path: Path) -> None:
    ctx, _ = _gb10_ctx(tmp_path, char_links=False)
    [risk] = [c for c in run_checks(ctx) if c.title == "daemon-reload GPU risk"]
    assert risk.status == "FAIL"
    assert "2/2 NVIDIA nodes lack /dev/char links (nvidia0, nvidiactl)" in risk.detail
    assert "nvidia-ctk system create-dev-char-symlinks --create-all" in risk.action
    assert exit_code(run_checks(ctx)) == 1


def test_it_warns_missing_links_with_the_cgroupfs_driver(tmp_path: Path) -> None:
    ctx, host = _gb10_ctx(tmp_path, char_links=False)
    host.docker_info = {**GB10_DOCKER_INFO, "CgroupDriver": "cgroupfs"}
    assert _statuses(run_checks(ctx))["daemon-reload GPU risk"] == "WARN"


def test_it_says_not_a_gpu_host_without_nvidia_nodes(tmp_path: Path) -> None:
    ctx, host = _gb10_ctx(tmp_path)
    for n in ("nvidia0", "nvidiactl"):
        (ctx.dev_root / n).unlink()
    host.nvidia_smi = None
    checks = run_checks(ctx)
    st = _statuses(checks)
    assert (st["GPU"], st["daemon-reload GPU risk"]) == ("WARN", "OK")
    assert "GPU memory" not in st
    assert "not a GPU host" in next(c.detail for c in checks if c.title.startswith("daemon"))


def test_it_lists_nvidia_nodes_through_links(tmp_path: Path) -> None:
    ctx, _ = _gb10_ctx(tmp_path)
    assert nvidia_device_nodes(ctx.dev_root) == [("nvidia0", 1, 3), ("nvidiactl", 1, 5)]


@pytest.mark.parametrize(
    ("mutate", "title", "status"),
    [
        ("swap_on", "Swap", "WARN"),
        ("wsf_raised", "Kernel watermarks", "WARN"),
        ("min_free_raised", "Kernel watermarks", "WARN"),
        ("low_watermark_high", "Kernel watermarks", "WARN"),
        ("cgroup_v1", "cgroup", "WARN"),
        ("cgroup_hybrid", "cgroup", "WARN"),
        ("shm_leftovers", "/dev/shm", "WARN"),
        ("shm_other", "/dev/shm", "OK"),
        ("docker_down", "Docker", "FAIL"),
        ("no_nvidia_runtime", "NVIDIA runtime", "WARN"),
        ("no_systemd", "sparkd unit", "WARN"),
        ("unit_inactive", "sparkd unit", "WARN"),
        ("recent_trip", "Last trip", "WARN"),
        ("old_trip", "Last trip", "OK"),
        ("smi_broken", "GPU", "FAIL"),
    ],
)
def test_it_reports_each_condition(tmp_path: Path, mutate: str, title: str, status: str) -> None:
    ctx, host = _gb10_ctx(tmp_path)
    vm = ctx.proc_root / "sys" / "vm"
    if mutate == "swap_on":
        text = (ctx.proc_root / "meminfo").read_text()
        text = text.replace("SwapTotal:              0 kB", "SwapTotal:       16777216 kB")
        (ctx.proc_root / "meminfo").write_text(text)
    elif mutate == "wsf_raised":
        (vm / "watermark_scale_factor").write_text("200\n")
    elif mutate == "min_free_raised":
        (vm / "min_free_kbytes").write_text("4194304\n")
    elif mutate == "low_watermark_high":
        pages = 2 * GiB // os.sysconf("SC_PAGE_SIZE")
        zoneinfo = f"Node 0, zone   Normal\n  pages free 1\n        min 1\n        low {pages}\n"
        (ctx.proc_root / "zoneinfo").write_text(zoneinfo)
    elif mutate == "cgroup_v1":
        (ctx.sys_root / "fs" / "cgroup" / "cgroup.controllers").unlink()
    elif mutate == "cgroup_hybrid":
        (ctx.sys_root / "fs" / "cgroup" / "cgroup.controllers").unlink()
        (ctx.sys_root / "fs" / "cgroup" / "unified").mkdir()
        (ctx.sys_root / "fs" / "cgroup" / "unified" / "cgroup.controllers").write_text("")
    elif mutate == "shm_leftovers":
        (ctx.shm_dir / "psm_3f2a9c").write_bytes(b"x" * 4096)
        (ctx.shm_dir / "nccl-AbC123").write_bytes(b"")
    elif mutate == "shm_other":
        (ctx.shm_dir / "pulse-shm-1234").write_bytes(b"x")
    elif mutate == "docker_down":
        ctx.docker_ping = lambda: (False, "ConnectionError: socket not found")
    elif mutate == "no_nvidia_runtime":
        host.docker_info = {"Runtimes": {"runc": {}}, "CgroupDriver": "systemd"}
    elif mutate == "no_systemd":
        shutil.rmtree(ctx.run_root / "systemd")
    elif mutate == "unit_inactive":
        ctx.unit_status = lambda: UnitStatus(True, "failed", "enabled")
    elif mutate == "recent_trip":
        ctx.last_trip = lambda: LastTrip(NOW - 3600, "MemAvailable 5.2 GiB < 6 GiB")
    elif mutate == "old_trip":
        ctx.last_trip = lambda: LastTrip(NOW - 30 * 86400, "MemAvailable low")
    elif mutate == "smi_broken":
        host.nvidia_smi = "Failed to initialize NVML: Unknown Error\n"
    checks = run_checks(ctx)
    st = _statuses(checks)
    assert st[title] == status, format_report(checks)
    others = {t: s for t, s in st.items() if t != title}
    assert set(others.values()) == {"OK"}, format_report(checks)


def test_a_proc_without_memavailable_fails(tmp_path: Path) -> None:
    # container-virtualised /proc (lxcfs) as in field-2/proc-no-memavailable: the guard would be blind
    ctx, _ = _gb10_ctx(tmp_path)
    shutil.copy(fixture("field-2", "proc-no-memavailable", "meminfo"), ctx.proc_root / "meminfo")
    checks = run_checks(ctx)
    fail = [c for c in checks if c.status == "FAIL"]
    assert [(c.title, c.detail) for c in fail] == [
        (
            "MemAvailable",
            f"not in {ctx.proc_root}/meminfo: the rules that need it cannot evaluate (sparkd would be blind)",
        )
    ]
    assert "lxcfs" in fail[0].action
    assert exit_code(checks) == 1


def test_it_names_the_system_not_pid1_situation(tmp_path: Path) -> None:
    ctx, host = _gb10_ctx(tmp_path)
    shutil.rmtree(ctx.run_root / "systemd")
    [unit] = [c for c in run_checks(ctx) if c.title == "sparkd unit"]
    assert unit.detail == "systemd is not running as PID 1 here"
    assert not [c for c in host.calls if c[0] == "systemctl"]


def test_a_recent_trip_shows_its_reason(tmp_path: Path) -> None:
    ctx, _ = _gb10_ctx(tmp_path)
    ctx.last_trip = lambda: LastTrip(NOW - 7200, "MemAvailable 5.2 GiB < 6 GiB for 5/5 samples")
    [trip] = [c for c in run_checks(ctx) if c.title == "Last trip"]
    assert trip.detail.endswith("(2.0 h ago): MemAvailable 5.2 GiB < 6 GiB for 5/5 samples")
    # the archives' directory the operator configured, not a fixed /var/lib/sparkd (a walk-through's was elsewhere)
    ctx.archives_dir = tmp_path / "state" / "archives"
    [trip] = [c for c in run_checks(ctx) if c.title == "Last trip"]
    assert f"postmortem archive in {tmp_path / 'state' / 'archives'}" in trip.action


def test_a_crashing_check_still_gives_a_report(tmp_path: Path) -> None:
    ctx, _ = _gb10_ctx(tmp_path)
    (ctx.proc_root / "meminfo").unlink()
    checks = run_checks(ctx)
    assert [c.title for c in checks if c.status == "FAIL"] == ["swap", "watermarks", "memtotal", "rule_inputs"]
    assert exit_code(checks) == 1


def test_format_report_aligns_and_adds_actions() -> None:
    checks = [
        Check("OK", "MemTotal", "121.69 GiB"),
        Check("WARN", "Swap", "on", "swapoff -a"),
        Check("FAIL", "Docker", "not reachable", "systemctl start docker"),
    ]
    assert format_report(checks).splitlines() == [
        "OK   MemTotal — 121.69 GiB",
        "WARN Swap     — on",
        "              → swapoff -a",
        "FAIL Docker   — not reachable",
        "              → systemctl start docker",
    ]
    assert exit_code(checks) == 1
    assert exit_code(checks[:2]) == 0


def test_the_last_trip_is_the_last_that_asked_for_a_stop_not_a_trip_with_the_model_down(tmp_path: Path) -> None:
    """After a stop, a rule that holds with the model down trips once per cooldown ("nothing to stop", warnings):
    doctor's "Last trip" showed one of those, not the trip that stopped the model (helper-44)."""
    import time

    from sparkd.config import load_settings
    from sparkd.face.cli.admin import _last_trip
    from sparkd.store.store import Store

    settings = load_settings(overrides={"state_dir": str(tmp_path)})
    store = Store.open(settings.db_file, migrate=True)
    t = time.time() - 600
    store.write_batch(
        [
            ("event", {"ts": t, "kind": "trip", "severity": "critical", "message": "low_available: stopped it"}),
            ("event", {"ts": t + 60, "kind": "trip", "severity": "warning", "message": "the model is stopped: …"}),
            ("event", {"ts": t + 120, "kind": "trip", "severity": "warning", "message": "the model is stopped: …"}),
        ]
    )
    store.close()
    trip = _last_trip(settings)
    assert trip is not None and (trip.at_s, trip.reason) == (t, "low_available: stopped it"), trip
