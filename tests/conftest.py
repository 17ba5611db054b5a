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
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture
def anyio_backend() -> str:
    """The event loop ``@pytest.mark.anyio`` tests run on: asyncio (sparkd's loop; anyio would also run trio)."""
    return "asyncio"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need(condition: bool, why: str) -> None:
    """Skip (developer machine) or fail (CI) when ``condition`` is false."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"required in CI but missing: {why}")
    pytest.skip(why)


def fixture(*parts: str) -> Path:
    """Path to a file in tests/fixtures (the public reports' figures, copied from the project's
    shared folder so that a clone stands alone). A missing file is an error, never a skip."""
    p = FIXTURES.joinpath(*parts)
    if not p.exists():
        raise FileNotFoundError(f"test fixture {p} is missing from the repository")
    return p
