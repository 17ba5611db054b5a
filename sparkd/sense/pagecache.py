"""How much of a file (or a checkpoint directory) sits in the page cache, via ``mincore(2)``.

``cached_bytes(path) -> (cached_bytes, total_bytes)``: each regular file under ``path``
is mapped read-only (no page is faulted in by ``mincore``) and its resident pages are
counted — what util-linux's ``fincore`` reports. Files that cannot be opened or mapped
are skipped. Used by the launch preflight ("how much of the model directory is cached")
and to check an eviction.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_libc.mincore.restype = ctypes.c_int
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = os.sysconf("SC_PAGE_SIZE")


def files_under(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Regular files under ``path`` (itself if a file); directory symlinks are not followed."""
    p = Path(path)
    if p.is_file():
        yield p
        return
    for root, _dirs, names in os.walk(p, followlinks=False):
        for n in names:
            f = Path(root, n)
            if f.is_file():
                yield f


def file_cached_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(cached, size)`` in bytes for one file. Raises OSError when it cannot be opened or mapped."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(path))
            resident = sum(b & 1 for b in bytes(vec))
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * PAGE, size), size


def cached_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(cached, total)`` bytes over every regular file under ``path``; unreadable files are skipped."""
    cached = total = 0
    for f in files_under(path):
        try:
            c, s = file_cached_bytes(f)
        except OSError:
            continue  # ignoring: not ours to read, or not mappable
        cached += c
        total += s
    return cached, total
