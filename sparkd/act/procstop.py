"""Stop a container by its processes when the Docker engine does not answer (hung or dead).

Measured here with a private engine (closing note of the session of 2026-12-02): with ``dockerd``
stopped (SIGSTOP, as a daemon starved under memory pressure) each stop attempt waited out the API
timeout (30-56 s) and failed; with ``dockerd`` killed, ``containerd-shim`` kept the container running
and every attempt failed at once, 80 times a minute. In neither case was the model stopped, the one
thing the guard exists to do. The container's processes are still there, and the kernel knows them by
cgroup: ``/proc/<pid>/cgroup`` names the container's full id (``/docker/<id>`` under cgroup v1,
``docker-<id>.scope`` under the systemd driver of cgroup v2).

``ProcessStopper(container_id)`` offers what ``act.stop.run_stop`` needs of the container manager
(``stop``, ``kill``, ``state``) without the engine:

* ``stop``: SIGTERM to the container's init (the process whose innermost PID-namespace pid is 1:
  the process ``docker stop`` signals; a container in the host's PID namespace has none, then every
  process of the container whose parent is outside it), up to ``timeout_s`` for every process of
  the container to be gone, then ``kill``;
* ``kill``: SIGKILL to every process of the container, again until none is left (a process forked
  meanwhile is caught by the next round; killing the init ends its PID namespace);
* ``state``: running while any process of the container remains (the exit code is Docker's to
  know: ``None`` here).

A container frozen by ``docker pause`` (the cgroup freezer) handles no signal: its SIGTERM never runs, and under
cgroup v1 even a SIGKILL waits for the thaw (helper-47: "killed", the processes still there). ``stop`` and ``kill``
thaw its cgroup first (``thaw``: v1 ``freezer.state`` = ``THAWED``, v2 ``cgroup.freeze`` = ``0``).

Every signal goes through a pidfd opened *before* the process's cgroup is read again: a pid that
ended and was reused by another process in between is never signalled (``os.pidfd_open``, Linux 5.3).
Where pidfds are refused (an older kernel, a system-call filter of an older systemd: ENOSYS, EPERM) the
signal goes by pid right after the cgroup is read (a window of microseconds). No Docker call is made;
nothing here raises for a process that ends while it is looked at. A signal refused (EPERM: the unit
lacks ``CAP_KILL``, a user-namespaced container) is recorded in ``errors``; ``stop`` and ``kill`` raise
``PermissionError`` when processes of the container remain and none of them could be signalled.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from sparkd.act.containerspec import ContainerState, StopResult
from sparkd.sense.shm_scan import proc_pids

POLL_S = 0.1  # how often ``stop`` looks whether the container's processes are gone
KILL_ROUNDS = 20  # SIGKILL rounds before ``kill`` gives up (each waits POLL_S for the processes to go)


class ProcessStopper:
    """``stop``/``kill``/``state`` of one container by its processes (see the module docstring).

    Args:
        container_id: the container's full id (64 hex digits; a shorter prefix could match another's).
        proc_root: where ``<pid>/cgroup`` and ``<pid>/status`` are read (``/proc``).
        cgroup_root: where the cgroup file systems are mounted (``/sys/fs/cgroup``; v2 on a hybrid host under
            ``unified``).

    Raises:
        ValueError: ``container_id`` is not 64 hexadecimal digits.
    """

    def __init__(
        self, container_id: str, proc_root: str | Path = "/proc", cgroup_root: str | Path = "/sys/fs/cgroup"
    ) -> None:
        if len(container_id) != 64 or any(c not in "0123456789abcdef" for c in container_id):
            raise ValueError(f"container_id {container_id!r}: must be the full id, 64 lowercase hex digits")
        self.container_id = container_id
        self.proc_root = Path(proc_root)
        self.cgroup_root = Path(cgroup_root)
        self.thawed: list[str] = []  # freezer files written (reports, tests)
        self.signalled: list[tuple[int, str]] = []  # (pid, signal name), in order (reports, tests)
        self.errors: list[str] = []  # signals refused: "pid N: SIGX: why"

    # ------------------------------------------------------------------ reading
    def _in_container(self, pid: int) -> bool:
        try:
            return self.container_id in (self.proc_root / str(pid) / "cgroup").read_text()
        except OSError:
            return False

    def pids(self) -> list[int]:
        """The pids whose cgroup names the container, ascending (empty: nothing of it runs)."""
        return [pid for pid in proc_pids(self.proc_root) if self._in_container(pid)]

    def _status(self, pid: int) -> dict[str, str]:
        try:
            text = (self.proc_root / str(pid) / "status").read_text()
        except OSError:
            return {}
        return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)

    def inits(self, pids: list[int] | None = None) -> list[int]:
        """The container's init (innermost PID-namespace pid 1), else the processes whose parent is outside it."""
        pids = self.pids() if pids is None else pids
        members = set(pids)
        status = {p: self._status(p) for p in pids}
        init = [p for p in pids if (ns := status[p].get("NSpid", "").split()) and len(ns) > 1 and ns[-1] == "1"]
        if init:
            return init
        return [p for p in pids if status[p] and int(status[p].get("PPid", "0").strip() or 0) not in members]

    def _freezer_files(self, pid: int) -> list[tuple[Path, str, str]]:
        """(file, frozen value, thawed value) of the freezers of ``pid``'s cgroups that exist."""
        try:
            text = (self.proc_root / str(pid) / "cgroup").read_text()
        except OSError:
            return []
        out: list[tuple[Path, str, str]] = []
        for line in text.splitlines():
            parts = line.split(":", 2)
            if len(parts) != 3 or self.container_id not in parts[2]:
                continue
            rel = parts[2].lstrip("/")
            if "freezer" in parts[1].split(","):
                out.append((self.cgroup_root / "freezer" / rel / "freezer.state", "FROZEN", "THAWED"))
            elif parts[0] == "0" and parts[1] == "":
                for base in (self.cgroup_root, self.cgroup_root / "unified"):
                    out.append((base / rel / "cgroup.freeze", "1", "0"))
        return [f for f in out if f[0].exists()]

    def thaw(self) -> bool:
        """Thaw the container's cgroup if ``docker pause`` froze it; True when a freezer was written. A write refused
        is recorded in ``errors`` (the signals that follow then wait for a thaw)."""
        pids = self.pids()
        if not pids:
            return False
        wrote = False
        for path, frozen, thawed in self._freezer_files(pids[0]):
            try:
                if path.read_text().strip() not in (frozen, "FREEZING"):
                    continue
                path.write_text(thawed)
            except OSError as e:
                self.errors.append(f"thaw {path}: {e.strerror or e}")
                continue
            self.thawed.append(str(path))
            wrote = True
        return wrote

    # ------------------------------------------------------------------ acting
    def _signal(self, pid: int, sig: signal.Signals) -> bool:
        """``sig`` to ``pid`` if it is (still) a process of the container; True when sent. A refusal
        (EPERM) is recorded in ``errors``; a process that is gone is not an error."""
        try:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # gone already
                return False
            except OSError:  # no pidfds here (ENOSYS, a seccomp filter's EPERM): by pid, right after the check
                if not self._in_container(pid):
                    return False
                os.kill(pid, sig)
            else:
                try:
                    if not self._in_container(pid):  # read with the pidfd held: the pid cannot be reused under us
                        return False
                    signal.pidfd_send_signal(fd, sig)
                finally:
                    os.close(fd)
        except ProcessLookupError:
            return False
        except OSError as e:
            self.errors.append(f"pid {pid}: {sig.name}: {e.strerror or e}")
            return False
        self.signalled.append((pid, sig.name))
        return True

    def _refused(self, what: str) -> PermissionError:
        return PermissionError(
            f"{what}: no process of the container could be signalled ({'; '.join(self.errors[-3:])})"
        )

    def kill(self, id_or_name: str) -> None:
        """SIGKILL to every process of the container until none is left (``KILL_ROUNDS`` at most), thawed first."""
        self._check(id_or_name)
        self.thaw()
        for _ in range(KILL_ROUNDS):
            pids = self.pids()
            if not pids:
                return
            sent = [self._signal(pid, signal.SIGKILL) for pid in pids]
            if not any(sent) and self.errors and self.pids():
                raise self._refused("SIGKILL")
            time.sleep(POLL_S)

    def stop(self, id_or_name: str, timeout_s: float = 30.0) -> StopResult:
        """SIGTERM to the init, ``timeout_s`` of grace, then ``kill``. Never raises for a process that ends."""
        self._check(id_or_name)
        t0 = time.monotonic()
        pids = self.pids()
        if not pids:
            return StopResult("not_running", None, 0.0, timeout_s)
        self.thaw()  # a paused container's SIGTERM would never run
        sent = [self._signal(pid, signal.SIGTERM) for pid in self.inits(pids)]
        if not any(sent) and self.errors and self.pids():
            raise self._refused("SIGTERM")
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if not self.pids():
                return StopResult("exited", None, time.monotonic() - t0, timeout_s)
            time.sleep(POLL_S)
        self.kill(id_or_name)
        # SIGKILL sent, yet processes remain (in the driver, uninterruptible; a freezer that would not thaw): not
        # "killed" (helper-47); the caller's stop_incomplete names them
        if self.pids():
            return StopResult("killed: processes remain", None, time.monotonic() - t0, timeout_s)
        return StopResult("killed", None, time.monotonic() - t0, timeout_s)

    def state(self, id_or_name: str) -> ContainerState:
        """Running while a process of the container remains; ``pid``: its init (the first, if several)."""
        self._check(id_or_name)
        pids = self.pids()
        inits = self.inits(pids) if pids else []
        return ContainerState(
            status="running" if pids else "exited",
            running=bool(pids),
            exit_code=None,
            oom_killed=False,
            started_at=None,
            finished_at=None if pids else time.time(),
            pid=inits[0] if inits else None,
            error=None,
        )

    def _check(self, id_or_name: str) -> None:
        """``id_or_name`` must be this stopper's container (its full id): ``ValueError`` otherwise."""
        if id_or_name != self.container_id:
            raise ValueError(f"container {id_or_name!r}: this stopper acts on {self.container_id} only")
