"""Relief before stopping: the policy (pure) and the real drop path (root)."""

from __future__ import annotations

import os
from pathlib import Path

from sparkd.act.pagecache import drop_clean_cache
from sparkd.core.relief import ReliefPolicy, reclaimable_page_cache_bytes, relief_helped, uses_mem_free
from sparkd.sense.procfs import parse_meminfo
from sparkd.units import GiB, MiB
from tests.conftest import fixture, need


def test_it_estimates_reclaimable_cache_from_meminfo() -> None:
    m = {"Active(file)": 3 * GiB, "Inactive(file)": 2 * GiB, "Mapped": 1 * GiB, "Dirty": 100 * MiB, "Writeback": 0}
    # 3 + 2 − 1 − 0.098 GiB
    assert reclaimable_page_cache_bytes(m) == 4 * GiB - 100 * MiB
    assert reclaimable_page_cache_bytes({**m, "Mapped": 9 * GiB}) == 0  # floored
    assert reclaimable_page_cache_bytes({"MemFree": 1}) is None


def test_it_reads_the_gb10_idle_figures() -> None:
    m = parse_meminfo(fixture("meminfo", "gb10-idle.meminfo").read_text()).fields
    r = reclaimable_page_cache_bytes(m)
    assert r is not None
    assert r == m["Active(file)"] + m["Inactive(file)"] - m["Mapped"] - m["Dirty"] - m["Writeback"]


def test_it_relieves_only_for_memfree_rules_with_enough_cache_and_once_a_minute() -> None:
    p = ReliefPolicy(enabled=True)
    assert uses_mem_free(["MemFree", "MemAvailable"]) and not uses_mem_free(["MemAvailable"])
    assert not p.should_relieve([], 5 * GiB, 0.0)  # no MemFree rule counting
    assert not p.should_relieve(["low_free_with_evidence"], 512 * MiB, 0.0)  # < 1 GiB reclaimable
    assert p.should_relieve(["low_free_with_evidence"], 5 * GiB, 0.0)
    p.started(0.0)
    assert not p.should_relieve(["low_free_with_evidence"], 5 * GiB, 59.0)  # rate limit
    assert p.should_relieve(["low_free_with_evidence"], 5 * GiB, 60.0)
    p.failed("drop_caches hung for 5 s")
    assert not p.should_relieve(["low_free_with_evidence"], 5 * GiB, 500.0)  # latched off for the run


def test_it_is_off_by_default() -> None:
    assert not ReliefPolicy().should_relieve(["r"], 10 * GiB, 0.0)


def test_a_counter_resets_only_when_memfree_actually_rose() -> None:
    assert relief_helped(1 * GiB, 2 * GiB)
    assert not relief_helped(1 * GiB, 1 * GiB + 10 * MiB)
    assert not relief_helped(None, 2 * GiB)


def _mem_free() -> int:
    return parse_meminfo(Path("/proc/meminfo").read_text()).fields["MemFree"]


def test_the_real_drop_frees_page_cache(tmp_path: Path) -> None:
    need(os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK), "root and a writable drop_caches")
    # fill the page cache with a clean 512 MiB file
    f = tmp_path / "cache-filler.bin"
    with open(f, "wb") as fh:
        block = os.urandom(1 << 20)
        for _ in range(512):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    with open(f, "rb") as fh:
        while fh.read(1 << 22):
            pass
    before = parse_meminfo(Path("/proc/meminfo").read_text()).fields
    assert reclaimable_page_cache_bytes(before) is not None
    drop_clean_cache()
    after = parse_meminfo(Path("/proc/meminfo").read_text()).fields
    # our 512 MiB file was clean and unmapped: the drop gives (most of) it back as MemFree
    assert after["MemFree"] - before["MemFree"] >= 256 * MiB, (before["MemFree"], after["MemFree"])
    assert after["Cached"] < before["Cached"]
