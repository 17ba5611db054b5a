"""Benchmark aid: the calls one idle tick makes, Python frames and C calls, in a running ``sparkd run``.

On a VM whose idle vCPU loses its caches between wake-ups, each Python frame of the 1 Hz tick costs several µs
(``bench/phases.py``); this counts them. Run it as the daemon itself: it wraps ``Daemon._on_tick`` so that the
``--tick``-th tick runs under ``sys.setprofile``, writes the call tree (indented by depth; ``[C]`` marks a call
into C) to ``--out``, and leaves the daemon running (stop it with SIGTERM).

Run: .venv/bin/python bench/frames.py [--tick 40] [--out /tmp/frames.out] --config sparkd.toml run
(then ``head -1 /tmp/frames.out``: "N calls, M python frames")
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any


def main() -> None:
    args = sys.argv[1:]
    tick, out = 40, "/tmp/frames.out"
    while args and args[0] in ("--tick", "--out"):
        if args[0] == "--tick":
            tick = int(args[1])
        else:
            out = args[1]
        args = args[2:]

    import sparkd.loop.daemon as daemon_module
    from sparkd.face.cli import main as sparkd_main

    orig = daemon_module.Daemon._on_tick
    seen = [0]

    def wrapped(self: Any) -> None:
        seen[0] += 1
        if seen[0] != tick:
            return orig(self)
        calls: list[str] = []
        depth = [0]

        def prof(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call":
                code = frame.f_code
                calls.append("  " * depth[0] + f"{code.co_filename.split('sparkd/')[-1]}:{code.co_name}")
                depth[0] += 1
            elif event == "return":
                depth[0] -= 1
            elif event == "c_call":
                calls.append("  " * depth[0] + f"[C] {getattr(arg, '__qualname__', arg)}")

        sys.setprofile(prof)
        try:
            return orig(self)
        finally:
            sys.setprofile(None)
            py = sum(1 for c in calls if "[C]" not in c)
            with open(out, "w") as f:
                f.write(f"{len(calls)} calls, {py} python frames\n" + "\n".join(calls) + "\n")

    daemon_module.Daemon._on_tick = wrapped  # type: ignore[method-assign]
    sys.argv = ["sparkd", *args]
    sparkd_main()


if __name__ == "__main__":
    main()
