"""Data shapes of the container manager: ownership labels, ``LaunchSpec``, and
what ``ContainerManager`` answers (``ContainerInfo``, ``ContainerState``,
``StopResult``). Pure: no Docker here. Sizes in bytes, times in UTC epoch seconds.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from sparkd.errors import InvalidInput

LABEL_MANAGED = "sparkd.managed"
LABEL_LAUNCH_ID = "sparkd.launch_id"
LABEL_REVISION = "sparkd.config_revision"
LABEL_PORT = "sparkd.port"
_RESERVED = (LABEL_MANAGED, LABEL_LAUNCH_ID, LABEL_REVISION, LABEL_PORT)
# The kernel's OOM badness is (share of memory x 1000) + oom_score_adj. At +500 a process at 0 (an sshd
# session, a shell) must hold more than half of memory to be chosen before the serving container, whose
# GPU allocations on a unified-memory host do not all show in its RSS; sparkd's unit runs at -1000.
DEFAULT_OOM_SCORE_ADJ = 500


@dataclass(frozen=True)
class LaunchSpec:
    """What to run. Sizes in bytes.

    ``command`` is the vLLM argument vector in exec form (no shell), appended to
    the image's entrypoint. ``model_dir`` is ``(host path, container path)``,
    mounted read-only. ``port`` is where vLLM listens (host network), recorded
    as label ``sparkd.port``; pass ``--port`` in ``command`` too.
    ``memswap_limit_bytes=None`` means "same as ``mem_limit_bytes``" (no swap for
    the container, as the notes run it); ``-1`` allows unlimited swap.
    ``gpu="auto"`` requests all GPUs only when the engine has an ``nvidia`` runtime.
    ``init`` runs Docker's init (tini) as PID 1: it reaps zombies and forwards
    signals (field report: a zombie PID 1 made stop and kill time out).
    ``oom_score_adj`` (1..1000, ``None`` = Docker's 0) raises the kernel OOM
    killer's score of the container's processes so that it takes the serving
    container before sshd or sparkd (field: a homelab lost sshd first).

    Raises ``InvalidInput`` (at construction) for a shell-string command, a port
    outside 1..65535, non-positive limits, swap below memory, or extra labels
    that would override ``sparkd.*`` ownership labels, an ``oom_score_adj`` outside 1..1000.
    """

    image: str
    name: str
    command: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    model_dir: tuple[str, str] | None = None
    port: int = 8000
    mem_limit_bytes: int | None = None
    memswap_limit_bytes: int | None = None
    ipc_mode: str = "host"
    shm_size_bytes: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    gpu: bool | Literal["auto"] = "auto"
    init: bool = True
    oom_score_adj: int | None = DEFAULT_OOM_SCORE_ADJ

    def __post_init__(self) -> None:
        if not isinstance(self.command, list) or not all(isinstance(a, str) for a in self.command):
            raise InvalidInput("command", self.command, "a list of strings (exec form, no shell)")
        if not 1 <= self.port <= 65535:
            raise InvalidInput("port", self.port, "1..65535")
        if self.mem_limit_bytes is not None and self.mem_limit_bytes <= 0:
            raise InvalidInput("mem_limit_bytes", self.mem_limit_bytes, "> 0 or None")
        swap = self.memswap_limit_bytes
        too_small = self.mem_limit_bytes is None or (swap or 0) < self.mem_limit_bytes
        if swap is not None and swap != -1 and too_small:
            raise InvalidInput("memswap_limit_bytes", swap, ">= mem_limit_bytes, -1 or None")
        adj = self.oom_score_adj
        if adj is not None and (isinstance(adj, bool) or not isinstance(adj, int) or not 1 <= adj <= 1000):
            raise InvalidInput("oom_score_adj", adj, "an integer 1..1000 (positive: the container goes first), or None")
        bad = sorted(k for k in self.labels if k in _RESERVED)
        if bad:
            raise InvalidInput("labels", bad, f"any key except {', '.join(_RESERVED)}")

    def docker_run_command(self) -> str:
        """The ``docker run`` line of this launch, as a person would paste it (one flag pair per line).

        The same container sparkd's launch creates: name, the model mount (read-only), limits,
        ``--init``, ``--oom-score-adj``, host IPC and network, ``--gpus all`` unless the GPU is off
        (``"auto"`` is printed as ``--gpus all``: a Spark has one). Environment variables are
        passed by name only (``-e HF_TOKEN``: the value comes from the shell, never printed).
        """
        flags: list[str] = ["--name", self.name, "--label", "sparkd.managed=true"]
        if self.gpu:
            flags += ["--gpus", "all"]
        if self.init:
            flags.append("--init")
        if self.oom_score_adj is not None:
            flags += ["--oom-score-adj", str(self.oom_score_adj)]
        flags += ["--ipc", self.ipc_mode, "--network", "host"]
        if self.mem_limit_bytes is not None:
            mem = f"{self.mem_limit_bytes // 2**20}m"
            swap = mem if self.memswap_limit_bytes in (None, self.mem_limit_bytes) else str(self.memswap_limit_bytes)
            flags += ["--memory", mem, "--memory-swap", swap]
        if self.model_dir:
            flags += ["-v", f"{self.model_dir[0]}:{self.model_dir[1]}:ro"]
        for k in sorted(self.environment):
            flags += ["-e", k]
        groups = [["docker", "run", "-d"], *_pairs(flags), [self.image], *_pairs(self.command)]
        return " \\\n    ".join(shlex.join(g) for g in groups)


def _pairs(args: list[str]) -> list[list[str]]:
    """``["--a", "1", "--b", "--c", "x"]`` → ``[["--a", "1"], ["--b"], ["--c", "x"]]``."""
    out: list[list[str]] = []
    for a in args:
        if a.startswith("-") or not out or len(out[-1]) == 2 or not out[-1][0].startswith("-"):
            out.append([a])
        else:
            out[-1].append(a)
    return out


@dataclass(frozen=True)
class ContainerInfo:
    """A container as sparkd sees it. ``created``/``started_at``: UTC epoch seconds."""

    id: str
    name: str
    image: str
    status: str  # created | running | paused | restarting | removing | exited | dead
    labels: dict[str, str]
    managed: bool
    launch_id: str | None
    revision: str | None
    port: int | None
    created: float | None
    started_at: float | None


@dataclass(frozen=True)
class ContainerState:
    """``State`` of ``docker inspect``. Times are UTC epoch seconds (None when unset);
    ``pid`` is the host PID of the container's PID 1 (None when not running).
    ``restarting`` (``State.Restarting``: Docker waits to restart it, and says ``running`` meanwhile),
    ``restart_count`` (``RestartCount``: restarts by the restart policy; ``docker start`` resets it),
    ``restart_policy`` (``HostConfig.RestartPolicy.Name``), ``health`` (``State.Health.Status`` when
    the image has a HEALTHCHECK), ``memory_bytes`` (``HostConfig.Memory``, Docker's ``--memory`` limit in
    bytes as it is now, ``docker update`` included: 0 when unlimited, None when not read),
    ``memory_swap_bytes`` (``HostConfig.MemorySwap``, ``--memory-swap``: memory plus swap in bytes, -1 unlimited
    swap, 0 unset; None when not read)."""

    status: str
    running: bool
    exit_code: int | None
    oom_killed: bool
    started_at: float | None
    finished_at: float | None
    pid: int | None
    error: str | None
    restarting: bool = False
    restart_count: int = 0
    restart_policy: str | None = None
    health: str | None = None
    memory_bytes: int | None = None
    memory_swap_bytes: int | None = None


def swap_allowance_bytes(memory_bytes: int | None, memory_swap_bytes: int | None) -> int:
    """The swap a container may use beyond its ``--memory`` (Docker's run reference, "--memory-swap details"):
    ``--memory-swap`` minus ``--memory``; -1 when unlimited (``--memory-swap -1``); as much as ``--memory`` when
    ``--memory-swap`` is unset (0; Docker fills in twice ``--memory`` at ``docker run``); 0 when there is no
    ``--memory`` or either figure was not read (None). sparkd launches with none (CONTEXT.md: ``--memory-swap``
    same as ``--memory``); a ``docker update --memory`` below it gives the difference as swap."""
    if not memory_bytes or memory_swap_bytes is None:
        return 0
    if memory_swap_bytes == -1:
        return -1
    if memory_swap_bytes == 0:
        return memory_bytes
    return max(0, memory_swap_bytes - memory_bytes)


@dataclass(frozen=True)
class StopResult:
    """What ``stop`` did. ``outcome``: ``not_running`` (nothing to do), ``exited``
    (left by itself within the grace), ``killed`` (SIGKILL after the grace, exit 137),
    ``killed: processes remain`` (a stop by the processes, ``act.procstop``: SIGKILL sent, processes still there)
    or ``oom_killed``. ``fallback_kill`` is true when ``docker stop`` failed and a
    kill was sent instead."""

    outcome: Literal["not_running", "exited", "killed", "killed: processes remain", "oom_killed"]
    exit_code: int | None
    elapsed_s: float
    timeout_s: float
    fallback_kill: bool = False

    def describe(self) -> str:
        """One line for operators, e.g. ``"killed (exit 137) after 3.0 s: no exit within 3 s"``."""
        if self.outcome == "not_running":
            return f"was not running (exit {self.exit_code})"
        how = " via kill fallback" if self.fallback_kill else ""
        text = f"{self.outcome} (exit {self.exit_code}) after {self.elapsed_s:.1f} s{how}"
        if self.outcome == "killed" and not self.fallback_kill:
            text += f": no exit within {self.timeout_s:g} s of SIGTERM"
        return text


_DOCKER_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def epoch_from_docker(stamp: str | None) -> float | None:
    """Docker's RFC 3339 time (nanoseconds) → UTC epoch seconds; unset/zero time → None."""
    m = _DOCKER_TIME.match(stamp or "")
    if not m or stamp is None or stamp.startswith("0001-01-01"):
        return None
    head, frac, tz = m.groups()
    tz = "+00:00" if tz == "Z" else tz
    return datetime.fromisoformat(f"{head}{tz}").timestamp() + float(f"0.{frac or 0}")
