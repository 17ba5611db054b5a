"""Who holds the memory, end to end: a real ``sparkd run``, a real fakevllm container and a real
host process, each allocating 512 MiB; a real memory trip names both in its reason and in the
incident summary of the postmortem archive.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from fvhelpers import wait_for

from sparkd.sense import procfs
from sparkd.units import GiB, MiB

pytest_plugins = ["dockerkit"]

HOG = Path(__file__).parent / "hog.py"


def test_a_trip_names_the_container_and_the_host_process_that_ate_the_memory(sparkd_factory: Any) -> None:
    avail = procfs.read_meminfo().fields["MemAvailable"]
    # 2 × 512 MiB must take MemAvailable below the line; one alone should not (noise: other testers)
    threshold = avail - 768 * MiB
    s = sparkd_factory(
        rules=[{"name": "low_available", "when": [f"MemAvailable < {threshold}B"], "samples": 3}],
        top={"consumers": {"interval_s": 1}},
    ).start()
    s.wait_state("ready", 60)
    # two scans with the container running: one of them is "before the fall"
    assert wait_for(lambda: (s.status().get("consumers") or {}).get("scans", 0) >= 2, 30)
    hog = subprocess.Popen([sys.executable, str(HOG), "512"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
        s.vllm("POST", "/alloc?mib=512")
        trip = s.wait_event("trip", 60)
        stopped = s.wait_event("stopped", 90)
    finally:
        hog.kill()
        hog.wait()
    # the trip's reason says who grew: the container by its 512 MiB; the host co-tenants are named
    assert "who grew since " in trip["message"], trip["message"]
    shares = trip["details"]["fall_shares_bytes"]
    assert 450 * MiB <= shares["container"] <= 700 * MiB, shares
    assert "container +0." in trip["message"] and "host co-tenants " in trip["message"]
    arch = Path(s.tmp) / "archives" / stopped["details"]["archive"]
    with tarfile.open(arch) as tf:
        summary = tf.extractfile("summary.txt").read().decode()  # type: ignore[union-attr]
        record = json.loads(tf.extractfile("consumers.json").read())  # type: ignore[union-attr]
    # the incident summary names both groups' growth, in the reason and on its own line
    assert "who grew since " in summary and "consumers:    since " in summary, summary
    after = record["trip"]["after"]
    top = {p["pid"]: p for p in after["top"]}
    # the top-consumer record attributes each 512 MiB holder to its group
    assert top[hog.pid]["group"] == "host" and top[hog.pid]["rss_bytes"] >= 500 * MiB, after["top"]
    held_by_container = [p for p in after["top"] if p["group"] == "container" and p["rss_bytes"] >= 500 * MiB]
    assert held_by_container, after["top"]
    assert after["totals_bytes"]["container"] >= 500 * MiB
    before = record["trip"]["before"]
    assert before is not None and hog.pid not in {p["pid"] for p in before["top"]}
    assert record["trip"]["shares_bytes"] == shares
    assert after["mem_available_bytes"] < before["mem_available_bytes"] - GiB // 2
