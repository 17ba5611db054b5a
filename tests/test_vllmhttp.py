"""Pure parts: metrics parsing (the ``_created`` trap), stall detection, LaunchSpec
validation, Docker time stamps; and /health against a closed port."""

from __future__ import annotations

import pytest
from fvhelpers import free_port
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from sparkd.act.containerspec import LaunchSpec, epoch_from_docker
from sparkd.errors import InvalidInput
from sparkd.sense.vllm_http import (
    MetricsUnavailable,
    health_check,
    parse_vllm_metrics,
    progress_stalled,
    read_vllm_metrics,
)
from sparkd.units import MiB

# As vLLM 0.11 writes it (prometheus_client text format): counters carry _created.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="flash"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="flash"} 1.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="flash"} 1234.0
vllm:generation_tokens_created{engine="0",model_name="flash"} 1.7594e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="flash"} 56789.0
vllm:prompt_tokens_created{engine="0",model_name="flash"} 1.7594e+09
"""


def test_it_reads_counts_and_never_created_timestamps() -> None:
    assert parse_vllm_metrics(VLLM_TEXT) == {
        "num_requests_running": 3.0,
        "num_requests_waiting": 1.0,
        "generation_tokens_total": 1234.0,
        "prompt_tokens_total": 56789.0,
    }


def test_it_reads_real_prometheus_client_output_with_created_samples() -> None:
    reg = CollectorRegistry()
    gen = Counter("vllm:generation_tokens", "gen", ["engine"], registry=reg)
    run = Gauge("vllm:num_requests_running", "run", ["engine"], registry=reg)
    gen.labels("0").inc(7)
    gen.labels("1").inc(5)  # two engines: summed
    run.labels("0").set(2)
    text = generate_latest(reg).decode()
    assert "vllm:generation_tokens_created" in text  # the trap is really there
    got = parse_vllm_metrics(text)
    assert got == {"generation_tokens_total": 12.0, "num_requests_running": 2.0}


def test_it_returns_only_the_figures_present() -> None:
    assert parse_vllm_metrics("# nothing here\nother_metric 1\n") == {}


@pytest.mark.parametrize(
    ("prev", "cur", "stalled"),
    [
        ((2, 0, 100, 50), (2, 0, 100, 50), True),  # running, no token moved
        ((0, 3, 100, 50), (0, 3, 100, 50), True),  # waiting only, no prefill
        ((2, 0, 100, 50), (2, 0, 140, 50), False),  # decode progress
        ((0, 3, 100, 50), (0, 3, 100, 90), False),  # prefill progress
        ((0, 0, 100, 50), (0, 0, 100, 50), False),  # idle is not stalled
        ((2, 0, 100, 50), (2, 0, 0, 0), False),  # counters reset: restarted, not stalled
    ],
)
def test_it_calls_a_stall_only_with_work_and_no_progress(
    prev: tuple[float, ...], cur: tuple[float, ...], stalled: bool
) -> None:
    keys = ("num_requests_running", "num_requests_waiting", "generation_tokens_total",
            "prompt_tokens_total")  # fmt: skip
    assert progress_stalled(dict(zip(keys, prev, strict=True)),
                            dict(zip(keys, cur, strict=True))) is stalled  # fmt: skip


def test_it_does_not_call_a_stall_without_counters() -> None:
    assert progress_stalled({"num_requests_running": 2}, {"num_requests_running": 2}) is False


def test_it_reports_a_closed_port_without_raising() -> None:
    port = free_port()
    res = health_check(port, timeout_s=1)
    assert res.status_code is None and not res.ok and res.error
    with pytest.raises(MetricsUnavailable, match=f"127.0.0.1:{port}/metrics"):
        read_vllm_metrics(port, timeout_s=1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"command": "vllm serve /m"}, "command"),  # a shell string, not exec form
        ({"port": 0}, "port"),
        ({"mem_limit_bytes": 0}, "mem_limit_bytes"),
        ({"mem_limit_bytes": 100 * MiB, "memswap_limit_bytes": 50 * MiB}, "memswap_limit_bytes"),
        ({"memswap_limit_bytes": 50 * MiB}, "memswap_limit_bytes"),  # swap without memory
        ({"labels": {"sparkd.managed": "false"}}, "labels"),
    ],
)
def test_it_refuses_a_bad_launch_spec(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        LaunchSpec(image="i", name="n", **kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_it_accepts_unlimited_swap_and_defaults() -> None:
    spec = LaunchSpec(image="i", name="n", mem_limit_bytes=100 * MiB, memswap_limit_bytes=-1)
    assert spec.port == 8000 and spec.ipc_mode == "host" and spec.gpu == "auto"


@pytest.mark.parametrize(
    ("stamp", "epoch"),
    [
        ("2025-10-03T16:22:53.123456789Z", 1759508573.123456789),
        ("2025-10-03T16:22:53Z", 1759508573.0),
        ("2025-10-03T18:22:53.5+02:00", 1759508573.5),
        ("0001-01-01T00:00:00Z", None),  # Docker's "never"
        ("", None),
        (None, None),
    ],
)
def test_it_reads_docker_time_stamps(stamp: str | None, epoch: float | None) -> None:
    got = epoch_from_docker(stamp)
    assert got == pytest.approx(epoch) if epoch is not None else got is None
