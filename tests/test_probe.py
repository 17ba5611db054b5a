"""The completion probe (sense.vllm_http) against the test image's fake vLLM in a real container,
one serving mode at a time: normal, empty completions, hanging completions, /health failing."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from dockerkit import Launched

from sparkd.errors import MetricsUnavailable
from sparkd.sense.vllm_http import completion_probe, health_check, read_vllm_metrics, served_model

pytest_plugins = ["dockerkit"]


def serve(fv: Launched, mode: str) -> None:
    r = httpx.post(fv.url(f"/serve?mode={mode}"), timeout=5)
    assert r.status_code == 200 and r.json()["serve"] == mode


def test_it_passes_a_real_completion_and_reads_the_served_name(launcher: Any) -> None:
    fv: Launched = launcher(args=["--served-model-name", "probe-model"])
    assert fv.wait_healthy()
    p = completion_probe(fv.port)
    # the served name came from /v1/models, and 16 tokens came back with a finish_reason
    assert p.ok and p.model == "probe-model"
    assert p.verdict.completion_tokens == 16 and p.verdict.finish_reason == "length"
    assert p.latency_s is not None and 0 < p.latency_s < 5 and p.tok_s is not None and p.tok_s > 0


def test_it_sends_the_api_key_as_bearer(launcher: Any) -> None:
    fv: Launched = launcher(env={"VLLM_API_KEY": "sekret"})
    assert fv.wait_healthy()
    # without the key: /v1/models answers 401 and the probe says so
    with pytest.raises(MetricsUnavailable, match="401"):
        served_model(fv.port)
    assert not completion_probe(fv.port).ok and "401" in (completion_probe(fv.port).verdict.error or "")
    assert completion_probe(fv.port, api_key="sekret").ok


def test_it_fails_empty_completions_while_health_answers_200(launcher: Any) -> None:
    fv: Launched = launcher(env={"FAKEVLLM_SERVE": "empty"})
    assert fv.wait_healthy()
    assert health_check(fv.port).ok  # /health says all is well ...
    p = completion_probe(fv.port)
    assert not p.ok and "completion_tokens is 0" in (p.verdict.error or "")  # ... the probe knows better


def test_it_fails_a_hanging_completion_after_its_timeout(launcher: Any) -> None:
    fv: Launched = launcher()
    assert fv.wait_healthy()
    serve(fv, "hang")
    t0 = time.monotonic()
    p = completion_probe(fv.port, timeout_s=1.0)
    assert not p.ok and "no answer within 1 s" in (p.verdict.error or "")
    assert 0.9 < time.monotonic() - t0 < 10
    assert health_check(fv.port).ok


def test_it_fails_when_health_and_completions_fail(launcher: Any) -> None:
    fv: Launched = launcher()
    assert fv.wait_healthy()
    serve(fv, "unhealthy")
    h = health_check(fv.port)
    assert h.status_code == 500 and not h.ok
    p = completion_probe(fv.port)
    assert not p.ok and p.verdict.error == "HTTP 500"


def test_it_counts_a_held_request_as_running(launcher: Any) -> None:
    fv: Launched = launcher()
    assert fv.wait_healthy()
    body = {"model": "/models/fake", "prompt": "x", "max_tokens": 4, "fake_hold_s": 2}
    t = threading.Thread(target=httpx.post, args=(fv.url("/v1/completions"),), kwargs={"json": body, "timeout": 10})
    t.start()
    time.sleep(0.5)
    # labelled float series (num_requests_running{engine="0",model_name=...} 1.0) parsed as 1
    assert read_vllm_metrics(fv.port)["num_requests_running"] == 1.0
    t.join(10)
    assert read_vllm_metrics(fv.port)["num_requests_running"] == 0.0
