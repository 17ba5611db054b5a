"""Field inputs, round 2: usable memory on CMA hosts (kind 3) and other watchdogs' files (kind 4).

The right values are those of tests/fixtures/field-2/README.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sparkd.config import DEFAULT_RULES, SEED_RULES, load_settings
from sparkd.loop.guard import Guard
from sparkd.ops.replay import TraceError, load_csv, loads_csv, replay, replay_command
from sparkd.units import GiB
from tests.conftest import fixture

KILL7 = fixture("field-2", "homelab-kill7-cma.csv")
RING = fixture("field-2", "homelab-ring-layout.csv")


def invoke(*args: str) -> Any:
    return CliRunner().invoke(replay_command, list(args), catch_exceptions=False)


def gib(n: int | None) -> float:
    assert n is not None
    return round(n / GiB, 2)


# ------------------------------------------------------------------ kind 3: usable memory


def test_the_cma_kill_trace_stops_before_the_last_row_with_the_default_rules() -> None:
    trace = load_csv(KILL7)
    # usable = MemAvailable - CmaFree, derived from the cma_free_gib column as the guard derives it
    assert [gib(s.mem_available_minus_cma) for s in trace.samples] == [26.12, 22.0, 15.7, 8.2, 3.3, 1.64]
    res = replay(trace, DEFAULT_RULES)
    stop = res.first_stop
    assert stop is not None
    assert stop.t < trace.samples[-1].mono  # before the row where the host died
    assert (stop.rule, stop.t) == ("collapse_projected", 60.0)
    assert (gib(stop.mem_available), gib(stop.usable)) == (11.2, 3.3)
    assert stop.reason.startswith("collapse_projected: usable 3.30 GiB < 16.00 GiB, falling 0.41 GiB/s")
    assert res.summary() == "first stop: collapse_projected at t=60.00 s, MemAvailable 11.20 GiB (usable 3.30 GiB)"


def test_the_seed_rules_judging_memavailable_never_stop_the_cma_kill_trace() -> None:
    # the fault of the field: 10.45 GiB MemAvailable at the end looks safe to rules on MemAvailable
    assert replay(load_csv(KILL7), SEED_RULES).first_stop is None


def test_the_cli_replays_the_cma_kill_trace_with_the_default_rules() -> None:
    r = invoke(str(KILL7), "--rules", "default")
    assert r.exit_code == 0, r.output
    assert "first stop: collapse_projected at t=60.00 s, MemAvailable 11.20 GiB (usable 3.30 GiB)" in r.output
    assert "      t (s)  MemAvailable      usable     MemFree" in r.output  # usable beside MemAvailable


def test_a_rule_on_memavailable_minus_cmafree_trips_in_replay_as_it_does_live() -> None:
    rule = {"name": "cma", "when": ["MemAvailable-CmaFree < 4GiB"], "samples": 1}
    res = replay(load_csv(KILL7), [rule], cooldown_s=0)
    assert [d.t for d in res.trips("cma")] == [60.0, 75.0]


def test_the_live_guard_and_replay_derive_usable_memory_alike(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    text = fixture("meminfo", "gb10-idle.meminfo").read_text()
    text = text.replace("MemAvailable:   118566368 kB", f"MemAvailable:   {round(10.45 * 1024 * 1024)} kB")
    text = text.replace("CmaFree:           136192 kB", f"CmaFree:           {round(8.81 * 1024 * 1024)} kB")
    (proc / "meminfo").write_text(text)
    settings = load_settings(overrides={"state_dir": str(tmp_path), "proc_root": str(proc), "kernlog_source": "off"})
    live = Guard(settings).tick().sample
    assert gib(live.mem_available) == 10.45 and gib(live.cma_free) == 8.81
    assert gib(live.mem_available_minus_cma) == 1.64
    row = live.to_row()
    csv = "t_s,mem_available,cma_free\n0,{},{}\n".format(row["mem_available"], row["cma_free"])
    (replayed,) = loads_csv(csv).samples
    assert replayed.mem_available_minus_cma == live.mem_available_minus_cma


def test_without_cma_usable_is_memavailable(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    lines = [x for x in fixture("meminfo", "gb10-idle.meminfo").read_text().splitlines() if not x.startswith("Cma")]
    (proc / "meminfo").write_text("\n".join(lines) + "\n")
    settings = load_settings(overrides={"state_dir": str(tmp_path), "proc_root": str(proc), "kernlog_source": "off"})
    s = Guard(settings).tick().sample
    assert s.cma_free is None and s.mem_available_minus_cma == s.mem_available


# ------------------------------------------------------------------ kind 4: other watchdogs' files


def test_the_ring_layout_is_read_with_its_own_names() -> None:
    trace = load_csv(RING)
    assert trace.epoch  # the epoch column is wall-clock seconds
    assert [s.ts for s in trace.samples][:2] == [1790000000.0, 1790000015.0]
    assert [gib(s.mem_available) for s in trace.samples] == [26.25, 22.4, 17.8, 13.6, 11.2, 10.45]
    assert [gib(s.cma_free) for s in trace.samples][-1] == 8.81
    assert [s.psi_full_avg10 for s in trace.samples][-1] == 37.9
    # its usable_gib column agrees with what sparkd derives, so nothing is overridden
    assert [gib(s.mem_available_minus_cma) for s in trace.samples] == [26.12, 22.0, 15.7, 8.2, 3.3, 1.64]
    assert not any(n.startswith("usable memory derived") for n in trace.notes)
    # the columns it does not know are named, never silently dropped
    assert "columns not used: swap_used_gib, gpu_top_pid, gpu_top_mib, restarts, utc" in trace.notes
    stop = replay(trace, DEFAULT_RULES).first_stop
    assert stop is not None and (stop.rule, stop.t) == ("collapse_projected", 60.0)


def test_the_cli_replays_the_ring_layout_and_prints_utc_times() -> None:
    r = invoke(str(RING), "--rules", "default")
    assert r.exit_code == 0, r.output
    assert "first stop: collapse_projected at t=60.00 s, MemAvailable 11.20 GiB (usable 3.30 GiB)" in r.output
    assert "at 2026-09-21 14:14:20 UTC" in r.output  # 1790000060


@pytest.mark.parametrize(
    ("header", "field", "value_bytes"),
    [
        ("memavailable", "mem_available", 5),  # a meminfo name in lower case: bytes
        ("MemAvailable_kB", "mem_available", 5 * 1024),
        ("avail_mib", "mem_available", 5 * 2**20),
        ("mem_avail_gib", "mem_available", 5 * GiB),
        ("usable_gib", "mem_available_minus_cma", 5 * GiB),
        ("cmafree_gib", "cma_free", 5 * GiB),
    ],
)
def test_common_aliases_and_units(header: str, field: str, value_bytes: int) -> None:
    extra = "" if field in ("mem_available", "mem_available_minus_cma") else ",mem_free_gib"
    trace = loads_csv(f"timestamp,{header}{extra}\n1790000000,5{',1' if extra else ''}\n")
    assert getattr(trace.samples[0], field) == value_bytes


@pytest.mark.parametrize(
    ("header", "first", "second", "epoch"),
    [
        ("epoch_ms", "1790000000000", "1790000015000", True),  # milliseconds
        ("unix_s", "1790000000", "1790000015", True),
        ("time_s", "0", "15", False),  # seconds from the start
        ("Timestamp", "2026-09-21T14:13:20", "2026-09-21T14:13:35", True),  # ISO-8601, any case
    ],
)
def test_time_column_aliases(header: str, first: str, second: str, epoch: bool) -> None:
    trace = loads_csv(f"{header},avail_mem_gib,free_mem_gib\n{first},26.25,0.87\n{second},22.40,0.95\n")
    assert trace.duration_s == 15.0 and trace.epoch is epoch
    assert [gib(s.mem_available) for s in trace.samples] == [26.25, 22.4]
    assert [gib(s.mem_free) for s in trace.samples] == [0.87, 0.95]


def test_column_maps_the_rest(tmp_path: Path) -> None:
    f = tmp_path / "odd.csv"
    f.write_text("when_s,avail_g,free_g,cma_g\n100,26.25,0.87,0.13\n115,22.40,0.95,0.40\n")
    r = invoke(str(f), "--rules", "default", "--json")
    assert r.exit_code == 2
    assert "Columns found: when_s, avail_g, free_g, cma_g" in r.output
    assert "--column NAME=FIELD" in r.output
    r = invoke(
        str(f),
        "--rules",
        "default",
        "--json",
        "--column",
        "when_s=epoch",
        "--column",
        "avail_g=mem_available_gib",
        "--column",
        "free_g=mem_free_gib",
        "--column",
        "cma_g=cma_free_gib",
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["trace"]["samples"] == 2 and data["trace"]["duration_s"] == 15.0


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("avail_g", "expected NAME=FIELD"),
        ("avail_g=bogus", "unknown field 'bogus'"),
        ("nope=mem_available_gib", "--column names nope, not a column of this trace"),
    ],
)
def test_a_bad_column_option_is_refused_with_what_is_allowed(tmp_path: Path, option: str, message: str) -> None:
    f = tmp_path / "odd.csv"
    f.write_text("t_s,avail_g\n0,5\n")
    r = invoke(str(f), "--column", option)
    assert r.exit_code == 2
    assert message in r.output


def test_a_refusal_names_the_columns_found_and_the_flag(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as e:
        loads_csv("epoch,gpu_top_mib\n1790000000,5\n", source="ring.csv")
    msg = e.value.message
    assert "ring.csv: unknown trace layout: no MemAvailable or MemFree column" in msg
    assert "Columns found: epoch, gpu_top_mib" in msg
    assert "--column NAME=FIELD" in msg
