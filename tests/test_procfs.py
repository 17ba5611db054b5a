from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import fixture

from sparkd.core.sample import build_sample, driver_bytes
from sparkd.sense import procfs
from sparkd.units import GiB


def test_it_parses_the_gb10_idle_fixture_in_bytes() -> None:
    text = fixture("meminfo", "gb10-idle.meminfo").read_text()
    res = procfs.parse_meminfo(text)
    assert res.bad_lines == []
    assert res.fields["MemTotal"] == 127600748 * 1024
    assert round(res.fields["MemTotal"] / GiB, 2) == 121.69
    assert res.fields["MemAvailable"] == 118566368 * 1024
    assert res.fields["HugePages_Total"] == 0  # a count, not kB
    assert res.fields["Hugepagesize"] == 2048 * 1024
    # every line of the fixture is a field
    assert len(res.fields) == len([line for line in text.splitlines() if line.strip()])


def test_it_skips_a_garbage_line_and_reports_it() -> None:
    text = "MemTotal: 100 kB\nthis is not meminfo\nMemFree: abc kB\nMemAvailable: 50 kB\nOdd: 5 MB\n"
    res = procfs.parse_meminfo(text)
    assert res.fields == {"MemTotal": 102400, "MemAvailable": 51200}
    assert res.bad_lines == ["this is not meminfo", "MemFree: abc kB", "Odd: 5 MB"]


def test_a_missing_field_is_none_not_a_crash() -> None:
    res = procfs.parse_meminfo("MemTotal: 100 kB\nMemFree: 10 kB\n")
    s = build_sample(0.0, 0.0, res, None)
    assert s.mem_total == 102400 and s.mem_free == 10240
    assert s.mem_available is None and s.cma_free is None and s.driver_bytes is None
    assert s.psi_some_avg10 is None


def test_it_parses_psi_and_returns_none_when_absent(tmp_path: Path) -> None:
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "memory").write_text(
        "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456\nfull avg10=0.50 avg60=0.10 avg300=0.00 total=789\n"
    )
    psi = procfs.read_psi(tmp_path)
    assert psi is not None
    assert (psi.some_avg10, psi.some_avg60, psi.some_total_us) == (1.5, 0.25, 123456)
    assert (psi.full_avg10, psi.full_total_us) == (0.5, 789)
    assert procfs.read_psi(tmp_path / "nope") is None
    assert procfs.parse_psi("garbage") is None


@pytest.mark.parametrize(
    "text",
    [
        "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456\nfull avg10=0.50 avg60=0.10 avg300=0.00 total=789\n",
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",  # before 5.2 kernels: no full line
        "some avg10=99.99 avg60=12.34 avg300=1.00 total=18446744073709551615\n"
        "full avg10=0.01 avg60=0.00 avg300=0.00 total=1\n",
        "full avg10=0.50 avg60=0.10 avg300=0.00 total=789\nsome avg10=1.50 avg60=0.25 avg300=0.00 total=1\n",
        "some avg10=1.50 avg60=0.25 avg300=0.00 total=1 extra=2\n",  # unknown key: the tolerant parser
        "some avg10=x avg60=0.25 avg300=0.00 total=1\n",
        "garbage",
        "",
    ],
    ids=["some+full", "some-only", "extremes", "full-first", "extra-key", "bad-number", "garbage", "empty"],
)
def test_the_fast_psi_parse_answers_as_the_tolerant_one(text: str) -> None:
    assert procfs.parse_psi_bytes(text.encode()) == procfs.parse_psi(text)


def test_the_fast_psi_parse_reads_this_kernels_file() -> None:
    try:
        raw = Path("/proc/pressure/memory").read_bytes()
    except OSError:
        pytest.skip("this kernel has no PSI (/proc/pressure/memory)")
    assert procfs._PSI_RE.match(raw) is not None, raw  # the fast path, not the fallback
    assert procfs.parse_psi_bytes(raw) == procfs.parse_psi(raw.decode())


@pytest.mark.parametrize(
    "parts",
    [("meminfo", "gb10-idle.meminfo"), ("proc-watermark", "meminfo"), ("field-2", "proc-no-memavailable", "meminfo")],
    ids=["gb10-idle", "proc-watermark", "no-memavailable"],
)
def test_the_named_fields_path_reads_what_the_full_parse_reads(tmp_path: Path, parts: tuple[str, ...]) -> None:
    import re

    text = fixture(*parts).read_text()
    (tmp_path / "meminfo").write_text(text)

    def named(t: str) -> dict[str, int]:
        return {k: v for k, v in procfs.parse_meminfo(t).fields.items() if k in procfs.NAMED_FIELDS}

    r = procfs.ProcReader(tmp_path)
    try:
        assert r.named_meminfo().fields == procfs.parse_meminfo(text).fields  # a full parse learns the layout
        assert r._named is not None
        assert r.named_meminfo().fields == named(text)  # then the named fields, in one match
        # the same layout with other values (wider and narrower numbers): still one match
        changed = re.sub(r"(MemFree: +)\d+", r"\g<1>123456789", text)
        changed = re.sub(r"(Cached: +)\d+", r"\g<1>7", changed)
        assert changed != text
        (tmp_path / "meminfo").write_text(changed)
        got = r.named_meminfo().fields
        assert got == named(changed) and got["MemFree"] == 123456789 * 1024 and r._named is not None
        # a field appears (another kernel, a file swapped under the reader): the full parse again
        (tmp_path / "meminfo").write_text(text + "Zswap:         1 kB\n")
        res = r.named_meminfo()
        assert res.fields["Zswap"] == 1024 and res.fields["MemTotal"] == named(text)["MemTotal"]
        # a garbled line: the tolerant parse, which reports it
        (tmp_path / "meminfo").write_text(text.replace("MemFree:", "MemFree", 1))
        assert r.named_meminfo().bad_lines
        # a garbled value in the learned layout (same tokens, one not a number): reported, never raised
        # (a ValueError here ended the daemon)
        (tmp_path / "meminfo").write_text(text)
        r.named_meminfo()  # learn the layout again
        assert r._layout is not None
        (tmp_path / "meminfo").write_text(re.sub(r"(MemFree: +)\d+", r"\g<1>12x4", text))
        res = r.named_meminfo()
        assert any("12x4" in line for line in res.bad_lines) and "MemFree" not in res.fields
        assert res.fields["MemTotal"] == named(text)["MemTotal"]
    finally:
        r.close()


def test_the_named_fields_path_reads_this_kernels_meminfo() -> None:
    r = procfs.ProcReader("/proc")
    try:
        r.named_meminfo()
        fast = r.named_meminfo().fields
        assert r._named is not None and set(fast) <= set(procfs.NAMED_FIELDS)
        full = procfs.read_meminfo("/proc").fields
        assert set(fast) == {k for k in full if k in procfs.NAMED_FIELDS}
        assert fast["MemTotal"] == full["MemTotal"]
    finally:
        r.close()


def test_it_counts_shm_entries(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"")
    used, count = procfs.read_shm(tmp_path)
    assert count == 2 and used is not None and used >= 0
    assert procfs.read_shm(tmp_path / "missing") == (None, None)


def test_the_shm_reader_lists_again_only_when_an_entry_came_or_went_and_sees_every_change(tmp_path: Path) -> None:
    import os

    r = procfs.ShmReader(tmp_path)
    old = time.time_ns() - 10**9
    os.utime(tmp_path, ns=(old, old))  # a settled directory: its listing is trusted
    assert r.read()[1] == 0 and r.listings == 1
    assert r.read()[1] == 0 and r.listings == 1  # nothing moved: not listed again
    for n in range(1, 4):  # changes within one clock tick of each other: each is seen
        (tmp_path / f"psm_{n}").write_bytes(b"")
        assert r.read()[1] == n
    (tmp_path / "psm_1").unlink()
    assert r.read()[1] == 2
    (got_bytes, got_n), (want_bytes, want_n) = r.read(), procfs.read_shm(tmp_path)
    # the bytes are the file system's usage (statfs): other processes' writes between the two reads move them
    # (CI saw 8 KiB), the entries are this directory's alone
    assert got_n == want_n == 2 and got_bytes is not None and abs(got_bytes - (want_bytes or 0)) < 64 * 2**20
    tmp_path.rename(tmp_path.with_name("gone"))
    assert r.read() == (None, None)


def test_the_shm_reader_answers_again_on_an_unchanged_shmem_and_asks_on_a_change_or_after_max_age(
    tmp_path: Path,
) -> None:
    import os

    def settle() -> None:  # the directory's mtime old enough for its listing to be trusted (SETTLE_S)
        old = time.time_ns() - 10**9
        os.utime(tmp_path, ns=(old, old))

    r = procfs.ShmReader(tmp_path)
    settle()
    first = r.read(1000, 0.0)
    assert first[1] == 0 and r.reads == 1 and r._last is not None
    (tmp_path / "psm_1").write_bytes(b"x" * 4096)
    settle()
    # the same Shmem, within MAX_AGE_S: the last figures, no system call (a change Shmem does not show)
    assert r.read(1000, 1.0) == first and r.reads == 1
    # Shmem moved (the page written above is a shmem page on a tmpfs): asked again, the file is seen
    assert r.read(1000 + 4096, 2.0)[1] == 1 and r.reads == 2 and r._last is not None
    (tmp_path / "psm_2").write_bytes(b"")  # an empty file: Shmem does not move
    settle()
    assert r.read(1000 + 4096, 2.0 + r.MAX_AGE_S - 0.01)[1] == 1 and r.reads == 2  # answered again, stale
    # unchanged for MAX_AGE_S: asked again whatever Shmem says
    assert r.read(1000 + 4096, 2.0 + r.MAX_AGE_S)[1] == 2 and r.reads == 3 and r._last is not None
    # no Shmem given (a rule reads shm_bytes), or no time: asked every time
    assert r.read(None, 12.5)[1] == 2 and r.read(1000 + 4096)[1] == 2 and r.reads == 5
    # a clock that went back is not trusted
    r.read(7, 20.0)
    assert r.reads == 6 and r._last is not None
    r.read(7, 19.0)
    assert r.reads == 7
    # the directory gone: seen when Shmem moves (or within MAX_AGE_S), and a read that failed is never
    # answered again: each tick tries
    tmp_path.rename(tmp_path.with_name(tmp_path.name + "-gone"))
    assert r.read(8, 20.5) == (None, None) and r.read(8, 20.6) == (None, None) and r.reads == 9


def test_the_shm_reader_does_not_answer_again_a_listing_made_within_a_clock_tick_of_a_change(tmp_path: Path) -> None:
    """An entry count taken while the directory's mtime is too recent to trust (``SETTLE_S``) is not answered
    again on an unchanged Shmem: a second entry created in the same clock tick (an empty file moves no Shmem)
    is seen at the next tick."""
    r = procfs.ShmReader(tmp_path)
    (tmp_path / "a").write_bytes(b"")
    assert r.read(5, 0.0)[1] == 1
    (tmp_path / "b").write_bytes(b"")
    assert r.read(5, 1.0)[1] == 2 and r.reads == 2


def test_a_file_written_to_the_real_dev_shm_moves_shmem_and_the_guard_sees_it_at_the_next_tick(
    tmp_path: Path,
) -> None:
    """The premise of answering /dev/shm again on an unchanged Shmem, on this machine's kernel: 8 MiB written to
    a file of this test's own in /dev/shm moves /proc/meminfo's Shmem, and the guard's next sample (no rule on
    shm_bytes, so its reader may answer again) shows them."""
    import os

    from sparkd.config import load_settings
    from sparkd.loop.guard import Guard

    settings = load_settings(overrides={"state_dir": str(tmp_path)})
    guard = Guard(settings)
    assert not guard._shm_exact()  # the default rules do not read shm_bytes
    guard.tick()
    guard.tick()
    before = guard.tick().sample
    reads = guard._shm.reads
    path = Path("/dev/shm") / f"sparkd-test-{os.getpid()}-{time.monotonic_ns()}"
    size = 8 * 2**20  # a container's /dev/shm is 64 MiB by default
    st = os.statvfs("/dev/shm")
    assert st.f_bavail * st.f_frsize > 2 * size, "/dev/shm has no room for this test's 8 MiB"
    try:
        with open(path, "wb") as f:
            f.write(b"\x01" * size)
        after = guard.tick().sample
        assert before.shmem is not None and after.shmem is not None
        # (per-CPU counter deltas of up to ~125 pages each may reach the global figure a second later)
        assert after.shmem - before.shmem >= size // 2, (before.shmem, after.shmem)
        assert before.shm_bytes is not None and after.shm_bytes is not None
        assert after.shm_bytes - before.shm_bytes >= size * 0.9, (before.shm_bytes, after.shm_bytes)
        assert guard._shm.reads > reads
    finally:
        path.unlink(missing_ok=True)


def test_a_rule_on_shm_bytes_gets_a_fresh_dev_shm_figure_every_tick(tmp_path: Path) -> None:
    from sparkd.config import load_settings
    from sparkd.loop.guard import Guard

    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "rules": [{"name": "shm_full", "when": ["shm_bytes > 1000GiB"], "samples": 3}],
        }
    )
    guard = Guard(settings)
    guard.tick()
    assert guard._shm_exact()
    reads = guard._shm.reads
    for _ in range(5):
        guard.tick()
    assert guard._shm.reads == reads + 5


def test_the_fast_reader_agrees_with_the_plain_reader_on_this_host() -> None:
    r = procfs.ProcReader("/proc")
    try:
        first, second = r.meminfo(), r.meminfo()
        plain = procfs.read_meminfo("/proc")
        assert r._layout is not None  # the second read went through the cached layout
    finally:
        r.close()
    assert first.fields.keys() == second.fields.keys() == plain.fields.keys()
    assert second.fields["MemTotal"] == plain.fields["MemTotal"]


def test_the_fast_reader_falls_back_when_the_layout_changes(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemFree: 10 kB\n")
    r = procfs.ProcReader(tmp_path)
    assert r.meminfo().fields == {"MemTotal": 102400, "MemFree": 10240}
    assert r.meminfo().fields["MemFree"] == 10240  # via the cached layout
    # a file replaced in place: the open fd still reads the old inode, so reopen
    r.close()
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable: 20 kB\nJunk line\n")
    res = r.meminfo()
    assert res.fields["MemAvailable"] == 20480 and res.bad_lines == ["Junk line"]
    assert r.psi() is None  # no pressure/ in this tree


@pytest.mark.parametrize(
    ("field", "kb"),
    [
        ("MemFree", 112874312),
        ("Buffers", 412388),
        ("Cached", 6384120),
        ("AnonPages", 1709184),
        ("Slab", 929792),
        ("PageTables", 38912),
        ("KernelStack", 24576),
    ],
)
def test_driver_estimate_terms_come_from_the_fixture(field: str, kb: int) -> None:
    res = procfs.parse_meminfo(fixture("meminfo", "gb10-idle.meminfo").read_text())
    assert res.fields[field] == kb * 1024


def test_driver_estimate_checked_by_hand_on_gb10_fixture() -> None:
    res = procfs.parse_meminfo(fixture("meminfo", "gb10-idle.meminfo").read_text())
    # 127600748 - 112874312 - 412388 - 6384120 - 1709184 - 929792 - 38912 - 24576 = 5227464 kB
    assert driver_bytes(res.fields) == 5227464 * 1024
    assert round(5227464 / 2**20, 2) == 4.99  # GiB


def test_an_unchanged_psi_text_is_not_parsed_again_and_a_changed_one_is(tmp_path: Path) -> None:
    """Issue 18: on a quiet host /proc/pressure/memory reads the same from tick to tick; the last parse
    answers it. Any change in the text (an average, a total) is parsed: the figures never go stale."""
    (tmp_path / "pressure").mkdir()
    f = tmp_path / "pressure" / "memory"
    quiet = "some avg10=0.00 avg60=0.00 avg300=0.00 total=32008\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=21790\n"
    f.write_text(quiet)
    r = procfs.ProcReader(tmp_path)
    first = r.psi()
    assert first is not None and first.some_total_us == 32008
    assert r.psi() is first  # the same text: the same (frozen) answer, not a second parse
    f.write_text(quiet.replace("total=32008", "total=32100"))  # a stall of 92 µs: only the total moved
    moved = r.psi()
    assert moved is not None and moved is not first and moved.some_total_us == 32100
    f.write_text(quiet.replace("some avg10=0.00", "some avg10=3.25"))
    assert (p := r.psi()) is not None and p.some_avg10 == 3.25 and p.some_total_us == 32008
    f.write_text("garbage")
    assert r.psi() is None  # unparsable now: no figure, not the last good one
    f.unlink()
    assert r.psi() is None  # the kept descriptor still reads the unlinked file's text: garbage, no figure
    r.close()
    assert procfs.ProcReader(tmp_path).psi() is None  # absent
