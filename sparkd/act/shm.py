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

import logging
import os
import stat
import time
from collections.abc import Collection, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path

from sparkd.sense.shm_scan import (
    _PATTERN_TEXT,
    DEFAULT_CLOCK_SLACK_S,
    DEFAULT_PROC_ROOT,
    DEFAULT_SHM_DIR,
    ENGINE_OWN_KINDS,
    KNOWN_RUNTIME_KINDS,
    CleanupPlan,
    CleanupResult,
    Kept,
    ShmEntry,
    ShmKind,
    ShmUser,
    ShmWitness,
    _collect_evidence,
    _Evidence,
    _file_type,
    classify,
    process_tree,
    scan,
    unreadable_pids,
)
from sparkd.units import GiB, MiB

log = logging.getLogger(__name__)

#: An unheld entry of unknown age (the launch preflight) changed within this many seconds is not called a
#: leftover yet: another job's runtime may have just made it and be about to map it (NCCL's proxy makes a segment
#: that a peer opens a moment later). The preflight looks again once it is this old (``young_leftovers``).
LEFTOVER_MIN_AGE_S = 10.0
TOO_NEW = "changed {age:.1f} s ago: too new to call a leftover (a runtime may be about to map it)"

# the reading side lives in sparkd.sense.shm_scan; act.shm is the one name callers use for /dev/shm
__all__ = [
    "DEFAULT_CLOCK_SLACK_S",
    "CleanupPlan",
    "CleanupResult",
    "Kept",
    "ShmEntry",
    "ShmKind",
    "ShmUser",
    "ShmWitness",
    "classify",
    "cleanup",
    "execute",
    "format_result",
    "plan_cleanup",
    "process_tree",
    "scan",
    "unreadable_pids",
    "young_leftovers",
]

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
      allows unused entries under a name only vLLM creates
      (:data:`ENGINE_OWN_KINDS`) that did not change within the last
      :data:`LEFTOVER_MIN_AGE_S` (another job may be about to map a new one);
      NCCL, multiprocessing and loky names are kept then (any program makes them).

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
        keep = _keep_reason(e, threshold, now, allow_unknown_age, ignored)
        if keep is None and threshold is not None and (reason := _tie_reason(e, witness, until)) is not None:
            keep = Kept(e.name, reason)
        if keep is None:
            remove.append(e)
        else:
            kept.append(keep)
    return CleanupPlan(tuple(remove), tuple(kept), container_started_at, now, ignored)


def _keep_reason(
    e: ShmEntry,
    threshold: float | None,
    now: float,
    allow_unknown_age: bool,
    ignored: frozenset[int],
) -> Kept | None:
    """Why ``e`` is kept whatever the witness says, or None."""
    if e.file_type != "file":
        return Kept(e.name, f"not sparkd's to judge: a {e.file_type}, not a shared-memory file")
    if e.users:
        return Kept(e.name, _in_use_reason(e.users))
    unreadable = [p for p in e.unreadable_pids if p not in ignored]
    if unreadable:
        return Kept(e.name, _unreadable_reason(unreadable))
    if threshold is None:
        if not allow_unknown_age:
            return Kept(e.name, f"age unknown (no container start given); last changed {_utc(e.changed_at)}")
        if e.kind not in KNOWN_RUNTIME_KINDS:
            return Kept(e.name, "not sparkd's to judge: name matches no known vLLM/NCCL/loky pattern")
        if e.kind not in ENGINE_OWN_KINDS:
            # no container's lifetime and no witness to tie it to: removed by name alone, a co-tenant's segment
            # (closed, not unlinked, waiting for a consumer) went at every launch (helper-53; DESIGN.md: never an
            # entry sparkd cannot prove was the container's)
            return Kept(
                e.name,
                f"not provably the engine's: {_PATTERN_TEXT[e.kind]} names are made by any program using that "
                "library, and nothing ties this one to a run of the model; remove it yourself if it is a leftover",
            )
        if now - e.changed_at < LEFTOVER_MIN_AGE_S:
            return Kept(e.name, TOO_NEW.format(age=max(0.0, now - e.changed_at)), too_new=True)
        return None
    if e.changed_at < threshold:
        age_s = max(0.0, now - e.changed_at)
        return Kept(e.name, f"older than the container (created {_utc(e.changed_at)}, {age_s:.0f} s ago)")
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


def young_leftovers(result: CleanupResult) -> list[str]:
    """Names ``result`` kept only because they changed within :data:`LEFTOVER_MIN_AGE_S` (looked at again later):
    ``Kept.too_new``, set where that reason is given (a reason's text was matched before)."""
    return [k.name for k in result.kept if k.too_new]


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
