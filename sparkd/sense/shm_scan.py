"""Read the evidence about POSIX shared memory in the host's /dev/shm (never writes).

* ``scan()`` lists the directory and which live processes map (``/proc/PID/maps``)
  or hold open (``/proc/PID/fd/*``) each entry, by device and inode;
* ``ShmWitness`` records which entries the serving container's own processes (its
  PID 1 and every descendant) use while it runs;
* ``classify()`` names the runtime that creates an entry (vLLM, NCCL, loky, ...).

What may be removed, and the removal itself, are ``sparkd.act.shm`` (the rules and
their sources are in its docstring).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

log = logging.getLogger(__name__)
DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_PROC_ROOT = "/proc"

# tmpfs stamps files with the kernel's coarse clock (up to one tick, ~4 ms,
# behind), and Docker's State.StartedAt is recorded by dockerd slightly after
# the runtime started the process. Two seconds covers both with room to spare;
# a leftover from a *previous* run is minutes older, so the slack costs nothing.
DEFAULT_CLOCK_SLACK_S = 2.0

# errno values that mean "this process is gone" — skip it.
_GONE = (errno.ENOENT, errno.ESRCH)
# errno values that mean "we cannot see what this process uses".
_HIDDEN = (errno.EACCES, errno.EPERM)


class ShmKind(StrEnum):
    """What created an entry, judged by its name (public reports, fixtures/shm/README.md)."""

    PSM = "psm"  # psm_<hex>: Python multiprocessing.shared_memory (vLLM message queues)
    NCCL = "nccl"  # nccl-<6 chars>: NCCL (mkstemp), often 0 bytes
    LOKY_SEM = "loky_sem"  # sem.loky-<...>: POSIX semaphore from loky / joblib
    VLLM_OBJECT_STORAGE = "vllm_object_storage"  # VLLM_OBJECT_STORAGE_SHM_BUFFER_<...>
    VLLM_OFFLOAD = "vllm_offload"  # vllm_offload_<uuid>.mmap
    OTHER = "other"


_KIND_PATTERNS: tuple[tuple[ShmKind, re.Pattern[str]], ...] = (
    (ShmKind.PSM, re.compile(r"psm_[0-9a-fA-F]+")),
    (ShmKind.NCCL, re.compile(r"nccl-[A-Za-z0-9]{6}")),
    (ShmKind.LOKY_SEM, re.compile(r"sem\.loky-[A-Za-z0-9_.-]+")),
    (ShmKind.VLLM_OBJECT_STORAGE, re.compile(r"VLLM_OBJECT_STORAGE_SHM_BUFFER_[A-Za-z0-9_.-]*")),
    (ShmKind.VLLM_OFFLOAD, re.compile(r"vllm_offload_[0-9a-fA-F-]+\.mmap")),
)

# The kinds a preflight cleanup (age unknown) may remove when explicitly asked.
KNOWN_RUNTIME_KINDS = frozenset(k for k, _ in _KIND_PATTERNS)
# Names only vLLM itself creates: created within the container's lifetime, they are its own even when no
# process of it was seen using them. NCCL, multiprocessing and loky names need the witness.
ENGINE_OWN_KINDS = frozenset({ShmKind.VLLM_OBJECT_STORAGE, ShmKind.VLLM_OFFLOAD})
_PATTERN_TEXT = {
    ShmKind.PSM: "psm_* (Python multiprocessing)",
    ShmKind.NCCL: "nccl-* (NCCL)",
    ShmKind.LOKY_SEM: "sem.loky-* (loky/joblib)",
    ShmKind.OTHER: "an unknown name",
}


def classify(name: str) -> ShmKind:
    """The :class:`ShmKind` of a /dev/shm entry name (whole-name match; anything else is OTHER)."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.fullmatch(name):
            return kind
    return ShmKind.OTHER


@dataclass(frozen=True, slots=True)
class ShmUser:
    """A live process that uses an entry: maps it, holds it open, or both."""

    pid: int
    comm: str
    mapped: bool = False
    open_fd: bool = False

    def describe(self) -> str:
        how = ", ".join(w for w, on in (("mapped", self.mapped), ("open", self.open_fd)) if on)
        return f"pid {self.pid} ({self.comm}) [{how}]"


@dataclass(frozen=True, slots=True)
class ShmEntry:
    """One entry of the shm directory, with the evidence of who uses it.

    Sizes in bytes: ``size_bytes`` is the file size, ``allocated_bytes`` the
    tmpfs memory it holds (``st_blocks * 512``; smaller for sparse files).
    Times are UTC epoch seconds. ``file_type`` is ``"file"``, ``"dir"``,
    ``"symlink"`` or ``"other"``; ``dev``/``ino`` identify the inode.
    ``users`` are live processes that map it or hold it open;
    ``unreadable_pids`` are processes whose maps/fds could not be read during
    the scan (the same for every entry of one scan) — while any exist, no
    entry can be proven unused.
    """

    name: str
    path: str
    size_bytes: int
    allocated_bytes: int
    mtime: float
    ctime: float
    kind: ShmKind
    file_type: str
    dev: int
    ino: int
    users: tuple[ShmUser, ...] = ()
    unreadable_pids: tuple[int, ...] = ()

    @property
    def mapped_by(self) -> tuple[int, ...]:
        """PIDs that have the entry in their memory map."""
        return tuple(u.pid for u in self.users if u.mapped)

    @property
    def open_by(self) -> tuple[int, ...]:
        """PIDs that hold an open file descriptor on the entry."""
        return tuple(u.pid for u in self.users if u.open_fd)

    @property
    def in_use(self) -> bool:
        return bool(self.users)

    @property
    def changed_at(self) -> float:
        """``min(mtime, ctime)``: the entry existed no later than this (see module doc)."""
        return min(self.mtime, self.ctime)


@dataclass(frozen=True, slots=True)
class Kept:
    """An entry the cleanup keeps: its ``name``, ``reason`` (said in the archive's ``shm-cleanup.txt``), and
    ``too_new``: kept only because it changed within ``act.shm.LEFTOVER_MIN_AGE_S`` (the preflight looks again)."""

    name: str
    reason: str
    too_new: bool = False


@dataclass(frozen=True, slots=True)
class CleanupPlan:
    """The decision of :func:`plan_cleanup`: ``remove`` (entries) and ``kept`` (name + reason)."""

    remove: tuple[ShmEntry, ...]
    kept: tuple[Kept, ...]
    container_started_at: float | None
    now: float
    ignore_unreadable_pids: frozenset[int] = frozenset()

    @property
    def remove_bytes(self) -> int:
        return sum(e.allocated_bytes for e in self.remove)


@dataclass(slots=True)
class CleanupResult:
    """What :func:`execute` did. ``removed``: ``(name, size_bytes)``; ``freed_bytes``:
    tmpfs memory returned (allocated bytes of the removed entries). With
    ``dry_run`` nothing was unlinked and ``removed`` lists what would have been."""

    dry_run: bool = False
    removed: list[tuple[str, int]] = field(default_factory=list)
    kept: list[Kept] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    freed_bytes: int = 0


# --------------------------------------------------------------------------- scan


@dataclass(slots=True)
class _Evidence:
    users: dict[tuple[int, int], dict[int, ShmUser]]
    unreadable: set[int]


def _file_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _strip_deleted(path: str) -> tuple[str, bool]:
    if path.endswith(" (deleted)"):
        return path[: -len(" (deleted)")], True
    return path, False


def _read_comm(pid_dir: str) -> str:
    try:
        with open(os.path.join(pid_dir, "comm"), encoding="utf-8", errors="replace") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def proc_pids(proc_root: str | Path) -> list[int]:
    """Every pid listed in ``proc_root`` (``/proc``), ascending. Raises ``OSError`` naming the path."""
    try:
        names = os.listdir(proc_root)
    except OSError as e:
        raise OSError(e.errno, f"cannot list {proc_root}: {e.strerror}") from e
    return sorted(int(n) for n in names if n.isdigit())


def _collect_evidence(
    proc_root: str,
    shm_dir: str,
    targets: dict[tuple[int, int], str],
    pids: Iterable[int] | None = None,
) -> _Evidence:
    """Which live processes (all, or only ``pids``) map or hold open the inodes in ``targets``.

    ``targets`` maps ``(dev, ino)`` to the entry's path. Processes that vanish
    mid-scan are skipped; processes that cannot be read are returned in
    ``unreadable``.
    """
    by_path = {p: key for key, p in targets.items()}
    by_name = {os.path.basename(p): key for key, p in targets.items()}
    prefix = shm_dir.rstrip("/") + "/"
    ev = _Evidence(users={}, unreadable=set())
    if not targets:
        return ev
    for pid in proc_pids(proc_root) if pids is None else sorted(pids):
        pid_dir = os.path.join(proc_root, str(pid))
        mapped: set[tuple[int, int]] = set()
        opened: set[tuple[int, int]] = set()
        try:
            _scan_maps(pid_dir, targets, by_path, mapped)
            _scan_fds(pid_dir, prefix, targets, by_path, by_name, opened)
        except OSError as e:
            if e.errno in _GONE:
                continue
            # EACCES/EPERM, or anything unexpected: we cannot see what this
            # process uses, so it blocks removal rather than crashing the scan.
            if e.errno not in _HIDDEN:
                log.warning("cannot read /proc evidence of pid %d: %s", pid, e)
            ev.unreadable.add(pid)
            continue
        if not (mapped or opened):
            continue
        comm = _read_comm(pid_dir)
        for key in mapped | opened:
            ev.users.setdefault(key, {})[pid] = ShmUser(pid, comm, mapped=key in mapped, open_fd=key in opened)
    return ev


def _scan_maps(
    pid_dir: str,
    targets: dict[tuple[int, int], str],
    by_path: dict[str, tuple[int, int]],
    found: set[tuple[int, int]],
) -> None:
    # "addr perms offset MAJ:MIN inode   /path[ (deleted)]" — dev is hex, inode decimal.
    with open(os.path.join(pid_dir, "maps"), encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 5 or parts[4] == "0":
                continue
            maj, _, mnr = parts[3].partition(":")
            try:
                key = (os.makedev(int(maj, 16), int(mnr, 16)), int(parts[4]))
            except ValueError:
                key = (-1, -1)
            if key in targets:
                found.add(key)
                continue
            if len(parts) == 6:
                path, deleted = _strip_deleted(parts[5].rstrip("\n"))
                if not deleted and path in by_path:
                    found.add(by_path[path])


def _scan_fds(
    pid_dir: str,
    prefix: str,
    targets: dict[tuple[int, int], str],
    by_path: dict[str, tuple[int, int]],
    by_name: dict[str, tuple[int, int]],
    found: set[tuple[int, int]],
) -> None:
    fd_dir = os.path.join(pid_dir, "fd")
    for fd in os.listdir(fd_dir):
        link = os.path.join(fd_dir, fd)
        try:
            target = os.readlink(link)
        except OSError as e:
            if e.errno in _GONE:  # this fd was closed meanwhile
                continue
            raise
        if not target.startswith("/"):
            continue  # socket:[…], pipe:[…], anon_inode:…
        path, deleted = _strip_deleted(target)
        if not deleted and path in by_path:
            found.add(by_path[path])
            continue
        # Only stat what can be ours: under the shm dir, or the same (random)
        # name elsewhere (a bind mount in another namespace). stat() on an
        # arbitrary fd could block on a hung network or FUSE file system.
        if not (path.startswith(prefix) or os.path.basename(path) in by_name):
            continue
        try:
            st = os.stat(link)
        except OSError as e:
            if e.errno in _GONE:
                continue
            raise
        key = (st.st_dev, st.st_ino)
        if key in targets:
            found.add(key)


def _lstat_entry(dir_fd: int, name: str, shm_dir: str) -> ShmEntry | None:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    return ShmEntry(
        name=name,
        path=os.path.join(shm_dir, name),
        size_bytes=st.st_size,
        allocated_bytes=st.st_blocks * 512,
        mtime=st.st_mtime,
        ctime=st.st_ctime,
        kind=classify(name),
        file_type=_file_type(st.st_mode),
        dev=st.st_dev,
        ino=st.st_ino,
    )


def scan(shm_dir: str | Path = DEFAULT_SHM_DIR, proc_root: str | Path = DEFAULT_PROC_ROOT) -> list[ShmEntry]:
    """List ``shm_dir`` with the evidence of use for each entry.

    Returns one :class:`ShmEntry` per directory entry, sorted by name.
    Directories and symlinks are listed (never followed) so a report can show
    them; only regular files are ever candidates for removal.

    Raises:
        OSError: ``shm_dir`` or ``proc_root`` cannot be listed. Per process,
            ENOENT/ESRCH (it exited mid-scan) skip it; any other error
            (EACCES/EPERM above all) records it in ``unreadable_pids``.
    """
    shm_dir = os.path.realpath(os.fspath(shm_dir))
    dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        entries = [e for n in sorted(os.listdir(dir_fd)) if (e := _lstat_entry(dir_fd, n, shm_dir))]
    finally:
        os.close(dir_fd)
    targets = {(e.dev, e.ino): e.path for e in entries if e.file_type == "file"}
    ev = _collect_evidence(os.fspath(proc_root), shm_dir, targets)
    unreadable = tuple(sorted(ev.unreadable))
    return [_with_evidence(e, ev.users.get((e.dev, e.ino), {}).values(), unreadable) for e in entries]


def _with_evidence(e: ShmEntry, users: Iterable[ShmUser], unreadable: tuple[int, ...]) -> ShmEntry:
    return replace(e, users=tuple(sorted(users, key=lambda u: u.pid)), unreadable_pids=unreadable)


# --------------------------------------------------------------------------- the container's own evidence


def process_tree(root_pid: int, proc_root: str | Path = DEFAULT_PROC_ROOT) -> set[int]:
    """``root_pid`` and every live descendant, from the parent PID in ``/proc/PID/stat``.

    A container's processes are its PID 1 (Docker's ``State.Pid``) and its
    descendants: an orphan inside the container is re-parented to that PID 1
    (the namespace's init), so it stays in the tree. Returns ``set()`` when
    ``root_pid`` does not exist (the container is gone).
    """
    proc_root = os.fspath(proc_root)
    children: dict[int, list[int]] = {}
    alive: set[int] = set()
    for pid in proc_pids(proc_root):
        try:
            with open(os.path.join(proc_root, str(pid), "stat"), "rb") as f:
                raw = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        rest = raw[raw.rfind(b")") + 2 :].split()
        if len(rest) < 2:
            continue
        alive.add(pid)
        children.setdefault(int(rest[1]), []).append(pid)
    if root_pid not in alive:
        return set()
    tree, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo.extend(children.get(pid, ()))
    return tree


def unreadable_pids(proc_root: str | Path = DEFAULT_PROC_ROOT) -> list[tuple[int, str, str]]:
    """Processes whose maps or fds sparkd cannot read: ``[(pid, comm, why)]``, by pid.

    Each one makes every /dev/shm entry "cannot prove unused" (see the module
    doc); ``sparkd doctor`` lists them. Raises ``OSError`` when ``proc_root``
    cannot be listed.
    """
    proc_root = os.fspath(proc_root)
    out = []
    for pid in proc_pids(proc_root):
        pid_dir = os.path.join(proc_root, str(pid))
        try:
            with open(os.path.join(pid_dir, "maps"), "rb") as f:
                f.read(1)
            os.listdir(os.path.join(pid_dir, "fd"))
        except OSError as e:
            if e.errno in _GONE:
                continue
            out.append((pid, _read_comm(pid_dir), e.strerror or str(e)))
    return out


@dataclass(slots=True)
class ShmWitness:
    """What the container's own processes were seen using in the shm directory.

    ``observe(root_pid)`` scans the maps and fds of ``root_pid`` and its
    descendants (:func:`process_tree`) and adds each entry they map or hold
    open to ``seen`` as ``(dev, ino, name)`` (name *and* inode, so a reused
    inode number under another name is not taken for it). Call it while the
    container runs and once more right before stopping it. ``observations``
    counts scans that found the container; ``last_error`` keeps the last
    failure (a scan never raises).
    """

    container_id: str
    shm_dir: str = DEFAULT_SHM_DIR
    proc_root: str = DEFAULT_PROC_ROOT
    seen: set[tuple[int, int, str]] = field(default_factory=set)
    observations: int = 0
    last_error: str | None = None

    def observe(self, root_pid: int | None) -> int:
        """Scan the container's processes now; returns how many entries were newly seen."""
        if not root_pid:
            return 0
        try:
            pids = process_tree(root_pid, self.proc_root)
            if not pids:
                return 0
            shm_dir = os.path.realpath(self.shm_dir)
            dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                entries = [e for n in os.listdir(dir_fd) if (e := _lstat_entry(dir_fd, n, shm_dir))]
            finally:
                os.close(dir_fd)
            targets = {(e.dev, e.ino): e.path for e in entries if e.file_type == "file"}
            ev = _collect_evidence(self.proc_root, shm_dir, targets, pids)
        except OSError as e:
            self.last_error = str(e)
            log.warning("/dev/shm witness: cannot observe container %s: %s", self.container_id[:12], e)
            return 0
        self.observations += 1
        before = len(self.seen)
        names = {(e.dev, e.ino): e.name for e in entries}
        self.seen.update((dev, ino, names[(dev, ino)]) for dev, ino in ev.users)
        return len(self.seen) - before

    def saw(self, e: ShmEntry) -> bool:
        return (e.dev, e.ino, e.name) in self.seen
