"""vLLM's HTTP surface as sparkd reads it: ``GET /health`` and ``GET /metrics``.

* ``health_check``: one ``/health`` probe; never raises, the result says what happened.
* ``read_vllm_metrics``: the request gauges and token counters from ``/metrics``.
* ``parse_vllm_metrics`` (pure): the same from Prometheus text.
* ``progress_stalled`` (pure): "answers /health but makes no progress".

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
