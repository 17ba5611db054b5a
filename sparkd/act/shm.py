"""Evidence-based cleanup of POSIX shared memory in the host's /dev/shm.

The serving container runs with ``--ipc host`` (CONTEXT.md), so vLLM, NCCL and
loky put their shared memory into the host's /dev/shm, which every other
process on the machine shares. A runtime killed before it cleans up leaves
entries behind (``vllm_offload_*.mmap`` leftovers even break the next start
with ``OSError: [Errno 14] Bad address``); a cleanup that deletes a *live*
segment breaks someone else. So nothing is removed by name alone:

* ``scan()`` (I/O) lists the directory and collects the evidence: which live
  processes map each entry (``/proc/PID/maps``) or hold it open
  (``/proc/PID/fd/*``). Matching is by device and inode, which is exact even
  for processes in other mount namespaces; a path match (not ``(deleted)``) is
  also counted, so an error in one method can only make sparkd keep more.
* ``ShmWitness`` (I/O) records, while the container runs and once more right
  before it is stopped, which entries *the container's own processes* (its
  PID 1 and every descendant) map or hold open.
* ``plan_cleanup()`` (pure) decides: remove only regular files that no live
  process maps or holds open now *and* that are tied to the stopped container
  by its own evidence — seen used by its processes while it ran, or created
  within its lifetime under a name only the engine itself creates
  (:data:`ENGINE_OWN_KINDS`: ``VLLM_OBJECT_STORAGE_SHM_BUFFER_*``,
  ``vllm_offload_*.mmap``). NCCL (``nccl-*``), Python multiprocessing
  (``psm_*``) and loky (``sem.loky-*``) names are created by any program using
  those libraries: without the witness they are kept, with the reason (field:
  an unrelated stale ``nccl-*`` entry created by someone else after the
  container started was deleted by the age rule alone).
* ``execute()`` re-checks the evidence right before unlinking (a process may
  have opened an entry since the scan), never follows symlinks, never removes
  directories and only unlinks names directly inside the scanned directory.

Timestamps: tmpfs has no usable creation time, so "appeared after the
container started" means ``min(mtime, ctime) >= started_at - clock_slack_s``.
That is a bound, not proof: a file created earlier but written after the start
also passes it — which is why the in-use evidence is the hard gate and the age
only a second one.

Limits of the evidence (why some entries are kept although unused): a process
whose maps or fds cannot be read (EACCES/EPERM) could be using anything, so a
scan with unreadable processes removes nothing. ENOENT/ESRCH mean the process
exited mid-scan and are skipped. sparkd must see the host's PID namespace
(no ``PrivatePIDs=``/``hidepid`` that hides other users' processes): an
invisible process is indistinguishable from no process.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path

from sparkd.units import GiB, MiB

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
    name: str
    reason: str


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


def _pids(proc_root: str) -> list[int]:
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
    for pid in _pids(proc_root) if pids is None else sorted(pids):
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
    for pid in _pids(proc_root):
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
    for pid in _pids(proc_root):
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


# --------------------------------------------------------------------------- plan


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _in_use_reason(users: Sequence[ShmUser], limit: int = 3) -> str:
    shown = ", ".join(u.describe() for u in users[:limit])
    more = f" and {len(users) - limit} more" if len(users) > limit else ""
    return f"in use by {shown}{more}"


def _unreadable_reason(pids: Sequence[int]) -> str:
    shown = ", ".join(str(p) for p in pids[:5])
    more = f" and {len(pids) - 5} more" if len(pids) > 5 else ""
    return f"cannot prove unused: /proc of pid {shown}{more} was unreadable"


def plan_cleanup(
    entries: Iterable[ShmEntry],
    *,
    container_started_at: float | None,
    now: float,
    allow_unknown_age: bool = False,
    clock_slack_s: float = DEFAULT_CLOCK_SLACK_S,
    ignore_unreadable_pids: Collection[int] = (),
    witness: ShmWitness | None = None,
    container_stopped_at: float | None = None,
) -> CleanupPlan:
    """Decide which entries to remove; pure (no I/O, no clock).

    An entry is removed only if all of these hold:

    * it is a regular file (directories, symlinks, sockets: "not sparkd's to judge");
    * the scan could read every process (``unreadable_pids`` empty);
    * no live process maps it or holds it open;
    * with ``container_started_at`` (UTC epoch s, e.g. Docker's
      ``State.StartedAt``), it is tied to that container by its own evidence:
      the ``witness`` saw the container's processes map or hold it open while
      the container ran; or it changed within the container's lifetime
      (``started_at - clock_slack_s`` .. ``container_stopped_at +
      clock_slack_s``; no upper bound when ``None``) *and* its name is one
      only the engine creates (:data:`ENGINE_OWN_KINDS`);
    * with ``container_started_at=None`` (preflight leftovers report) its age
      is unknown and it is kept, unless ``allow_unknown_age=True``, which
      allows unused entries whose name matches a known vLLM/NCCL/loky pattern
      (:data:`KNOWN_RUNTIME_KINDS`).

    ``ignore_unreadable_pids``: processes known to be irrelevant although
    /proc hides them from sparkd (e.g. a sandbox supervisor); any *other*
    unreadable process blocks every removal. Kept in the plan so that
    :func:`execute`'s re-check applies the same rule.

    Every other entry is in ``kept`` with a reason an operator can read.
    ``now`` (UTC epoch s) is used only for the ages in the reasons.
    """
    ignored = frozenset(ignore_unreadable_pids)
    remove: list[ShmEntry] = []
    kept: list[Kept] = []
    threshold = None if container_started_at is None else container_started_at - clock_slack_s
    until = None if container_stopped_at is None else container_stopped_at + clock_slack_s
    for e in entries:
        reason = _keep_reason(e, threshold, now, allow_unknown_age, ignored)
        if reason is None and threshold is not None:
            reason = _tie_reason(e, witness, until)
        if reason is None:
            remove.append(e)
        else:
            kept.append(Kept(e.name, reason))
    return CleanupPlan(tuple(remove), tuple(kept), container_started_at, now, ignored)


def _keep_reason(
    e: ShmEntry,
    threshold: float | None,
    now: float,
    allow_unknown_age: bool,
    ignored: frozenset[int],
) -> str | None:
    if e.file_type != "file":
        return f"not sparkd's to judge: a {e.file_type}, not a shared-memory file"
    if e.users:
        return _in_use_reason(e.users)
    unreadable = [p for p in e.unreadable_pids if p not in ignored]
    if unreadable:
        return _unreadable_reason(unreadable)
    if threshold is None:
        if not allow_unknown_age:
            return f"age unknown (no container start given); last changed {_utc(e.changed_at)}"
        if e.kind not in KNOWN_RUNTIME_KINDS:
            return "not sparkd's to judge: name matches no known vLLM/NCCL/loky pattern"
        return None
    if e.changed_at < threshold:
        age_s = max(0.0, now - e.changed_at)
        return f"older than the container (created {_utc(e.changed_at)}, {age_s:.0f} s ago)"
    return None


def _tie_reason(e: ShmEntry, witness: ShmWitness | None, until: float | None) -> str | None:
    """``None`` when ``e`` is tied to the stopped container; else why it is not (kept)."""
    if witness is not None and witness.saw(e):
        return None
    if until is not None and e.changed_at > until:
        return f"created after the container stopped ({_utc(e.changed_at)})"
    if e.kind in ENGINE_OWN_KINDS:
        return None
    seen = (
        "none of the container's processes was seen using it"
        if witness is not None and witness.observations
        else "the container's processes could not be observed"
    )
    return f"not tied to the container: {seen}, and {_PATTERN_TEXT[e.kind]} names are not the engine's own"


# --------------------------------------------------------------------------- execute


def execute(
    plan: CleanupPlan,
    *,
    dry_run: bool = False,
    proc_root: str | Path = DEFAULT_PROC_ROOT,
) -> CleanupResult:
    """Unlink the plan's ``remove`` entries after re-checking each one.

    Right before unlinking, the evidence for all candidates is collected again
    from ``proc_root`` and each name is ``lstat``-ed again (through a
    descriptor of its directory, never following symlinks). A candidate is kept
    if it vanished, was replaced by another inode, is no longer a regular file,
    changed since the scan, or is now mapped/open by a live process. The
    window left between this re-check and ``unlink`` is one /proc pass.

    The plan's ``kept`` entries are copied into the result. Failures to unlink
    land in ``errors`` as ``(name, message)``; a failed re-check scan puts
    every candidate in ``errors`` and removes nothing. Never raises for a
    single entry.
    """
    result = CleanupResult(dry_run=dry_run, kept=list(plan.kept))
    if not plan.remove:
        return result
    by_dir: dict[str, list[ShmEntry]] = {}
    for e in plan.remove:
        if os.path.basename(e.path) != e.name or e.name in ("", ".", "..") or "/" in e.name:
            result.errors.append((e.name, "refused: name is not a plain entry of its directory"))
            continue
        by_dir.setdefault(os.path.dirname(e.path), []).append(e)
    for shm_dir, candidates in by_dir.items():
        _execute_dir(plan, shm_dir, candidates, result, dry_run, os.fspath(proc_root))
    return result


def _execute_dir(
    plan: CleanupPlan,
    shm_dir: str,
    candidates: list[ShmEntry],
    result: CleanupResult,
    dry_run: bool,
    proc_root: str,
) -> None:
    try:
        dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        result.errors.extend((c.name, f"cannot open {shm_dir}: {e.strerror}") for c in candidates)
        return
    try:
        try:
            ev = _collect_evidence(proc_root, shm_dir, {(c.dev, c.ino): c.path for c in candidates})
        except OSError as e:
            msg = f"re-check failed, nothing removed: {e}"
            result.errors.extend((c.name, msg) for c in candidates)
            return
        unreadable = sorted(ev.unreadable - plan.ignore_unreadable_pids)
        for c in candidates:
            reason = _recheck(dir_fd, c, ev, unreadable)
            if reason is not None:
                result.kept.append(Kept(c.name, reason))
                continue
            if dry_run:
                result.removed.append((c.name, c.size_bytes))
                result.freed_bytes += c.allocated_bytes
                continue
            try:
                os.unlink(c.name, dir_fd=dir_fd)  # unlink never follows a symlink
            except FileNotFoundError:
                result.kept.append(Kept(c.name, "vanished before removal"))
            except OSError as e:
                result.errors.append((c.name, f"unlink failed: {e.strerror}"))
            else:
                result.removed.append((c.name, c.size_bytes))
                result.freed_bytes += c.allocated_bytes
                log.info("removed %s (%d bytes) from %s", c.name, c.size_bytes, shm_dir)
    finally:
        os.close(dir_fd)


def _recheck(dir_fd: int, c: ShmEntry, ev: _Evidence, unreadable: list[int]) -> str | None:
    try:
        st = os.lstat(c.name, dir_fd=dir_fd)
    except FileNotFoundError:
        return "vanished before removal"
    except OSError as e:
        return f"re-check failed: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"not sparkd's to judge: now a {_file_type(st.st_mode)}"
    if (st.st_dev, st.st_ino) != (c.dev, c.ino):
        return "replaced by another file since the scan"
    if st.st_mtime != c.mtime or st.st_ctime != c.ctime:
        return f"changed since the scan (at {_utc(max(st.st_mtime, st.st_ctime))})"
    users = ev.users.get((c.dev, c.ino))
    if users:
        return _in_use_reason(sorted(users.values(), key=lambda u: u.pid)) + " (since the scan)"
    if unreadable:
        return _unreadable_reason(unreadable)
    return None


# --------------------------------------------------------------------------- report


def _fmt_bytes(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n} B"


def format_result(result: CleanupResult, *, limit: int = 20) -> str:
    """Human-readable multi-line report of a cleanup, for events and logs.

    First line: counts and freed memory; then one line per removed, kept and
    failed entry (at most ``limit`` per section, then "… and N more").
    """
    verb = "would remove" if result.dry_run else "removed"
    head = (
        f"/dev/shm cleanup{' (dry run)' if result.dry_run else ''}: {verb} {len(result.removed)} "
        f"({_fmt_bytes(result.freed_bytes)}), kept {len(result.kept)}, errors {len(result.errors)}"
    )
    lines = [head]

    def section(title: str, items: list[str]) -> None:
        if not items:
            return
        lines.append(f"{title}:")
        lines.extend(f"  {s}" for s in items[:limit])
        if len(items) > limit:
            lines.append(f"  … and {len(items) - limit} more")

    section(verb, [f"{n} ({_fmt_bytes(b)})" for n, b in result.removed])
    section("kept", [f"{k.name}: {k.reason}" for k in result.kept])
    section("errors", [f"{n}: {msg}" for n, msg in result.errors])
    return "\n".join(lines)


def cleanup(
    *,
    container_started_at: float | None,
    shm_dir: str | Path = DEFAULT_SHM_DIR,
    proc_root: str | Path = DEFAULT_PROC_ROOT,
    dry_run: bool = False,
    allow_unknown_age: bool = False,
    now: float | None = None,
    ignore_unreadable_pids: Collection[int] = (),
    witness: ShmWitness | None = None,
    container_stopped_at: float | None = None,
) -> CleanupResult:
    """Convenience: ``scan`` → ``plan_cleanup`` → ``execute`` with one clock reading."""
    entries = scan(shm_dir, proc_root)
    plan = plan_cleanup(
        entries,
        container_started_at=container_started_at,
        now=time.time() if now is None else now,
        allow_unknown_age=allow_unknown_age,
        ignore_unreadable_pids=ignore_unreadable_pids,
        witness=witness,
        container_stopped_at=container_stopped_at,
    )
    return execute(plan, dry_run=dry_run, proc_root=proc_root)
