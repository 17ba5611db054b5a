"""Fixtures for tests against the real Docker engine and the fakevllm test image.

Every container a test starts carries ``sparkd.test=1``, ``sparkd.test.run=<this
run>`` and ``sparkd.test.case=<this test>``; the finalizer removes exactly the
containers this test created (by id) plus any left with this test's case label.
Nothing else is ever touched. A test module gets the fixtures with
``pytest_plugins = ["dockerkit"]``.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
from conftest import REPO, need
from fvhelpers import Launched, free_port
from sparkdapi import SparkdUnderTest

from sparkd.act.docker import ContainerManager, LaunchSpec
from sparkd.units import MiB

RUN_ID = uuid.uuid4().hex[:12]
RUN_LABELS = {"sparkd.test": "1", "sparkd.test.run": RUN_ID}
BUILD_SH = REPO / "tests" / "image" / "build.sh"


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A raw SDK client, for test set-up and clean-up only."""
    try:
        client = docker.from_env(version="auto", timeout=30)
        client.ping()
    except docker.errors.DockerException as e:
        need(False, f"Docker engine not reachable ({e}); run scripts/setup-test-env")
    yield client
    client.close()


@pytest.fixture(scope="session")
def image(docker_client: Any) -> str:
    """``sparkd-test-vllm:<hash of tests/image>``: the image for this checkout."""
    tag = subprocess.run([str(BUILD_SH), "--tag"], capture_output=True, text=True, check=True)
    name = tag.stdout.strip()
    try:
        docker_client.images.get(name)
    except docker.errors.ImageNotFound:
        need(False, f"test image {name} missing; run scripts/setup-test-env")
    return name


@pytest.fixture
def case_labels() -> dict[str, str]:
    return {**RUN_LABELS, "sparkd.test.case": uuid.uuid4().hex[:12]}


@pytest.fixture
def mgr(docker_client: Any, case_labels: dict[str, str]) -> ContainerManager:
    """A manager whose selector is this test's labels: it sees only this test's containers."""
    return ContainerManager(selector=case_labels, api_timeout_s=30)


@pytest.fixture
def launcher(
    mgr: ContainerManager, image: str, docker_client: Any, case_labels: dict[str, str]
) -> Iterator[Callable[..., Launched]]:
    """``launcher(mode="graceful", env={}, startup_s=0.3, mem_limit_bytes=256 MiB,
    args=[], managed=True, name=None, port=None)`` starts a fakevllm container on a free host port, or ``port``
    (``name``: its name, else a fresh ``sparkd-test-<run>-<uuid>``)."""
    created: list[str] = []

    def launch(
        mode: str = "graceful",
        env: dict[str, str] | None = None,
        startup_s: float = 0.3,
        mem_limit_bytes: int = 256 * MiB,
        args: list[str] | None = None,
        managed: bool = True,
        name: str | None = None,
        port: int | None = None,
    ) -> Launched:
        port = port or free_port()
        name = name or f"sparkd-test-{RUN_ID}-{uuid.uuid4().hex[:8]}"
        command = ["serve", "/models/fake", "--port", str(port), "--gpu-memory-utilization",
                   "0.786", "--max-model-len", "32768", "--shutdown-timeout", "25",
                   *(args or [])]  # fmt: skip
        environment = {"FAKEVLLM_MODE": mode, "FAKEVLLM_STARTUP_S": str(startup_s), **(env or {})}
        if managed:
            spec = LaunchSpec(image=image, name=name, command=command, environment=environment,
                              port=port, mem_limit_bytes=mem_limit_bytes, gpu=False)  # fmt: skip
            cid = mgr.launch(spec, launch_id=f"test-{uuid.uuid4().hex[:6]}", revision=1)
        else:  # an operator's hand-started container: test labels, no sparkd.managed
            c = docker_client.containers.run(
                image, command, name=name, environment=environment, labels=case_labels,
                network_mode="host", ipc_mode="host", detach=True)  # fmt: skip
            cid = c.id
        created.append(cid)
        return Launched(cid, name, port)

    yield launch

    ids = set(created)
    for c in docker_client.containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in case_labels.items()]}):
        ids.add(c.id)  # carries this test's unique case label: ours
    for cid in ids:
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.containers.get(cid).remove(force=True)


@pytest.fixture
def sparkd_factory(
    tmp_path: Path, image: str, case_labels: dict[str, str], docker_client: Any, launcher: Any
) -> Iterator[Callable[..., SparkdUnderTest]]:
    """``sparkd_factory(**kw)`` → a ``SparkdUnderTest`` (real ``sparkd run`` with its API) in its own state dir;
    stopped when the test ends."""
    made: list[SparkdUnderTest] = []

    def make(**kw: Any) -> SparkdUnderTest:
        (tmp_path / f"s{len(made)}").mkdir(exist_ok=True)
        s = SparkdUnderTest(tmp_path / f"s{len(made)}", image, case_labels, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def make(sparkd_factory: Callable[..., SparkdUnderTest]) -> Callable[..., SparkdUnderTest]:
    """``make(**kw)``: ``sparkd_factory(**kw).start()`` — a running sparkd with its API, stopped at the end."""
    return lambda **kw: sparkd_factory(**kw).start()
