"""Benchmark: where an idle daemon's tick spends its CPU, measured inside a running ``sparkd run``.

``bench/idle.py`` says what the whole process costs; this says which part of the tick costs it. It
starts one real daemon (monitor-only, API on, 1 Hz; ``idle.Daemon``) through this file as a wrapper
(``--child``) that wraps each phase of the tick in ``time.thread_time_ns()`` (the CPU time of the
thread that runs it) before sparkd starts. After ``--warmup`` s it lets the daemon run ``--window`` s,
asks it for its figures (SIGUSR2) and prints, per phase, the CPU per tick (µs) and the calls per
tick. Figures are inclusive (a phase holds the phases it calls) and each carries the wrapper's own
cost (two ``clock_gettime`` system calls, ~1-3 µs). They are measured in place, at 1 Hz, on the idle
host: on a VM whose idle vCPU loses its caches that is several times what the same code costs when
timed in a loop (``bench/tick.py``), and it is what the daemon pays. The process's CPU per thread
(``schedstat``) is printed beside them: the main thread (event loop and ticks) and the writer's thread.

Run: .venv/bin/python bench/phases.py [--window 60] [--warmup 70]
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (module, owner or None for a module function, attribute): the tick's phases, outermost first
PHASES: tuple[tuple[str, str | None, str], ...] = (
    ("sparkd.loop.daemon", "Daemon", "_on_tick"),
    ("sparkd.loop.guard", "Guard", "poll_kernel"),
    ("sparkd.loop.guard", "Guard", "read_sample"),
    ("sparkd.sense.procfs", "ProcReader", "named_meminfo"),
    ("sparkd.sense.procfs", "ProcReader", "psi"),
    ("sparkd.sense.procfs", "ShmReader", "read"),
    ("sparkd.loop.guard", None, "build_sample"),
    ("sparkd.loop.guard", "Guard", "evaluate"),
    ("sparkd.loop.daemon_decide", None, "handle_sync"),
    ("sparkd.store.store", "Writer", "submit"),
    ("sparkd.loop.daemon_view", None, "check_blind"),
    ("sparkd.loop.daemon_decide", None, "refresh_status"),
    ("sparkd.loop.daemon", "Daemon", "status_json"),
    ("sparkd.loop.daemon", "Daemon", "_after_tick"),
    ("sparkd.loop.daemon_decide", None, "update_mode"),
    ("sparkd.loop.daemon", "Daemon", "_ping_watchdog"),
    # the writer's batch (every store.WRITE_EVERY_S: ~0.2 calls per tick), in its thread
    ("sparkd.store.store", "Writer", "_write_locked"),
    ("sparkd.store.store", "Store", "write_batch"),
    ("sparkd.store.keeper", "DbKeeper", "replaced"),
    ("sparkd.store.store", "Writer", "dirs_changed"),
)


def child(out: str, argv: list[str]) -> None:
    """In the daemon's process: wrap the phases, then run ``sparkd`` with ``argv``."""
    import importlib

    cpu: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    clock = time.thread_time_ns

    def wrap(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return f(*a, **k)
            finally:
                cpu[label] += clock() - t0
                calls[label] += 1

        return timed

    for mod_name, owner_name, attr in PHASES:
        mod = importlib.import_module(mod_name)
        owner = getattr(mod, owner_name) if owner_name else mod
        label = f"{owner_name or mod_name.rsplit('.', 1)[1]}.{attr}"
        setattr(owner, attr, wrap(label, getattr(owner, attr)))
    base: dict[str, tuple[int, int]] = {}

    def mark(*_a: Any) -> None:  # SIGUSR1: the window starts
        base.clear()
        base.update({k: (cpu[k], calls[k]) for k in cpu})

    def dump(*_a: Any) -> None:  # SIGUSR2: the window ends
        ticks = max(calls["Daemon._on_tick"] - base.get("Daemon._on_tick", (0, 0))[1], 1)
        with open(out, "w") as f:
            for k in cpu:
                c0, n0 = base.get(k, (0, 0))
                f.write(f"{k}\t{(cpu[k] - c0) / ticks / 1e3:.1f}\t{(calls[k] - n0) / ticks:.2f}\n")

    signal.signal(signal.SIGUSR1, mark)
    signal.signal(signal.SIGUSR2, dump)
    from sparkd.face.cli import main as sparkd_main

    sys.argv = ["sparkd", *argv]
    sparkd_main()


def threads(pid: int) -> dict[str, int]:
    """CPU ns per thread of ``pid`` (``schedstat``): ``main`` (the event loop) and the others by tid."""
    out: dict[str, int] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            out["main" if t.name == str(pid) else f"thread {t.name}"] = int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=60.0, help="measuring window, s")
    ap.add_argument(
        "--warmup",
        type=float,
        default=70.0,
        help="seconds after READY=1 before the window (after the first retention pass, at 60 s, as bench/idle.py)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import idle

    root = Path(tempfile.mkdtemp(prefix="sparkd-phases-"))
    out = root / "phases.tsv"
    d = idle.Daemon(root, 1.0, cmd=[sys.executable, os.path.abspath(__file__), "--child", str(out)])
    try:
        d.wait_ready()
        time.sleep(args.warmup)
        os.kill(d.proc.pid, signal.SIGUSR1)
        before = threads(d.proc.pid)
        time.sleep(args.window)
        after = threads(d.proc.pid)
        os.kill(d.proc.pid, signal.SIGUSR2)
        for _ in range(200):  # the handler runs at the daemon's next tick
            if out.exists() and out.stat().st_size:
                break
            time.sleep(0.05)
        rows = [line.split("\t") for line in out.read_text().splitlines()]
    finally:
        d.stop()
    print(f"one idle daemon at 1 Hz, monitor-only, API on; window {args.window:.0f} s after {args.warmup:.0f} s")
    print("process CPU per thread (schedstat), µs/s:")
    for k in after:
        print(f"  {k:<20} {(after[k] - before.get(k, 0)) / args.window / 1e3:7.0f}")
    print(f"{'phase (inclusive)':<32} {'µs/tick':>8} {'calls/tick':>11}")
    for label, us, n in sorted(rows, key=lambda r: -float(r[1])):
        print(f"{label:<32} {float(us):8.1f} {float(n):11.2f}")


if __name__ == "__main__":
    main()
