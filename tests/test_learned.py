"""Start-up peaks learned from launch records (pure)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sparkd.core.learned import LaunchPeak, config_key, learn, peak_from_record, recommended_reserve_bytes
from sparkd.face.cli import main
from sparkd.ops.preflight import run_preflight
from sparkd.store.store import Store
from sparkd.units import GiB

BUDGET = 95 * GiB
AT_LAUNCH = 118 * GiB  # MemAvailable when the launch began: plan floor = 118 − 95 = 23 GiB


def _peak(i: int, below_plan_gib: int) -> LaunchPeak:
    return LaunchPeak(f"l{i}", 1000.0 + i, BUDGET, AT_LAUNCH, AT_LAUNCH - BUDGET - below_plan_gib * GiB)


def test_it_learns_the_worst_overshoot_of_three_launches() -> None:
    learned = learn([_peak(1, 6), _peak(2, 7), _peak(3, 8)])
    assert learned is not None
    assert learned.overshoot_bytes == 8 * GiB
    assert [e.launch_id for e in learned.evidence] == ["l3", "l2", "l1"]  # newest first
    assert learned.to_json()["launches"][0]["trough_bytes"] == 15 * GiB  # 23 − 8


def test_a_start_up_that_stayed_above_plan_learns_zero() -> None:
    learned = learn([_peak(1, -2)])
    assert learned is not None and learned.overshoot_bytes == 0


def test_no_launches_learn_nothing() -> None:
    assert learn([]) is None


def test_the_recommended_reserve_keeps_the_trough_above_the_stop_line() -> None:
    # plan floor 23 GiB, learned overshoot 8 → expected trough 15 GiB; stop line 16 GiB + 2 GiB margin → +3 GiB
    r = recommended_reserve_bytes(
        host_reserve_bytes=26 * GiB,
        plan_floor_bytes=23 * GiB,
        learned_overshoot_bytes=8 * GiB,
        stop_line_bytes=16 * GiB,
        margin_bytes=2 * GiB,
    )
    assert r == 29 * GiB
    # already enough: unchanged
    assert (
        recommended_reserve_bytes(
            host_reserve_bytes=26 * GiB,
            plan_floor_bytes=30 * GiB,
            learned_overshoot_bytes=8 * GiB,
            stop_line_bytes=6 * GiB,
            margin_bytes=2 * GiB,
        )
        == 26 * GiB
    )


def test_the_config_key_ignores_order_and_changes_with_the_shape() -> None:
    a = config_key({"image": "vllm:1", "max_num_seqs": 4, "kv_cache_dtype": "fp8"})
    assert a == config_key({"kv_cache_dtype": "fp8", "max_num_seqs": 4, "image": "vllm:1"})
    assert a != config_key({"image": "vllm:1", "max_num_seqs": 8, "kv_cache_dtype": "fp8"})


def test_it_reads_a_stored_launch_record() -> None:
    rec = {
        "id": "abc",
        "started_at": 5.0,
        "trough_bytes": 17 * GiB,
        "plan": {"budget_gib": 95.0},
        "actual": {"mem_available_at_launch_bytes": AT_LAUNCH},
    }
    p = peak_from_record(rec)
    assert p is not None and p.overshoot_bytes == 6 * GiB
    assert peak_from_record({**rec, "trough_bytes": None}) is None


# --------------------------------------------------------------------------- sparkd plan and preflight
IMAGE = "vllm/vllm-openai:v0.9.2"
WORKED = [
    "--mem-total-gib", "121.69", "--weights-gib", "71.75", "--overhead-gib", "5.60", "--mtp", "--mtp-gib", "1.49",
    "--max-model-len", "262144", "--kv-bytes-per-token", "29482", "--kv-cache-dtype", "fp8",
    "--kv-target-gib", "20", "--host-reserve-gib", "26", "--max-num-seqs", "4", "--max-num-batched-tokens", "2048",
]  # fmt: skip
# what shapes the start-up peak of that configuration (loop.launch.launch_config_parts)
PARTS = {
    "image": IMAGE,
    "model": None,
    "max_num_seqs": 4,
    "max_model_len": 262144,
    "kv_cache_dtype": "fp8",
    "graph": "",
}


def _plan_json(tmp_path: Path, extra_toml: str = "") -> dict[str, Any]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[container]\nimage = "{IMAGE}"\n{extra_toml}')
    r = CliRunner().invoke(main, ["--config", str(cfg), "plan", *WORKED, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)  # type: ignore[no-any-return]


def _three_launches(tmp_path: Path, budget_bytes: int) -> None:
    """Three past launches of this configuration: MemAvailable 110 GiB at launch, troughs 6, 7, 8 GiB below plan."""
    store = Store.open(tmp_path / "sparkd.db")
    try:
        for i, below in enumerate((6, 7, 8)):
            store.save_launch(
                {
                    "id": f"launch{i}",
                    "started_at": 1000.0 + i,
                    "status": "stopped",
                    "plan": {"budget_bytes": budget_bytes},
                    "actual": {"config_key": config_key(PARTS), "mem_available_at_launch_bytes": 110 * GiB},
                    "trough_bytes": 110 * GiB - budget_bytes - below * GiB,
                }
            )
        # a launch of another configuration (8 sequences) dipped further: it does not count here
        store.save_launch(
            {
                "id": "other",
                "started_at": 2000.0,
                "status": "stopped",
                "plan": {"budget_bytes": budget_bytes},
                "actual": {
                    "config_key": config_key({**PARTS, "max_num_seqs": 8}),
                    "mem_available_at_launch_bytes": 110 * GiB,
                },
                "trough_bytes": 0,
            }
        )
    finally:
        store.close()


def test_plan_json_shows_the_learned_overshoot_and_the_recommended_reserve(tmp_path: Path) -> None:
    first = _plan_json(tmp_path)
    assert first["learned"] is None  # no database yet: nothing learned
    budget = int(first["budget_gib"] * GiB)
    _three_launches(tmp_path, budget)
    out = _plan_json(tmp_path)
    learned = out["learned"]
    assert learned["config_key"] == config_key(PARTS)
    assert learned["learned_overshoot_bytes"] == 8 * GiB  # the worst of 6, 7, 8
    assert [e["launch_id"] for e in learned["evidence"]] == ["launch2", "launch1", "launch0"]
    assert [e["trough_bytes"] for e in learned["evidence"]] == [110 * GiB - budget - b * GiB for b in (8, 7, 6)]
    # floor 110 GiB − budget, minus 8 GiB must stay ≥ 6 GiB stop line + 2 GiB margin
    need = 6 * GiB + 2 * GiB - (110 * GiB - budget - 8 * GiB)
    assert need > 0
    assert learned["recommended_reserve_bytes"] == 26 * GiB + need
    assert learned["applied"] is False and out["inputs"]["host_reserve_gib"] == 26.0
    assert out["gmu"] == first["gmu"] == 0.786


def test_the_learned_reserve_is_applied_only_when_asked_and_shown(tmp_path: Path) -> None:
    budget = int(_plan_json(tmp_path)["budget_gib"] * GiB)
    _three_launches(tmp_path, budget)
    out = _plan_json(tmp_path, "[budget]\napply_learned_reserve = true\n")
    learned = out["learned"]
    assert learned["applied"] is True
    assert out["inputs"]["host_reserve_gib"] == pytest.approx(learned["recommended_reserve_bytes"] / GiB)
    assert out["gmu"] < 0.786  # a larger reserve, a smaller budget
    cfg = tmp_path / "c.toml"
    table = CliRunner().invoke(main, ["--config", str(cfg), "plan", *WORKED]).output
    assert "learned start-up overshoot: 8.00 GiB below the plan's floor (worst of 3 launches" in table
    assert "launch launch2: planned floor " in table and "APPLIED (budget.apply_learned_reserve)" in table


def test_preflight_refuses_when_memavailable_is_short_by_the_learned_overshoot(tmp_path: Path) -> None:
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()
    total = 128 * GiB
    # GMU 0.5: 64 GiB; MemAvailable 69 GiB clears the 2 GiB margin but not an 8 GiB learned overshoot
    (proc / "meminfo").write_text(f"MemTotal: {total // 1024} kB\nMemFree: 0 kB\nMemAvailable: {69 * GiB // 1024} kB\n")
    kw: dict[str, Any] = {"gmu": 0.5, "margin_bytes": 2 * GiB, "running_managed": [], "proc_root": str(proc)}
    kw |= {"shm_dir": str(shm), "clean_shm": False}
    assert run_preflight(**kw).ok
    pf = run_preflight(**kw, learned_overshoot_bytes=8 * GiB)
    assert not pf.ok
    assert pf.failures[0].startswith(
        "MemAvailable 69.00 GiB < GMU 0.500 x MemTotal 128.00 GiB + learned start-up overshoot 8.00 GiB = 72.00 GiB"
    )
    assert run_preflight(**kw, learned_overshoot_bytes=4 * GiB).ok


def test_preflight_judges_usable_memory_where_free_cma_fills_memavailable(tmp_path: Path) -> None:
    """Free CMA counts in MemAvailable, yet the driver cannot allocate from it: a launch needing 66 GiB passed at
    MemAvailable 100 GiB with 40 GiB of it free CMA (helper-47). It is judged on usable memory, as the stop lines."""
    proc, shm = tmp_path / "proc", tmp_path / "shm"
    proc.mkdir()
    shm.mkdir()
    (proc / "meminfo").write_text(
        f"MemTotal: {128 * GiB // 1024} kB\nMemFree: 0 kB\nMemAvailable: {100 * GiB // 1024} kB\n"
        f"CmaTotal: {48 * GiB // 1024} kB\nCmaFree: {40 * GiB // 1024} kB\n"
    )
    kw: dict[str, Any] = {"gmu": 0.5, "margin_bytes": 2 * GiB, "running_managed": [], "proc_root": str(proc)}
    pf = run_preflight(**kw, shm_dir=str(shm), clean_shm=False)
    assert not pf.ok
    assert pf.failures[0].startswith(
        "usable memory (MemAvailable − CmaFree 40.00 GiB) 60.00 GiB < GMU 0.500 x MemTotal 128.00 GiB + margin"
    ), pf.failures


def test_the_start_up_trough_is_learned_in_usable_memory(tmp_path: Path) -> None:
    """The trough was MemAvailable while the preflight judges usable memory: free CMA growing during a load (0.13 →
    8.81 GiB) was missing from the learned overshoot, and the preflight passed a launch that dipped to 0.2 GiB usable
    (helper-49). Trough and the figure at the launch are both usable memory now."""
    from sparkd.config import load_settings
    from sparkd.core.lifecycle import ContainerState
    from sparkd.core.sample import Sample, derive
    from sparkd.loop.supervisor import Supervisor

    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": {"guard": "sparkd-trough-test"}})
    sup = Supervisor(settings, manager=object())  # type: ignore[arg-type]
    sup.state = ContainerState.STARTING
    for avail, cma in ((20 * GiB, GiB // 8), (10 * GiB, int(8.81 * GiB)), (12 * GiB, 4 * GiB)):
        s = Sample(ts=0.0, mono=0.0, mem_available=avail, cma_free=cma)
        derive(s)
        sup.observe(s)
    assert sup.trough_bytes == 10 * GiB - int(8.81 * GiB)  # 1.19 GiB usable, not MemAvailable's 10 GiB
