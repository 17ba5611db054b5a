"""Benchmark: resident memory of idle daemons over time (issue 18: RSS ≤ 80 MiB after an hour idle).

Starts one real ``sparkd run`` (1 Hz, monitor-only, API on, its own state directory and port) per
source tree named on the command line, side by side, and prints each one's VmRSS every minute, then
the figures at 5, 30 and ``--minutes`` minutes. Default: this checkout alone, for 70 minutes.

A tree is a directory holding the ``sparkd`` package, e.g. an older commit checked out with
``git worktree add /tmp/old 60a117d``. Each daemon runs with ``PYTHONPATH`` and the working directory
set to its tree (``python -m`` puts the working directory first on ``sys.path``: started from this
checkout, every daemon would run this checkout's code).

``--kernlog off`` keeps the daemons from reading the kernel log: on a host shared with tests that
inject NV_ERR_NO_MEMORY lines into /dev/kmsg, every daemon reads them, and a flood of thousands of
lines grows each by ~3 MiB (measured) — no longer an idle figure. The figure stops growing once the
live view is full (1,800 samples, ~30 min at 1 Hz).

Run: .venv/bin/python bench/rss.py [--minutes 70] [--kernlog off|kmsg] [TREE ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float | None:
    """VmRSS of ``pid`` in MiB, or None when it has ended."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start(tree: Path, root: Path, kernlog: str) -> subprocess.Popen[bytes]:
    d = root / tree.name
    d.mkdir()
    cfg = d / "sparkd.toml"
    cfg.write_text(
        f'state_dir = "{d}"\nlog_dir = "{d / "logs"}"\ninterval_s = 1.0\nfast_interval_s = 1.0\n'
        f'kernlog_source = "{kernlog}"\n[api]\nhost = "127.0.0.1"\nport = {free_port()}\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKD_") and k != "NOTIFY_SOCKET"}
    env["PYTHONPATH"] = str(tree)
    return subprocess.Popen(
        [sys.executable, "-m", "sparkd.face.cli", "--config", str(cfg), "run"],
        env=env,
        cwd=tree,
        stdout=subprocess.DEVNULL,
        stderr=open(d / "stderr.log", "wb"),  # lives as long as the daemon
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="*", type=Path, help="source trees (default: this checkout)")
    ap.add_argument("--minutes", type=float, default=70.0, help="how long to watch (default 70)")
    ap.add_argument("--kernlog", choices=("off", "kmsg"), default="off", help="the daemons' kernlog_source")
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees] or [REPO]
    for t in trees:
        if not (t / "sparkd" / "__init__.py").exists():
            raise SystemExit(f"{t}: no sparkd package there")
    names = [f"{t.name}" for t in trees]
    if len(set(names)) != len(names):
        raise SystemExit("trees must have different directory names")
    with tempfile.TemporaryDirectory(prefix="sparkd-rss-") as tmp:
        procs = {name: start(t, Path(tmp), args.kernlog) for name, t in zip(names, trees, strict=True)}
        t0 = time.monotonic()
        seen: dict[str, list[tuple[float, float | None]]] = {n: [] for n in names}
        try:
            minute = 0
            while minute <= args.minutes:
                time.sleep(max(0.0, t0 + minute * 60 + 20 - time.monotonic()))
                at = (time.monotonic() - t0) / 60
                row = []
                for n, p in procs.items():
                    v = rss_mib(p.pid) if p.poll() is None else None
                    seen[n].append((at, v))
                    row.append(f"{n}={v:.1f}" if v is not None else f"{n}=ended")
                print(f"{at:6.1f} min  " + "  ".join(row), flush=True)
                minute += 1
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                p.wait(30)
    print(f"VmRSS, MiB (1 Hz, API on, kernlog {args.kernlog}):")
    for n in names:
        marks = []
        for want in (5.0, 30.0, args.minutes):
            near = min(seen[n], key=lambda x: abs(x[0] - want))
            marks.append(f"{near[0]:.0f} min {near[1]:.1f}" if near[1] is not None else f"{near[0]:.0f} min ended")
        print(f"  {n}: " + ", ".join(marks))
    print("goal: <= 80 MiB after an hour idle")


if __name__ == "__main__":
    main()
