"""A bounded memory hog for tests: allocates and touches N MiB, holds it until told.

Protocol on stdin/stdout: prints ``ready`` once the memory is touched; reads a
line ``free`` to release it (prints ``freed``); exits on EOF. Never more than 2 GiB.
"""

from __future__ import annotations

import subprocess
import sys

LIMIT_MIB = 2048


def main() -> None:
    mib = int(sys.argv[1])
    if not 0 < mib <= LIMIT_MIB:
        raise SystemExit(f"hog: {mib} MiB is outside 1..{LIMIT_MIB}")
    step = int(sys.argv[2]) if len(sys.argv) > 2 else mib  # MiB per chunk
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    import time

    chunks = []
    done = 0
    while done < mib:
        n = min(step, mib - done)
        b = bytearray(n * 2**20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        chunks.append(b)
        del b  # only ``chunks`` may hold the memory, so that "free" really frees it
        done += n
        if delay:
            time.sleep(delay)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "free":
            chunks.clear()
            print("freed", flush=True)


class Hog:
    """Context manager around the hog subprocess."""

    def __init__(self, mib: int, step_mib: int | None = None, delay_s: float = 0.0) -> None:
        self.p = subprocess.Popen(
            [sys.executable, __file__, str(mib), str(step_mib or mib), str(delay_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        assert self.p.stdout is not None
        line = self.p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"hog did not get ready: {line!r}")

    def free(self) -> None:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write("free\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "freed"

    def __enter__(self) -> Hog:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


if __name__ == "__main__":
    main()
