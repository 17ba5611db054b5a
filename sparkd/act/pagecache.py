"""Give page cache back: evict a checkpoint before launch, drop clean cache as relief.

* ``evict(path) -> EvictReport``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every regular
  file under ``path`` (no root needed; dirty pages are not dropped). The source project
  evicts a freshly written checkpoint before launch, because its page cache caused an
  out-of-memory in the middle of weight loading (CONTEXT.md "Who holds the memory").
* ``drop_clean_cache(proc_root)``: writes ``1`` to ``<proc_root>/sys/vm/drop_caches``
  (root only): the kernel drops clean page cache. The source project's watchdog does this
  once, rate-limited, before stopping on a MemFree rule (CONTEXT.md "Relief").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sparkd.sense.pagecache import cached_bytes, file_cached_bytes, files_under


@dataclass
class EvictReport:
    """``evicted_bytes``: cached bytes before minus after; ``files``: files advised; ``errors``: per file."""

    cached_before_bytes: int = 0
    cached_after_bytes: int = 0
    total_bytes: int = 0
    files: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def evicted_bytes(self) -> int:
        return max(0, self.cached_before_bytes - self.cached_after_bytes)

    def to_json(self) -> dict[str, object]:
        return {
            "cached_before_bytes": self.cached_before_bytes,
            "cached_after_bytes": self.cached_after_bytes,
            "evicted_bytes": self.evicted_bytes,
            "total_bytes": self.total_bytes,
            "files": self.files,
            "errors": self.errors[:10],
        }


def evict(path: str | os.PathLike[str]) -> EvictReport:
    """Advise the kernel to drop every file under ``path`` from the page cache; measure before and after."""
    rep = EvictReport()
    for f in files_under(path):
        try:
            before, size = file_cached_bytes(f)
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            after, _ = file_cached_bytes(f)
        except OSError as exc:
            rep.errors.append(f"{f}: {exc.strerror or exc}")
            continue
        rep.files += 1
        rep.total_bytes += size
        rep.cached_before_bytes += before
        rep.cached_after_bytes += after
    return rep


def drop_clean_cache(proc_root: str | os.PathLike[str] = "/proc") -> None:
    """Ask the kernel to drop clean page cache (``echo 1 > /proc/sys/vm/drop_caches``).

    Raises OSError (e.g. PermissionError when not root). Blocks while the kernel
    reclaims: call it from a worker thread with a time limit.
    """
    Path(proc_root, "sys", "vm", "drop_caches").write_text("1\n")


__all__ = ["EvictReport", "cached_bytes", "drop_clean_cache", "evict"]
