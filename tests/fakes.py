"""Typed fakes of the daemon's slow and dangerous edges, checked by mypy like the package.

``FakeActions`` is the container supervisor's control interface without Docker: it
returns the real contract types (``ContainerStatus``, ``ResizeResult``) built from the
real budget formula. mypy checks this module (``scripts/check``; and
``tests/test_status.py`` runs it), so a fake that drifts from ``sparkd.loop.status``
is a type error, not a test that passes against a shape the daemon never sends.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

from sparkd.core.budget import BudgetInputs, make_plan
from sparkd.core.lifecycle import ContainerState
from sparkd.errors import Conflict
from sparkd.loop.status import ContainerStatus, PlanFigures, ResizeResult, diff_figures
from sparkd.units import GiB


class FakeActions:
    """The worked example's plan (CONTEXT.md: GMU 0.786), a ready container, recorded calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.busy: str | None = None
        self.plan_json_missing = False
        self.observed = 0
        self.last_changes: dict[str, Any] = {}
        self.engine: Literal["unknown", "up", "down"] = "up"  # the Docker engine as the supervisor last saw it
        self.engine_error: str | None = None
        self.watch_error: str | None = None  # the supervisor's looks at the container fail (``watch_failing``)
        self.state = ContainerState.READY  # what status_json says
        self.inputs = BudgetInputs(
            mem_total_bytes=int(121.69 * GiB),
            max_model_len=262144,
            kv_bytes_per_token=29482,
            weights_gib=71.75,
            kv_cache_dtype="fp8",
            host_reserve_gib=26.0,
        )
        self.plan = make_plan(self.inputs)

    async def start(self, daemon: Any) -> None:
        return None

    async def on_stop(self, decision: Any) -> None:
        return None

    def on_kernel_record(self, rec: Any) -> None:
        return None

    def observe(self, sample: Any) -> None:
        self.observed += 1

    def fast_reason(self) -> str | None:
        return None

    async def look_now(self) -> None:
        self.calls.append(("look_now", ""))

    async def close(self) -> None:
        return None

    def lifecycle_state(self) -> str:
        return str(self.status_json().state)

    def status_json(self) -> ContainerStatus:
        plan = PlanFigures.model_validate(self.plan.to_json())
        return ContainerStatus(
            mode="managed",
            engine=self.engine,
            engine_error=self.engine_error,
            watch_error=self.watch_error,
            state=self.state,
            health="ok",
            name="sparkd-vllm",
            image="vllm/vllm-openai:v0.9.2",
            gmu=plan.gmu,
            memory_bytes=self.plan.docker_memory_bytes,
            started_at=time.time() - 3600,
            uptime_s=3600.0,
            plan=plan,
            stops_total=2,
        )

    async def request(
        self, action: str, *, source: str, reason: str | None = None, force: bool = False
    ) -> dict[str, Any]:
        if self.busy:
            raise Conflict(f"already {self.busy}")
        self.calls.append((action, source))
        return {"action": action, "accepted": True, "message": f"{action} queued"}

    async def resize(self, changes: dict[str, Any], *, dry_run: bool, source: str) -> ResizeResult:
        new = make_plan(dataclasses.replace(self.inputs, **changes)).to_json()
        old = None if self.plan_json_missing else self.plan.to_json()
        self.calls.append(("resize", source))
        self.last_changes = changes
        return ResizeResult(
            plan=PlanFigures.model_validate(new),
            previous=PlanFigures.model_validate(old) if old else None,
            diff=diff_figures(old, new),
            applied=not dry_run,
            dry_run=dry_run,
        )
