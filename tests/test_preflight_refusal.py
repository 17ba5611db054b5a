"""An operator's start while stop rules hold (``LaunchBook._refuse_below_a_stop_line``): the refusal names every
rule that holds and says what ``--force`` leads to. helper-35 forced a start at 2 GiB and the guard stopped the
model again 0.08 s after its launch; the refusal had named one rule of three and offered ``--force`` without a
word about that. The rules are judged by a real ``Guard`` on a scripted ``/proc``; the real path (Docker, the
API) is ``test_e2e_unattended.py::test_memory_held_low_after_the_guard_stopped_the_model_trips_once_per_cooldown``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from sparkd.config import load_settings
from sparkd.core.lifecycle import ContainerState
from sparkd.errors import Refused
from sparkd.loop.guard import Guard
from sparkd.loop.supervisor import Supervisor


class Daemon(list[dict[str, Any]]):
    """The supervisor's daemon as far as the preflight reads it: its ``guard``, and ``event`` kept in order."""

    def __init__(self, guard: Guard) -> None:
        super().__init__()
        self.guard = guard

    def __bool__(self) -> bool:
        return True

    def event(self, kind: str, message: str, **kw: Any) -> None:
        self.append({"kind": kind, "message": message, **kw})


def _supervisor(
    tmp_path: Path, usable_gib: float, image: str | None = "sparkd-test-vllm:latest"
) -> tuple[Supervisor, Daemon]:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    line = f"MemAvailable:   {int(usable_gib * 2**20):>12} kB"
    text = re.sub(r"(?m)^MemAvailable:.*$", line, Path("/proc/meminfo").read_text())
    text = re.sub(r"(?m)^Cma(Total|Free):.*\n", "", text)
    # MemFree and MemTotal pinned: below 2 GiB of MemFree (a busy host's page cache) low_free_with_evidence holds
    # too, with usable < 3 GiB as its evidence (helper-36)
    text = re.sub(r"(?m)^MemFree:.*$", f"MemFree:        {8 * 2**20:>12} kB", text)
    text = re.sub(r"(?m)^MemTotal:.*$", f"MemTotal:       {64 * 2**20:>12} kB", text)
    (proc / "meminfo").write_text(text)
    settings = load_settings(
        overrides={
            "state_dir": str(tmp_path / "state"),
            "proc_root": str(proc),
            "container": {"image": image, "name": "vllm"} if image else {"guard": "vllm"},
        }
    )
    guard = Guard(settings)
    guard.tick()  # the last sample the preflight judges
    sup = Supervisor(settings, manager=object())  # type: ignore[arg-type]
    daemon = Daemon(guard)
    sup.daemon = daemon  # type: ignore[assignment]
    return sup, daemon


def test_a_start_below_several_stop_lines_names_each_rule_and_says_the_guard_stops_it_again(tmp_path: Path) -> None:
    sup, daemon = _supervisor(tmp_path, 2.0)  # below low_available (6 GiB) and repeated_dips (3 GiB)
    with pytest.raises(Refused) as e:
        sup._refuse_below_a_stop_line("api:cli", force=False)
    msg = e.value.message
    held = "low_available (usable 2.00 GiB < 6.00 GiB); repeated_dips (usable 2.00 GiB < 3.00 GiB)"
    assert f"stop rules {held} hold now" in msg, msg
    assert "launches it anyway, and the guard stops it again as soon as these rules trip" in msg, msg
    assert e.value.detail["rules"] == ["low_available", "repeated_dips"]
    # a warning: the operator has the refusal in hand; each refused click paged as a critical (helper-44)
    assert [(x["kind"], x["severity"]) for x in daemon] == [("preflight_failed", "warning")]
    # forced: launched, and the warning names the same rules
    sup._refuse_below_a_stop_line("api:cli", force=True)
    assert daemon[-1]["kind"] == "preflight_forced" and "low_available" in daemon[-1]["message"]
    assert "repeated_dips" in daemon[-1]["message"]


def test_a_start_below_one_stop_line_names_it_alone_and_a_start_above_every_line_passes(tmp_path: Path) -> None:
    sup, daemon = _supervisor(tmp_path, 4.0)  # below low_available only
    with pytest.raises(Refused) as e:
        sup._refuse_below_a_stop_line("web:admin", force=False)
    assert "stop rule low_available (usable 4.00 GiB < 6.00 GiB) holds now" in e.value.message, e.value.message
    assert "as soon as this rule trips" in e.value.message and "repeated_dips" not in e.value.message
    up, quiet = _supervisor(tmp_path / "up", 40.0)
    up._refuse_below_a_stop_line("api:cli", force=False)  # nothing holds: no refusal, no event
    sup._refuse_below_a_stop_line("sparkd (auto-relaunch)", force=False)  # automatic launches are not refused here
    assert quiet == [] and len(daemon) == 1


@pytest.mark.anyio
async def test_a_guard_mode_start_is_refused_and_says_which_stop_rules_hold(tmp_path: Path) -> None:
    """Guard mode (no ``container.image``): sparkd never starts the model, and its refusal said nothing of memory
    while three rules held (helper-37); the operator then runs ``docker start`` into the shortage."""
    sup, daemon = _supervisor(tmp_path, 2.0, image=None)
    assert sup.mode == "guard"
    with pytest.raises(Refused) as e:
        await sup.request("start", source="api:cli")
    msg = e.value.message
    assert "start it yourself (docker start vllm)" in msg, msg
    held = "low_available (usable 2.00 GiB < 6.00 GiB); repeated_dips (usable 2.00 GiB < 3.00 GiB)"
    assert f"Mind memory first: stop rules {held} hold now: the guard would stop the model again" in msg, msg
    assert daemon == []  # a refusal, nothing recorded: nothing was launched or forced
    up, _ = _supervisor(tmp_path / "up", 40.0, image=None)
    with pytest.raises(Refused) as e:
        await up.request("start", source="api:cli")
    assert "Mind memory" not in e.value.message and "docker start vllm" in e.value.message
    with pytest.raises(Refused) as e:  # a restart runs no start-up into the shortage: not said
        await sup.request("restart", source="api:cli")
    assert "Mind memory" not in e.value.message and "docker restart vllm" in e.value.message
    # running already: "Mind memory first … would stop the model again" was false of a model that is up (helper-38)
    sup.container_id, sup.state = "c" * 64, ContainerState.READY
    with pytest.raises(Refused) as e:
        await sup.request("start", source="api:cli")
    assert "Mind memory" not in e.value.message and "docker start vllm" in e.value.message
