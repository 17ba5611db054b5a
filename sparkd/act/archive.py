"""Postmortem bundles: one ``tar.gz`` per event, written atomically.

Before sparkd stops a container (CONTEXT.md: "first archive the container's
logs and the watchdog's own log, then docker stop"), it bundles what an
operator needs afterwards: ``summary.txt`` (always the first member), then
parts such as ``container.log``, ``sparkd.log``, ``samples.csv``,
``kernel.log``, ``inspect.json``, ``config.json``, ``plan.json``.

Writing happens while memory is short, so file parts are streamed (never read
whole into memory) and capped at their last ``max_part_bytes``. A bundle
appears under its final name complete or not at all: it is written to a
hidden temp file in the same directory, fsync'ed, then published with
``os.link`` (atomic and never overwrites another bundle; ``os.replace`` after
an existence check where the file system has no hard links), and the
directory is fsync'ed.

Names: ``sparkd-<UTC yyyymmddTHHMMSSZ>-<slug>.tar.gz``, with ``-2``, ``-3`` …
before ``.tar.gz`` when the same second and hint repeat.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import logging
import os
import re
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePath
from typing import BinaryIO

from sparkd.core.supervision import is_incident
from sparkd.errors import InvalidInput, NotFound
from sparkd.units import MiB

log = logging.getLogger(__name__)

FILE_MODE = 0o640
DIR_MODE = 0o750
# The tail of a log holds the failure; a multi-GiB container log must not make
# a multi-GiB bundle on a machine that is short of memory and disk.
DEFAULT_MAX_PART_BYTES = 256 * MiB

SUMMARY_MEMBER = "summary.txt"
_NAME_RE = re.compile(r"^sparkd-\d{8}T\d{6}Z-[a-z0-9-]{1,40}(?:-\d+)?\.tar\.gz$")
_SAFE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,250}\.tar\.gz$")
_MEMBER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TMP_PREFIX = ".sparkd-tmp-"


@dataclass(frozen=True, slots=True)
class Missing:
    """A part that could not be gathered (e.g. ``docker logs`` failed while dockerd shut down).

    Written as member ``NAME.missing`` holding ``reason``, and listed in the
    summary's notes: a partial postmortem beats none."""

    reason: str


Part = bytes | str | PurePath | Missing


@dataclass(frozen=True, slots=True)
class ArchiveInfo:
    """One bundle: file ``name``, absolute ``path``, ``size_bytes`` on disk,
    ``created`` (UTC epoch seconds, the file's mtime)."""

    name: str
    path: Path
    size_bytes: int
    created: float


def slugify(hint: str, max_len: int = 40) -> str:
    """``"Low MemAvailable (5/5)!"`` → ``"low-memavailable-5-5"``; empty → ``"archive"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", hint.lower()).strip("-")[:max_len].strip("-")
    return slug or "archive"


def archive_name(now: float, name_hint: str, n: int = 1) -> str:
    """The file name for a bundle written at ``now`` (UTC epoch s); ``n > 1`` adds ``-n``."""
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%SZ")
    suffix = f"-{n}" if n > 1 else ""
    return f"sparkd-{stamp}-{slugify(name_hint)}{suffix}.tar.gz"


# --------------------------------------------------------------------------- write


@dataclass(slots=True)
class _Source:
    member: str
    data: bytes | None = None  # in-memory content
    fobj: BinaryIO | None = None  # open file, positioned at the first byte to copy
    size: int = 0
    note: str | None = None  # for the summary


def _open_part(name: str, value: Part, max_part_bytes: int) -> _Source:
    if isinstance(value, Missing):
        text = f"{name} is missing from this archive: {value.reason}\n".encode(errors="replace")
        return _Source(f"{name}.missing", data=text, size=len(text), note=f"{name}: missing ({value.reason})")
    if isinstance(value, bytes):
        return _Source(name, data=value, size=len(value))
    if isinstance(value, str):
        data = value.encode("utf-8", errors="replace")
        return _Source(name, data=data, size=len(data))
    try:
        # O_NONBLOCK: a FIFO given by mistake must not hang the stop path.
        fd = os.open(value, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        text = f"could not read {value}: {e.strerror or e}\n".encode()
        return _Source(f"{name}.missing", data=text, size=len(text), note=f"{name}: missing ({e})")
    f = os.fdopen(fd, "rb")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            f.close()
            text = f"could not read {value}: not a regular file\n".encode()
            return _Source(f"{name}.missing", data=text, size=len(text), note=f"{name}: missing")
        size = min(st.st_size, max_part_bytes)
        note = None
        if size < st.st_size:
            f.seek(st.st_size - size)
            note = f"{name}: only the last {size} of {st.st_size} bytes"
    except OSError:
        f.close()
        raise
    return _Source(name, fobj=f, size=size, note=note)


class _Exactly(io.RawIOBase):
    """Reads exactly ``size`` bytes from ``f``; pads with NUL if the file shrank."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.left, self.short = f, size, False

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        if n <= 0:
            return b""
        chunk = self.f.read(n)
        if len(chunk) < n:
            self.short = True
            chunk += b"\0" * (n - len(chunk))
        self.left -= len(chunk)
        return chunk


def _tarinfo(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode = size, int(mtime), FILE_MODE
    ti.uname = ti.gname = "root"
    return ti


def _write_members(tar: tarfile.TarFile, summary: str, sources: list[_Source], now: float) -> None:
    notes = [s.note for s in sources if s.note]
    text = summary if summary.endswith("\n") or not summary else summary + "\n"
    if notes:
        text += "\nArchive notes:\n" + "".join(f"  {n}\n" for n in notes)
    data = text.encode("utf-8", errors="replace")
    tar.addfile(_tarinfo(SUMMARY_MEMBER, len(data), now), io.BytesIO(data))
    for s in sources:
        if s.fobj is not None:
            reader = _Exactly(s.fobj, s.size)
            tar.addfile(_tarinfo(s.member, s.size, now), reader)
            if reader.short:
                log.warning("archive part %s shrank while being read; padded", s.member)
        else:
            assert s.data is not None
            tar.addfile(_tarinfo(s.member, s.size, now), io.BytesIO(s.data))


def _publish(tmp: str, directory: Path, now: float, name_hint: str) -> str:
    """Give ``tmp`` its final, unique name without ever overwriting a file."""
    for n in range(1, 1000):
        name = archive_name(now, name_hint, n)
        final = directory / name
        try:
            os.link(tmp, final)
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if final.exists():  # no hard links here: check, then replace
                continue
            os.replace(tmp, final)
            return name
        os.unlink(tmp)
        return name
    raise FileExistsError(errno.EEXIST, f"no free archive name for {name_hint!r} at {now}")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_archive(
    archive_dir: str | Path,
    name_hint: str,
    parts: Mapping[str, Part],
    summary: str,
    *,
    now: float | None = None,
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
) -> ArchiveInfo:
    """Write a postmortem bundle and return its :class:`ArchiveInfo`.

    ``parts`` maps member names (plain file names such as ``"container.log"``)
    to content: ``bytes`` and ``str`` (UTF-8) are written as given; a ``Path``
    is read — its last ``max_part_bytes`` bytes, streamed — and a path that
    cannot be read becomes a member ``NAME.missing`` holding the error text, as
    does a :class:`Missing` (a part the caller could not gather) with its reason.
    ``summary.txt`` is always the first member; notes about truncated or
    missing parts are appended to it. ``now`` (UTC epoch s) names the file and
    stamps the members (default: the current time). The directory is created
    (mode 0750) if missing; the file has mode 0640.

    Raises:
        InvalidInput: a part name is not a plain file name, or is ``summary.txt``;
            a part value is not bytes, str or a Path. Nothing is written.
        OSError: the directory cannot be created or written (disk full …); no
            file is left behind under any name.
    """
    for name in parts:
        if not _MEMBER_RE.match(name) or name == SUMMARY_MEMBER or ".." in name:
            raise InvalidInput("parts", name, "plain file names like 'container.log', not summary.txt")
    for name, value in parts.items():
        if not isinstance(value, bytes | str | PurePath | Missing):
            raise InvalidInput(f"parts[{name!r}]", type(value).__name__, "bytes, str, a Path or Missing")
    now = time.time() if now is None else now
    directory = Path(archive_dir)
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)

    sources: list[_Source] = []
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as raw:
            os.fchmod(raw.fileno(), FILE_MODE)
            for n, v in parts.items():
                sources.append(_open_part(n, v, max_part_bytes))
            with tarfile.open(fileobj=raw, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
                _write_members(tar, summary, sources, now)
            raw.flush()
            os.fsync(raw.fileno())
        name = _publish(tmp, directory, now, name_hint)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        for s in sources:
            if s.fobj is not None:
                s.fobj.close()
    _fsync_dir(directory)
    path = (directory / name).resolve()
    st = path.stat()
    log.info("wrote archive %s (%d bytes)", path, st.st_size)
    _written[str(path)] = time.monotonic()
    while len(_written) > WRITTEN_KEPT:
        del _written[next(iter(_written))]
    return ArchiveInfo(name, path, st.st_size, st.st_mtime)


#: The archives this process wrote: absolute path -> ``time.monotonic()`` of the write. ``list_archives`` orders them
#: by it, newest of all: after the wall clock stepped back, the postmortem just written had the oldest mtime and was
#: pruned first (helper-43). At most ``WRITTEN_KEPT`` (the oldest are forgotten first).
_written: dict[str, float] = {}
WRITTEN_KEPT = 1000


# --------------------------------------------------------------------------- read side


def list_archives(archive_dir: str | Path) -> list[ArchiveInfo]:
    """Bundles in ``archive_dir``, newest first: those this process wrote in the order written (``_written``), then
    the others by mtime, then name.

    Only regular files named like sparkd's bundles are listed: temp files,
    symlinks, directories and foreign files are ignored. A missing directory
    gives ``[]``.
    """
    directory = Path(archive_dir)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out: list[ArchiveInfo] = []
    for name in names:
        if not _NAME_RE.match(name):
            continue
        try:
            st = os.lstat(directory / name)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append(ArchiveInfo(name, (directory / name).absolute(), st.st_size, st.st_mtime))
    # the ones this process wrote are the newest, in the order written (monotonic): a wall clock stepped back gave the
    # latest an old mtime (helper-43); the others by mtime
    base = directory.resolve()

    def age(a: ArchiveInfo) -> tuple[bool, float, str]:
        mine = _written.get(str(base / a.name))
        return mine is not None, a.created if mine is None else mine, a.name

    out.sort(key=age, reverse=True)
    return out


def safe_archive_path(archive_dir: str | Path, name: str) -> Path:
    """Resolve a requested download ``name`` to a bundle inside ``archive_dir``.

    Accepts only a plain name ending in ``.tar.gz`` (letters, digits, ``._-``)
    that exists as a regular file — not a symlink — directly in the directory.

    Raises:
        NotFound: for everything else (``../x``, absolute paths, symlinks,
            other suffixes, missing files); the message does not say which.
    """
    refused = NotFound(f"no archive named {name!r}", detail={"name": str(name)})
    if not isinstance(name, str) or not _SAFE_NAME_RE.match(name) or ".." in name:
        raise refused
    base = Path(archive_dir).resolve()
    candidate = base / name
    try:
        st = os.lstat(candidate)
    except OSError:
        raise refused from None
    if not stat.S_ISREG(st.st_mode) or candidate.resolve().parent != base:
        raise refused
    return candidate


def open_archive(archive_dir: str | Path, name: str) -> BinaryIO:
    """Open a bundle for download without a check-then-open race.

    Validates like :func:`safe_archive_path`, then opens with ``O_NOFOLLOW``
    relative to the directory and re-checks that it is a regular file.

    Raises:
        NotFound: as :func:`safe_archive_path`.
    """
    path = safe_archive_path(archive_dir, name)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        raise NotFound(f"no archive named {name!r}", detail={"name": name}) from None
    finally:
        os.close(dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotFound(f"no archive named {name!r}", detail={"name": name})
    return os.fdopen(fd, "rb")


#: at most this much of ``summary.txt`` is read to tell an archive's kind (a summary is ~2 KiB)
SUMMARY_READ_BYTES = 64 * 1024


def requested_by(path: str | Path) -> str | None:
    """The ``requested by:`` line of a bundle's ``summary.txt`` (who asked for the stop: ``rule low-available``,
    ``api:token`` …; every release writes it, 0.1 too), or None when the bundle cannot be read or has no such line.
    Reads the first member only, at most ``SUMMARY_READ_BYTES``."""
    try:
        with tarfile.open(path, "r:gz") as tf:
            first = tf.next()
            if first is None or first.name != SUMMARY_MEMBER or not first.isfile():
                return None
            f = tf.extractfile(first)
            text = f.read(SUMMARY_READ_BYTES).decode("utf-8", "replace") if f is not None else ""
    except (OSError, tarfile.TarError, EOFError):
        return None
    for line in text.splitlines():
        if line.startswith("requested by:"):
            return line.partition(":")[2].strip()
    return None


def is_incident_archive(info: ArchiveInfo) -> bool:
    """Whether a bundle is an incident's postmortem (``core.supervision.is_incident`` of its ``requested by:``:
    a rule, the hard floor, the probe, a peer, a failed launch …). One that cannot be told (unreadable, no such
    line) counts as an incident: kept longer, never pruned first."""
    source = requested_by(info.path)
    return source is None or is_incident(source)


#: A temp file of an archive not written for this long is left by a write that never finished (sparkd killed or the
#: host frozen mid-write): removed at retention time (``remove_stale_temps``).
STALE_TEMP_S = 3600.0


def remove_stale_temps(
    archive_dir: str | Path, *, now: float | None = None, older_s: float = STALE_TEMP_S
) -> list[str]:
    """Delete sparkd's own temp files (``.sparkd-tmp-*.tmp``, regular files only) in ``archive_dir`` not modified for
    ``older_s``: a kill or a freeze during an archive's write left them, uncounted by the caps and never removed
    (helper-53). Returns the removed names; a missing directory gives ``[]``."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(os.scandir(archive_dir))
    except FileNotFoundError:
        return removed
    for e in entries:
        if not (e.name.startswith(_TMP_PREFIX) and e.name.endswith(".tmp")):
            continue
        try:
            if not e.is_file(follow_symlinks=False) or now - e.stat(follow_symlinks=False).st_mtime < older_s:
                continue
            os.unlink(e.path)
        except FileNotFoundError:
            continue
        except OSError as err:
            log.warning("could not remove the stale temp file %s: %s", e.name, err)
            continue
        removed.append(e.name)
    return removed


def prune_archives(
    archive_dir: str | Path,
    *,
    max_count: int,
    max_total_bytes: int,
    incident: Callable[[ArchiveInfo], bool] = is_incident_archive,
) -> list[str]:
    """Delete bundles until at most ``max_count`` remain and they total at most ``max_total_bytes``: the oldest
    **routine** one first (an operator's stop, restart or resize, a maintenance drain, sparkd's own exit), and
    the oldest incident one (``incident``: a trip's postmortem) only when no routine one is left. A tuning
    session of resizes pushed last week's trip postmortem out before (note 12). The newest is never deleted
    (even if it alone exceeds the size limit). Old and new are ``list_archives``' order. When an incident's bundle
    must go for the size cap, the routine ones its removal leaves room for are kept (newest first). Each bundle's
    kind is read (its summary's first lines) only when something must go. Returns the removed names, in the order
    removed.

    Raises:
        InvalidInput: ``max_count`` < 1 or ``max_total_bytes`` < 0.
    """
    if max_count < 1:
        raise InvalidInput("max_count", max_count, "an integer >= 1")
    if max_total_bytes < 0:
        raise InvalidInput("max_total_bytes", max_total_bytes, "bytes >= 0")
    archives = list_archives(archive_dir)  # newest first
    total = sum(a.size_bytes for a in archives)
    count = len(archives)
    if count <= 1 or (count <= max_count and total <= max_total_bytes):
        return []
    older = archives[1:]  # the newest is kept whatever it is
    kinds = {a.name: incident(a) for a in older}
    # oldest routine first, then oldest incident: the order of removal
    order = [a for a in reversed(older) if not kinds[a.name]] + [a for a in reversed(older) if kinds[a.name]]
    plan: list[ArchiveInfo] = []
    for victim in order:
        if count <= max_count and total <= max_total_bytes:
            break
        plan.append(victim)
        count, total = count - 1, total - victim.size_bytes
    # an incident that had to go for the size cap may leave room for routine ones planned before it: those are
    # kept, newest first (a single large postmortem must not take every routine bundle with it)
    if any(kinds[a.name] for a in plan):
        newest_first = {a.name: i for i, a in enumerate(archives)}
        for spared in sorted((a for a in plan if not kinds[a.name]), key=lambda a: newest_first[a.name]):
            if count + 1 <= max_count and total + spared.size_bytes <= max_total_bytes:
                plan.remove(spared)
                count, total = count + 1, total + spared.size_bytes
    removed: list[str] = []
    for victim in plan:
        try:
            os.unlink(victim.path)
        except FileNotFoundError:
            pass  # someone else pruned it
        except OSError as e:
            log.warning("could not prune archive %s: %s", victim.name, e)
            continue
        else:
            removed.append(victim.name)
    return removed


def samples_to_csv(rows: Iterable[Mapping[str, object]]) -> str:
    """Rows of samples → CSV text. The header is the union of the keys in
    first-seen order; a missing key or ``None`` is an empty cell. ``[]`` → ``""``."""
    rows = list(rows)
    header: dict[str, None] = {}
    for row in rows:
        header.update(dict.fromkeys(row))
    if not header:
        return ""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(header), restval="", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()
