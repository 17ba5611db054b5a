"""``bench/ab.py`` compares two versions in one window: it must run the version it names, not the
checkout it sits in (``python -m`` puts the working directory first on ``sys.path``)."""

from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "ab.py"


def _ab() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_ab", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_revision_runs_from_its_own_tree_not_the_checkout(tmp_path: Path) -> None:
    ab = _ab()
    tree = ab.extract("HEAD", tmp_path / "tree")
    assert (tree / "sparkd" / "__init__.py").is_file() and (tree / "migrations").is_dir()
    # from a directory outside any checkout, PYTHONPATH decides
    assert ab.resolved_package(tree, str(tmp_path)) == (tree / "sparkd").resolve()
    # from the checkout itself the checkout wins: the reason ab.py never runs daemons there
    assert ab.resolved_package(tree, str(ab.REPO)) == (ab.REPO / "sparkd").resolve()


def test_a_directory_holding_a_tree_is_taken_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ab = _ab()
    tree = ab.extract("HEAD", tmp_path / "carried")
    assert ab.extract(str(tree), tmp_path / "unused") == tree.resolve()
    assert not (tmp_path / "unused").exists()
    with pytest.raises(SystemExit, match="nothing"):  # a directory without a sparkd package is no tree
        (tmp_path / "nothing").mkdir()
        ab.extract(str(tmp_path / "nothing"), tmp_path / "x")
    # a name without a slash is a revision, even where a directory of that name holds a tree
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="carried"):
        ab.extract("carried", tmp_path / "y")


def test_an_unknown_revision_is_refused_by_name(tmp_path: Path) -> None:
    ab = _ab()
    with pytest.raises(SystemExit, match="no-such-revision"):
        ab.extract("no-such-revision", tmp_path / "tree")


def test_cpu_is_split_between_the_main_thread_and_the_others() -> None:
    ab = _ab()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin)
    t.start()
    try:
        before = ab.per_thread_ns(os.getpid())
        sum(range(200_000))
        stop.wait(0.05)
        after = ab.per_thread_ns(os.getpid())
    finally:
        stop.set()
        t.join()
    assert after["main"] > before["main"]
    assert after["other"] > before.get("other", 0)
    assert ab.change_pct(100.0, 90.0) == pytest.approx(-10.0)
