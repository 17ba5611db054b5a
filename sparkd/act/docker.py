"""The vLLM container, over the Docker SDK: launch, adopt, inspect, stop, kill, logs.

A plain blocking wrapper (no asyncio: the daemon calls it via
``asyncio.to_thread``). The API version is negotiated with the engine
(``version="auto"``), never pinned.

Ownership (DESIGN.md): sparkd launches containers carrying
``sparkd.managed=true`` and finds only those. A container the operator started
by hand may be inspected, stopped and killed only after ``guard(name)``; it is
never removed and never returned by ``find_managed``/``adopt``.

Errors: every method that talks to the engine raises ``DockerUnavailable`` when
it cannot be reached (socket missing, refused, timed out), ``NotFound`` for an
unknown container or image, ``Conflict`` when the engine answers 409 (name in
use, container not running), ``Refused`` for a container sparkd does not own,
and ``SparkdError`` for any other engine refusal.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import docker
import docker.errors
import requests.exceptions
import urllib3.exceptions
from docker.types import DeviceRequest

from sparkd.act.containerspec import (
    LABEL_LAUNCH_ID,
    LABEL_MANAGED,
    LABEL_PORT,
    LABEL_REVISION,
    ContainerInfo,
    ContainerState,
    LaunchSpec,
    StopResult,
    epoch_from_docker,
)
from sparkd.errors import Conflict, DockerUnavailable, EngineRefused, NotFound, Refused, SparkdError
from sparkd.sense.vllm_http import HealthResult, health_check, progress_stalled, read_vllm_metrics

__all__ = [
    "LABEL_LAUNCH_ID",
    "LABEL_MANAGED",
    "LABEL_PORT",
    "LABEL_REVISION",
    "ContainerInfo",
    "ContainerManager",
    "ContainerState",
    "HealthResult",
    "LaunchSpec",
    "StopResult",
    "health_check",
    "progress_stalled",
    "read_vllm_metrics",
]

log = logging.getLogger(__name__)


#: The shortest id prefix ``container.guard`` may name a container by (``docker ps`` prints 12 hex digits).
GUARD_ID_PREFIX_MIN = 12


def guard_matches(guard: str, name: str, cid: str) -> bool:
    """Whether the container ``name`` (``cid``) that Docker returned for ``container.guard = guard`` is the one meant:
    its name, or its id when ``guard`` is an id (``GUARD_ID_PREFIX_MIN`` hex digits or more). Docker's lookup falls
    back to a unique id prefix for any string; a two-letter hex name matched an unrelated container."""
    g = guard.strip().lstrip("/")
    if g == name.lstrip("/"):
        return True
    hexdigits = set("0123456789abcdef")
    return len(g) >= GUARD_ID_PREFIX_MIN and set(g) <= hexdigits and cid.startswith(g)


class ContainerManager:
    """Blocking manager for sparkd's vLLM container.

    ``base_url``: the engine socket (``"unix:///var/run/docker.sock"``); None reads
    the environment (``DOCKER_HOST``...). ``selector``: extra labels every launch
    carries and every search filters on (one sparkd instance, one test run).
    ``api_timeout_s``: HTTP timeout of one engine call (``stop`` adds its grace).
    The engine is first contacted on the first call, not here.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        selector: dict[str, str] | None = None,
        api_timeout_s: float = 30.0,
    ) -> None:
        self.base_url = base_url
        self.selector = dict(selector or {})
        self.api_timeout_s = api_timeout_s
        self._client: Any = None
        self._guarded: set[str] = set()
        self._guarded_ids: set[str] = set()  # the containers ``guard`` found: guarded by id, whatever their name now
        self._lock = threading.Lock()

    # -- engine ---------------------------------------------------------------
    def _docker(self) -> Any:
        with self._lock:
            if self._client is None:
                with self._call("connect to the Docker engine"):
                    timeout = int(self.api_timeout_s)
                    if self.base_url is None:
                        self._client = docker.from_env(version="auto", timeout=timeout)
                    else:
                        self._client = docker.DockerClient(base_url=self.base_url, version="auto", timeout=timeout)
            return self._client

    @contextlib.contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """Translate SDK / transport errors into sparkd errors."""
        try:
            yield
        except docker.errors.NotFound as e:
            raise NotFound(f"{what}: {e.explanation or e}") from e
        except docker.errors.APIError as e:  # before RequestException: it subclasses it
            if e.status_code == 409:
                raise Conflict(f"{what}: {e.explanation or e}") from e
            raise EngineRefused(f"{what}: Docker engine refused: {e.explanation or e}") from e
        except (
            requests.exceptions.RequestException,
            urllib3.exceptions.HTTPError,
            docker.errors.DockerException,
            OSError,
        ) as e:
            self._client = None  # renegotiate on the next call
            where = self.base_url or "DOCKER_HOST/default socket"
            raise DockerUnavailable(f"{what}: Docker engine at {where} unreachable: {e}") from e

    def ping(self) -> bool:
        """True when the engine answers; never raises."""
        try:
            with self._call("ping"):
                return bool(self._docker().ping())
        except SparkdError:
            return False

    def info(self) -> dict[str, Any]:
        """``docker info`` as a dict (``Runtimes``, ``MemTotal``, ``ServerVersion``...)."""
        with self._call("docker info"):
            return dict(self._docker().info())

    def has_nvidia_runtime(self) -> bool:
        """True when ``docker info`` lists a runtime named ``nvidia``."""
        return "nvidia" in (self.info().get("Runtimes") or {})

    # -- launch / find ---------------------------------------------------------
    def launch(self, spec: LaunchSpec, launch_id: str, revision: int | str) -> str:
        """Create and start ``spec``; returns the container id (64 hex).

        Host network, ``ipc_mode`` (host by default), ``--init`` and ``--oom-score-adj``
        as the spec says, restart policy ``no``, the
        ``sparkd.*`` labels plus the selector. The image is never pulled.
        Raises ``NotFound`` (image missing), ``Conflict`` (name in use), ``DockerUnavailable``.
        """
        labels = {
            **spec.labels,
            **self.selector,
            LABEL_MANAGED: "true",
            LABEL_LAUNCH_ID: str(launch_id),
            LABEL_REVISION: str(revision),
            LABEL_PORT: str(spec.port),
        }
        kwargs: dict[str, Any] = {
            "name": spec.name,
            "command": list(spec.command),
            "environment": dict(spec.environment),
            "labels": labels,
            "network_mode": "host",
            "ipc_mode": spec.ipc_mode,
            "restart_policy": {"Name": "no"},
            "detach": True,
            "init": spec.init,
        }
        if spec.oom_score_adj is not None:
            kwargs["oom_score_adj"] = spec.oom_score_adj
        if spec.mem_limit_bytes is not None:
            kwargs["mem_limit"] = spec.mem_limit_bytes
            kwargs["memswap_limit"] = spec.memswap_limit_bytes or spec.mem_limit_bytes
        if spec.shm_size_bytes is not None:
            kwargs["shm_size"] = spec.shm_size_bytes
        if spec.model_dir is not None:
            host_path, container_path = spec.model_dir
            kwargs["volumes"] = {host_path: {"bind": container_path, "mode": "ro"}}
        if spec.gpu is True or (spec.gpu == "auto" and self.has_nvidia_runtime()):
            kwargs["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
        client = self._docker()
        with self._call(f"create container {spec.name!r} from {spec.image!r}"):
            container = client.containers.create(spec.image, **kwargs)
        try:
            with self._call(f"start container {spec.name!r}"):
                container.start()
        except SparkdError:
            with contextlib.suppress(Exception):  # ours, created a moment ago, never started
                container.remove(force=True)
            raise
        log.info(
            "launched %s (%s) launch_id=%s revision=%s",
            spec.name,
            container.id[:12],
            launch_id,
            revision,
        )
        return str(container.id)

    def _info(self, c: Any) -> ContainerInfo:
        labels = dict(c.labels or {})
        port = labels.get(LABEL_PORT, "")
        return ContainerInfo(
            id=c.id,
            name=c.name,
            image=c.attrs.get("Config", {}).get("Image", ""),
            status=c.status,
            labels=labels,
            managed=self._is_managed(labels),
            launch_id=labels.get(LABEL_LAUNCH_ID),
            revision=labels.get(LABEL_REVISION),
            port=int(port) if port.isdigit() else None,
            created=epoch_from_docker(c.attrs.get("Created")),
            started_at=epoch_from_docker(c.attrs.get("State", {}).get("StartedAt")),
        )

    def _is_managed(self, labels: dict[str, str]) -> bool:
        wanted = {LABEL_MANAGED: "true", **self.selector}
        return all(labels.get(k) == v for k, v in wanted.items())

    def find_managed(self) -> list[ContainerInfo]:
        """Every container (running or not) with ``sparkd.managed=true`` and the
        selector labels, newest first. Unlabelled containers are never returned."""
        filters = [f"{k}={v}" for k, v in {LABEL_MANAGED: "true", **self.selector}.items()]
        with self._call("list managed containers"):
            found = self._docker().containers.list(all=True, filters={"label": filters}, ignore_removed=True)
        infos = [self._info(c) for c in found]
        return sorted(infos, key=lambda i: (i.started_at or 0.0, i.created or 0.0), reverse=True)

    def running_managed(self) -> list[tuple[str, str, str]]:
        """(id, name, image) of every running, restarting or paused container with ``sparkd.managed=true`` and the
        selector labels: one ``docker ps`` (sparse: no inspect per container, as ``find_managed`` makes)."""
        filters = [f"{k}={v}" for k, v in {LABEL_MANAGED: "true", **self.selector}.items()]
        return self._running("list running managed containers", {"label": filters})

    def running_containers(self) -> list[tuple[str, str, str]]:
        """(id, name, image) of every running, restarting or paused container, labelled or not (``docker ps``,
        sparse). Guard mode lists them when ``container.guard`` names no container (``core.supervision.
        guard_candidates``)."""
        return self._running("list running containers", {})

    def _running(self, what: str, filters: dict[str, Any]) -> list[tuple[str, str, str]]:
        with self._call(what):
            found = self._docker().containers.list(filters=filters, sparse=True, ignore_removed=True)
        return [
            (c.id, str((c.attrs.get("Names") or [c.id[:12]])[0]).lstrip("/"), str(c.attrs.get("Image", "")))
            for c in found
        ]

    def adopt(self) -> ContainerInfo | None:
        """The running managed container (paused counts: it holds its memory, and a trip must stop it; restarting
        too: a labelled copy run by hand with ``--restart always`` that crash-loops holds memory each time it runs,
        as guard mode counts it), or None. With several running, the newest (by start time) is returned and the
        others are logged as a warning; ``find_managed`` lists them all."""
        running = [i for i in self.find_managed() if i.status in ("running", "paused", "restarting")]
        if not running:
            return None
        if len(running) > 1:
            others = ", ".join(f"{i.name} ({i.id[:12]})" for i in running[1:])
            log.warning(
                "several managed containers running; adopting %s (%s), not: %s",
                running[0].name,
                running[0].id[:12],
                others,
            )
        return running[0]

    def guard(self, name: str) -> ContainerInfo | None:
        """Allow inspecting, stopping and killing the unlabelled container ``name`` (a name or an id,
        explicitly configured by the operator), and the container found by it under any later name.
        Returns it, or None when no container of that name exists now (the permission stays)."""
        self._guarded.add(name.lstrip("/"))
        try:
            info = self.get(name)
        except NotFound:
            return None
        if not guard_matches(name, info.name, info.id):
            # the engine resolves an unknown name as an id prefix: a hex-looking name ("b200", "e5") whose container
            # is gone took, and permitted the stop of, whatever container's id began so (helper-43)
            return None
        # by id too: ``guard`` may name an id (not the container's name), and a guarded container renamed while
        # it runs (``docker rename``) is still the model sparkd watches; its stop was refused ("not guarded")
        self._guarded_ids.add(info.id)
        return info

    # -- one container ---------------------------------------------------------
    def _container(self, id_or_name: str) -> Any:
        with self._call(f"find container {id_or_name!r}"):
            return self._docker().containers.get(id_or_name)

    def _owned(self, id_or_name: str, action: str, *, allow_guarded: bool = True) -> Any:
        c = self._container(id_or_name)
        if self._is_managed(dict(c.labels or {})):
            return c
        if allow_guarded and (c.name in self._guarded or c.id in self._guarded_ids):
            return c
        raise Refused(
            f"will not {action} container {c.name!r} ({c.id[:12]}): it lacks the label "
            f"{LABEL_MANAGED}=true" + ("" if not allow_guarded else " and is not guarded"),
            detail={"container": c.name, "action": action},
        )

    def get(self, id_or_name: str) -> ContainerInfo:
        """The container ``id_or_name`` (any, labelled or not). Raises ``NotFound``."""
        return self._info(self._container(id_or_name))

    def inspect(self, id_or_name: str) -> dict[str, Any]:
        """Full ``docker inspect`` attributes. Raises ``NotFound``."""
        return dict(self._container(id_or_name).attrs)

    def state(self, id_or_name: str) -> ContainerState:
        """The container's ``State`` (one ``docker inspect``). Raises ``NotFound``, ``DockerUnavailable``.

        ``exit_code`` is None while it runs, except while Docker waits to restart it (the exit that
        made it restart)."""
        ins = self.inspect(id_or_name)
        s = ins.get("State", {})
        running = bool(s.get("Running"))
        restarting = bool(s.get("Restarting"))
        return ContainerState(
            status=str(s.get("Status", "")),
            running=running,
            restarting=restarting,
            restart_count=int(ins.get("RestartCount") or 0),
            restart_policy=(ins.get("HostConfig", {}).get("RestartPolicy") or {}).get("Name") or None,
            health=(s.get("Health") or {}).get("Status"),
            memory_bytes=int(ins.get("HostConfig", {}).get("Memory") or 0),
            memory_swap_bytes=int(ins.get("HostConfig", {}).get("MemorySwap") or 0),
            exit_code=None if running and not restarting else s.get("ExitCode"),
            oom_killed=bool(s.get("OOMKilled")),
            started_at=epoch_from_docker(s.get("StartedAt")),
            finished_at=epoch_from_docker(s.get("FinishedAt")),
            pid=s.get("Pid") or None,
            error=s.get("Error") or None,
        )

    def stop(self, id_or_name: str, timeout_s: float = 30.0) -> StopResult:
        """``docker stop``: SIGTERM, ``timeout_s`` seconds of grace, then SIGKILL.

        If the stop call itself fails (engine error or HTTP timeout), a kill is
        sent instead (``fallback_kill``). Returns how it ended, read from
        ``State`` afterwards. Raises ``Refused`` (not owned or guarded),
        ``NotFound``, ``DockerUnavailable``.
        """
        c = self._owned(id_or_name, "stop")
        t0 = time.monotonic()
        before = self.state(c.id)
        if not before.running:
            return StopResult("not_running", before.exit_code, 0.0, timeout_s)
        fallback = False
        try:
            with self._call(f"stop container {c.name!r}"):
                c.stop(timeout=max(0, round(timeout_s)))
        except NotFound:
            raise
        except SparkdError as e:
            if isinstance(e, DockerUnavailable) and not self.ping():
                raise  # the engine is gone: a kill cannot reach it either
            log.warning("docker stop of %s failed (%s); sending SIGKILL", c.name, e)
            fallback = True
            self.kill(c.id)
            with self._call(f"wait for container {c.name!r}"):
                c.wait(timeout=self.api_timeout_s)
        elapsed = time.monotonic() - t0
        st = self.state(c.id)
        outcome: Literal["exited", "killed", "oom_killed"] = "exited"
        if st.oom_killed:
            outcome = "oom_killed"
        elif st.exit_code == 137:
            outcome = "killed"
        return StopResult(outcome, st.exit_code, elapsed, timeout_s, fallback)

    def kill(self, id_or_name: str, signal: str = "SIGKILL") -> bool:
        """Send ``signal`` now; False when the container was not running.
        Raises ``Refused``, ``NotFound``, ``DockerUnavailable``."""
        c = self._owned(id_or_name, "kill")
        try:
            with self._call(f"kill container {c.name!r}"):
                c.kill(signal=signal)
        except Conflict:  # 409: "is not running"
            return False
        return True

    def remove(self, id_or_name: str, force: bool = False) -> None:
        """Remove a managed container (never a guarded or unlabelled one);
        ``force`` also kills it when running. Raises ``Refused``, ``Conflict``
        (running without ``force``), ``NotFound``, ``DockerUnavailable``."""
        c = self._owned(id_or_name, "remove", allow_guarded=False)
        with self._call(f"remove container {c.name!r}"):
            c.remove(force=force)

    def exec(self, id_or_name: str, argv: list[str]) -> tuple[int, bytes]:
        """Run ``argv`` (exec form) inside the running container; returns
        ``(exit code, stdout+stderr)``. Raises ``Refused``, ``Conflict`` (not
        running), ``NotFound``, ``DockerUnavailable``."""
        c = self._owned(id_or_name, "exec in")
        with self._call(f"exec {argv[:1]} in {c.name!r}"):
            res = c.exec_run(argv, stdout=True, stderr=True)
        return int(res.exit_code), bytes(res.output or b"")

    # -- logs ------------------------------------------------------------------
    def logs(
        self, id_or_name: str, since: float | None = None, tail: int | None = None, max_bytes: int = 16 * 2**20
    ) -> bytes:
        """stdout+stderr of the container as one byte string; ``since``: UTC epoch seconds; ``tail``: last N lines;
        at most the last ``max_bytes`` of them, read as a stream (the whole log is never held in memory).
        Raises ``NotFound``, ``DockerUnavailable``."""
        c = self._container(id_or_name)
        with self._call(f"logs of {c.name!r}"):
            kept: collections.deque[bytes] = collections.deque()
            size = 0
            # follow=False: with stream=True docker-py follows by default (never ends while the container runs)
            for chunk in c.logs(stdout=True, stderr=True, since=since, tail=tail or "all", stream=True, follow=False):
                kept.append(chunk)
                size += len(chunk)
                while size - len(kept[0]) >= max_bytes:
                    size -= len(kept.popleft())
            return b"".join(kept)[-max_bytes:]

    def stream_logs(
        self,
        id_or_name: str,
        callback: Callable[[str], None],
        stop_event: threading.Event,
        since: float | None = None,
    ) -> None:
        """Follow the log, calling ``callback(line)`` (decoded, no newline) per line.

        Blocks until the container stops or ``stop_event`` is set; meant for a
        thread. Raises ``NotFound``, ``DockerUnavailable`` (at start).
        """
        c = self._container(id_or_name)
        client = self._docker()
        with self._call(f"follow logs of {c.name!r}"):
            stream = client.api.logs(c.id, stream=True, follow=True, since=since)

        done = threading.Event()

        def closer() -> None:  # unblocks the read below when stop_event is set
            while not done.is_set():
                if stop_event.wait(0.2):
                    with contextlib.suppress(Exception):
                        stream.close()
                    return

        threading.Thread(target=closer, name=f"logs-close-{c.name}", daemon=True).start()
        buf = b""
        try:
            with self._call(f"follow logs of {c.name!r}"):
                for chunk in stream:
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        callback(line.decode("utf-8", "replace").rstrip("\r"))
                    if stop_event.is_set():
                        break
        except DockerUnavailable:
            if not stop_event.is_set():  # closing the stream on purpose lands here too
                raise
        finally:
            done.set()
            if buf and not stop_event.is_set():
                callback(buf.decode("utf-8", "replace"))
            with contextlib.suppress(Exception):
                stream.close()
