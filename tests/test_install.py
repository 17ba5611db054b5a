"""sparkd.ops.install: files, modes, idempotence, and the systemctl steps (through a recording runner).

No test touches this machine's /etc: every install goes into a tmp root; the
"live" path uses ``live=True`` with the real host's systemd detection or a fake.
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from sparkd.errors import InvalidInput
from sparkd.ops.doctor import Check, systemd_is_pid1
from sparkd.ops.example_config import ConfigField, example_config_text, render_example_config
from sparkd.ops.install import (
    InstallReport,
    install,
    render_unit,
    uninstall,
    unit_template_path,
)
from tests.conftest import REPO

EXE = "/opt/sparkd/bin/sparkd"
OK_RISK = Check("OK", "daemon-reload GPU risk", "2 NVIDIA nodes linked in /dev/char")
BAD_RISK = Check(
    "FAIL",
    "daemon-reload GPU risk",
    "2/2 NVIDIA nodes lack /dev/char links",
    "nvidia-ctk system create-dev-char-symlinks --create-all",
)


class Recorder:
    """A runner that records argv and answers from a table (default: success)."""

    def __init__(self, answers: dict[tuple[str, ...], tuple[int, str]] | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.answers = answers or {}

    def __call__(self, argv: Sequence[str]) -> tuple[int, str]:
        self.calls.append(tuple(argv))
        return self.answers.get(tuple(argv), (0, ""))


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_it_lays_the_files_with_the_right_modes(tmp_path: Path) -> None:
    r = install(tmp_path, sparkd_exe=EXE, enable=False)
    unit = tmp_path / "etc/systemd/system/sparkd.service"
    conf = tmp_path / "etc/sparkd/sparkd.toml"
    token = tmp_path / "var/lib/sparkd/token"
    assert r.exit_code == 0
    assert r.files == {
        "/etc/systemd/system/sparkd.service": "created",
        "/etc/sparkd/sparkd.toml": "created",
        "/var/lib/sparkd/token": "created",
    }
    assert (_mode(unit), _mode(conf), _mode(token)) == (0o644, 0o644, 0o600)
    assert _mode(tmp_path / "var/lib/sparkd") == 0o700
    assert (tmp_path / "var/log/sparkd").is_dir()
    assert conf.read_text() == example_config_text()
    assert len(token.read_text().strip()) >= 40  # 32 random bytes, URL-safe base64


def test_it_rewrites_only_the_execstart_line(tmp_path: Path) -> None:
    install(tmp_path, sparkd_exe=EXE, enable=False)
    got = (tmp_path / "etc/systemd/system/sparkd.service").read_text().splitlines()
    want = (REPO / "systemd" / "sparkd.service").read_text().splitlines()
    diff = [(a, b) for a, b in zip(want, got, strict=True) if a != b]
    assert diff == [
        (
            "ExecStart=/usr/local/bin/sparkd run --config /etc/sparkd/sparkd.toml",
            f"ExecStart={EXE} run --config /etc/sparkd/sparkd.toml",
        )
    ]


def test_it_quotes_an_executable_path_with_spaces() -> None:
    text = render_unit("/opt/my tools/sparkd", "[Service]\nExecStart=/x run\n")
    assert text == '[Service]\nExecStart="/opt/my tools/sparkd" run\n'


def test_it_refuses_a_relative_executable_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="sparkd_exe"):
        install(tmp_path, sparkd_exe="sparkd")
    assert list(tmp_path.iterdir()) == []


def test_it_is_idempotent_and_keeps_the_token_and_an_edited_config(tmp_path: Path) -> None:
    install(tmp_path, sparkd_exe=EXE, enable=False)
    token = (tmp_path / "var/lib/sparkd/token").read_text()
    conf = tmp_path / "etc/sparkd/sparkd.toml"
    conf.write_text("[api]\nport = 9000\n")
    r = install(tmp_path, sparkd_exe=EXE, enable=False)
    assert r.files == {
        "/etc/systemd/system/sparkd.service": "unchanged",
        "/etc/sparkd/sparkd.toml": "kept",
        "/var/lib/sparkd/token": "kept",
    }
    assert (tmp_path / "var/lib/sparkd/token").read_text() == token
    assert conf.read_text() == "[api]\nport = 9000\n"
    r = install(tmp_path, sparkd_exe="/usr/bin/sparkd", enable=False)
    assert r.files["/etc/systemd/system/sparkd.service"] == "updated"


def test_it_keeps_an_existing_token_but_tightens_its_mode(tmp_path: Path) -> None:
    token = tmp_path / "var/lib/sparkd/token"
    token.parent.mkdir(parents=True)
    token.write_text("operator-chosen\n")
    os.chmod(token, 0o644)
    r = install(tmp_path, sparkd_exe=EXE, enable=False)
    assert token.read_text() == "operator-chosen\n"
    assert _mode(token) == 0o600
    assert any("token mode was wider than 0600" in ln for ln in r.lines)


def test_an_offline_root_gets_the_wants_link(tmp_path: Path) -> None:
    runner = Recorder()
    r = install(tmp_path, sparkd_exe=EXE, runner=runner)
    link = tmp_path / "etc/systemd/system/multi-user.target.wants/sparkd.service"
    assert os.readlink(link) == "/etc/systemd/system/sparkd.service"
    assert runner.calls == [] and r.exit_code == 0
    install(tmp_path, sparkd_exe=EXE, runner=runner)  # idempotent with the link present


def test_on_this_host_it_says_why_it_cannot_enable(tmp_path: Path) -> None:
    if systemd_is_pid1(Path("/run")):
        pytest.skip("this host runs systemd as PID 1; the not-PID-1 path needs a host without")
    runner = Recorder()
    r = install(
        tmp_path,
        sparkd_exe=EXE,
        live=True,
        systemd_pid1=lambda: systemd_is_pid1(Path("/run")),  # the real host's answer
        runner=runner,
    )
    assert r.exit_code == 1
    assert runner.calls == []
    text = r.format()
    assert "systemd is not running as PID 1 on this host" in text
    # the file written under the root, not a path of the live /etc (note 11)
    assert f"created   {tmp_path}/etc/systemd/system/sparkd.service" in text
    assert (tmp_path / "etc/systemd/system/sparkd.service").exists()
    assert f"{EXE} run --config /etc/sparkd/sparkd.toml" in text


def _live(tmp_path: Path, runner: Recorder, **kw: Any) -> InstallReport:
    return install(
        tmp_path,
        sparkd_exe=EXE,
        live=True,
        systemd_pid1=lambda: True,
        runner=runner,
        **kw,
    )


RELOAD = ("systemctl", "daemon-reload")
ENABLE = ("systemctl", "enable", "--no-reload", "--now", "sparkd.service")


def test_with_systemd_it_reloads_once_and_enables(tmp_path: Path) -> None:
    runner = Recorder()
    r = _live(tmp_path, runner, gpu_risk=lambda: OK_RISK)
    assert runner.calls == [RELOAD, ENABLE]
    assert r.exit_code == 0


def test_an_updated_unit_is_restarted(tmp_path: Path) -> None:
    install(tmp_path, sparkd_exe="/usr/bin/sparkd", enable=False)
    runner = Recorder()
    _live(tmp_path, runner, gpu_risk=lambda: OK_RISK)
    assert runner.calls == [RELOAD, ENABLE, ("systemctl", "try-restart", "sparkd.service")]


def test_it_checks_the_running_container_still_sees_its_gpu(tmp_path: Path) -> None:
    exec_ = ("docker", "exec", "abc123", "nvidia-smi", "-L")
    runner = Recorder({exec_: (0, "GPU 0: NVIDIA GB10 (UUID: GPU-1)\n")})
    r = _live(tmp_path, runner, gpu_risk=lambda: OK_RISK, running_container=lambda: "abc123")
    assert runner.calls == [RELOAD, ENABLE, exec_]
    assert "container abc123 still sees its GPU: GPU 0: NVIDIA GB10" in r.format()


def test_a_container_that_lost_its_gpu_must_be_recreated(tmp_path: Path) -> None:
    exec_ = ("docker", "exec", "abc123", "nvidia-smi", "-L")
    runner = Recorder({exec_: (255, "Failed to initialize NVML: Unknown Error\n")})
    r = _live(tmp_path, runner, gpu_risk=lambda: OK_RISK, running_container=lambda: "abc123")
    assert r.exit_code == 1
    assert "recreate the container" in r.format()


def test_it_does_not_reload_when_a_running_container_could_lose_its_gpu(tmp_path: Path) -> None:
    runner = Recorder()
    r = _live(tmp_path, runner, gpu_risk=lambda: BAD_RISK, running_container=lambda: "abc123")
    assert runner.calls == []
    assert r.exit_code == 1
    text = r.format()
    assert "nvidia-ctk system create-dev-char-symlinks --create-all" in text
    assert "not running `systemctl daemon-reload`" in text
    # Accepting the risk reloads and then checks the container.
    runner = Recorder()
    _live(
        tmp_path,
        runner,
        gpu_risk=lambda: BAD_RISK,
        running_container=lambda: "abc123",
        accept_gpu_risk=True,
    )
    assert runner.calls[:2] == [RELOAD, ENABLE]


def test_the_risk_without_a_running_container_is_reported_but_not_blocking(
    tmp_path: Path,
) -> None:
    runner = Recorder()
    r = _live(tmp_path, runner, gpu_risk=lambda: BAD_RISK)
    assert runner.calls == [RELOAD, ENABLE]
    assert r.exit_code == 0
    assert "FAIL: 2/2 NVIDIA nodes lack /dev/char links" in r.format()


def test_the_default_gpu_risk_check_reads_the_roots_dev(tmp_path: Path) -> None:
    (tmp_path / "dev" / "char").mkdir(parents=True)
    os.symlink("/dev/null", tmp_path / "dev" / "nvidia0")  # a char device without /dev/char link
    runner = Recorder()
    r = _live(tmp_path, runner, running_container=lambda: "abc123")
    assert RELOAD not in runner.calls
    assert "1/1 NVIDIA nodes lack /dev/char links" in r.format()


def test_a_failing_systemctl_is_reported(tmp_path: Path) -> None:
    runner = Recorder({ENABLE: (1, "Job for sparkd.service failed.")})
    r = _live(tmp_path, runner, gpu_risk=lambda: OK_RISK)
    assert r.exit_code == 1
    assert "Job for sparkd.service failed." in r.format()


def test_uninstall_keeps_config_and_data_unless_purge(tmp_path: Path) -> None:
    install(tmp_path, sparkd_exe=EXE)
    r = uninstall(tmp_path)
    assert not (tmp_path / "etc/systemd/system/sparkd.service").exists()
    assert not os.path.lexists(tmp_path / "etc/systemd/system/multi-user.target.wants/sparkd.service")
    assert (tmp_path / "etc/sparkd/sparkd.toml").exists()
    assert (tmp_path / "var/lib/sparkd/token").exists()
    assert r.files["/var/lib/sparkd"] == "kept"
    r = uninstall(tmp_path, purge=True)
    for d in ("etc/sparkd", "var/lib/sparkd", "var/log/sparkd"):
        assert not (tmp_path / d).exists()
    assert r.exit_code == 0


def test_uninstall_with_systemd_stops_then_reloads(tmp_path: Path) -> None:
    install(tmp_path, sparkd_exe=EXE, enable=False)
    runner = Recorder()
    r = uninstall(tmp_path, live=True, systemd_pid1=lambda: True, runner=runner, gpu_risk=lambda: OK_RISK)
    assert runner.calls == [
        ("systemctl", "disable", "--no-reload", "--now", "sparkd.service"),
        RELOAD,
    ]
    assert "the vLLM container keeps running" in r.format()
    runner = Recorder()
    install(tmp_path, sparkd_exe=EXE, enable=False)
    uninstall(
        tmp_path,
        live=True,
        systemd_pid1=lambda: True,
        runner=runner,
        gpu_risk=lambda: BAD_RISK,
        running_container=lambda: "abc123",
    )
    assert RELOAD not in runner.calls


SAMPLE_FIELDS: list[ConfigField] = [
    ("state_dir", "/var/lib/sparkd", "SQLite store, API token and postmortem archives."),
    ("api.port", 8741, "Listen port of the API and web UI."),
    ("guard.interval_s", 1.0, "Seconds between /proc/meminfo samples."),
    ("rules.low_available_and_free", ["10GiB", "2GiB"], "Two floors."),
    ("container.stop_timeout_s", 30, "Grace for docker stop."),
]


def test_the_example_config_has_every_setting_commented_and_round_trips() -> None:
    text = render_example_config(SAMPLE_FIELDS)
    assert tomllib.loads(text) == {"api": {}, "container": {}, "guard": {}, "rules": {}}
    uncommented = []
    leaves = {k.rpartition(".")[2] for k, _, _ in SAMPLE_FIELDS}
    for line in text.splitlines():
        body = line.removeprefix("# ")
        if line.startswith("# ") and body.partition(" = ")[0] in leaves and " = " in body:
            uncommented.append(body)
        else:
            uncommented.append(line)
    data = tomllib.loads("\n".join(uncommented))
    for key, default, _ in SAMPLE_FIELDS:
        node = data
        for part in key.split("."):
            node = node[part]
        assert node == default, key


def test_render_example_config_is_generic() -> None:
    text = render_example_config(
        [
            ("a.b.flag", True, "A flag."),
            ("top", None, "Unset by default."),
            ("a.b.path", 'C:\\x "q"', "A string with escapes."),
        ]
    )
    assert text.index("# top = <unset>") < text.index("[a.b]")
    assert '# path = "C:\\\\x \\"q\\""' in text
    assert "# flag = true" in text


def test_the_unit_template_is_found_in_the_checkout() -> None:
    assert unit_template_path() == REPO / "systemd" / "sparkd.service"
