"""``sparkd plan`` — the worked example of CONTEXT.md through the CLI, to two decimals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from checkpoints import gib, make_checkpoint
from click.testing import CliRunner
from test_kvcache import DEEPSEEK_V3, GEMMA3_27B, GPT_OSS_20B, LLAMA_31_8B, LLAMA_31_70B, QWEN3_NEXT_80B

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
    # weights given by a flag: said as given, not as a checkpoint row reading "— flag" (note 11)
    row = next(line for line in out.splitlines() if "weights (given; no checkpoint measured)" in line)
    assert "71.75 GiB" in row and row.rstrip().endswith("flag"), row


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
    assert "container.gpu = auto" in out and "NVIDIA runtime" in out  # the offline line says what auto means


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


def test_the_printed_command_is_the_launch_itself_and_can_be_pasted(tmp_path: Path) -> None:
    import shlex

    from sparkd.config import load_settings
    from sparkd.core.budget import BudgetInputs, make_plan
    from sparkd.loop.launch import launch_spec

    model = tmp_path / "ckpt"
    model.mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path}"\n[container]\nname = "m1"\nport = 8123\nmodel_dir = "{model}"\n'
        '[container.env]\nHF_TOKEN = "hf_SECRET"\n'
    )
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", *WORKED])
    assert r.exit_code == 0, r.output
    lines = r.output[r.output.index("docker run") :].splitlines()
    end = next(i for i, ln in enumerate(lines) if not ln.endswith("\\"))  # the command's last line
    argv = shlex.split(" ".join(ln.rstrip("\\") for ln in lines[: end + 1]))
    # the model is mounted where --model points, read-only; the port and drain of sparkd's own launch
    assert f"{model}:/models/model:ro" in argv and argv[argv.index("--model") + 1] == "/models/model"
    assert argv[argv.index("--port") + 1] == "8123" and "--shutdown-timeout" in argv
    assert argv[argv.index("--name") + 1] == "m1"
    # secrets by name only: the shell passes the value
    assert argv[argv.index("-e") + 1] == "HF_TOKEN" and "hf_SECRET" not in r.output
    # the vLLM arguments equal what sparkd's launch runs
    s = load_settings(cfg)
    spec = launch_spec(s.model_copy(update={"container": s.container.model_copy(update={"image": "x"})}), make_plan(
        BudgetInputs(mem_total_bytes=int(121.69 * 2**30), max_model_len=262144, kv_bytes_per_token=29482,
                     weights_gib=71.75, overhead_gib=5.60, mtp_enabled=True, mtp_gib=1.49, kv_cache_dtype="fp8",
                     kv_target_gib=20, host_reserve_gib=26, max_num_seqs=4, max_num_batched_tokens=2048,
                     model="/models/model")))  # fmt: skip
    assert argv[argv.index("vllm/vllm-openai:latest") + 1 :] == spec.command


@pytest.mark.parametrize("value", ["0", "-500", "1001", "true"])
def test_a_non_positive_oom_score_adj_is_refused_naming_the_field(tmp_path: Path, value: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[container]\noom_score_adj = {value}\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", *WORKED])
    assert r.exit_code == 2
    assert "oom_score_adj" in r.output and value in r.output


# --- plans for any model: KV from config.json, the fp8 multiplier, provenance (issue 19) ----------


def _ckpt(tmp_path: Path, config: dict[str, object], weights_gib: float) -> str:
    return str(make_checkpoint(tmp_path / "model", config, [gib(weights_gib / 2), gib(weights_gib / 2)]))


def _json(tmp_path: Path, *args: str) -> dict[str, Any]:
    code, out = _run(tmp_path, "--mem-total-gib", "121.69", *args, "--json")
    assert code == 0, out
    return json.loads(out)


def test_a_llama_checkpoint_gets_its_own_kv_bytes_per_token(tmp_path: Path) -> None:
    d = _ckpt(tmp_path, LLAMA_31_8B, 15)
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "131072", "--kv-cache-dtype", "bf16")
    # 2 × 32 × 8 × 128 × 2 = 131,072 B, not the notes' 29,482
    assert p["inputs"]["kv_bytes_per_token"] == 131_072
    # one max-length request: 131,072 tokens × 131,072 B = 16 GiB exactly
    assert p["kv_need_gib"] == 16.0
    assert p["provenance"]["kv_bytes_per_token"]["source"] == "checkpoint config.json"
    assert "GQA: 2 × num_hidden_layers 32" in p["provenance"]["kv_bytes_per_token"]["how"]
    assert p["provenance"]["weight_bytes"]["source"] == "measured"
    assert p["provenance"]["mem_total_bytes"]["source"] == "flag"
    assert p["provenance"]["max_model_len"]["source"] == "flag"
    assert p["provenance"]["host_reserve_gib"]["source"] == "default"


def test_fp8_halves_a_whole_fp8_kv_cache(tmp_path: Path) -> None:
    d = _ckpt(tmp_path, LLAMA_31_8B, 15)
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "131072", "--kv-cache-dtype", "fp8")
    # the whole KV is attention K/V: fp8 stores 1 byte of 2 → 8 GiB
    assert p["kv_mult"] == 0.5 and p["kv_need_gib"] == 8.0
    assert p["provenance"]["kv_mult"]["source"] == "checkpoint config.json"
    assert not any("fp8 KV multiplier" in w for w in p["warnings"])


def test_the_notes_model_keeps_its_0_58_with_the_reason(tmp_path: Path) -> None:
    code, out = _run(tmp_path, *WORKED, "--json")
    assert code == 0, out
    p = json.loads(out)
    assert p["kv_mult"] == 0.58 and round(p["kv_need_gib"], 2) == 4.17
    assert "side caches stay BF16" in p["provenance"]["kv_mult"]["how"]
    assert not any("fp8 KV multiplier" in w for w in p["warnings"])
    # every input of the worked example was given as a flag; nothing stands in for it
    assert p["provenance"]["overhead_gib"]["source"] == "flag"
    assert not any("is a default" in w for w in p["warnings"])


def test_a_hand_given_figure_of_another_model_warns_about_the_fp8_assumption(tmp_path: Path) -> None:
    args = [a if a != "29482" else "40000" for a in WORKED]
    code, out = _run(tmp_path, *args, "--json")
    assert code == 0, out
    p = json.loads(out)
    assert p["kv_mult"] == 0.5
    assert any("fp8 KV multiplier 0.5 is an assumption" in w for w in p["warnings"])
    # an explicit multiplier silences it and is used
    p = json.loads(_run(tmp_path, *args, "--kv-fp8-mult", "0.6", "--json")[1])
    assert p["kv_mult"] == 0.6 and p["provenance"]["kv_mult"]["source"] == "flag"
    assert not any("fp8 KV multiplier" in w for w in p["warnings"])


def test_a_model_whose_kv_does_not_fit_is_refused_where_the_notes_figure_passed(tmp_path: Path) -> None:
    d = _ckpt(tmp_path, LLAMA_31_70B, 50)
    base = ["--model-dir", d, "--max-model-len", "131072", "--kv-cache-dtype", "bf16"]
    # 2 × 80 × 8 × 128 × 2 = 327,680 B/token → 40 GiB for one request; fixed 50 + 5.6 leaves ~38
    code, out = _run(tmp_path, "--mem-total-gib", "121.69", *base)
    assert code == 1 and "below one max-length request" in out and "327680 B/token" in out
    # the notes' figure (the old default for any model) approves the same plan
    code, out = _run(tmp_path, "--mem-total-gib", "121.69", *base, "--kv-bytes-per-token", "29482")
    assert code == 0, out


def test_a_hybrid_checkpoint_puts_its_state_in_the_fixed_part(tmp_path: Path) -> None:
    d = _ckpt(tmp_path, QWEN3_NEXT_80B, 40)
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "262144", "--max-num-seqs", "4")
    # 262,144 tokens × 24,576 B × 0.5 (fp8) = 3 GiB
    assert p["kv_need_gib"] == 3.0
    # 4 sequences × 39,518,208 B of Gated DeltaNet state
    assert p["state_gib"] == 4 * 39_518_208 / 2**30
    assert p["fixed_gib"] == pytest.approx(p["weights_gib"] + 5.6 + p["state_gib"])
    assert p["provenance"]["state_bytes_per_seq"]["source"] == "checkpoint config.json"


def test_a_sliding_window_checkpoint_is_bounded_by_the_window(tmp_path: Path) -> None:
    d = _ckpt(tmp_path, GEMMA3_27B, 50)
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "131072", "--kv-cache-dtype", "bf16")
    # 131,072 × 81,920 + 1,024 × 425,984 = 11,173,625,856 B
    assert p["kv_need_gib"] == 11_173_625_856 / 2**30
    assert p["inputs"]["kv_window_groups"] == [[1024, 425_984]]


def test_an_unknown_architecture_is_refused_until_the_flag_gives_the_figure(tmp_path: Path) -> None:
    gpt2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_head": 12, "n_embd": 768}
    d = _ckpt(tmp_path, gpt2, 1)
    code, out = _run(tmp_path, "--mem-total-gib", "121.69", "--model-dir", d, "--max-model-len", "1024")
    assert code == 1
    assert "'gpt2'" in out and "n_layer" in out and "--kv-bytes-per-token" in out
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "1024", "--kv-bytes-per-token", "73728")
    assert p["inputs"]["kv_bytes_per_token"] == 73728
    assert p["provenance"]["kv_bytes_per_token"]["source"] == "flag"


def test_no_figure_and_no_checkpoint_is_refused_not_defaulted(tmp_path: Path) -> None:
    code, out = _run(tmp_path, "--mem-total-gib", "121.69", "--weights-gib", "10")
    assert code == 1
    assert "budget.kv_bytes_per_token" in out and "--kv-bytes-per-token" in out


def test_the_table_shows_sources_and_warns_about_defaults(tmp_path: Path) -> None:
    d = _ckpt(tmp_path, LLAMA_31_8B, 15)
    code, out = _run(tmp_path, "--mem-total-gib", "121.69", "--model-dir", d, "--max-model-len", "8192")
    assert code == 0, out
    line = {ln.split("  ")[1].strip(): ln for ln in out.splitlines() if ln.startswith("  ") and "  " in ln[2:]}
    assert line["KV bytes per token (16-bit)"].rstrip().endswith("checkpoint config.json")
    assert line["checkpoint weight files"].rstrip().endswith("measured")
    assert line["MemTotal"].rstrip().endswith("flag")
    assert line["overhead"].rstrip().endswith("default")
    assert "overhead_gib 5.6 GiB is a default (the launch notes' model)" in out
    assert "GQA: 2 × num_hidden_layers 32 × num_key_value_heads 8" in out


def test_mtp_gib_without_mtp_is_a_warning(tmp_path: Path) -> None:
    args = [a for a in WORKED if a != "--mtp"]
    code, out = _run(tmp_path, *args)
    assert code == 0 and "mtp_gib 1.49 GiB was given (flag) but MTP is off" in out
    code, out = _run(tmp_path, *WORKED)
    assert code == 0 and "but MTP is off" not in out


def test_max_model_len_beyond_the_model_context_or_defaulted_is_a_warning(tmp_path: Path) -> None:
    d = _ckpt(tmp_path, LLAMA_31_8B, 15)  # max_position_embeddings 131072
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "262144", "--kv-cache-dtype", "fp8")
    assert any(
        "max_model_len 262144 (flag) exceeds the checkpoint's max_position_embeddings 131072" in w
        for w in p["warnings"]
    )
    p = _json(tmp_path, "--model-dir", d, "--kv-cache-dtype", "fp8")  # the default 262144 stands in
    assert any("262144 (default) exceeds" in w for w in p["warnings"])
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "131072")
    assert not any("max_model_len" in w for w in p["warnings"])


def test_sources_of_a_stored_revision_are_judged_against_the_config() -> None:
    from sparkd.config import BudgetSettings
    from sparkd.loop.launch import apply_resize, setting_sources

    config = BudgetSettings(enabled=True, overhead_gib=5.6, kv_bytes_per_token=29482)
    revision = apply_resize(config, {"kv_target_gib": 16.0})  # every field set, as a stored revision is
    src = setting_sources(revision, base=config)
    # set in the file (even at the default's value), changed by the resize, and never set
    assert src["overhead_gib"] == "config file"
    assert src["kv_target_gib"] == "config file"
    assert src["host_reserve_gib"] == "default"
    # without a base every field of the revision looks set
    assert setting_sources(revision)["host_reserve_gib"] == "config file"
    assert setting_sources(config, flags={"max_model_len"})["max_model_len"] == "flag"


def test_the_notes_figure_from_the_config_file_keeps_0_58_and_says_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[budget]\nkv_bytes_per_token = 29482\noverhead_gib = 5.6\n')
    args = ["--mem-total-gib", "121.69", "--weights-gib", "71.75", "--json"]
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", *args])
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    assert p["kv_mult"] == 0.58
    assert p["provenance"]["kv_bytes_per_token"]["source"] == "config file"
    assert p["provenance"]["overhead_gib"]["source"] == "config file"
    assert p["provenance"]["weights_gib"]["source"] == "flag"
    assert not any("overhead_gib" in w for w in p["warnings"])


@pytest.mark.parametrize(
    ("config", "per_token", "windows", "state"),
    [
        (LLAMA_31_8B, 131_072, [], 0),  # 2 × 32 × 8 × 128 × 2
        (DEEPSEEK_V3, 70_272, [], 0),  # 61 × (512 + 64) × 2
        (QWEN3_NEXT_80B, 24_576, [], 39_518_208),  # 2 × 12 × 2 × 256 × 2; 36 × 1,097,728 B state
        (GPT_OSS_20B, 24_576, [[128, 24_576]], 0),  # 12 full + 12 sliding layers of 2 × 8 × 64 × 2
        (GEMMA3_27B, 81_920, [[1024, 425_984]], 0),  # 10 global + 52 sliding layers of 2 × 16 × 128 × 2
    ],
)
def test_every_family_goes_from_a_checkpoint_dir_into_the_plan(
    tmp_path: Path, config: dict[str, Any], per_token: int, windows: list[list[int]], state: int
) -> None:
    d = _ckpt(tmp_path, config, 8)
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "4096", "--kv-cache-dtype", "bf16")
    i = p["inputs"]
    assert (i["kv_bytes_per_token"], i["kv_window_groups"], i["state_bytes_per_seq"]) == (per_token, windows, state)
    # kv_need: 4096 tokens of the full layers + min(4096, window) of the sliding ones, 16-bit
    assert p["kv_need_gib"] == (4096 * per_token + sum(min(4096, w) * b for w, b in windows)) / 2**30


def test_the_dashboard_budget_bar_shows_the_linear_attention_state(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from sparkd.face.presenters import budget_from_status
    from sparkd.loop.status import PlanFigures

    d = _ckpt(tmp_path, QWEN3_NEXT_80B, 40)
    p = _json(tmp_path, "--model-dir", d, "--max-model-len", "262144", "--max-num-seqs", "8")
    figures = PlanFigures.model_validate(
        {k: v for k, v in p.items() if k not in ("checkpoint", "learned")}  # the CLI adds these two
    )
    bar = budget_from_status(SimpleNamespace(plan=figures, sample=None))  # type: ignore[arg-type]
    assert bar is not None
    seg = {s["key"]: s["gib"] for s in bar["segments"]}
    # 8 sequences × 39,518,208 B
    assert seg["state"] == 8 * 39_518_208 / 2**30
    # the fixed part is drawn whole: weights + overhead + state
    assert seg["weights"] + seg["overhead"] + seg["state"] == pytest.approx(p["fixed_gib"])


def test_a_budget_that_reaches_a_stop_line_is_warned_about(tmp_path: Path) -> None:
    """A walk-through's plan (and resize) gave a budget of 118.65 of 121.69 GiB (host_reserve_gib 3) beside the
    default rules' 6 GiB line, warned only that host_reserve_gib 3 is below 28: a model using its budget is certain
    to be stopped. The plan names the rule and the room left."""
    args = [a for a in WORKED]
    args[args.index("--host-reserve-gib") + 1] = "3"
    args[args.index("--kv-target-gib") + 1] = "60"
    code, out = _run(tmp_path, *args, "--json")
    assert code == 0, out
    warnings = json.loads(out)["warnings"]
    hits = [w for w in warnings if "stop rule low_available's line" in w]
    assert len(hits) == 1 and "leaves at most 3.04 GiB of MemAvailable" in hits[0], warnings
    # the worked example leaves 26 GiB: no such warning
    code, out = _run(tmp_path, *WORKED, "--json")
    assert not [w for w in json.loads(out)["warnings"] if "stop rule" in w]


def _with_resize_revision(tmp_path: Path, kv_target_gib: float) -> Path:
    """A config file and a database holding a resize's revision made on top of it (as the daemon saves it)."""
    from sparkd.config import load_settings
    from sparkd.store.store import Store

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[budget]\nweights_gib = 71.75\nkv_bytes_per_token = 29482\n')
    s = load_settings(cfg)
    store = Store.open(s.db_file, migrate=True)
    base = s.budget.model_dump()
    store.add_revision(who="config file", reason="configuration", data={**base, "_config_base": base}, diff=None)
    store.add_revision(
        who="api:token", reason="resize", data={**base, "kv_target_gib": kv_target_gib, "_config_base": base}, diff=None
    )
    store.close()
    return cfg


def test_config_show_and_plan_say_the_budget_of_a_resize_in_effect(tmp_path: Path) -> None:
    """A resize is saved as a revision, not in the config file: ``config show`` printed the file's
    ``kv_target_gib = 20.0`` and ``plan`` a "KV target 20.00 GiB default" while the daemon ran on 4 (note 11)."""
    cfg = _with_resize_revision(tmp_path, 4.0)
    r = CliRunner().invoke(main, ["--config", str(cfg), "config", "show", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["budget"]["kv_target_gib"] == 4.0
    assert "revision 2 (resize, by api:token" in r.stderr and "kv_target_gib 20.0 -> 4.0" in r.stderr, r.stderr
    r = CliRunner().invoke(main, ["--config", str(cfg), "config", "show"])
    assert r.stdout.startswith("# budget: revision 2") and "kv_target_gib = 4.0" in r.stdout, r.stdout[:500]
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", "--mem-total-gib", "121.69", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert p["kv_target_gib"] == 4.0 and p["inputs"]["sources"]["kv_target_gib"] == "resize", p["inputs"]
    # a flag still wins over the revision
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", "--mem-total-gib", "121.69", "--kv-target-gib", "8"])
    assert r.exit_code == 0, r.output
    assert any("KV target" in line and "8.00 GiB" in line and "flag" in line for line in r.stdout.splitlines())


def test_a_revision_made_on_another_configuration_is_not_shown(tmp_path: Path) -> None:
    """The config file's [budget] edited after the resize: the file wins (the daemon does the same)."""
    cfg = _with_resize_revision(tmp_path, 4.0)
    cfg.write_text(cfg.read_text().replace("weights_gib = 71.75", "weights_gib = 70.0"))
    r = CliRunner().invoke(main, ["--config", str(cfg), "config", "show", "--json"])
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert json.loads(r.stdout)["budget"]["kv_target_gib"] == 20.0


def test_a_plan_with_no_weights_names_the_flags_not_pythons_none(tmp_path: Path) -> None:
    """``sparkd plan`` with nothing given said "budget.weights_gib: None is not allowed" (note 11)."""
    code, out = _run(tmp_path, "--mem-total-gib", "121.69")
    assert code != 0
    assert "budget.weights_gib: not set" in out and "--weights-gib" in out and "--model-dir" in out, out
    assert "None" not in out, out
