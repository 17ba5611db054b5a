"""The README's two commands, as written: command 1 sets up and runs sparkd; command 2 is what CI runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from conftest import REPO, in_ci, need
from sparkdproc import db_query, free_port, wait_for

from sparkd.sense import procfs


def _commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_has_exactly_two_commands_and_ci_runs_the_second() -> None:
    cmds = _commands()
    assert len(cmds) == 2, cmds
    assert cmds[1] == "bash scripts/test"
    assert "bash scripts/test" in (REPO / ".ci" / "run").read_text()


def test_readme_command_1_samples_this_host_within_5_s(tmp_path: Path) -> None:
    """Runs command 1 verbatim in a copy of the checkout (state and port moved by SPARKD_* env)."""
    need(shutil.which("git") is not None, "git")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    if not files:
        need(in_ci() is False, "not a git checkout")
    work = tmp_path / "sparkd"
    for f in files:
        if (REPO / f).is_file():
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, work / f)
    cmd1 = _commands()[0]
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_") and k != "VIRTUAL_ENV"}
    env.update(
        SPARKD_STATE_DIR=str(state),
        SPARKD_LOG_DIR=str(state / "logs"),
        SPARKD_API__PORT=str(free_port()),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    p = subprocess.Popen(
        ["bash", "-c", cmd1],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    db = state / "sparkd.db"
    try:
        # pip install first (minutes on a cold cache), then the daemon starts: time from its first run row
        started = wait_for(lambda: db_query(db, "SELECT started_at FROM daemon_runs"), 600, 0.1)
        assert started, p.stdout.read() if p.poll() is not None and p.stdout else "sparkd never started"
        t0 = time.time()
        rows = wait_for(lambda: db_query(db, "SELECT ts, mem_total FROM samples"), 20.0, 0.05)
        assert rows and time.time() - t0 < 5.0
        assert rows[0][1] * 1024 == procfs.read_meminfo().fields["MemTotal"]  # stored as KiB
        st = subprocess.run(
            [str(work / ".venv" / "bin" / "sparkd"), "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["sample"]["mem_total"] == rows[0][1] * 1024  # bytes again
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)
