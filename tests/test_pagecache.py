"""Checkpoint eviction and page-cache accounting on real files (mincore, posix_fadvise)."""

from __future__ import annotations

import os
from pathlib import Path

from sparkd.act.pagecache import drop_clean_cache, evict
from sparkd.sense.pagecache import cached_bytes, file_cached_bytes
from sparkd.units import MiB


def _write(path: Path, size: int) -> None:
    with open(path, "wb") as fh:
        fh.write(os.urandom(1024) * (size // 1024))
        fh.flush()
        os.fsync(fh.fileno())  # clean pages: DONTNEED drops only clean ones


def _read(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(1 << 20):
            pass


def test_it_evicts_a_cached_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "model"
    ckpt.mkdir()
    for i in range(2):
        _write(ckpt / f"model-0000{i + 1}-of-00002.safetensors", 32 * MiB)
        _read(ckpt / f"model-0000{i + 1}-of-00002.safetensors")
    cached, total = cached_bytes(ckpt)
    assert total == 64 * MiB
    assert cached >= 60 * MiB  # just read: (nearly) all of it is in the page cache
    rep = evict(ckpt)
    assert rep.files == 2 and rep.errors == []
    assert rep.cached_before_bytes >= 60 * MiB
    assert rep.evicted_bytes >= 60 * MiB
    assert cached_bytes(ckpt)[0] <= 4 * MiB  # gone from the cache


def test_reading_brings_it_back_and_accounting_sees_it(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    _write(f, 8 * MiB)
    evict(f)
    assert file_cached_bytes(f)[0] <= 1 * MiB
    _read(f)
    assert file_cached_bytes(f)[0] >= 7 * MiB


def test_an_unreadable_file_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / "ok.bin").write_bytes(b"x" * 4096)
    os.mkfifo(tmp_path / "fifo")  # not a regular file: skipped
    rep = evict(tmp_path)
    assert rep.files == 1 and rep.total_bytes == 4096


def test_drop_clean_cache_writes_the_kernel_knob(tmp_path: Path) -> None:
    # a scripted proc tree: the real knob needs root and is exercised in tests/test_relief.py
    knob = tmp_path / "sys" / "vm"
    knob.mkdir(parents=True)
    (knob / "drop_caches").write_text("0\n")
    drop_clean_cache(tmp_path)
    assert (knob / "drop_caches").read_text() == "1\n"
