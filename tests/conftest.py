"""Shared test helpers.

``need(condition, why)``: tests that need Docker, the browser or root skip when
that is missing on a developer machine, but **fail** under CI (``CI=true``),
where ``.ci/run`` must have provided it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"
LOCAL_FIXTURES = REPO / "tests" / "fixtures"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(condition: bool, why: str) -> None:
    """Skip (developer machine) or fail (CI) when ``condition`` is false."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"required in CI but missing: {why}")
    pytest.skip(why)


def shared_fixture(*parts: str) -> Path:
    """Path to a file in ../shared/fixtures (the public reports' figures)."""
    p = SHARED_FIXTURES.joinpath(*parts)
    need(p.exists(), f"shared fixture {p} not present")
    return p


@pytest.fixture
def fixtures_dir() -> Path:
    return SHARED_FIXTURES
