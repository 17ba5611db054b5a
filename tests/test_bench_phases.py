"""``bench/phases.py`` wraps the tick's phases by name: a rename in sparkd must not leave the benchmark
failing at its next run (or timing nothing)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "phases.py"


def test_every_phase_the_benchmark_wraps_exists() -> None:
    spec = importlib.util.spec_from_file_location("bench_phases", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    missing = []
    for mod_name, owner_name, attr in mod.PHASES:
        owner = (
            getattr(importlib.import_module(mod_name), owner_name) if owner_name else importlib.import_module(mod_name)
        )
        if not callable(getattr(owner, attr, None)):
            missing.append(f"{mod_name}.{owner_name or ''}.{attr}")
    assert missing == []
