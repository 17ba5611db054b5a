"""The test image itself: fakevllm's /dev/shm entries, never-ready mode, the
OpenAI endpoints. Real engine, real image (``need``: fail in CI when missing)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fvhelpers import Launched

from sparkd.act.docker import ContainerManager
from sparkd.sense.vllm_http import health_check

pytestmark = pytest.mark.docker
pytest_plugins = ["dockerkit"]

SHM = Path("/dev/shm")
SHM_PATTERNS = [  # the names public reports show (tests/fixtures/shm/README.md)
    r"psm_[0-9a-f]+",
    r"nccl-[0-9a-f]{6}",
    r"sem\.loky-.+",
    r"VLLM_OBJECT_STORAGE_SHM_BUFFER_.+",
    r"vllm_offload_[0-9a-f-]{36}\.mmap",
]


@pytest.fixture
def shm_names() -> Iterator[list[str]]:
    """Names the test's containers created in the host /dev/shm; removed afterwards
    (only these exact names: fakevllm made them for this test)."""
    names: list[str] = []
    yield names
    for n in names:
        with contextlib.suppress(FileNotFoundError):
            (SHM / n).unlink()


def test_it_leaves_shm_entries_behind_when_killed(mgr: ContainerManager, launcher: Any, shm_names: list[str]) -> None:
    fv: Launched = launcher()
    assert fv.wait_healthy()
    names = fv.post("/shm?n=5&kib=64")["names"]
    shm_names.extend(names)
    for name, pattern in zip(names, SHM_PATTERNS, strict=True):
        assert re.fullmatch(pattern, name), name
        assert (SHM / name).exists()  # --ipc host: the host's /dev/shm
    assert (SHM / names[0]).stat().st_size == 64 * 1024
    assert (SHM / names[1]).stat().st_size == 0  # NCCL's are often empty
    mgr.kill(fv.id)
    assert all((SHM / n).exists() for n in names)  # the runtime had no time to clean up


def test_it_cleans_shm_on_graceful_exit_only_when_asked(
    mgr: ContainerManager, launcher: Any, shm_names: list[str]
) -> None:
    keeps = launcher()
    cleans = launcher(env={"FAKEVLLM_SHM_CLEANUP": "1"})
    assert keeps.wait_healthy() and cleans.wait_healthy()
    kept = keeps.post("/shm?n=2")["names"]
    cleaned = cleans.post("/shm?n=2")["names"]
    shm_names.extend(kept + cleaned)
    assert mgr.stop(keeps.id, timeout_s=5).exit_code == 0
    assert mgr.stop(cleans.id, timeout_s=5).exit_code == 0
    assert all((SHM / n).exists() for n in kept)
    assert not any((SHM / n).exists() for n in cleaned)


def test_it_never_becomes_ready_in_never_ready_mode(launcher: Any) -> None:
    fv: Launched = launcher(mode="never-ready", startup_s=0.2)
    assert wait_answering(fv)
    time.sleep(1.0)
    res = health_check(fv.port)
    assert res.status_code == 503 and not res.ok


def test_it_serves_models_and_completions_behind_an_api_key(launcher: Any) -> None:
    fv: Launched = launcher(env={"VLLM_API_KEY": "sekret"}, args=["--some-new-flag", "x"])
    assert fv.wait_healthy()
    assert httpx.get(fv.url("/v1/models"), timeout=5).status_code == 401
    auth = {"Authorization": "Bearer sekret"}
    models = httpx.get(fv.url("/v1/models"), headers=auth, timeout=5).json()
    assert models["data"][0]["id"] == "/models/fake"
    body = {"model": "/models/fake", "prompt": "hello there", "max_tokens": 16}
    r = httpx.post(fv.url("/v1/completions"), json=body, headers=auth, timeout=5)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 16
    assert "--some-new-flag" in fv.get_json("/state")["unknown_args"]


def wait_answering(fv: Launched, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if health_check(fv.port, timeout_s=1).status_code is not None:
            return True
        time.sleep(0.1)
    return False
