from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from sparkd.config import DEFAULT_RULES, load_settings
from sparkd.errors import ConfigError
from sparkd.face.cli import main


def test_it_builds_the_embedded_defaults(tmp_path: Path) -> None:
    s = load_settings(overrides={"state_dir": str(tmp_path)})
    assert s.interval_s == 1.0
    assert [r.name for r in s.rules] == [r["name"] for r in DEFAULT_RULES]
    assert s.db_file == tmp_path / "sparkd.db"
    assert s.api.host == "127.0.0.1" and s.api.port == 8741


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"interval_s": 0.01}, "interval_s = 0.01: Input should be greater than or equal to 0.1"),
        ({"api": {"port": 70000}}, "api.port = 70000: Input should be less than or equal to 65535"),
        ({"rules": [{"name": "x", "when": ["MemAvail < 3GiB"]}]}, "unknown field 'MemAvail'"),
        ({"rules": [{"name": "x", "when": ["MemAvailable < 3XB"]}]}, "unknown size unit 'XB'"),
        (
            {"rules": [{"name": "x", "when": ["MemAvailable < 3GiB"], "action": "explode"}]},
            "rules.0.action = \"explode\": Input should be 'stop' or 'warn'",
        ),
        ({"api": {"host": "0.0.0.0"}}, "set api.allow_remote = true"),
        ({"kernlog_source": "syslog"}, "Input should be 'auto', 'kmsg', 'journal', 'dmesg' or 'off'"),
        ({"nonsense": 1}, "nonsense = 1: Extra inputs are not permitted"),
    ],
)
def test_a_bad_value_is_refused_naming_key_value_and_allowed(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(overrides=overrides)
    assert expected in e.value.message


def test_it_reads_toml_and_env_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "sparkd.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path}"\ninterval_s = 2.0\n[api]\nport = 9001\n'
        '[[rules]]\nname = "only"\nwhen = ["MemAvailable < 5%"]\nsamples = 3\n'
    )
    s = load_settings(cfg)
    assert (s.interval_s, s.api.port, [r.name for r in s.rules]) == (2.0, 9001, ["only"])
    monkeypatch.setenv("SPARKD_INTERVAL_S", "0.5")
    monkeypatch.setenv("SPARKD_API__PORT", "9002")
    s = load_settings(cfg)
    assert (s.interval_s, s.api.port) == (0.5, 9002)


def test_a_missing_or_broken_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("interval_s = = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad)


def test_config_show_prints_the_effective_configuration_as_toml(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\ninterval_s = 0.5\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "config", "show"])
    assert r.exit_code == 0, r.output
    data = tomllib.loads(r.output)
    assert data["interval_s"] == 0.5
    assert data["db_path"] == str(tmp_path / "sparkd.db")
    assert [x["name"] for x in data["rules"]] == [x["name"] for x in DEFAULT_RULES]


def test_the_cli_refuses_a_bad_config_with_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("interval_s = 0.01\n")
    r = CliRunner().invoke(main, ["--config", str(cfg), "config", "show"])
    assert r.exit_code == 2
    assert "interval_s = 0.01" in r.output and "greater than or equal to 0.1" in r.output


def test_every_setting_is_documented_and_the_example_config_loads(tmp_path: Path) -> None:
    from sparkd.config import FIELD_DOCS, setting_keys
    from sparkd.ops.example_config import example_config_text

    assert set(setting_keys()) == set(FIELD_DOCS)
    text = example_config_text()
    for key in setting_keys():
        assert (f"# {key.rpartition('.')[2]} = " if key != "rules" else "# [[rules]]") in text, key
    # uncomment every line that sets a value: the result is valid TOML and valid settings
    import re

    lines = []
    for line in text.splitlines():
        body = line[2:] if line.startswith("# ") else line
        if line.startswith("[") or body == "[[rules]]" or (re.match(r"^[a-z_]+ = ", body) and "<unset>" not in body):
            lines.append(body)
    data = tomllib.loads("\n".join(lines))
    data["state_dir"] = str(tmp_path)
    cfg = tmp_path / "all.toml"
    from sparkd.tomlout import dumps

    cfg.write_text(dumps(data))
    s = load_settings(cfg)
    assert s.interval_s == 1.0 and [r.name for r in s.rules] == [r["name"] for r in DEFAULT_RULES]


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_numbers_are_refused(tmp_path: Path, value: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"interval_s = {value}\n[budget]\nweights_gib = {value}\n")
    with pytest.raises(ConfigError) as e:
        load_settings(cfg)
    assert "interval_s" in e.value.message and "budget.weights_gib" in e.value.message
    assert "finite number" in e.value.message


def test_config_show_redacts_container_environment_values(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[container]\nenv = {{ HF_TOKEN = "hf_SECRET123" }}\n')
    r = CliRunner().invoke(main, ["--config", str(cfg), "config", "show", "--json"])
    assert r.exit_code == 0 and "hf_SECRET123" not in r.output
    assert '"HF_TOKEN": "<redacted>"' in r.output


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"container": {"memory": "-3GiB"}}, "container.memory = \"-3GiB\": a size cannot be negative: '-3GiB'"),
        (
            {"container": {"memory": "3GiB"}, "budget": {"enabled": True}},
            "container.memory and budget.enabled = true both set Docker --memory",
        ),
    ],
)
def test_container_limits_that_cannot_work_are_refused(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(overrides=overrides)
    assert expected in e.value.message


def test_a_malformed_allowed_host_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(overrides={"api": {"allowed_hosts": ["a@b", "localhost"]}})
    assert "api.allowed_hosts" in e.value.message and "not a host[:port]: 'a@b'" in e.value.message


# --------------------------------------------------------------------------- config that silently disarms (issue 13)
@pytest.mark.parametrize(
    ("toml", "key", "says"),
    [
        ('leak_threshold = "-4GiB"', "leak_threshold", "cannot be negative"),
        ('fast_margin = "-1GiB"', "fast_margin", "cannot be negative"),
        ('fast_fall_rate = "-1MiB"', "fast_fall_rate", "cannot be negative"),
        ('[retention]\narchives_max_bytes = "-1"', "retention.archives_max_bytes", "cannot be negative"),
        ('[container]\nhard_floor = "-3GiB"', "container.hard_floor", "cannot be negative"),
        ('[[rules]]\nname = "x"\nwhen = ["MemAvailable < -6GiB"]', "rules.0.when", "cannot be negative"),
        (
            '[[rules]]\nname = "x"\nkind = "predictive"\nwhen = ["MemAvailable < 9GiB"]\nfloor = "-1GiB"',
            "rules.0.floor",
            "negative",
        ),
        ('leak_threshold = "4 GB"', "leak_threshold", "write 4GiB (binary, what sparkd uses) or 3.725GiB"),
        ('[[rules]]\nname = "x"\nwhen = ["MemAvailable < 6GB"]', "rules.0.when", "5.588GiB for 6 × 10^9 bytes"),
        ("rules = []", "rules = []", "no stop rule"),
        (
            '[[rules]]\nname = "x"\nwhen = ["MemAvailable < 6GiB"]\naction = "warn"',
            "no stop rule",
            "and no container (container.image or container.guard): to watch this host without guarding a model, "
            "say so with monitor_only = true",
        ),
        (
            '[container]\nimage = "vllm/vllm-openai"\n[[rules]]\nname = "x"\nwhen = ["MemAvailable < 6GiB"]\n'
            'action = "warn"',
            "no stop rule",
            "nothing would ever stop the container; add one, or say so explicitly with dry_run = true or "
            "monitor_only = true",
        ),
        (
            '[container]\nguard = "vllm"\n[[rules]]\nname = "x"\nwhen = ["MemAvailable < 6GiB"]\naction = "warn"',
            "no stop rule",
            "nothing would ever stop the container",
        ),
    ],
)
def test_it_refuses_config_that_silently_disarms(tmp_path: Path, toml: str, key: str, says: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(toml + "\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert key in e.value.message and says in e.value.message, e.value.message


def test_no_stop_rule_is_allowed_when_said_explicitly(tmp_path: Path) -> None:
    for extra in ("dry_run = true", "monitor_only = true"):
        p = tmp_path / "c.toml"
        p.write_text(f"rules = []\n{extra}\n")
        assert load_settings(p).rules == []


def test_a_garbage_rules_variable_is_one_clear_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_")}
    env["SPARKD_RULES"] = "garbage"
    r = subprocess.run(
        [sys.executable, "-m", "sparkd.face.cli", "config", "show"], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "SPARKD_RULES = 'garbage': not valid JSON" in r.stderr


def test_doctor_warns_about_a_threshold_this_host_can_never_reach(tmp_path: Path) -> None:
    from sparkd.ops.doctor import DoctorContext, check_rule_reach

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n")
    p = tmp_path / "c.toml"
    p.write_text(
        '[[rules]]\nname = "never"\nwhen = ["MemAvailable < 0GiB"]\n'
        '[[rules]]\nname = "above_total"\nwhen = ["MemFree > 32GiB"]\n'
        '[[rules]]\nname = "fine"\nwhen = ["MemAvailable < 6GiB"]\n'
    )
    checks = check_rule_reach(DoctorContext(proc_root=proc, rules=load_settings(p).rules))
    warned = {c.title: c.detail for c in checks if c.status == "WARN"}
    assert set(warned) == {"Rule never", "Rule above_total"}
    assert (
        "never below 0" in warned["Rule never"] and "never exceeds MemTotal (16.00 GiB)" in warned["Rule above_total"]
    )


def test_a_daemon_with_its_own_state_dir_keeps_its_own_log(tmp_path: Path) -> None:
    from sparkd.config import load_settings

    s = load_settings(overrides={"state_dir": str(tmp_path / "s")})
    # never the system daemon's /var/log/sparkd: two daemons must not share (and archive) one log
    assert s.logs_path == tmp_path / "s" / "logs"
    system = load_settings(overrides={"state_dir": "/var/lib/sparkd"})
    import os

    expected = Path("/var/log/sparkd") if os.geteuid() == 0 else Path("/var/lib/sparkd/logs")
    assert system.logs_path == expected
    assert load_settings(overrides={"state_dir": str(tmp_path), "log_dir": "/x/y"}).logs_path == Path("/x/y")


@pytest.mark.parametrize(
    ("rule", "why"),
    [
        ({"when": ["MemAvailable < 0GiB"]}, ["'MemAvailable < 0GiB' can never hold: MemAvailable is never below 0"]),
        ({"when": ["mem_free < 0%"]}, ["'mem_free < 0%' can never hold: mem_free is never below 0"]),
        (
            {"when": ["MemFree > 32GiB"]},
            ["'MemFree > 32GiB' can never hold: MemFree never exceeds MemTotal (16.00 GiB)"],
        ),
        (
            {"when": ["MemAvailable < 4GiB", "mem_available > 8GiB"]},
            ["'mem_available > 8GiB' and 'MemAvailable < 4GiB' never hold together"],
        ),
        (
            {"when": ["MemAvailable < 5%", "MemAvailable >= 5%"]},
            ["'MemAvailable >= 5%' and 'MemAvailable < 5%' never hold together"],
        ),
        (
            {"when": ["MemFree < 2GiB"], "evidence": ["nvrm_recent < 0", "MemAvailable > 20GiB"]},
            ["no evidence condition can ever hold: 'nvrm_recent < 0', 'MemAvailable > 20GiB'"],
        ),
        # a size without its unit is bytes: MemAvailable never that low while the host answers (helper-45)
        (
            {"when": ["MemAvailable < 6"]},
            [
                "'MemAvailable < 6' can never hold: MemAvailable is never below 1 MiB while the host answers (a size "
                "without a unit is bytes: write e.g. 'MemAvailable < 6GiB')"
            ],
        ),
        (
            {"when": ["MemFree < 2048"], "evidence": ["MemAvailable < 6k"]},
            [
                "'MemFree < 2048' can never hold: MemFree is never below 1 MiB while the host answers (a size "
                "without a unit is bytes: write e.g. 'MemFree < 2048GiB')",
                "no evidence condition can ever hold: 'MemAvailable < 6k'",
            ],
        ),
        # rules that can fire
        ({"when": ["MemAvailable < 2MiB"]}, []),
        ({"when": ["CmaFree <= 0"]}, []),  # the CMA region used up: it holds (helper-46)
        ({"when": ["MemAvailable > 6"]}, []),
        ({"when": ["nvrm_recent > 5"]}, []),  # the kernel log is read (``unread`` in the next test)
        ({"when": ["MemAvailable < 6GiB", "MemAvailable > 2GiB"]}, []),
        ({"when": ["MemAvailable <= 5%", "MemAvailable >= 5%"]}, []),
        ({"when": ["psi_some_avg10 > 0.5", "psi_some_avg10 < 0.9"]}, []),
        ({"when": ["MemAvailable < 4GiB", "MemFree > 8GiB"]}, []),
        ({"when": ["MemFree < 2GiB"], "evidence": ["nvrm_recent < 0", "MemAvailable < 3GiB"]}, []),
    ],
)
def test_rules_that_can_never_fire_are_named(rule: dict[str, list[str]], why: list[str]) -> None:
    from sparkd.core.conditions import never_fires

    assert never_fires(rule["when"], rule.get("evidence", []), 16 * 2**30) == why


def test_a_rule_on_nvrm_recent_never_fires_when_the_kernel_log_is_off_and_doctor_says_so(tmp_path: Path) -> None:
    """``kernlog_source = "off"``: nvrm_recent stays 0, and a rule that needs it looked armed ("0/1", doctor "OK
    Rules") and never fired (helper-45). One driver-error alternative among others still lets a rule fire."""
    from sparkd.core.conditions import never_fires, unread_fields
    from sparkd.ops.doctor import DoctorContext, check_rule_reach

    off = unread_fields("off")
    assert unread_fields("auto") == {} and never_fires(["nvrm_recent > 5"], [], 16 * 2**30, None, {}) == []
    why = "'nvrm_recent > 5' can never hold: nvrm_recent is not read (kernlog_source = \"off\": no kernel log is read)"
    assert never_fires(["nvrm_recent > 5"], [], 16 * 2**30, None, off) == [why]
    assert never_fires(["MemAvailable < 30GiB"], ["nvrm_recent > 0"], 16 * 2**30, None, off) == [
        "no evidence condition can ever hold: 'nvrm_recent > 0'"
    ]
    assert never_fires(["MemFree < 2GiB"], ["nvrm_recent > 0", "usable < 3GiB"], 16 * 2**30, None, off) == []
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n")
    rules = load_settings(overrides={"rules": [{"name": "nvrm_only", "when": ["nvrm_recent > 5"]}]}).rules
    [c] = check_rule_reach(DoctorContext(proc_root=proc, rules=rules, kernlog_source="off"))
    assert (c.status, c.title, c.detail) == ("WARN", "Rule nvrm_only", why)
    assert [c.status for c in check_rule_reach(DoctorContext(proc_root=proc, rules=rules))] == ["OK"]


def test_a_rule_that_can_never_fire_still_loads_for_the_guard_to_start() -> None:
    # accepted (a 0.1 configuration with such a rule must not leave the host unguarded); the
    # daemon says so at start (rule_never_fires) and sparkd doctor WARNs
    s = load_settings(overrides={"rules": [{"name": "never", "when": ["MemAvailable < 0GiB"]}]})
    assert [r.name for r in s.rules] == ["never"]


def test_the_quiet_gpu_cadence_may_not_be_faster_than_the_asked_one(tmp_path: Path) -> None:
    from sparkd.config import load_settings
    from sparkd.errors import ConfigError

    with pytest.raises(ConfigError, match="gpu_quiet_interval_s = 2 must be >= gpu_interval_s = 5"):
        load_settings(overrides={"state_dir": str(tmp_path), "gpu_quiet_interval_s": 2.0})
    s = load_settings(overrides={"state_dir": str(tmp_path)})
    assert (s.gpu_interval_s, s.gpu_quiet_interval_s) == (5.0, 30.0)


def test_doctor_warns_as_the_daemon_does_about_a_floor_this_host_sits_on(tmp_path: Path) -> None:
    """``doctor`` said "every threshold reachable" while the daemon warned at start that a rule may loop (its floor
    within the margin of the host's MemAvailable). It runs the daemon's floor check, MemAvailable now as healthy."""
    from sparkd.core.floors import check_floors
    from sparkd.core.rules import compile_rules
    from sparkd.ops.doctor import DoctorContext, check_rule_reach
    from sparkd.units import GiB

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n")
    p = tmp_path / "c.toml"
    p.write_text(  # 12 GiB available: a floor at 11.5 GiB is within the 1 GiB margin; 6 GiB is clear
        '[[rules]]\nname = "near"\nwhen = ["MemAvailable < 11.5GiB"]\n'
        '[[rules]]\nname = "fine"\nwhen = ["MemAvailable < 6GiB"]\n'
    )
    rules = load_settings(p).rules
    checks = check_rule_reach(DoctorContext(proc_root=proc, rules=rules))
    warned = {c.title: c.detail for c in checks if c.status == "WARN"}
    # the same finding the daemon reports as its watermark warning
    daemon_says = [
        w.message
        for w in check_floors(
            compile_rules(rules, 16 * GiB),
            healthy_mem_available_bytes=12 * GiB,
            low_watermark_bytes=None,
            min_free_kbytes=None,
            watermark_scale_factor=None,
        )
        if w.severity == "warning"
    ]
    assert daemon_says and set(warned) == {"Rule near"}, warned
    assert warned["Rule near"].startswith(daemon_says[0]), (warned, daemon_says)
    assert not any(c.status == "OK" for c in checks)
    # one rule clear of it: "1 rule" ("1 rules": helper-50)
    [ok] = check_rule_reach(DoctorContext(proc_root=proc, rules=[r for r in rules if r.name == "fine"]))
    assert ok.status == "OK" and ok.detail.startswith("1 rule, every threshold reachable"), ok


def test_a_warn_rule_already_below_its_line_is_a_note_in_doctor_and_status_alike(tmp_path: Path) -> None:
    """A warn rule whose line this healthy host is already below: ``sparkd doctor`` said the rules were "clear of its
    MemAvailable now" while ``sparkd status`` printed the same finding as "WATERMARK WARNING" (helper-50). Both say
    it as a note now: doctor an OK line with the daemon's text and no "clear", the status its ``watermark.notes``."""
    from sparkd.core.floors import check_floors
    from sparkd.core.rules import compile_rules
    from sparkd.ops.doctor import DoctorContext, check_rule_reach
    from sparkd.units import GiB

    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemFree: 8388608 kB\nMemAvailable: 12582912 kB\n")
    p = tmp_path / "c.toml"
    p.write_text(  # 12 GiB available: the warn rule's 14 GiB line already holds; the stop rule's 6 GiB is clear
        '[[rules]]\nname = "early"\nwhen = ["MemAvailable < 14GiB"]\naction = "warn"\n'
        '[[rules]]\nname = "fine"\nwhen = ["MemAvailable < 6GiB"]\n'
    )
    rules = load_settings(p).rules
    found = check_floors(
        compile_rules(rules, 16 * GiB),
        healthy_mem_available_bytes=12 * GiB,
        low_watermark_bytes=None,
        min_free_kbytes=None,
        watermark_scale_factor=None,
    )
    [note] = [w for w in found if w.rule == "early"]
    assert note.severity == "info" and "already holds" in note.message
    # it has no other signal: "only its other signals decide" was said of it, and it warned every minute (helper-55)
    assert "nothing else is needed: it trips at every cooldown for as long as this host stays so" in note.message
    checks = check_rule_reach(DoctorContext(proc_root=proc, rules=rules))
    assert [c.status for c in checks] == ["OK", "OK"], checks
    assert checks[0].detail == "2 rules, every threshold reachable on this host"  # no "clear of its MemAvailable"
    assert checks[1].title == "Rule early" and checks[1].detail.startswith(note.message)
    # the status keeps warnings for what is one; the note goes to its own list (0.1's snapshots have none)
    from sparkd.loop.status import WatermarkStatus

    # a note of a floor at the kernel's watermark is no line that holds now: the rules stay "clear" (helper-52), and
    # an OK line carries no action
    low_pages = 7 * GiB // os.sysconf("SC_PAGE_SIZE")
    (proc / "zoneinfo").write_text(f"Node 0, zone   Normal\n  pages free 1\n        min 1\n        low {low_pages}\n")
    fine = [r for r in rules if r.name == "fine"]
    checks = check_rule_reach(DoctorContext(proc_root=proc, rules=fine))
    assert [c.status for c in checks] == ["OK", "OK"], checks
    assert checks[0].detail == "1 rule, every threshold reachable on this host and clear of its MemAvailable now"
    assert "kernel" in checks[1].detail and checks[1].action == "", checks[1]
    base = {"vm": {}, "low_watermark_bytes": None, "healthy_mem_available_bytes": None, "healthy_t": None}
    old = WatermarkStatus.model_validate({**base, "launch_t": None, "launches": 0, "rules": {}, "warnings": []})
    assert old.notes == []
