"""A flood of dashboard requests: ``python tests/flood.py PORT CONNECTIONS [PATH]``.

Opens CONNECTIONS keep-alive HTTP/1.1 connections to 127.0.0.1:PORT and sends ``GET PATH`` (default ``/``, the
dashboard, which needs no token on loopback) on each as fast as the answers come, one request at a time per
connection (a dashboard left open in many tabs, or a script gone wrong). A connection closed by the server is opened
again. Runs until SIGTERM or SIGINT, then prints one line: ``answered=N errors=M`` (answers read, connections that
failed). A process of its own, so the flood's CPU is not the test's.
"""

from __future__ import annotations

import asyncio
import signal
import sys


async def _one(port: int, path: str, counts: dict[str, int]) -> None:
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n".encode()
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while True:
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    await reader.readexactly(length)
                    counts["answered"] += 1
                    if b"connection: close" in head.lower():
                        break
            finally:
                writer.close()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            counts["errors"] += 1
            await asyncio.sleep(0.05)


async def main(port: int, n: int, path: str) -> None:
    counts = {"answered": 0, "errors": 0}
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    tasks = [asyncio.create_task(_one(port, path, counts)) for _ in range(n)]
    await done.wait()
    for t in tasks:
        t.cancel()
    print(f"answered={counts['answered']} errors={counts['errors']}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "/"))
