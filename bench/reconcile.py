"""Benchmark: the cost of reconciling with Docker once per supervisor tick.

One reconciliation = ``ContainerManager.ping`` + ``ContainerManager.state`` (one ``docker
inspect`` of the one container) + ``core.lifecycle.transition`` — what ``Supervisor._step`` does
every ``min(container.health_interval_s, 1 s)`` besides the /health probe. Measured against the
real engine and a running test container (``sparkd-test-vllm``, labelled ``sparkd.test=1``,
removed at the end): wall time and this process's CPU time per reconciliation (the engine's own
CPU is not counted), and the share of one core at 1 Hz.

Run: .venv/bin/python bench/reconcile.py [--n 300]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import docker

from sparkd.act.docker import ContainerManager
from sparkd.core.lifecycle import ContainerState, Observation, transition

REPO = Path(__file__).resolve().parents[1]


def cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    args = ap.parse_args()
    image = subprocess.run(
        [str(REPO / "tests/image/build.sh"), "--tag"], capture_output=True, text=True, check=True
    ).stdout.strip()
    client = docker.from_env(version="auto")
    name = f"sparkd-bench-{uuid.uuid4().hex[:8]}"
    c = client.containers.run(
        image, ["serve", "/m", "--port", "1"], name=name, labels={"sparkd.test": "1", "sparkd.bench": name},
        environment={"FAKEVLLM_STARTUP_S": "0.2"}, detach=True,
    )  # fmt: skip
    try:
        mgr = ContainerManager()
        mgr.guard(name)
        mgr.ping()
        mgr.state(c.id)  # warm the connection
        walls: list[float] = []
        state = ContainerState.READY
        seen = mgr.state(c.id).started_at
        c0 = cpu_s()
        for _ in range(args.n):
            t0 = time.perf_counter()
            mgr.ping()
            st = mgr.state(c.id)
            obs = Observation(
                running=st.running, restarting=st.restarting, restart_count=st.restart_count,
                started_at=st.started_at, seen_started_at=seen, seen_restart_count=0, exit_code=st.exit_code,
            )  # fmt: skip
            state = transition(state, obs).state
            walls.append(time.perf_counter() - t0)
        cpu_per = (cpu_s() - c0) / args.n
        walls.sort()
        print(f"reconciliations: {args.n} (ping + docker inspect + transition), final state {state}")
        print(f"wall per reconciliation: median {statistics.median(walls) * 1e3:.2f} ms, "
              f"p95 {walls[int(0.95 * len(walls))] * 1e3:.2f} ms, max {walls[-1] * 1e3:.2f} ms")  # fmt: skip
        print(f"CPU of sparkd's process per reconciliation: {cpu_per * 1e3:.2f} ms "
              f"= {cpu_per * 100:.2f} % of one core at 1 Hz")  # fmt: skip
        t0 = time.perf_counter()
        for _ in range(args.n):
            transition(state, obs)
        print(f"transition alone: {(time.perf_counter() - t0) / args.n * 1e6:.1f} µs")
    finally:
        c.remove(force=True)


if __name__ == "__main__":
    main()
