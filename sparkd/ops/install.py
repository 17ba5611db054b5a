"""``sparkd install`` / ``uninstall``: lay down the unit, config and token; enable under systemd.

``install(root, *, sparkd_exe, ...) -> InstallReport`` writes, under ``root``:

* ``etc/systemd/system/sparkd.service`` (0644) — systemd/sparkd.service with
  ``ExecStart=`` rewritten to ``sparkd_exe``;
* ``etc/sparkd/sparkd.toml`` (0644, never overwritten) — every setting
  commented out with its default (``example_config_text()``); it holds no
  secret;
* ``var/lib/sparkd/token`` (0600, never overwritten) — the API token;
* ``var/lib/sparkd`` (0700) and ``var/log/sparkd`` (0750).

On the live host (``root == /``) it then checks the daemon-reload GPU risk
(doctor's ``check_dev_char_symlinks``), runs ``systemctl daemon-reload`` and
``systemctl enable --now sparkd``, and checks that a running managed container
still sees its GPU. When systemd is not PID 1 it says so and returns a
non-zero ``exit_code``. Every side effect goes through an injectable runner.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sparkd.errors import InvalidInput
from sparkd.ops.doctor import (
    Check,
    DoctorContext,
    Runner,
    check_dev_char_symlinks,
    run_command,
    systemd_is_pid1,
)
from sparkd.ops.example_config import example_config_text
from sparkd.resources import systemd_dir

UNIT_NAME = "sparkd.service"
UNIT_REL = Path("etc/systemd/system") / UNIT_NAME
WANTS_REL = Path("etc/systemd/system/multi-user.target.wants") / UNIT_NAME
CONFIG_DIR_REL = Path("etc/sparkd")
CONFIG_REL = CONFIG_DIR_REL / "sparkd.toml"
STATE_DIR_REL = Path("var/lib/sparkd")
TOKEN_REL = STATE_DIR_REL / "token"
LOG_DIR_REL = Path("var/log/sparkd")
NVML_LOST = "Failed to initialize NVML: Unknown Error"


def unit_template_path() -> Path:
    """systemd/sparkd.service: inside the wheel (``sparkd/systemd``) or in the checkout.

    Raises FileNotFoundError when neither holds it.
    """
    path = systemd_dir() / UNIT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{UNIT_NAME} template not found in {path.parent}")
    return path


def render_unit(sparkd_exe: str, template: str | None = None) -> str:
    """The unit text with ``ExecStart=`` pointing at ``sparkd_exe`` (quoted if it has spaces)."""
    text = unit_template_path().read_text() if template is None else template
    exe = f'"{sparkd_exe}"' if re.search(r"\s", sparkd_exe) else sparkd_exe
    new, n = re.subn(r"(?m)^ExecStart=\S+", lambda _m: f"ExecStart={exe}", text)
    if n != 1:
        raise ValueError(f"expected one ExecStart= line in the unit template, found {n}")
    return new


@dataclass
class InstallReport:
    """What was done: ``files`` path → created/updated/unchanged/kept/removed; ``lines`` to print.

    ``exit_code`` is 0 when everything asked for was done, 1 otherwise
    (systemd not PID 1, a systemctl failure, a container that lost its GPU).
    """

    root: Path
    files: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    exit_code: int = 0

    def say(self, line: str) -> None:
        self.lines.append(line)

    def fail(self, line: str) -> None:
        self.lines.append(line)
        self.exit_code = 1

    def format(self) -> str:
        # under --root, the path written (a new user read "created /etc/systemd/system/sparkd.service" and
        # looked in the live /etc); ``files`` keeps the installed view
        prefix = "" if self.root == Path("/") else str(self.root).rstrip("/")
        done = [f"{state:<9} {prefix}{path}" for path, state in self.files.items()]
        return "\n".join([*done, *self.lines])


def _write(report: InstallReport, path: Path, text: str, mode: int, *, keep: bool) -> None:
    """Write atomically; ``keep``: an existing file is left as is."""
    key = "/" + str(path.relative_to(report.root)) if path.is_relative_to(report.root) else str(path)
    if path.exists():
        if keep:
            report.files[key] = "kept"
            return
        if path.read_text() == text:
            os.chmod(path, mode)
            report.files[key] = "unchanged"
            return
        state = "updated"
    else:
        state = "created"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    report.files[key] = state


def _ensure_token(report: InstallReport, path: Path, token_bytes: int) -> None:
    key = "/" + str(path.relative_to(report.root))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o600)
            report.say(f"token mode was wider than 0600: fixed ({key})")
        report.files[key] = "kept"
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(token_bytes) + "\n")
    report.files[key] = "created"


def _gpu_risk_default(root: Path, runner: Runner) -> Callable[[], Check]:
    return lambda: check_dev_char_symlinks(DoctorContext(dev_root=root / "dev", run=runner))[0]


def install(
    root: Path = Path("/"),
    *,
    sparkd_exe: str,
    token_bytes: int = 32,
    enable: bool = True,
    runner: Runner = run_command,
    live: bool | None = None,
    systemd_pid1: Callable[[], bool] | None = None,
    running_container: Callable[[], str | None] = lambda: None,
    gpu_risk: Callable[[], Check] | None = None,
    accept_gpu_risk: bool = False,
    config_text: str | None = None,
) -> InstallReport:
    """Install sparkd under ``root``; idempotent (config and token are never overwritten).

    Args:
        sparkd_exe: absolute path of the ``sparkd`` console script for ExecStart.
        token_bytes: random bytes in a new API token (``secrets.token_urlsafe``).
        enable: enable and start the unit (live) or create the wants link (offline root).
        live: act on the running host's systemd; default ``root == /``.
        systemd_pid1: default ``/run/systemd/system`` exists (sd_booted(3)).
        running_container: id of the running sparkd-managed container, if any.
        gpu_risk: the daemon-reload GPU risk check; default doctor's, over ``root/dev``.
        accept_gpu_risk: reload even though a running container may lose its GPU.

    Raises:
        InvalidInput: ``sparkd_exe`` is not an absolute path (nothing is written).
    """
    root = Path(root)
    live = root == Path("/") if live is None else live
    if not os.path.isabs(sparkd_exe):
        raise InvalidInput("sparkd_exe", sparkd_exe, "an absolute path to the sparkd executable")
    report = InstallReport(root)
    _write(report, root / UNIT_REL, render_unit(sparkd_exe), 0o644, keep=False)
    if sparkd_exe.startswith(("/tmp/", "/var/tmp/")):
        report.say(
            f"WARNING: ExecStart={sparkd_exe} lies under a temporary directory, which the unit hides "
            "(PrivateTmp=yes): the service will not start. Install sparkd in /opt or /usr/local."
        )
    elif sparkd_exe.startswith(("/home/", "/root/")):
        report.say(
            f"note: ExecStart={sparkd_exe} lies under a home directory, which the unit mounts read-only "
            "(ProtectHome=read-only): it runs, but /opt or /usr/local is the usual place."
        )
    (root / CONFIG_DIR_REL).mkdir(parents=True, exist_ok=True)
    text = example_config_text() if config_text is None else config_text
    _write(report, root / CONFIG_REL, text, 0o644, keep=True)
    (root / STATE_DIR_REL).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root / STATE_DIR_REL, 0o700)
    (root / LOG_DIR_REL).mkdir(mode=0o750, parents=True, exist_ok=True)
    _ensure_token(report, root / TOKEN_REL, token_bytes)
    if not enable:
        report.say("not enabled (--no-enable): start with `systemctl enable --now sparkd`")
        return report
    if not live:
        wants = root / WANTS_REL
        wants.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(wants):
            os.symlink("/" + str(UNIT_REL), wants)
        report.say(f"offline root {root}: enabled for multi-user.target (no systemctl run)")
        return report
    booted = systemd_pid1 or (lambda: systemd_is_pid1(root / "run"))
    if not booted():
        report.fail(
            "systemd is not running as PID 1 on this host (no /run/systemd/system), so the unit "
            "cannot be reloaded, enabled or started. The files above are in place; run "
            f"`{sparkd_exe} run --config /etc/sparkd/sparkd.toml` under your own supervisor."
        )
        return report
    container = running_container()
    if not _reload_is_safe(report, (gpu_risk or _gpu_risk_default(root, runner))(), container, accept_gpu_risk):
        return report
    if not _systemctl(report, runner, "daemon-reload"):
        return report
    if _systemctl(report, runner, "enable", "--no-reload", "--now", UNIT_NAME):
        report.say("sparkd.service enabled and started")
    if report.files.get("/" + str(UNIT_REL)) == "updated":
        _systemctl(report, runner, "try-restart", UNIT_NAME)
    if container:
        _check_container_gpu(report, runner, container)
    return report


def _reload_is_safe(report: InstallReport, risk: Check, container: str | None, accept: bool) -> bool:
    if risk.status == "OK":
        return True
    report.say(f"{risk.status}: {risk.detail}")
    report.say(f"  → {risk.action}")
    if not container or accept:
        return True
    report.fail(
        f"not running `systemctl daemon-reload`: container {container} is running and could "
        "lose its GPU. Either create the /dev/char links first and run install again, or "
        "accept the risk (--accept-gpu-risk) and recreate the container if it loses its GPU."
    )
    return False


def _systemctl(report: InstallReport, runner: Runner, *args: str) -> bool:
    rc, out = runner(["systemctl", *args])
    if rc != 0:
        report.fail(f"`systemctl {' '.join(args)}` failed ({rc}): {out.strip()}")
        if "enable" in args:
            report.say("  → journalctl -u sparkd -b for the reason")
    return rc == 0


def _check_container_gpu(report: InstallReport, runner: Runner, container: str) -> None:
    rc, out = runner(["docker", "exec", container, "nvidia-smi", "-L"])
    if NVML_LOST in out:
        report.fail(
            f"container {container} lost its GPU after daemon-reload ({NVML_LOST}): recreate the "
            "container (stop, remove, launch again); do not debug the model"
        )
    elif rc == 0:
        first = out.strip().splitlines()[0] if out.strip() else "ok"
        report.say(f"container {container} still sees its GPU: {first}")
    else:
        report.say(f"could not check container {container}'s GPU ({rc}): {out.strip()}")


def uninstall(
    root: Path = Path("/"),
    *,
    purge: bool = False,
    runner: Runner = run_command,
    live: bool | None = None,
    systemd_pid1: Callable[[], bool] | None = None,
    running_container: Callable[[], str | None] = lambda: None,
    gpu_risk: Callable[[], Check] | None = None,
) -> InstallReport:
    """Stop and disable sparkd (live systemd), remove the unit; keep config and data unless purge.

    Stopping sparkd does not stop the vLLM container (it is dockerd's child).
    The final ``daemon-reload`` is skipped, with a note, when a running
    container could lose its GPU (see ``install``).
    """
    root = Path(root)
    live = root == Path("/") if live is None else live
    report = InstallReport(root)
    booted = live and (systemd_pid1 or (lambda: systemd_is_pid1(root / "run")))()
    if booted:
        _systemctl(report, runner, "disable", "--no-reload", "--now", UNIT_NAME)
        report.say("sparkd stopped; the vLLM container keeps running")
    elif live:
        report.say("systemd is not running as PID 1 here: nothing to stop or disable")
    for rel in (WANTS_REL, UNIT_REL):
        p = root / rel
        if os.path.lexists(p):
            p.unlink()
            report.files["/" + str(rel)] = "removed"
    if booted:
        risk = (gpu_risk or _gpu_risk_default(root, runner))()
        container = running_container()
        if risk.status != "OK" and container:
            report.say(f"{risk.status}: {risk.detail}")
            report.say(
                f"not running `systemctl daemon-reload`: container {container} could lose its "
                "GPU; systemd forgets the unit at the next daemon-reload or boot"
            )
        else:
            _systemctl(report, runner, "daemon-reload")
    for rel in (CONFIG_DIR_REL, STATE_DIR_REL, LOG_DIR_REL):
        p = root / rel
        if not p.exists():
            continue
        if purge:
            shutil.rmtree(p)
            report.files["/" + str(rel)] = "removed"
        else:
            report.files["/" + str(rel)] = "kept"
    return report
