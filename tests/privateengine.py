"""A Docker engine of a test's own, for tests that stop, hang or kill the engine (never the shared one)."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path


class PrivateEngine:
    """A dockerd of a test's own (its data root, exec root and socket under ``/tmp/sparkd-dk-<id>``, short
    for the socket path): a test may stop, hang or kill it without touching the shared engine.
    ``start()`` waits for ``/_ping``; ``close()`` removes what the test left in it, stops it and its
    containerd, unmounts what it mounted under its root and removes the root."""

    def __init__(self) -> None:
        import shutil

        dockerd = shutil.which("dockerd")
        assert dockerd, "dockerd missing"
        self.dockerd = dockerd
        self.root = Path(f"/tmp/sparkd-dk-{uuid.uuid4().hex[:6]}")
        self.root.mkdir()
        self.sock = self.root / "docker.sock"
        self.url = f"unix://{self.sock}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrivateEngine:
        from fvhelpers import wait_for

        self.proc = subprocess.Popen(
            [
                self.dockerd,
                "--data-root",
                str(self.root / "data"),
                "--exec-root",
                str(self.root / "exec"),
                "--host",
                self.url,
                "--pidfile",
                str(self.root / "pid"),
                "--storage-driver",
                "vfs",
                "--iptables=false",
                "--bridge=none",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "log", "ab"),  # noqa: SIM115 - lives as long as the engine
        )
        ok = wait_for(self.ping, 60, 0.2)
        assert ok, (self.root / "log").read_text()[-2000:]
        return self

    def ping(self) -> bool:
        import httpx

        if not self.sock.exists():
            return False
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), timeout=1) as cl:
            try:
                return cl.get("http://docker/_ping").status_code == 200
            except httpx.HTTPError:
                return False

    def load(self, image: str) -> None:
        """Copy ``image`` from the shared engine into this one (``docker save | docker load``)."""
        save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
        assert save.stdout is not None
        subprocess.run(["docker", "-H", self.url, "load", "-q"], stdin=save.stdout, check=True, capture_output=True)
        save.stdout.close()
        assert save.wait(120) == 0

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a test may have left it stopped
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def close(self, labels: dict[str, str]) -> None:
        """Remove this test's containers (by its case label), stop the engine, clean its root."""
        import shutil

        if self.proc is not None and self.proc.poll() is None and self.ping():
            ids = subprocess.run(
                [
                    "docker",
                    "-H",
                    self.url,
                    "ps",
                    "-aq",
                    "--filter",
                    f"label=sparkd.test.case={labels['sparkd.test.case']}",
                ],
                capture_output=True,
                text=True,
            ).stdout.split()
            if ids:
                subprocess.run(["docker", "-H", self.url, "rm", "-f", *ids], capture_output=True)
        self.stop()
        mounts = [ln.split()[1] for ln in Path("/proc/mounts").read_text().splitlines()]
        for m in sorted((m for m in mounts if m.startswith(str(self.root) + "/")), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
