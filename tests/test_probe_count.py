"""The completion probe's count of failures in a row belongs to one run of the model.

It went on across runs: four failures of a run that died and one of its successor's (a slow first request after
its load) made "5 completion probes failed", an emergency stop counted toward the breaker (helper-51). The probe's
HTTP calls are stubs here (the edge: a model failing on cue); ``Unattended.probe`` and the supervisor's
``_take_run`` are the real ones. The real probes against a served model: ``test_e2e_unattended.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import sparkd.loop.unattended as un
from sparkd.config import load_settings
from sparkd.core.lifecycle import Observation
from sparkd.core.supervision import ProbeVerdict
from sparkd.loop.supervisor import Supervisor
from sparkd.sense.vllm_http import CompletionProbe, HealthResult


def test_a_new_run_counts_its_failed_completion_probes_from_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path),
            "container": {"guard": "vllm"},
            "supervision": {"probe_interval_s": 0.001, "probe_failures": 5},
        }
    )
    sup = Supervisor(settings)
    events: list[tuple[str, str]] = []
    stops: list[str] = []
    sup._event = lambda kind, message, **kw: events.append((kind, message))  # type: ignore[method-assign]

    async def emergency_stop(source: str, reason: str) -> None:
        stops.append(reason)

    sup.emergency_stop = emergency_stop  # type: ignore[method-assign]
    sup._follow_logs = lambda: None  # type: ignore[method-assign]  # no engine to read a log from
    bad = CompletionProbe(ProbeVerdict(False, "HTTP 503"), 0.1, "m")
    monkeypatch.setattr(un, "completion_probe", lambda *a, **k: bad)
    monkeypatch.setattr(un, "health_check", lambda *a, **k: HealthResult(503, False, "HTTP 503", 0.01))

    async def probes(n: int) -> None:
        for _ in range(n):
            await sup.unattended.probe(ready=True, requests_waiting=None, startup_phase=None)
            await asyncio.sleep(0.002)
        if sup._bg is not None:
            await sup._bg

    async def go() -> None:
        sup.container_id = "a" * 64
        # its successor: launched by sparkd itself (``_launched``, a relaunch), or a run sparkd takes as it finds it
        # (``_take_run``: adopted, started outside sparkd). The first was missed (helper-52)
        for n, take in enumerate(("launched", "taken"), start=1):
            await probes(4)  # the run before: four failures, under the limit
            sup.container_id = f"{n}" * 64
            if take == "launched":
                await sup._launched("sparkd (relaunch)", 1.0e9)
            else:
                await sup._take_run(Observation(running=True, started_at=1.0e9, name="vllm"), first_sight=False)
            await probes(1)
            assert stops == [], (take, stops)  # one failure of its own
            failed = [m for k, m in events if k == "probe_failed"]
            assert failed[-1].startswith("completion probe failed (1): "), (take, failed)
            await probes(4)  # five of its own: the emergency stop, as ever
            assert len(stops) == 1 and stops[0].startswith("5 completion probes failed"), (take, stops)
            stops.clear()

    asyncio.run(go())
