"""vLLM start-up log → launch record: every fixture line, variants, garbage."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import fixture

from sparkd.sense.vllm_log import LaunchLogParser, LaunchRecord, parse_lines, strip_prefixes

ARGS = {
    "model": "/models/flash-next",
    "gpu_memory_utilization": 0.786,
    "max_model_len": 262144,
    "kv_cache_dtype": "fp8",
    "max_num_seqs": 4,
    "max_num_batched_tokens": 2048,
}
FREE_MEMORY_MSG = (
    "Free memory on device cuda:0 (55.87/119.56 GiB) on startup is less than desired GPU "
    "memory utilization (0.8, 95.65 GiB). Decrease GPU memory utilization or reduce GPU "
    "memory used by other processes."
)

# (fixture, line number from 1, the figures that line sets)
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("startup.log", 1, {"vllm_version": "0.11.0", "phase": "init"}),
    ("startup.log", 2, {"non_default_args": ARGS, "phase": "init"}),
    ("startup.log", 3, {"model_load_gib": 63.71, "model_load_s": 92.113, "phase": "model_load"}),
    ("startup.log", 4, {"kv_cache_available_gib": 6.51, "phase": "kv_cache"}),
    ("startup.log", 5, {"kv_cache_tokens": 42656, "phase": "kv_cache"}),
    ("startup.log", 6, {"max_concurrency_tokens_per_request": 32768, "max_concurrency": 1.30}),
    ("startup.log", 7, {"graph_capture_s": 34.0, "graph_capture_gib": 0.26, "phase": "graph_capture"}),
    ("startup.log", 8, {"engine_init_s": 71.02, "phase": "api_server"}),
    ("startup.log", 9, {"phase": "api_server"}),  # Starting vLLM API server 0 on http://… (no version in it)
    ("startup.log", 10, {"phase": "api_server"}),  # Started server process
    ("startup.log", 11, {}),
    ("startup.log", 12, {"startup_complete": True, "phase": "ready"}),
    (
        "startup-fail-free-memory.log",
        1,
        # the generic line marks the launch failed but is not the reason
        {"failed": True, "failure_phase": "starting", "failure_generic": "EngineCore failed to start."},
    ),
    (
        "startup-fail-free-memory.log",
        2,
        {
            "failed": True,
            "failure_phase": "starting",
            "failure_kind": "free_memory",
            "failure_device": "cuda:0",
            "failure_free_gib": 55.87,
            "failure_total_gib": 119.56,
            "failure_requested_gmu": 0.8,
            "failure_requested_gib": 95.65,
            "failure_message": "ValueError: " + FREE_MEMORY_MSG,
        },
    ),
]


def _lines(name: str) -> list[str]:
    return fixture("vllm", name).read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize(("name", "lineno", "expected"), CASES, ids=[f"{n}:{i}" for n, i, _ in CASES])
def test_it_reads_each_fixture_line(name: str, lineno: int, expected: dict[str, Any]) -> None:
    parser = LaunchLogParser()
    set_now = parser.feed(_lines(name)[lineno - 1])
    assert sorted(set_now) == sorted(expected)
    blank = LaunchRecord()
    for field, value in vars(parser.record).items():
        if field == "lines_seen":
            continue
        assert value == expected.get(field, getattr(blank, field)), field


def test_it_covers_every_fixture_line() -> None:
    for name in ("startup.log", "startup-fail-free-memory.log"):
        assert {i for n, i, _ in CASES if n == name} == set(range(1, len(_lines(name)) + 1))


def test_it_builds_the_whole_launch_record() -> None:
    rec = parse_lines(_lines("startup.log"))
    assert rec.state == "ready"
    assert rec.vllm_version == "0.11.0"
    assert rec.non_default_args == ARGS
    assert (rec.model_load_gib, rec.model_load_s) == (63.71, 92.113)
    assert rec.kv_cache_available_gib == 6.51
    assert rec.kv_cache_tokens == 42656
    assert (rec.max_concurrency, rec.max_concurrency_tokens_per_request) == (1.30, 32768)
    assert (rec.graph_capture_s, rec.graph_capture_gib) == (34.0, 0.26)
    assert rec.engine_init_s == 71.02
    assert rec.startup_complete and not rec.failed
    assert rec.lines_seen == 12
    assert rec.to_json()["state"] == "ready"


def test_it_records_the_free_memory_refusal() -> None:
    rec = parse_lines(_lines("startup-fail-free-memory.log"))
    assert rec.state == "failed"
    assert (rec.failure_free_gib, rec.failure_total_gib) == (55.87, 119.56)
    assert (rec.failure_requested_gmu, rec.failure_requested_gib) == (0.8, 95.65)
    assert rec.failure_message == "ValueError: " + FREE_MEMORY_MSG


def test_it_keeps_a_record_when_lines_are_missing() -> None:
    lines = [
        ln
        for ln in _lines("startup.log")
        if "KV cache" not in ln and "Graph capturing" not in ln and "version" not in ln
    ]
    rec = parse_lines(lines)
    assert rec.kv_cache_tokens is None and rec.kv_cache_available_gib is None
    assert rec.graph_capture_s is None and rec.graph_capture_gib is None
    assert rec.vllm_version is None
    assert rec.model_load_gib == 63.71
    assert rec.max_concurrency == 1.30
    assert rec.state == "ready"


def test_it_reads_size_and_concurrency_printed_on_one_line() -> None:
    line = (
        "INFO 10-03 16:22:17 [kv_cache_utils.py:864] GPU KV cache size: 42,656 tokens, "
        "Maximum concurrency for 32,768 tokens per request: 1.30x"
    )
    parser = LaunchLogParser()
    assert sorted(parser.feed(line)) == [
        "kv_cache_tokens",
        "max_concurrency",
        "max_concurrency_tokens_per_request",
        "phase",
    ]
    assert parser.record.kv_cache_tokens == 42656
    assert parser.record.max_concurrency == 1.30


@pytest.mark.parametrize(
    ("line", "field", "value"),
    [
        ("Model loading took 63.7 GiB memory and 92.1 seconds", "model_load_s", 92.1),
        ("Model loading took 63.71 GiB", "model_load_gib", 63.71),
        ("Graph capturing finished in 34 secs", "graph_capture_s", 34.0),
        ("INFO ... # GPU blocks: 2,666, # CPU blocks: 0", "kv_cache_blocks", 2666),
        ("INFO vLLM API server version v0.10.2rc1", "vllm_version", "0.10.2rc1"),
        ("Maximum concurrency for 1,048,576 tokens per request: 12.5x", "max_concurrency_tokens_per_request", 1048576),
    ],
)
def test_it_tolerates_format_variants(line: str, field: str, value: Any) -> None:
    parser = LaunchLogParser()
    assert field in parser.feed(line)
    assert getattr(parser.record, field) == value


def test_it_strips_the_docker_timestamp_and_uses_it() -> None:
    parser = LaunchLogParser()
    prefix = "2025-10-03T16:22:53.123456789Z "
    parser.feed(prefix + "(APIServer pid=1133401) INFO:     Application startup complete.")
    rec = parser.record
    assert rec.startup_complete
    assert rec.startup_complete_ts == pytest.approx(1759508573.123456789)
    assert rec.first_ts == rec.last_ts == rec.startup_complete_ts


def test_it_uses_received_at_without_a_docker_timestamp() -> None:
    parser = LaunchLogParser()
    parser.feed("INFO:     Application startup complete.", received_at=1000.5)
    assert parser.record.startup_complete_ts == 1000.5


def test_it_strips_ansi_colours_and_process_prefixes() -> None:
    line = (
        "2025-10-03T16:21:40.5+02:00 \x1b[1;36m(EngineCore_DP0 pid=1133552)\x1b[0;0m "
        "INFO 10-03 16:21:40 [gpu_model_runner.py:2653] Model loading took "
        "\x1b[1m63.71\x1b[0m GiB and 92.113 seconds\r\n"
    )
    msg, ts = strip_prefixes(line)
    assert msg.startswith("INFO 10-03 16:21:40")
    assert "\x1b" not in msg and not msg.endswith("\n")
    assert ts == pytest.approx(1759500100.5)
    rec = parse_lines([line])
    assert (rec.model_load_gib, rec.model_load_s) == (63.71, 92.113)


def test_it_accepts_bytes() -> None:
    rec = parse_lines([b"(EngineCore_DP0 pid=1) INFO Available KV cache memory: 6.51 GiB\xff\n"])
    assert rec.kv_cache_available_gib == 6.51


@pytest.mark.parametrize(
    "line",
    [
        "",
        "\n",
        "\x00\x01\x02",
        "Model loading took",
        "Model loading took 63.71.5 GiB",
        "GPU KV cache size: tokens",
        "GPU KV cache size: 9" + "9" * 400 + "e999 tokens",
        "Maximum concurrency for many tokens per request: lots",
        "non-default args: {'model': __import__('os').system('true')}",
        "non-default args: {'broken': ",
        "non-default args: ['a', 'list']",
        "Free memory on device cuda:0 (n/a) on startup is less than desired",
        "2025-13-45T99:99:99Z garbage timestamp",
        "(EngineCore_DP0 pid=) half a prefix",
        "x" * 200_000,
    ],
)
def test_it_survives_garbage(line: str) -> None:
    parser = LaunchLogParser()
    parser.feed(line)
    rec = parser.record
    assert rec.non_default_args is None
    assert rec.model_load_gib is None
    assert rec.max_concurrency is None
    assert not rec.failed
    assert rec.lines_seen == 1


def test_it_keeps_figures_when_garbage_follows() -> None:
    parser = LaunchLogParser()
    for line in _lines("startup.log"):
        parser.feed(line)
        parser.feed("\x1b[31mgarbage\x1b[0m ### (pid=) : : 1.2.3x GiB")
    assert parser.record.kv_cache_tokens == 42656
    assert parser.record.lines_seen == 24
