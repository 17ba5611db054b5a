"""Tests for sparkd.act.archive: postmortem bundles."""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path

import pytest

from sparkd.act import archive
from sparkd.act.archive import list_archives, prune_archives, safe_archive_path, write_archive
from sparkd.errors import InvalidInput, NotFound

NOW = 1_795_000_000.0  # 2026-11-18T11:06:40Z


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        out = {}
        for m in tar.getmembers():
            f = tar.extractfile(m)
            assert f is not None
            out[m.name] = f.read()
        return out


def _names_in_order(path: Path) -> list[str]:
    with tarfile.open(path, "r:gz") as tar:
        return tar.getnames()


def test_it_bundles_every_part_with_the_summary_first(tmp_path: Path) -> None:
    log = tmp_path / "container.log"
    log.write_bytes(b"INFO loading weights\nERROR NV_ERR_NO_MEMORY\n")
    parts: dict[str, bytes | str | Path] = {
        "container.log": log,
        "sparkd.log": "guard: low available 5/5\n",
        "samples.csv": archive.samples_to_csv([{"t": 1.0, "mem_available_bytes": 5}]),
        "kernel.log": b"NVRM: NV_ERR_NO_MEMORY\n",
        "inspect.json": '{"State": {"StartedAt": "2026-11-18T09:00:00Z"}}',
        "config.json": "{}",
        "plan.json": '{"gmu": 0.786}',
    }
    info = write_archive(tmp_path / "arch", "Low MemAvailable (5/5)!", parts, "stop: low", now=NOW)
    assert info.name == "sparkd-20261118T110640Z-low-memavailable-5-5.tar.gz"
    assert info.path == (tmp_path / "arch" / info.name).resolve()
    assert info.size_bytes == info.path.stat().st_size > 0
    assert stat.S_IMODE(info.path.stat().st_mode) == 0o640
    assert _names_in_order(info.path) == ["summary.txt", *parts]
    got = _members(info.path)
    assert got["summary.txt"] == b"stop: low\n"
    assert got["container.log"] == log.read_bytes()
    assert got["sparkd.log"] == b"guard: low available 5/5\n"
    assert got["kernel.log"] == b"NVRM: NV_ERR_NO_MEMORY\n"
    assert got["samples.csv"] == b"t,mem_available_bytes\n1.0,5\n"
    assert os.listdir(tmp_path / "arch") == [info.name]  # no temp file left


def test_it_records_a_missing_part_instead_of_crashing(tmp_path: Path) -> None:
    gone = tmp_path / "nope.log"
    info = write_archive(tmp_path, "x", {"container.log": gone, "sparkd.log": "ok"}, "s", now=NOW)
    got = _members(info.path)
    assert "container.log" not in got
    assert got["container.log.missing"].startswith(f"could not read {gone}: No such file".encode())
    assert b"container.log: missing" in got["summary.txt"]
    assert got["sparkd.log"] == b"ok"


def test_it_keeps_only_the_tail_of_a_large_part(tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    log.write_bytes(b"a" * 1000 + b"THE END\n")
    info = write_archive(tmp_path, "x", {"container.log": log}, "s", now=NOW, max_part_bytes=8)
    got = _members(info.path)
    assert got["container.log"] == b"THE END\n"
    assert b"container.log: only the last 8 of 1008 bytes" in got["summary.txt"]


def test_it_does_not_hang_on_a_fifo_part(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    info = write_archive(tmp_path / "a", "x", {"container.log": fifo}, "s", now=NOW)
    assert b"not a regular file" in _members(info.path)["container.log.missing"]


def test_it_names_archives_uniquely_within_one_second(tmp_path: Path) -> None:
    names = [write_archive(tmp_path, "stop", {}, f"s{i}", now=NOW).name for i in range(3)]
    assert names == [
        "sparkd-20261118T110640Z-stop.tar.gz",
        "sparkd-20261118T110640Z-stop-2.tar.gz",
        "sparkd-20261118T110640Z-stop-3.tar.gz",
    ]
    assert [_members(tmp_path / n)["summary.txt"] for n in names] == [b"s0\n", b"s1\n", b"s2\n"]


@pytest.mark.parametrize("hint", ["", "///", "Ünïcode only"])
def test_it_slugs_odd_hints(hint: str, tmp_path: Path) -> None:
    name = write_archive(tmp_path, hint, {}, "s", now=NOW).name
    assert name.startswith("sparkd-20261118T110640Z-") and archive._NAME_RE.match(name)


def test_it_leaves_nothing_when_writing_fails_midway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = archive._tarinfo

    def fail_on_third(name: str, size: int, mtime: float) -> tarfile.TarInfo:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(name, size, mtime)

    monkeypatch.setattr(archive, "_tarinfo", fail_on_third)
    with pytest.raises(OSError, match="No space left"):
        write_archive(tmp_path, "x", {"a.log": "a" * 100_000, "b.log": "b"}, "s", now=NOW)
    assert os.listdir(tmp_path) == []


def test_it_leaves_nothing_when_fsync_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(archive.os, "fsync", no_space)
    with pytest.raises(OSError):
        write_archive(tmp_path, "x", {"a.log": "a"}, "s", now=NOW)
    assert os.listdir(tmp_path) == []


def test_it_never_shows_a_partial_file_under_the_final_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    real = archive._write_members

    def spy(*a: object, **kw: object) -> None:
        real(*a, **kw)  # type: ignore[arg-type]
        seen.append(sorted(os.listdir(tmp_path)))

    monkeypatch.setattr(archive, "_write_members", spy)
    info = write_archive(tmp_path, "x", {"a.log": "a"}, "s", now=NOW)
    (during,) = seen
    assert len(during) == 1 and during[0].startswith(".sparkd-tmp-") and during[0].endswith(".tmp")
    assert list_archives(tmp_path) != [] and os.listdir(tmp_path) == [info.name]


@pytest.mark.parametrize("bad", ["summary.txt", "../x", "a/b", "", ".hidden", 3])
def test_it_refuses_bad_part_names_and_values(bad: object, tmp_path: Path) -> None:
    parts = {"x.log": bad} if isinstance(bad, int) else {bad: "content"}
    with pytest.raises(InvalidInput):
        write_archive(tmp_path, "x", parts, "s", now=NOW)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_it_lists_newest_first_and_ignores_foreign_files(tmp_path: Path) -> None:
    a = write_archive(tmp_path, "a", {}, "s", now=NOW)
    b = write_archive(tmp_path, "b", {}, "s", now=NOW + 60)
    os.utime(a.path, (NOW, NOW))
    os.utime(b.path, (NOW + 60, NOW + 60))
    (tmp_path / ".sparkd-tmp-abc.tmp").write_bytes(b"partial")
    (tmp_path / "notes.tar.gz").write_bytes(b"operator's own file")
    (tmp_path / "sparkd-20261118T110640Z-dir.tar.gz").mkdir()
    os.symlink(a.path, tmp_path / "sparkd-20261118T110640Z-link.tar.gz")
    got = list_archives(tmp_path)
    assert [x.name for x in got] == [b.name, a.name]
    assert got[0].created == NOW + 60 and got[0].size_bytes == b.size_bytes
    assert list_archives(tmp_path / "missing") == []


# --------------------------------------------------------------------------- download names


@pytest.fixture
def arch(tmp_path: Path) -> Path:
    d = tmp_path / "arch"
    write_archive(d, "ok", {}, "s", now=NOW)
    outside = tmp_path / "secret.tar.gz"
    outside.write_bytes(b"not yours")
    os.symlink(outside, d / "sparkd-20261118T110640Z-escape.tar.gz")
    os.symlink("../secret.tar.gz", d / "rel.tar.gz")
    (d / "notes.txt").write_text("x")
    (d / "sub.tar.gz").mkdir()
    return d


def test_it_resolves_a_real_archive(arch: Path) -> None:
    name = "sparkd-20261118T110640Z-ok.tar.gz"
    assert safe_archive_path(arch, name) == arch.resolve() / name
    with archive.open_archive(arch, name) as f:
        assert f.read(2) == b"\x1f\x8b"  # gzip magic


@pytest.mark.parametrize(
    "name",
    [
        "../secret.tar.gz",
        "..%2Fsecret.tar.gz",
        "./../secret.tar.gz",
        "sub/../../secret.tar.gz",
        "/etc/passwd",
        "/tmp/x.tar.gz",
        "sparkd-20261118T110640Z-escape.tar.gz",  # symlink pointing out
        "rel.tar.gz",  # relative symlink pointing out
        "notes.txt",
        "sparkd-20261118T110640Z-ok.tar",
        "sparkd-20261118T110640Z-ok.tar.gz/",
        "sparkd-20261118T110640Z-ok.tar.gz\x00.txt",
        "sub.tar.gz",  # a directory
        ".tar.gz",
        "..tar.gz",
        "missing.tar.gz",
        "",
        "\\..\\secret.tar.gz",
    ],
)
def test_it_refuses_names_that_escape(arch: Path, name: str) -> None:
    with pytest.raises(NotFound):
        safe_archive_path(arch, name)
    with pytest.raises(NotFound):
        archive.open_archive(arch, name)


# --------------------------------------------------------------------------- prune


def _make(d: Path, n: int, size: int = 0) -> list[str]:
    names = []
    for i in range(n):
        info = write_archive(d, f"a{i}", {"blob.bin": os.urandom(size)}, "s", now=NOW + i)
        os.utime(info.path, (NOW + i, NOW + i))
        names.append(info.name)
    return names  # oldest first


def test_it_prunes_by_count_oldest_first(tmp_path: Path) -> None:
    names = _make(tmp_path, 5)
    removed = prune_archives(tmp_path, max_count=2, max_total_bytes=10**9)
    assert removed == names[:3]
    assert [a.name for a in list_archives(tmp_path)] == names[:2:-1]


def test_it_prunes_by_size(tmp_path: Path) -> None:
    names = _make(tmp_path, 4, size=10_000)  # random bytes: gzip cannot shrink them
    sizes = {a.name: a.size_bytes for a in list_archives(tmp_path)}
    limit = sizes[names[3]] + sizes[names[2]]
    assert prune_archives(tmp_path, max_count=100, max_total_bytes=limit) == names[:2]
    assert sum(a.size_bytes for a in list_archives(tmp_path)) <= limit


def test_it_never_prunes_the_newest(tmp_path: Path) -> None:
    names = _make(tmp_path, 3, size=10_000)
    assert prune_archives(tmp_path, max_count=1, max_total_bytes=0) == names[:2]
    assert [a.name for a in list_archives(tmp_path)] == [names[2]]
    assert prune_archives(tmp_path, max_count=1, max_total_bytes=0) == []


def test_the_archive_just_written_is_the_newest_after_the_wall_clock_stepped_back(tmp_path: Path) -> None:
    """Archives are ordered by mtime: after the wall clock stepped back a day, the postmortem written next was the
    "oldest" and pruned first (helper-43). Those this process wrote are newest, in the order written; the others (a
    previous run's) by mtime."""
    before = _make(tmp_path, 2)  # a previous run's (mtime NOW, NOW + 1), forgotten by this process
    for name in before:
        archive._written.pop(str(tmp_path.resolve() / name))
    ahead = write_archive(tmp_path, "ahead", {"x.txt": "1"}, "s", now=NOW + 86400)  # the clock a day ahead
    os.utime(ahead.path, (NOW + 86400, NOW + 86400))
    stepped = write_archive(tmp_path, "stepped", {"x.txt": "2"}, "s", now=NOW - 3600)  # then stepped back
    os.utime(stepped.path, (NOW - 3600, NOW - 3600))
    assert [a.name for a in list_archives(tmp_path)] == [stepped.name, ahead.name, before[1], before[0]]
    assert prune_archives(tmp_path, max_count=2, max_total_bytes=10**9) == before
    assert prune_archives(tmp_path, max_count=1, max_total_bytes=10**9) == [ahead.name]  # not the one just written


def test_it_leaves_foreign_files_alone_when_pruning(tmp_path: Path) -> None:
    _make(tmp_path, 2)
    (tmp_path / "operator.tar.gz").write_bytes(b"x" * 100)
    prune_archives(tmp_path, max_count=1, max_total_bytes=0)
    assert (tmp_path / "operator.tar.gz").exists()


# the first lines of a summary as every release writes them (0.1's ``stopproc._summary`` too): who asked is
# what tells an incident's postmortem from a routine stop's
SUMMARY_01 = (
    "sparkd postmortem\n=================\ntime (UTC):   2026-11-29 11:00:00\n"
    "reason:       {reason}\nrequested by: {source}\n"
)


def _make_by(d: Path, sources: list[str]) -> list[str]:
    """One bundle per source, oldest first, each with a 0.1-style summary naming who asked for the stop."""
    names = []
    for i, source in enumerate(sources):
        summary = SUMMARY_01.format(reason=f"stop {i}", source=source)
        info = write_archive(d, f"vllm-{source}", {"container.log": b"x"}, summary, now=NOW + i)
        os.utime(info.path, (NOW + i, NOW + i))
        names.append(info.name)
    return names


def test_it_reads_who_asked_for_the_stop_from_the_summary(tmp_path: Path) -> None:
    rule, token = _make_by(tmp_path, ["rule low-available", "api:token"])
    assert archive.requested_by(tmp_path / rule) == "rule low-available"
    assert archive.requested_by(tmp_path / token) == "api:token"
    kinds = {a.name: archive.is_incident_archive(a) for a in list_archives(tmp_path)}
    assert kinds == {rule: True, token: False}


def test_a_bundle_whose_kind_cannot_be_told_counts_as_an_incident(tmp_path: Path) -> None:
    (torn,) = _make(tmp_path, 1)
    (tmp_path / torn).write_bytes(b"\x1f\x8b not a whole gzip stream")
    no_line = write_archive(tmp_path, "no-line", {}, "sparkd postmortem\nreason: x\n", now=NOW + 5).name
    assert archive.requested_by(tmp_path / torn) is None and archive.requested_by(tmp_path / no_line) is None
    assert all(archive.is_incident_archive(a) for a in list_archives(tmp_path))


def test_routine_archives_are_pruned_before_any_incidents_postmortem(tmp_path: Path) -> None:
    """A tuning session of resizes and restarts after a trip: the trips' postmortems stay, the oldest routine
    ones go first, even when newer than the trips'; the newest is kept whatever it is."""
    sources = [
        "rule low-available",  # 0: a trip last week
        "api:token",  # 1: a resize
        "peer:spark-b",  # 2: the other node tripped
        "web:session",  # 3: a restart
        "sparkd (failed launch)",  # 4
        "cli",  # 5: an operator's stop
        "daemon",  # 6: sparkd's own exit
        "api:token",  # 7: newest, routine
    ]
    names = _make_by(tmp_path, sources)
    assert prune_archives(tmp_path, max_count=5, max_total_bytes=10**9) == [names[1], names[3], names[5]]
    assert prune_archives(tmp_path, max_count=3, max_total_bytes=10**9) == [names[6], names[0]]
    assert [a.name for a in list_archives(tmp_path)] == [names[7], names[4], names[2]]


def test_a_large_incident_that_must_go_for_the_size_cap_does_not_take_the_routine_ones_with_it(tmp_path: Path) -> None:
    """One 3 MB trip postmortem over a 2 MB cap with five small routine bundles: only the trip's can bring the
    total under the cap, so it goes and the routine ones stay (review helper-30: all six went)."""
    names = []
    for i, source in enumerate(["rule low-available", "api:token", "cli", "web:session", "api:token", "cli", "cli"]):
        summary = SUMMARY_01.format(reason=f"stop {i}", source=source)
        blob = os.urandom(3_000_000 if i == 0 else 10_000)  # random: gzip cannot shrink it
        info = write_archive(tmp_path, f"vllm-{i}", {"container.log": blob}, summary, now=NOW + i)
        os.utime(info.path, (NOW + i, NOW + i))
        names.append(info.name)
    assert prune_archives(tmp_path, max_count=50, max_total_bytes=2_000_000) == [names[0]]
    assert sorted(a.name for a in list_archives(tmp_path)) == sorted(names[1:])


def test_incidents_go_oldest_first_once_no_routine_archive_is_left(tmp_path: Path) -> None:
    names = _make_by(tmp_path, ["rule a", "hard floor", "probe", "api:token"])
    assert prune_archives(tmp_path, max_count=1, max_total_bytes=10**9) == names[:3]
    assert [a.name for a in list_archives(tmp_path)] == [names[3]]


@pytest.mark.parametrize(("count", "size"), [(0, 10), (-1, 10), (1, -1)])
def test_it_refuses_bad_prune_limits(tmp_path: Path, count: int, size: int) -> None:
    with pytest.raises(InvalidInput):
        prune_archives(tmp_path, max_count=count, max_total_bytes=size)


# --------------------------------------------------------------------------- csv


def test_it_writes_samples_as_csv() -> None:
    rows: list[dict[str, object]] = [
        {"t": 1.5, "mem_available_bytes": 100, "mem_free_bytes": None},
        {"t": 2.5, "mem_free_bytes": 7, "psi_some_avg10": 0.25},
    ]
    assert archive.samples_to_csv(rows) == (
        "t,mem_available_bytes,mem_free_bytes,psi_some_avg10\n1.5,100,,\n2.5,,7,0.25\n"
    )
    assert archive.samples_to_csv([]) == ""
    assert archive.samples_to_csv([{"note": 'a "quoted", text'}]) == 'note\n"a ""quoted"", text"\n'
