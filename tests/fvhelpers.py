"""Plain helpers for tests that drive fakevllm containers (no fixtures here:
those are in ``dockerkit``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from sparkdproc import free_port, wait_for

from sparkd.sense.vllm_http import health_check

__all__ = ["Launched", "free_port", "wait_for"]


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
