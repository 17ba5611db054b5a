"""A user's clone stands alone: no sibling folders, every test collected, every fixture inside.

The repository is cloned (committed state, as CI and users get it) into a temporary
directory with nothing beside it; pytest collects the same tests there as here, and the
modules that read fixtures pass there with no skip for a missing file.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def _collect(cwd: Path) -> set[str]:
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {ln for ln in r.stdout.splitlines() if "::" in ln}


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("git and a git checkout are needed to clone the repository")
    dest = tmp_path_factory.mktemp("lonely") / "sparkd"
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True, timeout=120)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["sparkd"]  # nothing beside the clone
    return dest


def test_it_collects_every_test_in_a_clone_with_no_siblings(clone: Path) -> None:
    here, there = _collect(REPO), _collect(clone)
    tracked = set(subprocess.run(["git", "ls-files", "tests"], cwd=REPO, capture_output=True, text=True).stdout.split())
    # tests in files that are not committed yet exist only here; everything committed is collected there
    here = {t for t in here if t.split("::")[0] in tracked}
    assert here - there == set()
    assert len(there) > 500


def test_nothing_reads_outside_the_repository(clone: Path) -> None:
    offenders = []
    for path in [
        *clone.glob("tests/*.py"),
        *clone.rglob("sparkd/**/*.py"),
        *clone.glob("bench/*.py"),
        clone / "README.md",
    ]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.\./shared|parent / \"shared\"", line):
                offenders.append(f"{path.relative_to(clone)}:{n}: {line.strip()}")
    assert offenders == []


def test_fixture_reading_tests_pass_in_the_clone_without_skips(clone: Path) -> None:
    modules = sorted(
        p.relative_to(clone).as_posix()
        for p in clone.glob("tests/test_*.py")
        if re.search(r"\bfixture\(|FIXTURES\b", p.read_text()) and p.name != "test_standalone.py"
    )
    assert len(modules) >= 5, modules
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "not docker and not browser",
            *modules,
        ],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    skipped = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED") and "fixture" in ln.lower()]
    assert skipped == []
