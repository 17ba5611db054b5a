"""vLLM failure causes (issue 12, kind 2): the root cause, not the first generic line; the figures a
cause carries; CUDA graph memory figures; the one-sentence event; ``sparkd vllm-log``.

Right values: tests/fixtures/field-2/README.md. The wording variants below are written here from the
shapes older and newer vLLM releases print (a cause must be recognised in each of them)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import fixture

from sparkd.config import Settings
from sparkd.face.cli import main
from sparkd.loop.daemon import Daemon
from sparkd.loop.supervisor import Supervisor
from sparkd.sense.vllm_log import LaunchLogParser, parse_lines

FREE_SENTENCE = "vLLM refused to start: free memory 55.87 of 119.56 GiB < wanted 95.65 GiB (gpu_memory_utilization 0.8)"


def _field(name: str) -> list[str]:
    return fixture("field-2", name).read_text(encoding="utf-8").splitlines()


# ---------------------------------------------------------------- field logs: right values


def test_maxlen_refusal_after_the_generic_line_is_the_root_cause() -> None:
    rec = parse_lines(_field("vllm-maxlen-after-enginecore-failed.log"))
    assert rec.state == "failed"
    assert rec.failure_kind == "max_model_len"
    assert rec.failure_message is not None and rec.failure_message.startswith("ValueError: To serve at least one")
    assert rec.failure_generic == "EngineCore failed to start."
    assert "EngineCore failed" not in rec.failure_message
    assert rec.failure_kv_needed_gib == 24.0
    assert rec.failure_kv_available_gib == 3.18
    assert rec.failure_estimated_max_model_len == 34736
    assert rec.failure_max_model_len == 262144
    assert rec.failure_summary() == (
        "vLLM refused to start: max_model_len 262144 needs 24.0 GiB of KV cache, only 3.18 GiB available "
        "(estimated maximum model length 34736)"
    )


def test_graph_capture_oom_is_the_reason_and_kv_figures_stay() -> None:
    rec = parse_lines(_field("vllm-graph-capture-oom.log"))
    assert rec.state == "failed"
    assert rec.failure_kind == "cuda_oom"
    assert rec.failure_message is not None and rec.failure_message.startswith("torch.OutOfMemoryError: CUDA out")
    assert rec.failure_oom_request_bytes == 2 * 2**20
    summary = rec.failure_summary()
    assert summary is not None
    assert "CUDA out of memory during CUDA graph capture" in summary
    assert "Engine core initialization failed" not in summary
    assert rec.kv_cache_available_gib == 2.97
    assert rec.kv_cache_tokens == 150745
    assert (rec.max_concurrency, rec.max_concurrency_tokens_per_request) == (1.22, 124000)
    assert rec.phase == "kv_cache"  # the last step the log shows: capture comes after it


def test_negative_cudagraph_estimate_is_recorded_and_warned() -> None:
    rec = parse_lines(_field("vllm-negative-cudagraph-estimate.log"))
    assert rec.cudagraph_estimate_gib == -20.50
    assert (rec.kv_cache_available_gib, rec.kv_cache_tokens) == (90.6, 4061215)
    assert rec.state == "starting"
    warnings = rec.warnings()
    assert list(warnings) == ["negative_cudagraph_estimate"]
    text = warnings["negative_cudagraph_estimate"]
    assert "-20.50 GiB" in text and "90.6 GiB" in text and "4,061,215 tokens" in text
    assert "start-up peak will be higher than planned" in text
    assert rec.to_json()["warnings"] == warnings


def test_a_positive_estimate_raises_no_warning() -> None:
    rec = parse_lines(["INFO [gpu_model_runner.py:6517] Estimated CUDA graph memory: 0.94 GiB total"])
    assert rec.cudagraph_estimate_gib == 0.94
    assert rec.warnings() == {}


def test_free_memory_refusal_is_one_short_sentence() -> None:
    rec = parse_lines(_field("vllm-free-memory-refusal.log"))
    assert rec.failure_summary() == FREE_SENTENCE
    assert len(FREE_SENTENCE) < 120


def test_cuda_graph_pool_actual_and_estimated() -> None:
    line = (
        "(EngineCore_DP0 pid=7) INFO 07-12 02:36:01 [gpu_worker.py:621] CUDA graph pool memory: "
        "1.71 GiB (actual), 1.58 GiB (estimated), difference: 0.13 GiB"
    )
    rec = parse_lines([line])
    assert (rec.cudagraph_pool_actual_gib, rec.cudagraph_pool_estimated_gib) == (1.71, 1.58)
    assert rec.phase == "graph_capture"


# ---------------------------------------------------------------- the whole kind: wording variants

MAXLEN_VARIANTS = [
    # the bare ValueError, no generic line before it (older v1)
    (
        "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache "
        "is needed, which is larger than the available KV cache memory (8.50 GiB). Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
        {"failure_max_model_len": 131072, "failure_kv_needed_gib": 16.0, "failure_kv_available_gib": 8.5},
    ),
    # newer spelling (model's), ERROR-log prefixed, with the estimate
    (
        "(EngineCore_DP0 pid=9) ERROR 11-02 08:00:00 [core.py:866] ValueError: To serve at least one request "
        "with the model's max seq len (65536), (6.0 GiB KV cache is needed, which is larger than the available "
        "KV cache memory (2.5 GiB). Based on the available memory, the estimated maximum model length is 27000.",
        {"failure_max_model_len": 65536, "failure_estimated_max_model_len": 27000},
    ),
    # v0 engine: tokens, not GiB
    (
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be "
        "stored in KV cache (16384). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
        "initializing the engine.",
        {"failure_max_model_len": 32768, "failure_kv_capacity_tokens": 16384},
    ),
]


@pytest.mark.parametrize(("line", "figures"), MAXLEN_VARIANTS, ids=["bare-v1", "model's", "v0-tokens"])
def test_maxlen_refusal_in_any_wording_marks_the_launch_failed(line: str, figures: dict[str, object]) -> None:
    rec = parse_lines([line])
    assert rec.state == "failed"
    assert rec.failure_kind == "max_model_len"
    for k, v in figures.items():
        assert getattr(rec, k) == v, k
    summary = rec.failure_summary()
    head = f"vLLM refused to start: max_model_len {rec.failure_max_model_len}"
    assert summary is not None and summary.startswith(head)


@pytest.mark.parametrize(
    "line",
    [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB.",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 119.70 GiB total)",
        "RuntimeError: CUDA error: out of memory",
    ],
)
def test_cuda_oom_in_any_wording_after_the_kv_pool_is_graph_capture(line: str) -> None:
    lines = [
        "INFO [gpu_worker.py:298] Available KV cache memory: 6.51 GiB",
        "ERROR [core.py:708] EngineCore failed to start.",
        "ERROR [core.py:708] Traceback (most recent call last):",
        f"ERROR [core.py:708] {line}",
    ]
    rec = parse_lines(lines)
    assert rec.failure_kind == "cuda_oom"
    assert "CUDA out of memory during CUDA graph capture" in (rec.failure_summary() or "")


def test_oom_while_loading_weights_names_model_loading() -> None:
    rec = parse_lines(
        [
            "INFO [gpu_model_runner.py:2602] Starting to load model /models/x...",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB.",
        ]
    )
    assert rec.failure_phase == "model_load"
    assert rec.failure_oom_request_bytes == int(3.5 * 2**30)
    assert rec.failure_summary() == (
        "vLLM failed to start: CUDA out of memory during model loading (tried to allocate 3.50 GiB)"
    )


def test_free_memory_refusal_without_a_device_name() -> None:
    rec = parse_lines(
        [
            "ValueError: Free memory on device (40.00/119.56 GiB) on startup is less than desired GPU memory "
            "utilization (0.786, 93.98 GiB). Decrease GPU memory utilization or reduce GPU memory used by others."
        ]
    )
    assert rec.failure_kind == "free_memory"
    assert rec.failure_summary() == (
        "vLLM refused to start: free memory 40.0 of 119.56 GiB < wanted 93.98 GiB (gpu_memory_utilization 0.786)"
    )


def test_no_memory_for_cache_blocks_is_a_refusal() -> None:
    rec = parse_lines(
        ["ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`."]
    )
    assert (rec.state, rec.failure_kind) == ("failed", "no_kv_memory")


def test_an_unknown_exception_before_the_generic_line_is_the_reason() -> None:
    rec = parse_lines(
        [
            "ERROR [core.py:700] Traceback (most recent call last):",
            "ERROR [core.py:700] KeyError: 'model.layers.0.mlp.experts.w13_weight'",
            "ERROR [core.py:708] EngineCore failed to start.",
            "(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert rec.failure_kind == "error"
    assert rec.failure_message == "KeyError: 'model.layers.0.mlp.experts.w13_weight'"
    assert "Engine core initialization failed" not in (rec.failure_summary() or "")


def test_only_a_generic_line_says_there_is_no_root_cause() -> None:
    rec = parse_lines(["ERROR [core.py:708] EngineCore failed to start."])
    assert rec.state == "failed" and rec.failure_message is None
    assert "no root cause in the log" in (rec.failure_summary() or "")


def test_an_error_after_startup_complete_is_not_a_start_failure() -> None:
    lines = [*fixture("vllm", "startup.log").read_text().splitlines()]
    lines.append("ERROR [serving.py:1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.")
    rec = parse_lines(lines)
    assert rec.state == "ready" and rec.failure_kind is None


def test_an_exception_alone_does_not_fail_the_launch() -> None:
    rec = parse_lines(["WARNING [x.py:1] ImportError: optional kernel not built; falling back"])
    assert not rec.failed


# ---------------------------------------------------------------- the event, through the real supervisor


def _supervisor_events(tmp_path: Path, lines: list[str], *, wait_s: float = 0.0) -> list[dict[str, object]]:
    settings = Settings(state_dir=str(tmp_path), container={"image": "sparkd-test-vllm:latest"})
    daemon = Daemon(settings, serve_api=False)
    sup = Supervisor(settings)
    sup.daemon = daemon
    sup.parser = LaunchLogParser()

    async def drive() -> None:
        assert sup.parser is not None
        for ln in lines:
            if sup.parser.feed(ln):
                sup._launch_figures()
            await asyncio.sleep(0)
        await asyncio.sleep(wait_s)

    asyncio.run(drive())
    return [e for e in daemon.recent_events if str(e["kind"]).startswith("vllm_start")]


def test_the_start_failed_event_is_one_sentence(tmp_path: Path) -> None:
    events = _supervisor_events(tmp_path, _field("vllm-free-memory-refusal.log"))
    failed = [e for e in events if e["kind"] == "vllm_start_failed"]
    assert len(failed) == 1
    assert failed[0]["message"] == FREE_SENTENCE
    assert failed[0]["severity"] == "critical"


def test_a_generic_line_alone_gives_the_event_after_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sparkd.loop.launchbook as launchbook

    monkeypatch.setattr(launchbook, "START_FAILED_CAUSE_WAIT_S", 0.2)
    assert _supervisor_events(tmp_path / "a", ["ERROR [core.py:708] EngineCore failed to start."]) == []
    events = _supervisor_events(tmp_path / "b", ["ERROR [core.py:708] EngineCore failed to start."], wait_s=0.5)
    assert [e["message"] for e in events] == [
        "vLLM failed to start during start-up (no root cause in the log: EngineCore failed to start.)"
    ]


def test_the_negative_estimate_warning_event_is_raised_once(tmp_path: Path) -> None:
    lines = _field("vllm-negative-cudagraph-estimate.log")
    events = _supervisor_events(tmp_path, lines + lines[-2:])
    warn = [e for e in events if e["kind"] == "vllm_start_warning"]
    assert len(warn) == 1
    assert "start-up peak will be higher than planned" in str(warn[0]["message"])
    assert not [e for e in events if e["kind"] == "vllm_start_failed"]


# ---------------------------------------------------------------- sparkd vllm-log

FIELD_CASES = [
    ("vllm-maxlen-after-enginecore-failed.log", "failed", "starting", "max_model_len 262144 needs 24.0 GiB"),
    ("vllm-graph-capture-oom.log", "failed", "kv_cache", "CUDA out of memory during CUDA graph capture"),
    ("vllm-negative-cudagraph-estimate.log", "starting", "kv_cache", "WARNING: vLLM estimated CUDA graph memory"),
    ("vllm-free-memory-refusal.log", "failed", "starting", FREE_SENTENCE),
]


@pytest.mark.parametrize(("name", "state", "phase", "cause"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_vllm_log_command_prints_phase_and_cause(name: str, state: str, phase: str, cause: str) -> None:
    res = CliRunner().invoke(main, ["vllm-log", str(fixture("field-2", name))])
    assert res.exit_code == (1 if state == "failed" else 0), res.output  # a failed launch exits 1
    assert f"state:   {state}" in res.output
    assert f"phase:   {phase} " in res.output
    assert cause in res.output
    if state == "failed":
        assert "generic line (not the reason): EngineCore failed to start." in res.output


@pytest.mark.parametrize(("name", "state", "phase", "cause"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_vllm_log_json(name: str, state: str, phase: str, cause: str) -> None:
    res = CliRunner().invoke(main, ["vllm-log", "--json", str(fixture("field-2", name))])
    assert res.exit_code == (1 if state == "failed" else 0), res.output
    data = json.loads(res.output)
    assert (data["state"], data["phase"]) == (state, phase)
    if state == "failed":
        assert cause in data["failure_summary"]


def test_vllm_log_reads_docker_logs_from_stdin_in_a_real_process() -> None:
    text = fixture("field-2", "vllm-graph-capture-oom.log").read_bytes()
    res = subprocess.run(
        [sys.executable, "-m", "sparkd", "vllm-log", "--json", "-"], input=text, capture_output=True, timeout=60
    )
    assert res.returncode == 1, res.stderr  # the log shows a failed launch
    data = json.loads(res.stdout)
    assert data["failure_kind"] == "cuda_oom"
    assert data["first_ts"] is not None  # the Docker --timestamps prefix was read


def test_vllm_log_says_when_nothing_is_a_vllm_line(tmp_path: Path) -> None:
    f = tmp_path / "not-vllm.log"
    f.write_text("hello\nworld\n")
    res = CliRunner().invoke(main, ["vllm-log", str(f)])
    assert res.exit_code == 0, res.output
    assert "none of the 2 lines is a vLLM start-up line" in res.output


def test_vllm_log_refuses_a_missing_file(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["vllm-log", str(tmp_path / "nope.log")])
    assert res.exit_code == 2
    assert "nope.log" in res.output


def test_sparkd_launches_shows_the_cause_and_the_warning(tmp_path: Path) -> None:
    from sparkd.store.store import Store

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    settings = Settings(state_dir=str(tmp_path))
    store = Store.open(settings.db_file, migrate=True)
    for i, name in enumerate(("vllm-free-memory-refusal.log", "vllm-negative-cudagraph-estimate.log")):
        actual = parse_lines(_field(name)).to_json()
        store.save_launch({"id": f"l{i}", "status": "failed", "started_at": 1000.0 + i, "actual": actual})
    store.close()
    res = CliRunner().invoke(main, ["--config", str(cfg), "launches"])
    assert res.exit_code == 0, res.output
    assert f"failed:   {FREE_SENTENCE}" in res.output
    assert "warning:  vLLM estimated CUDA graph memory at -20.50 GiB" in res.output


def test_oom_while_profiling_cuda_graph_memory_is_graph_capture() -> None:
    lines = [
        "(EngineCore pid=75) INFO Initial profiling/warmup run took 100.46 s",
        "(EngineCore pid=75) INFO Profiling CUDA graph memory: PIECEWISE=51, FULL=35",
        "(EngineCore pid=75) ERROR torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB.",
    ]
    rec = parse_lines(lines)
    assert rec.phase == "profiling" and rec.failure_phase == "graph_capture"
    assert "during CUDA graph capture" in (rec.failure_summary() or "")
    # after the estimate is printed, an OOM in profiling is not the graphs' any more
    rec = parse_lines([lines[0], lines[1], "INFO Estimated CUDA graph memory: 1.58 GiB total", lines[2]])
    assert rec.failure_phase == "profiling"
    assert "during memory profiling" in (rec.failure_summary() or "")
