"""Who holds the memory: attribution by cgroup, summaries, and a real scan of real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkd.core.consumers import ConsumerSummary, ProcessMem, cotenant_excess, fall_shares, group_of, summarize
from sparkd.sense.consumers import ConsumerScanner
from sparkd.units import GiB, MiB

CID = "3f" * 32  # a full 64-hex container id

# cgroup texts as the kernel writes them
V1_DOCKER = f"12:memory:/docker/{CID}\n1:name=systemd:/docker/{CID}\n"
V2_SYSTEMD_DRIVER = f"0::/system.slice/docker-{CID}.scope\n"
V2_SERVICE = "0::/system.slice/ssh.service\n"
V2_USER = "0::/user.slice/user-1000.slice/session-3.scope\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (V1_DOCKER, "container"),
        (V2_SYSTEMD_DRIVER, "container"),  # under system.slice, but the container id decides first
        (V2_SERVICE, "system"),
        ("0::/init.scope\n", "system"),
        (V2_USER, "host"),
        ("", "host"),  # unreadable: counted as a co-tenant, never hidden in the container's share
    ],
)
def test_it_attributes_a_process_by_its_cgroup(text: str, expected: str) -> None:
    assert group_of(text, [CID]) == expected


def test_it_does_not_take_another_containers_process_for_ours() -> None:
    # another container (a second engine) is a co-tenant, even under system.slice
    assert group_of(f"0::/system.slice/docker-{'ab' * 32}.scope\n", [CID]) == "host"
    assert group_of(f"4:memory:/docker/{'ab' * 32}\n", [CID]) == "host"


def test_it_sums_groups_and_names_the_biggest_co_tenants() -> None:
    procs = [ProcessMem(100, "vllm", 90 * GiB, "container"), ProcessMem(101, "python3", 3 * GiB, "container")]
    procs += [ProcessMem(200 + i, "cc1plus", 320 * MiB, "host") for i in range(16)]
    procs += [ProcessMem(300, "python", 1400 * MiB, "host"), ProcessMem(1, "systemd", 12 * MiB, "system")]
    s = summarize(procs, at=0.0, top_n=3)
    assert s.totals == {"container": 93 * GiB, "host": 16 * 320 * MiB + 1400 * MiB, "system": 12 * MiB}
    assert [p.pid for p in s.top] == [100, 101, 300]
    # 16 × 320 MiB = 5.00 GiB of cc1plus comes first among the host's names
    assert s.text().startswith("container 93.00 GiB · host co-tenants 6.37 GiB: cc1plus ×16 5.00 GiB, python 1.37 GiB")
    assert s.to_json()["totals_bytes"]["host"] == s.totals["host"]
    assert cotenant_excess(s, 6 * GiB) == s.totals["host"] - 6 * GiB
    assert cotenant_excess(s, 8 * GiB) == 0


def test_with_no_container_watched_it_says_so_instead_of_container_0_gib() -> None:
    """Monitor-only (or before a launch): nothing is the container, and "container 0.00 GiB" would read as
    a measured zero (README: anything not measured reads n/a, never 0)."""
    procs = [ProcessMem(300, "python", 1400 * MiB, "host"), ProcessMem(1, "systemd", 12 * MiB, "system")]
    s = summarize(procs, at=0.0, watched=False)
    assert s.text() == "no container watched · host co-tenants 1.37 GiB: python 1.37 GiB · system services 0.01 GiB"
    assert s.to_json()["watched"] is False and summarize(procs, at=0.0).to_json()["watched"] is True


def test_it_splits_a_fall_between_container_and_others() -> None:
    before = summarize([ProcessMem(1, "vllm", 80 * GiB, "container"), ProcessMem(2, "cc1", 1 * GiB, "host")], at=0)
    after = summarize([ProcessMem(1, "vllm", 82 * GiB, "container"), ProcessMem(2, "cc1", 6 * GiB, "host")], at=1)
    assert fall_shares(before, after) == {"container": 2 * GiB, "host": 5 * GiB, "system": 0}
    assert fall_shares(None, after) == {"container": 0, "host": 0, "system": 0}


def test_it_refuses_a_top_of_zero() -> None:
    with pytest.raises(ValueError, match="top_n = 0"):
        summarize([], at=0, top_n=0)


HOG = (
    "import sys, time; b = bytearray(int(sys.argv[1])); b[::4096] = b'x' * len(b[::4096]); "
    "print('ok', flush=True); time.sleep(60)"
)


def test_a_real_scan_finds_a_real_host_process_holding_512_mib(tmp_path: Path) -> None:
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(512 * MiB)], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ok"
        s: ConsumerSummary = ConsumerScanner(top_n=10, uss_top=3).scan([])
        mine = [p for p in s.top if p.pid == hog.pid]
        assert mine, [(p.pid, p.name, p.rss_bytes) for p in s.top]
        assert mine[0].group == "host"
        assert 500 * MiB <= mine[0].rss_bytes <= 700 * MiB
        assert mine[0].uss_bytes is not None and mine[0].uss_bytes >= 500 * MiB
        assert s.scanned > 1 and s.totals["host"] >= mine[0].rss_bytes
    finally:
        hog.kill()
        hog.wait()


def test_a_scan_forgets_processes_that_ended() -> None:
    scanner = ConsumerScanner(top_n=5, uss_top=0)
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        scanner.scan([])
        assert any(pid == p.pid for pid, _ in scanner._known)
    finally:
        p.kill()
        p.wait()
    scanner.scan([])
    assert not any(pid == p.pid for pid, _ in scanner._known)


def test_a_fall_no_process_rss_explains_is_named() -> None:
    """A 16 GiB fall with 0.19 GiB of RSS growth read "container +0.00 GiB, host co-tenants +0.19 GiB" (an
    operator: "reads as nothing grew"); the rest is outside any process's RSS (on a Spark: the GPU driver)."""
    from sparkd.core.consumers import fall_text

    before = summarize([ProcessMem(1, "vllm", 80 * GiB, "container"), ProcessMem(2, "cc1", 1 * GiB, "host")], at=0)
    after = summarize(
        [ProcessMem(1, "vllm", 80 * GiB, "container"), ProcessMem(2, "cc1", GiB + 192 * MiB, "host")], at=1
    )
    text = fall_text(before, after, mem_available_before_bytes=40 * GiB, mem_available_after_bytes=24 * GiB)
    assert text.endswith(
        "system services +0.00 GiB, outside any process's RSS +15.81 GiB (GPU/driver allocations, kernel, page cache)"
    ), text
    small = fall_text(
        before, after, mem_available_before_bytes=40 * GiB, mem_available_after_bytes=40 * GiB - 256 * MiB
    )
    assert small.endswith("system services +0.00 GiB"), small  # 64 MiB outside: noise, not named


def test_a_trip_with_memory_as_low_as_at_the_scan_before_names_no_fall() -> None:
    """A rule that holds with the model down trips again once per cooldown with memory as low as before: "who grew
    since … MemAvailable 2.00 GiB → 2.00 GiB: container +0.00 GiB, …" named a fall there was not (helper-39)."""
    from sparkd.core.consumers import fall_text

    before = summarize([ProcessMem(2, "cc1", 1 * GiB, "host")], at=0)
    after = summarize([ProcessMem(2, "cc1", GiB + 10 * MiB, "host")], at=60)
    text = fall_text(before, after, mem_available_before_bytes=2 * GiB, mem_available_after_bytes=2 * GiB - 100 * MiB)
    assert text.startswith(
        "no fall since 00:00:00 UTC (MemAvailable 2.00 GiB → 1.90 GiB): it was this low already; "
    ), text
    assert text.endswith(f"now: {after.text()}") and "+0.00" not in text, text


def test_sparkd_itself_is_a_system_service_not_a_host_co_tenant() -> None:
    """Run from a shell (the README's command), sparkd was listed among the "host co-tenants" of a trip's "who grew"
    (helper-48). The scanning process is the guard: "system", wherever it was started from. A real scan."""
    import os

    held = bytearray(384 * MiB)  # resident: among the top processes of this machine
    held[::4096] = b"x" * len(held[::4096])
    s = ConsumerScanner(top_n=20, uss_top=0).scan([])
    [me] = [p for p in s.top if p.pid == os.getpid()]
    assert me.group == "system" and me.rss_bytes >= 384 * MiB
    assert len(held) == 384 * MiB
