"""vLLM's HTTP surface as sparkd reads it: ``GET /health``, ``GET /metrics``, ``GET /v1/models`` and a
completion probe.

* ``health_check``: one ``/health`` probe; never raises, the result says what happened.
* ``read_vllm_metrics``: the request gauges and token counters from ``/metrics``.
* ``parse_vllm_metrics`` (pure): the same from Prometheus text.
* ``progress_stalled`` (pure): "answers /health but makes no progress".
* ``served_model`` / ``completion_probe``: the served name, and a 16-token completion at temperature 0
  judged by ``core.supervision.judge_completion`` (``/health`` 200 with empty completions is a known
  failure, issue 15).

Counters in prometheus_client's text format come with a ``_created`` sample
(a Unix timestamp) beside ``_total``; reading ``_created`` as a count is a known
mistake (CONTEXT.md, "Serving facts"), so only exact ``_total`` samples count.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sparkd.core.supervision import ProbeVerdict, judge_completion
from sparkd.errors import MetricsUnavailable

# Sample name in /metrics -> key in read_vllm_metrics()'s answer.
VLLM_METRICS: dict[str, str] = {
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
}


@dataclass(frozen=True)
class HealthResult:
    """One ``/health`` probe.

    ``status_code`` is ``None`` when no HTTP answer came (refused, timeout);
    ``ok`` is true only for 200; ``error`` names the failure
    (``"HTTP 503"``, ``"ConnectError: ..."``); ``elapsed_s`` is the probe's wall time.
    """

    status_code: int | None
    ok: bool
    error: str | None
    elapsed_s: float


def _url(host: str, port: int, path: str) -> str:
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{host}:{port}{path}"


def health_check(port: int, host: str = "127.0.0.1", timeout_s: float = 2.0) -> HealthResult:
    """Probe ``http://host:port/health`` once, waiting at most ``timeout_s`` seconds.

    Never raises: connection errors and timeouts come back as
    ``HealthResult(status_code=None, ok=False, error=...)``.
    """
    t0 = time.monotonic()
    try:
        r = httpx.get(_url(host, port, "/health"), timeout=timeout_s)
    except httpx.HTTPError as e:
        return HealthResult(None, False, f"{type(e).__name__}: {e}", time.monotonic() - t0)
    elapsed = time.monotonic() - t0
    ok = r.status_code == 200
    return HealthResult(r.status_code, ok, None if ok else f"HTTP {r.status_code}", elapsed)


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Pick vLLM's request gauges and token counters out of Prometheus text.

    Returns a dict with the keys of ``VLLM_METRICS`` that were present
    (``num_requests_running``, ``num_requests_waiting``, ``generation_tokens_total``,
    ``prompt_tokens_total``); values are summed over label sets (engines, models).
    ``*_created`` samples are never read.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = VLLM_METRICS.get(sample.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def read_vllm_metrics(port: int, host: str = "127.0.0.1", timeout_s: float = 2.0) -> dict[str, float]:
    """Fetch ``http://host:port/metrics`` and return ``parse_vllm_metrics`` of it.

    Raises:
        MetricsUnavailable: no answer within ``timeout_s``, a non-200 status,
            or text that is not Prometheus format.
    """
    url = _url(host, port, "/metrics")
    try:
        r = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise MetricsUnavailable(f"GET {url} failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise MetricsUnavailable(f"GET {url} answered HTTP {r.status_code}")
    try:
        return parse_vllm_metrics(r.text)
    except ValueError as e:
        raise MetricsUnavailable(f"GET {url}: not Prometheus text: {e}") from e


def progress_stalled(prev: Mapping[str, float], cur: Mapping[str, float]) -> bool:
    """True when requests are running or waiting but no token counter advanced.

    ``prev`` and ``cur`` are two ``read_vllm_metrics`` answers, oldest first.
    Work is judged on ``cur`` (running + waiting > 0); progress is
    ``generation_tokens_total`` or ``prompt_tokens_total`` growing. A counter that
    went down (server restarted) or a missing figure is not evidence of a stall:
    the answer is then False.
    """
    keys = ("generation_tokens_total", "prompt_tokens_total")
    if any(k not in prev or k not in cur for k in keys):
        return False
    busy = cur.get("num_requests_running", 0.0) + cur.get("num_requests_waiting", 0.0) > 0
    if not busy:
        return False
    if any(cur[k] < prev[k] for k in keys):
        return False
    return all(cur[k] == prev[k] for k in keys)


@dataclass(frozen=True)
class CompletionProbe:
    """One deep probe: ``/v1/models`` for the served name, then a completion judged by
    ``core.supervision.judge_completion``. ``latency_s``: wall time of the completion request
    (``None`` when it was never sent); ``model``: the served name used; ``tok_s``: completion tokens
    per second of that request (``None`` unless it passed)."""

    verdict: ProbeVerdict
    latency_s: float | None
    model: str | None
    tok_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    def to_json(self) -> dict[str, object]:
        v = self.verdict
        return {
            "ok": v.ok,
            "error": v.error,
            "completion_tokens": v.completion_tokens,
            "finish_reason": v.finish_reason,
            "latency_s": self.latency_s,
            "model": self.model,
            "tok_s": self.tok_s,
        }


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model(port: int, host: str = "127.0.0.1", *, api_key: str | None = None, timeout_s: float = 5.0) -> str:
    """The first model id ``GET /v1/models`` lists (vLLM's ``--served-model-name``).

    Raises:
        MetricsUnavailable: no answer, a non-200 status (401 without the right API key), or no model listed.
    """
    url = _url(host, port, "/v1/models")
    try:
        r = httpx.get(url, headers=_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as e:
        raise MetricsUnavailable(f"GET {url} failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise MetricsUnavailable(f"GET {url} answered HTTP {r.status_code}")
    try:
        data = r.json().get("data") or []
        return str(data[0]["id"])
    except (ValueError, AttributeError, LookupError, TypeError) as e:
        raise MetricsUnavailable(f"GET {url}: no model listed ({type(e).__name__})") from e


def completion_probe(
    port: int,
    host: str = "127.0.0.1",
    *,
    api_key: str | None = None,
    model: str | None = None,
    timeout_s: float = 30.0,
    max_tokens: int = 16,
    prompt: str = "The capital of France is",
) -> CompletionProbe:
    """A ``max_tokens``-token completion at temperature 0 on ``POST /v1/completions`` (issue 15: 16 tokens).

    ``model`` ``None``: asked from ``/v1/models`` first. The API key goes as ``Authorization: Bearer``.
    Never raises: a failure of either request comes back as a failed verdict (``error`` says which).
    """
    try:
        name = model or served_model(port, host, api_key=api_key, timeout_s=min(timeout_s, 10.0))
    except MetricsUnavailable as e:
        return CompletionProbe(ProbeVerdict(False, f"/v1/models: {e.message}"), None, None)
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.monotonic()
    try:
        r = httpx.post(_url(host, port, "/v1/completions"), json=body, headers=_headers(api_key), timeout=timeout_s)
    except httpx.TimeoutException:
        return CompletionProbe(ProbeVerdict(False, f"no answer within {timeout_s:g} s"), time.monotonic() - t0, name)
    except httpx.HTTPError as e:
        return CompletionProbe(ProbeVerdict(False, f"{type(e).__name__}: {e}"), time.monotonic() - t0, name)
    latency = time.monotonic() - t0
    try:
        payload = r.json()
    except ValueError:
        payload = None
    v = judge_completion(r.status_code, payload)
    tok_s = v.completion_tokens / latency if v.ok and v.completion_tokens and latency > 0 else None
    return CompletionProbe(v, latency, name, tok_s)
