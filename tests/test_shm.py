"""Tests for sparkd.act.shm.

The key tests run against the REAL /dev/shm with real child processes, as root.
They only ever touch entries they created themselves (O_CREAT|O_EXCL, so an
existing entry is never clobbered), plan only over those entries, and remove
what is left in a finalizer — and only if it is still the inode they made.

Some test sandboxes hide a few processes even from root (e.g. a supervisor as
pid 1, whose /proc/1/maps is EACCES). sparkd refuses to remove anything while
any process is unreadable; the real-/dev/shm tests therefore pass those
pre-existing hidden pids as ``ignore_unreadable_pids`` (empty on a real host)
and assert that their own children are never among them.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sparkd.act import shm
from sparkd.act.shm import CleanupPlan, ShmEntry, ShmKind
from sparkd.sense import shm_scan
from tests.conftest import need

SHM = "/dev/shm"


# --------------------------------------------------------------------------- helpers


def _hidden_pids() -> set[int]:
    """PIDs whose maps root cannot read right now (sandbox supervisors)."""
    hidden = set()
    for n in os.listdir("/proc"):
        if not n.isdigit():
            continue
        try:
            with open(f"/proc/{n}/maps", "rb") as f:
                f.read(1)
            os.listdir(f"/proc/{n}/fd")
        except PermissionError:
            hidden.add(int(n))
        except OSError:
            pass
    return hidden


class Made:
    """Entries this test created in a shm dir; removed at teardown if still ours."""

    def __init__(self, shm_dir: str) -> None:
        self.shm_dir = shm_dir
        self.inodes: dict[str, tuple[int, int]] = {}

    def __call__(self, name: str, size: int = 4096) -> str:
        path = os.path.join(self.shm_dir, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            if size:
                os.pwrite(fd, b"x", 0)  # allocate a page, as a real segment would
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self.inodes[name] = (st.st_dev, st.st_ino)
        return path

    def ours(self, entries: list[ShmEntry]) -> list[ShmEntry]:
        return [e for e in entries if self.inodes.get(e.name) == (e.dev, e.ino)]

    def cleanup(self) -> None:
        for name, key in self.inodes.items():
            path = os.path.join(self.shm_dir, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) == key:
                os.unlink(path)


@pytest.fixture
def made() -> Iterator[Made]:
    need(os.geteuid() == 0, "reading every process's /proc/PID/maps needs root")
    need(os.path.isdir(SHM), "/dev/shm missing")
    m = Made(SHM)
    yield m
    m.cleanup()


@pytest.fixture
def made_tmp(tmp_path: Path) -> Iterator[Made]:
    d = tmp_path / "shm"
    d.mkdir()
    m = Made(str(d))
    yield m
    m.cleanup()


_OPEN = "import os,sys,time; fd=os.open(sys.argv[1], os.O_RDONLY); print('ready', flush=True); time.sleep(120)"
# CPython's mmap.mmap keeps a dup() of the fd, so map through libc to get a
# mapping with no open descriptor (as a process that mmaps then closes has).
_MMAP = (
    "import ctypes,os,sys,time; libc=ctypes.CDLL(None, use_errno=True); "
    "libc.mmap.restype=ctypes.c_void_p; libc.mmap.argtypes=[ctypes.c_void_p, ctypes.c_size_t, "
    "ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]; fd=os.open(sys.argv[1], os.O_RDWR); "
    "a=libc.mmap(None, 4096, 3, 1, fd, 0); assert a not in (None, 2**64-1), ctypes.get_errno(); "
    "os.close(fd); print('ready', flush=True); time.sleep(120)"
)


@pytest.fixture
def child() -> Iterator[Callable[[str, str], subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(code: str, path: str) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def _plan(made: Made, *, started_at: float | None, **kw: object) -> CleanupPlan:
    entries = made.ours(shm.scan(made.shm_dir))
    assert entries, "our entries vanished from the scan"
    return shm.plan_cleanup(
        entries,
        container_started_at=started_at,
        now=time.time(),
        ignore_unreadable_pids=_hidden_pids(),
        **kw,  # type: ignore[arg-type]
    )


def _kept(result_or_plan: object) -> dict[str, str]:
    return {k.name: k.reason for k in result_or_plan.kept}  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- classify


FIXTURE_NAMES = [
    ("psm_3f1c9a2e", ShmKind.PSM),
    ("psm_0b5d7e11", ShmKind.PSM),
    ("nccl-Ab3xYz", ShmKind.NCCL),
    ("nccl-k2Pq9L", ShmKind.NCCL),
    ("sem.loky-21844-k7_mz3q1", ShmKind.LOKY_SEM),
    ("VLLM_OBJECT_STORAGE_SHM_BUFFER_9d2c", ShmKind.VLLM_OBJECT_STORAGE),
    ("vllm_offload_3b2a6c1e-6f0d-4c3e-9a57-2f8d1e0b4c77.mmap", ShmKind.VLLM_OFFLOAD),
    ("psm_not-hex", ShmKind.OTHER),
    ("nccl-toolongname", ShmKind.OTHER),
    ("sem.mp-1234", ShmKind.OTHER),
    ("PostgreSQL.1804289383", ShmKind.OTHER),
    ("sparkd-test-psm_ab12", ShmKind.OTHER),
    ("vllm_offload_x.mmap", ShmKind.OTHER),
]


@pytest.mark.parametrize(("name", "kind"), FIXTURE_NAMES)
def test_it_classifies_names(name: str, kind: ShmKind) -> None:
    assert shm.classify(name) is kind


def test_it_classifies_every_fixture_kind_on_real_dev_shm(made: Made) -> None:
    tag = secrets.token_hex(6)
    names = {
        f"psm_{secrets.token_hex(8)}": ShmKind.PSM,
        f"nccl-{secrets.token_hex(3)}": ShmKind.NCCL,
        f"sem.loky-{os.getpid()}-sparkdtest{tag}": ShmKind.LOKY_SEM,
        f"VLLM_OBJECT_STORAGE_SHM_BUFFER_sparkdtest{tag}": ShmKind.VLLM_OBJECT_STORAGE,
        f"vllm_offload_{uuid.uuid4()}.mmap": ShmKind.VLLM_OFFLOAD,
        f"sparkd-test-{uuid.uuid4()}-other": ShmKind.OTHER,
    }
    for n in names:
        made(n, size=0 if n.startswith("nccl-") else 4096)
    got = {e.name: e for e in made.ours(shm.scan(SHM))}
    assert {n: e.kind for n, e in got.items()} == names
    nccl = next(e for e in got.values() if e.kind is ShmKind.NCCL)
    assert nccl.size_bytes == 0
    psm = next(e for e in got.values() if e.kind is ShmKind.PSM)
    assert psm.size_bytes == 4096 and psm.allocated_bytes >= 4096 and psm.file_type == "file"
    assert psm.path == f"{SHM}/{psm.name}" and not psm.users


# --------------------------------------------------------------------------- real /dev/shm


def test_it_removes_an_unused_vllm_entry_created_after_container_start(made: Made) -> None:
    started = time.time()
    name = f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{secrets.token_hex(8)}"  # a name only vLLM creates
    path = made(name, size=8192)
    plan = _plan(made, started_at=started)
    assert [e.name for e in plan.remove] == [name]
    result = shm.execute(plan)
    assert result.removed == [(name, 8192)] and not result.errors
    assert result.freed_bytes >= 4096
    assert not os.path.exists(path)


def test_it_keeps_an_entry_held_open_by_a_live_process(made: Made, child: Callable) -> None:
    started = time.time()
    name = f"sparkd-test-{uuid.uuid4()}-psm_ab12"
    path = made(name)
    proc = child(_OPEN, path)
    assert proc.pid not in _hidden_pids()
    (entry,) = made.ours(shm.scan(SHM))
    assert entry.open_by == (proc.pid,) and entry.mapped_by == ()
    plan = _plan(made, started_at=started)
    assert not plan.remove
    assert _kept(plan)[name].startswith(f"in use by pid {proc.pid} (python")
    assert "[open]" in _kept(plan)[name]
    assert os.path.exists(path)


def test_it_keeps_a_semaphore_mapped_but_not_open(made: Made, child: Callable) -> None:
    started = time.time()
    name = f"sem.loky-{os.getpid()}-sparkdtest{secrets.token_hex(6)}"
    path = made(name)
    proc = child(_MMAP, path)
    fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
    assert path not in fds, "child must only map, not hold an fd"
    (entry,) = made.ours(shm.scan(SHM))
    assert entry.kind is ShmKind.LOKY_SEM
    assert entry.mapped_by == (proc.pid,) and entry.open_by == ()
    plan = _plan(made, started_at=started)
    assert not plan.remove
    assert _kept(plan)[name] == f"in use by pid {proc.pid} ({entry.users[0].comm}) [mapped]"
    # Even a plan that wrongly lists it is refused at execute time.
    forced = replace(plan, remove=(replace(entry, users=()),), kept=())
    result = shm.execute(forced)
    assert not result.removed and os.path.exists(path)
    assert f"pid {proc.pid}" in _kept(result)[name]


def test_it_keeps_an_entry_older_than_the_container(made: Made) -> None:
    name = f"vllm_offload_{uuid.uuid4()}.mmap"
    path = made(name)
    started = time.time() + 60  # the container started after the entry was made
    plan = _plan(made, started_at=started)
    assert not plan.remove
    assert _kept(plan)[name].startswith("older than the container (created 20")
    assert shm.execute(plan).removed == [] and os.path.exists(path)


def test_it_keeps_an_entry_opened_between_plan_and_execute(made: Made, child: Callable) -> None:
    started = time.time()
    name = f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{secrets.token_hex(8)}"
    path = made(name)
    plan = _plan(made, started_at=started)
    assert [e.name for e in plan.remove] == [name]
    proc = child(_OPEN, path)  # TOCTOU: someone opens it after the scan
    result = shm.execute(plan)
    assert result.removed == []
    assert _kept(result)[name].startswith(f"in use by pid {proc.pid} (")
    assert _kept(result)[name].endswith("(since the scan)")
    assert os.path.exists(path)


def test_it_keeps_an_entry_replaced_between_plan_and_execute(made: Made) -> None:
    started = time.time()
    name = f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{secrets.token_hex(8)}"
    path = made(name)
    plan = _plan(made, started_at=started)
    os.unlink(path)
    made(name)  # same name, new inode
    result = shm.execute(plan)
    assert result.removed == [] and os.path.exists(path)
    assert _kept(result)[name] == "replaced by another file since the scan"


def _age(path: str, seconds: float) -> None:
    """Make an entry look ``seconds`` old (``changed_at`` is min(mtime, ctime))."""
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_it_removes_only_the_engines_own_names_when_age_is_unknown(made: Made) -> None:
    """The preflight (no container start, no witness) removed unheld psm_/nccl-/loky entries by name alone: a
    co-tenant's segment, closed and not unlinked while it waits for a consumer, went at every launch (helper-53).
    Only names vLLM alone creates go."""
    known = f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{secrets.token_hex(8)}"
    library = f"psm_{secrets.token_hex(8)}"
    other = f"sparkd-test-{uuid.uuid4()}-leftover"
    _age(made(known), 60)
    _age(made(library), 60)
    _age(made(other), 60)
    plan = _plan(made, started_at=None)
    assert not plan.remove
    assert _kept(plan)[known].startswith("age unknown")
    plan = _plan(made, started_at=None, allow_unknown_age=True)
    assert [e.name for e in plan.remove] == [known]
    assert _kept(plan)[library].startswith("not provably the engine's: psm_* (Python multiprocessing) names")
    assert _kept(plan)[other].startswith("not sparkd's to judge: name matches no known")
    assert shm.execute(plan, dry_run=True).removed == [(known, 4096)]
    assert os.path.exists(os.path.join(SHM, known))


def test_an_unheld_known_entry_changed_a_moment_ago_is_not_yet_a_leftover(made: Made) -> None:
    """The preflight removed any unheld vLLM/NCCL/loky-named entry, whoever made it: another job's runtime that
    had just made a segment and was about to map it lost it (notes 12, 13). One younger than LEFTOVER_MIN_AGE_S
    is kept, and named for the preflight to look at again."""
    young = made(f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{secrets.token_hex(3)}")
    plan = _plan(made, started_at=None, allow_unknown_age=True)
    assert not plan.remove
    reason = _kept(plan)[os.path.basename(young)]
    assert reason.startswith("changed ") and "too new to call a leftover" in reason, reason
    assert shm.young_leftovers(shm.execute(plan)) == [os.path.basename(young)]
    _age(young, shm.LEFTOVER_MIN_AGE_S + 1)
    assert [e.name for e in _plan(made, started_at=None, allow_unknown_age=True).remove] == [os.path.basename(young)]


def test_only_entries_kept_as_too_new_are_looked_at_again() -> None:
    result = shm.CleanupResult(
        kept=[
            shm.Kept("nccl-aaaaaa", shm.TOO_NEW.format(age=2.5), too_new=True),
            shm.Kept("nccl-dddddd", shm.TOO_NEW.format(age=2.5)),  # the words alone do not make it young
            shm.Kept("nccl-bbbbbb", "changed since the scan (mtime 1 -> 2)"),  # a race's reason, not an age
            shm.Kept("psm_cccc", "in use by pid 1 (python3)"),
        ]
    )
    assert shm.young_leftovers(result) == ["nccl-aaaaaa"]


def test_the_preflight_looks_again_at_new_entries_and_spares_one_mapped_meanwhile(
    made_tmp: Made, tmp_path: Path
) -> None:
    """Two new unheld segments of vLLM's at a launch: one is a crash's leftover (nobody comes back for it), the
    other another engine maps a second later. The preflight waits LEFTOVER_MIN_AGE_S and looks again: the first
    goes, the second stays (in use). An NCCL segment is kept whatever its age: any program makes those (helper-53)."""
    from sparkd.ops.preflight import run_preflight

    leftover = made_tmp(f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{secrets.token_hex(3)}")
    wanted = made_tmp(f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{secrets.token_hex(3)}")
    library = made_tmp(f"nccl-{secrets.token_hex(3)}")
    _age(library, 3600)
    code = "import os,sys,time; time.sleep(1); os.open(sys.argv[1], 0); print('ready', flush=True); time.sleep(99)"
    job = subprocess.Popen([sys.executable, "-c", code, wanted], stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        pf = run_preflight(
            gmu=None,
            margin_bytes=0,
            running_managed=[],
            shm_dir=made_tmp.shm_dir,
            ignore_unreadable_pids=sorted(_hidden_pids()),
        )
        took_s = time.monotonic() - t0
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        assert not os.path.exists(leftover) and os.path.exists(wanted), pf.notes
        assert any("looked at again after 10 s" in n for n in pf.notes), pf.notes
        assert any("removed 1 dead /dev/shm leftovers" in n for n in pf.notes), pf.notes
        assert any(os.path.basename(wanted) in n and "in use by" in n for n in pf.notes), pf.notes
        assert os.path.exists(library)
        assert any(f"{os.path.basename(library)}: not provably the engine's" in n for n in pf.notes), pf.notes
        assert took_s >= shm.LEFTOVER_MIN_AGE_S, took_s
    finally:
        job.kill()
        job.wait()


# --------------------------------------------------------------------------- private dir


def test_it_never_follows_symlinks_or_removes_directories(made_tmp: Made, tmp_path: Path) -> None:
    d = made_tmp.shm_dir
    outside = tmp_path / "precious"
    outside.write_text("keep me")
    os.symlink(outside, os.path.join(d, "VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa"))
    os.mkdir(os.path.join(d, "VLLM_OBJECT_STORAGE_SHM_BUFFER_bbbb"))
    made_tmp("VLLM_OBJECT_STORAGE_SHM_BUFFER_cccc")
    entries = shm.scan(d, proc_root=tmp_path / "noproc-empty")
    plan = shm.plan_cleanup(entries, container_started_at=0.0, now=time.time())
    kept = _kept(plan)
    assert kept["VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa"] == "not sparkd's to judge: a symlink, not a shared-memory file"
    assert kept["VLLM_OBJECT_STORAGE_SHM_BUFFER_bbbb"] == "not sparkd's to judge: a dir, not a shared-memory file"
    assert [e.name for e in plan.remove] == ["VLLM_OBJECT_STORAGE_SHM_BUFFER_cccc"]
    # VLLM_OBJECT_STORAGE_SHM_BUFFER_cccc becomes a symlink to the outside file after the scan
    os.unlink(os.path.join(d, "VLLM_OBJECT_STORAGE_SHM_BUFFER_cccc"))
    os.symlink(outside, os.path.join(d, "VLLM_OBJECT_STORAGE_SHM_BUFFER_cccc"))
    result = shm.execute(plan, proc_root=tmp_path / "noproc-empty")
    assert result.removed == [] and outside.read_text() == "keep me"
    assert _kept(result)["VLLM_OBJECT_STORAGE_SHM_BUFFER_cccc"] == "not sparkd's to judge: now a symlink"
    assert os.path.isdir(os.path.join(d, "VLLM_OBJECT_STORAGE_SHM_BUFFER_bbbb"))


@pytest.fixture(autouse=True)
def _empty_proc(tmp_path: Path) -> None:
    (tmp_path / "noproc-empty").mkdir()


def test_it_refuses_names_that_leave_the_directory(made_tmp: Made, tmp_path: Path) -> None:
    made_tmp("VLLM_OBJECT_STORAGE_SHM_BUFFER_dddd")
    (e,) = shm.scan(made_tmp.shm_dir, proc_root=tmp_path / "noproc-empty")
    victim = tmp_path / "victim"
    victim.write_text("x")
    bad = replace(e, name="../victim", path=os.path.join(made_tmp.shm_dir, "../victim"))
    plan = CleanupPlan(remove=(bad,), kept=(), container_started_at=0.0, now=0.0)
    result = shm.execute(plan, proc_root=tmp_path / "noproc-empty")
    assert result.removed == [] and victim.exists()
    assert result.errors and "refused" in result.errors[0][1]


def _fake_proc(root: Path, pid: int, maps: str = "", fds: dict[str, str] | None = None) -> Path:
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "maps").write_text(maps)
    (d / "comm").write_text(f"proc{pid}\n")
    for fd, target in (fds or {}).items():
        os.symlink(target, d / "fd" / fd)
    return d


def _maps_line(dev: int, ino: int, path: str) -> str:
    mm = f"{os.major(dev):02x}:{os.minor(dev):02x}"
    return f"7f0000000000-7f0000001000 rw-s 00000000 {mm} {ino}    {path}\n"


def test_it_reads_evidence_from_a_proc_tree(made_tmp: Made, tmp_path: Path) -> None:
    d = made_tmp.shm_dir
    a = made_tmp("VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa")
    b = made_tmp("VLLM_OBJECT_STORAGE_SHM_BUFFER_bbbb")
    c = made_tmp("VLLM_OBJECT_STORAGE_SHM_BUFFER_cccc")
    st_a, st_c = os.stat(a), os.stat(c)
    proc = tmp_path / "proc"
    # 100 maps a by inode (path as seen in another mount namespace)
    _fake_proc(proc, 100, maps=_maps_line(st_a.st_dev, st_a.st_ino, "/dev/shm/VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa"))
    # 101 holds b open
    _fake_proc(proc, 101, fds={"3": b, "4": "socket:[123]", "5": "/nonexistent/x"})
    # 102 maps an older, deleted file that had c's path: a different inode, not c
    _fake_proc(proc, 102, maps=_maps_line(st_c.st_dev, st_c.st_ino + 10_000, c + " (deleted)"))
    # 103 vanished between listdir and open (no maps, no fd dir)
    (proc / "103").mkdir()
    (proc / "self").mkdir()
    got = {e.name: e for e in shm.scan(d, proc_root=proc)}
    ga, gb, gc = (got[f"VLLM_OBJECT_STORAGE_SHM_BUFFER_{x}"] for x in ("aaaa", "bbbb", "cccc"))
    assert ga.mapped_by == (100,) and ga.users[0].comm == "proc100"
    assert gb.open_by == (101,) and gb.mapped_by == ()
    assert gc.users == () and gc.unreadable_pids == ()
    plan = shm.plan_cleanup(got.values(), container_started_at=0.0, now=time.time())
    assert [e.name for e in plan.remove] == ["VLLM_OBJECT_STORAGE_SHM_BUFFER_cccc"]
    assert _kept(plan)["VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa"] == "in use by pid 100 (proc100) [mapped]"


def test_it_removes_nothing_while_a_process_is_unreadable(
    made_tmp: Made, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made_tmp("VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa")
    proc = tmp_path / "proc"
    _fake_proc(proc, 100)
    _fake_proc(proc, 200)
    real = shm_scan._scan_maps

    def denied(pid_dir: str, *a: object) -> None:
        if pid_dir.endswith("/200"):
            raise PermissionError(13, "Permission denied")
        real(pid_dir, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(shm_scan, "_scan_maps", denied)  # the reading side (sense)
    (e,) = shm.scan(made_tmp.shm_dir, proc_root=proc)
    assert e.unreadable_pids == (200,)
    plan = shm.plan_cleanup([e], container_started_at=0.0, now=time.time())
    assert _kept(plan)["VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa"] == "cannot prove unused: /proc of pid 200 was unreadable"
    # forced through, execute's re-check still refuses
    forced = replace(plan, remove=(e,), kept=())
    assert _kept(shm.execute(forced, proc_root=proc))["VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa"].startswith("cannot prove")
    # explicitly ignored: removed
    plan = shm.plan_cleanup([e], container_started_at=0.0, now=time.time(), ignore_unreadable_pids={200})
    assert shm.execute(plan, proc_root=proc).removed == [("VLLM_OBJECT_STORAGE_SHM_BUFFER_aaaa", 4096)]


def _entry(name: str, changed_at: float, **kw: object) -> ShmEntry:
    base = ShmEntry(
        name=name, path=f"/dev/shm/{name}", size_bytes=10, allocated_bytes=4096,
        mtime=changed_at, ctime=changed_at, kind=shm.classify(name), file_type="file",
        dev=1, ino=2,
    )  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changed_at", "removed"),
    [(1000.0, True), (998.0, True), (997.9, False), (500.0, False)],
)
def test_it_applies_the_clock_slack(changed_at: float, removed: bool) -> None:
    e = _entry("VLLM_OBJECT_STORAGE_SHM_BUFFER_ab", changed_at)
    plan = shm.plan_cleanup([e], container_started_at=1000.0, now=2000.0)
    assert bool(plan.remove) is removed


def test_it_uses_the_earlier_of_mtime_and_ctime() -> None:
    e = _entry("psm_ab", 1500.0, mtime=100.0)  # touched back to an old mtime
    plan = shm.plan_cleanup([e], container_started_at=1000.0, now=2000.0)
    assert _kept(plan)["psm_ab"] == "older than the container (created 1970-01-01T00:01:40Z, 1900 s ago)"


def test_it_names_several_users_in_the_reason() -> None:
    users = tuple(shm.ShmUser(p, "python3", mapped=True, open_fd=p == 11) for p in (10, 11, 12, 13, 14))
    e = _entry("psm_ab", 1500.0, users=users)
    plan = shm.plan_cleanup([e], container_started_at=1000.0, now=2000.0)
    assert _kept(plan)["psm_ab"] == (
        "in use by pid 10 (python3) [mapped], pid 11 (python3) [mapped, open], pid 12 (python3) [mapped] and 2 more"
    )


def test_it_formats_a_result() -> None:
    r = shm.CleanupResult(
        removed=[("psm_ab", 2 * 1024**3)],
        kept=[shm.Kept("nccl-Ab3xYz", "in use by pid 7 (python3) [open]")],
        errors=[("psm_cd", "unlink failed: Permission denied")],
        freed_bytes=2 * 1024**3,
    )
    assert shm.format_result(r) == (
        "/dev/shm cleanup: removed 1 (2.00 GiB), kept 1, errors 1\n"
        "removed:\n  psm_ab (2.00 GiB)\n"
        "kept:\n  nccl-Ab3xYz: in use by pid 7 (python3) [open]\n"
        "errors:\n  psm_cd: unlink failed: Permission denied"
    )
    many = shm.CleanupResult(dry_run=True, removed=[(f"psm_{i}", 0) for i in range(25)])
    text = shm.format_result(many)
    assert text.startswith("/dev/shm cleanup (dry run): would remove 25 (0 B)")
    assert text.endswith("… and 5 more")
