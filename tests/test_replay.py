"""``sparkd.ops.replay``: trace loaders, interpolation, the replay result, the CLI command."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tracemalloc
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from sparkd import config
from sparkd.config import DEFAULT_RULES, SEED_RULES
from sparkd.core.sample import Sample
from sparkd.ops.replay import (
    MAX_TRACE_POINTS,
    Trace,
    TraceError,
    compare_text,
    interpolate,
    load_csv,
    load_db,
    loads_csv,
    replay,
    replay_command,
)
from sparkd.units import GiB, MiB
from tests.conftest import fixture

MEM_TOTAL = round(121.69 * GiB)


@pytest.fixture(autouse=True)
def _no_system_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The CLI must not pick up /etc/sparkd/sparkd.toml or SPARKD_* from the developer's machine."""
    monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    for k in list(os.environ):
        if k.startswith("SPARKD_"):
            monkeypatch.delenv(k)


def startup_path() -> str:
    return str(fixture("meminfo", "startup-collapse.csv"))


# ------------------------------------------------------------------ loaders


def test_generic_csv_gib_columns() -> None:
    trace = load_csv(startup_path())
    assert [s.mono for s in trace.samples] == [0.0, 2.0, 4.0, 6.0]
    assert [s.mem_available for s in trace.samples] == [round(v * GiB) for v in (28.97, 23.79, 10.61, 6.27)]
    assert all(s.mem_free is None for s in trace.samples)
    assert trace.interval_s == 2.0
    assert trace.notes == ["columns not used: used_gib, container_cgroup_current_gib"]
    assert not any(trace.synthetic)
    assert trace.epoch is False


def test_phase_rows_are_ordered_and_spaced_by_assumption() -> None:
    trace = load_csv(fixture("meminfo", "page-cache-flood.csv"), row_interval_s=2.0)
    assert [s.mono for s in trace.samples] == [0.0, 2.0, 4.0]
    assert trace.labels == ["baseline", "after_writing_60GB", "after_deleting_it"]
    assert [s.cached for s in trace.samples] == [round(v * GiB) for v in (12.64, 72.64, 12.61)]
    assert trace.notes[0] == (
        "rows are phases without times (baseline, after_writing_60GB, after_deleting_it); "
        "spaced 2 s apart by assumption"
    )


def sparkd_csv(samples: list[Sample]) -> str:
    """What ``sparkd samples --csv`` writes: the store's columns, bytes, epoch ts."""
    buf = io.StringIO()
    rows = [s.to_row() for s in samples]
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def test_sparkd_samples_csv_round_trip() -> None:
    t0 = 1_764_000_000.5
    src = [
        Sample(
            ts=t0 + i,
            mono=0.0,
            mem_total=MEM_TOTAL,
            mem_available=(9 - i) * GiB,
            mem_free=GiB,
            psi_some_avg10=1.25,
            nvrm_recent=i,
        )
        for i in range(3)
    ]
    trace = loads_csv(sparkd_csv(src), source="samples.csv")
    assert trace.epoch is True
    assert [s.ts for s in trace.samples] == [t0, t0 + 1, t0 + 2]
    assert [s.mono for s in trace.samples] == [0.0, 1.0, 2.0]
    assert [s.mem_available for s in trace.samples] == [9 * GiB, 8 * GiB, 7 * GiB]
    assert [s.nvrm_recent for s in trace.samples] == [0, 1, 2]
    assert trace.samples[0].psi_some_avg10 == 1.25
    assert trace.samples[0].mem_total == MEM_TOTAL
    assert trace.samples[0].swap_total is None  # empty cell
    assert trace.mem_total == MEM_TOTAL
    assert trace.notes == []


@pytest.mark.parametrize(
    ("text", "t", "avail", "free"),
    [
        (
            "time,MemAvailable,MemFree\n2025-01-01T00:00:00,6442450944,1073741824\n"
            "2025-01-01T00:00:01.5,5368709120,1073741824\n",
            [0.0, 1.5],
            [6 * GiB, 5 * GiB],
            [GiB, GiB],
        ),
        (
            "t,mem_available,mem_free\n10,6442450944,\n11,5368709120,2147483648\n",
            [0.0, 1.0],
            [6 * GiB, 5 * GiB],
            [None, 2 * GiB],
        ),
        ("t_s,mem_free_gib\n0,1.5\n0.5,1.25\n", [0.0, 0.5], [None, None], [round(1.5 * GiB), round(1.25 * GiB)]),
        ("ts,mem_available_mib\n100,6144\n101,6090\n", [0.0, 1.0], [6 * GiB, 6090 * MiB], [None, None]),
    ],
)
def test_accepted_layouts(text: str, t: list[float], avail: list[int | None], free: list[int | None]) -> None:
    trace = loads_csv(text)
    assert [s.mono for s in trace.samples] == t
    assert [s.mem_available for s in trace.samples] == avail
    assert [s.mem_free for s in trace.samples] == free


def test_unknown_layout_names_found_and_accepted_columns() -> None:
    with pytest.raises(TraceError) as e:
        loads_csv("when,avail\n0,5\n", source="odd.csv")
    msg = e.value.message
    assert "odd.csv: unknown trace layout: no time column. Columns found: when, avail" in msg
    assert "time: one of t_s, ts, time, t, time_s, elapsed_s, seconds, epoch, timestamp" in msg
    assert "--column NAME=FIELD" in msg  # the flag that maps a column sparkd does not know
    assert "mem_available_gib" in msg and "MemAvailable" in msg and "mem_available" in msg


def test_time_without_memory_columns_is_refused() -> None:
    with pytest.raises(TraceError, match=r"no MemAvailable or MemFree column\. Columns found: t_s, used_gib"):
        loads_csv("t_s,used_gib\n0,90\n")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("t_s,mem_available_gib\n0,5\n2,5\n1,5\n", r"row 3, column t_s: time goes backwards \(2 → 1\)"),
        ("t_s,mem_available_gib\n0,five\n", r"row 1, column mem_available_gib: 'five' is not a number$"),
        ("t_s,mem_available_gib\n0,5\n,5\n", r"row 2, column t_s: empty"),
        ("t,mem_available_gib\nnoon,5\n", r"row 1, column t: 'noon' is not a number of seconds"),
        ("t_s,mem_available_gib\n", r"no rows"),
    ],
)
def test_bad_rows(text: str, match: str) -> None:
    with pytest.raises(TraceError, match=match):
        loads_csv(text)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("t_s,mem_available_gib\n0,10\n1,9\n2,nan\n", "row 3, column mem_available_gib: 'nan' is not a finite number"),
        ("t_s,mem_available_gib\n0,10\n1,inf\n", "row 2, column mem_available_gib: 'inf' is not a finite number"),
        ("t_s,mem_available_gib\n0,10\n1,-Infinity\n", "row 2, column mem_available_gib: '-Infinity' is not a finite"),
        ("t_s,MemAvailable\n0,NaN\n", "row 1, column MemAvailable: 'NaN' is not a finite number"),
        ("t_s,mem_available_gib\n0,10\ninf,9\n", "row 2, column t_s: 'inf' is not a finite number"),
        ("t_s,mem_available_gib\nnan,10\n", "row 1, column t_s: 'nan' is not a finite number"),
    ],
)
def test_non_finite_values_are_refused_with_row_and_column(text: str, match: str) -> None:
    with pytest.raises(TraceError, match=re.escape(match)):
        loads_csv(text)


def test_non_finite_value_via_cli_exits_2_without_traceback(tmp_path: Path) -> None:
    f = tmp_path / "inf.csv"
    f.write_text("t_s,mem_available_gib\n0,10\n1,9\n2,inf\n")
    r = CliRunner().invoke(replay_command, [str(f)])
    assert r.exit_code == 2, r.output
    assert "row 3, column mem_available_gib: 'inf' is not a finite number" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("t_s,mem_available_gib\n0,10\n1,-1\n", "row 2, column mem_available_gib: -1 is negative"),
        ("t_s,MemAvailable,MemFree\n0,100,-5\n", "row 1, column MemFree: -5 is negative"),
        ("t_s,mem_available_gib,nvrm_recent\n0,5,-2\n", "row 1, column nvrm_recent: -2 is negative"),
    ],
)
def test_negative_sizes_are_refused(text: str, match: str) -> None:
    with pytest.raises(TraceError, match=re.escape(match)):
        loads_csv(text)


def test_signed_derived_fields_may_be_negative() -> None:
    # usable memory given without MemAvailable is taken as it is, and may be negative
    trace = loads_csv("t_s,mem_free_gib,mem_available_minus_cma_gib\n0,5,-1\n")
    assert trace.samples[0].mem_available_minus_cma == -GiB
    # with MemAvailable it is derived as the guard derives it (MemAvailable - CmaFree), never read
    trace = loads_csv("t_s,mem_available_gib,cma_free_gib,mem_available_minus_cma_gib\n0,5,6,3\n")
    assert trace.samples[0].mem_available_minus_cma == -GiB
    assert trace.notes[-1].startswith("usable memory derived from MemAvailable and CmaFree as the guard does")


def test_repeated_time_with_different_values_is_refused() -> None:
    with pytest.raises(TraceError, match=re.escape("row 3, column t_s: time 1 repeats the previous row's")):
        loads_csv("t_s,mem_available_gib\n0,10\n1,9\n1,8\n")


def test_exact_duplicate_rows_are_dropped_with_a_note() -> None:
    trace = loads_csv("t_s,mem_available_gib\n0,10\n1,9\n1,9\n1,9\n2,8\n")
    assert [s.mono for s in trace.samples] == [0.0, 1.0, 2.0]
    assert [s.mem_available for s in trace.samples] == [10 * GiB, 9 * GiB, 8 * GiB]
    assert trace.notes == ["dropped 2 exact duplicate row(s) (row 3, 4): same time and values as the row before"]
    assert trace.labels == [None, None, None] and trace.synthetic == [False, False, False]


def test_duplicate_note_is_printed_by_the_cli(tmp_path: Path) -> None:
    f = tmp_path / "dup.csv"
    f.write_text("t_s,mem_available_gib\n0,10\n1,9\n1,9\n2,8\n")
    r = invoke(str(f), "--rules", "seed")
    assert r.exit_code == 0, r.output
    assert "trace: dup.csv — 3 samples over 2.00 s" in r.output
    assert "note: dropped 1 exact duplicate row(s) (row 3): same time and values as the row before" in r.output


class FakeStore:
    path = "/var/lib/sparkd/sparkd.db"

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.calls: list[tuple[float, float | None]] = []
        self.limits: list[int | None] = []

    def samples(self, *, since: float, until: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        self.calls.append((since, until))
        self.limits.append(limit)
        out = [r for r in self.rows if r["ts"] >= since and (until is None or r["ts"] <= until)]
        return out[:limit] if limit else out


def test_load_db_uses_store_samples_for_the_range() -> None:
    t0 = 1_764_000_000.0
    rows = [
        Sample(ts=t0 + i, mono=0.0, mem_total=MEM_TOTAL, mem_available=(8 - i) * GiB, mem_free=GiB).to_row()
        for i in range(10)
    ]
    store = FakeStore(rows)
    trace = load_db(store, since=t0 + 2, until=t0 + 5)
    assert store.calls == [(t0 + 2, t0 + 5)]
    assert [s.mono for s in trace.samples] == [0.0, 1.0, 2.0, 3.0]
    assert [s.ts for s in trace.samples] == [t0 + 2, t0 + 3, t0 + 4, t0 + 5]
    assert trace.samples[0].mem_available == 6 * GiB
    assert trace.epoch is True
    with pytest.raises(TraceError, match="no samples in the database between"):
        load_db(store, since=t0 + 100)


def test_load_db_asks_for_one_row_over_the_cap_and_refuses_it() -> None:
    t0 = 1_764_000_000.0
    store = FakeStore([Sample(ts=t0 + i, mono=0.0, mem_available=GiB).to_row() for i in range(10)])
    assert len(load_db(store, since=t0, max_rows=10).samples) == 10
    assert store.limits == [11]
    with pytest.raises(
        TraceError, match=r"more than 9 rows; a replay holds at most 9 samples — replay a shorter range"
    ):
        load_db(store, since=t0, max_rows=9)
    load_db(store, since=t0)
    assert store.limits[-1] == MAX_TRACE_POINTS + 1


def test_csv_rows_over_the_cap_are_refused_while_streaming(tmp_path: Path) -> None:
    f = tmp_path / "long.csv"
    f.write_text("t_s,mem_available_gib\n" + "".join(f"{i},5\n" for i in range(50)))
    assert len(load_csv(f, max_rows=50).samples) == 50
    with pytest.raises(TraceError, match=r"long\.csv: more than 49 rows; a replay holds at most 49 samples"):
        load_csv(f, max_rows=49)
    with pytest.raises(TraceError, match="more than 3 rows"):
        loads_csv("t_s,mem_available_gib\n0,1\n1,1\n2,1\n3,1\n", max_rows=3)


# ------------------------------------------------------------------ interpolation


def test_interpolation_is_linear_labelled_and_keeps_recorded_points() -> None:
    trace = interpolate(load_csv(startup_path()), 0.25)
    assert len(trace.samples) == 25
    assert [s.mono for s in trace.samples][:3] == [0.0, 0.25, 0.5]
    assert sum(trace.synthetic) == 21
    assert [s.mono for s, syn in zip(trace.samples, trace.synthetic, strict=True) if not syn] == [0, 2, 4, 6]
    # 2.5 s is a quarter of the way from 23.79 to 10.61 GiB
    s = trace.samples[10]
    assert s.mem_available == round(23.79 * GiB + (10.61 - 23.79) * GiB * 0.25)
    assert trace.notes[-1] == (
        "interpolated to 0.25 s from 2 s samples — synthetic points (21 of 25 samples are synthetic, marked *)"
    )


def test_interpolation_holds_driver_error_counts() -> None:
    samples = [
        Sample(ts=0, mono=0, mem_available=8 * GiB, nvrm_recent=0),
        Sample(ts=1, mono=1, mem_available=7 * GiB, nvrm_recent=4),
    ]
    trace = interpolate(Trace(samples, "x"), 0.25)
    assert [s.nvrm_recent for s in trace.samples] == [0, 0, 0, 0, 4]
    assert [s.mem_available for s in trace.samples] == [round((8 - k / 4) * GiB) for k in range(5)]


def test_interpolation_keeps_the_last_recorded_sample_off_the_grid() -> None:
    trace = interpolate(load_csv(startup_path()), 0.8)
    assert [round(s.mono, 2) for s in trace.samples] == [0.0, 0.8, 1.6, 2.4, 3.2, 4.0, 4.8, 5.6, 6.0]
    assert trace.synthetic[-1] is False
    assert trace.samples[-1].mem_available == round(6.27 * GiB)


def test_interpolation_over_the_cap_is_refused_before_allocating() -> None:
    trace = loads_csv("t_s,mem_available_gib\n0,10\n1000,5\n", source="long.csv")
    assert len(interpolate(trace, 10, max_points=101).samples) == 101
    with pytest.raises(TraceError) as e:
        interpolate(trace, 10, max_points=100)
    assert e.value.message == (
        "long.csv: interpolating 1000 s at 10 s would make 101 points, more than the cap of 100; use a coarser "
        "--interval (at least 10.3 s for this span) or a shorter range (--since/--until, or fewer CSV rows)"
    )
    assert len(interpolate(trace, 10.3, max_points=100).samples) <= 100
    # the last recorded sample off the grid counts too: 0, 300, 600, 900 and 1000
    with pytest.raises(TraceError, match="would make 5 points, more than the cap of 4"):
        interpolate(trace, 300, max_points=4)


def test_interpolation_of_the_reviewers_trace_is_refused_at_once() -> None:
    """A 1e9 s span at 0.25 s: 4e9 points; the loop used to run (and grow) until killed."""
    tracemalloc.start()
    try:
        trace = loads_csv("t_s,mem_available_gib\n0,10\n1e9,5\n", source="big.csv")
        with pytest.raises(TraceError) as e:
            interpolate(trace, 0.25)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "interpolating 1e+09 s at 0.25 s would make 4,000,000,001 points, more than the cap of 200,000" in (
        e.value.message
    )
    assert "a coarser --interval (at least 5010 s for this span) or a shorter range" in e.value.message
    assert peak < 1_000_000
    huge = Trace([Sample(ts=0, mono=0, mem_available=GiB), Sample(ts=1e308, mono=1e308, mem_available=GiB)], "x")
    with pytest.raises(TraceError, match="would make more than can be counted points"):
        interpolate(huge, 1e-300)


def test_cli_refuses_an_interpolation_over_the_cap_with_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "big.csv"
    f.write_text("t_s,mem_available_gib\n0,10\n1e9,5\n")
    r = CliRunner().invoke(replay_command, [str(f), "--interpolate", "--interval", "0.25"])
    assert r.exit_code == 2, r.output
    assert "sparkd replay: big.csv: interpolating 1e+09 s at 0.25 s would make 4,000,000,001 points" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize(
    ("opt", "value"),
    [("--interval", "nan"), ("--interval", "inf"), ("--mem-total-gib", "nan"), ("--cooldown", "nan")],
)
def test_cli_refuses_non_finite_numbers(opt: str, value: str) -> None:
    r = CliRunner().invoke(replay_command, [startup_path(), "--interpolate", opt, value])
    assert r.exit_code == 2, r.output
    assert "must be a finite number" in r.output


def test_interpolation_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        interpolate(load_csv(startup_path()), 0)


# ------------------------------------------------------------------ replay result


def low(t: float, avail_gib: float) -> Sample:
    return Sample(ts=t, mono=t, mem_total=MEM_TOTAL, mem_available=round(avail_gib * GiB), mem_free=50 * GiB)


def test_replay_records_every_sample_and_first_trip() -> None:
    samples = [low(t, 5.0) for t in range(12)]
    res = replay(samples, SEED_RULES, mem_total_bytes=MEM_TOTAL, fast_interval_s=0.25, cooldown_s=6.0)
    assert len(res.steps) == 12
    assert [(d.t, d.kind) for d in res.decisions] == [(4, "trip"), (9, "cooldown")]
    ft = res.first_trip["low_available"]
    assert ft is not None and ft.t == 4 and ft.mem_available == 5 * GiB
    assert res.first_trip["low_available_and_free"] is None
    assert res.summary() == "first stop: low_available at t=4.00 s, MemAvailable 5.00 GiB"
    data = json.loads(json.dumps(res.to_json()))
    assert data["first_stop"]["rule"] == "low_available"
    assert data["max_counter"] == {"low_available": 5, "low_available_and_free": 0}


def test_the_table_shows_a_duration_rule_by_how_long_it_held_not_as_an_overrun_counter() -> None:
    """``sparkd replay``'s "counting" column showed a duration rule (``for_s``) as count/samples: the seed rules'
    ``low_available`` (4 s, at least 3 samples) read "4/3" and "5/3" before its trip, as ``sparkd status`` did
    before note 10. It shows how long the rule held, of ``for_s``, and the samples."""
    from sparkd.ops.replay.report import render

    samples = [low(t, 5.0) for t in range(6)]
    res = replay(samples, SEED_RULES, mem_total_bytes=MEM_TOTAL, cooldown_s=60)
    text = render(res, Trace(samples=samples, source="test"), title="seed", show_all=True)
    assert [s.held_s.get("low_available") for s in res.steps] == [0.0, 1.0, 2.0, 3.0, None, 0.0]
    assert "low_available held 3.0/4 s (4 samples)" in text, text
    assert not re.search(r"low_available [45]/3", text), text
    assert json.loads(json.dumps(res.steps[3].to_json()))["held_s"] == {"low_available": 3.0}


def test_replay_rechecks_a_stop_on_the_next_sample() -> None:
    samples = [low(t, 5.0) for t in range(5)] + [low(5, 6.5)]
    res = replay(samples, SEED_RULES, fast_interval_s=0.25, cooldown_s=60)
    stop = res.first_stop
    assert stop is not None and stop.recheck is False  # recovered: the daemon would not have stopped
    samples[-1] = low(5, 5.5)
    stop = replay(samples, SEED_RULES).first_stop
    assert stop is not None and stop.recheck is True
    stop = replay(samples[:5], SEED_RULES).first_stop
    assert stop is not None and stop.recheck is None  # the trace ended: unknown


def test_a_trip_that_recovered_on_re_check_leaves_its_rule_without_a_cooldown_as_in_the_daemon() -> None:
    """The daemon forgets a trip's cooldown when its re-check found memory recovered (nothing stopped, a model
    running); replay kept it and said "muted" where sparkd stopped (review helper-32)."""
    from sparkd.core.engine import EngineChange

    rules = [{"name": "low", "when": ["MemAvailable < 6GiB"], "samples": 2}]
    samples = [low(t, g) for t, g in enumerate([8, 5, 5, 7, 5, 5, 4, 3, 2])]
    got = [(d.t, d.kind, d.recheck) for d in replay(samples, rules, cooldown_s=60.0).decisions]
    assert got[:2] == [(2, "trip", False), (5, "trip", True)], got  # then the cooldown of a stop that acted
    # a database trace: the daemon's own record decides (here: the model was down, the cooldown stood)
    stood = replay(samples, rules, cooldown_s=60.0, changes=[EngineChange(-1.0, "reset")]).decisions
    assert [(d.t, d.kind) for d in stood][:2] == [(2, "trip"), (5, "cooldown")]
    told = replay(
        samples,
        rules,
        cooldown_s=60.0,
        changes=[EngineChange(-1.0, "reset"), EngineChange(2.5, "cooldown_reset", rule="low")],
    ).decisions
    assert [(d.t, d.kind) for d in told][:2] == [(2, "trip"), (5, "trip")]


def test_replay_percentage_rules_take_mem_total_from_the_trace_or_the_argument() -> None:
    rules = [{"name": "pct", "when": ["MemAvailable < 5%"], "samples": 2}]
    samples = [low(t, 6.0) for t in range(2)]
    assert replay(samples, rules).first_stop is not None  # 6.00 < 6.08 GiB (5 % of the trace's MemTotal)
    bare = [Sample(ts=t, mono=t, mem_available=6 * GiB) for t in range(2)]
    with pytest.raises(ValueError, match="percentage needs MemTotal"):
        replay(bare, rules)
    assert replay(bare, rules, mem_total_bytes=100 * GiB).first_stop is None  # 5 % = 5 GiB


def test_compare_text() -> None:
    trace = interpolate(load_csv(startup_path()), 0.25)
    d = replay(trace, DEFAULT_RULES)
    s = replay(trace, SEED_RULES)
    assert compare_text(d, "default", s, "seed") == (
        "compare: default stops at t=3.75 s (MemAvailable 12.26 GiB); seed does not stop before the trace ends "
        "(t=6.00 s, MemAvailable 6.27 GiB)"
    )
    early = replay([low(t, 5.0) for t in range(12)], [{"name": "a", "when": ["MemAvailable < 6GiB"], "samples": 2}])
    late = replay([low(t, 5.0) for t in range(12)], SEED_RULES)
    assert compare_text(early, "new", late, "seed") == (
        "compare: new stops at t=1.00 s (MemAvailable 5.00 GiB), 3.00 s earlier than seed "
        "(t=4.00 s, MemAvailable 5.00 GiB)"
    )
    assert compare_text(s, "seed", s, "seed") == "compare: neither seed nor seed stops before the trace ends"


# ------------------------------------------------------------------ CLI


def invoke(*args: str) -> Any:
    return CliRunner().invoke(replay_command, list(args), catch_exceptions=False)


def test_cli_interpolated_default_rules_print_label_and_first_stop() -> None:
    r = invoke(startup_path(), "--interpolate", "--interval", "0.25", "--rules", "default")
    assert r.exit_code == 0, r.output
    assert "trace: startup-collapse.csv — 25 samples over 6.00 s (every 0.25 s)" in r.output
    assert "note: interpolated to 0.25 s from 2 s samples — synthetic points" in r.output
    assert "first stop: collapse_projected at t=3.75 s, MemAvailable 12.26 GiB (synthetic point)" in r.output
    assert "→ TRIP (stop): collapse_projected: usable 12.26 GiB < 16.00 GiB" in r.output
    assert "*      3.75     12.26 GiB" in r.output  # synthetic rows are marked
    assert "low_available: no trip (highest count 0/3)" in r.output


def test_cli_seed_rules_at_2s_do_not_stop() -> None:
    r = invoke(startup_path(), "--rules", "seed")
    assert r.exit_code == 0, r.output
    assert "interpolated" not in r.output
    assert "no stop: no stop rule tripped before the trace ended (t=6.00 s, MemAvailable 6.27 GiB)" in r.output


def test_cli_says_why_a_predictive_rule_could_never_evaluate(tmp_path: Path) -> None:
    # a fixed 1 s horizon needs only a 2 s fit window, which 2 s samples never fill
    f = tmp_path / "short.toml"
    f.write_text(
        '[[rules]]\nname = "short"\nkind = "predictive"\nwhen = ["usable < 16GiB"]\nfloor = "4GiB"\n'
        "within_s = 1.0\nwindow_s = 2.0\nsamples = 2\n"
    )
    r = invoke(startup_path(), "--rules", str(f))
    assert r.exit_code == 0, r.output
    assert (
        "  short: no trip; its 2 s fit window holds at most 2 samples at 2 s spacing — needs 4; "
        "try --interpolate --interval 0.25\n"
    ) in r.output
    data = json.loads(invoke(startup_path(), "--rules", str(f), "--json").output)["runs"]["short.toml"]
    assert data["fit_points"] == {"short": 2}
    assert data["no_trip_reasons"]["short"].startswith("its 2 s fit window holds at most 2 samples")
    r = invoke(startup_path(), "--rules", str(f), "--interpolate", "--interval", "0.25")
    assert "fit window" not in r.output  # 9 points in 2 s: it evaluates
    # the default predictive rule's horizon is the time a stop takes (30 s): its fits reach back
    # 64 s, which hold all 4 samples of this trace, so it evaluates at 2 s sampling (1/2 at t=6 s)
    r = invoke(startup_path(), "--rules", "default")
    assert "collapse_projected: no trip (highest count 1/2)" in r.output
    assert "fit window" not in r.output


def test_fit_window_note_counts_the_densest_stretch_and_suggests_an_interval_that_fits() -> None:
    rule = {
        "name": "p",
        "kind": "predictive",
        "when": ["MemAvailable < 16GiB"],
        "floor": "4GiB",
        "window_s": 0.5,
        "within_s": 0.25,  # fits of 0.5 s only (a window covers twice the horizon)
    }
    # 1 s spacing except one 0.25 s pair: the window holds at most 2 points there
    samples = [low(t, 10 - t) for t in (0, 1, 2, 2.25, 3, 4)]
    res = replay(samples, [rule], fast_interval_s=0.25)
    assert res.fit_points == {"p": 2}
    why = res.why_no_trip(res.rules[0])
    # 0.25 s gives 3 points in 0.5 s, too few: the suggestion is the coarsest spacing that gives 4
    assert (
        why
        == "its 0.5 s fit window holds at most 2 samples at 1 s spacing — needs 4; try --interpolate --interval 0.166"
    )
    dense = replay(interpolate(Trace(samples, "x"), 0.166), [rule], fast_interval_s=0.25)
    assert dense.fit_points["p"] >= 4 and dense.why_no_trip(dense.rules[0]) is None
    # a threshold rule never gets the note; a predictive rule with enough points neither
    assert replay(samples, SEED_RULES).fit_points == {}
    wide = replay(samples, [{**rule, "window_s": 3.0}], fast_interval_s=0.25)
    assert wide.fit_points == {"p": 5} and wide.why_no_trip(wide.rules[0]) is None


def test_slope_minimum_is_read_from_the_rules_module() -> None:
    from sparkd.core.rules import SlopeWindow
    from sparkd.ops.replay import SLOPE_MIN_POINTS

    w = SlopeWindow()
    for t in range(SLOPE_MIN_POINTS - 1):
        w.add(t, (10 - t) * GiB)
    assert w.slope(SLOPE_MIN_POINTS - 2, 100.0) is None
    w.add(SLOPE_MIN_POINTS - 1, GiB)
    assert w.slope(SLOPE_MIN_POINTS - 1, 100.0) is not None


def test_cli_compare() -> None:
    r = invoke(startup_path(), "--interpolate", "--interval", "0.25", "--rules", "default", "--compare", "seed")
    assert r.exit_code == 0, r.output
    assert r.output.count("rules: ") == 2
    assert r.output.rstrip().endswith(
        "compare: default stops at t=3.75 s (MemAvailable 12.26 GiB); seed does not stop before the trace ends "
        "(t=6.00 s, MemAvailable 6.27 GiB)"
    )


def test_cli_json() -> None:
    r = invoke(startup_path(), "--interpolate", "--rules", "default", "--compare", "seed", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["trace"]["samples"] == 25  # --interpolate alone uses the fast interval, 0.25 s
    assert data["trace"]["synthetic"] == 21
    assert data["runs"]["default"]["first_stop"]["t"] == 3.75
    assert data["runs"]["seed"]["first_stop"] is None
    assert data["compare"].startswith("compare: default stops at t=3.75 s")


def test_cli_rules_file(tmp_path: Path) -> None:
    f = tmp_path / "rules.toml"
    f.write_text('[[rules]]\nname = "early"\nwhen = ["MemAvailable < 11GiB"]\nsamples = 1\n')
    r = invoke(startup_path(), "--rules", str(f), "--compare", "seed")
    assert r.exit_code == 0, r.output
    assert "first stop: early at t=4.00 s, MemAvailable 10.61 GiB" in r.output
    assert "compare: rules.toml stops at t=4.00 s" in r.output


def test_cli_config_rules_are_the_default(tmp_path: Path) -> None:
    f = tmp_path / "sparkd.toml"
    f.write_text('cooldown_s = 5\n[[rules]]\nname = "mine"\nwhen = ["MemAvailable < 7GiB"]\nsamples = 1\n')
    r = invoke(startup_path(), "--config", str(f))
    assert r.exit_code == 0, r.output
    assert "cooldown 5 s" in r.output
    assert "first stop: mine at t=6.00 s, MemAvailable 6.27 GiB" in r.output


def test_cli_registered_under_a_group_reads_the_group_config(tmp_path: Path) -> None:
    @click.group()
    @click.option("--config", "config_path", default=None)
    @click.pass_context
    def main(ctx: click.Context, config_path: str | None) -> None:
        ctx.ensure_object(dict)["config"] = config_path

    main.add_command(replay_command)
    f = tmp_path / "sparkd.toml"
    f.write_text('[[rules]]\nname = "mine"\nwhen = ["MemAvailable < 7GiB"]\nsamples = 1\n')
    r = CliRunner().invoke(main, ["--config", str(f), "replay", startup_path()], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "first stop: mine at t=6.00 s" in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give either TRACE.csv or --db"),
        (["--db"], "--db needs --since"),
        (["STARTUP", "--interval", "0.25"], "add --interpolate to accept synthetic points"),
        (["STARTUP", "--since", "2h"], "--since/--until apply to --db only"),
        (["STARTUP", "--rules", "nope.toml"], "rules file nope.toml does not exist"),
        (["--db", "--since", "2h", "--db-file", "/nonexistent/sparkd.db"], "database /nonexistent/sparkd.db does not"),
        (["STARTUP", "--rules", "PCT"], "rule set pct.toml cannot be compiled against this trace: "),
        (
            ["STARTUP", "--rules", "PCT"],
            "percentage needs MemTotal, which is unknown; give MemTotal with --mem-total-gib",
        ),
    ],
)
def test_cli_errors(args: list[str], message: str, tmp_path: Path) -> None:
    pct = tmp_path / "pct.toml"
    pct.write_text('[[rules]]\nname = "pct"\nwhen = ["MemAvailable < 5%"]\n')
    args = [startup_path() if a == "STARTUP" else str(pct) if a == "PCT" else a for a in args]
    r = CliRunner().invoke(replay_command, args)
    assert r.exit_code == 2
    assert message in r.output


def test_cli_mem_total_makes_percentage_rules_work(tmp_path: Path) -> None:
    pct = tmp_path / "pct.toml"
    pct.write_text('[[rules]]\nname = "pct"\nwhen = ["MemAvailable < 10%"]\nsamples = 1\n')
    r = invoke(startup_path(), "--rules", str(pct), "--mem-total-gib", "121.69")
    assert r.exit_code == 0, r.output
    assert "first stop: pct at t=4.00 s, MemAvailable 10.61 GiB" in r.output  # 10 % = 12.17 GiB


def test_cli_unknown_layout(tmp_path: Path) -> None:
    f = tmp_path / "odd.csv"
    f.write_text("when,avail\n0,5\n")
    r = CliRunner().invoke(replay_command, [str(f)])
    assert r.exit_code == 2
    assert "unknown trace layout" in r.output and "Columns found: when, avail" in r.output
