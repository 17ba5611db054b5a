"""Benchmark: two versions of sparkd side by side, idle, in one window (before/after a change).

``bench/idle.py`` gives one version's figure; on a 2-CPU VM the same daemon measures up to 2x apart
from one run to the next (the host, ``dockerd``, the kernel's background work), so a before/after
taken in two runs says little. This runs both in the same window: ``--pairs`` daemons of each
version, started alternately (A, B, A, B, ...), every one monitor-only, API on, 1 Hz
(``idle.Daemon``), each in its own state directory. After ``--warmup`` s it reads the CPU of every
thread of every daemon (``/proc/PID/task/*/schedstat``, ns) at the start and end of ``--window`` s
and prints, per daemon, µs of CPU per second in all, for the main thread (the event loop and the
ticks), for the other threads (the database writer) and for its child processes (the NVML helper on a
GPU host), and the RSS of the daemon and of its children at the end; then each version's median and B's change
against A in percent. Spread between identical daemons in one window is the noise floor to compare
that change with (on this VM about ±10 %).

A version is a git revision of this repository (``git archive REV sparkd web migrations systemd``,
extracted into a temporary directory: the repository is not touched), ``.`` (the working tree as it
is, uncommitted changes included), or a directory holding such a tree (extracted beforehand, e.g. on a
machine the repository's history does not travel to). Each runs from this virtual environment, with
``PYTHONPATH`` set to its tree and a working directory outside any checkout; before measuring, the script checks that
``import sparkd`` resolves inside that tree (else it would measure the wrong code and say so).
A version whose dependencies differ from this environment's cannot be compared this way.

Run: .venv/bin/python bench/ab.py --a REV [--b .] [--pairs 2] [--window 120] [--warmup 70]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import idle  # the bench's own helper, next to this file

REPO = Path(__file__).resolve().parent.parent
TREE_PARTS = ("sparkd", "web", "migrations", "systemd")


def extract(rev: str, dest: Path, repo: Path = REPO) -> Path:
    """The tree of ``rev`` (``sparkd``, ``web``, ``migrations``, ``systemd``) under ``dest``; ``.``: ``repo``
    itself; a directory holding a ``sparkd`` package: that directory as it is (a tree extracted elsewhere, e.g.
    carried to a machine with no git history). Raises ``SystemExit`` with git's message when ``rev`` is not a
    revision of ``repo``."""
    if rev == ".":
        return repo
    if "/" in rev and (Path(rev) / "sparkd" / "__init__.py").is_file():  # a path, never a revision's name
        return Path(rev).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest.with_suffix(".tar")
    with archive.open("wb") as f:
        r = subprocess.run(["git", "-C", str(repo), "archive", rev, *TREE_PARTS], stdout=f, stderr=subprocess.PIPE)
    if r.returncode != 0:
        raise SystemExit(f"--a/--b {rev!r}: {r.stderr.decode(errors='replace').strip()}")
    with tarfile.open(archive) as t:
        t.extractall(dest, filter="data")
    archive.unlink()
    return dest


def resolved_package(tree: Path, cwd: str) -> Path:
    """Where ``import sparkd`` resolves for a daemon run with ``PYTHONPATH=tree`` from ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", "import sparkd, os; print(os.path.dirname(os.path.realpath(sparkd.__file__)))"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def per_thread_ns(pid: int) -> dict[str, int]:
    """CPU ns per live thread of ``pid`` (``schedstat``): ``main`` and ``other`` (every other thread)."""
    out: collections.Counter[str] = collections.Counter()
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((t / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
        out["main" if t.name == str(pid) else "other"] += ns
    for child in idle.children(pid):  # the NVML helper, on a GPU host
        with contextlib.suppress(OSError):
            out["helper"] += int(idle.sched(child)[0] * 1e9)
    return dict(out)


def rss_mib(pid: int) -> tuple[float, float]:
    """RSS of ``pid`` and of its children together (its NVML helper), MiB."""
    kids = 0
    for child in idle.children(pid):
        with contextlib.suppress(OSError):
            kids += idle.rss_bytes(child)
    return idle.rss_bytes(pid) / 2**20, kids / 2**20


def change_pct(a: float, b: float) -> float:
    """B against A, in percent (negative: B costs less)."""
    return (b - a) / a * 100.0 if a else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--a", required=True, help="version A: a git revision, . for the working tree, or a path to a tree (with a /)"
    )
    ap.add_argument("--b", default=".", help="version B (default: the working tree)")
    ap.add_argument("--pairs", type=int, default=2, help="daemons of each version (default 2)")
    ap.add_argument("--window", type=float, default=120.0, help="measuring window, s")
    ap.add_argument("--warmup", type=float, default=70.0, help="after READY=1 of the last daemon, s")
    args = ap.parse_args()
    if args.pairs < 1:
        raise SystemExit(f"--pairs {args.pairs}: must be >= 1")
    root = Path(tempfile.mkdtemp(prefix="sparkd-ab-"))
    cwd = str(root)  # outside any checkout: `python -m` puts the working directory first on sys.path
    trees = {"A": extract(args.a, root / "tree-a"), "B": extract(args.b, root / "tree-b")}
    for name, tree in trees.items():
        got = resolved_package(tree, cwd)
        if got != (tree / "sparkd").resolve():
            raise SystemExit(f"version {name}: import sparkd resolves to {got}, not {tree / 'sparkd'}")
    daemons: list[tuple[str, idle.Daemon]] = []
    try:
        for i in range(args.pairs):
            for name in ("A", "B"):
                sub = root / f"{name}{i}"
                sub.mkdir()
                d = idle.Daemon(sub, 1.0, env={"PYTHONPATH": str(trees[name])}, cwd=cwd)
                daemons.append((name, d))
                d.wait_ready()
        time.sleep(args.warmup)
        t0 = time.monotonic()
        start = [per_thread_ns(d.proc.pid) for _, d in daemons]
        time.sleep(args.window)
        end = [per_thread_ns(d.proc.pid) for _, d in daemons]
        w = time.monotonic() - t0
        rss = [rss_mib(d.proc.pid) for _, d in daemons]
    finally:
        for _, d in daemons:
            d.stop()
    print(f"A = {args.a}, B = {args.b}; {args.pairs} daemons each, 1 Hz idle, window {w:.0f} s after {args.warmup:g} s")
    print(
        f"{'daemon':8s} {'µs/s':>7s} {'main':>7s} {'other':>7s} {'helper':>7s} {'+helper':>8s} "
        f"{'RSS MiB':>8s} {'helper MiB':>10s}"
    )
    totals: dict[str, list[float]] = {"A": [], "B": []}
    withh: dict[str, list[float]] = {"A": [], "B": []}
    for (name, _), s, e, (mem, kids) in zip(daemons, start, end, rss, strict=True):
        parts = {k: (e.get(k, 0) - s.get(k, 0)) / w / 1e3 for k in ("main", "other", "helper")}
        total = parts["main"] + parts["other"]
        totals[name].append(total)
        withh[name].append(total + parts["helper"])
        print(
            f"{name:8s} {total:7.0f} {parts['main']:7.0f} {parts['other']:7.0f} {parts['helper']:7.0f} "
            f"{total + parts['helper']:8.0f} {mem:8.1f} {kids:10.1f}"
        )
    ma, mb = statistics.median(totals["A"]), statistics.median(totals["B"])
    print(f"median A {ma:.0f} µs/s, B {mb:.0f} µs/s: B {change_pct(ma, mb):+.1f} % against A")
    ha, hb = statistics.median(withh["A"]), statistics.median(withh["B"])
    if (ha, hb) != (ma, mb):
        print(f"with their NVML helpers: A {ha:.0f} µs/s, B {hb:.0f} µs/s: B {change_pct(ha, hb):+.1f} % against A")
    spread = [max(v) - min(v) for v in totals.values() if len(v) > 1]
    if spread:
        print(f"spread between daemons of one version: up to {max(spread):.0f} µs/s (the noise to compare with)")


if __name__ == "__main__":
    main()
