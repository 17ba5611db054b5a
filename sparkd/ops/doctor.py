"""``sparkd doctor``: one screen of host checks for a DGX Spark serving vLLM in Docker.

``run_checks(ctx) -> list[Check]``; ``format_report(checks) -> str``;
``exit_code(checks) -> int`` (1 when any check FAILs, else 0).

Every input is injectable through ``DoctorContext`` (``proc_root``,
``sys_root``, ``shm_dir``, ``dev_root``, a command runner and three
callables) so tests run the same checks over fixture trees. Thresholds and
their sources are stated at each check; the facts come from CONTEXT.md.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sparkd.core.supervision import guard_candidates, restart_policy_risk
from sparkd.sense.gpu import parse_nvidia_smi_table
from sparkd.sense.procfs import read_meminfo, read_zoneinfo_low_watermark_bytes
from sparkd.units import GiB, fmt_gib

Status = Literal["OK", "WARN", "FAIL"]
Runner = Callable[[Sequence[str]], tuple[int, str]]

# Kernel defaults (mm/page_alloc.c): watermark_scale_factor 10 (0.1 %), and the
# auto-sized min_free_kbytes never exceeds 262144 kB. Above either, an operator
# (or a tuning guide) raised them.
DEFAULT_WATERMARK_SCALE_FACTOR = 10
AUTO_MIN_FREE_KBYTES_CEILING = 262144
# Low watermarks above 1 % of MemTotal (≈1.2 GiB on a Spark) shift MemAvailable
# visibly against the 6 GiB seed floor.
LOW_WATERMARK_WARN_FRACTION = 0.01
# Names seen in /dev/shm after a killed vLLM (tests/fixtures/shm/README.md).
SHM_LEFTOVER_PREFIXES = ("psm_", "nccl-", "sem.loky-", "VLLM_OBJECT_STORAGE_SHM_BUFFER", "vllm_")
DEV_CHAR_FIX = "nvidia-ctk system create-dev-char-symlinks --create-all"
LAST_TRIP_RECENT_S = 7 * 86400
# Below this much free space in the state directory SQLite soon fails with "database or disk is full"
# (a day of 1 Hz samples is ~20 MiB; WAL checkpoints need room for a copy of the pages they move).
STATE_DIR_FREE_MIN_BYTES = 64 * 2**20


@dataclass(slots=True, frozen=True)
class Check:
    """One line of the report. ``action`` is what to do for WARN/FAIL ("" for OK)."""

    status: Status
    title: str
    detail: str
    action: str = ""


@dataclass(slots=True, frozen=True)
class UnitStatus:
    """``systemd_pid1``: systemd manages this host; ``active``/``enabled``: systemctl's words."""

    systemd_pid1: bool
    active: str | None = None
    enabled: str | None = None


@dataclass(slots=True, frozen=True)
class LastTrip:
    """The last emergency stop: UTC epoch seconds and the rule's reason text."""

    at_s: float
    reason: str


def run_command(argv: Sequence[str], timeout_s: float = 15.0) -> tuple[int, str]:
    """Run ``argv``; return (exit status, stdout+stderr). 127 when not found, 124 on timeout."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: timed out after {timeout_s:.0f} s"
    except OSError as exc:
        return 126, f"{argv[0]}: {exc}"
    return p.returncode, p.stdout + p.stderr


def docker_ping_sdk() -> tuple[bool, str]:
    """Ping the Docker engine through the docker SDK (honours DOCKER_HOST), 5 s timeout."""
    try:
        import docker  # lazily: doctor must run where the SDK or the engine is missing

        client = docker.from_env(timeout=5)
        client.ping()
        version = client.version().get("Version", "?")
        return True, f"engine {version}"
    except Exception as exc:  # any failure means "not reachable" here
        return False, f"{type(exc).__name__}: {exc}"


def docker_container_status(name: str, docker_url: str | None = None) -> tuple[str, str | None] | None:
    """Docker's status of the container ``name`` (a name or an id, as ``container.guard`` takes it: ``running``,
    ``exited``...) and its restart policy (``HostConfig.RestartPolicy.Name``, None when unset); None when no
    container by that name exists (``docker ps -a`` lists none). Raises when the engine does not answer
    (``DockerUnavailable``)."""
    from sparkd.act.docker import ContainerManager, guard_matches  # lazily: doctor must run where the SDK is missing
    from sparkd.errors import NotFound

    manager = ContainerManager(docker_url, api_timeout_s=5.0)
    try:
        info = manager.get(name)
        if not guard_matches(name, info.name, info.id):  # not an id prefix of another one
            return None
        return info.status, manager.state(info.id).restart_policy
    except NotFound:
        return None


def docker_running_containers(docker_url: str | None = None) -> list[tuple[str, str, str]]:
    """(id, name, image) of every running container (``docker ps``). Raises when the engine does not answer."""
    from sparkd.act.docker import ContainerManager  # lazily, as docker_container_status

    return ContainerManager(docker_url, api_timeout_s=5.0).running_containers()


def systemd_is_pid1(run_root: Path = Path("/run")) -> bool:
    """sd_booted(3): systemd runs as PID 1 iff ``/run/systemd/system`` exists."""
    return (run_root / "systemd" / "system").is_dir()


def probe_unit_status(run: Runner, run_root: Path = Path("/run"), unit: str = "sparkd") -> UnitStatus:
    """Ask systemctl for ``is-active``/``is-enabled`` (only when systemd is PID 1)."""
    if not systemd_is_pid1(run_root):
        return UnitStatus(False)
    _, active = run(["systemctl", "is-active", unit])
    _, enabled = run(["systemctl", "is-enabled", unit])
    return UnitStatus(True, active.strip() or None, enabled.strip() or None)


@dataclass
class DoctorContext:
    """Where the checks look. Defaults read the live host; tests inject fixtures."""

    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    shm_dir: Path = Path("/dev/shm")
    dev_root: Path = Path("/dev")
    run_root: Path = Path("/run")
    run: Runner = run_command
    docker_ping: Callable[[], tuple[bool, str]] = docker_ping_sdk
    unit_status: Callable[[], UnitStatus] | None = None  # None: probe_unit_status(run)
    last_trip: Callable[[], LastTrip | None] = lambda: None
    now: Callable[[], float] = time.time
    shm_ignore_unreadable_pids: Sequence[int] = ()  # the setting of the same name
    db_file: Path | None = None  # None: no database check (tests of other checks)
    archives_dir: Path | None = None  # where the postmortem archives are (settings.archives_path)
    rules: Sequence[Any] = ()  # config.RuleConfig-like: name, when, floor, action
    kernlog_source: str = "auto"  # the setting: "off" reads no kernel log (a rule on nvrm_recent never fires)
    interval_s: float = 1.0  # the setting: seconds between samples in normal mode
    guard_name: str | None = None  # container.guard in guard mode (no container.image): the container it names
    # the guarded container's status, None when none by that name exists; raises when Docker does not answer
    container_status: Callable[[str], tuple[str, str | None] | None] = docker_container_status
    running_containers: Callable[[], list[tuple[str, str, str]]] = docker_running_containers
    _docker_info: dict[str, Any] | None = field(default=None, init=False, repr=False)


def run_checks(ctx: DoctorContext) -> list[Check]:
    """All checks, in report order. Never raises: a check that breaks reports FAIL."""
    checks: list[Check] = []
    for fn in (
        check_gpu,
        check_docker,
        check_guard_target,
        check_nvidia_runtime,
        check_cgroup,
        check_swap,
        check_watermarks,
        check_memtotal,
        check_rule_inputs,
        check_sampling,
        check_shm,
        check_proc_visibility,
        check_dev_char_symlinks,
        check_unit,
        check_last_trip,
        check_database,
        check_rule_reach,
    ):
        try:
            checks.extend(fn(ctx))
        except Exception as exc:  # a doctor must finish its report
            name = fn.__name__.removeprefix("check_")
            checks.append(Check("FAIL", name, f"check crashed: {type(exc).__name__}: {exc}"))
    return checks


def check_gpu(ctx: DoctorContext) -> list[Check]:
    """nvidia-smi present? name, driver, CUDA; and how GPU memory is reported."""
    rc, out = ctx.run(["nvidia-smi"])
    if rc == 127:
        action = "install the NVIDIA driver utilities; sparkd still guards /proc/meminfo without it"
        return [Check("WARN", "GPU", "nvidia-smi not found", action)]
    table = parse_nvidia_smi_table(out)
    if rc != 0 or not table.gpus:
        first = out.strip().splitlines()[0] if out.strip() else f"exit {rc}"
        return [Check("FAIL", "GPU", f"nvidia-smi failed: {first}", "check the NVIDIA driver")]
    names = ", ".join(sorted({g.name for g in table.gpus}))
    gpu = Check("OK", "GPU", f"{names}, driver {table.driver_version}, CUDA {table.cuda_version}")
    if table.memory_not_supported:
        mem = Check(
            "OK",
            "GPU memory",
            "Not Supported (unified memory, GB10): /proc/meminfo is the ground truth",
        )
    else:
        total = sum(g.memory_total_bytes or 0 for g in table.gpus)
        mem = Check("OK", "GPU memory", f"reported ({fmt_gib(total)}); sparkd still guards /proc/meminfo")
    return [gpu, mem]


def _docker_info(ctx: DoctorContext) -> dict[str, Any] | None:
    if ctx._docker_info is None:
        rc, out = ctx.run(["docker", "info", "--format", "{{json .}}"])
        try:
            ctx._docker_info = json.loads(out) if rc == 0 else {}
        except ValueError:
            ctx._docker_info = {}
    return ctx._docker_info or None


def check_docker(ctx: DoctorContext) -> list[Check]:
    """The Docker engine answers a ping (sparkd is monitor-only without it)."""
    ok, detail = ctx.docker_ping()
    if ok:
        return [Check("OK", "Docker", f"reachable, {detail}")]
    action = "systemctl start docker; sparkd can only watch memory, not stop the container"
    return [Check("FAIL", "Docker", f"not reachable: {detail}", action)]


def check_guard_target(ctx: DoctorContext) -> list[Check]:
    """Guard mode: a container by ``container.guard``'s name exists (any state: a stopped one is guarded again once it
    runs). FAIL when none does: sparkd guards nothing (a typo, or docker compose's ``<project>-<service>-1``
    naming); WARN when its restart policy undoes sparkd's stop (``core.supervision.restart_policy_risk``). Nothing
    is said when Docker does not answer (the Docker check says that)."""
    name = ctx.guard_name
    if not name:
        return []
    try:
        status = ctx.container_status(name)
    except Exception:
        return []
    if status is None:
        try:
            candidates = guard_candidates(name, ctx.running_containers())
        except Exception:
            candidates = []
        running = f"; running now: {', '.join(candidates)}" if candidates else ""
        return [
            Check(
                "FAIL",  # the daemon says this critical (guard_target_missing): doctor said WARN, rc 0 (helper-44)
                "Guarded container",
                f"container.guard = {name!r} matches no container (`docker ps -a` lists none by that name or id): "
                f"sparkd guards nothing{running}",
                "set container.guard to the name `docker ps -a --format '{{.Names}}'` shows (docker compose names it "
                "<project>-<service>-1), or start the container by that name",
            )
        ]
    state, policy = status
    risk = restart_policy_risk(name, policy)
    if risk:  # sparkd's stop does not hold against it (helper-43)
        return [
            Check(
                "WARN",
                "Guarded container",
                f"{name}: {state}; {risk}",
                f"docker update --restart unless-stopped {name}",
            )
        ]
    return [Check("OK", "Guarded container", f"{name}: {state}" + (f" (restart policy {policy})" if policy else ""))]


def check_nvidia_runtime(ctx: DoctorContext) -> list[Check]:
    """``docker info`` lists an ``nvidia`` runtime (NVIDIA Container Toolkit)."""
    info = _docker_info(ctx)
    if info is None:
        return [
            Check(
                "WARN",
                "NVIDIA runtime",
                "unknown: `docker info` gave no answer",
                "start the Docker engine first (see the Docker check), then run `sparkd doctor` again",
            )
        ]
    runtimes = sorted(info.get("Runtimes") or {})
    if "nvidia" in runtimes:
        return [Check("OK", "NVIDIA runtime", "nvidia runtime registered with Docker")]
    action = "install nvidia-container-toolkit; `nvidia-ctk runtime configure --runtime=docker`"
    msg = f"Docker is up but has no nvidia runtime (runtimes: {', '.join(runtimes) or 'none'})"
    return [Check("WARN", "NVIDIA runtime", msg, action)]


def check_cgroup(ctx: DoctorContext) -> list[Check]:
    """cgroup v2 expected (DGX OS default); the container's memory.current is read there."""
    root = ctx.sys_root / "fs" / "cgroup"
    if (root / "cgroup.controllers").exists():
        return [Check("OK", "cgroup", "v2 (unified)")]
    mode = "hybrid (v1 + v2)" if (root / "unified" / "cgroup.controllers").exists() else "v1"
    action = "boot with systemd.unified_cgroup_hierarchy=1 (DGX OS default is v2)"
    return [Check("WARN", "cgroup", f"{mode}: sparkd reads container memory from cgroup v2", action)]


def check_swap(ctx: DoctorContext) -> list[Check]:
    """Swap state. Swap ON → WARN.

    Decision: the notes' hosts froze with swap off, so swap off does not
    protect; but swap on does not either — GPU allocations on unified memory
    cannot be swapped, so a host under pressure pages out the CPU side and
    thrashes into the same freeze, more slowly and with the guard's samples
    delayed. MemAvailable excludes swap, so sparkd's floors are unaffected.
    The container itself runs with ``--memory-swap`` = ``--memory`` (no swap).
    """
    mi = read_meminfo(ctx.proc_root).fields
    total = mi.get("SwapTotal", 0)
    if not total:
        return [Check("OK", "Swap", "off (MemAvailable floors are the protection, not swap)")]
    used = total - mi.get("SwapFree", 0)
    action = "swapoff -a (and drop it from /etc/fstab), or keep it knowing it only delays a freeze"
    msg = f"on: {fmt_gib(total)}, {fmt_gib(used)} used; a UMA host thrashing in swap freezes too"
    return [Check("WARN", "Swap", msg, action)]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def check_watermarks(ctx: DoctorContext) -> list[Check]:
    """``vm.min_free_kbytes`` / ``vm.watermark_scale_factor`` raised → WARN.

    Raised watermarks lower MemAvailable on a healthy host (the kernel
    subtracts the low watermarks), so a fixed 6 GiB floor loops; floors must
    be set relative (CONTEXT.md, "Raised kernel watermarks").
    """
    vm = ctx.proc_root / "sys" / "vm"
    mfk = _read_int(vm / "min_free_kbytes")
    wsf = _read_int(vm / "watermark_scale_factor")
    low = read_zoneinfo_low_watermark_bytes(ctx.proc_root)
    total = read_meminfo(ctx.proc_root).fields.get("MemTotal")
    detail = f"min_free_kbytes={mfk}, watermark_scale_factor={wsf}"
    if low is not None:
        detail += f", low watermarks {fmt_gib(low)}"
    raised = (mfk is not None and mfk > AUTO_MIN_FREE_KBYTES_CEILING) or (
        wsf is not None and wsf > DEFAULT_WATERMARK_SCALE_FACTOR
    )
    if low is not None and total:
        raised = raised or low > LOW_WATERMARK_WARN_FRACTION * total
    if mfk is None and wsf is None:
        return [Check("WARN", "Kernel watermarks", "unreadable", f"check {vm} is readable")]
    if not raised:
        return [Check("OK", "Kernel watermarks", detail + " (kernel defaults)")]
    action = "set sparkd's floors relative to the low watermark, not a fixed 6 GiB"
    msg = detail + ": raised; MemAvailable reads lower on a healthy host"
    return [Check("WARN", "Kernel watermarks", msg, action)]


def check_memtotal(ctx: DoctorContext) -> list[Check]:
    """MemTotal in GiB (a DGX Spark reports ≈121.69 GiB of its 128 GB)."""
    total = read_meminfo(ctx.proc_root).fields.get("MemTotal")
    if not total:
        return [Check("FAIL", "MemTotal", "not found in meminfo", f"check {ctx.proc_root}")]
    return [Check("OK", "MemTotal", f"{total / GiB:.2f} GiB")]


def check_rule_inputs(ctx: DoctorContext) -> list[Check]:
    """The inputs every default rule reads: MemAvailable and MemFree must be in meminfo.

    FAIL without MemAvailable (a container-virtualised /proc such as lxcfs omits it): the
    guard would be blind — every memory rule needs it — and must not look quiet. With CMA
    (CmaTotal/CmaFree), OK with usable memory = MemAvailable − CmaFree, what the rules judge.
    """
    mi = read_meminfo(ctx.proc_root).fields
    where = f"{ctx.proc_root}/meminfo"
    out: list[Check] = []
    for name in ("MemAvailable", "MemFree"):
        if name not in mi:
            out.append(
                Check(
                    "FAIL",
                    name,
                    f"not in {where}: the rules that need it cannot evaluate (sparkd would be blind)",
                    "run sparkd on the host's own /proc (proc_root), not a container-virtualised one (e.g. lxcfs)",
                )
            )
    avail = mi.get("MemAvailable")
    if avail is not None and "CmaFree" in mi:
        cma = mi["CmaFree"]
        out.append(
            Check(
                "OK",
                "usable memory",
                f"{(avail - cma) / GiB:.2f} GiB = MemAvailable {avail / GiB:.2f} GiB - CmaFree {cma / GiB:.2f} GiB "
                "(free CMA is not usable by the driver; the rules judge usable)",
            )
        )
    elif avail is not None:
        out.append(Check("OK", "MemAvailable", f"{avail / GiB:.2f} GiB (no CMA: usable = MemAvailable)"))
    return out


#: Above this normal-mode interval a fall is seen late: CONTEXT.md's collapse went 7.1 → 5.7 GiB in 9 s.
SLOW_INTERVAL_S = 5.0


def check_sampling(ctx: DoctorContext) -> list[Check]:
    """``interval_s`` against how fast memory falls: WARN above ``SLOW_INTERVAL_S`` (fast sampling starts only once
    a sample shows something moving, so the first sample of a fall comes up to ``interval_s`` late; helper-48 saw a
    12 s stop at 40 s, with the headline calm meanwhile)."""
    if ctx.interval_s <= SLOW_INTERVAL_S:
        return [Check("OK", "Sampling", f"every {ctx.interval_s:g} s")]
    return [
        Check(
            "WARN",
            "Sampling",
            f"every {ctx.interval_s:g} s: a fall is first seen up to {ctx.interval_s:g} s late (a 7.1 → 5.7 GiB "
            "collapse took 9 s on a DGX Spark), and the dashboard's figures are that old meanwhile",
            "interval_s = 1 (about 0.2 % of a core, the default)",
        )
    ]


def check_shm(ctx: DoctorContext) -> list[Check]:
    """/dev/shm size, entries and bytes; names like vLLM/NCCL leftovers → WARN."""
    try:
        st = os.statvfs(ctx.shm_dir)
        names = sorted(os.listdir(ctx.shm_dir))
    except OSError as exc:
        return [Check("WARN", "/dev/shm", f"unreadable: {exc}")]
    size = st.f_blocks * st.f_frsize
    used = 0
    for n in names:
        try:
            used += os.lstat(ctx.shm_dir / n).st_size
        except OSError:
            continue
    suspects = [n for n in names if n.startswith(SHM_LEFTOVER_PREFIXES)]
    detail = f"size {fmt_gib(size)}, {len(names)} entries, {fmt_gib(used)}"
    if not suspects:
        return [Check("OK", "/dev/shm", detail)]
    shown = ", ".join(suspects[:3]) + (" …" if len(suspects) > 3 else "")
    return [
        Check(
            "WARN",
            "/dev/shm",
            f"{detail}; {len(suspects)} named like vLLM/NCCL segments ({shown})",
            "leftovers if no vLLM runs: sparkd removes only entries no live process maps or "
            "holds open; check by hand with `fuser -v /dev/shm/<name>`",
        )
    ]


def check_proc_visibility(ctx: DoctorContext) -> list[Check]:
    """PIDs whose /proc maps or fds sparkd cannot read (e.g. PID 1 in some sandboxes, ``hidepid``): any
    one of them makes every /dev/shm entry "cannot prove unused", so the cleanup after a stop removes
    nothing. PIDs listed in ``shm_ignore_unreadable_pids`` are reported but do not block."""
    from sparkd.act.shm import unreadable_pids

    try:
        found = unreadable_pids(ctx.proc_root)
    except OSError as exc:
        return [Check("FAIL", "/proc visibility", f"cannot list {ctx.proc_root}: {exc}")]
    ignored = set(ctx.shm_ignore_unreadable_pids)

    def show(items: list[tuple[int, str, str]]) -> str:
        text = ", ".join(f"pid {p} ({comm}): {why}" for p, comm, why in items[:5])
        return text + (f" and {len(items) - 5} more" if len(items) > 5 else "")

    blocking = [t for t in found if t[0] not in ignored]
    skipped = [t for t in found if t[0] in ignored]
    note = f"; ignored by shm_ignore_unreadable_pids: {show(skipped)}" if skipped else ""
    if not blocking:
        return [Check("OK", "/proc visibility", f"every process's maps and fds are readable{note}")]
    return [
        Check(
            "WARN",
            "/proc visibility",
            f"/proc unreadable for {show(blocking)}: /dev/shm cleanup cannot prove unused any entry and "
            f"keeps them all{note}",
            "run sparkd as root in the host's PID namespace (no hidepid); a PID known not to use /dev/shm "
            "(a sandbox's init) can be listed in shm_ignore_unreadable_pids",
        )
    ]


def nvidia_device_nodes(dev_root: Path) -> list[tuple[str, int, int]]:
    """NVIDIA character devices under ``dev_root``: (path relative to dev_root, major, minor).

    Looks at ``nvidia*`` and ``nvidia-caps/*``. ``os.stat`` follows links, so
    tests can point fixture names at any char device (e.g. /dev/null).
    """
    out = []
    candidates = sorted(dev_root.glob("nvidia*")) + sorted(dev_root.glob("nvidia-caps/*"))
    for p in candidates:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out.append((str(p.relative_to(dev_root)), os.major(st.st_rdev), os.minor(st.st_rdev)))
    return out


def check_dev_char_symlinks(ctx: DoctorContext) -> list[Check]:
    """daemon-reload GPU risk: NVIDIA nodes without ``/dev/char/<major>:<minor>`` links.

    runc re-applies device rules from /dev/char on ``systemctl daemon-reload``;
    nodes missing there lose access and the container prints ``Failed to
    initialize NVML: Unknown Error`` (NVIDIA/nvidia-docker#1730). FAIL when
    Docker uses the systemd cgroup driver (the documented trigger), else WARN.
    """
    nodes = nvidia_device_nodes(ctx.dev_root)
    if not nodes:
        return [Check("OK", "daemon-reload GPU risk", "no NVIDIA device nodes: not a GPU host")]
    char = ctx.dev_root / "char"
    missing = [n for n, ma, mi in nodes if not os.path.lexists(char / f"{ma}:{mi}")]
    if not missing:
        linked = f"{len(nodes)} NVIDIA nodes linked in /dev/char"
        return [Check("OK", "daemon-reload GPU risk", linked)]
    info = _docker_info(ctx) or {}
    systemd_driver = info.get("CgroupDriver") == "systemd"
    status: Status = "FAIL" if systemd_driver else "WARN"
    driver = "systemd cgroup driver" if systemd_driver else "cgroup driver " + str(info.get("CgroupDriver", "unknown"))
    return [
        Check(
            status,
            "daemon-reload GPU risk",
            f"{len(missing)}/{len(nodes)} NVIDIA nodes lack /dev/char links "
            f"({', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}); "
            f"{driver}: daemon-reload can cut running containers off the GPU",
            f"{DEV_CHAR_FIX} (and at boot, e.g. a udev rule); a container that lost its GPU must be recreated",
        )
    ]


def check_unit(ctx: DoctorContext) -> list[Check]:
    """sparkd.service active and enabled; systemd not PID 1 → WARN."""
    us = ctx.unit_status() if ctx.unit_status else probe_unit_status(ctx.run, ctx.run_root)
    if not us.systemd_pid1:
        action = "run `sparkd run` under another supervisor, or on a host booted with systemd"
        return [Check("WARN", "sparkd unit", "systemd is not running as PID 1 here", action)]
    if us.active == "active" and us.enabled == "enabled":
        return [Check("OK", "sparkd unit", "active, enabled")]
    action = "sparkd install, or systemctl enable --now sparkd; journalctl -u sparkd for errors"
    return [Check("WARN", "sparkd unit", f"{us.active or 'unknown'}, {us.enabled or 'unknown'}", action)]


def check_last_trip(ctx: DoctorContext) -> list[Check]:
    """The last emergency stop; one within 7 days → WARN with its reason."""
    trip = ctx.last_trip()
    if trip is None:
        return [Check("OK", "Last trip", "none recorded")]
    age_s = ctx.now() - trip.at_s
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(trip.at_s))
    if age_s > LAST_TRIP_RECENT_S:
        return [Check("OK", "Last trip", f"{when} ({age_s / 86400:.0f} d ago): {trip.reason}")]
    where = ctx.archives_dir or "sparkd's archives directory"
    action = f"read its postmortem archive in {where} (sparkd events --kind stopped names it) before relaunching"
    return [Check("WARN", "Last trip", f"{when} ({age_s / 3600:.1f} h ago): {trip.reason}", action)]


def check_database(ctx: DoctorContext) -> list[Check]:
    """The database sparkd records into: FAIL when it cannot be read (corrupt, locked, disk full),
    WARN for files others can read or corrupt files kept aside. The guard runs without it (from
    memory), but nothing is recorded until it is fixed."""
    db = ctx.db_file
    if db is None:
        return []
    out: list[Check] = []
    state_dir = db.parent
    try:
        st = os.statvfs(state_dir)
        free = st.f_bavail * st.f_frsize
        if free < STATE_DIR_FREE_MIN_BYTES:
            out.append(
                Check(
                    "FAIL",
                    "State dir space",
                    f"{fmt_gib(free)} free in {state_dir} (< {STATE_DIR_FREE_MIN_BYTES >> 20} MiB)",
                    "free space there: sparkd guards from memory but records nothing",
                )
            )
        mode = stat.S_IMODE(os.stat(state_dir).st_mode)
        if mode & 0o077:
            out.append(Check("WARN", "State dir mode", f"{state_dir} is {mode:04o}", f"chmod 700 {state_dir}"))
    except FileNotFoundError:
        return [Check("OK", "Database", f"no state directory {state_dir} yet (created by sparkd run)")]
    if not db.exists():
        return [*out, Check("OK", "Database", f"{db} not created yet")]
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2.0)
        try:
            res = con.execute("PRAGMA quick_check(1)").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error as e:
        res = str(e)
    if res != "ok":
        out.append(
            Check(
                "FAIL",
                "Database",
                f"{db} unusable: {res}",
                "sparkd moves a corrupt file aside (sparkd.db.corrupt-<time>) and starts a new one; "
                "check the disk, free space, or another process holding a lock",
            )
        )
    else:
        out.append(Check("OK", "Database", f"{db} readable"))
    aside = sorted(p.name for p in state_dir.glob(db.name + ".corrupt-*") if not p.name.endswith(("-wal", "-shm")))
    if aside:
        kept = ", ".join(aside[-3:])
        out.append(Check("WARN", "Corrupt databases kept", kept, f"inspect or remove them in {state_dir}"))
    return out


def check_rule_reach(ctx: DoctorContext) -> list[Check]:
    """WARN for a stop rule whose threshold this host can never reach (it looks armed and is not)."""
    if not ctx.rules:
        return []
    total = read_meminfo(ctx.proc_root).fields.get("MemTotal")
    if not total:
        return []
    from sparkd.core.conditions import never_fires, unread_fields

    out = []
    unread = unread_fields(ctx.kernlog_source)
    for r in ctx.rules:
        for why in never_fires(r.when, r.evidence, total, getattr(r, "floor", None), unread):
            out.append(Check("WARN", f"Rule {r.name}", why, "fix the threshold: this rule guards nothing"))
    floors, holding = _floor_checks(ctx, total)
    out += [c for c in floors if c.status != "OK"]
    notes = [c for c in floors if c.status == "OK"]
    if out:
        return out + notes
    # "clear of its MemAvailable now" only when no line already holds now: a warn rule below its line read "clear"
    # here while `sparkd status` said it already holds (helper-50); a note of a floor at the kernel's watermark is
    # no line that holds
    clear = " and clear of its MemAvailable now" if not holding else ""
    n = len(ctx.rules)
    summary = f"{n} rule{'' if n == 1 else 's'}, every threshold reachable on this host{clear}"
    return [Check("OK", "Rules", summary), *notes]


def _floor_checks(ctx: DoctorContext, total: int) -> tuple[list[Check], bool]:
    """The daemon's own floor check (``core.floors.check_floors``, its ``watermark`` warnings at start) with this
    host's MemAvailable now taken as the healthy one, as the daemon takes it at start: a rule that may loop or cannot
    protect this host is a WARN here too (doctor said "every threshold reachable" where the daemon warned, note 10);
    a finding the daemon notes without warning (``Status.watermark.notes``: a warn rule's line already below) is an
    OK line with its text. Also returns whether a rule's line already holds now (``always_holds``).
    A rule list that does not compile is left to the daemon's own refusal."""
    from sparkd.core.floors import check_floors, read_vm_tunables
    from sparkd.core.rules import compile_rules

    try:
        rules = compile_rules(ctx.rules, total)
    except Exception:
        return [], False
    fields = read_meminfo(ctx.proc_root).fields
    tunables = read_vm_tunables(ctx.proc_root)
    found = check_floors(
        rules,
        healthy_mem_available_bytes=fields.get("MemAvailable"),
        low_watermark_bytes=read_zoneinfo_low_watermark_bytes(ctx.proc_root),
        min_free_kbytes=tunables.get("min_free_kbytes"),
        watermark_scale_factor=tunables.get("watermark_scale_factor"),
        healthy_cma_free_bytes=fields.get("CmaFree"),
    )
    checks = [
        Check(
            "WARN" if w.severity == "warning" else "OK",
            f"Rule {w.rule}",
            f"{w.message} (MemAvailable now taken as healthy)",
            "see the rule's floor" if w.severity == "warning" else "",
        )
        for w in found
    ]
    return checks, any(w.problem == "always_holds" for w in found)


def format_report(checks: Sequence[Check]) -> str:
    """One line per check, ``OK   title — detail``, plus ``→ action`` under WARN/FAIL."""
    width = max((len(c.title) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4} {c.title:<{width}} — {c.detail}")
        if c.status != "OK" and c.action:
            lines.append(f"     {'':<{width}} → {c.action}")
    return "\n".join(lines)


def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check FAILs, else 0 (WARN does not fail ``sparkd doctor``)."""
    return 1 if any(c.status == "FAIL" for c in checks) else 0
