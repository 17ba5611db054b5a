"""Plain helpers for tests that drive fakevllm containers (no fixtures here:
those are in ``dockerkit``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from sparkd.vllmhttp import health_check


def free_port() -> int:
    """A TCP port free on the host right now (containers use the host network)."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()


@dataclass
class Launched:
    id: str
    name: str
    port: int

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str) -> Any:
        r = httpx.post(self.url(path), timeout=10)
        r.raise_for_status()
        return r.json()

    def get_json(self, path: str) -> Any:
        r = httpx.get(self.url(path), timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_healthy(self, timeout_s: float = 20) -> bool:
        return wait_for(lambda: health_check(self.port, timeout_s=1).ok, timeout_s)
