"""Start-up peaks learned from launch records (pure)."""

from __future__ import annotations

from sparkd.core.learned import LaunchPeak, config_key, learn, peak_from_record, recommended_reserve_bytes
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
