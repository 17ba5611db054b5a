"""/dev/shm cleanup by the container's own evidence (issue 12, kind 9).

A temporary directory stands in for /dev/shm; real processes (a "container": a root process and its
children) hold entries open or mapped; the real /proc is read. Field case: an unrelated stale ``nccl-*``
entry created by someone else after the container started must be kept, with the reason recorded."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkd.act import shm
from sparkd.ops import doctor
from tests.conftest import need
from tests.test_shm import _hidden_pids

# A "container": the root process starts a child that opens argv[1] and maps argv[2] (no fd kept), says
# ready, and both sleep until killed (the test kills the tree by pid).
_CONTAINER = r"""
import ctypes, os, subprocess, sys, time
if sys.argv[1] == "child":
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    held = os.open(sys.argv[2], os.O_RDONLY)
    fd = os.open(sys.argv[3], os.O_RDWR)
    assert libc.mmap(None, 4096, 3, 1, fd, 0) not in (None, 2**64 - 1)
    os.close(fd)
    print("ready", flush=True)
    time.sleep(300)
else:
    subprocess.Popen([sys.executable, __file__, "child", *sys.argv[1:]]).wait()
"""


def _start_container(tmp_path: Path, opened: str, mapped: str) -> subprocess.Popen[str]:
    """Root process + a child that holds ``opened`` open and maps ``mapped``; returns the root."""
    script = tmp_path / "container.py"
    script.write_text(_CONTAINER)
    p = subprocess.Popen([sys.executable, str(script), opened, mapped], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _kill_tree(p: subprocess.Popen[str]) -> None:
    for pid in sorted(shm.process_tree(p.pid), reverse=True):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    p.wait(timeout=10)
    deadline = time.monotonic() + 10
    while shm.process_tree(p.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _make(d: Path, name: str, size: int = 4096) -> str:
    path = d / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    os.pwrite(fd, b"x", 0)
    os.close(fd)
    return str(path)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "shm"
    d.mkdir()
    yield d


def _kept(r: object) -> dict[str, str]:
    return {k.name: k.reason for k in r.kept}  # type: ignore[attr-defined]


def test_process_tree_is_the_root_and_its_descendants(tmp_path: Path, shm_dir: Path) -> None:
    a, b = _make(shm_dir, "psm_aa"), _make(shm_dir, "psm_bb")
    p = _start_container(tmp_path, a, b)
    try:
        tree = shm.process_tree(p.pid)
        assert p.pid in tree and len(tree) == 2
        assert os.getpid() not in tree  # the parent of the root is not the container's
    finally:
        _kill_tree(p)
    assert shm.process_tree(p.pid) == set()


def test_the_field_case_keeps_an_unrelated_nccl_entry_and_removes_the_containers_own(
    tmp_path: Path, shm_dir: Path
) -> None:
    stale = _make(shm_dir, "nccl-Old000")  # left before the container started: not its
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    started_at = time.time()
    opened = _make(shm_dir, "psm_0a1b2c3d")  # the container holds it open
    mapped = _make(shm_dir, "nccl-Ab3xYz")  # the container maps it (no fd)
    engine_own = _make(shm_dir, "VLLM_OBJECT_STORAGE_SHM_BUFFER_9d2c")  # vLLM's name, never held when observed
    container = _start_container(tmp_path, opened, mapped)
    witness = shm.ShmWitness("c0ffee" * 10 + "abcd", shm_dir=str(shm_dir))
    try:
        assert witness.observe(container.pid) == 2
        # someone else, not the container, makes an NCCL entry while the container runs
        unrelated = _make(shm_dir, "nccl-Zz9Yy8")
        assert witness.observe(container.pid) == 0  # observing again adds nothing
    finally:
        _kill_tree(container)
    stopped_at = time.time()
    time.sleep(shm.DEFAULT_CLOCK_SLACK_S + 0.2)  # beyond the clock slack: tmpfs ctime cannot be set
    after = _make(shm_dir, "vllm_offload_3b2a6c1e-6f0d-4c3e-9a57-2f8d1e0b4c77.mmap")  # vLLM's name, after the stop
    result = shm.cleanup(
        container_started_at=started_at,
        container_stopped_at=stopped_at,
        shm_dir=shm_dir,
        witness=witness,
        ignore_unreadable_pids=_hidden_pids(),
    )
    assert sorted(n for n, _ in result.removed) == sorted(
        ["psm_0a1b2c3d", "nccl-Ab3xYz", "VLLM_OBJECT_STORAGE_SHM_BUFFER_9d2c"]
    ), result
    assert not os.path.exists(opened) and not os.path.exists(mapped) and not os.path.exists(engine_own)
    kept = _kept(result)
    assert os.path.exists(unrelated)
    assert kept["nccl-Zz9Yy8"] == (
        "not tied to the container: none of the container's processes was seen using it, "
        "and nccl-* (NCCL) names are not the engine's own"
    )
    assert kept["nccl-Old000"].startswith("older than the container")
    assert kept[os.path.basename(after)].startswith("created after the container stopped")
    assert os.path.exists(stale) and os.path.exists(after)
    assert "nccl-Zz9Yy8: not tied to the container" in shm.format_result(result)


def test_a_held_entry_seen_by_the_witness_is_still_kept(tmp_path: Path, shm_dir: Path) -> None:
    started_at = time.time()
    a, b = _make(shm_dir, "psm_11aa"), _make(shm_dir, "psm_22bb")
    container = _start_container(tmp_path, a, b)
    witness = shm.ShmWitness("x" * 64, shm_dir=str(shm_dir))
    try:
        assert witness.observe(container.pid) == 2
        result = shm.cleanup(
            container_started_at=started_at, shm_dir=shm_dir, witness=witness, ignore_unreadable_pids=_hidden_pids()
        )
        assert result.removed == []
        assert _kept(result)["psm_11aa"].startswith("in use by pid ")
    finally:
        _kill_tree(container)


def test_a_reused_inode_under_another_name_is_not_the_witnessed_entry(tmp_path: Path, shm_dir: Path) -> None:
    started_at = time.time()
    a, b = _make(shm_dir, "psm_33cc"), _make(shm_dir, "psm_44dd")
    ino_a = os.stat(a).st_ino
    container = _start_container(tmp_path, a, b)
    witness = shm.ShmWitness("y" * 64, shm_dir=str(shm_dir))
    try:
        assert witness.observe(container.pid) == 2
    finally:
        _kill_tree(container)
    os.unlink(a)  # the container's own cleanup removed it; tmpfs hands its inode number to the next file
    other = _make(shm_dir, "psm_99zz")  # someone else's
    reused = os.stat(other).st_ino == ino_a
    result = shm.cleanup(
        container_started_at=started_at, shm_dir=shm_dir, witness=witness, ignore_unreadable_pids=_hidden_pids()
    )
    assert [n for n, _ in result.removed] == ["psm_44dd"]
    assert _kept(result)["psm_99zz"].startswith("not tied to the container"), reused


def test_without_observations_only_the_engines_own_names_go(shm_dir: Path) -> None:
    started_at = time.time()
    _make(shm_dir, "psm_55ee")
    _make(shm_dir, "sem.loky-1-abc")
    _make(shm_dir, "vllm_offload_3b2a6c1e-6f0d-4c3e-9a57-2f8d1e0b4c78.mmap")
    witness = shm.ShmWitness("z" * 64, shm_dir=str(shm_dir))
    assert witness.observe(2**22 + 12345) == 0 and witness.observations == 0  # no such process
    result = shm.cleanup(
        container_started_at=started_at, shm_dir=shm_dir, witness=witness, ignore_unreadable_pids=_hidden_pids()
    )
    assert [n for n, _ in result.removed] == ["vllm_offload_3b2a6c1e-6f0d-4c3e-9a57-2f8d1e0b4c78.mmap"]
    kept = _kept(result)
    assert kept["psm_55ee"] == (
        "not tied to the container: the container's processes could not be observed, "
        "and psm_* (Python multiprocessing) names are not the engine's own"
    )
    assert "sem.loky-* (loky/joblib)" in kept["sem.loky-1-abc"]


# ---------------------------------------------------------------- doctor: PIDs whose /proc cannot be read


def _fake_pid(root: Path, pid: int, comm: str, readable: bool) -> None:
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    if readable:
        (d / "maps").write_text("")
    else:
        (d / "maps").mkdir()  # reading it fails (EISDIR), as EACCES does in a sandbox


def test_doctor_names_the_pids_whose_proc_cannot_be_read(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _fake_pid(proc, 1, "sandbox-init", readable=False)
    _fake_pid(proc, 42, "python3", readable=True)
    (c,) = doctor.check_proc_visibility(doctor.DoctorContext(proc_root=proc))
    assert c.status == "WARN"
    assert "pid 1 (sandbox-init)" in c.detail and "42" not in c.detail
    assert "cannot prove unused" in c.detail
    assert "shm_ignore_unreadable_pids" in c.action
    ok = doctor.check_proc_visibility(doctor.DoctorContext(proc_root=proc, shm_ignore_unreadable_pids=(1,)))
    assert ok[0].status == "OK" and "pid 1 (sandbox-init)" in ok[0].detail and "ignored" in ok[0].detail


def test_doctor_on_the_real_proc_matches_what_the_cleanup_sees() -> None:
    need(os.geteuid() == 0, "reading every process's /proc/PID/maps needs root")
    hidden = _hidden_pids()
    (c,) = doctor.check_proc_visibility(doctor.DoctorContext())
    if hidden:
        assert c.status == "WARN"
        for pid in sorted(hidden)[:5]:
            assert f"pid {pid} (" in c.detail
    else:
        assert c.status == "OK"
    assert {p for p, _c, _w in shm.unreadable_pids("/proc")} >= hidden


# ---------------------------------------------------------------- the supervisor's witness on a real container

pytest_plugins = ["dockerkit"]


@pytest.mark.docker
def test_the_supervisor_witnesses_what_a_real_container_uses(tmp_path: Path, launcher: Any, mgr: Any) -> None:
    from sparkd.config import Settings
    from sparkd.loop.supervisor import Supervisor

    fv = launcher(env={"FAKEVLLM_SHM_CLEANUP": "1"})  # it removes its entries on a graceful exit
    assert fv.wait_healthy()
    names = fv.post("/shm?n=5&kib=64")["names"]  # --ipc host: in the host's /dev/shm, held open by the server
    try:
        settings = Settings(state_dir=str(tmp_path), container={"image": "sparkd-test-vllm:latest"})
        sup = Supervisor(settings, manager=mgr)
        sup.container_id = fv.id
        asyncio.run(sup._observe_shm(mgr.state(fv.id).pid))
        w = sup.shm_witness
        assert w is not None and w.container_id == fv.id and w.observations == 1
        assert {name for _d, _i, name in w.seen} >= set(names)
    finally:
        assert mgr.stop(fv.id, timeout_s=10).outcome == "exited"
    assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]
