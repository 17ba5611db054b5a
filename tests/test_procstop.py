"""``act.procstop.ProcessStopper``: a container stopped by its processes when Docker does not answer.

Real processes in a real cgroup that each test creates (named with a fresh 64-hex id, as Docker names a
container's cgroup), some in their own PID namespace (``unshare --pid --fork``: the namespace's pid 1 is
the container's init, as under Docker). Only the processes a test started are ever signalled; the
cgroup is removed afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkd.act.procstop import ProcessStopper

HIERARCHIES = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def _writable_hierarchy() -> Path | None:
    for h in HIERARCHIES:
        p = Path(h)
        if (p / "cgroup.procs").exists() and os.access(p, os.W_OK):
            return p
    return None


class Box:
    """One cgroup named like a container's (``docker-<id>.scope``) and the processes started in it."""

    def __init__(self, parent: Path) -> None:
        self.id = secrets.token_hex(32)
        self.dir = parent / f"docker-{self.id}.scope"
        self.dir.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, script: str, *, own_pid_namespace: bool = True, uid: int | None = None) -> subprocess.Popen[bytes]:
        """``sh -c script`` inside the cgroup (moved in before it runs: its children are born there), as
        ``uid`` when given (``setpriv``)."""
        inner = ["sh", "-c", script]
        if uid is not None:
            inner = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *inner]
        if own_pid_namespace:
            inner = ["unshare", "--pid", "--fork", *inner]
        p = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {self.dir / "cgroup.procs"} && exec "$@"', "box", *inner],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(p)
        return p

    def members(self) -> list[int]:
        return sorted(int(x) for x in (self.dir / "cgroup.procs").read_text().split())

    def wait_members(self, n: int, timeout_s: float = 5.0) -> list[int]:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if len(self.members()) >= n:
                return self.members()
            time.sleep(0.02)
        raise AssertionError(f"expected {n} processes in {self.dir}, have {self.members()}")

    def close(self) -> None:
        for pid in self.members():  # only what this box started can be in its cgroup
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(5)
        end = time.monotonic() + 5
        while self.members() and time.monotonic() < end:
            time.sleep(0.02)
        self.dir.rmdir()


@pytest.fixture
def box() -> Iterator[Box]:
    parent = _writable_hierarchy()
    if parent is None or os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root with a writable cgroup hierarchy and util-linux (unshare, setpriv)")
        pytest.skip("needs root, a writable cgroup hierarchy, unshare and setpriv")
    b = Box(parent)
    try:
        yield b
    finally:
        b.close()


def test_it_finds_the_containers_processes_and_its_init(box: Box) -> None:
    box.start("sleep 60 & wait")
    pids = box.wait_members(3)  # unshare (host namespace), the namespace's init (sh), its sleep
    s = ProcessStopper(box.id)
    assert s.pids() == pids
    (init,) = s.inits()
    assert (Path(f"/proc/{init}/status").read_text().split("NSpid:\t", 1)[1].split("\n", 1)[0]).split()[-1] == "1"
    st = s.state(box.id)
    assert st.running and st.pid == init and st.exit_code is None
    assert ProcessStopper(secrets.token_hex(32)).pids() == []  # another container's id: nothing


def test_stop_sends_sigterm_to_the_init_only_and_waits_for_every_process(box: Box) -> None:
    box.start('trap "kill $!; exit 0" TERM; sleep 60 & wait')
    box.wait_members(3)
    s = ProcessStopper(box.id)
    init = s.inits()[0]
    r = s.stop(box.id, timeout_s=10.0)
    assert r.outcome == "exited" and r.elapsed_s < 5.0 and not r.fallback_kill
    assert s.signalled == [(init, "SIGTERM")]
    assert s.pids() == [] and box.members() == []
    assert not s.state(box.id).running
    assert s.stop(box.id, 1.0).outcome == "not_running"


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(box: Box) -> None:
    box.start('trap "" TERM; sleep 60 & wait')
    box.wait_members(3)
    s = ProcessStopper(box.id)
    t0 = time.monotonic()
    r = s.stop(box.id, timeout_s=1.0)
    assert r.outcome == "killed" and 1.0 <= time.monotonic() - t0 < 6.0
    sent = [sig for _, sig in s.signalled]
    assert sent[:1] == ["SIGTERM"] and "SIGKILL" in sent
    assert s.pids() == [] and box.members() == []


def test_a_container_in_the_hosts_pid_namespace_is_stopped_through_its_top_process(box: Box) -> None:
    p = box.start("sleep 60 & wait", own_pid_namespace=False)
    box.wait_members(2)
    s = ProcessStopper(box.id)
    assert s.inits() == [p.pid]  # no namespace pid 1: the process whose parent is outside the cgroup
    r = s.stop(box.id, timeout_s=2.0)  # its sleep outlives the SIGTERM'd shell: killed after the grace
    assert r.outcome in ("exited", "killed") and s.pids() == []


def test_a_process_outside_the_container_is_never_signalled(box: Box) -> None:
    box.start("sleep 60 & wait")
    box.wait_members(3)
    outside = subprocess.Popen(["sleep", "60"])
    try:
        s = ProcessStopper(box.id)
        assert s._signal(outside.pid, signal.SIGKILL) is False  # not in the container's cgroup
        s.kill(box.id)
        assert s.pids() == [] and outside.poll() is None
        assert outside.pid not in [pid for pid, _ in s.signalled]
    finally:
        outside.kill()
        outside.wait()


def test_only_a_full_id_is_accepted() -> None:
    with pytest.raises(ValueError, match="64 lowercase hex digits"):
        ProcessStopper("abc123")
    s = ProcessStopper("a" * 64)
    with pytest.raises(ValueError, match="acts on"):
        s.stop("b" * 64)


def test_a_signal_it_may_not_send_is_an_error_not_a_silent_success(box: Box) -> None:
    """The container's processes run as another user and the stopper's process lacks CAP_KILL (as under a unit
    without it): EPERM is reported (``PermissionError`` naming the refusals), never taken for "gone already"."""
    import sys

    box.start("sleep 60 & wait", uid=65534)  # nobody
    box.wait_members(3)
    code = (
        "import sys; from sparkd.act.procstop import ProcessStopper\n"
        "s = ProcessStopper(sys.argv[1])\n"
        "try:\n"
        "    s.stop(sys.argv[1], 1.0)\n"
        "except PermissionError as e:\n"
        "    print('refused', e)\n"
        "else:\n"
        "    print('no error', s.signalled, s.errors)\n"
    )
    out = subprocess.run(
        ["setpriv", "--bounding-set=-kill", "--inh-caps=-kill", sys.executable, "-c", code, box.id],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert out.stdout.startswith("refused SIGTERM: no process of the container could be signalled"), out
    assert "Operation not permitted" in out.stdout
    assert len(box.members()) == 3  # nothing was stopped
    # the same stopper with CAP_KILL (this test's own process, root) stops them
    assert ProcessStopper(box.id).stop(box.id, 5.0).outcome in ("exited", "killed") and box.members() == []


class HungEngine:
    """A Docker engine that never answers a ping within the test (the slow, dangerous edge; the real engine
    hung by SIGSTOP is ``test_e2e_docker.py``'s)."""

    def ping(self) -> bool:
        time.sleep(1.0)  # past EMERGENCY_PING_S (0.2 s here): no answer in time
        return False


def _supervisor(tmp_path: Path, container_id: str | None) -> object:
    from sparkd.config import load_settings
    from sparkd.loop import supervisor as supervisor_mod

    settings = load_settings(overrides={"state_dir": str(tmp_path), "container": {"guard": "sparkd-procstop-test"}})
    sup = supervisor_mod.Supervisor(settings, manager=HungEngine())  # type: ignore[arg-type]
    sup.container_id = container_id
    return sup


def test_an_operators_stop_with_the_engine_silent_is_refused_while_an_action_holds_the_lock(
    box: Box, tmp_path: Path
) -> None:
    """Two stops never run at once: an emergency may go past an action hung on the engine (it holds the lock),
    an operator's stop may not: Conflict, and the container's processes are not touched. The action here
    begins while the operator's ping waits (after ``request``'s first check of the lock)."""
    import asyncio

    from sparkd.errors import Conflict

    init = box.start("sleep 300 & wait")
    members = box.wait_members(3)  # unshare, the namespace's init (sh), its sleep: all born before the check
    sup: Any = _supervisor(tmp_path, box.id)

    async def engine_silent_while_an_action_begins() -> bool:
        await sup.lock.acquire()  # another action (a resize, say) takes the lock while the ping waits
        return False  # and the engine does not answer

    sup._engine_answers = engine_silent_while_an_action_begins

    async def scenario() -> BaseException | None:
        try:
            await sup.request("stop", source="api:ops")
        except BaseException as e:
            return e
        return None

    err = asyncio.run(scenario())
    assert isinstance(err, Conflict), err
    assert init.poll() is None and box.members() == members  # nothing signalled
    assert sup.stay_stopped is False and sup.stopped_without_docker is None


def test_an_operators_stop_with_the_engine_silent_and_nothing_running_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No process of the container runs: Refused (422) naming that and the engine; its id not known yet (sparkd
    started while the engine was down): DockerUnavailable (503). Nothing is recorded as stopped."""
    import asyncio

    from sparkd.errors import DockerUnavailable, Refused
    from sparkd.loop import supervisor as supervisor_mod

    monkeypatch.setattr(supervisor_mod, "EMERGENCY_PING_S", 0.2)
    for cid, want, text in (
        ("f" * 64, Refused, "no process of sparkd-procstop-test runs (the Docker engine does not answer"),
        (None, DockerUnavailable, "the container's id is not known"),
    ):
        sup: Any = _supervisor(tmp_path, cid)
        with pytest.raises(want) as info:
            asyncio.run(sup.request("stop", source="api:ops"))
        assert text in info.value.message, info.value.message
        # the code, not the words, tells a handed-over stop that nothing runs (``_stop_as_asked``)
        assert getattr(info.value, "reason", None) == ("not_running" if want is Refused else None), info.value
        assert sup.stay_stopped is False and sup.stopped_without_docker is None and sup.action is None
