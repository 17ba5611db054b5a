"""A real ``sparkd run`` (API on) managing fakevllm containers on the real engine.

``SparkdUnderTest`` writes a config for this test (its own state dir, API port,
container name, the test's case labels as the container selector), starts the
daemon, and talks to its API with the token it generated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from fvhelpers import free_port
from sparkdproc import db_query, wait_for

from sparkd.loop.status import Status


def unreadable_pids() -> list[int]:
    """PIDs whose /proc/PID/maps even root cannot read here (a sandbox's init)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/maps"):
                    pass
            except PermissionError:
                out.append(int(d))
            except OSError:
                pass
    return out


def toml_value(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {toml_value(x)}' for k, x in v.items()) + " }"
    return json.dumps(v)


class SparkdUnderTest:
    def __init__(
        self,
        tmp_path: Path,
        image: str,
        labels: dict[str, str],
        *,
        container: dict[str, Any] | None = None,
        top: dict[str, Any] | None = None,
        budget: dict[str, Any] | None = None,
        rules: list[dict[str, Any]] | None = None,
        sections: dict[str, dict[str, Any]] | None = None,
        extra_toml: str = "",
    ) -> None:
        self.tmp = tmp_path
        self.api_port = free_port()
        self.vllm_port = free_port()
        self.name = f"sparkd-test-{labels['sparkd.test.case']}"
        c = {
            "image": image,
            "name": self.name,
            "port": self.vllm_port,
            "health_interval_s": 0.3,
            "gpu": "off",
            "memory": "3GiB",
            "selector": labels,
            "env": {"FAKEVLLM_STARTUP_S": "0.5"},
            **(container or {}),
        }
        t = {
            "state_dir": str(tmp_path),
            "log_dir": str(tmp_path / "logs"),
            "interval_s": 0.25,
            "fast_interval_s": 0.25,
            "kernlog_source": "off",
            "shm_ignore_unreadable_pids": unreadable_pids(),
            **(top or {}),
        }
        lines = [f"{k} = {toml_value(v)}" for k, v in t.items()]
        lines += ["[api]", f"port = {self.api_port}", "[container]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in c.items() if v is not None]
        if budget:
            lines += ["[budget]"] + [f"{k} = {toml_value(v)}" for k, v in budget.items()]
        for name, values in (sections or {}).items():  # e.g. {"supervision": {...}, "notify": {...}}
            lines += [f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()]
        for r in rules or []:
            lines += ["[[rules]]"] + [f"{k} = {toml_value(v)}" for k, v in r.items()]
        self.config = tmp_path / "sparkd.toml"
        self.config.write_text("\n".join(lines) + "\n" + extra_toml)
        self.db = tmp_path / "sparkd.db"
        self.proc: subprocess.Popen[str] | None = None

    # ---------------------------------------------------------------- process
    def start(self) -> SparkdUnderTest:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_") and k != "NOTIFY_SOCKET"}
        self.log = open(self.tmp / "sparkd.out", "a")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sparkd.face.cli", "--config", str(self.config), "run"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert wait_for(self._healthz, 20), f"sparkd did not come up: {self.output()[-2000:]}"
        return self

    def _healthz(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.api_port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc else None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def output(self) -> str:
        return (self.tmp / "sparkd.out").read_text() if (self.tmp / "sparkd.out").exists() else ""

    # ---------------------------------------------------------------- API
    @property
    def token(self) -> str:
        return (self.tmp / "token").read_text().strip()

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(
            method,
            f"http://127.0.0.1:{self.api_port}{path}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=kw.pop("timeout", 120),
            **kw,
        )

    def cli(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """``sparkd --config CFG ARGS...`` as an operator runs it, against this daemon."""
        return subprocess.run(
            [sys.executable, "-m", "sparkd.face.cli", "--config", str(self.config), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def status(self) -> dict[str, Any]:
        """``/api/status`` as JSON, checked against the contract (``Status``) on every call."""
        r = httpx.get(f"http://127.0.0.1:{self.api_port}/api/status", timeout=5)
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        Status.model_validate(body)  # a daemon that drifts from the contract fails here
        return body

    def container(self) -> dict[str, Any]:
        return self.status()["container"]  # type: ignore[no-any-return]

    def wait_state(self, state: str, timeout_s: float = 60) -> dict[str, Any]:
        assert wait_for(lambda: self.container().get("state") == state, timeout_s), (
            f"container never {state}: {self.container()}\n{self.output()[-3000:]}"
        )
        return self.container()

    def events(self, kind: str) -> list[dict[str, Any]]:
        rows = db_query(self.db, "SELECT ts, message, details, severity FROM events WHERE kind=? ORDER BY id", (kind,))
        return [
            {"ts": r[0], "message": r[1], "details": json.loads(r[2]) if r[2] else None, "severity": r[3]} for r in rows
        ]

    def wait_event(self, kind: str, timeout_s: float = 60, *, nth: int = 1) -> dict[str, Any]:
        """The newest ``kind`` event once there are at least ``nth`` of them (waited up to ``timeout_s``)."""
        got = wait_for(lambda: len(self.events(kind)) >= nth and self.events(kind), timeout_s)
        assert got, f"no {kind} event #{nth} within {timeout_s} s\n{self.output()[-3000:]}"
        return got[-1]  # type: ignore[no-any-return]

    def vllm(self, method: str, path: str) -> Any:
        r = httpx.request(method, f"http://127.0.0.1:{self.vllm_port}{path}", timeout=30)
        r.raise_for_status()
        return r.json()


def now() -> float:
    return time.time()
