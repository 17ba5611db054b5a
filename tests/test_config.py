from __future__ import annotations

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
        ({"container": {"memory": "-3GiB"}}, "container.memory = \"-3GiB\": '-3GiB' must be a positive size"),
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
