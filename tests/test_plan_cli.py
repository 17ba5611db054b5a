"""``sparkd plan`` — the worked example of CONTEXT.md through the CLI, to two decimals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from sparkd.face.cli import main

WORKED = [
    "--mem-total-gib",
    "121.69",
    "--weights-gib",
    "71.75",
    "--overhead-gib",
    "5.60",
    "--mtp",
    "--mtp-gib",
    "1.49",
    "--max-model-len",
    "262144",
    "--kv-bytes-per-token",
    "29482",
    "--kv-cache-dtype",
    "fp8",
    "--kv-target-gib",
    "20",
    "--host-reserve-gib",
    "26",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "2048",
]


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", *args])
    return r.exit_code, r.output


def test_the_worked_example_through_plan_json(tmp_path: Path) -> None:
    code, out = _run(tmp_path, *WORKED, "--json")
    assert code == 0, out
    p = json.loads(out)
    assert p["gmu"] == 0.786
    expected = {
        "budget_gib": 95.65,
        "fixed_gib": 78.84,
        "kv_need_gib": 4.17,
        "kv_exp_gib": 16.81,
        "wish_gib": 98.84,
        "cap_gib": 95.69,
        "mem_total_gib": 121.69,
        "weights_gib": 71.75,
        "docker_memory_gib": 100.65,
    }
    for key, value in expected.items():
        assert round(p[key], 2) == value, key
    assert round(p["max_len_concurrency"]) == 4
    assert p["squeezed"] is True


def test_the_table_shows_the_figures_the_squeeze_and_the_command(tmp_path: Path) -> None:
    code, out = _run(tmp_path, *WORKED)
    assert code == 0, out
    for text in (
        "78.84 GiB",
        "4.17 GiB",
        "95.65 GiB",
        "16.81 GiB",
        "0.786",
        "SQUEEZED",
        "--gpu-memory-utilization 0.786",
        "--memory 103063m",
        "--memory-swap 103063m",
    ):
        assert text in out, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-model-len", "0"], "max_model_len = 0: Input should be greater than or equal to 1"),
        (["--gmu-override", "1.5"], "gmu_override = 1.5: Input should be less than or equal to 1"),
    ],
)
def test_bad_inputs_are_refused_naming_the_field(tmp_path: Path, args: list[str], message: str) -> None:
    code, out = _run(tmp_path, *WORKED, *args)
    assert code == 2 and message in out


def test_kv_room_below_one_request_is_refused_with_a_suggestion(tmp_path: Path) -> None:
    args = [a for a in WORKED]
    args[args.index("--max-model-len") + 1] = "4000000"
    code, out = _run(tmp_path, *args)
    assert code == 1
    assert "max_model_len" in out and "KV" in out


def test_the_printed_command_has_no_gpu_request_when_the_container_gets_none(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[container]\ngpu = "off"\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", *WORKED])
    assert r.exit_code == 0 and "--gpus" not in r.output and "--memory 103063m" in r.output
    code, out = _run(tmp_path, *WORKED)
    assert code == 0 and "--gpus all" in out


def test_the_printed_command_has_the_launch_flags_from_the_field(tmp_path: Path) -> None:
    code, out = _run(tmp_path, *WORKED)
    assert code == 0, out
    assert "--init" in out.split()
    assert "--oom-score-adj 500" in out  # the default: the serving container before sshd and sparkd


def test_the_printed_command_follows_the_configured_launch_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[container]\ninit = false\noom_score_adj = 900\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", *WORKED])
    assert r.exit_code == 0, r.output
    assert "--init" not in r.output.split()
    assert "--oom-score-adj 900" in r.output


@pytest.mark.parametrize("value", ["0", "-500", "1001", "true"])
def test_a_non_positive_oom_score_adj_is_refused_naming_the_field(tmp_path: Path, value: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[container]\noom_score_adj = {value}\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", *WORKED])
    assert r.exit_code == 2
    assert "oom_score_adj" in r.output and value in r.output
