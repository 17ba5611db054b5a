"""The memory budget: CONTEXT.md's worked example, properties, refusals, rendering."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sparkd.core.budget import (
    BudgetInputs,
    Plan,
    floor_gmu,
    make_plan,
)
from sparkd.core.plan_table import render_plan_table
from sparkd.errors import InvalidInput, Refused
from sparkd.sense.checkpoint import checkpoint_weight_bytes
from sparkd.units import GiB, MiB

MEM_TOTAL_BYTES = round(121.69 * GiB)


def example(**changes: object) -> BudgetInputs:
    """CONTEXT.md's worked example; keyword arguments replace fields."""
    base = BudgetInputs(
        mem_total_bytes=MEM_TOTAL_BYTES,
        weights_gib=71.75,
        overhead_gib=5.60,
        mtp_enabled=True,
        mtp_gib=1.49,
        max_model_len=262144,
        kv_bytes_per_token=29482,
        kv_cache_dtype="fp8",
        kv_target_gib=20,
        host_reserve_gib=26,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        model="/models/flash-next",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# --- the worked example ------------------------------------------------------


def test_it_reproduces_the_worked_example() -> None:
    p = make_plan(example())
    assert round(p.mem_total_gib, 2) == 121.69
    assert round(p.weights_gib, 2) == 71.75
    assert round(p.fixed_gib, 2) == 78.84
    assert round(p.kv_need_gib, 2) == 4.17
    assert round(p.wish_gib, 2) == 98.84
    assert round(p.cap_gib, 2) == 95.69
    assert p.gmu == 0.786
    assert round(p.budget_gib, 2) == 95.65
    assert round(p.kv_exp_gib, 2) == 16.81
    assert round(p.max_len_concurrency, 2) == 4.03
    assert math.floor(p.max_len_concurrency) == 4
    assert round(p.docker_memory_gib, 2) == 100.65
    assert p.docker_memory_swap_bytes == p.docker_memory_bytes
    assert p.docker_memory_bytes % MiB == 0
    assert p.squeezed is True
    assert p.gmu_source == "formula"


def test_it_gives_vllm_args_of_the_example() -> None:
    assert make_plan(example()).vllm_args() == [
        "--model",
        "/models/flash-next",
        "--gpu-memory-utilization",
        "0.786",
        "--max-model-len",
        "262144",
        "--kv-cache-dtype",
        "fp8",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "2048",
    ]


def test_it_omits_the_model_when_not_given_and_appends_extra_args() -> None:
    spec = '{"method":"mtp","num_speculative_tokens":3}'
    extra = ("--speculative-config", spec)
    args = make_plan(example(model=None, extra_vllm_args=extra)).vllm_args()
    assert "--model" not in args
    assert args[:2] == ["--gpu-memory-utilization", "0.786"]
    assert args[-2:] == ["--speculative-config", spec]


@pytest.mark.parametrize(
    ("dtype", "mult", "vllm_name"),
    [
        ("auto", 1.0, "auto"),
        ("bf16", 1.0, "auto"),
        ("fp16", 1.0, "auto"),
        ("fp8", 0.58, "fp8"),
        ("fp8_e4m3", 0.58, "fp8_e4m3"),
        ("fp8_e5m2", 0.58, "fp8_e5m2"),
    ],
)
def test_it_maps_kv_cache_dtypes(dtype: str, mult: float, vllm_name: str) -> None:
    p = make_plan(example(kv_cache_dtype=dtype, max_model_len=32768))
    assert p.kv_mult == mult
    assert p.kv_need_gib == pytest.approx(32768 * 29482 * mult / GiB)
    args = p.vllm_args()
    assert args[args.index("--kv-cache-dtype") + 1] == vllm_name


def test_it_accepts_a_custom_kv_mult_table() -> None:
    p = make_plan(example(kv_cache_dtype="int4", kv_mult_table={"int4": 0.3}))
    assert p.kv_mult == 0.3


def test_it_json_has_the_promised_keys() -> None:
    d = make_plan(example()).to_json()
    for key in (
        "mem_total_gib",
        "weights_gib",
        "fixed_gib",
        "kv_need_gib",
        "wish_gib",
        "cap_gib",
        "gmu",
        "budget_gib",
        "kv_exp_gib",
        "max_len_concurrency",
        "docker_memory_gib",
        "docker_memory_swap_gib",
        "kv_mult",
        "squeezed",
        "inputs",
        "vllm_args",
        "warnings",
    ):
        assert key in d, key
    assert d["gmu"] == 0.786
    assert d["inputs"]["max_model_len"] == 262144
    json.dumps(d)  # serialisable as is


def test_it_derives_w_from_checkpoint_bytes_and_ple() -> None:
    p = make_plan(example(weights_gib=None, weight_bytes=80 * GiB, ple_bytes=round(8.25 * GiB)))
    assert p.checkpoint_gib == 80
    assert p.ple_gib == pytest.approx(8.25)
    assert p.weights_gib == pytest.approx(71.75)
    assert p.gmu == 0.786


def test_it_applies_the_mtp_off_credit_only_when_mtp_is_off() -> None:
    on = make_plan(example(mtp_off_credit_gib=2.0))
    off = make_plan(example(mtp_enabled=False, mtp_off_credit_gib=2.0))
    assert on.mtp_off_credit_applied_gib == 0
    assert on.fixed_gib == pytest.approx(71.75 + 5.60 + 1.49)
    assert off.mtp_off_credit_applied_gib == 2.0
    assert off.mtp_gib == 0
    assert off.fixed_gib == pytest.approx(71.75 - 2.0 + 5.60)


def test_it_caps_the_mtp_off_credit_at_w() -> None:
    p = make_plan(example(weights_gib=1.0, mtp_enabled=False, mtp_off_credit_gib=3.0))
    assert p.mtp_off_credit_applied_gib == 1.0
    assert p.weights_gib == 0


def test_it_is_not_squeezed_when_the_cap_leaves_room() -> None:
    p = make_plan(example(weights_gib=40.0))
    assert not p.squeezed
    assert p.wish_gib < p.cap_gib
    assert p.gmu == math.floor((40 + 5.6 + 1.49 + 20) / p.mem_total_gib * 1000) / 1000
    assert not any("squeezed" in w for w in p.warnings)


def test_it_warns_about_the_26_gib_reserve_and_not_about_28() -> None:
    assert any("28" in w for w in make_plan(example()).warnings)
    at_28 = make_plan(example(host_reserve_gib=28))
    assert not any("host_reserve_gib" in w for w in at_28.warnings)


def test_it_warns_when_max_num_seqs_exceeds_max_length_concurrency() -> None:
    assert not any("max_num_seqs" in w for w in make_plan(example()).warnings)
    assert any("max_num_seqs 8 > 4.03" in w for w in make_plan(example(max_num_seqs=8)).warnings)


# --- gmu_override --------------------------------------------------------------


def test_it_uses_a_gmu_override_within_the_cap() -> None:
    p = make_plan(example(gmu_override=0.75))
    assert p.gmu == 0.75
    assert p.gmu_source == "override"
    assert p.budget_gib == pytest.approx(0.75 * 121.69)
    assert any("gmu_override 0.750" in w for w in p.warnings)


def test_it_refuses_a_gmu_override_above_the_cap() -> None:
    with pytest.raises(Refused) as e:
        make_plan(example(gmu_override=0.8))
    assert "gmu_override" in e.value.message
    assert "≤ 0.786" in e.value.message
    assert "host_reserve_gib" in e.value.message


@pytest.mark.parametrize("bad", [0, -0.1, 1.01, 0.7865, float("nan")])
def test_it_rejects_a_gmu_override_out_of_range(bad: float) -> None:
    with pytest.raises(InvalidInput) as e:
        make_plan(example(gmu_override=bad))
    assert e.value.field == "gmu_override"
    assert "0 < gmu ≤ 1" in e.value.message


# --- the floor -----------------------------------------------------------------


def test_it_floors_0_786_without_float_artefacts() -> None:
    # On a 100.11 GiB host, 0.786 * T / T * 1000 is 785.999…: a bare floor gives 0.785.
    total = 100.11
    assert math.floor(0.786 * total / total * 1000) == 785
    assert floor_gmu(0.786 * total, total) == 0.786


def test_it_floors_down_and_never_up() -> None:
    assert floor_gmu(95.69, 121.69) == 0.786  # 0.78634…
    assert floor_gmu(121.69 * 0.7869999, 121.69) == 0.786


@given(milli=st.integers(1, 1000), total=st.floats(8, 1024))
def test_it_floor_is_idempotent_on_every_step(milli: int, total: float) -> None:
    g = milli / 1000
    assert floor_gmu(g * total, total) == g


# --- properties ----------------------------------------------------------------

inputs_strategy = st.builds(
    BudgetInputs,
    mem_total_bytes=st.integers(16 * GiB, 1024 * GiB),
    max_model_len=st.integers(1, 262144),
    kv_bytes_per_token=st.integers(1, 200_000),
    weights_gib=st.floats(0, 200),
    overhead_gib=st.floats(0, 10),
    mtp_enabled=st.booleans(),
    mtp_gib=st.floats(0, 4),
    mtp_off_credit_gib=st.floats(0, 4),
    kv_target_gib=st.floats(0, 64),
    host_reserve_gib=st.floats(0, 15.9),
    kv_cache_dtype=st.sampled_from(["auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"]),
    max_num_seqs=st.integers(1, 256),
    max_num_batched_tokens=st.integers(1, 65536),
    docker_headroom_gib=st.floats(0, 16),
)


@settings(max_examples=400)
@given(inputs_strategy)
def test_it_keeps_gmu_and_budget_within_the_host_cap(i: BudgetInputs) -> None:
    try:
        p = make_plan(i)
    except Refused as e:
        # The only refusals a valid input can meet: the plan does not fit.
        assert any(s in e.message for s in ("KV room", "does not fit", "gpu-memory-utilization"))
        return
    total = i.mem_total_bytes / GiB
    one_byte = 1 / GiB
    assert 0 < p.gmu <= 1
    assert p.gmu <= (total - i.host_reserve_gib) / total + 1e-12  # float rounding, < 1 byte
    assert p.budget_gib <= p.cap_gib + one_byte
    assert abs(min(p.wish_gib, p.cap_gib) - p.budget_gib) < total / 1000 + one_byte  # at most 1 step either way
    if p.budget_gib > min(p.wish_gib, p.cap_gib) + one_byte:  # rounded up: only to hold one max-length request
        assert p.kv_exp_gib - total / 1000 < p.kv_need_gib
    assert Decimal(str(p.gmu)).as_tuple().exponent >= -3  # type: ignore[operator]
    assert p.kv_exp_gib >= p.kv_need_gib
    assert p.max_len_concurrency >= 1
    assert p.docker_memory_bytes <= (p.budget_gib + i.docker_headroom_gib) * GiB
    assert p.squeezed == (p.wish_gib > p.cap_gib)


@settings(max_examples=200)
@given(inputs_strategy)
def test_it_refuses_exactly_when_the_kv_room_is_below_one_request(i: BudgetInputs) -> None:
    # refused exactly when the largest gmu step within the cap holds no max-length request (budget.py docstring)
    total = i.mem_total_bytes / GiB
    assume(floor_gmu(min(_wish(i), total - i.host_reserve_gib), total) > 0)
    kv_exp = floor_gmu(total - i.host_reserve_gib, total) * total - _fixed(i)
    kv_need = i.max_model_len * i.kv_bytes_per_token * i.kv_mult_table[i.kv_cache_dtype] / GiB
    if kv_exp < kv_need:
        with pytest.raises(Refused):
            make_plan(i)
    else:
        assert isinstance(make_plan(i), Plan)


def _fixed(i: BudgetInputs) -> float:
    w = float(i.weights_gib or 0)
    if not i.mtp_enabled:
        w -= min(i.mtp_off_credit_gib, max(w, 0))
    return w + i.overhead_gib + (i.mtp_gib if i.mtp_enabled else 0)


def _wish(i: BudgetInputs) -> float:
    kv_need = i.max_model_len * i.kv_bytes_per_token * i.kv_mult_table[i.kv_cache_dtype] / GiB
    return _fixed(i) + max(kv_need, i.kv_target_gib)


# --- refusals ------------------------------------------------------------------


def test_it_refuses_when_kv_room_is_below_one_max_length_request() -> None:
    # fp8: 1M tokens × 29482 B × 0.58 = 16.70 GiB still fits in 16.81 GiB; 2M does not.
    with pytest.raises(Refused) as e:
        make_plan(example(max_model_len=2 * 1048576))
    msg = e.value.message
    assert "KV room 16.81 GiB" in msg
    limit = math.floor(make_plan(example()).kv_exp_gib * GiB / (29482 * 0.58))
    assert f"lower max_model_len to ≤ {limit}" in msg.lower()
    assert "host_reserve_gib" in msg
    assert make_plan(example(max_model_len=limit)).max_len_concurrency >= 1
    with pytest.raises(Refused):
        make_plan(example(max_model_len=limit + 1))


def test_it_suggests_fp8_only_when_kv_is_not_fp8_yet() -> None:
    with pytest.raises(Refused) as bf16:
        make_plan(example(kv_cache_dtype="auto", max_model_len=1048576))
    assert "fp8" in bf16.value.message
    with pytest.raises(Refused) as fp8:
        make_plan(example(max_model_len=2 * 1048576))
    assert "use an fp8" not in fp8.value.message


def test_it_refuses_when_the_fixed_part_does_not_fit() -> None:
    with pytest.raises(Refused) as e:
        make_plan(example(weights_gib=100.0))
    assert "does not fit" in e.value.message
    assert "host_reserve_gib" in e.value.message


def test_it_refuses_a_gmu_of_zero() -> None:
    with pytest.raises(Refused) as e:
        make_plan(
            example(weights_gib=0, overhead_gib=0, mtp_gib=0, kv_target_gib=0, max_model_len=1, kv_bytes_per_token=1)
        )
    assert "0.000" in e.value.message
    assert "0 < gmu ≤ 1" in e.value.message


@pytest.mark.parametrize(
    ("changes", "field", "allowed"),
    [
        ({"mem_total_bytes": 0}, "mem_total_bytes", "≥ 1"),
        ({"mem_total_bytes": 121.69}, "mem_total_bytes", "integer"),
        ({"max_model_len": 0}, "max_model_len", "≥ 1"),
        ({"kv_bytes_per_token": -1}, "kv_bytes_per_token", "≥ 1"),
        ({"max_num_seqs": 0}, "max_num_seqs", "≥ 1"),
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens", "≥ 1"),
        ({"weights_gib": -1.0}, "weights_gib", "≥ 0"),
        ({"weights_gib": None}, "weights_gib", "exactly one"),
        ({"weight_bytes": 10 * GiB}, "weights_gib", "exactly one"),
        ({"weights_gib": None, "weight_bytes": -1}, "weight_bytes", "≥ 0"),
        ({"weights_gib": None, "weight_bytes": GiB, "ple_bytes": 2 * GiB}, "ple_bytes", "≤ weight_bytes"),
        ({"ple_bytes": GiB}, "ple_bytes", "after PLE"),
        ({"overhead_gib": -0.1}, "overhead_gib", "≥ 0"),
        ({"mtp_gib": float("inf")}, "mtp_gib", "finite"),
        ({"kv_target_gib": -1}, "kv_target_gib", "≥ 0"),
        ({"docker_headroom_gib": -5}, "docker_headroom_gib", "≥ 0"),
        ({"host_reserve_gib": 121.7}, "host_reserve_gib", "< MemTotal (121.69 GiB)"),
        ({"host_reserve_gib": -1}, "host_reserve_gib", "0 ≤"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype", "fp8"),
        ({"kv_mult_table": {"fp8": 0}}, "kv_mult_table[fp8]", "0 < m"),
        ({"model": " "}, "model", "non-empty"),
    ],
)
def test_it_names_the_bad_field_and_its_range(changes: dict[str, object], field: str, allowed: str) -> None:
    with pytest.raises(InvalidInput) as e:
        make_plan(example(**changes))
    assert e.value.field == field
    assert field in e.value.message
    assert allowed in e.value.message


# --- the table -------------------------------------------------------------------


def test_it_renders_a_table_with_the_figures_and_the_command() -> None:
    text = render_plan_table(make_plan(example()), image="vllm/vllm-openai:v0.11.0")
    for figure in (
        "121.69 GiB",
        "71.75 GiB",
        "78.84 GiB",
        "4.17 GiB",
        "98.84 GiB",
        "95.69 GiB",
        "0.786",
        "95.65 GiB",
        "16.81 GiB",
        "4.03",
        "100.65 GiB",
        "262144",
        "29482",
        "fp8 (KV_MULT 0.58)",
        "4 / 2048",
    ):
        assert figure in text, figure
    assert "SQUEEZED" in text
    for flag in (
        "docker run",
        "--memory 103063m",
        "--memory-swap 103063m",
        "--ipc host",
        "--network host",
        "--gpu-memory-utilization 0.786",
        "vllm/vllm-openai:v0.11.0",
        "--label sparkd.managed=true",
    ):
        assert flag in text, flag
    assert "28" in text  # the reserve warning


def test_it_says_when_not_squeezed() -> None:
    text = render_plan_table(make_plan(example(weights_gib=40.0, host_reserve_gib=28)))
    assert "not squeezed" in text
    assert "SQUEEZED" not in text


# --- checkpoint size (I/O) -----------------------------------------------------


def _write(p: Path, n: int) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"\0" * n)
    return p


def test_it_sums_safetensors_and_ignores_other_files(tmp_path: Path) -> None:
    _write(tmp_path / "model-00001-of-00002.safetensors", 1000)
    _write(tmp_path / "sub" / "model-00002-of-00002.safetensors", 500)
    _write(tmp_path / "config.json", 77)
    _write(tmp_path / "pytorch_model.bin", 3000)  # vLLM prefers safetensors: not counted
    assert checkpoint_weight_bytes(tmp_path) == 1500


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ({"a.bin": 10, "b.pt": 5}, 15),
        ({"m.gguf": 42}, 42),
        ({"README.md": 9}, 0),
    ],
)
def test_it_falls_back_to_other_weight_formats(tmp_path: Path, names: dict[str, int], expected: int) -> None:
    for name, size in names.items():
        _write(tmp_path / name, size)
    assert checkpoint_weight_bytes(tmp_path) == expected


def test_it_counts_file_links_once_and_skips_dir_links(tmp_path: Path) -> None:
    blob = _write(tmp_path / "blobs" / "abc", 700)
    snap = tmp_path / "snap"
    snap.mkdir()
    os.symlink(blob, snap / "model.safetensors")  # the Hugging Face cache layout
    os.symlink(blob, snap / "again.safetensors")  # same inode: once
    os.symlink(tmp_path / "missing", snap / "broken.safetensors")
    _write(tmp_path / "outside" / "x.safetensors", 9999)
    os.symlink(tmp_path / "outside", snap / "linked-dir")  # not followed
    assert checkpoint_weight_bytes(snap) == 700


def test_it_reads_one_weight_file_and_rejects_others(tmp_path: Path) -> None:
    assert checkpoint_weight_bytes(_write(tmp_path / "m.gguf", 12)) == 12
    with pytest.raises(InvalidInput):
        checkpoint_weight_bytes(_write(tmp_path / "notes.txt", 1))
    with pytest.raises(InvalidInput) as e:
        checkpoint_weight_bytes(tmp_path / "nope")
    assert e.value.field == "checkpoint"


# --- KV layouts beyond one figure per token (issue 19) -------------------------------


def test_it_puts_the_per_sequence_state_into_the_fixed_part() -> None:
    # 4 sequences × 256 MiB = 1 GiB more fixed; the cap squeezes, so the KV room shrinks by it
    p = make_plan(example(state_bytes_per_seq=256 * MiB))
    assert p.state_gib == 1.0
    assert round(p.fixed_gib, 2) == 79.84 and p.gmu == 0.786
    assert round(p.kv_exp_gib, 2) == 15.81


def test_it_bounds_sliding_window_layers_by_their_window() -> None:
    # no full layer; 4,096-token window of 131,072 B/token: 4096 × 131072 × 0.58 B, whatever max_model_len is
    i = example(kv_bytes_per_token=0, kv_window_groups=((4096, 131_072),))
    assert make_plan(i).kv_need_gib == 4096 * 131_072 * 0.58 / GiB
    assert make_plan(dataclasses.replace(i, max_model_len=1_000_000)).kv_need_gib == make_plan(i).kv_need_gib


def test_its_max_len_suggestion_accounts_for_the_windows() -> None:
    i = example(kv_bytes_per_token=100_000, kv_window_groups=((1024, 1_000_000),), max_model_len=1_000_000)
    with pytest.raises(Refused) as e:
        make_plan(i)
    limit = int(e.value.message.split("max_model_len to ≤ ")[1].split(",")[0])
    # the suggestion is the longest that fits: it plans, one token more is refused
    assert make_plan(dataclasses.replace(i, max_model_len=limit)).kv_exp_gib >= 0
    with pytest.raises(Refused):
        make_plan(dataclasses.replace(i, max_model_len=limit + 1))
    assert "min(max_model_len, 1024) × 1000000 B" in e.value.message


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),  # 0 only when windows hold the KV
        ({"kv_window_groups": ((0, 5),)}, "kv_window_groups"),
        ({"state_bytes_per_seq": -1}, "state_bytes_per_seq"),
        ({"model_max_len": 0}, "model_max_len"),
        ({"sources": {"overhead_gib": "rumour"}}, "sources[overhead_gib]"),
    ],
)
def test_it_refuses_bad_layout_fields(changes: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as e:
        make_plan(example(**changes))
    assert e.value.field == field


def test_a_wish_set_by_one_request_is_not_floored_below_it() -> None:
    """The notes' example with KV_TARGET_GIB 2 (below its 4.17 GiB request): floored, gmu 0.694 gave "KV room 4.15
    GiB is below one max-length request 4.17 GiB ... or raise the host budget (host_reserve_gib now 26)", whatever the
    reserve (an operator's walk-through). The next step holds the request and stays within the cap."""
    p = make_plan(example(kv_target_gib=2.0))
    assert p.kv_exp_gib >= p.kv_need_gib and p.kv_need_gib == pytest.approx(4.17, abs=0.01)
    assert p.budget_gib <= p.cap_gib and p.budget_gib - p.wish_gib < 121.69 / 1000
    assert floor_gmu(p.wish_gib, 121.69) + 0.001 == pytest.approx(p.gmu)
    # where the cap binds, the floor stays (the worked example: 0.786)
    assert make_plan(example()).gmu == pytest.approx(0.786)
