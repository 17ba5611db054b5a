"""``bench/frames.py`` runs a real daemon and writes the call tree of one tick: it must keep finding the tick
(``Daemon._on_tick``) and what it calls, or the frame counts in the notes and the README cannot be made again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "frames.py"


def test_it_writes_the_call_tree_of_one_tick_of_a_running_daemon(tmp_path: Path) -> None:
    cfg = tmp_path / "sparkd.toml"
    cfg.write_text(
        f'state_dir = "{tmp_path / "state"}"\nlog_dir = "{tmp_path / "logs"}"\n'
        'interval_s = 0.25\nfast_interval_s = 0.25\nkernlog_source = "off"\n'
    )
    out = tmp_path / "frames.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKD_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--tick", "3", "--out", str(out), "--config", str(cfg), "run", "--no-api"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and out.read_text().endswith("\n")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    head, *tree = out.read_text().splitlines()
    calls, frames = (int(w) for w in head.replace(",", "").split() if w.isdigit())
    assert head == f"{calls} calls, {frames} python frames" and 0 < frames < calls == len(tree), head
    assert tree[0] == "loop/daemon.py:_on_tick", tree[:3]
    assert any(line.strip() == "loop/guard.py:read_sample" for line in tree), tree
    assert any(line.strip() == "loop/daemon_decide.py:handle_sync" for line in tree), tree
